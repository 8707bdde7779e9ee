use super::*;

/// A real tokenizer shipped (gzipped) in tests/fixtures/tokenizers.
fn fixture_tokenizer(family: &str) -> TargetTokenizer {
    let (json, label) = test_fixtures::tokenizer_json(family);
    TargetTokenizer::from_bytes(&json, &label).unwrap()
}

/// Every seam delta equals the joint encoding's, for adversarial units (tabs, double spaces,
/// zero-width space, CJK, emoji, special-token look-alikes) on byte-level and SentencePiece files.
#[test]
fn seam_deltas_match_joint_encoding() {
    let units = [
        "Handbook",
        "\té policy 東京!",
        "\t[INST end|> \u{200b})",
        "  <|im😀",
        " < s > 😀x",
        "  policy é)",
        "\t[INST naïve end|> <<SYS>>x café 数据。",
        "\n\n数据 <<SYS>>x。",
        " The maximum hotel rate is 245 USD per night.",
        "\n\nSection 2. Records.",
        "\nLegal staff must file forms.",
        "\n\nQuestion: which?\nAnswer:",
    ];
    for family in [
        "gpt2",
        "smollm",
        "llama3-from-gguf",
        "llama2-tinyllama",
        "mistral-7b-v1",
        "bert-wordpiece",
    ] {
        let tok = fixture_tokenizer(family);
        let engine = LayoutEngine::new(&tok, units.iter().map(|s| (*s, false)).collect())
            .unwrap()
            .0;
        for a in &units {
            for b in &units[1..] {
                let (sa, sb) = (engine.seg(a), engine.seg(b));
                let j = engine.junction(sa, sb).unwrap();
                let joint = tok.encode_ids(&format!("{a}{b}"), false).unwrap().len() as i64;
                let expected = joint - engine.len(sa).unwrap() - engine.len(sb).unwrap();
                if tok.fast_unsound_reason.is_none() || j.provable {
                    assert_eq!(j.delta, expected, "{family}: {a:?} + {b:?}");
                }
            }
        }
    }
}

/// Seams verified in one batch are found by the next batch on the same tokenizer (the
/// per-tokenizer cache the benchmarks depend on), never by a batch on another tokenizer.
#[test]
fn seam_cache_is_per_tokenizer_and_outlives_a_batch() {
    let units = ["Handbook", " The rate is 245 USD.", "\n\nQuestion: which?"];
    let tok = fixture_tokenizer("gpt2");
    let key = {
        let engine = LayoutEngine::new(&tok, units.iter().map(|s| (*s, false)).collect())
            .unwrap()
            .0;
        let (a, b) = (engine.seg(units[0]), engine.seg(units[1]));
        let key = (
            engine.gid(a).unwrap().unwrap(),
            engine.gid(b).unwrap().unwrap(),
        );
        assert!(engine.seams.get(key).is_none());
        engine.junction(a, b).unwrap();
        key
    };
    let next = LayoutEngine::new(&tok, units.iter().map(|s| (*s, false)).collect())
        .unwrap()
        .0;
    assert!(next.seams.get(key).is_some());
    // Same texts, same ids, in a later batch.
    assert_eq!(next.gid(next.seg(units[0])).unwrap(), Some(key.0));
    assert!(Arc::ptr_eq(&next.seams, &tok.side_cache::<SeamCache>()));
    let other = fixture_tokenizer("gpt2");
    assert!(other.side_cache::<SeamCache>().get(key).is_none());
}

/// Inserting the spliced block into the spliced body gives, at every boundary whose new seams
/// merge nothing, exactly what splicing the whole sequence gives: ids, every token offset, text
/// and unit starts. Units with merging seams (Llama-3 ".\n\n", SmolLM digits) on both sides.
#[test]
fn block_insertion_equals_a_whole_splice() {
    let haystack = [
        " The travel desk books rail first.",
        "\n\nSection 2. Records.",
        " Invoices are due in 30 days.",
        "\nLegal staff must file forms.",
        " Rates: 245 USD, 180 USD.",
        " 東京 offices close at 18:00.",
        "\n\nSection 3. Travel.",
        " Meals are capped at 60 USD.",
    ];
    let prefix = "Company Operations Handbook (excerpt)";
    let suffix = "\n\nQuestion: which rate?\nAnswer:";
    let block_texts = [
        " Travel policy version 4 (2025)",
        " caps the hotel rate at 245 USD.",
    ];
    for family in ["gpt2", "smollm", "llama3-from-gguf", "bert-wordpiece"] {
        let tok = fixture_tokenizer(family);
        if tok.fast_unsound_reason.is_some() {
            continue;
        }
        let mut texts: Vec<(&str, bool)> = vec![(prefix, false), (suffix, false)];
        texts.extend(haystack.iter().chain(&block_texts).map(|t| (*t, true)));
        let engine = LayoutEngine::new(&tok, texts).unwrap().0;
        let body_seq: Vec<UnitIdx> = std::iter::once(prefix)
            .chain(haystack)
            .chain(std::iter::once(suffix))
            .map(|t| engine.seg(t))
            .collect();
        let block_seq: Vec<UnitIdx> = block_texts.iter().map(|t| engine.seg(t)).collect();
        for add_special in [false, true] {
            let tail = if add_special {
                tok.special_tail.len()
            } else {
                0
            };
            let seams = engine.provable_seams(&body_seq).unwrap().unwrap();
            let body = engine
                .spliced(&body_seq, &seams, add_special)
                .unwrap()
                .unwrap();
            let block_seams = engine.provable_seams(&block_seq).unwrap().unwrap();
            let block = engine
                .spliced(&block_seq, &block_seams, false)
                .unwrap()
                .unwrap();
            let mut tried = 0;
            for k in 0..body_seq.len() - 1 {
                let (l, r) = (body_seq[k], body_seq[k + 1]);
                let left = engine.junction(l, block_seq[0]).unwrap();
                let right = engine.junction(*block_seq.last().unwrap(), r).unwrap();
                if left.drop_a + left.drop_b + right.drop_a + right.drop_b > 0
                    || !left.provable
                    || !right.provable
                {
                    continue;
                }
                tried += 1;
                let fast = engine
                    .insert_block(&body, &block, (l, r), k, &seams[k], tail)
                    .unwrap();
                let mut seq = body_seq[..=k].to_vec();
                seq.extend(&block_seq);
                seq.extend(&body_seq[k + 1..]);
                let whole = engine
                    .measure(&seq, add_special, Verification::Fast)
                    .unwrap();
                assert_eq!(whole.used, Verification::Fast, "{family} {k}");
                assert_eq!(fast.ids, whole.ids, "{family} {k}");
                assert_eq!(fast.text, whole.text, "{family} {k}");
                assert_eq!(fast.unit_starts, whole.unit_starts, "{family} {k}");
                assert_eq!(fast.offsets.len(), whole.offsets.len(), "{family} {k}");
                for t in 0..whole.offsets.len() {
                    assert_eq!(
                        fast.offsets.get(t),
                        whole.offsets.get(t),
                        "{family} {k} {t}"
                    );
                }
                // And both are the tokenizer's own encoding of the text.
                assert_eq!(
                    fast.ids,
                    tok.encode_ids(&fast.text, add_special).unwrap(),
                    "{family} {k}"
                );
            }
            assert!(
                tried >= 3,
                "{family}: only {tried} boundaries take the block"
            );
        }
    }
}

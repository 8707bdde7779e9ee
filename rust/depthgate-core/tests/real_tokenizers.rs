//! Integration tests on the real tokenizer families shipped in tests/fixtures/tokenizers (gzipped,
//! see its NOTICE.md): every emitted layout must satisfy ids == encode(text), exact length, and spans
//! read from the final offsets.

mod common;

use depthgate_core::spec::Span;
use depthgate_core::spec::{PositionSpec, Verification};
use depthgate_core::{
    build_layouts, presend_check, presend_check_batch, PresendRow, SendContract, Status,
    TargetTokenizer,
};

mod batch;
use batch::*;

#[test]
fn every_family_meets_the_contract_in_full_mode() {
    for family in FAMILIES {
        let tok = tokenizer(family);
        let spec = batch(Verification::Full, vec![512, 1024, 4096]);
        let layouts = build_layouts(&tok, &spec).unwrap();
        assert_eq!(layouts.len(), 3 * 6);
        for l in &layouts {
            assert_eq!(
                l.status,
                Status::Ok,
                "{family} {} {}: {:?}",
                l.target_tokens,
                l.position,
                l.reason
            );
            assert_eq!(l.total_tokens, l.target_tokens, "{family}");
            let violations = l.reverify(&tok).unwrap();
            assert!(
                violations.is_empty(),
                "{family} {} {}: {violations:?}",
                l.target_tokens,
                l.position
            );
            let ev = l.spans.iter().find(|s| s.unit_id == "travel-v4").unwrap();
            // Evidence ids identical at every position of the case.
            let first = &layouts[0];
            let ev0 = first
                .spans
                .iter()
                .find(|s| s.unit_id == "travel-v4")
                .unwrap();
            assert_eq!(
                l.token_ids[ev.token_start..ev.token_end],
                first.token_ids[ev0.token_start..ev0.token_end]
            );
            let contract =
                SendContract::for_tokenizer(&tok, l.target_tokens, Some(8192), 12, "raw", "");
            let report = l.presend_check("raw", "", &contract);
            assert!(report.ok, "{family}: {:?}", report.violations);
        }
        // Depth 0 puts the evidence at the start of the region, depth 1 ends it at the region end.
        let at = |label: &str| {
            layouts
                .iter()
                .find(|l| l.position == label && l.target_tokens == 1024)
                .unwrap()
        };
        let d0 = at("0");
        assert_eq!(d0.actual_offset, Some(d0.region_start), "{family}");
        let d1 = at("1");
        let ev = d1.spans.iter().find(|s| s.unit_id == "travel-v4").unwrap();
        if *family == "gpt2" {
            assert_eq!(ev.token_end, d1.region_end, "{family}");
        } else {
            // Llama-3 merges ".\n\n" across the seam to the question: the block then snaps one
            // closing sentence earlier. The snap is recorded and small.
            assert!(
                ev.token_end <= d1.region_end && d1.region_end - ev.token_end <= 64,
                "{family}"
            );
        }
        for l in &layouts {
            assert!(
                l.snap_tokens.abs() <= 64,
                "{family} {} snap {}",
                l.position,
                l.snap_tokens
            );
        }
        assert_eq!(at("@300").requested_offset, Some(300));
    }
}

#[test]
fn fast_mode_equals_full_mode_where_sound() {
    for family in FAMILIES {
        let tok = tokenizer(family);
        let full = build_layouts(&tok, &batch(Verification::Full, vec![2048])).unwrap();
        let fast = build_layouts(&tok, &batch(Verification::Fast, vec![2048])).unwrap();
        for (a, b) in full.iter().zip(&fast) {
            assert_eq!(a.token_ids, b.token_ids, "{family} {}", a.position);
            assert_eq!(a.spans, b.spans, "{family} {}", a.position);
            assert_eq!(a.text, b.text);
        }
        assert!(
            fast.iter().all(|l| l.status == Status::Ok),
            "{family}: {:?}",
            fast.iter().map(|l| &l.reason).collect::<Vec<_>>()
        );
        let used_fast = fast
            .iter()
            .filter(|l| l.verification == Verification::Fast)
            .count();
        if tok.fast_unsound_reason.is_none() {
            assert!(used_fast > 0, "{family}: fast mode never applied");
        } else {
            assert_eq!(used_fast, 0, "{family}: fast mode used although unsound");
        }
    }
}

#[test]
fn refusals_name_their_reason() {
    let tok = tokenizer("gpt2");
    let mut spec = batch(Verification::Full, vec![40]);
    let layouts = build_layouts(&tok, &spec).unwrap();
    assert!(layouts
        .iter()
        .all(|l| l.reason_code.as_deref() == Some("length_below_fixed_parts")));
    spec.lengths = vec![1024];
    spec.window = Some(1000);
    let layouts = build_layouts(&tok, &spec).unwrap();
    assert!(layouts
        .iter()
        .all(|l| l.reason_code.as_deref() == Some("window_too_small")));
    spec.window = None;
    spec.positions = vec![PositionSpec {
        label: "@5000".into(),
        depth: None,
        offset: Some(5000),
        turn: None,
    }];
    let layouts = build_layouts(&tok, &spec).unwrap();
    assert_eq!(
        layouts[0].reason_code.as_deref(),
        Some("offset_outside_region")
    );
    spec.positions = vec![PositionSpec {
        label: "1.5".into(),
        depth: Some(1.5),
        offset: None,
        turn: None,
    }];
    assert!(build_layouts(&tok, &spec).is_err());
    let mut spec = batch(Verification::Full, vec![1024]);
    spec.cases[0].moving[0].text = " The code is <|endoftext|> 42.".into();
    let err = build_layouts(&tok, &spec).unwrap_err().to_string();
    assert!(err.contains("special-token"), "{err}");
}

#[test]
fn a_different_tokenizer_changes_the_layout_id() {
    let a = build_layouts(&tokenizer("gpt2"), &batch(Verification::Full, vec![512])).unwrap();
    let b = build_layouts(&tokenizer("smollm"), &batch(Verification::Full, vec![512])).unwrap();
    assert_ne!(a[0].layout_id, b[0].layout_id);
    let a2 = build_layouts(&tokenizer("gpt2"), &batch(Verification::Full, vec![512])).unwrap();
    assert_eq!(a[0].layout_id, a2[0].layout_id);
    assert_eq!(a[0].token_ids, a2[0].token_ids);
}

// ---- fast-verification soundness (issue #10, item 5) ---------------------------------------------

/// A fixture's tokenizer.json, edited: an adversarial variant built at test time.
fn variant(family: &str, edit: impl FnOnce(&mut serde_json::Value)) -> TargetTokenizer {
    let (json, label) = common::tokenizer_json(family);
    let mut value: serde_json::Value = serde_json::from_slice(&json).unwrap();
    edit(&mut value);
    TargetTokenizer::from_bytes(
        &serde_json::to_vec(&value).unwrap(),
        &format!("{label} (variant)"),
    )
    .unwrap()
}

/// The issue's tokenizer: GPT-2 whose pre-tokenizer is Sequence[Split(regex with a 20–60-char
/// lookahead), ByteLevel]. Letters are cut in pairs when a digit follows 20–60 characters later.
const LOOKAHEAD_REGEX: &str = r" ?\p{L}{1,2}(?=[^\d]{20,60}\d)|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

fn adversarial_variants() -> Vec<(&'static str, TargetTokenizer, &'static str)> {
    use serde_json::json;
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    vec![
        (
            "gpt2 + Split(lookahead)",
            variant("gpt2", |t| {
                t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": LOOKAHEAD_REGEX}, "behavior": "Isolated", "invert": false},
                    byte_level(false)]});
            }),
            "Split inside a Sequence regex",
        ),
        (
            "mistral, Metaspace(split=false) in a Sequence",
            variant("mistral-7b-v1", |t| {
                let meta = t["pre_tokenizer"].take();
                t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [meta]});
            }),
            "Metaspace(split=false) inside a Sequence",
        ),
        (
            "llama2 without its normalizer, Metaspace(split=false) in a Sequence",
            variant("llama2-tinyllama", |t| {
                t["normalizer"] = serde_json::Value::Null;
                t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}]});
            }),
            "Metaspace(split=false) inside a Sequence",
        ),
        (
            "gpt2 + Strip normalizer",
            variant("gpt2", |t| {
                t["normalizer"] = json!({"type": "Strip", "strip_left": true, "strip_right": true});
            }),
            "normalizer Strip is not character-local",
        ),
        (
            "llama3 with its pre-tokenizers in the other order",
            variant("llama3-from-gguf", |t| {
                t["pre_tokenizer"]["pretokenizers"]
                    .as_array_mut()
                    .unwrap()
                    .reverse();
            }),
            "pre-tokenizer sequence [ByteLevel, Split]",
        ),
        (
            "gpt2 truncating at 512",
            variant("gpt2", |t| {
                t["truncation"] = json!({"direction": "Right", "max_length": 512, "strategy": "LongestFirst", "stride": 0});
            }),
            "truncation",
        ),
        (
            "gpt2 + an added token with a space",
            variant("gpt2", |t| {
                t["added_tokens"].as_array_mut().unwrap().push(json!({
                    "id": 50257, "content": " hotel rate", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": false}));
            }),
            "contains whitespace",
        ),
    ]
}

#[test]
fn fixture_families_are_fast_sound_exactly_where_known() {
    for family in ["gpt2", "smollm", "llama3-from-gguf", "bert-wordpiece"] {
        assert_eq!(tokenizer(family).fast_unsound_reason, None, "{family}");
    }
    let llama2 = tokenizer("llama2-tinyllama").fast_unsound_reason.unwrap();
    assert!(llama2.contains("normalizer Prepend"), "{llama2}");
    let mistral = tokenizer("mistral-7b-v1").fast_unsound_reason.unwrap();
    assert!(mistral.contains("Metaspace(split=false)"), "{mistral}");
}

/// Every adversarial variant is refused for fast mode with a named reason, falls back to the full
/// re-encode, records why in the layout, and every emitted layout re-verifies from scratch.
#[test]
fn adversarial_variants_fall_back_to_full_with_the_reason() {
    for (name, tok, expected) in adversarial_variants() {
        let reason = tok
            .fast_unsound_reason
            .clone()
            .unwrap_or_else(|| panic!("{name}: trusted for fast mode"));
        assert!(reason.contains(expected), "{name}: {reason}");
        let layouts = build_layouts(&tok, &batch(Verification::Fast, vec![512, 1024])).unwrap();
        let mut ok = 0;
        for l in &layouts {
            // Refused layouts too: the mode they would have been verified in, and why not fast.
            assert_eq!(l.verification, Verification::Full, "{name}");
            let note = l.verification_note.as_deref().unwrap_or_default();
            assert!(note.contains(&reason), "{name}: {note}");
            if l.status != Status::Ok {
                continue;
            }
            ok += 1;
            let violations = l.reverify(&tok).unwrap();
            assert!(
                violations.is_empty(),
                "{name} {}: {violations:?}",
                l.position
            );
        }
        assert!(ok > 0, "{name}: no layout was built, nothing was checked");
    }
}

/// A modified tokenizer file is judged on what it is, not on a family name: the same GPT-2 file
/// with fewer merges (an "older release") stays fast and exact; with another pre-tokenizer it is
/// re-verified in full.
#[test]
fn a_modified_tokenizer_file_is_judged_by_its_content() {
    let fewer_merges = variant("gpt2", |t| {
        let merges = t["model"]["merges"].as_array_mut().unwrap();
        merges.retain(|m| {
            let m = m
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| m.to_string());
            !m.starts_with("Ġ ") && !m.starts_with("Ġt")
        });
    });
    assert_eq!(fewer_merges.fast_unsound_reason, None);
    assert_ne!(fewer_merges.digest, tokenizer("gpt2").digest);
    let layouts = build_layouts(&fewer_merges, &batch(Verification::Fast, vec![1024])).unwrap();
    assert!(layouts.iter().any(|l| l.verification == Verification::Fast));
    for l in layouts.iter().filter(|l| l.status == Status::Ok) {
        let violations = l.reverify(&fewer_merges).unwrap();
        assert!(violations.is_empty(), "{}: {violations:?}", l.position);
    }
}

// ---- pre-send checks wired to the system's own values (issue #10, item 6) ------------------------

/// A template that writes BOS into the text while `add_special_tokens` adds another: the
/// tokenizer's own BOS id makes the pre-send check fire; without it (the old contract) it never ran.
#[test]
fn doubled_bos_is_caught_with_the_tokenizers_bos() {
    let tok = tokenizer("llama2-tinyllama");
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tokenizer("gpt2").bos_id(), None);
    let layouts = build_layouts(&tok, &batch(Verification::Full, vec![512])).unwrap();
    let l = &layouts[0];
    assert_eq!(l.status, Status::Ok);
    // The builder itself refuses a frame that renders BOS on a tokenizer that adds one.
    let mut spec = batch(Verification::Full, vec![512]);
    spec.cases[0].prefix = format!("<s>{}", spec.cases[0].prefix);
    let refused = build_layouts(&tok, &spec).unwrap();
    assert!(refused
        .iter()
        .all(|l| l.reason_code.as_deref() == Some("doubled_bos")));
    // A pipeline bug after the build: the frame gains the rendered BOS, the ids are re-encoded with
    // add_special_tokens on.
    let text = format!("<s>{}", l.text);
    let ids = tok.encode_ids(&text, true).unwrap();
    assert_eq!(&ids[..2], &[1, 1]);
    let contract = SendContract::for_tokenizer(&tok, l.target_tokens, None, 12, "raw", "");
    let report = presend_check(&l.layout_id, &text, &ids, &l.spans, "raw", "", &contract);
    assert!(
        report.violations.iter().any(|v| v.code == "doubled_bos"),
        "{:?}",
        report.violations
    );
}

#[test]
fn pinned_date_is_compared() {
    let tok = tokenizer("gpt2");
    let l = &build_layouts(&tok, &batch(Verification::Full, vec![512])).unwrap()[0];
    let contract = SendContract::for_tokenizer(&tok, l.target_tokens, None, 12, "t", "2024-07-26");
    let same = presend_check(
        &l.layout_id,
        &l.text,
        &l.token_ids,
        &l.spans,
        "t",
        "2024-07-26",
        &contract,
    );
    assert!(same.ok, "{:?}", same.violations);
    let other = presend_check(
        &l.layout_id,
        &l.text,
        &l.token_ids,
        &l.spans,
        "t",
        "2025-01-01",
        &contract,
    );
    assert_eq!(
        other
            .violations
            .iter()
            .map(|v| v.code.as_str())
            .collect::<Vec<_>>(),
        ["pinned_date"]
    );
}

/// The batched pre-send check finds exactly what one call per layout finds, row by row: on clean
/// layouts (with non-ASCII units, so spans are counted in chars), a duplicated distractor, a wrong
/// length and spans outside the prompt or reversed.
#[test]
fn presend_batch_equals_one_call_per_layout() {
    let tok = tokenizer("llama3-from-gguf");
    let layouts = build_layouts(&tok, &batch(Verification::Fast, vec![512, 1024])).unwrap();
    let contract = SendContract::for_tokenizer(&tok, 0, Some(2048), 12, "raw", "");
    let mut cases: Vec<(String, Vec<u32>, Vec<Span>, usize)> = Vec::new();
    for l in &layouts {
        cases.push((
            l.text.clone(),
            l.token_ids.clone(),
            l.spans.clone(),
            l.target_tokens,
        ));
    }
    let l = &layouts[0];
    let sea = l.spans.iter().find(|s| s.unit_id == "d-sea").unwrap();
    let sea_text: String = l
        .text
        .chars()
        .skip(sea.char_start)
        .take(sea.char_end - sea.char_start)
        .collect();
    assert!(!sea_text.is_ascii());
    cases.push((
        format!("{}{sea_text}", l.text),
        l.token_ids.clone(),
        l.spans.clone(),
        512,
    ));
    cases.push((l.text.clone(), l.token_ids.clone(), l.spans.clone(), 600));
    let mut bad_spans = l.spans.clone();
    bad_spans[0].char_end = l.text.chars().count() + 1;
    bad_spans[1].char_start = bad_spans[1].char_end + 1;
    bad_spans[2].token_end = l.token_ids.len() + 1;
    cases.push((l.text.clone(), l.token_ids.clone(), bad_spans, 512));
    cases.push((String::new(), Vec::new(), Vec::new(), 512));
    let rows: Vec<PresendRow<'_>> = cases
        .iter()
        .map(|(text, ids, spans, target)| PresendRow {
            text,
            ids,
            spans,
            template_digest: "raw",
            pinned_date: "",
            target_tokens: *target,
        })
        .collect();
    let batched = presend_check_batch(&rows, &contract);
    assert_eq!(batched.len(), rows.len());
    for (i, ((text, ids, spans, target), found)) in cases.iter().zip(&batched).enumerate() {
        let one = SendContract {
            target_tokens: *target,
            ..contract.clone()
        };
        let single = presend_check("x", text, ids, spans, "raw", "", &one);
        assert_eq!(found, &single.violations, "row {i}");
        if i < layouts.len() {
            assert!(found.is_empty(), "row {i}: {found:?}");
        }
    }
    let codes = |i: usize| {
        batched[i]
            .iter()
            .map(|v| v.code.as_str())
            .collect::<Vec<_>>()
    };
    let n = layouts.len();
    assert!(
        codes(n).contains(&"duplicated_distractor"),
        "{:?}",
        codes(n)
    );
    assert_eq!(codes(n + 1), ["length_mismatch"]);
    let out_of_range = codes(n + 2)
        .iter()
        .filter(|c| **c == "span_out_of_range")
        .count();
    assert_eq!(out_of_range, 3, "{:?}", codes(n + 2));
    assert_eq!(codes(n + 3), ["length_mismatch", "evidence_missing"]);
}

//! Conversation layouts (issue 25) on the real tokenizer families of tests/fixtures/tokenizers: turn
//! separators as real templates render them (ChatML, Llama-3, Gemma, Mistral), the haystack spread
//! over the turns, ids == encode(text), exact length, spans and turn spans from the final offsets, and
//! single-slot layouts unchanged by the new fields.

mod common;

use depthgate_core::spec::{BatchSpec, PositionSpec, Verification};
use depthgate_core::{build_layouts, Layout, SendContract, Status, TargetTokenizer};

mod batch;
use batch::*;

/// Turn separators of a 5-turn conversation as ChatML, Llama-3, Gemma and Mistral templates render
/// them (end of turn, next role header, the fixed lead of layout/conversation.py).
fn separators(style: &str) -> Vec<String> {
    let lead = |k: usize| {
        if k % 2 == 0 {
            "Noted. The document continues."
        } else {
            "More of the document follows."
        }
    };
    (0..4)
        .map(|k| {
            let role = if k % 2 == 0 { "assistant" } else { "user" };
            let gemma_role = if k % 2 == 0 { "model" } else { "user" };
            match style {
                "chatml" => format!("<|im_end|>\n<|im_start|>{role}\n{}", lead(k)),
                "llama3" => format!(
                    "<|eot_id|><|start_header_id|>{role}<|end_header_id|>\n\n{}",
                    lead(k)
                ),
                "gemma" => format!("<end_of_turn>\n<start_of_turn>{gemma_role}\n{}", lead(k)),
                _ if k % 2 == 0 => format!(" [/INST] {}", lead(k)),
                _ => format!("</s>[INST] {}", lead(k)),
            }
        })
        .collect()
}

fn conversation(family: &str, style: &str, mode: Verification, lengths: Vec<usize>) -> BatchSpec {
    let mut spec = batch(mode, lengths);
    spec.add_special_tokens = family != "bert-wordpiece";
    spec.cases[0].turns = separators(style);
    spec.positions.extend((1..=5).map(|t| PositionSpec {
        label: format!("@turn:{t}"),
        depth: None,
        offset: None,
        turn: Some(t),
    }));
    spec
}

fn check_conversation(family: &str, style: &str, tok: &TargetTokenizer, l: &Layout) {
    let what = format!("{family} {style} {} {}", l.target_tokens, l.position);
    assert_eq!(l.status, Status::Ok, "{what}: {:?}", l.reason);
    assert_eq!(l.total_tokens, l.target_tokens, "{what}");
    let violations = l.reverify(tok).unwrap();
    assert!(violations.is_empty(), "{what}: {violations:?}");
    let contract = SendContract::for_tokenizer(tok, l.target_tokens, Some(8192), 12, "raw", "");
    assert!(l.presend_check("raw", "", &contract).ok, "{what}");
    // Five turns in order, tiling the region between the separators' tokens.
    assert_eq!(l.turn_spans.len(), 5, "{what}");
    assert_eq!(l.turn_spans[0].token_start, l.region_start, "{what}");
    assert_eq!(l.turn_spans[4].token_end, l.region_end, "{what}");
    let seps = separators(style);
    let chars: Vec<char> = l.text.chars().collect();
    for (t, span) in l.turn_spans.iter().enumerate() {
        assert_eq!(span.turn, t + 1);
        assert!(
            span.token_start < span.token_end,
            "{what}: turn {} is empty",
            t + 1
        );
        if t > 0 {
            let prev = &l.turn_spans[t - 1];
            // The separator sits between the two turns, in chars exactly and in tokens.
            let between: String = chars[prev.char_end..span.char_start].iter().collect();
            assert_eq!(between, seps[t - 1], "{what}");
            assert!(prev.token_end <= span.token_start, "{what}");
        }
    }
    // The evidence sits inside the turn the layout records, and @turn:K puts it in turn K.
    let ev = l.spans.iter().find(|s| s.unit_id == "travel-v4").unwrap();
    let turn = l.turn.expect("a conversation layout records its turn");
    let span = &l.turn_spans[turn - 1];
    assert!(
        span.token_start <= ev.token_start && ev.token_end <= span.token_end,
        "{what}: evidence {}..{} outside turn {turn} {}..{}",
        ev.token_start,
        ev.token_end,
        span.token_start,
        span.token_end
    );
    if let Some(k) = l.position.strip_prefix("@turn:") {
        assert_eq!(turn, k.parse::<usize>().unwrap(), "{what}");
    }
}

#[test]
fn conversations_are_exact_on_every_family_and_style() {
    for family in FAMILIES {
        let tok = tokenizer(family);
        for style in ["chatml", "llama3", "gemma", "mistral"] {
            let spec = conversation(family, style, Verification::Full, vec![1024, 3000]);
            let layouts = build_layouts(&tok, &spec).unwrap();
            assert_eq!(layouts.len(), 2 * 11);
            for l in &layouts {
                check_conversation(family, style, &tok, l);
            }
            // Depth is over the whole conversation: depth 0 starts in turn 1, depth 1 ends in turn 5.
            let at = |label: &str| layouts.iter().find(|l| l.position == label).unwrap();
            assert_eq!(at("0").turn, Some(1), "{family} {style}");
            assert_eq!(at("1").turn, Some(5), "{family} {style}");
        }
    }
}

#[test]
fn fast_conversations_equal_full_ones_where_sound() {
    for family in FAMILIES {
        let tok = tokenizer(family);
        let full = build_layouts(
            &tok,
            &conversation(family, "llama3", Verification::Full, vec![2048]),
        )
        .unwrap();
        let fast = build_layouts(
            &tok,
            &conversation(family, "llama3", Verification::Fast, vec![2048]),
        )
        .unwrap();
        for (a, b) in full.iter().zip(&fast) {
            check_conversation(family, "llama3", &tok, b);
            assert_eq!(a.token_ids, b.token_ids, "{family} {}", a.position);
            assert_eq!(a.turn_spans, b.turn_spans, "{family} {}", a.position);
            assert_eq!(a.layout_id, b.layout_id);
        }
    }
}

#[test]
fn separators_change_the_layout_id_and_single_slots_keep_theirs() {
    let tok = tokenizer("gpt2");
    let single = build_layouts(&tok, &batch(Verification::Full, vec![1024])).unwrap();
    let conv = build_layouts(
        &tok,
        &conversation("gpt2", "chatml", Verification::Full, vec![1024]),
    )
    .unwrap();
    let mut other = conversation("gpt2", "chatml", Verification::Full, vec![1024]);
    other.cases[0].turns[1] = other.cases[0].turns[1].replace("user", "human");
    let other = build_layouts(&tok, &other).unwrap();
    assert_ne!(single[0].layout_id, conv[0].layout_id);
    assert_ne!(conv[0].layout_id, other[0].layout_id);
    assert!(single
        .iter()
        .all(|l| l.turn.is_none() && l.turn_spans.is_empty()));
    // The single-slot JSON has no turn fields at all (stored layouts keep their bytes).
    let json = serde_json::to_string(&single[0]).unwrap();
    assert!(!json.contains("turn"), "{json}");
}

#[test]
fn turn_positions_are_refused_beyond_the_conversation() {
    let tok = tokenizer("gpt2");
    let mut spec = conversation("gpt2", "chatml", Verification::Full, vec![1024]);
    spec.positions = vec![PositionSpec {
        label: "@turn:6".into(),
        depth: None,
        offset: None,
        turn: Some(6),
    }];
    let err = build_layouts(&tok, &spec).unwrap_err().to_string();
    assert!(
        err.contains("positions[0].turn") && err.contains("turns 1..=5"),
        "{err}"
    );
    spec.positions[0].depth = Some(0.5);
    let err = build_layouts(&tok, &spec).unwrap_err().to_string();
    assert!(
        err.contains("exactly one of depth, offset or turn"),
        "{err}"
    );
}

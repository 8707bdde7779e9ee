//! The shared batch of the integration tests on real tokenizers (tests/real_tokenizers.rs and
//! tests/conversation.rs): the tokenizer of a fixture family, the families, filler, the distractor pool
//! and a batch spec of two cases.
#![allow(dead_code)] // each test file uses its own subset

use super::common;
use depthgate_core::spec::{
    AnchoredSpec, BatchSpec, CaseSpec, PositionSpec, UnitKind, UnitSpec, Verification,
};
use depthgate_core::TargetTokenizer;

pub fn tokenizer(family: &str) -> TargetTokenizer {
    let (json, label) = common::tokenizer_json(family);
    TargetTokenizer::from_bytes(&json, &label).unwrap()
}

pub const FAMILIES: &[&str] = &[
    "gpt2",
    "smollm",
    "llama2-tinyllama",
    "mistral-7b-v1",
    "llama3-from-gguf",
    "bert-wordpiece",
];

pub fn filler(n: usize) -> Vec<String> {
    let depts = [
        "Procurement",
        "Facilities",
        "Legal",
        "Warehouse",
        "Finance",
        "Security",
    ];
    let acts = [
        "should review",
        "must archive",
        "may update",
        "will confirm",
    ];
    let objs = [
        "equipment loan forms",
        "meeting room bookings",
        "badge access logs",
        "vendor contact lists",
    ];
    let times = [
        "before the monthly close",
        "every Friday",
        "when a request is approved",
        "during onboarding",
    ];
    (0..n)
        .map(|i| {
            if i % 9 == 0 {
                format!("\n\nSection {}. Operations notes.", i / 9 + 1)
            } else if i % 9 == 1 {
                format!(
                    "\n{} staff {} {} {}.",
                    depts[i % 6],
                    acts[i % 4],
                    objs[(i / 4) % 4],
                    times[(i / 16) % 4]
                )
            } else {
                format!(
                    " {} staff {} {} {}.",
                    depts[i % 6],
                    acts[(i / 6) % 4],
                    objs[i % 4],
                    times[(i / 3) % 4]
                )
            }
        })
        .collect()
}

pub fn pool() -> Vec<String> {
    let mut out = vec![
        " Noted.".to_string(),
        " Forms are online.".to_string(),
        " Ask the front desk.".to_string(),
    ];
    let words = [
        "Copies", "of", "this", "handbook", "may", "be", "out", "of", "date", "so", "check", "the",
        "intranet", "first",
    ];
    for n in 1..words.len() {
        out.push(format!(" {}.", words[..n].join(" ")));
    }
    for n in 1..12 {
        out.push(format!(
            " Staff {} review the {} checklist.",
            "should also".repeat(1 + n % 2),
            "weekly ".repeat(n).trim_end()
        ));
    }
    out
}

pub fn batch(verification: Verification, lengths: Vec<usize>) -> BatchSpec {
    BatchSpec {
        assembler_version: depthgate_core::ASSEMBLER_VERSION.into(),
        template_digest: "raw".into(),
        add_special_tokens: true,
        verification,
        window: None,
        max_output_tokens: 12,
        filler: filler(4000),
        pool: pool(),
        filler_digest: None,
        cases: vec![CaseSpec {
            case_id: "hotel-china".into(),
            case_digest: "d1".into(),
            prefix: "Company Operations Handbook (excerpt)".into(),
            suffix: "\n\nQuestion: What is the current maximum hotel rate in region China?\nAnswer: Under the current travel policy, the maximum hotel rate for business travel in region China is".into(),
            moving: vec![UnitSpec {
                id: "travel-v4".into(),
                text: " Travel policy version 4 (2025), which replaces version 3: the maximum hotel rate for business travel in region China is 245 USD per night.".into(),
                kind: UnitKind::Evidence,
            }],
            anchored: vec![
                AnchoredSpec { id: "travel-v3".into(), text: " Travel policy version 3 (2023): the maximum hotel rate for business travel in region China is 180 USD per night.".into(), kind: UnitKind::Evidence, depth: 0.375 },
                AnchoredSpec { id: "d-gulf".into(), text: " The maximum hotel rate for business travel in region Gulf States is 260 USD per night.".into(), kind: UnitKind::Distractor, depth: 0.1 },
                AnchoredSpec { id: "d-sea".into(), text: " The maximum hotel rate for business travel in region South-East Asia is 265 USD per night 東京 😀.".into(), kind: UnitKind::Distractor, depth: 0.8 },
            ],
            filler_offset: 3,
            turns: Vec::new(),
            asked: None,
        }],
        lengths,
        positions: [0.0, 0.25, 0.5, 0.75, 1.0]
            .iter()
            .map(|d| PositionSpec { label: d.to_string(), depth: Some(*d), offset: None, turn: None })
            .chain(std::iter::once(PositionSpec { label: "@300".into(), depth: None, offset: Some(300), turn: None }))
            .collect(),
    }
}

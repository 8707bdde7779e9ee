//! Pre-send checks (DESIGN §4, first list): cheap structural checks on a built layout right before
//! it is sent — no tokenizer call, so they run at memory speed on every layout, every time.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::digest::sha256_hex;
use crate::spec::{Span, UnitKind};
use crate::tokenizer::TargetTokenizer;
use crate::verify::Violation;

/// What the layout must satisfy for the system it is about to be sent to. Every value comes from
/// the system (its served config, its template, its tokenizer), never from the layout file: a check
/// that compares a layout's column with itself catches nothing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendContract {
    pub target_tokens: usize,
    /// The model window from the *served* config (vLLM `max_model_len`, llama.cpp `n_ctx`).
    pub window: Option<usize>,
    pub max_output_tokens: usize,
    /// Digest of the frame the system renders now (its chat template's source, or the raw frame's
    /// descriptor); must equal the layout's.
    pub template_digest: String,
    /// The date the system's template renders `strftime_now` with (ISO; "" for a raw frame); must
    /// equal the date the layout was rendered with. `None` only when the caller cannot know it.
    #[serde(default)]
    pub pinned_date: Option<String>,
    /// The id the target tokenizer's post-processor puts first ([`TargetTokenizer::bos_id`]); `None`
    /// when it adds none (then no BOS can be doubled by `add_special_tokens`).
    pub bos_id: Option<u32>,
}

impl SendContract {
    /// The contract of a system whose tokenizer is `tok`: the BOS id is the tokenizer's own.
    pub fn for_tokenizer(
        tok: &TargetTokenizer,
        target_tokens: usize,
        window: Option<usize>,
        max_output_tokens: usize,
        template_digest: impl Into<String>,
        pinned_date: impl Into<String>,
    ) -> Self {
        SendContract {
            target_tokens,
            window,
            max_output_tokens,
            template_digest: template_digest.into(),
            pinned_date: Some(pinned_date.into()),
            bos_id: tok.bos_id(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckReport {
    pub layout_id: String,
    pub ok: bool,
    pub violations: Vec<Violation>,
}

fn v(code: &str, detail: String) -> Violation {
    Violation {
        code: code.to_string(),
        detail,
    }
}

/// `layout_template_digest` and `layout_pinned_date` are what the layout was rendered with (its
/// `template_digest` and `pinned_date` columns).
#[allow(clippy::too_many_arguments)]
pub fn presend_check(
    layout_id: &str,
    text: &str,
    ids: &[u32],
    spans: &[Span],
    layout_template_digest: &str,
    layout_pinned_date: &str,
    contract: &SendContract,
) -> CheckReport {
    let row = PresendRow {
        text,
        ids,
        spans,
        template_digest: layout_template_digest,
        pinned_date: layout_pinned_date,
        target_tokens: contract.target_tokens,
    };
    let violations = check_row(&row, contract);
    CheckReport {
        layout_id: layout_id.to_string(),
        ok: violations.is_empty(),
        violations,
    }
}

/// One layout of [`presend_check_batch`], borrowed from the caller's columns.
pub struct PresendRow<'a> {
    pub text: &'a str,
    pub ids: &'a [u32],
    pub spans: &'a [Span],
    /// What the layout was rendered with (its `template_digest` and `pinned_date` columns).
    pub template_digest: &'a str,
    pub pinned_date: &'a str,
    /// The length contract of this layout (`target_tokens`); replaces `contract.target_tokens`.
    pub target_tokens: usize,
}

/// [`presend_check`] on many layouts bound for one system, in parallel: one call per batch instead
/// of one per layout (the per-layout boundary crossing and id copy were most of the cost of the
/// pre-send gate, docs/benchmarks.md). `contract.target_tokens` is ignored: each row has its own.
/// Returns each row's violations, in row order.
pub fn presend_check_batch(
    rows: &[PresendRow<'_>],
    contract: &SendContract,
) -> Vec<Vec<Violation>> {
    rows.par_iter()
        .with_min_len(16)
        .map(|row| check_row(row, contract))
        .collect()
}

fn check_row(row: &PresendRow<'_>, contract: &SendContract) -> Vec<Violation> {
    let PresendRow {
        text,
        ids,
        spans,
        template_digest: layout_template_digest,
        pinned_date: layout_pinned_date,
        target_tokens,
    } = *row;
    let mut out = Vec::new();
    if ids.len() != target_tokens {
        out.push(v(
            "length_mismatch",
            format!("{} tokens, the contract says {target_tokens}", ids.len()),
        ));
    }
    if let Some(window) = contract.window {
        if ids.len() + contract.max_output_tokens > window {
            out.push(v(
                "window_overflow",
                format!(
                    "{} prompt + {} output tokens exceed the served window {window}",
                    ids.len(),
                    contract.max_output_tokens
                ),
            ));
        }
    }
    if layout_template_digest != contract.template_digest {
        out.push(v(
            "template_digest",
            "layout was built with a different chat template than the system uses".into(),
        ));
    }
    if let Some(date) = contract.pinned_date.as_deref() {
        if layout_pinned_date != date {
            out.push(v(
                "pinned_date",
                format!(
                    "layout was rendered with the template date {layout_pinned_date:?}, the system renders {date:?}"
                ),
            ));
        }
    }
    if let Some(bos) = contract.bos_id {
        if ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
            out.push(v(
                "doubled_bos",
                "the prompt starts with two BOS tokens".into(),
            ));
        }
    }
    // Char → byte positions; an ASCII prompt (the common case) needs no table.
    let char_to_byte: Vec<usize> = if text.is_ascii() {
        Vec::new()
    } else {
        text.char_indices()
            .map(|(b, _)| b)
            .chain(std::iter::once(text.len()))
            .collect()
    };
    let byte_at = |c: usize| {
        if char_to_byte.is_empty() {
            (c <= text.len()).then_some(c)
        } else {
            char_to_byte.get(c).copied()
        }
    };
    let mut seen_evidence = false;
    for span in spans {
        let range = match (byte_at(span.char_start), byte_at(span.char_end)) {
            (Some(a), Some(b)) if a <= b => Some((a, b)),
            _ => None,
        };
        let Some((start, end)) =
            range.filter(|_| span.token_end <= ids.len() && span.token_start < span.token_end)
        else {
            out.push(v(
                "span_out_of_range",
                format!("span of {} lies outside the prompt", span.unit_id),
            ));
            continue;
        };
        let unit = &text[start..end];
        if sha256_hex(unit.as_bytes()) != span.sha256 {
            out.push(v(
                "evidence_missing",
                format!(
                    "{} is not at its recorded span (hash differs)",
                    span.unit_id
                ),
            ));
            continue;
        }
        let needle = unit.trim_start();
        // Non-overlapping occurrences, as `str::matches` counts them, with a SIMD searcher: the
        // two-way search of `matches` over a 4K prompt per span was most of a pre-send check.
        let occurrences = if needle.is_empty() {
            text.matches(needle).count()
        } else {
            memchr::memmem::find_iter(text.as_bytes(), needle.as_bytes()).count()
        };
        match span.kind {
            UnitKind::Evidence => {
                seen_evidence = true;
                if occurrences != 1 {
                    out.push(v(
                        "evidence_not_once",
                        format!("evidence {} occurs {occurrences} times", span.unit_id),
                    ));
                }
            }
            UnitKind::Distractor if occurrences != 1 => {
                out.push(v(
                    "duplicated_distractor",
                    format!("distractor {} occurs {occurrences} times", span.unit_id),
                ));
            }
            _ => {}
        }
    }
    if !seen_evidence {
        out.push(v(
            "evidence_missing",
            "the layout records no evidence span".into(),
        ));
    }
    out
}

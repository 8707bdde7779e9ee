//! Verification from scratch: re-encode a layout's text in full and check ids and spans against
//! the final encoding. This is the check `depthgate check` runs and the one the tests trust.

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::spec::Span;
use crate::tokenizer::TargetTokenizer;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Violation {
    /// Machine code: `ids_mismatch`, `length_mismatch`, `span_out_of_range`, `span_offsets`, `span_hash`.
    pub code: String,
    pub detail: String,
}

fn violation(code: &str, detail: String) -> Violation {
    Violation {
        code: code.to_string(),
        detail,
    }
}

/// Re-encode `text` and compare with `ids`; check every span against the offsets of that encoding.
pub fn verify_layout(
    tok: &TargetTokenizer,
    text: &str,
    ids: &[u32],
    add_special_tokens: bool,
    target_tokens: Option<usize>,
    spans: &[Span],
) -> Result<Vec<Violation>> {
    let mut out = Vec::new();
    let enc = tok.encode_piece(text, add_special_tokens)?;
    if enc.ids != ids {
        let first = enc
            .ids
            .iter()
            .zip(ids)
            .position(|(a, b)| a != b)
            .unwrap_or(enc.ids.len().min(ids.len()));
        out.push(violation(
            "ids_mismatch",
            format!(
                "stored ids ({} tokens) differ from encode(text) ({} tokens), first difference at token {first}",
                ids.len(),
                enc.ids.len()
            ),
        ));
    }
    if let Some(t) = target_tokens {
        if enc.ids.len() != t {
            out.push(violation(
                "length_mismatch",
                format!(
                    "encode(text) has {} tokens, the contract says {t}",
                    enc.ids.len()
                ),
            ));
        }
    }
    // char -> byte positions, once.
    let char_to_byte: Vec<usize> = text
        .char_indices()
        .map(|(b, _)| b)
        .chain(std::iter::once(text.len()))
        .collect();
    for span in spans {
        if span.char_end > char_to_byte.len() - 1
            || span.char_start > span.char_end
            || span.token_end > enc.ids.len()
        {
            out.push(violation(
                "span_out_of_range",
                format!("span of {} lies outside the prompt", span.unit_id),
            ));
            continue;
        }
        let (bs, be) = (char_to_byte[span.char_start], char_to_byte[span.char_end]);
        if crate::digest::sha256_hex(&text.as_bytes()[bs..be]) != span.sha256 {
            out.push(violation(
                "span_hash",
                format!(
                    "text at the span of {} does not hash to the recorded value",
                    span.unit_id
                ),
            ));
        }
        if span.token_start >= span.token_end {
            out.push(violation(
                "span_offsets",
                format!("empty token span for {}", span.unit_id),
            ));
            continue;
        }
        let first = enc.offsets[span.token_start];
        let last = enc.offsets[span.token_end - 1];
        let before_ok = span.token_start == 0
            || enc.offsets[span.token_start - 1].1 <= bs
            || enc.offsets[span.token_start - 1] == (0, 0);
        let after_ok = span.token_end == enc.offsets.len()
            || enc.offsets[span.token_end].0 >= be
            || enc.offsets[span.token_end] == (0, 0);
        if first.0 < bs || last.1 > be || !before_ok || !after_ok {
            out.push(violation(
                "span_offsets",
                format!(
                    "tokens {}..{} of {} do not map onto chars {}..{} in the final encoding",
                    span.token_start, span.token_end, span.unit_id, span.char_start, span.char_end
                ),
            ));
        }
    }
    Ok(out)
}

/// One stored layout to re-verify.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredLayout {
    pub layout_id: String,
    pub text: String,
    pub add_special_tokens: bool,
    pub target_tokens: Option<usize>,
    pub spans: Vec<Span>,
}

/// Re-verify many layouts in parallel; `ids[i]` belongs to `layouts[i]`.
pub fn verify_batch(
    tok: &TargetTokenizer,
    layouts: &[StoredLayout],
    ids: &[&[u32]],
) -> Result<Vec<Vec<Violation>>> {
    use rayon::prelude::*;
    layouts
        .par_iter()
        .zip(ids.par_iter())
        .map(|(l, ids)| {
            verify_layout(
                tok,
                &l.text,
                ids,
                l.add_special_tokens,
                l.target_tokens,
                &l.spans,
            )
        })
        .collect()
}

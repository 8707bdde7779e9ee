//! Is boundary-local ("fast") verification sound for a tokenizer? Sound *by construction*: only
//! configurations whose context window is known to be bounded are trusted, everything else gets the
//! full re-encode and the layout records why.
//!
//! Fast mode assembles a prompt from cached per-unit encodings and re-encodes only a bounded window
//! around each seam (`layout.rs`). That equals `encode(text)` only when every stage decides what
//! happens at a position from a few characters around it:
//!
//! * the normalizer works per character (no `Strip` of the whole text, no `Prepend`, no `Replace`);
//! * the pre-tokenizer splits at whitespace-bounded pre-tokens whose regex looks at most one character
//!   ahead. A `Split` is only as local as its regex: `Sequence[Split(regex with a 20–60-char
//!   lookahead), ByteLevel]` passed the old type allowlist and wrote layouts whose ids differed from
//!   `encode(text)` (issue #10). So pre-tokenizers are compared *structurally* (serialised by the
//!   `tokenizers` crate, `Sequence`s flattened, the offsets-only `trim_offsets` dropped) against the
//!   known pipelines of the fixture families: GPT-2 (`ByteLevel` with its built-in regex), SmolLM
//!   (`Digits` + `ByteLevel`), Llama-3 / cl100k (`Split` with exactly their regex + `ByteLevel`
//!   without regex) and BERT (`BertPreTokenizer`). Every `Sequence` member is inspected, so a
//!   `Metaspace(split=false)` nested in a `Sequence` is found and named;
//! * the model works inside pre-tokens, deterministically (no BPE dropout);
//! * `encode` is not truncated or padded (a tokenizer.json may configure both);
//! * no added token can reach across a seam (every seam is followed by whitespace: an added token
//!   containing whitespace could span it) or strips whitespace / matches single words around itself.

use serde_json::{json, Value};
use tokenizers::models::ModelWrapper;
use tokenizers::Tokenizer;

use crate::digest::sha256_hex;

/// The Llama-3 pre-tokenizer regex (tiktoken's cl100k_base pattern as the HF conversions write it),
/// byte for byte as in `tests/fixtures/tokenizers/llama3-from-gguf/tokenizer.json`.
pub const LLAMA3_CL100K_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Normalizers that map each character on its own (Unicode normalization forms are stable at the
/// ASCII-whitespace boundaries every seam window starts and ends at).
const CHAR_LOCAL_NORMALIZERS: &[&str] = &[
    "BertNormalizer",
    "Lowercase",
    "NFC",
    "NFD",
    "NFKC",
    "NFKD",
    "StripAccents",
];

/// The known bounded-context pre-tokenizer pipelines, flattened, in canonical form.
fn known_pipelines() -> Vec<(&'static str, Vec<Value>)> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": use_regex});
    vec![
        ("GPT-2", vec![byte_level(true)]),
        (
            "SmolLM",
            vec![
                json!({"type": "Digits", "individual_digits": true}),
                byte_level(true),
            ],
        ),
        (
            "Llama-3/cl100k",
            vec![
                json!({"type": "Split", "pattern": {"Regex": LLAMA3_CL100K_REGEX}, "behavior": "Isolated", "invert": false}),
                byte_level(false),
            ],
        ),
        ("BERT", vec![json!({"type": "BertPreTokenizer"})]),
    ]
}

/// `None` when seam-local verification is sound for this tokenizer, else the reason it is not.
pub fn fast_unsound_reason(tok: &Tokenizer) -> Option<String> {
    if tok.get_truncation().is_some() {
        return Some(
            "the tokenizer file configures truncation: encode(text) is cut, not the concatenation of its pieces"
                .into(),
        );
    }
    if tok.get_padding().is_some() {
        return Some(
            "the tokenizer file configures padding: encode(text) is padded, not the concatenation of its pieces"
                .into(),
        );
    }
    model_reason(tok.get_model())
        .or_else(|| normalizer_reason(tok))
        .or_else(|| pre_tokenizer_reason(tok))
        .or_else(|| added_token_reason(tok))
}

fn model_reason(model: &ModelWrapper) -> Option<String> {
    match model {
        ModelWrapper::BPE(bpe) => match bpe.dropout {
            Some(p) if p > 0.0 => Some(format!("BPE dropout {p} makes encoding random")),
            _ => None,
        },
        ModelWrapper::WordPiece(_) => None,
        ModelWrapper::WordLevel(_) => {
            Some("model WordLevel is not a known fast-mode configuration".into())
        }
        ModelWrapper::Unigram(_) => {
            Some("model Unigram is not a known fast-mode configuration".into())
        }
    }
}

fn type_of(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("?")
}

/// Members of a (possibly nested) `Sequence`, in order, each with whether it sat inside a Sequence.
fn flatten<'v>(v: &'v Value, list_key: &str, nested: bool, out: &mut Vec<(&'v Value, bool)>) {
    if type_of(v) == "Sequence" {
        for member in v
            .get(list_key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            flatten(member, list_key, true, out);
        }
    } else {
        out.push((v, nested));
    }
}

fn inside(nested: bool) -> &'static str {
    if nested {
        " inside a Sequence"
    } else {
        ""
    }
}

fn normalizer_reason(tok: &Tokenizer) -> Option<String> {
    let normalizer = tok.get_normalizer()?;
    let value = match serde_json::to_value(normalizer) {
        Ok(v) => v,
        Err(e) => return Some(format!("the normalizer cannot be inspected ({e})")),
    };
    let mut members = Vec::new();
    flatten(&value, "normalizers", false, &mut members);
    members.into_iter().find_map(|(m, nested)| {
        let t = type_of(m);
        (!CHAR_LOCAL_NORMALIZERS.contains(&t)).then(|| {
            format!(
                "normalizer {t}{} is not character-local (it can change text away from a seam)",
                inside(nested)
            )
        })
    })
}

/// Why one pre-tokenizer member is not known to have a bounded context, if it is not.
fn member_reason(m: &Value, nested: bool) -> Option<String> {
    let t = type_of(m);
    let at = inside(nested);
    match t {
        "ByteLevel" => (m.get("add_prefix_space") != Some(&Value::Bool(false))).then(|| {
            format!("ByteLevel{at} with add_prefix_space prepends a space to every split: not a known configuration")
        }),
        "Digits" => (m.get("individual_digits") != Some(&Value::Bool(true))).then(|| {
            format!("Digits{at} without individual_digits is not a known configuration")
        }),
        "BertPreTokenizer" => None,
        "Metaspace" if m.get("split") == Some(&Value::Bool(false)) => Some(format!(
            "Metaspace(split=false){at}: no pre-token boundaries, the model runs over the whole text"
        )),
        "Split" => {
            let regex = m.get("pattern").and_then(|p| p.get("Regex")).and_then(Value::as_str);
            match regex {
                Some(r) if r == LLAMA3_CL100K_REGEX => {
                    let isolated = m.get("behavior").and_then(Value::as_str) == Some("Isolated");
                    let inverted = m.get("invert") == Some(&Value::Bool(true));
                    (!isolated || inverted).then(|| {
                        format!("Split{at} with the Llama-3 regex but behavior {} / invert {inverted} is not a known configuration",
                            m.get("behavior").map(Value::to_string).unwrap_or_default())
                    })
                }
                Some(r) => Some(format!(
                    "Split{at} regex {:?} (sha256 {}) is not a known bounded-context pattern (only the GPT-2, Llama-3/cl100k and BERT pre-tokenizers are trusted)",
                    r.chars().take(48).collect::<String>(),
                    &sha256_hex(r.as_bytes())[..12]
                )),
                None => Some(format!(
                    "Split{at} on a literal pattern is not a known bounded-context configuration"
                )),
            }
        }
        _ => Some(format!(
            "pre-tokenizer {t}{at} is not a known bounded-context configuration"
        )),
    }
}

fn pre_tokenizer_reason(tok: &Tokenizer) -> Option<String> {
    let Some(pre) = tok.get_pre_tokenizer() else {
        return Some(
            "no pre-tokenizer: the model runs over the whole text, no split is provable".into(),
        );
    };
    let value = match serde_json::to_value(pre) {
        Ok(v) => v,
        Err(e) => return Some(format!("the pre-tokenizer cannot be inspected ({e})")),
    };
    let mut members = Vec::new();
    flatten(&value, "pretokenizers", false, &mut members);
    if let Some(why) = members
        .iter()
        .find_map(|&(m, nested)| member_reason(m, nested))
    {
        return Some(why);
    }
    // Known members, but are they one of the known pipelines (a Split after ByteLevel sees "Ġ" where
    // the text had spaces, and words run together)?
    let canonical: Vec<Value> = members
        .iter()
        .map(|&(m, _)| {
            let mut m = m.clone();
            if let Some(obj) = m.as_object_mut() {
                obj.remove("trim_offsets"); // offsets only; ids do not depend on it
            }
            m
        })
        .collect();
    if known_pipelines().iter().any(|(_, p)| *p == canonical) {
        return None;
    }
    Some(format!(
        "pre-tokenizer sequence [{}] is not a known bounded-context configuration (known: {})",
        members
            .iter()
            .map(|(m, _)| type_of(m))
            .collect::<Vec<_>>()
            .join(", "),
        known_pipelines()
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

fn added_token_reason(tok: &Tokenizer) -> Option<String> {
    let mut tokens: Vec<_> = tok.get_added_tokens_decoder().into_iter().collect();
    tokens.sort_by_key(|(id, _)| *id);
    tokens.into_iter().find_map(|(_, t)| {
        if t.lstrip || t.rstrip || t.single_word {
            Some(format!(
                "added token {:?} strips whitespace or matches single words: its match depends on text beyond a seam window",
                t.content
            ))
        } else if t.content.chars().any(char::is_whitespace) {
            Some(format!(
                "added token {:?} contains whitespace and can span a seam",
                t.content
            ))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_pre(pre: Value) -> Tokenizer {
        let json = json!({
            "version": "1.0",
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": pre,
            "post_processor": null,
            "decoder": null,
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
        });
        Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap()
    }

    #[test]
    fn known_pipelines_are_sound_and_variants_are_not() {
        let bl = |r: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": r});
        let llama3 = json!({"type": "Split", "pattern": {"Regex": LLAMA3_CL100K_REGEX}, "behavior": "Isolated", "invert": false});
        assert_eq!(pre_tokenizer_reason(&with_pre(bl(true))), None);
        assert_eq!(
            pre_tokenizer_reason(&with_pre(
                json!({"type": "Sequence", "pretokenizers": [llama3, bl(false)]})
            )),
            None
        );
        // Nested sequences are flattened.
        assert_eq!(
            pre_tokenizer_reason(&with_pre(
                json!({"type": "Sequence", "pretokenizers": [{"type": "Sequence", "pretokenizers": [bl(true)]}]})
            )),
            None
        );
        let reason = |pre: Value| pre_tokenizer_reason(&with_pre(pre)).unwrap();
        // Any other regex, however GPT-2-like.
        let other = json!({"type": "Split", "pattern": {"Regex": " ?\\p{L}{1,2}(?=[^\\d]{20,60}\\d)|\\s+"}, "behavior": "Isolated", "invert": false});
        assert!(
            reason(json!({"type": "Sequence", "pretokenizers": [other, bl(false)]}))
                .contains("Split inside a Sequence regex")
        );
        // Metaspace without split, hidden in a Sequence.
        let meta = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false});
        assert!(reason(json!({"type": "Sequence", "pretokenizers": [meta]}))
            .contains("Metaspace(split=false) inside a Sequence"));
        // Known members in an unknown order: ByteLevel's "Ġ" hides the spaces from the regex.
        assert!(
            reason(json!({"type": "Sequence", "pretokenizers": [bl(false), llama3]}))
                .contains("not a known bounded-context configuration")
        );
        // ByteLevel without its regex alone splits nothing.
        assert!(reason(bl(false)).contains("[ByteLevel]"));
        assert!(reason(json!({"type": "Whitespace"})).contains("Whitespace"));
    }
}

//! A loaded target tokenizer plus the facts the layout engine needs about it: its digest, the
//! special tokens a post-processor adds around a sequence, the special-token strings evidence must
//! never contain, and whether boundary-local ("fast") verification is provably sound for it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

use serde_json::Value;
use tokenizers::Tokenizer;

use crate::digest::sha256_hex;
use crate::error::{CoreError, Result};

/// One encoded piece: ids plus byte offsets into the piece's own text.
#[derive(Debug, Clone, Default)]
pub struct Piece {
    pub ids: Vec<u32>,
    pub offsets: Vec<(usize, usize)>,
}

pub struct TargetTokenizer {
    inner: Tokenizer,
    /// sha256 of the tokenizer.json bytes.
    pub digest: String,
    /// Ids a post-processor puts before / after a single sequence when `add_special_tokens` is on
    /// (e.g. `[BOS]` for Llama, `[CLS]`/`[SEP]` for BERT, nothing for GPT-2).
    pub special_head: Vec<u32>,
    pub special_tail: Vec<u32>,
    /// Contents of added tokens flagged special: evidence containing one is refused.
    pub special_strings: Vec<String>,
    special_first_chars: Vec<char>,
    /// `None` when junction-local verification is sound for this tokenizer, else why not.
    pub fast_unsound_reason: Option<String>,
    /// Segments (filler sentences, evidence, frames) encoded once per tokenizer and reused by every
    /// later batch: re-encoding the filler per batch was 60–93 % of a fast 128K batch
    /// (docs/benchmarks.md, "Where the time goes").
    segment_cache: RwLock<HashMap<String, Arc<Piece>>>,
    /// Verified seams between two segments, keyed by both texts (length-prefixed).
    seam_cache: RwLock<HashMap<String, Arc<crate::layout::Junction>>>,
}

/// Upper bound on cached segments (≈ 40 MB of ids and offsets at ~15 tokens a segment).
const SEGMENT_CACHE_LIMIT: usize = 200_000;

impl TargetTokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| CoreError::TokenizerLoad {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    pub fn from_bytes(bytes: &[u8], label: &str) -> Result<Self> {
        let load_err = |detail: String| CoreError::TokenizerLoad {
            path: label.to_string(),
            detail,
        };
        let inner = Tokenizer::from_bytes(bytes).map_err(|e| load_err(e.to_string()))?;
        let json: Value = serde_json::from_slice(bytes).map_err(|e| load_err(e.to_string()))?;
        let fast_unsound_reason = fast_soundness(&json);
        let special_strings = inner
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        let mut tok = TargetTokenizer {
            inner,
            digest: sha256_hex(bytes),
            special_head: Vec::new(),
            special_tail: Vec::new(),
            special_first_chars: Vec::new(),
            special_strings,
            fast_unsound_reason,
            segment_cache: RwLock::new(HashMap::new()),
            seam_cache: RwLock::new(HashMap::new()),
        };
        let mut firsts: Vec<char> = tok
            .special_strings
            .iter()
            .filter_map(|s| s.chars().next())
            .collect();
        firsts.sort_unstable();
        firsts.dedup();
        tok.special_first_chars = firsts;
        // Learn what the post-processor adds by encoding a probe with and without special tokens.
        let plain = tok.encode_piece("probe", false)?.ids;
        let with = tok.encode_piece("probe", true)?.ids;
        let at = with
            .windows(plain.len().max(1))
            .position(|w| w == plain.as_slice())
            .ok_or_else(|| {
                load_err("post-processor rewrites the sequence body; unsupported".into())
            })?;
        tok.special_head = with[..at].to_vec();
        tok.special_tail = with[at + plain.len()..].to_vec();
        Ok(tok)
    }

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Encode one piece; offsets are byte offsets into `text`.
    pub fn encode_piece(&self, text: &str, add_special_tokens: bool) -> Result<Piece> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| CoreError::Encode {
                what: format!("{} bytes of text", text.len()),
                detail: e.to_string(),
            })?;
        Ok(Piece {
            ids: enc.get_ids().to_vec(),
            offsets: enc.get_offsets().to_vec(),
        })
    }

    /// A segment's encoding (no special tokens), from the per-tokenizer cache when it was seen before.
    /// With `check`, a text seen for the first time is refused when it contains a special-token
    /// string (content units; frames may hold special tokens). Checking once per text per tokenizer
    /// instead of per batch: the per-batch scan of 30K filler units was 8 % of a fast batch.
    pub fn segment(&self, text: &str, check: bool) -> Result<Arc<Piece>> {
        if let Some(piece) = self
            .segment_cache
            .read()
            .expect("segment cache poisoned")
            .get(text)
        {
            return Ok(Arc::clone(piece));
        }
        if check {
            if let Some(special) = self.find_special_string(text) {
                return Err(CoreError::spec(
                    "filler",
                    format!(
                        "unit {:?} contains the special-token string {special:?}",
                        text.chars().take(40).collect::<String>()
                    ),
                    "remove or escape special-token strings from evidence, distractors and filler",
                ));
            }
        }
        let piece = Arc::new(self.encode_piece(text, false)?);
        let mut cache = self.segment_cache.write().expect("segment cache poisoned");
        if cache.len() < SEGMENT_CACHE_LIMIT {
            cache.insert(text.to_string(), Arc::clone(&piece));
        }
        Ok(piece)
    }

    pub(crate) fn cached_seam(&self, key: &str) -> Option<Arc<crate::layout::Junction>> {
        self.seam_cache
            .read()
            .expect("seam cache poisoned")
            .get(key)
            .cloned()
    }

    pub(crate) fn cache_seam(&self, key: String, seam: Arc<crate::layout::Junction>) {
        let mut cache = self.seam_cache.write().expect("seam cache poisoned");
        if cache.len() < SEGMENT_CACHE_LIMIT {
            cache.insert(key, seam);
        }
    }

    /// Ids only, for counting and verification.
    pub fn encode_ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.encode_piece(text, add_special_tokens)?.ids)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The first special-token string that occurs in `text`, if any. A text without any first
    /// character of a special token is cleared in one pass (Llama-3 has 256 special strings, all
    /// starting with '<'; scanning each one per filler unit was 7 % of a fast batch).
    pub fn find_special_string<'a>(&'a self, text: &str) -> Option<&'a str> {
        let ascii_only = self.special_first_chars.iter().all(char::is_ascii);
        let may_contain = if ascii_only {
            text.bytes()
                .any(|b| self.special_first_chars.contains(&(b as char)))
        } else {
            text.chars().any(|c| self.special_first_chars.contains(&c))
        };
        if !may_contain {
            return None;
        }
        self.special_strings
            .iter()
            .find(|s| text.contains(s.as_str()))
            .map(String::as_str)
    }
}

/// Junction-local verification is sound only when every stage of the pipeline is local: a
/// normalizer that works per character, a pre-tokenizer made of regex/character splits (a split
/// can be observed in a bounded window), and a model that works inside pre-tokens. SentencePiece
/// files serialised without a pre-tokenizer (Llama-2 "legacy") run BPE over the whole text: no
/// split is provable, so they always get the full re-encode.
fn fast_soundness(json: &Value) -> Option<String> {
    const LOCAL_NORMALIZERS: &[&str] = &[
        "NFC",
        "NFKC",
        "NFD",
        "NFKD",
        "Lowercase",
        "BertNormalizer",
        "Strip",
    ];
    const LOCAL_PRETOKENIZERS: &[&str] = &[
        "ByteLevel",
        "Split",
        "Digits",
        "Punctuation",
        "Whitespace",
        "WhitespaceSplit",
        "BertPreTokenizer",
        "Metaspace",
        "UnicodeScripts",
    ];
    fn types(v: &Value, key_list: &str) -> Vec<String> {
        match v.get("type").and_then(Value::as_str) {
            Some("Sequence") => v
                .get(key_list)
                .and_then(Value::as_array)
                .map(|a| a.iter().flat_map(|x| types(x, key_list)).collect())
                .unwrap_or_default(),
            Some(t) => vec![t.to_string()],
            None => Vec::new(),
        }
    }
    let normalizer = json.get("normalizer").unwrap_or(&Value::Null);
    if !normalizer.is_null() {
        for t in types(normalizer, "normalizers") {
            if !LOCAL_NORMALIZERS.contains(&t.as_str()) {
                return Some(format!("normalizer {t} is not character-local"));
            }
        }
    }
    let pre = json.get("pre_tokenizer").unwrap_or(&Value::Null);
    if pre.is_null() {
        return Some("no pre-tokenizer: BPE runs over the whole text, no split is provable".into());
    }
    for t in types(pre, "pretokenizers") {
        if !LOCAL_PRETOKENIZERS.contains(&t.as_str()) {
            return Some(format!("pre-tokenizer {t} is not split-local"));
        }
    }
    if pre.get("type").and_then(Value::as_str) == Some("Metaspace")
        && pre.get("split").and_then(Value::as_bool) == Some(false)
    {
        return Some("Metaspace without split: no pre-token boundaries".into());
    }
    None
}

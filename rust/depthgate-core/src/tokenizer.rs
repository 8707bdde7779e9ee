//! A loaded target tokenizer plus the facts the layout engine needs about it: its digest, the
//! special tokens a post-processor adds around a sequence, the special-token strings evidence must
//! never contain, and whether boundary-local ("fast") verification is provably sound for it
//! (`soundness.rs`).
//!
//! This module names no layout type: caches that the layout engine keeps per tokenizer (verified
//! seams) live in a type-keyed slot ([`TargetTokenizer::side_cache`]), so `layout` depends on
//! `tokenizer` and never the other way round.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

use ahash::AHashMap;
use tokenizers::Tokenizer;

use crate::digest::sha256_hex;
use crate::error::{CoreError, Result};
use crate::soundness::fast_unsound_reason;

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
    /// (docs/benchmarks.md, "Where the time goes"). Each cached text also gets a stable id (its
    /// insertion index), so caches of higher layers key a pair of texts by two integers instead of
    /// hashing both texts again (the seam cache: docs/benchmarks.md).
    segment_cache: RwLock<AHashMap<String, (SegmentId, Arc<Piece>)>>,
    /// Caches of higher layers kept per tokenizer (the layout engine's verified seams), one per
    /// type, created empty on first use and dropped with the tokenizer.
    side_caches: RwLock<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

/// Upper bound on cached segments (≈ 40 MB of ids and offsets at ~15 tokens a segment).
const SEGMENT_CACHE_LIMIT: usize = 200_000;

/// The id of a text in a tokenizer's segment cache: equal ids mean equal texts, for the lifetime of
/// the tokenizer (ids are never reused; texts past the cache limit get none).
pub type SegmentId = u32;

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
        let fast_unsound_reason = fast_unsound_reason(&inner);
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
            segment_cache: RwLock::new(AHashMap::new()),
            side_caches: RwLock::new(HashMap::new()),
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
        Ok(self.segment_entry(text, check)?.1)
    }

    /// [`Self::segment`] plus the text's [`SegmentId`] in this tokenizer's cache (`None` once the
    /// cache is full: the piece is then encoded but not kept).
    pub fn segment_entry(
        &self,
        text: &str,
        check: bool,
    ) -> Result<(Option<SegmentId>, Arc<Piece>)> {
        if let Some((id, piece)) = self
            .segment_cache
            .read()
            .expect("segment cache poisoned")
            .get(text)
        {
            return Ok((Some(*id), Arc::clone(piece)));
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
        // Another thread may have encoded the same text meanwhile: keep the first id.
        if let Some((id, piece)) = cache.get(text) {
            return Ok((Some(*id), Arc::clone(piece)));
        }
        if cache.len() < SEGMENT_CACHE_LIMIT {
            let id = cache.len() as SegmentId;
            cache.insert(text.to_string(), (id, Arc::clone(&piece)));
            return Ok((Some(id), piece));
        }
        Ok((None, piece))
    }

    /// This tokenizer's instance of the cache type `C`, created empty on first use. Whatever a cache
    /// holds was computed with this tokenizer, so it is shared by every batch built with it and
    /// dropped with it (the layout engine's seam cache: docs/benchmarks.md depends on it).
    pub fn side_cache<C: Any + Send + Sync + Default>(&self) -> Arc<C> {
        let key = TypeId::of::<C>();
        let found = self
            .side_caches
            .read()
            .expect("side caches poisoned")
            .get(&key)
            .cloned();
        let cache = match found {
            Some(cache) => cache,
            None => Arc::clone(
                self.side_caches
                    .write()
                    .expect("side caches poisoned")
                    .entry(key)
                    .or_insert_with(|| Arc::new(C::default())),
            ),
        };
        match cache.downcast::<C>() {
            Ok(cache) => cache,
            Err(_) => unreachable!("side caches are keyed by their type"),
        }
    }

    /// The id the post-processor puts first when `add_special_tokens` is on (BOS for Llama-2 and
    /// Mistral, `[CLS]` for BERT), if it adds any: the token a rendered prompt must not repeat.
    pub fn bos_id(&self) -> Option<u32> {
        self.special_head.first().copied()
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

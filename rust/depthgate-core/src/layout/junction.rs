//! Step 2: junctions. A pair of adjacent segments is encoded once in a bounded window around the
//! seam and cached per tokenizer, giving its exact token delta and, where the seam merges tokens,
//! the replacement ids.

use super::*;

/// Bytes of context kept on each side of a seam when a junction is checked. The pre-tokenizer
/// regexes of the supported families look at most one character ahead, so a whitespace-led token
/// start 8 bytes away from the seam is decided before the seam is seen.
pub(super) const JUNCTION_MARGIN: usize = 8;

/// Neutral left context for junction windows and reference evidence encodings: one letter, which
/// no family merges with a following space or newline (a "." would: Llama-3 has ".\n\n" tokens).
pub(super) const JUNCTION_ANCHOR: &str = "x";

#[derive(Clone)]
pub(super) struct Junction {
    /// Tokens of A (from its end) and of B (from its start) replaced by `ids`; 0/0 when exact.
    pub(super) drop_a: usize,
    pub(super) drop_b: usize,
    pub(super) ids: Vec<u32>,
    /// Byte offsets of `ids`, relative to the window start.
    pub(super) offsets: Vec<(usize, usize)>,
    /// Byte offset in A where the window starts.
    pub(super) window_start_in_a: usize,
    /// Token count change against plain concatenation.
    pub(super) delta: i64,
    /// False when the seam could not be verified inside a bounded window (fast mode falls back).
    pub(super) provable: bool,
}

/// Upper bound on seams cached per tokenizer (same order as the segment cache).
pub(super) const SEAM_CACHE_LIMIT: usize = 200_000;

/// Verified seams of one tokenizer, keyed by the [`SegmentId`]s of both texts in the tokenizer's
/// segment cache (equal ids, equal texts). A seam depends only on its two texts and the tokenizer, so
/// the cache lives with the tokenizer ([`TargetTokenizer::side_cache`]) and serves every later batch
/// (docs/benchmarks.md). Keying by ids, not by the two texts, saves an allocation and a hash of both
/// texts per look-up (that was 11 % of a fast 128K batch).
#[derive(Default)]
pub(super) struct SeamCache {
    pub(super) seams: RwLock<AHashMap<(SegmentId, SegmentId), Arc<Junction>>>,
}

impl SeamCache {
    pub(super) fn get(&self, key: (SegmentId, SegmentId)) -> Option<Arc<Junction>> {
        self.seams
            .read()
            .expect("seam cache poisoned")
            .get(&key)
            .cloned()
    }

    /// False when the cache is full (the seam is then kept by the batch only).
    pub(super) fn insert(&self, key: (SegmentId, SegmentId), seam: Arc<Junction>) -> bool {
        let mut seams = self.seams.write().expect("seam cache poisoned");
        if seams.len() < SEAM_CACHE_LIMIT {
            seams.insert(key, seam);
            return true;
        }
        false
    }
}

pub(super) fn is_ascii_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\t' | b'\r')
}

pub(super) fn back_over_ws(text: &str, mut pos: usize) -> usize {
    let bytes = text.as_bytes();
    while pos > 0 && is_ascii_ws(bytes[pos - 1]) {
        pos -= 1;
    }
    pos
}

/// Does token `k` of a piece start a whitespace-led pre-token? Either the token begins with the
/// whitespace itself, or (offset-trimming byte-level files) the whitespace right before it belongs
/// to no other token.
pub(super) fn ws_led_token(text: &str, offsets: &[(usize, usize)], k: usize) -> bool {
    let bytes = text.as_bytes();
    let pos = offsets[k].0;
    if k > 0 && offsets[k - 1].0 == pos {
        return false; // continuation of a multi-token character
    }
    pos == 0
        || (pos < bytes.len() && is_ascii_ws(bytes[pos]))
        || (is_ascii_ws(bytes[pos - 1]) && (k == 0 || offsets[k - 1].1 < pos))
}

/// The window around the seam of A and B: the token index `ka` of A and `kb` of B where it starts
/// and ends (whitespace-led token starts at least [`JUNCTION_MARGIN`] bytes from the seam), and its
/// byte edges in A's and B's text.
fn window_edges(a: (&str, &Piece), b: (&str, &Piece)) -> (usize, usize, usize, usize) {
    let ((sa_text, pa), (sb_text, pb)) = (a, b);
    // Left edge: the last whitespace-led token start of A at least MARGIN bytes before the seam.
    let a_len = sa_text.len();
    let mut ka = 0usize;
    for (k, &(start, _)) in pa.offsets.iter().enumerate().rev() {
        if start + JUNCTION_MARGIN <= a_len && ws_led_token(sa_text, &pa.offsets, k) {
            ka = k;
            break;
        }
    }
    // Right edge: the first whitespace-led token start of B at least MARGIN bytes after the seam.
    let mut kb = pb.ids.len();
    for (k, &(start, _)) in pb.offsets.iter().enumerate().skip(1) {
        if start >= JUNCTION_MARGIN && ws_led_token(sb_text, &pb.offsets, k) {
            kb = k;
            break;
        }
    }
    // Offset-trimming files (Llama-3, SmolLM, BERT) leave the whitespace before a word out of
    // every token; the window edges take that whitespace to the right-hand side, where the
    // pre-tokenizer puts it, so the window starts with whitespace and never ends with it.
    let a_start = if ka == 0 {
        0
    } else {
        back_over_ws(sa_text, pa.offsets[ka].0).max(pa.offsets[ka - 1].1)
    };
    let b_end = if kb == pb.ids.len() {
        sb_text.len()
    } else {
        back_over_ws(sb_text, pb.offsets[kb].0).max(pb.offsets[kb - 1].1)
    };
    (ka, kb, a_start, b_end)
}

impl LayoutEngine<'_, '_> {
    pub(super) fn junction(&self, a: UnitIdx, b: UnitIdx) -> Result<Arc<Junction>> {
        let consecutive = b == a + 1;
        if consecutive {
            if let Some(j) = self.segments[a as usize].next.get() {
                return Ok(Arc::clone(j));
            }
        }
        let j = self.junction_cached(a, b)?;
        if consecutive {
            let _ = self.segments[a as usize].next.set(Arc::clone(&j));
        }
        Ok(j)
    }

    pub(super) fn junction_cached(&self, a: UnitIdx, b: UnitIdx) -> Result<Arc<Junction>> {
        // A seam depends only on the two texts: it is cached per tokenizer, across batches.
        let key = match (self.gid(a)?, self.gid(b)?) {
            (Some(ga), Some(gb)) => Some((ga, gb)),
            _ => None,
        };
        if let Some(j) = key.and_then(|k| self.seams.get(k)) {
            return Ok(j);
        }
        if let Some(j) = self
            .junctions
            .read()
            .expect("junction cache poisoned")
            .get(&(a, b))
        {
            return Ok(Arc::clone(j));
        }
        let j = Arc::new(self.compute_junction(a, b)?);
        if !key.is_some_and(|k| self.seams.insert(k, Arc::clone(&j))) {
            self.junctions
                .write()
                .expect("junction cache poisoned")
                .insert((a, b), Arc::clone(&j));
        }
        Ok(j)
    }

    pub(super) fn compute_junction(&self, a: UnitIdx, b: UnitIdx) -> Result<Junction> {
        let (sa, sb) = (&self.segments[a as usize], &self.segments[b as usize]);
        let (pa, pb) = (self.piece(a)?, self.piece(b)?);
        let exact = |provable| Junction {
            drop_a: 0,
            drop_b: 0,
            ids: Vec::new(),
            offsets: Vec::new(),
            window_start_in_a: 0,
            delta: 0,
            provable,
        };
        if pa.ids.is_empty() || pb.ids.is_empty() {
            return Ok(exact(true));
        }
        let (ka, kb, a_start, b_end) = window_edges((sa.text, pa), (sb.text, pb));
        let a_len = sa.text.len();
        // A window that starts at a whitespace-led token gets a neutral left context ("x"), so
        // tokenizers that treat the start of a string specially (SentencePiece's dummy prefix)
        // see the window as they see it mid-prompt. The anchor's own tokens are dropped again.
        let anchor = if ka > 0 || is_ascii_ws(sa.text.as_bytes()[0]) {
            JUNCTION_ANCHOR
        } else {
            ""
        };
        let mut window = String::with_capacity(anchor.len() + a_len - a_start + b_end);
        window.push_str(anchor);
        window.push_str(&sa.text[a_start..]);
        window.push_str(&sb.text[..b_end]);
        let mut enc = self.tok.encode_piece(&window, false)?;
        if !anchor.is_empty() {
            let keep = enc
                .offsets
                .iter()
                .position(|&(_, e)| e > anchor.len())
                .unwrap_or(enc.ids.len());
            if enc
                .offsets
                .get(keep)
                .is_some_and(|&(s, _)| s < anchor.len())
            {
                // The anchor merged into the window's first token: no clean left edge. Estimate the
                // seam from the two whole units instead, and never trust it for fast assembly.
                let joint = self
                    .tok
                    .encode_ids(&format!("{}{}", sa.text, sb.text), false)?
                    .len() as i64;
                return Ok(Junction {
                    delta: joint - pa.ids.len() as i64 - pb.ids.len() as i64,
                    ..exact(false)
                });
            }
            enc.ids.drain(..keep);
            enc.offsets = enc
                .offsets
                .split_off(keep)
                .into_iter()
                .map(|(s, e)| (s - anchor.len(), e - anchor.len()))
                .collect();
        }
        let expected_len = (pa.ids.len() - ka) + kb;
        let same = enc.ids.len() == expected_len
            && enc.ids[..pa.ids.len() - ka] == pa.ids[ka..]
            && enc.ids[pa.ids.len() - ka..] == pb.ids[..kb];
        if same {
            return Ok(exact(true));
        }
        // The seam merges or re-splits tokens. The splice is trustworthy only if both window
        // edges are strictly inside the units (else a neighbouring seam is involved) and the
        // window re-synchronises with the units' own tokens at both edges.
        let edges_inside = ka > 0 && kb < pb.ids.len();
        let left_sync = enc.ids.first() == pa.ids.get(ka);
        let right_sync = enc.ids.last() == pb.ids.get(kb - 1);
        Ok(Junction {
            drop_a: pa.ids.len() - ka,
            drop_b: kb,
            delta: enc.ids.len() as i64 - expected_len as i64,
            ids: enc.ids,
            offsets: enc.offsets,
            window_start_in_a: a_start,
            provable: edges_inside && left_sync && right_sync,
        })
    }

    /// Exact token count of a sequence of segments (specials excluded), seams included.
    pub(super) fn count(&self, seq: &[UnitIdx]) -> Result<i64> {
        let mut total = 0i64;
        for (i, &s) in seq.iter().enumerate() {
            total += self.len(s)?;
            if i > 0 {
                total += self.junction(seq[i - 1], s)?.delta;
            }
        }
        Ok(total)
    }

    /// The seams of a sequence, in order; an error names the first one that is not provable.
    pub(super) fn provable_seams(
        &self,
        seq: &[UnitIdx],
    ) -> Result<std::result::Result<Vec<Arc<Junction>>, String>> {
        let mut seams = Vec::with_capacity(seq.len().saturating_sub(1));
        for i in 1..seq.len() {
            let j = self.junction(seq[i - 1], seq[i])?;
            if !j.provable {
                return Ok(Err(format!(
                    "seam {} could not be verified in a bounded window",
                    i
                )));
            }
            seams.push(j);
        }
        Ok(Ok(seams))
    }
}

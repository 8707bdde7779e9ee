//! The layout builder: for each case × length × position, the final prompt whose ids are exactly
//! `encode(text)` under the target tokenizer, of exactly the requested length, with the moving
//! evidence block at the requested token offset (snapped to a unit boundary).
//!
//! How (and why this way):
//! 1. Every distinct text (frame pieces, filler, pool, evidence, distractors) is encoded once, in
//!    parallel, and cached as a token segment. Re-tokenizing a 128K prompt per probe is what makes
//!    RULER-style builders run at 0.23 layouts/s (research/anchors_longctx.md §4.5).
//! 2. A pair of adjacent segments is a *junction*. `encode(A)+encode(B) != encode(A+B)` in general
//!    (tokenizers/README.md): the junction is encoded once in a bounded window around the seam and
//!    cached, giving its exact token delta and, where the seam merges tokens, the replacement ids.
//! 3. Per case × length, one haystack (filler with anchored units at fixed depths) is planned by
//!    arithmetic over segment lengths + junction deltas to the exact budget; gaps are closed with
//!    pool sentences of the right length. The haystack is the same at every position, so only the
//!    moving block changes place (a paired design; also what makes prefix caches comparable).
//! 4. Per position the block is inserted at the unit boundary nearest the requested offset.
//! 5. The final ids come from one full encode of the rendered text (`Verification::Full`) or, when
//!    the tokenizer's pre-tokenizer makes junction-local checks sound, from the verified segments
//!    (`Verification::Fast`). Spans are read from offsets of that final encoding, never guessed.
//!    In fast mode the haystack is spliced once per case × length (prefix, haystack, suffix) and
//!    each position inserts the spliced block into it where both new seams merge nothing: the same
//!    ids and offsets as splicing the whole prompt (tested), for two memcpys (ids and text) instead
//!    of a seam look-up per unit; the final offsets stay a few runs of the spliced pieces, read only
//!    around the spans and the region edges (docs/benchmarks.md).

use std::collections::HashMap;

use ahash::AHashMap;
use std::sync::{Arc, OnceLock, RwLock};

use rayon::prelude::*;

use crate::checks::{presend_check, CheckReport, PresendRow, SendContract};
use crate::digest::{sha256_fields, sha256_hex};
use crate::error::{CoreError, Result};
use crate::spec::{
    BatchSpec, CaseSpec, Layout, PositionSpec, Span, Status, UnitKind, Verification,
};
use crate::tokenizer::{Piece, SegmentId, TargetTokenizer};
use crate::verify::{verify_layout, Violation};

/// Bytes of context kept on each side of a seam when a junction is checked. The pre-tokenizer
/// regexes of the supported families look at most one character ahead, so a whitespace-led token
/// start 8 bytes away from the seam is decided before the seam is seen.
const JUNCTION_MARGIN: usize = 8;

/// Gap (in tokens) under which the haystack stops taking stream units and closes with pool units.
const CLOSE_FACTOR: usize = 2;

/// Re-plans of a haystack whose measured total missed the target.
const MAX_CORRECTIONS: usize = 6;

/// How many of the nearest unit boundaries are tried for the moving block.
const MAX_BOUNDARY_TRIES: usize = 8;

/// Neutral left context for junction windows and reference evidence encodings: one letter, which
/// no family merges with a following space or newline (a "." would: Llama-3 has ".\n\n" tokens).
const JUNCTION_ANCHOR: &str = "x";

type UnitIdx = u32;

struct Segment<'s> {
    /// Borrowed from the batch spec: interning 30K filler units must not copy them.
    text: &'s str,
    /// A content unit (checked for special-token strings when first encoded), not a frame.
    check: bool,
    /// Encoded on first use (a haystack uses a fraction of the filler it is offered), from the
    /// tokenizer's cross-batch segment cache when possible, with the text's id in that cache.
    entry: OnceLock<(Option<SegmentId>, Arc<Piece>)>,
    /// The seam to the next segment of the batch (the next unit of the filler stream): a planned
    /// haystack is mostly consecutive stream units, and every pass over it (plan, exact count,
    /// boundaries, splice) looks these seams up again.
    next: OnceLock<Arc<Junction>>,
}

#[derive(Clone)]
struct Junction {
    /// Tokens of A (from its end) and of B (from its start) replaced by `ids`; 0/0 when exact.
    drop_a: usize,
    drop_b: usize,
    ids: Vec<u32>,
    /// Byte offsets of `ids`, relative to the window start.
    offsets: Vec<(usize, usize)>,
    /// Byte offset in A where the window starts.
    window_start_in_a: usize,
    /// Token count change against plain concatenation.
    delta: i64,
    /// False when the seam could not be verified inside a bounded window (fast mode falls back).
    provable: bool,
}

/// Upper bound on seams cached per tokenizer (same order as the segment cache).
const SEAM_CACHE_LIMIT: usize = 200_000;

/// Verified seams of one tokenizer, keyed by the [`SegmentId`]s of both texts in the tokenizer's
/// segment cache (equal ids, equal texts). A seam depends only on its two texts and the tokenizer, so
/// the cache lives with the tokenizer ([`TargetTokenizer::side_cache`]) and serves every later batch
/// (docs/benchmarks.md). Keying by ids, not by the two texts, saves an allocation and a hash of both
/// texts per look-up (that was 11 % of a fast 128K batch).
#[derive(Default)]
struct SeamCache {
    seams: RwLock<AHashMap<(SegmentId, SegmentId), Arc<Junction>>>,
}

impl SeamCache {
    fn get(&self, key: (SegmentId, SegmentId)) -> Option<Arc<Junction>> {
        self.seams
            .read()
            .expect("seam cache poisoned")
            .get(&key)
            .cloned()
    }

    /// False when the cache is full (the seam is then kept by the batch only).
    fn insert(&self, key: (SegmentId, SegmentId), seam: Arc<Junction>) -> bool {
        let mut seams = self.seams.write().expect("seam cache poisoned");
        if seams.len() < SEAM_CACHE_LIMIT {
            seams.insert(key, seam);
            return true;
        }
        false
    }
}

/// In-context token counts of closing-pool sentences (after the neutral anchor), per tokenizer and
/// [`SegmentId`]: measuring the 400 pool sentences anew per batch was 28 % of a fast 128K batch.
#[derive(Default)]
struct PoolLenCache {
    lens: RwLock<AHashMap<SegmentId, i64>>,
}

/// Holds the tokenized segments of one batch and the junction cache.
pub struct LayoutEngine<'t, 's> {
    tok: &'t TargetTokenizer,
    segments: Vec<Segment<'s>>,
    index: AHashMap<&'s str, UnitIdx>,
    /// Seams of this batch that the tokenizer's cache could not take (a text without a
    /// [`SegmentId`], or the cache full).
    junctions: RwLock<AHashMap<(UnitIdx, UnitIdx), Arc<Junction>>>,
    /// The tokenizer's cross-batch seam cache.
    seams: Arc<SeamCache>,
}

struct Refusal {
    code: &'static str,
    message: String,
}

fn refuse(code: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

/// A planned unit in a sequence: which segment, and what it is.
#[derive(Clone)]
struct Placed {
    seg: UnitIdx,
    kind: UnitKind,
    id: String,
}

struct Haystack {
    units: Vec<Placed>,
    /// Seams of `[prefix, units…, suffix]`, in order (`units.len() + 1`).
    seams: Vec<Arc<Junction>>,
    /// Token offset, within the haystack, of each unit boundary (`units.len() + 1`).
    bounds: Vec<i64>,
    /// Token count of the haystack alone, junctions inside it included.
    tokens: i64,
    /// Token offset of the context region in the prompt (special tokens, prefix and its seam).
    region_start: i64,
    /// Fast mode on a sound tokenizer: the spliced prompt without the moving block, shared by every
    /// position (`None` when a seam of it cannot be spliced: each layout then takes the general path).
    body: Option<Spliced>,
    /// The moving block spliced on its own (its inner seams), inserted into `body` per position.
    block: Option<Spliced>,
}

/// A sequence of segments spliced from cached pieces and verified seams.
struct Spliced {
    ids: Vec<u32>,
    /// Byte offsets into `text` (special tokens: (0, 0)).
    offsets: Vec<(usize, usize)>,
    text: String,
    /// Byte start of each unit of the sequence in `text`.
    unit_starts: Vec<usize>,
    /// Token range of each unit's own tokens in `ids` (without the tokens its seams replace).
    own: Vec<(usize, usize)>,
}

/// A run of token offsets taken from a spliced piece, shifted by `shift` bytes, starting at token
/// `start` of the prompt.
struct Run<'a> {
    start: usize,
    offsets: &'a [(usize, usize)],
    shift: usize,
}

/// The byte offsets of a prompt's tokens: owned (a full encode, a whole splice) or, when a block is
/// inserted into a spliced body, the few runs they are made of. Only the offsets around the spans and
/// the region edges are ever read, so the 128K-entry vector is not materialised per layout (that copy
/// was most of what remained of a fast 128K layout, docs/benchmarks.md).
enum Offsets<'a> {
    Owned(Vec<(usize, usize)>),
    Runs(Vec<Run<'a>>, usize),
}

impl Offsets<'_> {
    fn len(&self) -> usize {
        match self {
            Offsets::Owned(v) => v.len(),
            Offsets::Runs(_, n) => *n,
        }
    }

    fn get(&self, i: usize) -> (usize, usize) {
        match self {
            Offsets::Owned(v) => v[i],
            Offsets::Runs(runs, _) => {
                let run = runs
                    .iter()
                    .rev()
                    .find(|r| r.start <= i && !r.offsets.is_empty())
                    .expect("token index inside the prompt");
                let (a, b) = run.offsets[i - run.start];
                (a + run.shift, b + run.shift)
            }
        }
    }

    /// First index in `lo..hi` where `pred` turns false (`pred` true then false over the range).
    fn partition_point(
        &self,
        lo: usize,
        hi: usize,
        pred: impl Fn((usize, usize)) -> bool,
    ) -> usize {
        match self {
            Offsets::Owned(v) => lo + v[lo..hi].partition_point(|&o| pred(o)),
            Offsets::Runs(..) => {
                let (mut lo, mut hi) = (lo, hi);
                while lo < hi {
                    let mid = lo + (hi - lo) / 2;
                    if pred(self.get(mid)) {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                lo
            }
        }
    }
}

struct Measured<'a> {
    ids: Vec<u32>,
    /// Byte offsets into the full text (special tokens: (0, 0)).
    offsets: Offsets<'a>,
    /// Byte start of each sequence unit in the text.
    unit_starts: Vec<usize>,
    text: String,
    note: Option<String>,
    used: Verification,
}

fn is_ascii_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\t' | b'\r')
}

fn back_over_ws(text: &str, mut pos: usize) -> usize {
    let bytes = text.as_bytes();
    while pos > 0 && is_ascii_ws(bytes[pos - 1]) {
        pos -= 1;
    }
    pos
}

/// Does token `k` of a piece start a whitespace-led pre-token? Either the token begins with the
/// whitespace itself, or (offset-trimming byte-level files) the whitespace right before it belongs
/// to no other token.
fn ws_led_token(text: &str, offsets: &[(usize, usize)], k: usize) -> bool {
    let bytes = text.as_bytes();
    let pos = offsets[k].0;
    if k > 0 && offsets[k - 1].0 == pos {
        return false; // continuation of a multi-token character
    }
    pos == 0
        || (pos < bytes.len() && is_ascii_ws(bytes[pos]))
        || (is_ascii_ws(bytes[pos - 1]) && (k == 0 || offsets[k - 1].1 < pos))
}

impl<'t, 's> LayoutEngine<'t, 's> {
    /// Intern every distinct text of the batch (encoding happens lazily, on first use). Returns the
    /// engine and each input's segment index, in input order. `check` marks content units, which
    /// must not contain special-token strings (frames may: templates write them).
    fn new(tok: &'t TargetTokenizer, texts: Vec<(&'s str, bool)>) -> Result<(Self, Vec<UnitIdx>)> {
        let mut index = AHashMap::with_capacity(texts.len());
        let mut segments = Vec::with_capacity(texts.len());
        let mut order = Vec::with_capacity(texts.len());
        for (text, check) in texts {
            let idx = *index.entry(text).or_insert_with(|| {
                segments.push(Segment {
                    text,
                    check,
                    entry: OnceLock::new(),
                    next: OnceLock::new(),
                });
                (segments.len() - 1) as UnitIdx
            });
            order.push(idx);
        }
        Ok((
            LayoutEngine {
                tok,
                segments,
                index,
                junctions: RwLock::new(AHashMap::new()),
                seams: tok.side_cache::<SeamCache>(),
            },
            order,
        ))
    }

    /// Append a stream of texts (the filler) as segments of their own, without interning them: a
    /// stream is addressed by position, and hashing 33K filler texts per batch only to find that
    /// they are distinct was 7 % of a fast 128K batch. Equal texts still share their seams through
    /// the tokenizer's cache (same [`SegmentId`]).
    fn add_stream(&mut self, texts: &'s [String], check: bool) -> Vec<UnitIdx> {
        let first = self.segments.len();
        self.segments.extend(texts.iter().map(|text| Segment {
            text,
            check,
            entry: OnceLock::new(),
            next: OnceLock::new(),
        }));
        (first..self.segments.len()).map(|i| i as UnitIdx).collect()
    }

    fn entry(&self, seg: UnitIdx) -> Result<&(Option<SegmentId>, Arc<Piece>)> {
        let slot = &self.segments[seg as usize];
        if let Some(entry) = slot.entry.get() {
            return Ok(entry);
        }
        let entry = self.tok.segment_entry(slot.text, slot.check)?;
        Ok(slot.entry.get_or_init(|| entry))
    }

    fn piece(&self, seg: UnitIdx) -> Result<&Piece> {
        Ok(&self.entry(seg)?.1)
    }

    /// The segment's id in the tokenizer's cache, if it has one.
    fn gid(&self, seg: UnitIdx) -> Result<Option<SegmentId>> {
        Ok(self.entry(seg)?.0)
    }

    fn seg(&self, text: &str) -> UnitIdx {
        self.index[text]
    }

    fn starts_with_space(&self, seg: UnitIdx) -> bool {
        self.segments[seg as usize].text.starts_with(' ')
    }

    fn len(&self, seg: UnitIdx) -> Result<i64> {
        Ok(self.piece(seg)?.ids.len() as i64)
    }

    fn junction(&self, a: UnitIdx, b: UnitIdx) -> Result<Arc<Junction>> {
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

    fn junction_cached(&self, a: UnitIdx, b: UnitIdx) -> Result<Arc<Junction>> {
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

    fn compute_junction(&self, a: UnitIdx, b: UnitIdx) -> Result<Junction> {
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
        // Left edge: the last whitespace-led token start of A at least MARGIN bytes before the seam.
        let a_len = sa.text.len();
        let mut ka = 0usize;
        for (k, &(start, _)) in pa.offsets.iter().enumerate().rev() {
            if start + JUNCTION_MARGIN <= a_len && ws_led_token(sa.text, &pa.offsets, k) {
                ka = k;
                break;
            }
        }
        // Right edge: the first whitespace-led token start of B at least MARGIN bytes after the seam.
        let mut kb = pb.ids.len();
        for (k, &(start, _)) in pb.offsets.iter().enumerate().skip(1) {
            if start >= JUNCTION_MARGIN && ws_led_token(sb.text, &pb.offsets, k) {
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
            back_over_ws(sa.text, pa.offsets[ka].0).max(pa.offsets[ka - 1].1)
        };
        let b_end = if kb == pb.ids.len() {
            sb.text.len()
        } else {
            back_over_ws(sb.text, pb.offsets[kb].0).max(pb.offsets[kb - 1].1)
        };
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
    fn count(&self, seq: &[UnitIdx]) -> Result<i64> {
        let mut total = 0i64;
        for (i, &s) in seq.iter().enumerate() {
            total += self.len(s)?;
            if i > 0 {
                total += self.junction(seq[i - 1], s)?.delta;
            }
        }
        Ok(total)
    }

    fn assemble_text(&self, seq: &[UnitIdx]) -> (String, Vec<usize>) {
        let cap = seq
            .iter()
            .map(|&s| self.segments[s as usize].text.len())
            .sum();
        let mut text = String::with_capacity(cap);
        let mut starts = Vec::with_capacity(seq.len());
        for &s in seq {
            starts.push(text.len());
            text.push_str(self.segments[s as usize].text);
        }
        (text, starts)
    }

    /// Final ids of a sequence, by one full encode or by verified segments.
    fn measure(
        &self,
        seq: &[UnitIdx],
        add_special: bool,
        mode: Verification,
    ) -> Result<Measured<'static>> {
        let (text, unit_starts) = self.assemble_text(seq);
        let mut note = None;
        if mode == Verification::Fast {
            match unsound_note(self.tok) {
                Some(why) => note = Some(why),
                None => match self.splice(seq, &unit_starts, add_special)? {
                    Ok((ids, offsets, _)) => {
                        return Ok(Measured {
                            ids,
                            offsets: Offsets::Owned(offsets),
                            unit_starts,
                            text,
                            note: None,
                            used: Verification::Fast,
                        })
                    }
                    Err(why) => note = Some(format!("{why}; full re-encode used")),
                },
            }
        }
        let piece = self.tok.encode_piece(&text, add_special)?;
        Ok(Measured {
            ids: piece.ids,
            offsets: Offsets::Owned(piece.offsets),
            unit_starts,
            text,
            note,
            used: Verification::Full,
        })
    }

    /// The seams of a sequence, in order; an error names the first one that is not provable.
    fn provable_seams(
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

    /// Concatenate cached segments, replacing merged seams by their verified window ids.
    #[allow(clippy::type_complexity)]
    fn splice(
        &self,
        seq: &[UnitIdx],
        unit_starts: &[usize],
        add_special: bool,
    ) -> Result<std::result::Result<SplicedIds, String>> {
        match self.provable_seams(seq)? {
            Ok(seams) => self.splice_with(seq, &seams, unit_starts, add_special),
            Err(why) => Ok(Err(why)),
        }
    }

    /// [`Self::splice`] with the seams given (`seams[i]` between `seq[i]` and `seq[i + 1]`, all
    /// provable). Also returns each unit's own token range.
    fn splice_with(
        &self,
        seq: &[UnitIdx],
        seams: &[Arc<Junction>],
        unit_starts: &[usize],
        add_special: bool,
    ) -> Result<std::result::Result<SplicedIds, String>> {
        let mut approx = 8;
        for &s in seq {
            approx += self.piece(s)?.ids.len();
        }
        let mut ids = Vec::with_capacity(approx);
        let mut offsets = Vec::with_capacity(approx);
        let mut own = Vec::with_capacity(seq.len());
        if add_special {
            ids.extend_from_slice(&self.tok.special_head);
            offsets.extend(std::iter::repeat_n((0, 0), self.tok.special_head.len()));
        }
        for (i, &s) in seq.iter().enumerate() {
            let piece = self.piece(s)?;
            let head_drop = if i > 0 { seams[i - 1].drop_b } else { 0 };
            let tail_drop = if i + 1 < seq.len() {
                seams[i].drop_a
            } else {
                0
            };
            if head_drop + tail_drop > piece.ids.len() {
                return Ok(Err(format!("seams around unit {i} overlap")));
            }
            let base = unit_starts[i];
            let end = piece.ids.len() - tail_drop;
            own.push((ids.len(), ids.len() + end - head_drop));
            ids.extend_from_slice(&piece.ids[head_drop..end]);
            offsets.extend(
                piece.offsets[head_drop..end]
                    .iter()
                    .map(|&(a, b)| (a + base, b + base)),
            );
            if i + 1 < seq.len() && (seams[i].drop_a > 0 || seams[i].drop_b > 0) {
                let j = &seams[i];
                let wbase = base + j.window_start_in_a;
                ids.extend_from_slice(&j.ids);
                offsets.extend(j.offsets.iter().map(|&(a, b)| (a + wbase, b + wbase)));
            }
        }
        if add_special {
            ids.extend_from_slice(&self.tok.special_tail);
            offsets.extend(std::iter::repeat_n((0, 0), self.tok.special_tail.len()));
        }
        Ok(Ok((ids, offsets, own)))
    }

    /// Splice a whole sequence with its seams (all provable) into a [`Spliced`], or `None` when a
    /// seam is not provable or two seams overlap inside a unit.
    fn spliced(
        &self,
        seq: &[UnitIdx],
        seams: &[Arc<Junction>],
        add_special: bool,
    ) -> Result<Option<Spliced>> {
        if seams.iter().any(|j| !j.provable) {
            return Ok(None);
        }
        let (text, unit_starts) = self.assemble_text(seq);
        Ok(self
            .splice_with(seq, seams, &unit_starts, add_special)?
            .ok()
            .map(|(ids, offsets, own)| Spliced {
                ids,
                offsets,
                text,
                unit_starts,
                own,
            }))
    }

    /// The prompt with the spliced `block` inserted into the spliced `body` at boundary `k` (between
    /// body units `k` and `k + 1`; unit 0 is the prefix). Equal, token for token and offset for
    /// offset, to splicing the whole sequence with the block in place ([`Self::measure`] in fast
    /// mode), provided both new seams (body unit `k` → block, block → body unit `k + 1`) are provable
    /// and merge nothing: then the two units keep all their own tokens, the tokens `closed` (the
    /// body's seam at `k`) had replaced come back, and everything else is copied. No seam is looked
    /// up and no offset vector is built: the cost is two memcpys of the prompt (ids and text).
    fn insert_block<'a>(
        &'a self,
        body: &'a Spliced,
        block: &'a Spliced,
        body_seq: (UnitIdx, UnitIdx),
        k: usize,
        closed: &Junction,
        tail: usize,
    ) -> Result<Measured<'a>> {
        let (left, right) = (self.piece(body_seq.0)?, self.piece(body_seq.1)?);
        let left_back = &left.ids[left.ids.len() - closed.drop_a..];
        let right_back = &right.ids[..closed.drop_b];
        let (own_end, own_start) = (body.own[k].1, body.own[k + 1].0);
        let n = own_end + left_back.len() + block.ids.len() + right_back.len() + body.ids.len()
            - own_start;
        let mut ids = Vec::with_capacity(n);
        ids.extend_from_slice(&body.ids[..own_end]);
        ids.extend_from_slice(left_back);
        ids.extend_from_slice(&block.ids);
        ids.extend_from_slice(right_back);
        ids.extend_from_slice(&body.ids[own_start..]);
        let at = body.unit_starts[k + 1];
        let shift = block.text.len();
        let mut text = String::with_capacity(body.text.len() + shift);
        text.push_str(&body.text[..at]);
        text.push_str(&block.text);
        text.push_str(&body.text[at..]);
        let mut unit_starts = Vec::with_capacity(body.unit_starts.len() + block.unit_starts.len());
        unit_starts.extend_from_slice(&body.unit_starts[..=k]);
        unit_starts.extend(block.unit_starts.iter().map(|s| s + at));
        unit_starts.extend(body.unit_starts[k + 1..].iter().map(|s| s + shift));
        let body_tail = body.ids.len() - tail;
        let mut runs = Vec::with_capacity(6);
        let mut push = |offsets: &'a [(usize, usize)], shift: usize, start: &mut usize| {
            runs.push(Run {
                start: *start,
                offsets,
                shift,
            });
            *start += offsets.len();
        };
        let mut start = 0;
        push(&body.offsets[..own_end], 0, &mut start);
        push(
            &left.offsets[left.ids.len() - closed.drop_a..],
            body.unit_starts[k],
            &mut start,
        );
        push(&block.offsets, at, &mut start);
        push(&right.offsets[..closed.drop_b], at + shift, &mut start);
        push(&body.offsets[own_start..body_tail], shift, &mut start);
        // Special tokens after the prompt keep their (0, 0).
        push(&body.offsets[body_tail..], 0, &mut start);
        debug_assert_eq!(start, n);
        Ok(Measured {
            ids,
            offsets: Offsets::Runs(runs, n),
            unit_starts,
            text,
            note: None,
            used: Verification::Fast,
        })
    }
}

/// Ids, byte offsets and each unit's own token range of a splice.
type SplicedIds = (Vec<u32>, Vec<(usize, usize)>, Vec<(usize, usize)>);

/// The note a layout carries when fast mode was asked for a tokenizer it is not sound for.
fn unsound_note(tok: &TargetTokenizer) -> Option<String> {
    tok.fast_unsound_reason.as_ref().map(|why| {
        format!("fast verification unsound for this tokenizer ({why}); full re-encode used")
    })
}

/// Which pool units (by segment) have which token count, for closing gaps exactly.
struct Pool {
    by_len: Vec<(i64, Vec<UnitIdx>)>,
}

impl Pool {
    /// Buckets pool units by their *in-context* token count (after a neutral "x."), which is what
    /// they add mid-prompt; for SentencePiece files that is one less than their standalone count.
    fn new(engine: &LayoutEngine<'_, '_>, pool: &[String]) -> Result<Self> {
        let mut map: HashMap<i64, Vec<UnitIdx>> = HashMap::new();
        let anchor_len = engine.tok.encode_ids(JUNCTION_ANCHOR, false)?.len() as i64;
        let cache = engine.tok.side_cache::<PoolLenCache>();
        for text in pool {
            let seg = engine.seg(text);
            let gid = engine.gid(seg)?;
            let cached = gid.and_then(|g| {
                cache
                    .lens
                    .read()
                    .expect("pool cache poisoned")
                    .get(&g)
                    .copied()
            });
            let in_context = match cached {
                Some(len) => len,
                None => {
                    let len = engine
                        .tok
                        .encode_ids(&format!("{JUNCTION_ANCHOR}{text}"), false)?
                        .len() as i64
                        - anchor_len;
                    if let Some(g) = gid {
                        cache
                            .lens
                            .write()
                            .expect("pool cache poisoned")
                            .insert(g, len);
                    }
                    len
                }
            };
            let entry = map.entry(in_context).or_default();
            if !entry.contains(&seg) {
                entry.push(seg);
            }
        }
        let mut by_len: Vec<(i64, Vec<UnitIdx>)> =
            map.into_iter().filter(|(l, _)| *l > 0).collect();
        by_len.sort_by_key(|(l, _)| *l);
        Ok(Pool { by_len })
    }

    fn max_len(&self) -> i64 {
        self.by_len.last().map(|(l, _)| *l).unwrap_or(0)
    }

    fn pick(&self, len: i64, salt: usize) -> Option<UnitIdx> {
        let units = &self.by_len.iter().find(|(l, _)| *l == len)?.1;
        Some(units[salt % units.len()])
    }

    /// One to three pool units whose lengths sum to `gap` (seams assumed exact; the caller
    /// re-measures and retries).
    fn close(&self, gap: i64, salt: usize) -> Option<Vec<UnitIdx>> {
        if gap == 0 {
            return Some(Vec::new());
        }
        if let Some(u) = self.pick(gap, salt) {
            return Some(vec![u]);
        }
        let lens: Vec<i64> = self.by_len.iter().map(|(l, _)| *l).collect();
        for (i, &l1) in lens.iter().enumerate().rev() {
            if l1 < gap {
                if let Some(u2) = self.pick(gap - l1, salt + i) {
                    return Some(vec![self.pick(l1, salt)?, u2]);
                }
            }
        }
        for &l1 in lens.iter().rev() {
            for &l2 in lens.iter().rev() {
                if l1 + l2 < gap {
                    if let Some(u3) = self.pick(gap - l1 - l2, salt + 1) {
                        return Some(vec![self.pick(l1, salt)?, self.pick(l2, salt + 2)?, u3]);
                    }
                }
            }
        }
        None
    }
}

/// The digest a layout id carries for its filler stream and distractor pool: sha256 over the filler
/// units, then the pool units (`digest::sha256_fields`). `BatchSpec::filler_digest` is this value,
/// computed once per build by the caller.
pub fn filler_digest(filler: &[String], pool: &[String]) -> String {
    sha256_fields(
        &filler
            .iter()
            .chain(pool)
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
}

impl Layout {
    /// This layout as a [`PresendRow`], rendered with `template_digest` and `pinned_date`.
    pub fn presend_row<'a>(
        &'a self,
        template_digest: &'a str,
        pinned_date: &'a str,
    ) -> PresendRow<'a> {
        PresendRow {
            text: &self.text,
            ids: &self.token_ids,
            spans: &self.spans,
            template_digest,
            pinned_date,
            target_tokens: self.target_tokens,
        }
    }

    /// [`verify_layout`] of this layout as it was built: its special-token flag, its target length.
    pub fn reverify(&self, tok: &TargetTokenizer) -> Result<Vec<Violation>> {
        verify_layout(
            tok,
            &self.text,
            &self.token_ids,
            self.add_special_tokens,
            Some(self.target_tokens),
            &self.spans,
        )
    }

    /// [`presend_check`] of this layout, rendered with `template_digest` and `pinned_date`.
    pub fn presend_check(
        &self,
        template_digest: &str,
        pinned_date: &str,
        contract: &SendContract,
    ) -> CheckReport {
        presend_check(
            &self.layout_id,
            &self.text,
            &self.token_ids,
            &self.spans,
            template_digest,
            pinned_date,
            contract,
        )
    }
}

struct CaseContext<'a> {
    case: &'a CaseSpec,
    prefix: UnitIdx,
    suffix: UnitIdx,
    moving: Vec<Placed>,
    anchored: Vec<(f64, Placed)>,
    /// Canonical ids of each moving/anchored unit in a neutral left context ("x." + unit).
    canonical: HashMap<String, Vec<u32>>,
}

/// Build every layout of a batch. Refusals are layouts with `status = refused` and a reason; only
/// a malformed spec or a tokenizer failure is an error.
pub fn build_layouts(tok: &TargetTokenizer, spec: &BatchSpec) -> Result<Vec<Layout>> {
    validate_spec(tok, spec)?;
    let mut texts: Vec<(&str, bool)> = Vec::with_capacity(spec.pool.len() + 4 * spec.cases.len());
    texts.extend(spec.pool.iter().map(|t| (t.as_str(), true)));
    for case in &spec.cases {
        texts.push((&case.prefix, false));
        texts.push((&case.suffix, false));
        texts.extend(case.moving.iter().map(|u| (u.text.as_str(), true)));
        texts.extend(case.anchored.iter().map(|u| (u.text.as_str(), true)));
    }
    let (mut engine, _) = LayoutEngine::new(tok, texts)?;
    let filler = engine.add_stream(&spec.filler, true);
    let pool = Pool::new(&engine, &spec.pool)?;
    // The front passes the filler digest it computed once per build; hashing 2.6 MB of filler per
    // batch was 4 % of a fast 128K batch.
    let filler_digest = match &spec.filler_digest {
        Some(d) => d.clone(),
        None => filler_digest(&spec.filler, &spec.pool),
    };

    let contexts: Vec<CaseContext<'_>> = spec
        .cases
        .iter()
        .map(|case| case_context(&engine, case))
        .collect::<Result<_>>()?;

    let jobs: Vec<(usize, usize)> = (0..contexts.len())
        .flat_map(|c| spec.lengths.iter().map(move |&l| (c, l)))
        .collect();
    let per_job: Vec<Result<Vec<Layout>>> = jobs
        .par_iter()
        .map(|&(c, length)| {
            build_case_length(
                &engine,
                &pool,
                &filler,
                &filler_digest,
                spec,
                &contexts[c],
                length,
            )
        })
        .collect();
    let mut out = Vec::with_capacity(jobs.len() * spec.positions.len());
    for layouts in per_job {
        out.extend(layouts?);
    }
    Ok(out)
}

fn validate_spec(tok: &TargetTokenizer, spec: &BatchSpec) -> Result<()> {
    for (i, p) in spec.positions.iter().enumerate() {
        match (p.depth, p.offset) {
            (Some(d), None) if (0.0..=1.0).contains(&d) => {}
            (Some(d), None) => {
                return Err(CoreError::spec(
                    format!("positions[{i}].depth"),
                    format!("depth {d} is outside [0, 1]"),
                    "use a depth between 0 (start of the context) and 1 (end), or an absolute offset '@N'",
                ))
            }
            (None, Some(_)) => {}
            _ => {
                return Err(CoreError::spec(
                    format!("positions[{i}]"),
                    "a position needs exactly one of depth or offset",
                    "give a depth such as 0.5 or an offset such as @1200",
                ))
            }
        }
    }
    if spec.filler.is_empty() || spec.pool.is_empty() {
        return Err(CoreError::spec(
            "filler",
            "filler stream and closing pool must not be empty",
            "pass filler units",
        ));
    }
    for (field, text) in spec
        .filler
        .iter()
        .map(|t| ("filler", t))
        .chain(spec.pool.iter().map(|t| ("pool", t)))
        .chain(spec.cases.iter().flat_map(|c| {
            c.moving
                .iter()
                .map(|u| ("moving", &u.text))
                .chain(c.anchored.iter().map(|u| ("anchored", &u.text)))
        }))
    {
        let bytes = text.as_bytes();
        if bytes.is_empty() || !is_ascii_ws(bytes[0]) || is_ascii_ws(bytes[bytes.len() - 1]) {
            return Err(CoreError::spec(
                field,
                format!("unit {:?} must start with one whitespace separator and end with non-whitespace", preview(text)),
                "start the unit with ' ' (or '\\n\\n' for a heading) and strip trailing whitespace",
            ));
        }
        // Filler and pool are checked once per text per tokenizer, when first encoded.
        let content = matches!(field, "moving" | "anchored");
        if let Some(special) = content.then(|| tok.find_special_string(text)).flatten() {
            return Err(CoreError::spec(
                field,
                format!(
                    "unit {:?} contains the special-token string {special:?}",
                    preview(text)
                ),
                "remove or escape special-token strings from evidence, distractors and filler",
            ));
        }
    }
    for (i, case) in spec.cases.iter().enumerate() {
        if case.moving.is_empty() {
            return Err(CoreError::spec(
                format!("cases[{i}].moving"),
                format!("case {} has no moving evidence", case.case_id),
                "give each case at least one evidence unit to place",
            ));
        }
        for a in &case.anchored {
            if !(0.0..=1.0).contains(&a.depth) {
                return Err(CoreError::spec(
                    format!("cases[{i}].anchored"),
                    format!(
                        "anchored unit {} has depth {} outside [0, 1]",
                        a.id, a.depth
                    ),
                    "use a depth between 0 and 1",
                ));
            }
        }
    }
    Ok(())
}

fn preview(text: &str) -> String {
    text.chars().take(40).collect()
}

fn case_context<'a>(engine: &LayoutEngine<'_, '_>, case: &'a CaseSpec) -> Result<CaseContext<'a>> {
    let placed = |id: &str, text: &str, kind| Placed {
        seg: engine.seg(text),
        kind,
        id: id.to_string(),
    };
    let moving: Vec<Placed> = case
        .moving
        .iter()
        .map(|u| placed(&u.id, &u.text, u.kind))
        .collect();
    let mut anchored: Vec<(f64, Placed)> = case
        .anchored
        .iter()
        .map(|u| (u.depth, placed(&u.id, &u.text, u.kind)))
        .collect();
    anchored.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut canonical = HashMap::new();
    for (id, text) in case
        .moving
        .iter()
        .map(|u| (&u.id, &u.text))
        .chain(case.anchored.iter().map(|u| (&u.id, &u.text)))
    {
        let anchor = JUNCTION_ANCHOR;
        let piece = engine.tok.encode_piece(&format!("{anchor}{text}"), false)?;
        let ids = piece
            .ids
            .iter()
            .zip(&piece.offsets)
            .filter(|(_, off)| off.1 > anchor.len())
            .map(|(id, _)| *id)
            .collect();
        canonical.insert(id.clone(), ids);
    }
    Ok(CaseContext {
        case,
        prefix: engine.seg(&case.prefix),
        suffix: engine.seg(&case.suffix),
        moving,
        anchored,
        canonical,
    })
}

#[allow(clippy::too_many_arguments)]
fn refused_layout(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    layout_id: String,
    length: usize,
    position: &PositionSpec,
    r: Refusal,
) -> Layout {
    Layout {
        layout_id,
        case_id: ctx.case.case_id.clone(),
        target_tokens: length,
        position: position.label.clone(),
        status: Status::Refused,
        reason_code: Some(r.code.to_string()),
        reason: Some(r.message),
        total_tokens: 0,
        token_ids: Vec::new(),
        text: String::new(),
        add_special_tokens: spec.add_special_tokens,
        spans: Vec::new(),
        requested_offset: None,
        actual_offset: None,
        snap_tokens: 0,
        region_start: 0,
        region_end: 0,
        // A refusal records the mode the layout would have been verified in, and why not fast.
        verification: match (spec.verification, &engine.tok.fast_unsound_reason) {
            (Verification::Fast, Some(_)) => Verification::Full,
            (mode, _) => mode,
        },
        verification_note: match spec.verification {
            Verification::Fast => unsound_note(engine.tok),
            Verification::Full => None,
        },
    }
}

fn layout_id(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    filler_digest: &str,
    case: &CaseSpec,
    length: usize,
    position: &str,
) -> String {
    sha256_fields(&[
        &engine.tok.digest,
        &spec.template_digest,
        &spec.assembler_version,
        &case.case_digest,
        // The rendered frame itself: a preamble or instruction change that leaves the template
        // untouched still changes every layout id.
        &case.prefix,
        &case.suffix,
        filler_digest,
        &length.to_string(),
        position,
        if spec.add_special_tokens {
            "special"
        } else {
            "plain"
        },
    ])[..32]
        .to_string()
}

fn build_case_length(
    engine: &LayoutEngine<'_, '_>,
    pool: &Pool,
    filler: &[UnitIdx],
    filler_digest: &str,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    length: usize,
) -> Result<Vec<Layout>> {
    let ids: Vec<String> = spec
        .positions
        .iter()
        .map(|p| layout_id(engine, spec, filler_digest, ctx.case, length, &p.label))
        .collect();
    let refuse_all = |r: Refusal| -> Vec<Layout> {
        spec.positions
            .iter()
            .zip(&ids)
            .map(|(p, id)| {
                refused_layout(
                    engine,
                    spec,
                    ctx,
                    id.clone(),
                    length,
                    p,
                    refuse(r.code, r.message.clone()),
                )
            })
            .collect()
    };
    if let Some(window) = spec.window {
        if length + spec.max_output_tokens > window {
            return Ok(refuse_all(refuse(
                "window_too_small",
                format!(
                    "{length} prompt tokens + {} output tokens exceed the model window of {window}",
                    spec.max_output_tokens
                ),
            )));
        }
    }
    let haystack = match plan_haystack(engine, pool, filler, spec, ctx, length)? {
        Ok(units) => prepare_haystack(engine, spec, ctx, units)?,
        Err(r) => return Ok(refuse_all(r)),
    };
    // Positions share the haystack and the caches; each places and verifies on its own core.
    spec.positions
        .par_iter()
        .zip(ids)
        .map(|(position, id)| {
            Ok(
                match place(engine, spec, ctx, &haystack, length, position, id.clone())? {
                    Ok(layout) => layout,
                    Err(r) => refused_layout(engine, spec, ctx, id, length, position, r),
                },
            )
        })
        .collect()
}

fn specials(engine: &LayoutEngine<'_, '_>, spec: &BatchSpec) -> (i64, i64) {
    if spec.add_special_tokens {
        (
            engine.tok.special_head.len() as i64,
            engine.tok.special_tail.len() as i64,
        )
    } else {
        (0, 0)
    }
}

/// Plan the haystack (everything in the context region except the moving block) of one case at
/// one length, to the exact token budget. Returns its units.
fn plan_haystack(
    engine: &LayoutEngine<'_, '_>,
    pool: &Pool,
    filler: &[UnitIdx],
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    length: usize,
) -> Result<std::result::Result<Vec<Placed>, Refusal>> {
    let (head, tail) = specials(engine, spec);
    let block: Vec<UnitIdx> = ctx.moving.iter().map(|p| p.seg).collect();
    let block_tokens = engine.count(&block)?;
    let fixed = head + tail + engine.len(ctx.prefix)? + engine.len(ctx.suffix)? + block_tokens;
    let budget = length as i64 - fixed;
    let anchored_tokens: i64 = ctx
        .anchored
        .iter()
        .map(|(_, p)| engine.len(p.seg))
        .sum::<Result<i64>>()?;
    if budget < anchored_tokens {
        return Ok(Err(refuse(
            "length_below_fixed_parts",
            format!(
                "the fixed parts take {} tokens (frame {}, special {}, moving evidence {block_tokens}, anchored units {anchored_tokens}) but only {length} were requested; use a length of at least {}",
                fixed + anchored_tokens,
                engine.len(ctx.prefix)? + engine.len(ctx.suffix)?,
                head + tail,
                fixed + anchored_tokens
            ),
        )));
    }
    let close_zone = CLOSE_FACTOR as i64 * pool.max_len();
    let salt = ctx.case.filler_offset;
    // Up to three attempts: a seam next to the frame or a closer may shift the count; the second
    // pass corrects the closing gap by the measured error.
    let mut correction = 0i64;
    for _attempt in 0..MAX_CORRECTIONS {
        let target = budget + correction;
        let mut units: Vec<Placed> = Vec::new();
        let mut count = 0i64;
        let mut prev = ctx.prefix;
        let mut next_filler = ctx.case.filler_offset;
        let mut anchored = ctx.anchored.iter().peekable();
        loop {
            // An anchored unit goes in only before a space-led unit: a newline after it would
            // merge with its last token in some families (Llama-3 ".\n") and blur its span.
            let next_is_space_led = filler
                .get(next_filler)
                .is_none_or(|&f| engine.starts_with_space(f));
            if let Some((depth, unit)) = anchored.peek() {
                if ((*depth * target as f64) <= count as f64 && next_is_space_led)
                    || target - count <= close_zone
                {
                    count += engine.len(unit.seg)? + engine.junction(prev, unit.seg)?.delta;
                    prev = unit.seg;
                    units.push((*unit).clone());
                    anchored.next();
                    continue;
                }
            }
            if target - count <= close_zone {
                break;
            }
            let Some(&seg) = filler.get(next_filler) else {
                return Ok(Err(refuse(
                    "filler_exhausted",
                    format!(
                        "the filler stream ({} units) ran out before {length} tokens; pass more filler units",
                        filler.len()
                    ),
                )));
            };
            next_filler += 1;
            count += engine.len(seg)? + engine.junction(prev, seg)?.delta;
            prev = seg;
            units.push(Placed {
                seg,
                kind: UnitKind::Filler,
                id: String::new(),
            });
        }
        let gap = target - count;
        if gap < 0 {
            return Ok(Err(refuse(
                "cannot_reach_exact_length",
                format!(
                    "anchored units overshoot the budget by {} tokens at length {length}",
                    -gap
                ),
            )));
        }
        // A gap smaller than every pool sentence cannot be closed: give back the last filler units
        // (never anchored ones) until the gap is closable.
        let mut gap = gap;
        let closers = loop {
            if let Some(closers) = pool.close(gap, salt) {
                break closers;
            }
            let Some(pos) = units.iter().rposition(|p| p.kind == UnitKind::Filler) else {
                return Ok(Err(refuse(
                    "cannot_reach_exact_length",
                    format!("no combination of closing sentences has exactly {gap} tokens; add shorter pool sentences"),
                )));
            };
            let removed = units.remove(pos);
            let before = if pos == 0 {
                ctx.prefix
            } else {
                units[pos - 1].seg
            };
            gap += engine.len(removed.seg)? + engine.junction(before, removed.seg)?.delta;
        };
        units.extend(closers.into_iter().map(|seg| Placed {
            seg,
            kind: UnitKind::Filler,
            id: String::new(),
        }));
        // Measure the whole sequence exactly (frame seams included) with the block left out.
        let mut seq = Vec::with_capacity(units.len() + block.len() + 2);
        seq.push(ctx.prefix);
        seq.extend(units.iter().map(|p| p.seg));
        seq.extend(block.iter().copied());
        seq.push(ctx.suffix);
        // Seam arithmetic is exact where junctions are provable; elsewhere (SentencePiece without
        // a pre-tokenizer) it is only an estimate, so the planned haystack is measured once in full.
        let total = if engine.tok.fast_unsound_reason.is_some() {
            engine
                .measure(&seq, spec.add_special_tokens, Verification::Full)?
                .ids
                .len() as i64
        } else {
            head + tail + engine.count(&seq)?
        };
        if total == length as i64 {
            return Ok(Ok(units));
        }
        correction += length as i64 - total;
    }
    Ok(Err(refuse(
        "cannot_reach_exact_length",
        format!("seams kept shifting the total away from {length} tokens after {MAX_CORRECTIONS} corrections"),
    )))
}

/// What every position of a planned haystack shares, computed once: its seams, unit boundaries and
/// region start (they were recomputed per position, one seam look-up per unit each time), and in
/// fast mode on a sound tokenizer the spliced prompt without the block and the spliced block, so a
/// position is two memcpys ([`LayoutEngine::insert_block`]).
fn prepare_haystack(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    units: Vec<Placed>,
) -> Result<Haystack> {
    let (head, _) = specials(engine, spec);
    let mut seq = Vec::with_capacity(units.len() + 2);
    seq.push(ctx.prefix);
    seq.extend(units.iter().map(|p| p.seg));
    seq.push(ctx.suffix);
    let mut seams = Vec::with_capacity(seq.len() - 1);
    let mut bounds = Vec::with_capacity(units.len() + 1);
    bounds.push(0i64);
    let mut acc = 0i64;
    for i in 1..seq.len() {
        let j = engine.junction(seq[i - 1], seq[i])?;
        if i < seq.len() - 1 {
            // Unit i - 1 of the haystack; the prefix seam belongs to the region start instead.
            acc += engine.len(seq[i])? + if i > 1 { j.delta } else { 0 };
            bounds.push(acc);
        }
        seams.push(j);
    }
    let first = units.first().map(|p| p.seg).unwrap_or(ctx.moving[0].seg);
    let region_start = head
        + engine.len(ctx.prefix)?
        + if units.is_empty() {
            engine.junction(ctx.prefix, first)?.delta
        } else {
            seams[0].delta
        };
    let (body, block) =
        if spec.verification == Verification::Fast && engine.tok.fast_unsound_reason.is_none() {
            let block_seq: Vec<UnitIdx> = ctx.moving.iter().map(|p| p.seg).collect();
            let block = match engine.provable_seams(&block_seq)? {
                Ok(block_seams) => engine.spliced(&block_seq, &block_seams, false)?,
                Err(_) => None,
            };
            match block {
                Some(block) => (
                    engine.spliced(&seq, &seams, spec.add_special_tokens)?,
                    Some(block),
                ),
                None => (None, None),
            }
        } else {
            (None, None)
        };
    Ok(Haystack {
        units,
        seams,
        tokens: acc,
        bounds,
        region_start,
        body,
        block,
    })
}

/// Insert the moving block into the haystack at the position, build and check the final prompt.
fn place(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    haystack: &Haystack,
    length: usize,
    position: &PositionSpec,
    layout_id: String,
) -> Result<std::result::Result<Layout, Refusal>> {
    let (head, tail) = specials(engine, spec);
    let region_start = haystack.region_start;
    let bounds = &haystack.bounds;
    let h = haystack.tokens;
    let requested: i64 = match (position.depth, position.offset) {
        (Some(d), _) => (d * h as f64).round() as i64,
        (None, Some(o)) => {
            let m = o as i64 - region_start;
            if m < 0 || m > h {
                return Ok(Err(refuse(
                    "offset_outside_region",
                    format!(
                        "offset {o} is outside the context region [{region_start}, {}] at length {length}; use an offset inside it",
                        region_start + h
                    ),
                )));
            }
            m
        }
        _ => unreachable!("validated"),
    };
    // The MAX_BOUNDARY_TRIES nearest boundaries, nearest first (ties: the earlier one), in one pass
    // (sorting all 9.5K boundaries of a 128K haystack per position was 5 % of a fast layout).
    let mut order: Vec<(i64, usize)> = Vec::with_capacity(MAX_BOUNDARY_TRIES + 1);
    for (k, &b) in bounds.iter().enumerate() {
        let key = ((b - requested).abs(), k);
        if order.len() == MAX_BOUNDARY_TRIES && key >= order[MAX_BOUNDARY_TRIES - 1] {
            continue;
        }
        let at = order.partition_point(|&o| o < key);
        order.insert(at, key);
        order.truncate(MAX_BOUNDARY_TRIES);
    }
    let order: Vec<usize> = order.into_iter().map(|(_, k)| k).collect();
    // The nearest boundary is tried first; a boundary whose seams change the count or cut through
    // a placed unit (Llama-3 merges ".\n\n" into one token) is skipped for the next-nearest one,
    // and the extra distance shows up as snap.
    let mut last_refusal = None;
    let block_first = ctx.moving[0].seg;
    let block_last = ctx.moving[ctx.moving.len() - 1].seg;
    for &k in order.iter().take(MAX_BOUNDARY_TRIES) {
        // The block's two new seams when the spliced body can take the block directly.
        let mut insert = None;
        // Where seams are provable, a boundary whose seams merge into the evidence or change the
        // total is known bad before any encode: skip it for free (Llama-3 ".\n\n" seams otherwise
        // cost a full encode per retry, docs/benchmarks.md).
        if engine.tok.fast_unsound_reason.is_none() {
            let prev = if k == 0 {
                ctx.prefix
            } else {
                haystack.units[k - 1].seg
            };
            let next = if k == haystack.units.len() {
                ctx.suffix
            } else {
                haystack.units[k].seg
            };
            let (left, right) = (
                engine.junction(prev, block_first)?,
                engine.junction(block_last, next)?,
            );
            let closed = &haystack.seams[k];
            let merges = left.drop_a + left.drop_b + right.drop_a + right.drop_b > 0;
            if merges || left.delta + right.delta != closed.delta {
                last_refusal = Some(refuse(
                    "evidence_straddles_token",
                    "every nearby boundary merges a token across the evidence edge or changes the total",
                ));
                continue;
            }
            if left.provable && right.provable {
                insert = Some((prev, next));
            }
        }
        // Unit i of the prompt's sequence after the prefix: haystack units before the boundary, the
        // block, the rest of the haystack.
        let n_units = haystack.units.len() + ctx.moving.len();
        let m = ctx.moving.len();
        let unit = |i: usize| -> &Placed {
            if i < k {
                &haystack.units[i]
            } else if i < k + m {
                &ctx.moving[i - k]
            } else {
                &haystack.units[i - m]
            }
        };
        let measured = match (&haystack.body, &haystack.block, insert) {
            (Some(body), Some(block), Some(pair)) => {
                engine.insert_block(body, block, pair, k, &haystack.seams[k], tail as usize)?
            }
            _ => {
                let mut seq = Vec::with_capacity(n_units + 2);
                seq.push(ctx.prefix);
                seq.extend((0..n_units).map(|i| unit(i).seg));
                seq.push(ctx.suffix);
                engine.measure(&seq, spec.add_special_tokens, spec.verification)?
            }
        };
        if measured.ids.len() != length {
            last_refusal = Some(refuse(
                "cannot_reach_exact_length",
                format!(
                    "inserting the evidence near offset {requested} changes the total ({} != {length}) at every nearby boundary",
                    measured.ids.len()
                ),
            ));
            continue;
        }
        // Spans from the final offsets. Char positions are counted in one forward pass (units come
        // in text order), not from the start of the prompt for every span.
        let mut spans = Vec::new();
        let mut refusal = None;
        let (mut counted_bytes, mut counted_chars) = (0usize, 0usize);
        for i in 0..n_units {
            let p = unit(i);
            if !matches!(p.kind, UnitKind::Evidence | UnitKind::Distractor) {
                continue;
            }
            let seg_text = &engine.segments[p.seg as usize].text;
            let byte_start = measured.unit_starts[i + 1];
            counted_chars += measured.text[counted_bytes..byte_start].chars().count();
            counted_bytes = byte_start;
            let char_start = counted_chars;
            let byte_end = byte_start + seg_text.len();
            match token_span(
                &measured.offsets,
                byte_start,
                byte_end,
                head as usize,
                tail as usize,
            ) {
                Ok((ts, te)) => {
                    if p.kind == UnitKind::Evidence
                        && ctx.canonical.get(&p.id).map(Vec::as_slice)
                            != Some(&measured.ids[ts..te])
                    {
                        refusal = Some(refuse(
                            "evidence_tokens_differ",
                            format!("evidence {} tokenizes differently here than in its reference context", p.id),
                        ));
                    }
                    spans.push(Span {
                        unit_id: p.id.clone(),
                        kind: p.kind,
                        token_start: ts,
                        token_end: te,
                        char_start,
                        char_end: char_start + seg_text.chars().count(),
                        sha256: sha256_hex(seg_text.as_bytes()),
                    });
                }
                Err(r) => refusal = Some(r),
            }
        }
        if let Some(r) = refusal {
            last_refusal = Some(r);
            continue;
        }
        if spec.add_special_tokens
            && head > 0
            && measured.ids.len() > head as usize
            && measured.ids[head as usize] == engine.tok.special_head[0]
        {
            return Ok(Err(refuse(
                "doubled_bos",
                "the rendered text already starts with the BOS token and the tokenizer adds another; set add_special_tokens=false for this frame",
            )));
        }
        let actual = spans
            .iter()
            .find(|s| {
                ctx.moving
                    .first()
                    .map(|m| m.id == s.unit_id)
                    .unwrap_or(false)
            })
            .map(|s| s.token_start);
        // The region is read from the final offsets (exact for every tokenizer family); the
        // arithmetic above only chose the boundary.
        let body_end = measured.offsets.len() - tail as usize;
        let region_first = measured
            .offsets
            .partition_point(head as usize, body_end, |(_, e)| {
                e <= measured.unit_starts[1]
            });
        let suffix_start = *measured.unit_starts.last().expect("suffix");
        let region_last = measured
            .offsets
            .partition_point(head as usize, body_end, |(s, _)| s < suffix_start);
        let block_tokens: usize = spans
            .iter()
            .filter(|s| ctx.moving.iter().any(|m| m.id == s.unit_id))
            .map(|s| s.token_end - s.token_start)
            .sum();
        let measured_h = region_last.saturating_sub(region_first + block_tokens) as i64;
        let requested_abs = match position.depth {
            Some(d) => region_first + (d * measured_h as f64).round() as usize,
            None => (region_start + requested) as usize,
        };
        return Ok(Ok(Layout {
            layout_id,
            case_id: ctx.case.case_id.clone(),
            target_tokens: length,
            position: position.label.clone(),
            status: Status::Ok,
            reason_code: None,
            reason: None,
            total_tokens: measured.ids.len(),
            region_start: region_first,
            region_end: region_last,
            snap_tokens: actual.map(|a| a as i64 - requested_abs as i64).unwrap_or(0),
            requested_offset: Some(requested_abs),
            actual_offset: actual,
            token_ids: measured.ids,
            text: measured.text,
            add_special_tokens: spec.add_special_tokens,
            spans,
            verification: measured.used,
            verification_note: measured.note,
        }));
    }
    Ok(Err(last_refusal.unwrap_or_else(|| {
        refuse(
            "cannot_reach_exact_length",
            "no insertion boundary in the haystack",
        )
    })))
}

/// Token span covering bytes [start, end) of the text; refuses when a token straddles an edge.
fn token_span(
    offsets: &Offsets<'_>,
    start: usize,
    end: usize,
    skip: usize,
    skip_tail: usize,
) -> std::result::Result<(usize, usize), Refusal> {
    let body_end = offsets.len() - skip_tail;
    let ts = offsets.partition_point(skip, body_end, |(_, e)| e <= start);
    let te = offsets.partition_point(skip, body_end, |(s, _)| s < end);
    let straddle = |what: &str| {
        refuse(
            "evidence_straddles_token",
            format!("a token crosses the {what} of a placed unit (bytes {start}..{end}); the unit cannot be located exactly"),
        )
    };
    if ts >= te {
        return Err(straddle("inside"));
    }
    // A leading separator may be trimmed out of a token's offsets (ByteLevel trim_offsets).
    if offsets.get(ts).0 < start {
        return Err(straddle("start"));
    }
    if offsets.get(te - 1).1 > end {
        return Err(straddle("end"));
    }
    Ok((ts, te))
}

// The tokenizer-fixture helper of the integration tests (path relative to this file's folder).
#[cfg(test)]
#[path = "../tests/common/mod.rs"]
mod test_fixtures;

#[cfg(test)]
mod tests {
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
}

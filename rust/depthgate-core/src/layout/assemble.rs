//! Step 5: the final ids of a prompt, by one full encode (`Verification::Full`) or spliced from
//! verified segments (`Verification::Fast`), and the fast insertion of the spliced block into the
//! spliced body shared by every position.

use super::*;

/// A sequence of segments spliced from cached pieces and verified seams.
pub(super) struct Spliced {
    pub(super) ids: Vec<u32>,
    /// Byte offsets into `text` (special tokens: (0, 0)).
    pub(super) offsets: Vec<(usize, usize)>,
    pub(super) text: String,
    /// Byte start of each unit of the sequence in `text`.
    pub(super) unit_starts: Vec<usize>,
    /// Token range of each unit's own tokens in `ids` (without the tokens its seams replace).
    pub(super) own: Vec<(usize, usize)>,
}

/// A run of token offsets taken from a spliced piece, shifted by `shift` bytes, starting at token
/// `start` of the prompt.
pub(super) struct Run<'a> {
    pub(super) start: usize,
    pub(super) offsets: &'a [(usize, usize)],
    pub(super) shift: usize,
}

/// The byte offsets of a prompt's tokens: owned (a full encode, a whole splice) or, when a block is
/// inserted into a spliced body, the few runs they are made of. Only the offsets around the spans and
/// the region edges are ever read, so the 128K-entry vector is not materialised per layout (that copy
/// was most of what remained of a fast 128K layout, docs/benchmarks.md).
pub(super) enum Offsets<'a> {
    Owned(Vec<(usize, usize)>),
    Runs(Vec<Run<'a>>, usize),
}

impl Offsets<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Offsets::Owned(v) => v.len(),
            Offsets::Runs(_, n) => *n,
        }
    }

    pub(super) fn get(&self, i: usize) -> (usize, usize) {
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
    pub(super) fn partition_point(
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

pub(super) struct Measured<'a> {
    pub(super) ids: Vec<u32>,
    /// Byte offsets into the full text (special tokens: (0, 0)).
    pub(super) offsets: Offsets<'a>,
    /// Byte start of each sequence unit in the text.
    pub(super) unit_starts: Vec<usize>,
    pub(super) text: String,
    pub(super) note: Option<String>,
    pub(super) used: Verification,
}

impl LayoutEngine<'_, '_> {
    /// Final ids of a sequence, by one full encode or by verified segments.
    pub(super) fn measure(
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

    /// Concatenate cached segments, replacing merged seams by their verified window ids.
    #[allow(clippy::type_complexity)]
    pub(super) fn splice(
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
    pub(super) fn splice_with(
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
    pub(super) fn spliced(
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
    pub(super) fn insert_block<'a>(
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
pub(super) type SplicedIds = (Vec<u32>, Vec<(usize, usize)>, Vec<(usize, usize)>);

/// The note a layout carries when fast mode was asked for a tokenizer it is not sound for.
pub(super) fn unsound_note(tok: &TargetTokenizer) -> Option<String> {
    tok.fast_unsound_reason.as_ref().map(|why| {
        format!("fast verification unsound for this tokenizer ({why}); full re-encode used")
    })
}

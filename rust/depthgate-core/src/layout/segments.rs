//! Step 1: every distinct text of a batch interned once and encoded on first use (from the
//! tokenizer's cross-batch segment cache), and plain text assembly of a sequence of segments.

use super::*;

pub(super) type UnitIdx = u32;

pub(super) struct Segment<'s> {
    /// Borrowed from the batch spec: interning 30K filler units must not copy them.
    pub(super) text: &'s str,
    /// A content unit (checked for special-token strings when first encoded), not a frame.
    pub(super) check: bool,
    /// Encoded on first use (a haystack uses a fraction of the filler it is offered), from the
    /// tokenizer's cross-batch segment cache when possible, with the text's id in that cache.
    pub(super) entry: OnceLock<(Option<SegmentId>, Arc<Piece>)>,
    /// The seam to the next segment of the batch (the next unit of the filler stream): a planned
    /// haystack is mostly consecutive stream units, and every pass over it (plan, exact count,
    /// boundaries, splice) looks these seams up again.
    pub(super) next: OnceLock<Arc<Junction>>,
}

/// Holds the tokenized segments of one batch and the junction cache.
pub struct LayoutEngine<'t, 's> {
    pub(super) tok: &'t TargetTokenizer,
    pub(super) segments: Vec<Segment<'s>>,
    pub(super) index: AHashMap<&'s str, UnitIdx>,
    /// Seams of this batch that the tokenizer's cache could not take (a text without a
    /// [`SegmentId`], or the cache full).
    pub(super) junctions: RwLock<AHashMap<(UnitIdx, UnitIdx), Arc<Junction>>>,
    /// The tokenizer's cross-batch seam cache.
    pub(super) seams: Arc<SeamCache>,
}

impl<'t, 's> LayoutEngine<'t, 's> {
    /// Intern every distinct text of the batch (encoding happens lazily, on first use). Returns the
    /// engine and each input's segment index, in input order. `check` marks content units, which
    /// must not contain special-token strings (frames may: templates write them).
    pub(super) fn new(
        tok: &'t TargetTokenizer,
        texts: Vec<(&'s str, bool)>,
    ) -> Result<(Self, Vec<UnitIdx>)> {
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
    pub(super) fn add_stream(&mut self, texts: &'s [String], check: bool) -> Vec<UnitIdx> {
        let first = self.segments.len();
        self.segments.extend(texts.iter().map(|text| Segment {
            text,
            check,
            entry: OnceLock::new(),
            next: OnceLock::new(),
        }));
        (first..self.segments.len()).map(|i| i as UnitIdx).collect()
    }

    pub(super) fn entry(&self, seg: UnitIdx) -> Result<&(Option<SegmentId>, Arc<Piece>)> {
        let slot = &self.segments[seg as usize];
        if let Some(entry) = slot.entry.get() {
            return Ok(entry);
        }
        let entry = self.tok.segment_entry(slot.text, slot.check)?;
        Ok(slot.entry.get_or_init(|| entry))
    }

    pub(super) fn piece(&self, seg: UnitIdx) -> Result<&Piece> {
        Ok(&self.entry(seg)?.1)
    }

    /// The segment's id in the tokenizer's cache, if it has one.
    pub(super) fn gid(&self, seg: UnitIdx) -> Result<Option<SegmentId>> {
        Ok(self.entry(seg)?.0)
    }

    pub(super) fn seg(&self, text: &str) -> UnitIdx {
        self.index[text]
    }

    pub(super) fn starts_with_space(&self, seg: UnitIdx) -> bool {
        self.segments[seg as usize].text.starts_with(' ')
    }

    pub(super) fn len(&self, seg: UnitIdx) -> Result<i64> {
        Ok(self.piece(seg)?.ids.len() as i64)
    }

    pub(super) fn assemble_text(&self, seq: &[UnitIdx]) -> (String, Vec<usize>) {
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
}

//! Step 3 (closing): the pool of short sentences, bucketed by in-context token count, that closes
//! the last gap of a haystack exactly; and the filler digest every layout id carries.

use super::*;

/// In-context token counts of closing-pool sentences (after the neutral anchor), per tokenizer and
/// [`SegmentId`]: measuring the 400 pool sentences anew per batch was 28 % of a fast 128K batch.
#[derive(Default)]
pub(super) struct PoolLenCache {
    pub(super) lens: RwLock<AHashMap<SegmentId, i64>>,
}

/// Which pool units (by segment) have which token count, for closing gaps exactly.
pub(super) struct Pool {
    pub(super) by_len: Vec<(i64, Vec<UnitIdx>)>,
}

impl Pool {
    /// Buckets pool units by their *in-context* token count (after a neutral "x."), which is what
    /// they add mid-prompt; for SentencePiece files that is one less than their standalone count.
    pub(super) fn new(engine: &LayoutEngine<'_, '_>, pool: &[String]) -> Result<Self> {
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

    pub(super) fn max_len(&self) -> i64 {
        self.by_len.last().map(|(l, _)| *l).unwrap_or(0)
    }

    pub(super) fn pick(&self, len: i64, salt: usize) -> Option<UnitIdx> {
        let units = &self.by_len.iter().find(|(l, _)| *l == len)?.1;
        Some(units[salt % units.len()])
    }

    /// One to three pool units whose lengths sum to `gap` (seams assumed exact; the caller
    /// re-measures and retries).
    pub(super) fn close(&self, gap: i64, salt: usize) -> Option<Vec<UnitIdx>> {
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

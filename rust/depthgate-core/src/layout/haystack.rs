//! Step 3: per case × length, one haystack (filler with anchored units at fixed depths) planned by
//! arithmetic over segment lengths and junction deltas to the exact budget, then prepared once for
//! every position (seams, unit boundaries, region start, and in fast mode the spliced body).

use super::*;

/// Gap (in tokens) under which the haystack stops taking stream units and closes with pool units.
pub(super) const CLOSE_FACTOR: usize = 2;

/// Re-plans of a haystack whose measured total missed the target.
pub(super) const MAX_CORRECTIONS: usize = 6;

pub(super) struct Haystack {
    pub(super) units: Vec<Placed>,
    /// Seams of `[prefix, units…, suffix]`, in order (`units.len() + 1`).
    pub(super) seams: Vec<Arc<Junction>>,
    /// Token offset, within the haystack, of each unit boundary (`units.len() + 1`).
    pub(super) bounds: Vec<i64>,
    /// Token count of the haystack alone, junctions inside it included.
    pub(super) tokens: i64,
    /// Token offset of the context region in the prompt (special tokens, prefix and its seam).
    pub(super) region_start: i64,
    /// Fast mode on a sound tokenizer: the spliced prompt without the moving block, shared by every
    /// position (`None` when a seam of it cannot be spliced: each layout then takes the general path).
    pub(super) body: Option<Spliced>,
    /// The moving block spliced on its own (its inner seams), inserted into `body` per position.
    pub(super) block: Option<Spliced>,
    /// Indices in `units` of a conversation's turn separators, in order (empty: one slot).
    pub(super) separators: Vec<usize>,
}

impl Haystack {
    /// The unit boundaries inside turn `t` (1-based): from just after separator `t - 1` to just
    /// before separator `t` (the whole haystack for a single slot).
    pub(super) fn turn_bounds(&self, t: usize) -> (usize, usize) {
        let lo = if t > 1 { self.separators[t - 2] + 1 } else { 0 };
        let hi = self
            .separators
            .get(t - 1)
            .copied()
            .unwrap_or(self.units.len());
        (lo, hi)
    }

    /// The turn (1-based) the block starts in when inserted at boundary `k`.
    pub(super) fn turn_at(&self, k: usize) -> usize {
        1 + self.separators.partition_point(|&j| j < k)
    }

    /// Whether an MRCR exchange block (see [`is_exchange_block`]) may go in at boundary `k`: inside
    /// a user turn (odd), and not directly before a separator (the block ends with one: two
    /// separators in a row would leave a user turn with no content between them).
    pub(super) fn takes_exchanges(&self, k: usize) -> bool {
        self.turn_at(k) % 2 == 1 && self.separators.binary_search(&k).is_err()
    }
}

/// MRCR across turns (issue 25 item 3): the moving block of an MRCR case in a conversation holds each
/// needle as its own exchange — `request, separator (user → assistant), reply, separator (assistant →
/// user)` per needle, filler of a spacing after the second separator — so the request ends a user
/// turn's content and the reply is the whole content of the next assistant turn. The turn separators
/// of the exchanges travel *inside* the block instead of being anchored at even depths like the
/// haystack's own (`CaseSpec::turns`, the filler turns), so the block still moves as one unit and
/// the needles keep their order and spacing at every position; it is inserted only at boundaries
/// inside a user turn ([`Haystack::takes_exchanges`]), where the two alternating separators keep
/// user/assistant alternation. The front renders the frame with the exchanges' turns and re-renders
/// every built conversation through the template (`prove_rendered`), so a template whose separators
/// depend on more than the roles cannot pass.
pub(super) fn is_exchange_block(ctx: &CaseContext<'_>) -> bool {
    ctx.moving.iter().any(|p| p.kind == UnitKind::Frame)
}

pub(super) fn specials(engine: &LayoutEngine<'_, '_>, spec: &BatchSpec) -> (i64, i64) {
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
pub(super) fn plan_haystack(
    engine: &LayoutEngine<'_, '_>,
    pool: &Pool,
    filler: &[UnitIdx],
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    length: usize,
) -> Result<std::result::Result<Vec<Placed>, Refusal>> {
    let block: Vec<UnitIdx> = ctx.moving.iter().map(|p| p.seg).collect();
    let budget = match haystack_budget(engine, spec, ctx, &block, length)? {
        Ok(budget) => budget,
        Err(r) => return Ok(Err(r)),
    };
    let close_zone = CLOSE_FACTOR as i64 * pool.max_len();
    // Up to three attempts: a seam next to the frame or a closer may shift the count; the second
    // pass corrects the closing gap by the measured error.
    let mut correction = 0i64;
    for _attempt in 0..MAX_CORRECTIONS {
        let target = budget + correction;
        let (mut units, count) =
            match fill_to_close_zone(engine, filler, ctx, target, close_zone, length)? {
                Ok(filled) => filled,
                Err(r) => return Ok(Err(r)),
            };
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
        if let Err(r) = close_gap(engine, pool, ctx, &mut units, gap)? {
            return Ok(Err(r));
        }
        let total = planned_total(engine, spec, ctx, &units, &block)?;
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

/// The tokens left for the haystack at `length` once the frame, the special tokens and the moving
/// block are counted; refused when the anchored units do not fit in it.
fn haystack_budget(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    block: &[UnitIdx],
    length: usize,
) -> Result<std::result::Result<i64, Refusal>> {
    let (head, tail) = specials(engine, spec);
    let block_tokens = engine.count(block)?;
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
    Ok(Ok(budget))
}

/// Stream units, with the anchored units at their depths of `target`, until the gap left is in the
/// close zone (or the anchored units are all in). Returns the units and their token count.
fn fill_to_close_zone(
    engine: &LayoutEngine<'_, '_>,
    filler: &[UnitIdx],
    ctx: &CaseContext<'_>,
    target: i64,
    close_zone: i64,
    length: usize,
) -> Result<std::result::Result<(Vec<Placed>, i64), Refusal>> {
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
            // A turn separator never directly follows placed content: its first characters may
            // merge with the content's last token (TinyLlama does not split "</s>" out of text, so
            // "night.</s>" starts with the token ".</") and blur the content's span. One filler
            // unit goes between them.
            let after_content = unit.kind == UnitKind::Frame
                && units
                    .last()
                    .is_some_and(|p| matches!(p.kind, UnitKind::Evidence | UnitKind::Distractor));
            if ((*depth * target as f64) <= count as f64 && next_is_space_led && !after_content)
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
            return Ok(Ok((units, count)));
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
}

/// Close `gap` with pool units appended to `units`. A gap smaller than every pool sentence cannot be
/// closed: the last filler units (never anchored ones) are given back until the gap is closable.
fn close_gap(
    engine: &LayoutEngine<'_, '_>,
    pool: &Pool,
    ctx: &CaseContext<'_>,
    units: &mut Vec<Placed>,
    mut gap: i64,
) -> Result<std::result::Result<(), Refusal>> {
    let salt = ctx.case.filler_offset;
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
    Ok(Ok(()))
}

/// The exact token count of the planned prompt (frame seams included) with the block at the end.
/// Seam arithmetic is exact where junctions are provable; elsewhere (SentencePiece without a
/// pre-tokenizer) it is only an estimate, so the planned haystack is measured once in full.
fn planned_total(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    units: &[Placed],
    block: &[UnitIdx],
) -> Result<i64> {
    let (head, tail) = specials(engine, spec);
    let mut seq = Vec::with_capacity(units.len() + block.len() + 2);
    seq.push(ctx.prefix);
    seq.extend(units.iter().map(|p| p.seg));
    seq.extend(block.iter().copied());
    seq.push(ctx.suffix);
    Ok(if engine.tok.fast_unsound_reason.is_some() {
        engine
            .measure(&seq, spec.add_special_tokens, Verification::Full)?
            .ids
            .len() as i64
    } else {
        head + tail + engine.count(&seq)?
    })
}

/// What every position of a planned haystack shares, computed once: its seams, unit boundaries and
/// region start (they were recomputed per position, one seam look-up per unit each time), and in
/// fast mode on a sound tokenizer the spliced prompt without the block and the spliced block, so a
/// position is two memcpys ([`LayoutEngine::insert_block`]).
pub(super) fn prepare_haystack(
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
    let separators = units
        .iter()
        .enumerate()
        .filter(|(_, p)| p.kind == UnitKind::Frame)
        .map(|(j, _)| j)
        .collect();
    Ok(Haystack {
        separators,
        units,
        seams,
        tokens: acc,
        bounds,
        region_start,
        body,
        block,
    })
}

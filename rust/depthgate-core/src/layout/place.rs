//! Step 4: per position, the moving block inserted at the unit boundary nearest the requested
//! offset; spans and region read from the final offsets.

use super::*;

/// How many of the nearest unit boundaries are tried for the moving block.
pub(super) const MAX_BOUNDARY_TRIES: usize = 8;

/// Where one layout goes: the case's haystack at one total length, one position, the layout's id.
pub(super) struct Target<'h> {
    pub haystack: &'h Haystack,
    pub length: usize,
    pub position: &'h PositionSpec,
    pub layout_id: String,
}

/// Insert the moving block into the haystack at the position, build and check the final prompt.
pub(super) fn place(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    target: Target<'_>,
) -> Result<std::result::Result<Layout, Refusal>> {
    let (haystack, length, position) = (target.haystack, target.length, target.position);
    let (requested, allowed) = match requested_offset(haystack, length, position) {
        Ok(requested) => requested,
        Err(r) => return Ok(Err(r)),
    };
    // The nearest boundary is tried first; a boundary whose seams change the count or cut through
    // a placed unit (Llama-3 merges ".\n\n" into one token) is skipped for the next-nearest one,
    // and the extra distance shows up as snap.
    let exchange = is_exchange_block(ctx);
    if let (true, Some(t)) = (exchange, position.turn) {
        if t % 2 == 0 {
            return Ok(Err(refuse(
                "turn_not_user",
                format!(
                    "turn {t} is an assistant turn; an MRCR exchange starts in a user turn (odd K)"
                ),
            )));
        }
    }
    let accept = |k: usize| !exchange || haystack.takes_exchanges(k);
    let mut last_refusal = None;
    for k in nearest_boundaries(&haystack.bounds, requested, allowed, accept) {
        let (measured, spans) = match place_at(engine, spec, ctx, haystack, length, k, requested)? {
            Ok(placed) => placed,
            Err(r) => {
                last_refusal = Some(r);
                continue;
            }
        };
        let (head, _) = specials(engine, spec);
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
        let placed = PlacedPrompt {
            measured,
            spans,
            requested,
            k,
        };
        return Ok(Ok(finish_layout(engine, spec, ctx, target, placed)));
    }
    Ok(Err(last_refusal.unwrap_or_else(|| {
        refuse(
            "cannot_reach_exact_length",
            "no insertion boundary in the haystack",
        )
    })))
}

/// The requested block start, in tokens from the start of the haystack: a depth of the haystack, an
/// absolute offset (refused outside the context region), or the middle of a conversation's turn;
/// with the range of unit boundaries the block may take (a turn's own, else all of them).
fn requested_offset(
    haystack: &Haystack,
    length: usize,
    position: &PositionSpec,
) -> std::result::Result<(i64, (usize, usize)), Refusal> {
    let (region_start, h) = (haystack.region_start, haystack.tokens);
    let all = (0, haystack.units.len());
    match (position.depth, position.offset, position.turn) {
        (Some(d), _, _) => Ok(((d * h as f64).round() as i64, all)),
        (None, Some(o), _) => {
            let m = o as i64 - region_start;
            if m < 0 || m > h {
                return Err(refuse(
                    "offset_outside_region",
                    format!(
                        "offset {o} is outside the context region [{region_start}, {}] at length {length}; use an offset inside it",
                        region_start + h
                    ),
                ));
            }
            Ok((m, all))
        }
        (None, None, Some(t)) => {
            if t > haystack.separators.len() + 1 {
                return Err(refuse(
                    "turn_outside_conversation",
                    format!(
                        "turn {t} is not a turn of this conversation ({} turns)",
                        haystack.separators.len() + 1
                    ),
                ));
            }
            let (lo, hi) = haystack.turn_bounds(t);
            Ok(((haystack.bounds[lo] + haystack.bounds[hi]) / 2, (lo, hi)))
        }
        _ => unreachable!("validated"),
    }
}

/// The [`MAX_BOUNDARY_TRIES`] unit boundaries nearest `requested`, nearest first (ties: the earlier
/// one), among the `allowed` ones (inclusive) that `accept` takes, in one pass (sorting all 9.5K
/// boundaries of a 128K haystack per position was 5 % of a fast layout).
fn nearest_boundaries(
    bounds: &[i64],
    requested: i64,
    allowed: (usize, usize),
    accept: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let mut order: Vec<(i64, usize)> = Vec::with_capacity(MAX_BOUNDARY_TRIES + 1);
    for (k, &b) in bounds
        .iter()
        .enumerate()
        .take(allowed.1 + 1)
        .skip(allowed.0)
        .filter(|&(k, _)| accept(k))
    {
        let key = ((b - requested).abs(), k);
        if order.len() == MAX_BOUNDARY_TRIES && key >= order[MAX_BOUNDARY_TRIES - 1] {
            continue;
        }
        let at = order.partition_point(|&o| o < key);
        order.insert(at, key);
        order.truncate(MAX_BOUNDARY_TRIES);
    }
    order.into_iter().map(|(_, k)| k).collect()
}

/// Unit `i` of the prompt's sequence after the prefix with the block at boundary `k`: haystack
/// units before the boundary, the block, the rest of the haystack.
fn unit_at<'h>(haystack: &'h Haystack, moving: &'h [Placed], k: usize, i: usize) -> &'h Placed {
    let m = moving.len();
    if i < k {
        &haystack.units[i]
    } else if i < k + m {
        &moving[i - k]
    } else {
        &haystack.units[i - m]
    }
}

/// Where seams are provable, a boundary whose seams merge into the evidence or change the total is
/// known bad before any encode: refused for free (Llama-3 ".\n\n" seams otherwise cost a full
/// encode per retry, docs/benchmarks.md). Returns the block's two neighbours when the spliced body
/// can take the block directly.
fn block_seams_at(
    engine: &LayoutEngine<'_, '_>,
    ctx: &CaseContext<'_>,
    haystack: &Haystack,
    k: usize,
) -> Result<std::result::Result<Option<(UnitIdx, UnitIdx)>, Refusal>> {
    if engine.tok.fast_unsound_reason.is_some() {
        return Ok(Ok(None));
    }
    let block_first = ctx.moving[0].seg;
    let block_last = ctx.moving[ctx.moving.len() - 1].seg;
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
        return Ok(Err(refuse(
            "evidence_straddles_token",
            "every nearby boundary merges a token across the evidence edge or changes the total",
        )));
    }
    Ok(Ok((left.provable && right.provable).then_some((prev, next))))
}

/// The prompt with the block at boundary `k`, measured, of exactly `length` tokens, with the spans
/// of its evidence and distractors; or why this boundary cannot take the block.
fn place_at<'a>(
    engine: &'a LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &'a CaseContext<'_>,
    haystack: &'a Haystack,
    length: usize,
    k: usize,
    requested: i64,
) -> Result<std::result::Result<(Measured<'a>, Vec<Span>), Refusal>> {
    let (_, tail) = specials(engine, spec);
    let insert = match block_seams_at(engine, ctx, haystack, k)? {
        Ok(insert) => insert,
        Err(r) => return Ok(Err(r)),
    };
    let n_units = haystack.units.len() + ctx.moving.len();
    let measured = match (&haystack.body, &haystack.block, insert) {
        (Some(body), Some(block), Some(pair)) => {
            engine.insert_block(body, block, pair, k, &haystack.seams[k], tail as usize)?
        }
        _ => {
            let mut seq = Vec::with_capacity(n_units + 2);
            seq.push(ctx.prefix);
            seq.extend((0..n_units).map(|i| unit_at(haystack, &ctx.moving, k, i).seg));
            seq.push(ctx.suffix);
            engine.measure(&seq, spec.add_special_tokens, spec.verification)?
        }
    };
    if measured.ids.len() != length {
        return Ok(Err(refuse(
            "cannot_reach_exact_length",
            format!(
                "inserting the evidence near offset {requested} changes the total ({} != {length}) at every nearby boundary",
                measured.ids.len()
            ),
        )));
    }
    let units = (0..n_units).map(|i| unit_at(haystack, &ctx.moving, k, i));
    Ok(spans_of(engine, spec, ctx, &measured, units).map(|spans| (measured, spans)))
}

/// Spans of the evidence and distractors from the final offsets; refused when a token straddles a
/// unit edge or evidence tokenizes differently than in its reference context (the last such
/// refusal wins). Char positions are counted in one forward pass (units come in text order), not
/// from the start of the prompt for every span.
fn spans_of<'p>(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    measured: &Measured<'_>,
    units: impl Iterator<Item = &'p Placed>,
) -> std::result::Result<Vec<Span>, Refusal> {
    let (head, tail) = specials(engine, spec);
    let mut spans = Vec::new();
    let mut refusal = None;
    let (mut counted_bytes, mut counted_chars) = (0usize, 0usize);
    for (i, p) in units.enumerate() {
        if !matches!(
            p.kind,
            UnitKind::Evidence | UnitKind::Distractor | UnitKind::Request
        ) {
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
                    && ctx.canonical.get(&p.id).map(Vec::as_slice) != Some(&measured.ids[ts..te])
                {
                    refusal = Some(refuse(
                        "evidence_tokens_differ",
                        format!(
                            "evidence {} tokenizes differently here than in its reference context",
                            p.id
                        ),
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
    match refusal {
        Some(r) => Err(r),
        None => Ok(spans),
    }
}

/// A prompt that took the block: measured, its spans, and the requested offset in the haystack.
struct PlacedPrompt<'a> {
    measured: Measured<'a>,
    spans: Vec<Span>,
    requested: i64,
    /// The boundary the block took.
    k: usize,
}

/// The layout of a placed prompt. The region is read from the final offsets (exact for every
/// tokenizer family); the arithmetic before only chose the boundary.
fn finish_layout(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    ctx: &CaseContext<'_>,
    target: Target<'_>,
    placed: PlacedPrompt<'_>,
) -> Layout {
    let Target {
        haystack,
        length,
        position,
        layout_id,
    } = target;
    let (head, tail) = specials(engine, spec);
    let PlacedPrompt {
        measured,
        spans,
        requested,
        k,
    } = placed;
    let actual = spans
        .iter()
        .find(|s| {
            ctx.moving
                .first()
                .map(|m| m.id == s.unit_id)
                .unwrap_or(false)
        })
        .map(|s| s.token_start);
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
    let turn_spans = turn_spans(
        engine,
        ctx,
        haystack,
        &measured,
        k,
        (region_first, region_last),
    );
    // An exchange block's separators and gap filler have no span: its tokens are its whole extent,
    // from the first unit's first token to the last unit's (the trailing separator's) last one.
    let block_tokens = if is_exchange_block(ctx) {
        let m = ctx.moving.len();
        let first = measured
            .offsets
            .partition_point(head as usize, body_end, |(_, e)| {
                e <= measured.unit_starts[k + 1]
            });
        let last = measured
            .offsets
            .partition_point(head as usize, body_end, |(s, _)| {
                s < measured.unit_starts[k + m + 1]
            });
        last.saturating_sub(first)
    } else {
        block_tokens
    };
    let measured_h = region_last.saturating_sub(region_first + block_tokens) as i64;
    let turn = recorded_turn(ctx, haystack, k, &spans, &turn_spans);
    let requested_abs = match position.depth {
        Some(d) => region_first + (d * measured_h as f64).round() as usize,
        None => (haystack.region_start + requested) as usize,
    };
    Layout {
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
        turn,
        turn_spans,
    }
}

/// The turn a conversation layout records: where the block starts, or for an MRCR exchange block
/// the turn holding the asked needle's reply (`CaseSpec::asked`), so a slice reads where the asked
/// exchange sits. None for one slot.
fn recorded_turn(
    ctx: &CaseContext<'_>,
    haystack: &Haystack,
    k: usize,
    spans: &[Span],
    turn_spans: &[TurnSpan],
) -> Option<usize> {
    if turn_spans.is_empty() {
        return None;
    }
    let asked = ctx
        .case
        .asked
        .as_ref()
        .and_then(|id| spans.iter().find(|s| &s.unit_id == id));
    Some(match asked {
        Some(span) => turn_spans
            .iter()
            .find(|t| t.token_start <= span.token_start && span.token_end <= t.token_end)
            .map_or(haystack.turn_at(k), |t| t.turn),
        None => haystack.turn_at(k),
    })
}

/// The token and char range of each turn's content (its slot) in a conversation prompt, read from
/// the final offsets: a turn ends before the first token that reaches into the separator after it
/// and starts after the last token that reaches into the separator before it. The separators are
/// every frame unit of the final sequence: the haystack's and an MRCR exchange block's. Empty for
/// one slot.
fn turn_spans(
    engine: &LayoutEngine<'_, '_>,
    ctx: &CaseContext<'_>,
    haystack: &Haystack,
    measured: &Measured<'_>,
    k: usize,
    region: (usize, usize),
) -> Vec<TurnSpan> {
    let n_units = haystack.units.len() + ctx.moving.len();
    let separators: Vec<(usize, &Placed)> = (0..n_units)
        .map(|i| (i, unit_at(haystack, &ctx.moving, k, i)))
        .filter(|(_, p)| p.kind == UnitKind::Frame)
        .collect();
    if separators.is_empty() {
        return Vec::new();
    }
    let (head, body_end) = (region.0, region.1);
    let mut spans = Vec::with_capacity(separators.len() + 1);
    let (mut token_start, mut byte_start) = (region.0, measured.unit_starts[1]);
    let (mut counted_bytes, mut counted_chars) = (0usize, 0usize);
    let mut chars_at = |byte: usize| {
        counted_chars += measured.text[counted_bytes..byte].chars().count();
        counted_bytes = byte;
        counted_chars
    };
    for (t, &(i, p)) in separators.iter().enumerate() {
        let sep_start = measured.unit_starts[i + 1];
        let sep_end = sep_start + engine.segments[p.seg as usize].text.len();
        let token_end = measured
            .offsets
            .partition_point(head, body_end, |(s, _)| s < sep_start);
        let char_start = chars_at(byte_start);
        spans.push(TurnSpan {
            turn: t + 1,
            token_start,
            token_end,
            char_start,
            char_end: chars_at(sep_start),
        });
        token_start = measured
            .offsets
            .partition_point(head, body_end, |(_, e)| e <= sep_end);
        byte_start = sep_end;
    }
    let suffix_start = *measured.unit_starts.last().expect("suffix");
    let char_start = chars_at(byte_start);
    spans.push(TurnSpan {
        turn: separators.len() + 1,
        token_start,
        token_end: region.1,
        char_start,
        char_end: chars_at(suffix_start),
    });
    spans
}

/// Token span covering bytes [start, end) of the text; refuses when a token straddles an edge.
pub(super) fn token_span(
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

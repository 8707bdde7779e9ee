//! The batch driver: validate the spec, intern its texts, and per case × length plan a haystack
//! and place every position (rayon over case × length, then over positions).

use super::*;

pub(super) struct CaseContext<'a> {
    pub(super) case: &'a CaseSpec,
    pub(super) prefix: UnitIdx,
    pub(super) suffix: UnitIdx,
    pub(super) moving: Vec<Placed>,
    pub(super) anchored: Vec<(f64, Placed)>,
    /// Canonical ids of each moving/anchored unit in a neutral left context ("x." + unit).
    pub(super) canonical: HashMap<String, Vec<u32>>,
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
        // An MRCR exchange block carries turn separators (frame pieces) among its units.
        texts.extend(
            case.moving
                .iter()
                .map(|u| (u.text.as_str(), u.kind != UnitKind::Frame)),
        );
        texts.extend(case.anchored.iter().map(|u| (u.text.as_str(), true)));
        // Turn separators are frame pieces (rendered by the template): never content-checked.
        texts.extend(case.turns.iter().map(|t| (t.as_str(), false)));
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

pub(super) fn validate_spec(tok: &TargetTokenizer, spec: &BatchSpec) -> Result<()> {
    validate_positions(spec)?;
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
                .filter(|u| u.kind != UnitKind::Frame)
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

/// Each position is one of a depth in [0, 1], an absolute offset, or a turn of a conversation that
/// every case of the batch has.
fn validate_positions(spec: &BatchSpec) -> Result<()> {
    for (i, p) in spec.positions.iter().enumerate() {
        match (p.depth, p.offset, p.turn) {
            (Some(d), None, None) if (0.0..=1.0).contains(&d) => {}
            (Some(d), None, None) => {
                return Err(CoreError::spec(
                    format!("positions[{i}].depth"),
                    format!("depth {d} is outside [0, 1]"),
                    "use a depth between 0 (start of the context) and 1 (end), or an absolute offset '@N'",
                ))
            }
            (None, Some(_), None) => {}
            (None, None, Some(t)) => {
                let fewest = spec.cases.iter().map(|c| c.turns.len() + 1).min().unwrap_or(1);
                if t == 0 || t > fewest {
                    return Err(CoreError::spec(
                        format!("positions[{i}].turn"),
                        format!("turn {t} is not a turn of every conversation (turns 1..={fewest})"),
                        "use '@turn:K' with K between 1 and the number of turns, on a conversation shape",
                    ));
                }
            }
            _ => {
                return Err(CoreError::spec(
                    format!("positions[{i}]"),
                    "a position needs exactly one of depth, offset or turn",
                    "give a depth such as 0.5, an offset such as @1200, or a turn such as @turn:3",
                ))
            }
        }
    }
    Ok(())
}

pub(super) fn preview(text: &str) -> String {
    text.chars().take(40).collect()
}

pub(super) fn case_context<'a>(
    engine: &LayoutEngine<'_, '_>,
    case: &'a CaseSpec,
) -> Result<CaseContext<'a>> {
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
    // A conversation's turns split the haystack evenly by tokens: separator k (between turns k and
    // k + 1) is anchored at depth k / turns, like a distractor, but is a frame piece (no span).
    let turns = case.turns.len() + 1;
    anchored.extend(case.turns.iter().enumerate().map(|(k, text)| {
        let id = format!("turn-separator-{}", k + 1);
        (
            (k + 1) as f64 / turns as f64,
            placed(&id, text, UnitKind::Frame),
        )
    }));
    anchored.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut canonical = HashMap::new();
    for (id, text) in case
        .moving
        .iter()
        .filter(|u| u.kind != UnitKind::Frame)
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
pub(super) fn refused_layout(
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
        turn: None,
        turn_spans: Vec::new(),
    }
}

pub(super) fn layout_id(
    engine: &LayoutEngine<'_, '_>,
    spec: &BatchSpec,
    filler_digest: &str,
    case: &CaseSpec,
    length: usize,
    position: &str,
) -> String {
    let length = length.to_string();
    let separators = case.turns.join("\u{e000}");
    let mut fields: Vec<&str> = vec![
        &engine.tok.digest,
        &spec.template_digest,
        &spec.assembler_version,
        &case.case_digest,
        // The rendered frame itself: a preamble or instruction change that leaves the template
        // untouched still changes every layout id.
        &case.prefix,
        &case.suffix,
    ];
    // A conversation's turn separators are frame too (single-slot ids are unchanged: no field).
    if !case.turns.is_empty() {
        fields.push(&separators);
    }
    fields.extend([
        filler_digest,
        &length,
        position,
        if spec.add_special_tokens {
            "special"
        } else {
            "plain"
        },
    ]);
    sha256_fields(&fields)[..32].to_string()
}

pub(super) fn build_case_length(
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
            let target = Target {
                haystack: &haystack,
                length,
                position,
                layout_id: id.clone(),
            };
            Ok(match place(engine, spec, ctx, target)? {
                Ok(layout) => layout,
                Err(r) => refused_layout(engine, spec, ctx, id, length, position, r),
            })
        })
        .collect()
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

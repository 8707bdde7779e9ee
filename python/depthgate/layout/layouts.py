"""Layouts: cases → token-exact prompts, built by the Rust core and streamed to ``layouts.parquet``.

This module is the typed front over ``depthgate._core`` (tiktoken's ``core.py`` role): it turns cases,
a frame (chat template or raw completion text) and filler into one JSON batch spec per chunk of
cases, calls the core once per chunk (GIL released, rayon inside), and writes rows in bounded
batches so a 10,000-layout 128K matrix never sits in memory at once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl

from depthgate import _core
from depthgate.exceptions import InputError, SpecError
from depthgate.layout import sink as layout_sink
from depthgate.layout.conversation import (
    TURN_SCHEMA,
    Conversation,
    conversation_frame,
    exchange_block,
    exchanges_of,
    gap_units,
    prove_cases,
    turn_columns,
)
from depthgate.layout.gguf_tokenizer import resolve_tokenizer_path
from depthgate.layout.templates import ChatTemplate, Frame, chat_frame, check_template_bos, raw_frame
from depthgate.layout.tokenizer_errors import named_load_error
from depthgate.spec.assemblers import assemble
from depthgate.spec.cases import Case, Suite
from depthgate.spec.files import atomic_write
from depthgate.spec.filler import filler_pool, filler_units
from depthgate.spec.positions import (
    SPACING_SEP,
    TURN_PREFIX,
    PositionLabel,
    is_spacing_label,
    spacing_gap,
)

__all__ = [
    "ASSEMBLER_VERSION",
    "BUILT_SCHEMA",
    "LAYOUT_SCHEMA",
    "SPACING_SCHEMA",
    "BuildOptions",
    "Position",
    "Tokenizer",
    "assembler_version",
    "build_batch",
    "build_frame",
    "build_layouts",
    "case_frame",
    "load_tokenizer",
    "parse_positions",
    "read_layouts",
]

ASSEMBLER_VERSION: str = _core.ASSEMBLER_VERSION

Verification = Literal["full", "fast"]

# Cases per core call. Chosen so one chunk of 128K-token layouts stays near 64 MB of ids + text
# (each layout ≈ 0.5 MB of ids and ≈ 0.5 MB of text).
_CASES_PER_CHUNK = 8

# Tokens one core call builds at most (cases × lengths × positions), down to one case per call: at
# 128K × 5 depths a call of 8 cases held ≈ 5 M tokens of ids and text several times over (the core's
# output, the Python frame, the Arrow table of the write), the larger part of a long build's peak.
_TOKENS_PER_CALL = 1 << 21


def _cases_per_call(options: BuildOptions) -> int:
    per_case = sum(options.lengths) * max(len(options.positions), 1)
    return max(1, min(_CASES_PER_CHUNK, _TOKENS_PER_CALL // max(per_case, 1)))


_SPAN_STRUCT = pl.Struct(
    {
        "evidence_id": pl.String,
        "kind": pl.String,
        "token_start": pl.Int64,
        "token_end": pl.Int64,
        "char_start": pl.Int64,
        "char_end": pl.Int64,
        "sha256": pl.String,
    }
)

LAYOUT_SCHEMA: dict[str, Any] = {
    "layout_id": pl.String,
    "case_id": pl.String,
    "system": pl.String,
    "target_tokens": pl.Int64,
    "position": pl.String,
    "total_tokens": pl.Int64,
    "token_ids": pl.List(pl.UInt32),
    "text": pl.String,
    "add_special_tokens": pl.Boolean,
    "evidence_spans": pl.List(_SPAN_STRUCT),
    "requested_offset": pl.Int64,
    "actual_offset": pl.Int64,
    "snap_tokens": pl.Int64,
    "region_start": pl.Int64,
    "region_end": pl.Int64,
    "status": pl.String,
    "reason_code": pl.String,
    "reason": pl.String,
    "verification": pl.String,
    "verification_note": pl.String,
    "tokenizer_digest": pl.String,
    "template_digest": pl.String,
    "pinned_date": pl.String,
    "assembler_version": pl.String,
    "case_digest": pl.String,
}

#: Evidence spacing (issue #13 item 5), after the layout columns of every built layouts file:
#: ``spacing`` (the label: adjacent, near, far, <N>tok), ``evidence_gaps`` (the MEASURED tokens between
#: consecutive decisive documents, in text order, read from the final spans) and ``evidence_gap_tokens``
#: (the smallest of them; null with fewer than two decisive documents or on a refused layout).
SPACING_SCHEMA: dict[str, Any] = {
    "spacing": pl.String,
    "evidence_gaps": pl.List(pl.Int64),
    "evidence_gap_tokens": pl.Int64,
}
BUILT_SCHEMA: dict[str, Any] = {**LAYOUT_SCHEMA, **SPACING_SCHEMA}

#: The gap filler between decisive documents comes from its own filler stream (this offset added to the
#: filler seed), so it never repeats the haystack's sentences around it; its texts are bound into the
#: layout id through the case digest the core hashes.
_GAP_SEED_OFFSET = 7919


class Tokenizer:
    """A target tokenizer loaded by the Rust core (the same bytes both sides tokenize with)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._core = _core.Tokenizer.from_file(str(self.path))
        except InputError as exc:
            raise named_load_error(self.path, exc) from None

    @property
    def digest(self) -> str:
        return self._core.digest

    @property
    def bos_id(self) -> int | None:
        """The id the post-processor puts first with ``add_special_tokens`` (BOS, ``[CLS]``), or None."""
        return self._core.bos_id

    @property
    def fast_unsound_reason(self) -> str | None:
        """Why junction-local ("fast") verification is not sound for this tokenizer, or None."""
        return self._core.fast_unsound_reason

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray[Any, np.dtype[np.uint32]]:
        return self._core.encode(text, add_special_tokens)


def load_tokenizer(spec: str | Path, *, base_dir: Path | None = None) -> Tokenizer:
    """The tokenizer a matrix, a CLI flag or a test names: a ``tokenizer.json`` (or ``.json.gz``)
    path, relative to ``base_dir`` (the matrix's folder), or ``gguf:`` / ``gguf:<file>``
    (:func:`depthgate.layout.gguf_tokenizer.resolve_tokenizer_path`)."""
    return Tokenizer(resolve_tokenizer_path(str(spec), base_dir=base_dir))


@dataclass(frozen=True)
class Position:
    """A named depth in [0, 1] of the context region, or an absolute token offset of the evidence;
    ``spacing``: the evidence spacing of multi-evidence cases (``"adjacent"``, or carried in the label
    as ``"0.5~far"``)."""

    label: str
    depth: float | None = None
    offset: int | None = None
    spacing: str = "adjacent"
    # A conversation turn (``"@turn:3"``): the evidence in the middle of that turn's content.
    turn: int | None = None

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"label": self.label, "depth": self.depth, "offset": self.offset}
        if self.turn is not None:
            spec["turn"] = self.turn
        return spec


def parse_positions(values: Sequence[float | str]) -> list[Position]:
    """``0.5`` / ``"0.5"`` → depth; ``"@1200"`` → absolute offset; ``"@turn:3"`` → a conversation's turn;
    any may carry an evidence spacing,
    ``"0.5~far"``, ``"@1200~near"``, ``"1~300tok"`` (``Matrix.position_values``)."""
    out: list[Position] = []
    for raw in values:
        parsed = PositionLabel.parse(str(raw).strip())
        text, spacing = parsed.base.strip(), parsed.spacing
        if not is_spacing_label(spacing):
            raise InputError(
                f"position {raw!r} has the unknown spacing {spacing!r}",
                field="positions",
                fix="write a spacing as <position>~near, ~far or ~<N>tok (e.g. 0.5~far), or leave it off",
            )
        suffix = "" if spacing == "adjacent" else f"{SPACING_SEP}{spacing}"
        if text.startswith(TURN_PREFIX):
            turn = PositionLabel(text).turn
            if turn is None:
                raise InputError(
                    f"position {text!r} is not a turn",
                    field="positions",
                    fix="write a turn as @turn:<K>, K >= 1 (a conversation's turn, counted from 1)",
                )
            out.append(Position(label=text + suffix, turn=turn, spacing=spacing))
            continue
        if text.startswith("@"):
            try:
                offset = int(text[1:])
            except ValueError:
                raise InputError(
                    f"position {text!r} is not an absolute offset",
                    field="positions",
                    fix="write absolute offsets as @<tokens>, e.g. @1200",
                ) from None
            if offset < 0:
                raise InputError(f"offset {text} is negative", field="positions", fix="use @0 or more")
            out.append(Position(label=str(PositionLabel(text, spacing)), offset=offset, spacing=spacing))
            continue
        try:
            depth = float(text)
        except ValueError:
            raise InputError(
                f"position {text!r} is neither a depth nor an offset",
                field="positions",
                fix="give depths in [0, 1] (0,0.25,0.5,0.75,1) or offsets like @1200",
            ) from None
        if not 0.0 <= depth <= 1.0:
            raise InputError(
                f"depth {depth} is outside [0, 1]",
                field="positions",
                fix="use a depth between 0 (start of the context) and 1 (end), or an offset @N",
            )
        label = PositionLabel(f"{depth:g}", spacing)
        out.append(Position(label=str(label), depth=depth, spacing=spacing))
    return out


# Document header and question lines per language. The frame prefix must end with non-whitespace
# and the suffix starts with a paragraph break, so the seams around the context are exact.
def case_frame(
    case: Case,
    *,
    template: ChatTemplate | None,
    preamble: str = "",
    assembler: str = "default",
    conversation: Conversation | None = None,
) -> Frame:
    """The frame of one case: the prompt assembler's text before and after the context
    (:mod:`depthgate.spec.assemblers`), rendered through ``template`` (raw completion frame when None),
    as one user turn or, with ``conversation``, a multi-turn chat (layout/conversation.py)."""
    parts = assemble(assembler, case, preamble)
    if conversation is not None:
        if template is None:
            raise SpecError(
                'shape = "conversation" needs a chat template',
                field="shape",
                fix="give the system a chat_template",
            )
        return conversation_frame(
            template,
            turns=conversation.fixed_turns(),
            system=conversation.system,
            user_before=parts.before,
            user_after=parts.after,
            answer_prefix=parts.answer,
            exchanges=exchanges_of(case, conversation),
        )
    if template is None:
        return raw_frame(user_before=parts.before, user_after=parts.after, answer_prefix=parts.answer)
    return chat_frame(
        template, system=None, user_before=parts.before, user_after=parts.after, answer_prefix=parts.answer
    )


def assembler_version(assembler: str) -> str:
    """The assembler part of every layout id: the algorithm version, plus the prompt assembler's name
    when it is not the default (default ids are unchanged)."""
    return ASSEMBLER_VERSION if assembler == "default" else f"{ASSEMBLER_VERSION}+{assembler}"


def _distractor_depths(case: Case) -> list[float]:
    """Distractors spread evenly over 3–97% of the haystack with a fixed per-case jitter and order
    (research/gemma_position_pilot.md §3): identical at every position of the case."""
    n = len(case.distractors)
    if n == 0:
        return []
    seed = int.from_bytes(hashlib.sha256(case.id.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    base = np.linspace(0.03, 0.97, n)
    jitter = rng.uniform(-0.4, 0.4, n) * (0.94 / max(n, 1))
    depths = np.clip(base + jitter, 0.0, 0.99)
    rng.shuffle(depths)
    return [float(d) for d in depths]


def _case_spec(
    case: Case, frame: Frame, filler_offset: int, gaps: Sequence[Sequence[str]] = ()
) -> dict[str, Any]:
    """The core's spec of one case. ``gaps``: for a non-adjacent spacing, the filler units between
    consecutive decisive documents (one list per pair), inside the one moving block, as kind "filler"
    (no span, never evidence); the block still moves as a whole, so the design stays paired."""
    moving: list[dict[str, Any]] = []
    for index, d in enumerate(case.decisive):
        moving += gap_units(case.id, index, gaps)
        moving.append({"id": d.id, "text": d.text, "kind": "evidence"})
    case_digest = case.digest()
    if gaps:  # the gap texts are part of what the layout id binds
        case_digest = _fields_digest([case_digest, *(t for gap in gaps for t in (SPACING_SEP, *gap))])
    exchanges = exchange_block(case, frame, gaps) if frame.exchanges else {}
    if exchanges:  # MRCR needles as exchanges: another block than the same case's text block
        case_digest = _fields_digest([case_digest, "mrcr-exchanges"])
    anchored: list[dict[str, Any]] = []
    for doc in case.competing:
        depth = case.competing_depth if case.competing_depth is not None else 0.5
        anchored.append({"id": doc.id, "text": doc.text, "kind": "evidence", "depth": depth})
    for dist, depth in zip(case.distractors, _distractor_depths(case), strict=True):
        anchored.append({"id": dist.id, "text": dist.text, "kind": "distractor", "depth": depth})
    return {
        "case_id": case.id,
        "case_digest": case_digest,
        "prefix": frame.prefix,
        "suffix": frame.suffix,
        "moving": moving,
        "anchored": anchored,
        "filler_offset": filler_offset,
        **({"turns": list(frame.separators)} if frame.separators else {}),
        **exchanges,
    }


class _GapFiller:
    """Filler units between decisive documents for a nominal gap in tokens, from the gap stream of one
    language; unit token counts are read once per build (an isolated encode: the gap a layout records
    is measured on its final encoding, this only chooses the units)."""

    def __init__(self, tokenizer: Tokenizer, seed: int, language: str, count: int) -> None:
        self._tokenizer = tokenizer
        # Sentences that continue a paragraph (" ..."), no headings or paragraph starts ("\n..."): a
        # decisive document's last "." followed by "\n\n" is one token in Llama-3 (".\n\n"), which
        # would cut through the evidence edge inside the block, where no other boundary can be tried.
        units = filler_units(seed + _GAP_SEED_OFFSET, language, max(count, 64))
        self._units = [u for u in units if u.startswith(" ")]
        self._tokens: dict[int, int] = {}

    def _count(self, index: int) -> int:
        if index not in self._tokens:
            self._tokens[index] = len(self._tokenizer.encode(self._units[index]))
        return self._tokens[index]

    def units(self, gap: int, start: int) -> list[str]:
        """Consecutive units from ``start`` (wrapping) whose token counts sum closest to ``gap`` (at
        least one unit)."""
        n = len(self._units)
        chosen: list[int] = []
        total = 0
        while total < gap and len(chosen) < n:
            index = (start + len(chosen)) % n
            chosen.append(index)
            total += self._count(index)
        if len(chosen) > 1 and total - gap > gap - (total - self._count(chosen[-1])):
            chosen.pop()
        return [self._units[i] for i in chosen]


def _spacing_groups(positions: Sequence[Position]) -> list[tuple[str, list[Position]]]:
    """Positions by spacing, in first-seen order (the adjacent ones build exactly as before)."""
    groups: dict[str, list[Position]] = {}
    for p in positions:
        groups.setdefault(p.spacing, []).append(p)
    return list(groups.items())


def _gap_batches(spacing: str, lengths: Sequence[int]) -> list[tuple[list[int], int]]:
    """Lengths that share one nominal gap (one core call each): all of them for adjacent, near and
    explicit gaps, one per length for far (a fraction of the length)."""
    by_gap: dict[int, list[int]] = {}
    for length in lengths:
        by_gap.setdefault(spacing_gap(spacing, length), []).append(length)
    return [(ls, gap) for gap, ls in by_gap.items()]


@dataclass(frozen=True)
class BuildOptions:
    """Everything besides the cases that determines a layout."""

    lengths: Sequence[int]
    positions: Sequence[Position]
    template: ChatTemplate | None = None
    preamble: str = ""
    system: str = "default"
    assembler: str = "default"
    verification: Verification = "full"
    window: int | None = None
    max_output_tokens: int = 16
    filler_seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    conversation: Conversation | None = None


def _filler_for(language: str, seed: int, max_length: int, n_cases: int) -> tuple[list[str], list[str], int]:
    # Short units are ~4 tokens; the stream must cover the longest length from any case's offset.
    stride = 97
    span = stride * max(n_cases, 1) % 4096 + stride
    count = max_length // 4 + span + 64
    return filler_units(seed, language, count), filler_pool(seed, language, 400), stride


def _fields_digest(fields: Sequence[str]) -> str:
    """Same bytes as the core's ``digest::sha256_fields``: each field length-prefixed (u64 LE)."""
    h = hashlib.sha256()
    for text in fields:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _chunks(cases: Sequence[Case], size: int) -> Iterator[Sequence[Case]]:
    for start in range(0, len(cases), size):
        yield cases[start : start + size]


def _check_build_inputs(
    cases: Sequence[Case], options: BuildOptions, groups: Sequence[tuple[str, list[Position]]]
) -> None:
    if not cases:
        raise SpecError(
            "no case with decisive evidence to place", field="cases", fix="use a suite with cases"
        )
    if not options.lengths:
        raise InputError("no lengths given", field="lengths", fix="pass --lengths 1024,4096")
    for length in options.lengths:
        if length < 16:
            raise InputError(f"length {length} is too small", field="lengths", fix="use lengths >= 16 tokens")
    spaced = [label for label, _ in groups if label != "adjacent"]
    if spaced and not any(len(c.decisive) >= 2 for c in cases):
        raise SpecError(
            f"spacing {spaced[0]!r} needs a case with two or more decisive documents; every case of this "
            "suite has one, so every spacing would build the same prompt",
            field="spacings",
            fix='use a suite with multi-evidence cases, or spacings = ["adjacent"]',
        )


@dataclass(frozen=True)
class _BuildFiller:
    """One language's filler for a whole build: the units and pool (with the offset stride between
    cases), their digest (hashed once per build, not once per batch in the core), their JSON (encoded
    once and spliced into every chunk's spec) and the gap filler of spaced layouts (None: no spacing)."""

    units: list[str]
    stride: int
    digest: str
    json: str
    gap: _GapFiller | None


def _build_fillers(
    cases: Sequence[Case], tokenizer: Tokenizer, options: BuildOptions, spaced: bool
) -> dict[str, _BuildFiller]:
    out: dict[str, _BuildFiller] = {}
    for lang in {c.language for c in cases}:
        units, pool, stride = _filler_for(lang, options.filler_seed, max(options.lengths), len(cases))
        out[lang] = _BuildFiller(
            units=units,
            stride=stride,
            digest=_fields_digest([*units, *pool]),
            json=f'"filler": {json.dumps(units)}, "pool": {json.dumps(pool)}',
            gap=_GapFiller(tokenizer, options.filler_seed, lang, len(units)) if spaced else None,
        )
    return out


def _core_calls(
    chunk_index: int, chunk: Sequence[Case], options: BuildOptions, fillers: Mapping[str, _BuildFiller]
) -> list[tuple[str, list[Case], list[int]]]:
    """The (language, cases, filler offsets) of each core call of one chunk. Long lengths go to the core
    in smaller calls (same cases, offsets and row order: only the memory of one call shrinks, #21)."""
    by_lang: dict[str, list[Case]] = {}
    for case in chunk:
        by_lang.setdefault(case.language, []).append(case)
    per_call = _cases_per_call(options)
    return [
        (lang, group[start : start + per_call], offsets[start : start + per_call])
        for lang, group in sorted(by_lang.items())
        for offsets in [
            [((chunk_index * _CASES_PER_CHUNK + i) * fillers[lang].stride) % 4096 for i in range(len(group))]
        ]
        for start in range(0, len(group), per_call)
    ]


def _build_call(
    tokenizer: Tokenizer,
    options: BuildOptions,
    groups: Sequence[tuple[str, list[Position]]],
    filler: _BuildFiller,
    lang_cases: Sequence[Case],
    offsets: Sequence[int],
) -> Iterator[pl.DataFrame]:
    """The built frames of one language group of cases: one core call per spacing (and per nominal
    gap)."""
    frames = [
        case_frame(
            c,
            template=options.template,
            preamble=options.preamble,
            assembler=options.assembler,
            conversation=options.conversation,
        )
        for c in lang_cases
    ]
    frame0 = frames[0]
    if len({f.add_special_tokens for f in frames}) != 1:
        raise SpecError("cases render with different BOS handling", field="chat_template")
    # The moving block differs by spacing; the haystack of a case × length does not, so a case's spacings
    # stay paired. A case with one decisive document has no spacing: it is laid out at adjacent positions
    # only (at a spaced label it would repeat its adjacent prompt and dilute the spaced slice's Δ).
    for spacing, group in groups:
        members = [
            (c, f, off)
            for c, f, off in zip(lang_cases, frames, offsets, strict=True)
            if spacing == "adjacent" or len(c.decisive) >= 2
        ]
        if not members:
            continue
        for lengths, gap in _gap_batches(spacing, options.lengths):
            specs = [
                _case_spec(
                    c,
                    f,
                    off,
                    [filler.gap.units(gap, off + 1009 * pair) for pair in range(len(c.decisive) - 1)]
                    if gap and filler.gap is not None
                    else (),
                )
                for c, f, off in members
            ]
            batch = {
                "assembler_version": assembler_version(options.assembler),
                "template_digest": frame0.template_digest,
                "add_special_tokens": frame0.add_special_tokens,
                "verification": options.verification,
                "window": options.window,
                "max_output_tokens": options.max_output_tokens,
                "filler_digest": filler.digest,
                "cases": specs,
                "lengths": list(lengths),
                "positions": [p.to_spec() for p in group],
            }
            spec_json = f"{json.dumps(batch)[:-1]}, {filler.json}}}"
            ids, offs, texts, meta_json = _core.build_layout_columns(tokenizer._core, spec_json)
            built = _to_frame(
                ids,
                offs,
                texts,
                json.loads(meta_json),
                tokenizer,
                frame0,
                options.system,
                {c.id: c.digest() for c in lang_cases},
                assembler=assembler_version(options.assembler),
                decisive={s["case_id"]: _decisive_ids(s) for s in specs},
            )
            if options.conversation is not None and options.template is not None:
                # Each conversation layout re-rendered whole by the template.
                prove_cases(
                    options.template,
                    options.conversation,
                    built,
                    [(c, f) for c, f, _ in members],
                    assembler=options.assembler,
                    preamble=options.preamble,
                )
            yield built


def build_layouts(
    suite: Suite | Sequence[Case],
    tokenizer: Tokenizer,
    options: BuildOptions,
    out_path: str | Path,
) -> pl.DataFrame:
    """Build every case × length × position layout and write ``out_path`` (parquet) atomically.

    Returns a summary frame (no ids or text): one row per layout with its status and reason.
    Evidence-absent cases have nothing to place; they are controls, not position variants, and are
    skipped here (see ``depthgate.spec.suites``).
    """
    cases = [c for c in (suite.cases if isinstance(suite, Suite) else suite) if c.decisive]
    groups = _spacing_groups(options.positions)
    _check_build_inputs(cases, options, groups)
    check_template_bos(options.template, tokenizer.bos_id)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=".layouts-", dir=out_path.parent))
    summaries: list[pl.DataFrame] = []
    try:
        fillers = _build_fillers(cases, tokenizer, options, any(label != "adjacent" for label, _ in groups))
        sink = layout_sink.LayoutSink(tmp_dir, BUILT_SCHEMA, row_group_rows=layout_sink.ROW_GROUP_ROWS)
        # One batch per turn count: a turn_tokens conversation's lengths differ in it (one frame each).
        turns = [] if options.conversation is None else options.conversation.batches(options.lengths)
        batches = [replace(options, lengths=ls, conversation=c) for c, ls in turns] or [options]
        for chunk_index, chunk in enumerate(_chunks(cases, _CASES_PER_CHUNK)):
            for lang, lang_cases, offsets in _core_calls(chunk_index, chunk, options, fillers):
                for batch in batches:
                    for frame in _build_call(tokenizer, batch, groups, fillers[lang], lang_cases, offsets):
                        sink.add(frame)
                        summaries.append(frame.drop("token_ids", "text"))
        atomic_write(out_path, sink.finish)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return pl.concat(summaries) if summaries else pl.DataFrame(schema=BUILT_SCHEMA)


def _decisive_ids(spec: Mapping[str, Any]) -> frozenset[str]:
    """The moving evidence units of a core case spec: the decisive documents."""
    return frozenset(u["id"] for u in spec["moving"] if u["kind"] == "evidence")


def _spacing_fields(meta: Mapping[str, Any], decisive: frozenset[str]) -> tuple[str, list[int], int | None]:
    """(spacing label, measured gaps between consecutive decisive spans, the smallest gap or None)."""
    spacing = PositionLabel.parse(meta["position"]).spacing
    spans = sorted((s["token_start"], s["token_end"]) for s in meta["spans"] if s["unit_id"] in decisive)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    return spacing, gaps, min(gaps) if gaps else None


def _spaced_request(meta: dict[str, Any], decisive: frozenset[str]) -> None:
    """Re-read ``requested_offset`` and ``snap_tokens`` of a spaced depth layout with the whole moving
    block (gap filler included) taken out of the haystack, as the core does for an adjacent block (the
    core counts only the block's evidence spans)."""
    label = PositionLabel.parse(meta["position"])
    base = label.base
    spans = [s for s in meta["spans"] if s["unit_id"] in decisive]
    if meta["status"] != "ok" or label.is_offset or not spans or meta["actual_offset"] is None:
        return
    block = max(s["token_end"] for s in spans) - min(s["token_start"] for s in spans)
    room = meta["region_end"] - meta["region_start"] - block
    requested = meta["region_start"] + math.floor(float(base) * room + 0.5)
    meta["requested_offset"] = requested
    meta["snap_tokens"] = meta["actual_offset"] - requested


def _to_frame(
    ids: np.ndarray[Any, np.dtype[np.uint32]],
    offsets: np.ndarray[Any, np.dtype[np.uint64]],
    texts: list[str],
    meta: list[dict[str, Any]],
    tokenizer: Tokenizer,
    frame: Frame,
    system: str,
    case_digests: dict[str, str],
    *,
    assembler: str = ASSEMBLER_VERSION,
    decisive: Mapping[str, frozenset[str]] | None = None,
) -> pl.DataFrame:
    rows = np.split(ids, offsets[1:-1].astype(np.int64)) if len(meta) else []
    data: dict[str, list[Any]] = {name: [] for name in BUILT_SCHEMA}
    for m in meta:
        ids_of = (decisive or {}).get(m["case_id"], frozenset())
        spacing, gaps, smallest = _spacing_fields(m, ids_of)
        if spacing != "adjacent":
            _spaced_request(m, ids_of)
        data["spacing"].append(spacing)
        data["evidence_gaps"].append(gaps)
        data["evidence_gap_tokens"].append(smallest)
        data["layout_id"].append(m["layout_id"])
        data["case_id"].append(m["case_id"])
        data["system"].append(system)
        data["target_tokens"].append(m["target_tokens"])
        data["position"].append(m["position"])
        data["total_tokens"].append(m["total_tokens"])
        data["add_special_tokens"].append(m["add_special_tokens"])
        data["evidence_spans"].append(
            [
                {
                    "evidence_id": s["unit_id"],
                    "kind": s["kind"],
                    "token_start": s["token_start"],
                    "token_end": s["token_end"],
                    "char_start": s["char_start"],
                    "char_end": s["char_end"],
                    "sha256": s["sha256"],
                }
                for s in m["spans"]
            ]
        )
        for key in (
            "requested_offset",
            "actual_offset",
            "snap_tokens",
            "region_start",
            "region_end",
            "reason_code",
            "reason",
            "verification",
            "verification_note",
        ):
            data[key].append(m[key])
        data["status"].append(m["status"])
        data["tokenizer_digest"].append(tokenizer.digest)
        data["template_digest"].append(frame.template_digest)
        data["pinned_date"].append(frame.pinned_date)
        data["assembler_version"].append(assembler)
        data["case_digest"].append(case_digests[m["case_id"]])
    data["token_ids"] = list(rows)
    data["text"] = texts
    if frame.separators:
        return pl.DataFrame(
            {**data, **turn_columns(meta, frame.roles)}, schema={**BUILT_SCHEMA, **TURN_SCHEMA}
        )
    return pl.DataFrame(data, schema=BUILT_SCHEMA)


def build_batch(tokenizer: Tokenizer, batch: dict[str, Any], *, system: str = "default") -> pl.DataFrame:
    """Build one raw batch spec (the JSON the core takes) into a frame with ids — for tests and tools
    that assemble their own units. ``build_layouts`` is the product path."""
    ids, offsets, texts, meta_json = _core.build_layout_columns(tokenizer._core, json.dumps(batch))
    frame = Frame(
        prefix="",
        suffix="",
        kind="raw",
        template_digest=batch["template_digest"],
        pinned_date="",
        add_special_tokens=batch["add_special_tokens"],
    )
    return _to_frame(
        ids,
        offsets,
        texts,
        json.loads(meta_json),
        tokenizer,
        frame,
        system,
        {c["case_id"]: c["case_digest"] for c in batch["cases"]},
        assembler=str(batch.get("assembler_version", ASSEMBLER_VERSION)),
        decisive={c["case_id"]: _decisive_ids(c) for c in batch["cases"]},
    )


def build_frame(
    suite: Suite | Sequence[Case], tokenizer: Tokenizer, options: BuildOptions, out_path: str | Path
) -> pl.DataFrame:
    """:func:`build_layouts` into ``out_path``, then the whole file read back (:func:`read_layouts`):
    for the small builds of ``diff``, the fault injection and tests. A matrix build reads its file in
    column subsets instead: ids and text of every layout are ≈ 8 bytes per token."""
    build_layouts(suite, tokenizer, options, out_path)
    return read_layouts(out_path)


def read_layouts(path: str | Path, columns: Sequence[str] | None = None) -> pl.DataFrame:
    """Read a layouts file, refusing files that are not depthgate layouts. ``columns``: read only
    these (the small ones, e.g. for the gate's job plan), never the ids and text of every layout —
    those are ≈ 8 bytes per token, 10 GB for a 10,000-layout 128K matrix."""
    path = Path(path)
    if not path.is_file():
        raise InputError("layouts file not found", file=str(path), fix="run `depthgate build` first")
    try:
        names = list(pl.read_parquet_schema(path))
        frame = pl.read_parquet(path, columns=[c for c in columns if c in names]) if columns else None
        if frame is None:
            frame = pl.read_parquet(path)
    except Exception as exc:  # polars raises several types for a truncated/corrupt file
        raise InputError(
            f"cannot read parquet: {exc}", file=str(path), fix="rebuild it with `depthgate build`"
        ) from None
    missing = [c for c in ("layout_id", "token_ids", "text", "evidence_spans", "status") if c not in names]
    missing += [c for c in columns or () if c not in names and c not in missing]
    if missing:
        raise InputError(
            f"not a layouts file: missing columns {missing}",
            file=str(path),
            fix="pass a layouts.parquet written by `depthgate build`",
        )
    return frame

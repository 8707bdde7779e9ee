"""The pre-send gate: the one check every command runs on layouts before a request is sent.

Every ``ok`` layout must have been built under the system's tokenizer (digest), pass the Rust pre-send
checks against the *served* window, the system's template digest and pinned template date and the
tokenizer's own BOS id, start and end with the frame the system renders *now* for its case, and
re-encode to its stored ids with its spans on the final offsets. Every expected value comes from the
system (template, preamble, tokenizer, served window), never from the layout file: a check that
compares a layout's column with itself never fires. A violation turns the layout into ``refused`` with
a named ``reason_code``; it is never a warning and never a silent drop. ``depthgate run`` and
``depthgate faults`` both call :func:`guard_layouts`; the faults command proves each check catches its
fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from depthgate import _core
from depthgate.exceptions import TemplateError
from depthgate.layout.conversation import Conversation
from depthgate.layout.layouts import Tokenizer, case_frame
from depthgate.layout.templates import ChatTemplate, Frame, raw_frame
from depthgate.spec.cases import Case

__all__ = ["REASON_PRIORITY", "guard_layouts"]

#: Violation codes from most specific (a diagnosis) to most generic (a symptom). A layout's reason is
#: its highest-ranked code; ties go to the pre-send check.
REASON_PRIORITY: tuple[str, ...] = (
    "stale_tokenizer",
    "template_digest",
    "pinned_date",
    "frame_mismatch",
    "window_overflow",
    "doubled_bos",
    "duplicated_distractor",
    "evidence_not_once",
    "units_reordered",
    "ids_mismatch",
    "length_mismatch",
    "span_out_of_range",
    "span_hash",
    "span_offsets",
    "evidence_missing",
)


def _spans_json(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    # The core reads a stored span's evidence_id as its unit id: spans cross as stored.
    return list(row["evidence_spans"] or [])


def _rank(code: str) -> int:
    base = code.split("_", 1)[1] if code.startswith(("presend_", "verify_")) else code
    try:
        return REASON_PRIORITY.index(base) * 2 + (0 if code.startswith("presend_") else 1)
    except ValueError:
        return len(REASON_PRIORITY) * 2


def _unit_texts(cases: Mapping[str, Case]) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in cases.values():
        for doc in case.evidence:
            out[doc.id] = doc.text
        for dist in case.distractors:
            out[dist.id] = dist.text
    return out


def _reordered(row: Mapping[str, Any], texts: Mapping[str, str]) -> bool:
    """Every recorded unit still occurs exactly once, but not in the recorded order."""
    spans = sorted(row["evidence_spans"] or [], key=lambda s: s["char_start"])
    found: list[int] = []
    prompt = str(row["text"])
    for span in spans:
        unit = texts.get(span["evidence_id"])
        if unit is None:
            return False
        needle = unit.lstrip()
        at = prompt.find(needle)
        if at < 0 or prompt.find(needle, at + 1) >= 0:
            return False
        found.append(at)
    return len(found) >= 2 and found != sorted(found)


_RAW_DIGEST = raw_frame(user_before="", user_after="").template_digest


def _frame_violation(
    row: Mapping[str, Any], expected: Frame | TemplateError, turn_spans: Sequence[Mapping[str, Any]] = ()
) -> tuple[str, str] | None:
    """The layout's prompt must be ``prefix + context + suffix`` of the frame the system renders now; a
    conversation's (issue 25) must also hold, between consecutive turns' recorded content spans, exactly
    the separator the system's template renders there now (end of turn, role header, lead), and record
    one span per turn. A conversation layout sent to a single-slot system, or the reverse, is a mismatch."""
    if isinstance(expected, TemplateError):
        return ("presend_frame_mismatch", f"the system's template cannot frame this case: {expected.message}")
    text = str(row["text"])
    if not (text.startswith(expected.prefix) and text.endswith(expected.suffix)):
        where = "start" if not text.startswith(expected.prefix) else "end"
        return (
            "presend_frame_mismatch",
            f"the prompt's {where} differs from the frame the system renders now (template, preamble or "
            "instruction changed since the build); rebuild the layout",
        )
    turns = len(expected.separators) + 1 if expected.separators else 0
    if len(turn_spans) != turns:
        shape = f"a {turns}-turn conversation" if turns else "a single-slot prompt"
        return (
            "presend_frame_mismatch",
            f"the layout records {len(turn_spans)} turn spans but the system renders {shape}; rebuild the "
            "layout with the matrix's shape and turns",
        )
    for k, separator in enumerate(expected.separators):
        between = text[turn_spans[k]["char_end"] : turn_spans[k + 1]["char_start"]]
        if between != separator:
            return (
                "presend_frame_mismatch",
                f"the text between turns {k + 1} and {k + 2} differs from what the system's template renders "
                "there now (turn markers, role header or lead changed since the build); rebuild the layout",
            )
    return None


#: The core's detail for a layout with no evidence span at all (rust/depthgate-core/src/checks.rs).
_NO_EVIDENCE_SPAN = "the layout records no evidence span"


def guard_layouts(
    frame: pl.DataFrame,
    *,
    tokenizer: Tokenizer,
    window: int | None,
    max_output_tokens: int,
    template: ChatTemplate | None = None,
    preamble: str = "",
    assembler: str = "default",
    template_digest: str | None = None,
    pinned_date: str | None = None,
    cases: Mapping[str, Case] | None = None,
    bos_id: int | None = None,
    verify: bool = True,
    conversation: Conversation | None = None,
) -> pl.DataFrame:
    """The pre-send gate of one system: every ``ok`` layout must be built under the system's tokenizer
    (digest), pass the Rust pre-send checks against the *served* window, the system's frame and the
    tokenizer's BOS, and — with ``verify`` — re-encode to its stored ids with its spans on the final
    offsets.

    The system's frame is ``template`` (its chat template now; None: the raw completion frame) with
    ``preamble`` and prompt ``assembler``: the expected template digest and pinned date come from it,
    and with ``cases`` every layout's prompt must start and end with the frame the system renders now
    for its case (``presend_frame_mismatch``: a preamble, assembler or instruction change that the
    template digest cannot see).
    ``template_digest`` (and ``pinned_date``) may be given instead of ``template`` by callers that only
    know the digest; the date is then checked when it is given or the digest is the raw frame's, and the
    frame only for the raw frame. ``bos_id`` defaults to the tokenizer's own (the id its post-processor
    puts first), so a rendered BOS plus an added one is ``presend_doubled_bos``. ``conversation`` (issue
    25): the frame is that conversation's, its separators checked at the layout's turn spans.

    A layout with any violation becomes ``refused`` with the most specific code as ``reason_code``
    (``verify_*`` / ``presend_*``, see :data:`REASON_PRIORITY`) and every violation in ``reason``. With
    ``cases``, span-hash failures where every unit is still present once but in another order are
    diagnosed as ``presend_units_reordered``. Rows already refused are kept as they are.
    """
    system_known = template_digest is None
    if template is not None and template_digest is not None and template_digest != template.digest:
        raise ValueError("template_digest contradicts template; pass one of them")
    expected_digest = template_digest or (template.digest if template is not None else _RAW_DIGEST)
    if pinned_date is None and (system_known or expected_digest == _RAW_DIGEST):
        pinned_date = template.pinned_date.isoformat() if template is not None else ""
    check_frames = cases is not None and (system_known or expected_digest == _RAW_DIGEST)
    frames: dict[tuple[str, int], Frame | TemplateError] = {}
    if bos_id is None:
        bos_id = tokenizer.bos_id
    contract = _contract(window, max_output_tokens, expected_digest, pinned_date, bos_id)
    statuses = frame["status"].to_list()
    found: list[list[tuple[str, str]]] = [[] for _ in statuses]
    # An evidence-absent control (run/controls.py) has no evidence span by design when its case has no
    # competing document (single, conflict, negation ... cases): "no evidence span" is what it must be
    # there, not a lost document. Every other check still applies to it.
    controls = frame["control"].to_list() if "control" in frame.columns else [None] * len(statuses)
    no_evidence_by_design = {i for i, kind in enumerate(controls) if kind == "evidence_absent"}
    ok_index = [i for i, status in enumerate(statuses) if status == "ok"]
    texts = _unit_texts(cases) if cases else {}
    for start in range(0, len(ok_index), _BLOCK_ROWS):
        index = ok_index[start : start + _BLOCK_ROWS]
        block = _Block.take(frame, index, all_rows=len(ok_index) == frame.height)
        for j, i in enumerate(index):
            if block.tokenizer_digests[j] not in (None, tokenizer.digest):
                found[i].append(
                    (
                        "verify_stale_tokenizer",
                        "built under another tokenizer (digest differs); rebuild the layout",
                    )
                )
            found[i].extend(block.problems.get(j, []))
        # One Rust call for the block's pre-send checks (rows with missing fields are left out).
        reports = block.presend(contract)
        for j, violations in reports.items():
            i = index[j]
            if i in no_evidence_by_design:
                violations = [
                    (c, d) for c, d in violations if (c, d) != ("evidence_missing", _NO_EVIDENCE_SPAN)
                ]
            found[i].extend((f"presend_{code}", detail) for code, detail in violations)
            if check_frames and cases is not None and block.case_ids[j] in cases:
                system = _System(template, preamble, assembler, conversation)
                case_id, text, turns = str(block.case_ids[j]), block.texts[j], block.turn_spans_of(j)
                target = int(block.targets[j])
                mismatch = _frame_check(frames, cases, (case_id, target), text, turns, system)
                if mismatch is not None:
                    found[i].append(mismatch)
            codes = {code for code, _ in found[i]}
            if (
                texts
                and codes & {"presend_evidence_missing", "presend_evidence_not_once"}
                and _reordered({"text": block.texts[j], "evidence_spans": block.spans_of(j)}, texts)
            ):
                found[i].append(
                    ("presend_units_reordered", "the documents are all present but in another order")
                )
        if verify:
            for j, verified in block.verify(tokenizer).items():
                found[index[j]].extend((f"verify_{v['code']}", str(v["detail"])) for v in verified)
    return _with_violations(frame, statuses, found)


def _contract(
    window: int | None,
    max_output_tokens: int,
    template_digest: str,
    pinned_date: str | None,
    bos_id: int | None,
) -> str:
    """The pre-send contract of the Rust checks, as JSON (``target_tokens``: each layout's own)."""
    return json.dumps(
        {
            "target_tokens": 0,
            "window": window,
            "max_output_tokens": max_output_tokens,
            "template_digest": template_digest,
            "pinned_date": pinned_date,
            "bos_id": bos_id,
        }
    )


@dataclass(frozen=True)
class _System:
    """What the frame a system renders now depends on besides the case."""

    template: ChatTemplate | None
    preamble: str
    assembler: str
    conversation: Conversation | None


def _frame_check(
    frames: dict[tuple[str, int], Frame | TemplateError],
    cases: Mapping[str, Case],
    layout: tuple[str, int],
    text: str,
    turn_spans: Sequence[Mapping[str, Any]],
    system: _System,
) -> tuple[str, str] | None:
    """The frame violation of one layout's prompt (``layout``: its case id and target length) against the
    frame its system renders now for its case at that length: a ``turn_tokens`` conversation's turn
    count follows the length (``frames`` caches them per case and turn count; a template that raises is
    the violation of every layout)."""
    case_id, target = layout
    conversation = system.conversation
    turns = 0 if conversation is None else conversation.turns_at(target)
    key = (case_id, turns)
    if key not in frames:
        try:
            frames[key] = case_frame(
                cases[case_id],
                template=system.template,
                preamble=system.preamble,
                assembler=system.assembler,
                conversation=None if conversation is None else conversation.at(target),
            )
        except TemplateError as exc:
            frames[key] = exc
    return _frame_violation({"text": text}, frames[key], turn_spans)


def _with_violations(
    frame: pl.DataFrame, statuses: Sequence[str], found: Sequence[Sequence[tuple[str, str]]]
) -> pl.DataFrame:
    """``frame`` with every ``ok`` row that has violations ``refused``: the most specific code (see
    :data:`REASON_PRIORITY`) as ``reason_code`` and every violation in ``reason``."""
    status: list[str] = []
    code_col: list[str | None] = []
    reason_col: list[str | None] = []
    old_codes = frame["reason_code"].to_list()
    old_reasons = frame["reason"].to_list()
    for row_status, old_code, old_reason, violations in zip(
        statuses, old_codes, old_reasons, found, strict=True
    ):
        if row_status != "ok" or not violations:
            status.append(row_status)
            code_col.append(old_code)
            reason_col.append(old_reason)
            continue
        ordered = sorted(violations, key=lambda v: _rank(v[0]))
        grouped: dict[str, list[str]] = {}
        for code, detail in ordered:
            grouped.setdefault(code, []).append(detail)
        status.append("refused")
        code_col.append(ordered[0][0])
        reason_col.append(
            "; ".join(
                f"{code}{f' ×{len(details)}' if len(details) > 1 else ''}: {details[0]}"
                for code, details in grouped.items()
            )
        )
    return frame.with_columns(
        pl.Series("status", status, dtype=pl.String),
        pl.Series("reason_code", code_col, dtype=pl.String),
        pl.Series("reason", reason_col, dtype=pl.String),
    )


# Layouts per pre-send call: one Rust call per block of rows, so the Python lists a call needs (the
# prompts, the span columns) stay bounded however many layouts a run sends.
_BLOCK_ROWS = 4096

# The columns a layout needs to be checked at all; a null one is a violation, not a crash. (Null spans
# are no spans: the checks then report the missing evidence.)
_REQUIRED = ("text", "token_ids", "target_tokens", "template_digest")
_SPAN_FIELDS = ("evidence_id", "kind", "token_start", "token_end", "char_start", "char_end", "sha256")


def _explode(column: pl.Series) -> pl.Series:
    """A list column's values, row after row (empty and null lists contribute nothing)."""
    try:
        return column.explode(empty_as_null=False, keep_nulls=False)
    except TypeError:  # polars without these options: leave the empty and null lists out first
        return column.filter(column.list.len() > 0).explode()


def _offsets(lengths: np.ndarray[Any, np.dtype[np.int64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    out = np.zeros(len(lengths) + 1, dtype=np.uint64)
    np.cumsum(lengths, out=out[1:])
    return out


class _Block:
    """One block of ``ok`` layouts as the column buffers the Rust checks take: the prompts, the flat
    token ids with row offsets, the flat span columns with row offsets. Built column-wise from the
    frame: no row becomes a Python dict and no id list a Python list (that conversion, and a Rust call
    per layout, were the whole cost of the old gate, docs/benchmarks.md)."""

    def __init__(self, rows: pl.DataFrame) -> None:
        n = rows.height
        self.rows = rows
        self.texts: list[str] = rows["text"].to_list()
        self.case_ids: list[Any] = rows["case_id"].to_list() if "case_id" in rows.columns else [None] * n
        self.targets: list[Any] = rows["target_tokens"].fill_null(0).to_list()
        self.tokenizer_digests: list[Any] = (
            rows["tokenizer_digest"].to_list() if "tokenizer_digest" in rows.columns else [None] * n
        )
        self.problems: dict[int, list[tuple[str, str]]] = {}
        missing = np.zeros(n, dtype=bool)
        for name in _REQUIRED:
            nulls = rows[name].is_null().to_numpy()
            for j in np.flatnonzero(nulls):
                self.problems.setdefault(int(j), []).append(
                    (
                        "presend_field_missing",
                        f"{name} is null; the layout was tampered with or truncated: rebuild it",
                    )
                )
            missing |= nulls
        ids = rows["token_ids"]
        flat = _explode(ids)
        if flat.dtype != pl.UInt32:
            flat = flat.cast(pl.UInt32, strict=False)  # out of range → null, flagged below
        if flat.null_count():
            bad = ids.list.eval(pl.element().cast(pl.UInt32, strict=False).is_null().any()).fill_null(False)
            for j in np.flatnonzero(bad.to_numpy() & ~missing):
                self.problems.setdefault(int(j), []).append(
                    (
                        "presend_ids_out_of_range",
                        "token_ids hold a null id or one outside 0..2^32-1: rebuild the layout",
                    )
                )
            missing |= bad.to_numpy()
        self.checked = np.flatnonzero(~missing)
        self._all = bool(self.checked.size == n)
        self._lengths = ids.list.len().fill_null(0).cast(pl.Int64).to_numpy()
        self.ids = (flat.fill_null(0) if flat.null_count() else flat).to_numpy()
        self.id_offsets = _offsets(self._lengths)
        spans = rows["evidence_spans"]
        span_lengths = spans.list.len().fill_null(0).cast(pl.Int64).to_numpy()
        self.span_offsets = _offsets(span_lengths)
        exploded = _explode(spans)
        if isinstance(exploded.dtype, pl.Struct):
            fields = exploded.struct.unnest()
        else:  # no row has a span (the column's inner type is Null)
            fields = pl.DataFrame(
                {name: pl.Series(name, [], dtype=pl.Int64) for name in _SPAN_FIELDS}
            ).with_columns(pl.col("evidence_id", "kind", "sha256").cast(pl.String))
        self.span_strings = {
            name: fields[name].cast(pl.String).fill_null("").to_list()
            for name in ("evidence_id", "kind", "sha256")
        }
        self.span_numbers = {
            name: fields[name].cast(pl.Int64).fill_null(-1).to_numpy()
            for name in ("token_start", "token_end", "char_start", "char_end")
        }

    @classmethod
    def take(cls, frame: pl.DataFrame, index: list[int], *, all_rows: bool) -> _Block:
        if all_rows and len(index) == frame.height:
            return cls(frame)
        if all_rows:
            return cls(frame.slice(index[0], len(index)))
        return cls(frame[index])

    def turn_spans_of(self, j: int) -> list[dict[str, Any]]:
        """The layout's turn spans (issue 25); none for a single-slot layout or an older file."""
        if "turn_spans" not in self.rows.columns:
            return []
        return list(self.rows["turn_spans"].slice(j, 1).to_list()[0] or [])

    def spans_of(self, j: int) -> list[dict[str, Any]]:
        return list(self.rows["evidence_spans"].slice(j, 1).to_list()[0] or [])

    def _subset(self) -> tuple[list[int], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The checked rows, their ids and row offsets (all rows: no copy)."""
        rows = [int(j) for j in self.checked]
        if self._all:
            return rows, self.ids, self.id_offsets
        parts = [self.ids[self.id_offsets[j] : self.id_offsets[j + 1]] for j in rows]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
        return rows, flat, _offsets(np.array([len(p) for p in parts], dtype=np.int64))

    def presend(self, contract: str) -> dict[int, list[tuple[str, str]]]:
        """Rust pre-send checks of the checked rows, in one call: row → violations (code, detail)."""
        rows, ids, id_offsets = self._subset()
        if not rows:
            return {}
        targets = self.rows["target_tokens"].cast(pl.Int64).fill_null(-1).to_numpy()
        digests = self.rows["template_digest"].to_list()
        n = self.rows.height
        dates = self.rows["pinned_date"].to_list() if "pinned_date" in self.rows.columns else [None] * n
        s = self.span_offsets
        if self._all:
            span_offsets = s
            span_index = None
        else:
            span_index = np.concatenate(
                [np.arange(s[j], s[j + 1], dtype=np.int64) for j in rows] + [np.zeros(0, dtype=np.int64)]
            )
            span_offsets = _offsets(np.array([s[j + 1] - s[j] for j in rows], dtype=np.int64))

        def strings(name: str) -> list[str]:
            values = self.span_strings[name]
            return values if span_index is None else [values[k] for k in span_index]

        def numbers(name: str) -> np.ndarray[Any, np.dtype[np.int64]]:
            values = self.span_numbers[name]
            return np.ascontiguousarray(values if span_index is None else values[span_index])

        def pick(values: list[Any]) -> list[Any]:
            return values if self._all else [values[j] for j in rows]

        reports = _core.presend_check_batch(
            pick(self.texts),
            np.ascontiguousarray(ids, dtype=np.uint32),
            id_offsets,
            np.ascontiguousarray(targets if self._all else targets[rows], dtype=np.int64),
            pick(digests),
            pick(dates),
            span_offsets,
            strings("evidence_id"),
            strings("kind"),
            (numbers("token_start"), numbers("token_end")),
            (numbers("char_start"), numbers("char_end")),
            strings("sha256"),
            contract,
        )
        return dict(zip(rows, reports, strict=True))

    def verify(self, tokenizer: Tokenizer) -> dict[int, list[dict[str, Any]]]:
        """Full re-encode of the checked rows (ids == encode(text), spans on the final offsets)."""
        rows, ids, id_offsets = self._subset()
        if not rows:
            return {}
        spans = self.rows["evidence_spans"].to_list()
        add_special = self.rows["add_special_tokens"].to_list()
        targets = self.rows["target_tokens"].to_list()
        ids_of = self.rows["layout_id"].to_list()
        stored = [
            {
                "layout_id": ids_of[j],
                "text": self.texts[j],
                "add_special_tokens": add_special[j],
                "target_tokens": targets[j],
                "spans": list(spans[j] or []),  # the core reads a stored evidence_id as its unit id
            }
            for j in rows
        ]
        result = json.loads(
            _core.verify_layouts(
                tokenizer._core, json.dumps(stored), np.ascontiguousarray(ids, dtype=np.uint32), id_offsets
            )
        )
        return dict(zip(rows, result, strict=True))

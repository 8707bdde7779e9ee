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
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

from depthgate import _core
from depthgate.exceptions import TemplateError
from depthgate.layout.layouts import Tokenizer, case_frame
from depthgate.layout.templates import ChatTemplate, Frame, raw_frame
from depthgate.spec.models import Case

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


def _frame_violation(row: Mapping[str, Any], expected: Frame | TemplateError) -> tuple[str, str] | None:
    """The layout's prompt must be ``prefix + context + suffix`` of the frame the system renders now."""
    if isinstance(expected, TemplateError):
        return ("presend_frame_mismatch", f"the system's template cannot frame this case: {expected.message}")
    text = str(row["text"])
    if text.startswith(expected.prefix) and text.endswith(expected.suffix):
        return None
    where = "start" if not text.startswith(expected.prefix) else "end"
    return (
        "presend_frame_mismatch",
        f"the prompt's {where} differs from the frame the system renders now (template, preamble or "
        "instruction changed since the build); rebuild the layout",
    )


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
    puts first), so a rendered BOS plus an added one is ``presend_doubled_bos``.

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
    frames: dict[str, Frame | TemplateError] = {}
    if bos_id is None:
        bos_id = tokenizer.bos_id
    rows = list(frame.iter_rows(named=True))
    found: list[list[tuple[str, str]]] = [[] for _ in rows]
    ok_index = [i for i, r in enumerate(rows) if r["status"] == "ok"]
    texts = _unit_texts(cases) if cases else {}
    for i in ok_index:
        row = rows[i]
        if row.get("tokenizer_digest") not in (None, tokenizer.digest):
            found[i].append(
                (
                    "verify_stale_tokenizer",
                    "built under another tokenizer (digest differs); rebuild the layout",
                )
            )
        contract = {
            "target_tokens": row["target_tokens"],
            "window": window,
            "max_output_tokens": max_output_tokens,
            "template_digest": expected_digest,
            "pinned_date": pinned_date,
            "bos_id": bos_id,
        }
        report = json.loads(
            _core.presend_check(
                row["layout_id"],
                row["text"],
                np.asarray(row["token_ids"], dtype=np.uint32),
                json.dumps(_spans_json(row)),
                row["template_digest"],
                row.get("pinned_date") or "",
                json.dumps(contract),
            )
        )
        found[i].extend((f"presend_{v['code']}", str(v["detail"])) for v in report["violations"])
        if check_frames and cases is not None and row["case_id"] in cases:
            case_id = str(row["case_id"])
            if case_id not in frames:
                try:
                    frames[case_id] = case_frame(
                        cases[case_id], template=template, preamble=preamble, assembler=assembler
                    )
                except TemplateError as exc:
                    frames[case_id] = exc
            mismatch = _frame_violation(row, frames[case_id])
            if mismatch is not None:
                found[i].append(mismatch)
        codes = {c for c, _ in found[i]}
        if (
            texts
            and codes & {"presend_evidence_missing", "presend_evidence_not_once"}
            and _reordered(row, texts)
        ):
            found[i].append(("presend_units_reordered", "the documents are all present but in another order"))
    if verify and ok_index:
        stored = [
            {
                "layout_id": rows[i]["layout_id"],
                "text": rows[i]["text"],
                "add_special_tokens": rows[i]["add_special_tokens"],
                "target_tokens": rows[i]["target_tokens"],
                "spans": _spans_json(rows[i]),
            }
            for i in ok_index
        ]
        flat = [np.asarray(rows[i]["token_ids"], dtype=np.uint32) for i in ok_index]
        offsets = np.cumsum(np.array([0] + [len(x) for x in flat], dtype=np.uint64))
        result = json.loads(
            _core.verify_layouts(tokenizer._core, json.dumps(stored), np.concatenate(flat), offsets)
        )
        for i, violations in zip(ok_index, result, strict=True):
            found[i].extend((f"verify_{v['code']}", str(v["detail"])) for v in violations)
    status: list[str] = []
    code_col: list[str | None] = []
    reason_col: list[str | None] = []
    for row, violations in zip(rows, found, strict=True):
        if row["status"] != "ok" or not violations:
            status.append(row["status"])
            code_col.append(row["reason_code"])
            reason_col.append(row["reason"])
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

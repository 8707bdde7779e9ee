"""How the reports write numbers, slices and depths: one wording for summary.md, report.html and junit.xml
(slice keys, depth labels, signed numbers with a real minus, q-values, the marks, the report order of
slices)."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Sequence

from depthgate.judge.gate import SliceResult, SliceStatus
from depthgate.judge.tables import position_sort_key
from depthgate.spec.positions import split_position_label

MARK_REGRESSION = "★"


#: "Non-inferiority shown": LB > -M, the slice's own NI test (stats.non_inferiority_shown), never q_NI.
MARK_NI = "·"


# Failing slices first (worst kind first), then inconclusive, then passing.
STATUS_ORDER = {
    SliceStatus.FAIL_SYSTEM: 0,
    SliceStatus.FAIL_REGRESSION: 0,
    SliceStatus.FAIL_NOT_SHOWN: 1,
    SliceStatus.FAIL_FLOOR: 2,
    SliceStatus.INCONCLUSIVE: 3,
    SliceStatus.PASS: 4,
}


def slice_key(length: int, position: str) -> str:
    """The slice name used in every report and in the gate's reasons: ``"8192/0.5"``."""
    return f"{length}/{position}"


def depth_label(position: str) -> str:
    """A position for people: ``"0.25"`` → ``"25%"``, ``"@1200"`` → ``"token 1,200"``, ``"0.5~far"`` →
    ``"50% · far"`` (evidence spacing)."""
    base, spacing = split_position_label(position)
    if spacing != "adjacent":
        return f"{depth_label(base)} · {spacing}"
    kind, value, _ = position_sort_key(position)
    if kind == 0:
        return f"{100 * value:g}%"
    if kind == 1:
        return f"token {int(value):,}"
    return position


def signed(value: float | None, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return "–"
    if math.isinf(value):
        return "−∞" if value < 0 else "+∞"
    text = f"{value:+.{digits}f}"
    return text.replace("-", "−")


def plain(value: float | None, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}"


def q_value(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if value >= 0.9995:
        return "1"
    return f"{value:.3g}" if value >= 0.001 else f"{value:.1e}"


def machine_signed(value: float | None) -> str:
    """``+0.123`` / ``-0.411`` with an ASCII minus (junit.xml values are read by tools), ``–`` for none."""
    return "–" if value is None or math.isnan(value) else f"{value:+.3f}"


def ordered_slices(slices: Iterable[SliceResult]) -> list[SliceResult]:
    return sorted(
        slices,
        key=lambda s: (
            STATUS_ORDER[s.status],
            s.lower if s.lower is not None else math.inf,
            s.length,
            position_sort_key(s.position),
        ),
    )


def reason_kind(reason: str | None) -> str:
    """Bucket a system-failure reason by its head: ``"truncation: 4100 > 4096"`` → ``"truncation"``."""
    if not reason or not reason.strip():
        return "unspecified"
    head = re.split(r"[:(\[;,]", reason.strip(), maxsplit=1)[0].strip().lower()
    return (head or "unspecified")[:40]


def markdown_table(
    head: Sequence[str], rows: Iterable[Sequence[str]], *, right: Collection[int] = ()
) -> list[str]:
    """A summary.md table as lines: the head, the rule (columns in ``right`` right-aligned, ``---:``),
    one line per row. Cells are written as given (escape them with :func:`md_cell`)."""
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(head)))
    return ["| " + " | ".join(head) + " |", rule, *("| " + " | ".join(cells) + " |" for cells in rows)]


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")

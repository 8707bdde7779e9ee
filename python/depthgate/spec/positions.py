"""Positions and evidence spacings as a matrix names them, and the position labels built from them
(``"0.5"``, ``"@1200"``, ``"0.5~far"``)."""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeAlias

from pydantic import (
    BeforeValidator,
)

from depthgate.spec.base import violation

_ABSOLUTE_POSITION = re.compile(r"^@(0|[1-9][0-9]*)$")


def _parse_position(value: Any) -> Any:
    if isinstance(value, bool):
        raise violation(f"{value!r} is not a position", fix="give a depth in [0, 1] or '@<token offset>'")
    if isinstance(value, int | float):
        depth = float(value)
        if not 0.0 <= depth <= 1.0:
            raise violation(
                f"depth {value} is outside [0, 1]",
                fix="give a depth between 0 and 1, or an absolute token offset as '@<int>'",
            )
        return depth
    if isinstance(value, str):
        if not _ABSOLUTE_POSITION.match(value):
            raise violation(
                f"{value!r} is not a position",
                fix="give a depth in [0, 1] such as 0.5, or an absolute token offset such as '@512'",
            )
        return value
    raise violation(f"{value!r} is not a position", fix="give a depth in [0, 1] or '@<token offset>'")


Position: TypeAlias = Annotated[float | str, BeforeValidator(_parse_position)]


# Evidence spacing (issue #13 item 5): the token distance between the decisive documents of a
# multi-evidence case. "adjacent" is the block as it always was; the others put filler between the
# decisive documents inside the one moving block (depthgate.layout.layouts; docs/position.md).
SPACING_NAMES: tuple[str, ...] = ("adjacent", "near", "far")
#: "near": a fixed gap of this many tokens between consecutive decisive documents.
NEAR_GAP_TOKENS = 64
#: "far": a gap of this fraction of the layout's total length (rounded), e.g. 410 tokens at 1024.
FAR_GAP_FRACTION = 0.4
#: Joins a position and a non-adjacent spacing in a position label: "0.5~far", "@1200~near", "1~300tok".
SPACING_SEP = "~"
_GAP_LABEL = re.compile(r"^([1-9][0-9]*)tok$")


def _parse_spacing(value: Any) -> Any:
    fix = 'give "adjacent", "near" (64 tokens), "far" (0.4 of the length) or a gap in tokens such as 300'
    if isinstance(value, bool):
        raise violation(f"{value!r} is not a spacing", fix=fix)
    if isinstance(value, int):
        if value < 1:
            raise violation(
                f"gap {value} is not a positive number of tokens",
                fix='use "adjacent" for no gap, or a gap of at least 1 token',
            )
        return value
    if isinstance(value, str) and value in SPACING_NAMES:
        return value
    raise violation(f"{value!r} is not a spacing", fix=fix)


Spacing: TypeAlias = Annotated[str | int, BeforeValidator(_parse_spacing)]


def spacing_label(spacing: str | int) -> str:
    """The label of a spacing in position labels and reports: the name, or ``"<N>tok"`` for a gap."""
    return f"{spacing}tok" if isinstance(spacing, int) else spacing


def spacing_gap(spacing: str | int, length: int) -> int:
    """The nominal gap in tokens between consecutive decisive documents at total ``length`` (a
    spacing value or its label); the gap a layout records is measured (``evidence_gap_tokens``)."""
    label = spacing_label(spacing)
    if label == "adjacent":
        return 0
    if label == "near":
        return NEAR_GAP_TOKENS
    if label == "far":
        return round(FAR_GAP_FRACTION * length)
    match = _GAP_LABEL.match(label)
    if match is None:
        raise ValueError(f"{spacing!r} is not a spacing")
    return int(match.group(1))


def split_position_label(label: str) -> tuple[str, str]:
    """``"0.5~far"`` → ``("0.5", "far")``; ``"0.5"`` → ``("0.5", "adjacent")``. The one place a position
    label is split into its depth/offset part and its evidence spacing."""
    base, sep, spacing = str(label).partition(SPACING_SEP)
    return (base, spacing) if sep else (base, "adjacent")


def is_spacing_label(label: str) -> bool:
    return label in SPACING_NAMES or _GAP_LABEL.match(label) is not None


def spacing_rank(label: str) -> int:
    """Order of spacings in reports: adjacent, near, far, then explicit gaps by size."""
    if label in SPACING_NAMES:
        return SPACING_NAMES.index(label)
    match = _GAP_LABEL.match(label)
    return len(SPACING_NAMES) + (int(match.group(1)) if match else 0)

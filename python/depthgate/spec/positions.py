"""Positions and evidence spacings as a matrix names them, and the position labels built from them
(``"0.5"``, ``"@1200"``, ``"@turn:3"``, ``"0.5~far"``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias

from pydantic import (
    BeforeValidator,
)

from depthgate.spec.base import violation

_ABSOLUTE_POSITION = re.compile(r"^@(0|[1-9][0-9]*)$")
#: A position by conversation turn (issue 25): ``"@turn:3"``, the evidence in the middle of turn 3's
#: content (a matrix with ``shape = "conversation"`` only; depthgate.layout.conversation).
TURN_PREFIX = "@turn:"
_TURN_POSITION = re.compile(r"^@turn:([1-9][0-9]*)$")
_POSITION_FIX = (
    "give a depth in [0, 1] such as 0.5, an absolute token offset such as '@512', or a conversation turn "
    "such as '@turn:3'"
)


def _parse_position(value: Any) -> Any:
    if isinstance(value, bool):
        raise violation(f"{value!r} is not a position", fix=_POSITION_FIX)
    if isinstance(value, int | float):
        depth = float(value)
        if not 0.0 <= depth <= 1.0:
            raise violation(
                f"depth {value} is outside [0, 1]",
                fix="give a depth between 0 and 1, or an absolute token offset as '@<int>'",
            )
        return depth
    if isinstance(value, str):
        if not (_ABSOLUTE_POSITION.match(value) or _TURN_POSITION.match(value)):
            raise violation(f"{value!r} is not a position", fix=_POSITION_FIX)
        return value
    raise violation(f"{value!r} is not a position", fix=_POSITION_FIX)


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
    """``"0.5~far"`` → ``("0.5", "far")``; ``"0.5"`` → ``("0.5", "adjacent")``
    (:meth:`PositionLabel.parse`)."""
    parsed = PositionLabel.parse(label)
    return parsed.base, parsed.spacing


def is_spacing_label(label: str) -> bool:
    return label in SPACING_NAMES or _GAP_LABEL.match(label) is not None


def spacing_rank(label: str) -> int:
    """Order of spacings in reports: adjacent, near, far, then explicit gaps by size."""
    if label in SPACING_NAMES:
        return SPACING_NAMES.index(label)
    match = _GAP_LABEL.match(label)
    return len(SPACING_NAMES) + (int(match.group(1)) if match else 0)


@dataclass(frozen=True)
class PositionLabel:
    """A position label as records, slices and reports name it: where the evidence block starts
    (``base``: a depth such as ``"0.5"``, or an absolute token offset such as ``"@1200"``) and how its
    decisive documents are spaced (``spacing``: ``"adjacent"``, ``"near"``, ``"far"`` or ``"<N>tok"``).
    ``str()`` gives the label: the base alone when adjacent, else ``"<base>~<spacing>"``. The one place
    a label is parsed, formatted and ordered."""

    base: str
    spacing: str = "adjacent"

    @classmethod
    def parse(cls, label: object) -> PositionLabel:
        """``"0.5~far"`` → ``PositionLabel("0.5", "far")``; ``"@1200"`` → ``PositionLabel("@1200")``."""
        base, sep, spacing = str(label).partition(SPACING_SEP)
        return cls(base, spacing if sep else "adjacent")

    @classmethod
    def of(cls, position: float | str, spacing: str | int = "adjacent") -> PositionLabel:
        """The label of a matrix position (a depth or ``"@<offset>"``) at a spacing (a value or label)."""
        return cls(str(position), spacing_label(spacing))

    def __str__(self) -> str:
        return self.base if self.spacing == "adjacent" else f"{self.base}{SPACING_SEP}{self.spacing}"

    @property
    def adjacent(self) -> bool:
        return self.spacing == "adjacent"

    @property
    def is_offset(self) -> bool:
        """The base names a token offset (``"@..."``), not a depth or a turn."""
        return self.base.startswith("@") and not self.base.startswith(TURN_PREFIX)

    @property
    def turn(self) -> int | None:
        """The conversation turn K of an ``"@turn:K"`` label (K >= 1), else None."""
        match = _TURN_POSITION.match(self.base)
        return int(match.group(1)) if match else None

    @property
    def offset(self) -> int | None:
        """The absolute token offset of an ``"@<offset>"`` label, else None."""
        return int(self.base[1:]) if _ABSOLUTE_POSITION.match(self.base) else None

    def sort_key(self) -> tuple[int, float, str]:
        """Order of labels in reports: relative depths first, then absolute token offsets, then turns by
        number (then anything else); spaced labels after the adjacent ones, grouped by spacing (near,
        far, gaps by size)."""
        label = str(self)
        kind, value = _base_order(self.base)
        if not self.adjacent:
            return (3 * (1 + spacing_rank(self.spacing)) + kind, value, label)
        return (kind, value, label)


def _base_order(base: str) -> tuple[int, float]:
    try:
        return (0, float(base))
    except ValueError:
        pass
    match = _TURN_POSITION.match(base)
    if match:
        return (2, float(match.group(1)))
    if base.startswith("@"):
        try:
            return (1, float(base[1:]))
        except ValueError:
            pass
    return (2, 0.0)


def position_sort_key(position: str) -> tuple[int, float, str]:
    """:meth:`PositionLabel.sort_key` of a label."""
    return PositionLabel.parse(position).sort_key()

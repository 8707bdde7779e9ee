"""One descriptor per evidence pattern: the single place that knows what each ``evidence_pattern`` of a
case means (issue #38 item 3).

An evidence pattern (``single``, ``override``, ``conflict``, ``mrcr``, …) says how a case's evidence
decides its answer. An :class:`EvidencePatternKind` says everything the rest of depthgate asks about it:

* ``decisive``: how many decisive documents a case of it holds — ``none`` (evidence absent: no required
  claim, the case must abstain), ``one``, ``some`` (one or more) or ``several`` (two or more);
* ``competing``: it needs a competing document (the superseded version, the general rule), placed at
  the case's fixed ``competing_depth``;
* ``scoring``: how the oracle (:mod:`depthgate.judge.scoring`) reads an answer — ``claims`` (the required
  claims, no forbidden one), ``conflict`` (an abstention or every conflicting value passes; the case
  validation then checks its sources conflict) or ``mrcr`` (the k-th needle's answer line,
  :mod:`depthgate.judge.scoring.mrcr`);
* ``turns``: in a conversation its decisive documents are needles laid out as exchanges (MRCR);
* what the built-in suite generator (:mod:`depthgate.spec.suites`) draws for it: ``second_value`` (a
  second value: the superseded, general, ruled-out or other source's one), ``asks_current`` (the question
  asks for the current value) and ``task`` (the case's ``kind``).

The case validation (:class:`depthgate.spec.cases.Case`), the built-in suite generator, the layout of
conversations (:mod:`depthgate.layout.conversation`) and the oracle read this registry; none of them
compares a pattern's name. A new evidence pattern is one module that describes it plus one
:func:`register_evidence_pattern` line (below, or in that module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "EvidencePatternKind",
    "evidence_pattern",
    "register_evidence_pattern",
    "registered_evidence_patterns",
    "unregister_evidence_pattern",
]

Decisive = Literal["none", "one", "some", "several"]
Scoring = Literal["claims", "conflict", "mrcr"]


@dataclass(frozen=True)
class EvidencePatternKind:
    """What one evidence pattern means (see the module docstring)."""

    name: str
    decisive: Decisive = "some"
    competing: bool = False
    scoring: Scoring = "claims"
    turns: bool = False
    second_value: bool = False
    asks_current: bool = False
    task: Literal["extraction", "qa"] = "qa"


_REGISTRY: dict[str, EvidencePatternKind] = {}


def register_evidence_pattern(kind: EvidencePatternKind) -> EvidencePatternKind:
    """Add ``kind`` to the registry (a name registered twice is a bug: ValueError)."""
    if kind.name in _REGISTRY:
        raise ValueError(f"evidence pattern {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    return kind


def unregister_evidence_pattern(name: str) -> None:
    """Remove a registered pattern (tests that register a toy one)."""
    _REGISTRY.pop(name, None)


def registered_evidence_patterns() -> tuple[str, ...]:
    """The registered pattern names, in registration order."""
    return tuple(_REGISTRY)


def evidence_pattern(name: str) -> EvidencePatternKind:
    """The descriptor of pattern ``name`` (KeyError listing the registered ones if unknown)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown evidence pattern {name!r}; registered: {', '.join(_REGISTRY)}") from None


register_evidence_pattern(EvidencePatternKind("single", decisive="one", task="extraction"))
register_evidence_pattern(
    EvidencePatternKind("override", competing=True, second_value=True, asks_current=True)
)
register_evidence_pattern(EvidencePatternKind("exception", competing=True, second_value=True))
register_evidence_pattern(EvidencePatternKind("order", second_value=True, asks_current=True))
register_evidence_pattern(EvidencePatternKind("negation", second_value=True))
register_evidence_pattern(EvidencePatternKind("absent", decisive="none"))
register_evidence_pattern(
    EvidencePatternKind("conflict", decisive="several", scoring="conflict", second_value=True)
)
register_evidence_pattern(EvidencePatternKind("mrcr", scoring="mrcr", turns=True))

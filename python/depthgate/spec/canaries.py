"""The full-length canary cases (issue #21; sent by :mod:`depthgate.run.canary`, judged by
:mod:`depthgate.judge.health.canary`): a fixed five-digit number per canary, at the very start
(``head``) or the very end (``tail``) of the context region of a prompt of the tested length, asked
for at the end."""

from __future__ import annotations

import hashlib

from depthgate.spec.cases import Case, Suite

__all__ = ["CANARY_DEPTHS", "CANARY_KINDS", "canary_cases", "canary_kind", "canary_suite"]

CANARY_KINDS: tuple[str, ...] = ("head", "tail")
CANARY_DEPTHS = {"head": 0.0, "tail": 1.0}
_PREFIX = "canary-"


def _number(kind: str, index: int) -> str:
    """A fixed five-digit number per canary (10000–99999), the same on every machine."""
    digest = hashlib.sha256(f"depthgate-canary-{kind}-{index}".encode()).digest()
    return str(10000 + int.from_bytes(digest[:4], "big") % 90000)


def canary_cases(count: int, kinds: tuple[str, ...] = CANARY_KINDS) -> list[Case]:
    """``count`` canary cases of each kind: ``canary-head-0`` … (ids name the kind), each a decisive
    sentence holding a fixed number, a cloze question asking for it, and the number as required claim."""
    cases = []
    for kind in kinds:
        for index in range(count):
            number = _number(kind, index)
            cases.append(
                Case.model_validate(
                    {
                        "id": f"{_PREFIX}{kind}-{index}",
                        "kind": "extraction",
                        "evidence_pattern": "single",
                        "language": "en",
                        "risk": "low",
                        "query": "What is the check number of this document?",
                        "answer_prefix": "The check number of this document is",
                        "evidence": [
                            {
                                "id": "check",
                                "text": f" The check number of this document is {number}.",
                                "supports": ["number"],
                            }
                        ],
                        "required_claims": [
                            {"id": "number", "text": number, "aliases": [number], "value": number}
                        ],
                        "expected_fields": {"value": number},
                        "family": f"canary:{kind}",
                    }
                )
            )
    return cases


def canary_suite(count: int) -> Suite:
    """The canary cases as a suite (for the oracle)."""
    return Suite(name="depthgate-canaries", language="en", cases=canary_cases(count))


def canary_kind(case_id: str) -> str | None:
    """``head`` or ``tail`` for a canary case id, None for any other case."""
    if not case_id.startswith(_PREFIX):
        return None
    kind = case_id[len(_PREFIX) :].rsplit("-", 1)[0]
    return kind if kind in CANARY_KINDS else None

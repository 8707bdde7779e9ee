"""The MRCR answer rule (issue 25 item 3; cases from depthgate.spec.mrcr).

An MRCR case asks for the code of the k-th of several near-identical replies. Its one required claim is
the k-th reply's code; every other reply's code (and every distractor reply's code) is a forbidden claim.
The answer line (judge/scoring/oracle.py, rules 1–2) **passes when it holds the required code and no forbidden
code anywhere in it** — stricter than the head rule, where a forbidden value after the answer is the
continuation a base model copies on: a reply that lists several codes has not picked the k-th one.
Numbers that are no reply's code (an ordinal "2nd", a year) do not decide; an abstention fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["judge_mrcr"]


class _EventLike(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def claim_id(self) -> str | None: ...
    @property
    def token(self) -> str: ...


def judge_mrcr(
    events: Sequence[_EventLike], required_ids: Sequence[str], expected: str, raw_line: str
) -> tuple[str, list[str], list[str], list[str]]:
    """(note, missing required claim ids, forbidden claim ids given, problems) of one answer line."""
    found = {e.claim_id for e in events if e.kind == "required"}
    forbidden = list(dict.fromkeys(e.claim_id for e in events if e.kind == "forbidden" and e.claim_id))
    missing = [claim_id for claim_id in required_ids if claim_id not in found]
    problems: list[str] = []
    if forbidden:
        given = ", ".join(repr(e.token) for e in events if e.kind == "forbidden")
        problems.append(f"gave the code(s) {given} of another reply ({', '.join(forbidden)})")
    if missing:
        shown = repr(raw_line.strip()[:80])
        problems.append(f"the answer {shown} lacks the code of the asked reply, {expected!r}")
    if problems:
        return "", missing, forbidden, problems
    return f"gave the asked reply's code {expected!r} and no other reply's", [], [], []

"""The MRCR answer rule (judge/scoring/mrcr.py): the answer line must hold the asked (k-th) reply's code and
no other reply's code anywhere — deterministic, stricter than the head rule; a wrong code is a plain fail."""

from __future__ import annotations

import pytest

from depthgate.judge.scoring import score
from depthgate.spec.mrcr import mrcr_suite

CASE = mrcr_suite(1, 0, needles=4, k=2).cases[0]
CODES = [d.text.rsplit(" ", 1)[1].rstrip(".") for d in CASE.decisive]
ASKED, FIRST, THIRD = CODES[1], CODES[0], CODES[2]
OTHER_TOPIC = CASE.distractors[0].text.rsplit(" ", 1)[1].rstrip(".")


@pytest.mark.parametrize(
    ("output", "outcome", "forbidden"),
    [
        (f" {ASKED}.", "pass", []),
        (f" reply code {ASKED}, as asked.", "pass", []),
        (f" the 2nd reply's code, {ASKED}.", "pass", []),  # an ordinal is no reply's code
        (
            f" {ASKED}.\nThe reply code of the third reply was {THIRD}.",
            "pass",
            [],
        ),  # next line: not the answer
        (f" {FIRST}.", "fail", ["needle_1"]),
        (f" {THIRD}.", "fail", ["needle_3"]),
        (f" {ASKED}. The reply code of the third reply was {THIRD}.", "fail", ["needle_3"]),  # strict
        (f" {FIRST} or {ASKED}.", "fail", ["needle_1"]),
        (f" {OTHER_TOPIC}.", "fail", ["distractor_01"]),
        (" not stated.", "fail", []),
        ("", "fail", []),
    ],
)
def test_mrcr_rule(output: str, outcome: str, forbidden: list[str]) -> None:
    result = score(CASE, output, evidence_ids_in_layout={d.id for d in CASE.evidence})
    assert result.outcome == outcome, result.reason
    assert result.forbidden_hits == forbidden
    assert not result.safety  # another reply's code is a wrong answer, never a safety event
    if outcome == "fail":
        assert result.reason
    again = score(CASE, output, evidence_ids_in_layout={d.id for d in CASE.evidence})
    assert again == result


def test_the_required_code_follows_k() -> None:
    for k in (1, 3, 4):
        case = mrcr_suite(1, 0, needles=4, k=k).cases[0]
        codes = [d.text.rsplit(" ", 1)[1].rstrip(".") for d in case.decisive]
        ids = {d.id for d in case.evidence}
        assert score(case, f" {codes[k - 1]}.", evidence_ids_in_layout=ids).outcome == "pass"
        assert all(
            score(case, f" {c}.", evidence_ids_in_layout=ids).outcome == "fail"
            for i, c in enumerate(codes)
            if i != k - 1
        )

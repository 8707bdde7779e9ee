"""Intervals on control-normalised accuracy (issue #24 item 4), computed in judge.position: each
accuracy of the table with its two-sided Wilson interval on the case-clustered effective sample size,
checked against the interval written out by hand."""

from __future__ import annotations

import math

import polars as pl
import pytest

from depthgate.judge.science import control_normalised_accuracy

Z = 1.959963984540054


def _wilson(p: float, n: float) -> tuple[float, float]:
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return centre - half, centre + half


def test_control_normalised_accuracy_has_clustered_wilson_intervals_by_hand() -> None:
    # baseline, one slice, 2 seeds: a passes both, b one, c none, d both; controls: c fails
    outcomes = {"a": ("pass", "pass"), "b": ("pass", "fail"), "c": ("fail", "fail"), "d": ("pass", "pass")}
    rows = [(c, s, o) for c, pair in outcomes.items() for s, o in enumerate(pair)]
    scored = pl.DataFrame(
        {
            "arm": ["baseline"] * len(rows),
            "case_id": [r[0] for r in rows],
            "length": [1024] * len(rows),
            "position": ["0.5"] * len(rows),
            "seed": [r[1] for r in rows],
            "outcome": [r[2] for r in rows],
        }
    )
    controls = pl.DataFrame(
        {
            "arm": ["baseline"] * 4,
            "case_id": list("abcd"),
            "control": ["evidence_only"] * 4,
            "outcome": ["pass", "pass", "fail", "pass"],
        }
    )
    (r,) = control_normalised_accuracy(scored, controls).iter_rows(named=True)
    # raw: rates 1, .5, 0, 1 -> .625; R = 2, s^2 = .6875/3, DEFF = (s^2/4) / (.625 * .375 / 8) = 1.9556
    assert r["accuracy"] == 0.625
    lo, hi = _wilson(0.625, 8 / ((0.6875 / 3 / 4) / (0.234375 / 8)))
    assert (r["accuracy_lower"], r["accuracy_upper"]) == (pytest.approx(lo), pytest.approx(hi))
    assert (round(r["accuracy_lower"], 4), round(r["accuracy_upper"], 4)) == (0.2222, 0.9068)
    # eligible (control passes): a, b, d -> rates 1, .5, 1 -> 5/6; s^2 = 1/12, var_srs = (5/6)(1/6)/6,
    # DEFF = (1/12 / 3) / var_srs = 1.2, n_eff = 6 / 1.2 = 5
    assert r["accuracy_eligible"] == pytest.approx(5 / 6) and r["n_eligible"] == 3
    lo, hi = _wilson(5 / 6, 5.0)
    assert (r["accuracy_eligible_lower"], r["accuracy_eligible_upper"]) == (
        pytest.approx(lo),
        pytest.approx(hi),
    )
    assert (round(lo, 4), round(hi, 4)) == (0.4033, 0.9737)
    # the baseline-eligible set is the same cases for the baseline arm
    assert r["accuracy_eligible_baseline_lower"] == pytest.approx(lo)


def test_no_eligible_case_gives_a_null_interval() -> None:
    scored = pl.DataFrame(
        {
            "arm": ["baseline"],
            "case_id": ["a"],
            "length": [512],
            "position": ["0"],
            "seed": [0],
            "outcome": ["pass"],
        }
    )
    controls = pl.DataFrame(
        {"arm": ["baseline"], "case_id": ["a"], "control": ["evidence_only"], "outcome": ["fail"]}
    )
    (r,) = control_normalised_accuracy(scored, controls).iter_rows(named=True)
    assert r["accuracy_eligible"] is None and r["accuracy_eligible_lower"] is None
    # one case, one run, p = 1: Wilson at n = 1
    assert r["accuracy_lower"] == pytest.approx(_wilson(1.0, 1.0)[0]) and r["accuracy_upper"] == 1.0

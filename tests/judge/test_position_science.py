"""Position science beside the gate (issue #13): effective length, control-normalised accuracy, pass^k,
the A/A noise floor and power planning.

Every statistic is checked against a hand-computed example (exact numbers) and by a small seeded
simulation (a planted effect is found, A/A stays clean). The larger calibration runs are opt-in:
tests/judge/test_position_sim.py (``-m bench``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import polars as pl
import pytest
from statsmodels.stats.proportion import binom_test, proportion_confint

from depthgate.exceptions import InputError
from depthgate.judge.bounds import shrunk_design_effect
from depthgate.judge.gate import GatePlan, Sizing, sample_size_per_slice
from depthgate.judge.planning import (
    DesignParameters,
    cases_for_power,
    draw_design,
    expected_table,
    pilot_parameters,
    power_per_slice,
    power_plan,
    simulate_gate_power,
)
from depthgate.judge.science import (
    abs_delta_quantile,
    base_scores_from_controls,
    control_normalised_accuracy,
    effective_length,
    eligible_cases,
    noise_delta_quantile,
    noise_floor,
    pass_hat_k,
    wilson_design_interval,
)
from helpers import scored_frame

ARMS = ("baseline", "candidate")
#: The spec's sizing table (section 3): the bare t-test n, no n_min, no inflation.
TABLE = Sizing(margin=0.10, alpha=0.05, n_min=0, inflation=1.0)


# --------------------------------------------------------------------------------------------------
# Builders


def records(rows: Sequence[tuple[str, str, int, str, int, str]]) -> pl.DataFrame:
    """(arm, case_id, length, position, seed, outcome) rows -> a scored-records frame."""
    return scored_frame(rows)


def controls(rows: Sequence[tuple[str, str, int, str]], kind: str = "evidence_only") -> pl.DataFrame:
    """(arm, case_id, seed, outcome) rows -> scored controls."""
    return pl.DataFrame(
        [(a, c, s, o, kind) for a, c, s, o in rows],
        schema={
            "arm": pl.String,
            "case_id": pl.String,
            "seed": pl.Int64,
            "outcome": pl.String,
            "control": pl.String,
        },
        orient="row",
    )


def from_arrays(arrays: dict[tuple[str, int, str], np.ndarray], case_prefix: str = "c") -> pl.DataFrame:
    """(arm, length, position) -> (cases, seeds) 0/1 array (NaN = missing) -> records."""
    parts = []
    for (arm, length, position), y in arrays.items():
        n, r = y.shape
        outcome = np.where(np.isnan(y), "missing", np.where(y > 0, "pass", "fail"))
        parts.append(
            pl.DataFrame(
                {
                    "arm": arm,
                    "case_id": [f"{case_prefix}{i:03d}" for i in np.repeat(np.arange(n), r)],
                    "length": length,
                    "position": position,
                    "seed": np.tile(np.arange(r), n),
                    "outcome": outcome.ravel(),
                    "safety": False,
                }
            )
        )
    return pl.concat(parts)


# --------------------------------------------------------------------------------------------------
# Effective length: the hand example
#
# 4 cases, one seed, depth 0.5, lengths 1000/2000/4000/8000.
#   baseline  accuracy 1.00 1.00 0.75 1.00   (c3 fails at 4000)
#   candidate accuracy 1.00 0.75 0.75 0.50   (c2 fails from 2000 on, c3 at 8000)
# Evidence-only controls: the baseline passes all 4 (base 1.0), the candidate fails c0 (base 0.75).
# NoLiMa 0.85: baseline threshold 0.85 -> first crossing at 4000 -> EL 2000 (8000 passes again but does
#   not count: first crossing); candidate threshold 0.6375 -> 1000..4000 pass, 8000 fails -> EL 4000.
#   Difference +2000 tokens, +1 grid step.
# RULER 0.70: baseline passes everywhere -> 8000 (at the grid top, censored); candidate -> 4000.

LENGTHS = (1000, 2000, 4000, 8000)
CASES = ("c0", "c1", "c2", "c3")
FAILS = {
    ("baseline", 4000): {"c3"},
    ("candidate", 2000): {"c2"},
    ("candidate", 4000): {"c2"},
    ("candidate", 8000): {"c2", "c3"},
}
CONTROL_FAILS = {("candidate", "c0")}


def hand_records() -> pl.DataFrame:
    return records(
        [
            (arm, c, length, "0.5", 0, "fail" if c in FAILS.get((arm, length), set()) else "pass")
            for arm in ARMS
            for length in LENGTHS
            for c in CASES
        ]
    )


def hand_controls() -> pl.DataFrame:
    return controls([(a, c, 0, "fail" if (a, c) in CONTROL_FAILS else "pass") for a in ARMS for c in CASES])


def test_effective_length_hand_example_nolima() -> None:
    res = effective_length(
        hand_records(), rule="nolima", threshold=0.85, scored_controls=hand_controls(), reps=200, seed=1
    )
    b, c = res.row("baseline", "0.5"), res.row("candidate", "0.5")
    assert res.base_scores == {"baseline": 1.0, "candidate": 0.75}
    assert res.base_resampled
    assert (b.threshold_abs, c.threshold_abs) == (0.85, pytest.approx(0.6375))
    assert (b.estimate, b.steps, b.at_grid_top) == (2000, 2, False)
    assert (c.estimate, c.steps, c.at_grid_top) == (4000, 3, False)
    assert b.grid == LENGTHS
    d = res.delta("0.5")
    assert (d.estimate, d.estimate_steps) == (2000, 1)
    # Fixed base scores give the same point estimates; the base is then not resampled.
    fixed = effective_length(
        hand_records(),
        rule="nolima",
        threshold=0.85,
        base_scores={"baseline": 1.0, "candidate": 0.75},
        reps=50,
    )
    assert not fixed.base_resampled
    assert [(r.arm, r.estimate) for r in fixed.rows] == [("baseline", 2000), ("candidate", 4000)]
    assert base_scores_from_controls(hand_controls()) == {"baseline": 1.0, "candidate": 0.75}


def test_effective_length_hand_example_ruler_and_curve() -> None:
    res = effective_length(hand_records(), rule="ruler", threshold=0.7, reps=200, seed=1)
    b, c = res.row("baseline", "0.5"), res.row("candidate", "0.5")
    assert (b.estimate, b.steps, b.at_grid_top, b.base_score) == (8000, 4, True, None)
    assert (c.estimate, c.steps) == (4000, 3)
    assert (res.delta("0.5").estimate, res.delta("0.5").estimate_steps) == (-4000, -1)
    curve = res.curve_frame.filter(pl.col("arm") == "candidate").sort("length")
    assert curve["accuracy"].to_list() == [1.0, 0.75, 0.75, 0.5]
    assert curve["meets"].to_list() == [True, True, True, False]
    assert curve["n_cases"].to_list() == [4, 4, 4, 4]
    # Wilson on the design-effect-adjusted n (one seed: DEFF 1, n_eff 4): 2/4 -> (0.1500, 0.8500).
    lo, hi = proportion_confint(2, 4, alpha=0.05, method="wilson")
    assert curve["wilson_lower"][3] == pytest.approx(lo) and curve["wilson_upper"][3] == pytest.approx(hi)
    assert (round(lo, 4), round(hi, 4)) == (0.1500, 0.8500)
    js = res.to_dict()
    assert js["rows"][0]["grid"] == list(LENGTHS) and js["convention"].startswith("first crossing")


def _exact_bootstrap(rule: str, threshold: float) -> dict[str, dict[int, float]]:
    """Enumerate all 4^4 equally likely ordered case resamples: the exact bootstrap distribution of each
    arm's effective length and of the paired difference (pure Python, independent of the product)."""
    rate = {
        (arm, length, c): 0.0 if c in FAILS.get((arm, length), set()) else 1.0
        for arm in ARMS
        for length in LENGTHS
        for c in CASES
    }
    ctl = {(a, c): 0.0 if (a, c) in CONTROL_FAILS else 1.0 for a in ARMS for c in CASES}
    out: dict[str, dict[int, float]] = {"baseline": {}, "candidate": {}, "delta": {}}
    for draw in itertools.product(CASES, repeat=4):
        el = {}
        for arm in ARMS:
            thr = threshold * (sum(ctl[(arm, c)] for c in draw) / 4 if rule == "nolima" else 1.0)
            value = 0
            for length in LENGTHS:
                if sum(rate[(arm, length, c)] for c in draw) / 4 >= thr - 1e-12:
                    value = length
                else:
                    break
            el[arm] = value
            out[arm][value] = out[arm].get(value, 0.0) + 1 / 256
        diff = el["candidate"] - el["baseline"]
        out["delta"][diff] = out["delta"].get(diff, 0.0) + 1 / 256
    return out


def _exact_interval(mass: dict[int, float], alpha: float) -> tuple[int, int]:
    cdf, lo, hi = 0.0, None, None
    for v in sorted(mass):
        cdf += mass[v]
        if lo is None and cdf >= alpha / 2 - 1e-12:
            lo = v
        if hi is None and cdf >= 1 - alpha / 2 - 1e-12:
            hi = v
    assert lo is not None and hi is not None
    return lo, hi


@pytest.mark.parametrize(("rule", "threshold", "alpha"), [("nolima", 0.85, 0.05), ("ruler", 0.7, 0.2)])
def test_effective_length_bootstrap_matches_exact_enumeration(
    rule: str, threshold: float, alpha: float
) -> None:
    reps = 20000
    kwargs = {"scored_controls": hand_controls()} if rule == "nolima" else {}
    res = effective_length(
        hand_records(), rule=rule, threshold=threshold, reps=reps, seed=7, alpha=alpha, **kwargs
    )
    exact = _exact_bootstrap(rule, threshold)
    for arm in ARMS:
        row = res.row(arm, "0.5")
        got = dict(row.distribution)
        assert set(got) == set(exact[arm])
        for v, p in exact[arm].items():
            assert abs(got[v] - p) < 4 * math.sqrt(p * (1 - p) / reps) + 1e-9, (arm, v)
        # The exact CDF is nowhere within 0.01 of the cut points here, so the Monte Carlo interval is
        # the exact one.
        assert (row.lower, row.upper) == _exact_interval(exact[arm], alpha)
    d = res.delta("0.5")
    assert (d.lower, d.upper) == _exact_interval(exact["delta"], alpha)
    shorter = sum(p for v, p in exact["delta"].items() if v < 0)
    assert abs(d.share_shorter - shorter) < 4 * math.sqrt(shorter * (1 - shorter) / reps)


def test_effective_length_hand_bootstrap_numbers() -> None:
    """Baseline, NoLiMa: the resample misses c3 (the only failure) with probability (3/4)^4 = 81/256,
    then every length passes (EL 8000); otherwise accuracy at 4000 is <= 0.75 < 0.85 (EL 2000)."""
    exact = _exact_bootstrap("nolima", 0.85)
    assert exact["baseline"] == {2000: pytest.approx(175 / 256), 8000: pytest.approx(81 / 256)}
    assert _exact_interval(exact["baseline"], 0.05) == (2000, 8000)


def test_wilson_design_interval_hand() -> None:
    """Rates (1, 1, 0, 0.5) over R = 2: p = 0.625, s^2 = 0.6875/3, Var_srs = 0.234375/8 -> Kish DEFF =
    (0.229167/4)/(0.029297) = 1.956 (below R = 2), n_eff = 8/1.956 = 4.09: Wilson on 0.625 x 4.09."""
    lo, hi, deff = wilson_design_interval([1.0, 1.0, 0.0, 0.5], 2.0)
    expected = (0.6875 / 3 / 4) / (0.625 * 0.375 / 8)
    assert deff == pytest.approx(expected) and round(deff, 3) == 1.956
    n_eff = 8 / expected
    ref = proportion_confint(0.625 * n_eff, n_eff, alpha=0.05, method="wilson")
    assert (lo, hi) == (pytest.approx(ref[0]), pytest.approx(ref[1]))
    # No spread (all 1): DEFF = R, n_eff = the number of cases.
    assert wilson_design_interval([1.0] * 4, 3.0)[2] == 3.0


def test_effective_length_missing_runs_and_rules() -> None:
    df = hand_records().with_columns(
        pl.when((pl.col("arm") == "baseline") & (pl.col("length") == 4000) & (pl.col("case_id") == "c3"))
        .then(pl.lit("missing"))
        .otherwise(pl.col("outcome"))
        .alias("outcome")
    )
    # c3's only failure is now missing: the baseline passes everywhere on the 3 observed cases.
    res = effective_length(df, rule="ruler", threshold=0.9, reps=100)
    point = res.curve_frame.filter((pl.col("arm") == "baseline") & (pl.col("length") == 4000)).row(
        0, named=True
    )
    assert (point["n_cases"], point["accuracy"]) == (3, 1.0)
    assert res.row("baseline", "0.5").estimate == 8000
    with pytest.raises(InputError, match="NoLiMa"):
        effective_length(df, rule="nolima", threshold=0.85)
    with pytest.raises(InputError, match="absolute threshold"):
        effective_length(df, rule="ruler", threshold=0.85, base_scores={"baseline": 1.0, "candidate": 1.0})
    with pytest.raises(InputError, match="threshold"):
        effective_length(df, rule="ruler", threshold=1.5)
    with pytest.raises(InputError, match="lack column"):
        effective_length(df.drop("seed"), rule="ruler", threshold=0.5)


def _el_world(rng: np.random.Generator, n: int, planted: bool) -> pl.DataFrame:
    """4 lengths x 3 depths, 2 seeds. Per-case ability ~ N(3, 1) logits, -0.4 per doubling of the length
    (accuracy about 0.93, 0.90, 0.87, 0.83); the planted candidate loses 1.5 logits at depth 0.5 from 16K
    on (about 0.65 there: its effective length at 0.75 drops from 32K to 8K)."""
    lengths = (4096, 8192, 16384, 32768)
    ability = rng.normal(3.0, 1.0, n)
    arrays = {}
    for j, length in enumerate(lengths):
        for pos in ("0", "0.5", "1"):
            eta = ability - 0.4 * j
            for arm in ARMS:
                shift = -1.5 if planted and arm == "candidate" and pos == "0.5" and length >= 16384 else 0.0
                p = 1 / (1 + np.exp(-(eta + shift)))
                arrays[(arm, length, pos)] = (rng.random((n, 2)) < p[:, None]).astype(float)
    return from_arrays(arrays)


def test_effective_length_simulation_planted_found_and_aa_clean() -> None:
    rng = np.random.default_rng(2024)
    planted = effective_length(_el_world(rng, 80, True), rule="ruler", threshold=0.75, reps=400, seed=1)
    d = planted.delta("0.5")
    assert (d.estimate, d.estimate_steps) == (8192 - 32768, -2)
    assert d.upper < 0 and d.share_shorter > 0.975
    assert planted.delta("0").lower <= 0 <= planted.delta("0").upper
    covered = total = 0
    for rep in range(8):
        aa = effective_length(_el_world(rng, 80, False), rule="ruler", threshold=0.75, reps=400, seed=rep)
        for delta in aa.deltas:
            total += 1
            covered += delta.lower <= 0 <= delta.upper
    assert total == 24 and covered >= 22, covered


# --------------------------------------------------------------------------------------------------
# Control-normalised accuracy


def test_control_normalised_accuracy_hand_example() -> None:
    # Slice 1000/0.5, 2 seeds. Baseline rates: c0 0, c1 1, c2 0.5, c3 1 -> raw 0.625.
    outcomes = {
        "c0": ("fail", "fail"),
        "c1": ("pass", "pass"),
        "c2": ("pass", "fail"),
        "c3": ("pass", "pass"),
    }
    rows = [("baseline", c, 1000, "0.5", s, o[s]) for c, o in outcomes.items() for s in (0, 1)]
    rows += [("candidate", c, 1000, "0.5", s, "pass") for c in outcomes for s in (0, 1)]
    # Baseline controls: c0 fails both seeds (task), c1 passes, c2 1 of 2 (a tie counts as a pass, as
    # in classify_failures), c3 only a system_fail (no usable control). Candidate: c1 fails (0/2).
    ctl = controls(
        [
            ("baseline", "c0", 0, "fail"),
            ("baseline", "c0", 1, "fail"),
            ("baseline", "c1", 0, "pass"),
            ("baseline", "c1", 1, "pass"),
            ("baseline", "c2", 0, "pass"),
            ("baseline", "c2", 1, "fail"),
            ("baseline", "c3", 0, "system_fail"),
            *[("candidate", c, s, "fail" if c == "c1" else "pass") for c in outcomes for s in (0, 1)],
        ]
    )
    out = control_normalised_accuracy(records(rows), ctl)
    b = out.filter(pl.col("arm") == "baseline").row(0, named=True)
    assert b["n_cases"] == 4 and b["accuracy"] == pytest.approx(0.625)
    assert (b["n_eligible"], b["accuracy_eligible"]) == (2, pytest.approx(0.75))  # c1 1.0, c2 0.5
    assert (b["n_ineligible"], b["accuracy_ineligible"]) == (1, 0.0)  # c0
    assert b["n_no_control"] == 1  # c3
    c = out.filter(pl.col("arm") == "candidate").row(0, named=True)
    assert (c["n_eligible"], c["accuracy_eligible"], c["n_ineligible"]) == (3, 1.0, 1)
    # The paired population of a control-normalised gate: the baseline's eligible cases, both arms.
    assert (c["n_eligible_baseline"], c["accuracy_eligible_baseline"]) == (2, 1.0)
    assert eligible_cases(ctl) == ("c1", "c2")
    assert eligible_cases(ctl, arm="candidate") == ("c0", "c2", "c3")
    assert eligible_cases(ctl, min_control_pass=1.0) == ("c1",)
    assert out.columns[:5] == ["arm", "length", "position", "n_cases", "accuracy"]


def test_control_normalised_accuracy_simulation() -> None:
    """Planted: 30 % of cases cannot do the task (control fails, every long variant fails); the rest
    pass with p = 0.9 except at depth 0.5 (p = 0.5). Raw accuracy mixes both; control-normalised
    accuracy recovers 0.9 at the good depths and keeps the depth loss. A/A with every control passing:
    normalised == raw exactly."""
    rng = np.random.default_rng(11)
    n = 200
    unable = rng.random(n) < 0.3
    arrays = {}
    for pos in ("0", "0.5", "1"):
        p = np.where(unable, 0.0, 0.5 if pos == "0.5" else 0.9)
        for arm in ARMS:
            arrays[(arm, 8192, pos)] = (rng.random((n, 3)) < p[:, None]).astype(float)
    df = from_arrays(arrays)
    ctl = controls(
        [
            (a, f"c{i:03d}", s, "fail" if unable[i] else "pass")
            for a in ARMS
            for i in range(n)
            for s in range(3)
        ]
    )
    out = control_normalised_accuracy(df, ctl).filter(pl.col("arm") == "baseline")
    rows = {r["position"]: r for r in out.iter_rows(named=True)}
    assert rows["0"]["accuracy"] < 0.7 < 0.85 < rows["0"]["accuracy_eligible"] < 0.95
    assert rows["0.5"]["accuracy_eligible"] < 0.6
    assert rows["0"]["accuracy_ineligible"] == 0.0 and rows["0"]["n_ineligible"] == int(unable.sum())
    everyone = controls([(a, f"c{i:03d}", 0, "pass") for a in ARMS for i in range(n)])
    same = control_normalised_accuracy(df, everyone)
    assert same["accuracy_eligible"].to_list() == same["accuracy"].to_list()
    assert same["n_eligible"].to_list() == same["n_cases"].to_list()


# --------------------------------------------------------------------------------------------------
# pass^k


def test_pass_hat_k_hand_example() -> None:
    # 3 seeds. c0 PPP, c1 PPF, c2 FFF, c3 PP + a missing seed (not complete).
    outcomes = {
        "c0": ("pass", "pass", "pass"),
        "c1": ("pass", "pass", "fail"),
        "c2": ("fail", "fail", "fail"),
        "c3": ("pass", "pass", "missing"),
    }
    rows = [(arm, c, 2048, "0.25", s, o[s]) for arm in ARMS for c, o in outcomes.items() for s in range(3)]
    out = pass_hat_k(records(rows))
    r = out.filter(pl.col("arm") == "baseline").row(0, named=True)
    assert (r["k"], r["n_cases"], r["n_complete"]) == (3, 4, 3)
    assert r["accuracy"] == pytest.approx((1 + 2 / 3 + 0 + 1) / 4)
    assert r["accuracy_complete"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert r["pass_hat_k"] == pytest.approx(1 / 3) and r["pass_at_k"] == pytest.approx(2 / 3)
    lo, hi = proportion_confint(1, 3, alpha=0.05, method="wilson")
    assert (r["pass_hat_k_lower"], r["pass_hat_k_upper"]) == (pytest.approx(lo), pytest.approx(hi))
    # k = 1: pass^k is the accuracy.
    one = pass_hat_k(records([row for row in rows if row[4] == 0]))
    assert one["pass_hat_k"].to_list() == one["accuracy"].to_list()
    with pytest.raises(InputError, match="outside the seed set"):
        pass_hat_k(records(rows), seeds=[0, 1])


def test_pass_hat_k_simulation_flaky_candidate() -> None:
    """Same mean 0.8: the baseline is deterministic per case (p_i in {0, 1}), the candidate flaky (p_i =
    0.8 everywhere): pass^3 ~ 0.8 vs 0.512, the Wilson intervals separate. A/A: they overlap."""
    rng = np.random.default_rng(5)
    n = 150
    det = (rng.random(n) < 0.8).astype(float)
    arrays = {
        ("baseline", 4096, "0.5"): np.repeat(det[:, None], 3, axis=1),
        ("candidate", 4096, "0.5"): (rng.random((n, 3)) < 0.8).astype(float),
    }
    out = {r["arm"]: r for r in pass_hat_k(from_arrays(arrays)).iter_rows(named=True)}
    assert abs(out["baseline"]["accuracy"] - out["candidate"]["accuracy"]) < 0.06
    assert out["candidate"]["pass_hat_k_upper"] < out["baseline"]["pass_hat_k_lower"]
    aa = {
        ("baseline", 4096, "0.5"): (rng.random((n, 3)) < 0.8).astype(float),
        ("candidate", 4096, "0.5"): (rng.random((n, 3)) < 0.8).astype(float),
    }
    same = {r["arm"]: r for r in pass_hat_k(from_arrays(aa)).iter_rows(named=True)}
    assert same["candidate"]["pass_hat_k_lower"] < same["baseline"]["pass_hat_k_upper"]
    assert same["baseline"]["pass_hat_k_lower"] < same["candidate"]["pass_hat_k_upper"]


# --------------------------------------------------------------------------------------------------
# Noise floor


def test_abs_delta_quantiles_hand() -> None:
    # F = 3 flips: |2X - 3| is 3 with probability 2/8, 1 with 6/8.
    assert abs_delta_quantile(3, 0.75) == 1 and abs_delta_quantile(3, 0.76) == 3
    assert abs_delta_quantile(0, 0.99) == 0
    # One run at flip rate 0.5: D in {-1, 0, 1} with 1/4, 1/2, 1/4.
    assert noise_delta_quantile(1, 0.5, 0.5) == 0 and noise_delta_quantile(1, 0.5, 0.6) == 1
    # Four runs at 0.5: D = Binomial(8, 1/2) - 4; P(|D| <= 2) = 238/256 < 0.95 <= P(|D| <= 3) = 254/256.
    assert noise_delta_quantile(4, 0.5, 238 / 256) == 2 and noise_delta_quantile(4, 0.5, 0.95) == 3
    assert noise_delta_quantile(2, 1.0, 0.5) == 0 and noise_delta_quantile(2, 1.0, 0.51) == 2
    assert noise_delta_quantile(50, 0.0, 0.99) == 0


def test_noise_delta_quantile_matches_exact_trinomial() -> None:
    runs, rate = 6, 0.3
    mass: dict[int, float] = {}
    for steps in itertools.product((-1, 0, 1), repeat=runs):
        p = math.prod(rate / 2 if s else 1 - rate for s in steps)
        mass[abs(sum(steps))] = mass.get(abs(sum(steps)), 0.0) + p
    cdf = np.cumsum([mass.get(m, 0.0) for m in range(runs + 1)])
    for level in (0.5, 0.8, 0.9, 0.95, 0.99):
        assert noise_delta_quantile(runs, rate, level) == int(np.searchsorted(cdf, level - 1e-12))


def test_noise_floor_hand_example() -> None:
    # One slice, 2 cases x 2 seeds. c0: base P P, repeat P F (a regression flip); c1: base F P, repeat
    # P P (an improvement flip). 2 flips of 4 paired runs; Delta = mean(-0.5, +0.5) = 0.
    rows = [
        ("baseline", "c0", 512, "0.5", 0, "pass"),
        ("baseline", "c0", 512, "0.5", 1, "pass"),
        ("baseline", "c1", 512, "0.5", 0, "fail"),
        ("baseline", "c1", 512, "0.5", 1, "pass"),
        ("candidate", "c0", 512, "0.5", 0, "pass"),
        ("candidate", "c0", 512, "0.5", 1, "fail"),
        ("candidate", "c1", 512, "0.5", 0, "pass"),
        ("candidate", "c1", 512, "0.5", 1, "pass"),
    ]
    res = noise_floor(records(rows))
    (s,) = res.slices
    assert (s.n_cases, s.seeds, s.paired_runs, s.flips, s.flip_rate) == (2, 2, 4, 2, 0.5)
    assert (s.improve, s.regress, s.cases_flipping, s.delta) == (1, 1, 2, 0.0)
    assert s.asymmetry_p == 1.0
    # One slice: level 0.95; 4 runs at flip rate 0.5: m = 3 (above) -> bound 3/4 -> margin 0.75.
    assert res.level == 0.95 and s.delta_bound == 0.75 and res.noise_bound_margin == 0.75
    # Issue #22: the recommendation is where a simulated A/A release passes with the target 0.8.
    # Two cases: the gate's monotone percentile bound (issue #22, item 3) is the smaller case difference in
    # most resamples, so no margin < 1 passes this design's A/A release 0.8 of the time; the
    # recommendation is then the largest margin on the grid, shown with its probability (0.58).
    assert res.pass_target == 0.8 and res.recommended_margin == 0.99 and 0.3 < res.pass_probability < 0.8
    assert res.binding_slice == "512/0.5"
    # Flip-rate upper bound: per-case flip rates (0.5, 0.5) have no spread, Kish DEFF = 1, n_eff = 4:
    # one-sided 95 % Wilson on 2/4.
    lo, _ = proportion_confint(2, 4, alpha=0.10, method="wilson")
    assert s.flip_rate_upper == pytest.approx(1 - lo)
    js = res.to_dict()
    assert js["slices"][0]["flips"] == 2 and js["noise_bound_margin"] == 0.75


def test_noise_floor_deterministic_and_levels() -> None:
    y = (np.random.default_rng(3).random((40, 3)) < 0.8).astype(float)
    same = {(arm, length, pos): y for arm in ARMS for length in (1024, 2048) for pos in ("0", "1")}
    res = noise_floor(from_arrays(same), plan=GatePlan(n_min=40, bootstrap_resamples=199))
    assert res.flips == 0 and res.max_delta_bound == 0.0 and res.noise_bound_margin == 0.01
    # No flip in 480 runs still allows some (the upper bound), clustered by case over every slice (issue
    # #39 item 5): the 4 slices × 3 seeds of one case are one cluster, so n_eff is the 40 cases and the
    # bound is 1 − 0.05^(1/40) = 0.072 (0.0062 when the 480 runs counted as independent); at that rate
    # the release passes 0.8 of the time only at 0.12 (0.08 before).
    assert res.flip_rate_upper_clustered == pytest.approx(1 - 0.05 ** (1 / 40), abs=1e-9)
    assert 0.10 < res.recommended_margin <= 0.15 and res.pass_probability >= 0.8
    assert res.level == pytest.approx(1 - 0.05 / 4)
    # This A/A run itself passes at the plan's 0.10, but 0.10 is below what 40 cases can promise a fresh
    # A/A release at the bound: the plan margin is flagged.
    assert res.aa_verdict == "PASS" and res.aa_not_passing == () and not res.plan_margin_ok
    assert noise_floor(from_arrays(same), familywise=False).level == pytest.approx(0.95)
    shifted = from_arrays(same).with_columns(
        pl.when(pl.col("arm") == "candidate")
        .then(pl.col("seed") + 10)
        .otherwise(pl.col("seed"))
        .alias("seed")
    )
    with pytest.raises(InputError, match="no paired A/A runs"):
        noise_floor(shifted)
    with pytest.raises(InputError, match="both arms"):
        noise_floor(from_arrays({k: v for k, v in same.items() if k[0] == "baseline"}))


def _aa_world(rng: np.random.Generator, n: int, slices: int, flip: float, shift: float = 0.0) -> pl.DataFrame:
    """Each case has a deterministic outcome (pass with 0.85); each run flips it with probability
    ``flip``; the repeat additionally fails a passing run with probability ``shift`` (not an A/A)."""
    arrays = {}
    for s in range(slices):
        det = (rng.random(n) < 0.85).astype(float)[:, None]
        for arm in ARMS:
            y = np.where(rng.random((n, 3)) < flip, 1 - det, det)
            if arm == "candidate" and shift:
                y = np.where(rng.random((n, 3)) < shift, 0.0, y)
            arrays[(arm, 1024 * (s + 1), "0.5")] = y
    return from_arrays(arrays)


def test_noise_floor_simulation() -> None:
    """A/A with a planted flip rate: the estimate recovers it, a fresh A/A run of the same design does
    not breach the recommended margin, and the sign test stays quiet. A planted asymmetry (the repeat
    fails 25 % of passing runs: not the same system) is flagged by the sign test."""
    rng = np.random.default_rng(17)
    flip = 0.05  # per arm; a pair flips with 2 f (1 - f) = 0.095
    res = noise_floor(_aa_world(rng, 60, 4, flip))
    assert abs(res.flip_rate - 2 * flip * (1 - flip)) < 0.03
    assert all(s.asymmetry_p > 0.01 for s in res.slices)
    breaches = 0
    for _ in range(20):
        fresh = noise_floor(_aa_world(rng, 60, 4, flip), familywise=False, sims=20)
        breaches += fresh.max_abs_delta > res.recommended_margin + 1e-12
    assert breaches <= 1
    skewed = noise_floor(_aa_world(rng, 60, 4, flip, shift=0.25))
    assert all(s.asymmetry_p < 0.01 for s in skewed.slices)
    assert all(s.delta < 0 for s in skewed.slices)
    # The sign test is binom_test on (improve, improve + regress).
    s0 = skewed.slices[0]
    assert s0.asymmetry_p == pytest.approx(float(binom_test(s0.improve, s0.improve + s0.regress)))


# --------------------------------------------------------------------------------------------------
# Power


def test_power_reproduces_spec_section_3() -> None:
    """Spec §3: p = 0.85, Beta(1.7, 0.3) cases (ICC 1/3), no coupling: sd_diff 0.184 at R = 5 -> 23 cases,
    0.412 at R = 1 -> 107. sd_diff 0.3, M = 0.10 -> 58 cases (141 for 20 slices jointly)."""
    d = DesignParameters.from_icc(0.85, 1 / 3)
    assert d.between_case_sd**2 == pytest.approx(0.0425)
    # omega^2 = 2 (p (1 - p) - SD^2) = 2 (0.1275 - 0.0425) = 0.17
    assert d.moments() == (0.0, pytest.approx(0.17))
    assert d.sd_diff(5) == pytest.approx(math.sqrt(0.034)) and round(d.sd_diff(5), 3) == 0.184
    assert round(d.sd_diff(1), 3) == 0.412
    five = cases_for_power(d, seeds=5, sizing=TABLE)
    one = cases_for_power(d, seeds=1, sizing=TABLE)
    assert (five.n_test, one.n_test) == (23, 107)
    assert sample_size_per_slice(d.sd_diff(5), TABLE) == 23
    flat = DesignParameters(0.85, 0.0, interaction_sd=0.3, within_var=0.0)
    assert flat.sd_diff(3) == pytest.approx(0.3)
    assert cases_for_power(flat, seeds=3, sizing=TABLE).n_test == 58
    joint = cases_for_power(flat, seeds=3, sizing=TABLE, n_slices=20)
    assert joint.n_test == 141 and joint.per_slice_target == pytest.approx(0.8 ** (1 / 20))
    row = power_per_slice(23, 5, d, Sizing(n_min=0))
    # The model's D is 1 at delta 0; the gate shrinks it toward R with the weight of 6 discordant runs
    # (issue #22): 23 x 5 x 0.17 = 19.55 expected discordant runs give (19.55 + 6 x 5) / 25.55.
    assert round(row.power_test, 3) == 0.809
    assert row.deff == pytest.approx(shrunk_design_effect(1.0, 23 * 5 * 0.17, 5))
    assert power_per_slice(23, 5, d, Sizing()).power == 0.0  # below n_min 40: INCONCLUSIVE


def test_power_moments_hand_example() -> None:
    """p = 0.8, SD = 0.2, delta = -0.08: q_i = 0.9 p_i. E[p^2] = 0.68, tau^2 = 0.1^2 x 0.04 = 0.0004,
    E[p(1-p)] = 0.12, E[q(1-q)] = 0.72 - 0.81 x 0.68 = 0.1692, omega^2 = 0.2892 (no coupling);
    coupling 0.5 subtracts 2 x 0.5 x E[q - pq] = 0.72 - 0.9 x 0.68 = 0.108."""
    d = DesignParameters(0.8, 0.2)
    tau2, omega2 = d.moments(-0.08)
    assert tau2 == pytest.approx(0.0004) and omega2 == pytest.approx(0.2892)
    assert DesignParameters(0.8, 0.2, seed_coupling=0.5).moments(-0.08)[1] == pytest.approx(0.2892 - 0.108)
    # delta = +0.1: 1 - q = 0.5 (1 - p); tau^2 = 0.25 x 0.04; E[q(1-q)] = 0.5 x 0.2 - 0.25 x (0.04 + 0.04).
    tau2, omega2 = d.moments(0.1)
    assert tau2 == pytest.approx(0.01) and omega2 == pytest.approx(0.12 + 0.08)
    # Expected run table at delta 0: psi = omega^2 = 2 x 0.12 -> b = c = 0.12, a = 0.68, d = 0.08.
    assert expected_table(d) == pytest.approx((0.68, 0.12, 0.12, 0.08))
    r = power_per_slice(60, 3, d, Sizing(n_min=40), true_delta=-0.08)
    model_deff = 1 + 2 * 0.0004 / (0.0004 + 0.2892)
    _, b, c, _ = expected_table(d, -0.08)
    assert r.deff == pytest.approx(shrunk_design_effect(model_deff, (b + c) * 60 * 3, 3))  # issue #22
    assert r.sd_diff == pytest.approx(math.sqrt(0.0004 + 0.2892 / 3))
    with pytest.raises(InputError, match="true_delta"):
        d.moments(-0.9)
    with pytest.raises(InputError, match="between_case_sd"):
        DesignParameters(0.9, 0.5)


def test_draw_design_matches_moments() -> None:
    d = DesignParameters(0.8, 0.2, seed_coupling=0.3)
    yb, yc = draw_design(np.random.default_rng(0), d, 20000, 3, -0.08, 1)
    diff = yc[0].mean(axis=1) - yb[0].mean(axis=1)
    assert diff.mean() == pytest.approx(-0.08, abs=0.01)
    assert diff.var() == pytest.approx(d.sd_diff(3, -0.08) ** 2, rel=0.05)


def test_pilot_parameters_hand_example() -> None:
    """Baseline rates over 2 seeds: c0 1, c1 1, c2 0.5, c3 0 -> p = 0.625, Var(rates) = 0.6875/3;
    between-case variance = (0.229167 - 0.234375/2) / (1 - 1/2) = 0.223958. Candidate differences per run:
    c0 (0, -1) -> d = -0.5, c1 (0, 0), c2 (+1... ) as below."""
    base = {"c0": (1, 1), "c1": (1, 1), "c2": (1, 0), "c3": (0, 0)}
    cand = {"c0": (1, 0), "c1": (1, 1), "c2": (1, 1), "c3": (0, 0)}
    rows = []
    for arm, table in (("baseline", base), ("candidate", cand)):
        for c, ys in table.items():
            rows += [(arm, c, 4096, "0.5", s, "pass" if y else "fail") for s, y in enumerate(ys)]
    pilot = pilot_parameters(records(rows))
    (s,) = pilot.slices
    assert s.p_baseline == pytest.approx(0.625)
    var_rates = 0.6875 / 3
    assert s.between_case_sd**2 == pytest.approx((var_rates - 0.625 * 0.375 / 2) / 0.5)
    # Run differences e: c0 (0, -1), c1 (0, 0), c2 (0, +1), c3 (0, 0); d = (-0.5, 0, 0.5, 0).
    assert s.sd_diff == pytest.approx(math.sqrt(np.var([-0.5, 0, 0.5, 0], ddof=1)))
    within = np.mean([0.5, 0.0, 0.5, 0.0])  # per-case variances of e with ddof 1
    assert s.within_var == pytest.approx(within)
    assert s.interaction_sd == pytest.approx(
        math.sqrt(max(np.var([-0.5, 0, 0.5, 0], ddof=1) - within / 2, 0))
    )
    design = pilot.design(4096, "0.5", min_cases=2)
    assert design.within_var == pytest.approx(within) and design.source == "pilot:4096/0.5"
    assert pilot.design(9999, "0", min_cases=2).source == "pilot:pooled"


def test_pilot_recovers_a_known_design() -> None:
    d = DesignParameters(0.8, 0.25)
    yb, yc = draw_design(np.random.default_rng(1), d, 3000, 3, 0.0, 1)
    df = from_arrays({("baseline", 8192, "0"): yb[0], ("candidate", 8192, "0"): yc[0]})
    (s,) = pilot_parameters(df).slices
    assert s.p_baseline == pytest.approx(0.8, abs=0.02)
    assert s.between_case_sd == pytest.approx(0.25, abs=0.02)
    assert s.sd_diff == pytest.approx(d.sd_diff(3), rel=0.05)
    assert s.within_var == pytest.approx(d.moments()[1], rel=0.05)
    assert s.interaction_sd is not None and s.interaction_sd**2 < 0.1 * s.sd_diff**2  # tau^2 = 0 here
    carried = pilot_parameters(df).design(8192, "0")
    assert carried.sd_diff(5) == pytest.approx(d.sd_diff(5), rel=0.1)


def test_power_plan_table() -> None:
    slices = [(4096, p) for p in ("0", "0.5", "1")] + [(16384, "0.5")]
    plan = power_plan(
        slices, n_cases=60, seeds=3, sizing=Sizing(), design=DesignParameters.from_icc(0.85, 1 / 3)
    )
    assert [(r.length, r.position) for r in plan.rows] == sorted(slices, key=lambda k: (k[0], float(k[1])))
    assert plan.per_slice_target == pytest.approx(0.8 ** (1 / 4))
    assert plan.power_all_slices == pytest.approx(math.prod(r.power for r in plan.rows))
    assert plan.cases_needed == max(r.cases.n_recommended or 0 for r in plan.rows)
    frame = plan.frame
    assert {"power", "power_test", "power_newcombe", "n_for_target", "check_by_simulation"} <= set(
        frame.columns
    )
    assert plan.to_dict()["rows"][0]["cases"]["n_slices"] == 4
    with pytest.raises(InputError, match="no design parameters"):
        power_plan(slices, n_cases=60, seeds=3, sizing=Sizing())


def test_newcombe_binds_near_the_ceiling() -> None:
    """p = 0.97 with strong case spread: the t-test promises power the gate cannot have (few discordant
    runs, Newcombe-RS with DEFF = R); the Newcombe approximation binds and the row asks for simulation."""
    d = DesignParameters.from_icc(0.97, 0.5)
    row = power_per_slice(40, 3, d, Sizing(margin=0.05))
    assert row.power_newcombe < row.power_test and row.power == row.power_newcombe
    assert row.check_by_simulation and row.expected_discordant < 10
    c = row.cases
    assert c.n_test is not None and c.n_approx is not None and c.n_approx > c.n_test


def test_power_checked_against_the_gate_small() -> None:
    """The gate itself on simulated slices (seeded; B = 199): power near the approximation at delta 0,
    size at most alpha + 2 MC-SE at delta = -M. The full table is tests/judge/test_position_sim.py."""
    d = DesignParameters.from_icc(0.85, 0.0)
    design = {"n_cases": 60, "seeds": 3, "margin": 0.1, "alpha": 0.05, "sims": 80, "bootstrap_resamples": 199}
    sim = simulate_gate_power(d, seed=3, **design)
    assert abs(sim.rate - sim.predicted) < 3 * sim.mc_se + 0.03, sim
    size = simulate_gate_power(d, true_delta=-0.1, seed=4, **design)
    assert size.rate <= 0.05 + 2 * size.mc_se, size
    assert size.predicted == pytest.approx(0.05, abs=0.01)


def test_low_nolima_base_score_is_flagged_per_arm() -> None:
    """An arm that fails most evidence-only controls has a NoLiMa threshold near chance: the report says
    so for that arm only (the embedded query-first arm: base 0.08, docs/position.md)."""
    from depthgate.report.position import position_science
    from depthgate.spec.models import AnalysisPlan

    plan = AnalysisPlan(n_min=2, bootstrap_resamples=99)
    fine = position_science(hand_records(), plan, seeds=[0], scored_controls=hand_controls())
    assert fine.effective is not None and fine.effective.base_scores == {"baseline": 1.0, "candidate": 0.75}
    assert not [n for n in fine.notes if "NoLiMa base score" in n]
    weak = controls(
        [(a, c, 0, "fail" if a == "candidate" and c != "c3" else "pass") for a in ARMS for c in CASES]
    )
    low = position_science(hand_records(), plan, seeds=[0], scored_controls=weak)
    flagged = [n for n in low.notes if "NoLiMa base score" in n]
    assert len(flagged) == 1 and flagged[0].startswith("candidate: NoLiMa base score 0.25")
    assert "threshold 0.212" in flagged[0]

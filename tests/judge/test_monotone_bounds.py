"""Issue #22, item 3 (the remainder): every lower bound the gate uses is monotone in added failures.

Turning one candidate run from pass to fail never raises a slice's lower bound (the bootstrap part,
the Newcombe part, their minimum), its upper bound, the overall or worst-position lower bound, never
lowers p_NI, and never turns a failing slice or release into a passing one. Until this change the
bootstrap-t rose in such flips (22-49 of 400 random flips, up to .30 at 10 cases x 2 seeds), which made
min(bootstrap-t, Newcombe-RS) rise with it. The gate now uses the percentile bootstrap on resamples
drawn from the seed alone (``depthgate.judge.bounds.percentile``), monotone by construction.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_stats import draw_pairs, records_from_arrays

from depthgate.judge.bounds import bootstrap_percentile, slice_statistics
from depthgate.judge.gate import GatePlan, SliceStatus, Verdict, gate

PROPS = settings(deadline=None, database=None, max_examples=60)
EPS = 1e-12

# Found on the code before this change (bootstrap-t): 10 cases x 2 seeds, a slice far below -M; the
# second run of case 3 failing *raised* min(bootstrap-t, Newcombe-RS) from -0.750 to -0.447.
PINNED_BASELINE = [[0, 0], [1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1]]
PINNED_CANDIDATE = [[0, 0], [1, 1], [0, 0], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [0, 0]]
PINNED_FLIP = (3, 1)
RANK = {Verdict.PASS: 0, Verdict.INCONCLUSIVE: 1, Verdict.FAIL: 2}


@st.composite
def slices(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """A (baseline, candidate) slice of 2-40 cases x 2-5 seeds from the spec's broken-case DGP (skewed
    losses, near and far from the ceiling) and one candidate run that passes, to be failed."""
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.sampled_from([2, 3, 5, 10, 20, 40]))
    seeds = draw(st.integers(2, 5))
    mu = draw(st.sampled_from([0.85, 0.95, 0.99]))
    delta = draw(st.sampled_from([0.0, -0.1, -0.3, -0.6]))
    yb, yc = draw_pairs(np.random.default_rng(seed), n, seeds, delta=delta, mu=mu)
    passing = np.argwhere(yc == 1)
    if passing.size == 0:
        yc[0, 0] = 1.0
        passing = np.argwhere(yc == 1)
    i, j = passing[draw(st.integers(0, len(passing) - 1))]
    return yb, yc, (int(i), int(j))


def _failed(yc: np.ndarray, flip: tuple[int, int]) -> np.ndarray:
    worse = yc.copy()
    assert worse[flip] == 1.0
    worse[flip] = 0.0
    return worse


def _pinned() -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    return np.array(PINNED_BASELINE, float), np.array(PINNED_CANDIDATE, float), PINNED_FLIP


@PROPS
@given(slices(), st.sampled_from([0.05, 0.025]), st.sampled_from([0.03, 0.1, 0.6]))
@example(_pinned(), 0.05, 0.10)
def test_a_failed_candidate_run_never_raises_a_slice_bound(pair, alpha: float, margin: float) -> None:
    yb, yc, flip = pair
    before = slice_statistics(yb, yc, margin, alpha, 199, 7)
    after = slice_statistics(yb, _failed(yc, flip), margin, alpha, 199, 7)
    assert after.lower <= before.lower + EPS
    assert after.lower_newcombe <= before.lower_newcombe + EPS
    assert after.lower_bootstrap is not None and before.lower_bootstrap is not None
    assert after.lower_bootstrap <= before.lower_bootstrap + EPS
    assert after.p_ni >= before.p_ni - EPS
    assert not (after.lower > -margin and not before.lower > -margin)  # no FAIL -> PASS


def test_the_pinned_flip_no_longer_raises_the_bound() -> None:
    """The explicit example: before this change -0.750 -> -0.447 (a FAIL at M = 0.6 became a PASS)."""
    yb, yc, flip = _pinned()
    before = slice_statistics(yb, yc, 0.6, 0.05, 999, 7)
    after = slice_statistics(yb, _failed(yc, flip), 0.6, 0.05, 999, 7)
    assert after.lower <= before.lower
    plan = GatePlan(margin=0.6, n_min=10, bootstrap_resamples=999, bootstrap_seed=7)
    verdicts = [
        gate(records_from_arrays({(2048, "0.5"): (yb, cand)}), plan).verdict
        for cand in (yc, _failed(yc, flip))
    ]
    assert RANK[verdicts[1]] >= RANK[verdicts[0]], verdicts  # before: FAIL, then PASS


@settings(deadline=None, database=None, max_examples=15)
@given(slices())
def test_a_failed_candidate_run_never_turns_a_release_fail_into_pass(pair) -> None:
    """Through gate() with two slices sharing cases: the slice, overall and worst-position lower bounds
    never rise, and no FAIL (slice or release) becomes a PASS."""
    yb, yc, flip = pair
    n = yb.shape[0]
    if n < 2:
        return
    rng = np.random.default_rng(n)
    other = draw_pairs(rng, n, yb.shape[1], mu=0.95)
    plan = GatePlan(margin=0.1, n_min=2, bootstrap_resamples=999)
    results = []
    for cand in (yc, _failed(yc, flip)):
        results.append(gate(records_from_arrays({(2048, "0.5"): (yb, cand), (2048, "0.0"): other}), plan))
    before, after = results
    assert RANK[after.verdict] >= RANK[before.verdict] or before.verdict is Verdict.INCONCLUSIVE
    for b, a in zip(before.slice_results, after.slice_results, strict=True):
        assert (b.length, b.position) == (a.length, a.position)
        if b.status is not SliceStatus.PASS:
            assert a.status is not SliceStatus.PASS
        if b.lower is not None and a.lower is not None:
            assert a.lower <= b.lower + EPS
    assert before.overall is not None and after.overall is not None
    assert after.overall.lower <= before.overall.lower + EPS
    for b, a in zip(before.worst_by_length, after.worst_by_length, strict=True):
        if b.worst_lower is not None and a.worst_lower is not None:
            assert a.worst_lower <= b.worst_lower + EPS


@pytest.mark.parametrize("reps", [999, 9999])
def test_percentile_bound_and_p_value_agree(reps: int) -> None:
    """LB > -M exactly when p_NI <= alpha (the plan's B rule makes alpha (B + 1) an integer)."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        d = rng.choice([-1.0, -0.5, 0.0, 0.5], size=30, p=[0.1, 0.1, 0.7, 0.1])
        for margin in (0.05, 0.1, 0.2):
            b = bootstrap_percentile(d, margin, 0.05, reps, 1)
            assert b.p_ni is not None
            assert (b.lower > -margin) == (b.p_ni <= 0.05)
            assert b.used == reps and b.degenerate == 0

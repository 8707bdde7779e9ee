"""Power before GPU time (issue #13, item 4): per slice, the power of the gate's non-inferiority test
with a matrix's cases and seeds, and the cases that would reach a target power.

**Model** (research/stats_gate.md §2.1, §3). The unit is the case. Per slice, case i has a true baseline
pass probability p_i (mean ``p_baseline``, between-case SD ``between_case_sd``; ICC = SD² / (p (1 − p)),
the intra-class correlation of one case's runs) and a candidate probability q_i; each of R seeds draws a
pass/fail per arm. The gate tests the case-level paired difference d_i = mean_s(y^c) − mean_s(y^b), and

    Var(d_i) = tau² + omega² / R
    tau²   = Var(q_i − p_i)                               (between-case spread of the true difference)
    omega² = E[p(1−p)] + E[q(1−q)] − 2 c E[min(p,q) − p q]  (within-case run variance; c = seed coupling)

At true delta = 0 the candidate is the baseline case by case (q_i = p_i): tau² = 0 and omega² =
2 (1 − c) (p (1 − p) − SD²) — more between-case spread means *fewer* discordant runs (cases near 0 or 1
never flip), so a smaller sd_diff. A true delta < 0 scales every case down (q_i = s p_i, s = 1 + delta/p);
delta > 0 scales the failures down (1 − q_i = s' (1 − p_i)); both keep q_i in [0, 1] with mean exactly
p + delta. ``interaction_sd`` adds case-by-system interaction (tau² += interaction_sd²), e.g. from a pilot
of a real A/B comparison. The design effect of the R runs of a case is DEFF = 1 + (R − 1) tau² / (tau² +
omega²), so sd_diff² = (tau² + omega²) DEFF / R.

**Power** of the one-sided NI test (H0: delta <= −M) at the look's alpha. The gate passes a slice when
both its bounds clear −M (R >= 2: bootstrap-t and Newcombe-RS; R = 1: Newcombe-10), so the power is
approximated by the smaller of two numbers: the paired t on case differences, statsmodels
``TTestPower().power(effect_size=(delta + M) / sd_diff, nobs=n, alpha, alternative="larger")`` — the
spec's §3 sizing, whose numbers the tests reproduce (sd_diff 0.184 at p = 0.85, ICC 1/3, R = 5 gives
23 cases; 0.412 at R = 1 gives 107) — and a normal approximation of the Newcombe-RS bound on the expected
run table (:func:`expected_table`), which binds near the ceiling where the t-test promises power the
gate cannot have (p = 0.95, M = 0.05). :func:`cases_for_power` solves for n on that minimum and inflates
by 1.1 as the spec does; :func:`simulate_gate_power` checks the numbers against
:func:`depthgate.judge.gate.gate` itself (tests/test_position_sim.py prints the table with Monte Carlo
errors; at the recommended n the gate's power was 0.800-0.833 ± 0.02 in every design where the
approximation claims to hold, the size at −M 0.020-0.062 ± 0.012). Rows outside the checked range say
``check_by_simulation``. Below ``n_min`` valid cases a slice is INCONCLUSIVE, so the power to PASS is
0 there whatever the test could do.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
from statsmodels.stats.power import TTestPower

from depthgate.exceptions import InputError
from depthgate.judge.bounds import newcombe10_paired, rs_alpha, shrunk_design_effect
from depthgate.judge.gate import Sizing
from depthgate.judge.science import runs_frame
from depthgate.judge.tables import BASELINE, CANDIDATE, FiniteRow, finite_fields, position_sort_key

__all__ = [
    "MIN_CASES_APPROX",
    "MIN_DISCORDANT_RUNS",
    "CasesForPower",
    "DesignParameters",
    "PilotParameters",
    "PilotSlice",
    "PowerPlan",
    "PowerRow",
    "cases_for_power",
    "expected_table",
    "pilot_parameters",
    "power_per_slice",
    "power_plan",
    "predicted_power",
]

FloatArray = npt.NDArray[np.float64]
_EPS = 1e-12


# --------------------------------------------------------------------------------------------------
# Design parameters


@dataclass(frozen=True)
class DesignParameters:
    """What the power of a slice depends on besides n, R, M and alpha (module docstring).

    ``p_baseline``: the baseline's case-weighted accuracy; ``between_case_sd``: SD of the per-case true
    pass probability (0 <= SD² < p (1 − p)); ``interaction_sd``: extra SD of the per-case true difference
    (case-by-system interaction); ``seed_coupling``: probability that a seed makes both arms draw the same
    uniform (0: independent, the conservative default — a tokenizer or template change decouples them);
    ``within_var``: a measured omega² (a pilot with both arms), which replaces the modelled one;
    ``source``: where the numbers came from ("assumed", "pilot:<slice>", "pilot:pooled").
    """

    p_baseline: float
    between_case_sd: float = 0.0
    interaction_sd: float = 0.0
    seed_coupling: float = 0.0
    within_var: float | None = None
    source: str = "assumed"

    def __post_init__(self) -> None:
        p, sd = self.p_baseline, self.between_case_sd
        checks = [
            (0.0 <= p <= 1.0, "p_baseline", "an accuracy in [0, 1]"),
            (sd >= 0.0 and sd * sd <= p * (1.0 - p) + _EPS, "between_case_sd", "0 <= SD <= sqrt(p (1 - p))"),
            (self.interaction_sd >= 0.0, "interaction_sd", "a non-negative SD"),
            (0.0 <= self.seed_coupling < 1.0, "seed_coupling", "a probability in [0, 1)"),
            (self.within_var is None or self.within_var >= 0.0, "within_var", "a non-negative variance"),
        ]
        for ok, name, fix in checks:
            if not ok or not all(math.isfinite(v) for v in (p, sd, self.interaction_sd, self.seed_coupling)):
                raise InputError(
                    f"invalid design parameter {name} = {getattr(self, name)!r}", field=name, fix=fix
                )

    @classmethod
    def from_icc(cls, p_baseline: float, icc: float, **kwargs: Any) -> DesignParameters:
        """Parameters from the ICC of one case's runs: SD = sqrt(icc p (1 − p))."""
        if not 0.0 <= icc < 1.0:
            raise InputError(f"icc {icc!r} out of range", field="icc", fix="an ICC in [0, 1)")
        if not 0.0 <= p_baseline <= 1.0:  # checked here too: sqrt of a negative variance comes first
            raise InputError(
                f"p_baseline {p_baseline!r} out of range", field="p_baseline", fix="an accuracy in [0, 1]"
            )
        return cls(p_baseline, math.sqrt(icc * p_baseline * (1.0 - p_baseline)), **kwargs)

    @property
    def icc(self) -> float:
        """SD² / (p (1 − p)) (0 at p = 0 or 1)."""
        v = self.p_baseline * (1.0 - self.p_baseline)
        return self.between_case_sd**2 / v if v > 0 else 0.0

    def moments(self, true_delta: float = 0.0) -> tuple[float, float]:
        """(tau², omega²) at ``true_delta`` (module docstring)."""
        p, var_b, c = self.p_baseline, self.between_case_sd**2, self.seed_coupling
        if not -p - _EPS <= true_delta <= 1.0 - p + _EPS:
            raise InputError(
                f"true_delta {true_delta!r} takes the candidate outside [0, 1] at p = {p}",
                field="true_delta",
                fix=f"a difference in [{-p:.3f}, {1 - p:.3f}]",
            )
        second = var_b + p * p  # E[p_i^2]
        e_pp = p - second  # E[p(1 - p)]
        if true_delta < 0:
            s = 1.0 + true_delta / p
            tau2 = (1.0 - s) ** 2 * var_b
            e_qq = s * p - s * s * second
            shared = s * p - s * second  # E[q - p q], q = s p <= p
        elif true_delta > 0:
            s = 1.0 - true_delta / (1.0 - p)
            tau2 = (1.0 - s) ** 2 * var_b
            e_qq = s * (1.0 - p) - s * s * (var_b + (1.0 - p) ** 2)
            shared = s * e_pp  # E[p - p q] = E[p (1 - q)], q >= p
        else:
            tau2, e_qq, shared = 0.0, e_pp, e_pp
        omega2 = max(e_pp + e_qq - 2.0 * c * shared, 0.0)
        if self.within_var is not None:
            tau2, omega2 = 0.0, self.within_var
        return tau2 + self.interaction_sd**2, omega2

    def sd_diff(self, seeds: int, true_delta: float = 0.0) -> float:
        """SD of the per-case paired difference with ``seeds`` runs per case: sqrt(tau² + omega² / R)."""
        if seeds < 1:
            raise InputError(f"seeds {seeds!r} < 1", field="seeds", fix="a positive seed count")
        tau2, omega2 = self.moments(true_delta)
        return math.sqrt(tau2 + omega2 / seeds)

    def to_dict(self) -> dict[str, Any]:
        out = finite_fields(self)
        out["icc"] = self.icc
        return out


# --------------------------------------------------------------------------------------------------
# Power and sample size


def _t_power(effect: float, n: int, alpha: float) -> float:
    if n < 2:
        return 0.0
    if math.isinf(effect):
        return 1.0 if effect > 0 else 0.0
    value = float(
        np.asarray(TTestPower().power(effect_size=effect, nobs=n, alpha=alpha, alternative="larger")).item()
    )
    if not math.isfinite(value):  # statsmodels' noncentral t returns NaN far out in the tail (n 300, d 2.2)
        z = statistics.NormalDist()
        return z.cdf(effect * math.sqrt(n) - z.inv_cdf(1.0 - alpha))
    return value


def _effect(margin: float, true_delta: float, sd: float) -> float:
    gap = true_delta + margin
    if sd <= _EPS:
        return math.inf if gap > 0 else -math.inf
    return gap / sd


def expected_table(design: DesignParameters, true_delta: float = 0.0) -> tuple[float, float, float, float]:
    """Expected run-level paired table (a both pass, b only the candidate, c only the baseline, d
    neither) as shares of runs, from the moments alone: the discordance psi = b + c = E[(y^c − y^b)^2] =
    tau² + omega² + delta², b − c = delta, a + c = p."""
    tau2, omega2 = design.moments(true_delta)
    psi = min(tau2 + omega2 + true_delta**2, 1.0)
    b = max((psi + true_delta) / 2.0, 0.0)
    c = max((psi - true_delta) / 2.0, 0.0)
    a = max(design.p_baseline - c, 0.0)
    return a, b, c, max(1.0 - a - b - c, 0.0)


def _newcombe_power(
    design: DesignParameters, n: int, seeds: int, margin: float, alpha: float, true_delta: float, deff: float
) -> tuple[float, float]:
    """Normal approximation of P(Newcombe-RS lower bound > −M): the bound L on the *expected* table
    (counts n R x shares, deflated by the design effect), its spread read off its own width, SE = (theta −
    L) / z, and P = Phi((L + M) / SE) (0.5 when the expected bound sits on −M). Returns (power, L)."""
    if n < 1:
        return 0.0, -1.0
    runs = n * seeds / (deff if seeds > 1 else 1.0)
    a, b, c, d = (v * runs for v in expected_table(design, true_delta))
    level = rs_alpha(alpha, seeds)  # the gate's Newcombe-RS level (judge/bounds/design_effect.py)
    lower, _ = newcombe10_paired(a, b, c, d, 2.0 * level)
    z = statistics.NormalDist().inv_cdf(1.0 - level)
    theta = (b - c) / runs
    se = (theta - lower) / z
    if se <= _EPS:
        return (1.0 if lower > -margin else 0.0), lower
    return statistics.NormalDist().cdf((lower + margin) / se), lower


@dataclass(frozen=True)
class _Approx:
    sd: float
    tau2: float
    omega2: float
    deff: float
    effect: float
    power_t: float
    power_newcombe: float
    lower_expected: float
    discordant: float

    @property
    def power(self) -> float:
        return min(self.power_t, self.power_newcombe)


def _approx(
    design: DesignParameters, n: int, seeds: int, margin: float, alpha: float, true_delta: float
) -> _Approx:
    tau2, omega2 = design.moments(true_delta)
    sd = math.sqrt(tau2 + omega2 / seeds)
    total = tau2 + omega2
    deff = 1.0 + (seeds - 1) * tau2 / total if total > 0 else float(seeds)
    _, b, c, _ = expected_table(design, true_delta)
    if seeds > 1:  # the gate shrinks D toward R when few runs disagree (judge/bounds/design_effect.py)
        deff = shrunk_design_effect(deff, (b + c) * n * seeds, seeds, n * seeds)
    effect = _effect(margin, true_delta, sd)
    power_n, lower = _newcombe_power(design, n, seeds, margin, alpha, true_delta, deff)
    return _Approx(
        sd, tau2, omega2, deff, effect, _t_power(effect, n, alpha), power_n, lower, (b + c) * n * seeds
    )


#: Below these the normal approximations are unreliable (near the ceiling the realised discordance is
#: often 0 and the gate's Newcombe-RS bound takes DEFF = R; few cases make the bootstrap-t conservative):
#: such rows say ``check_by_simulation``.
def predicted_power(
    design: DesignParameters, n: int, seeds: int, margin: float, alpha: float, true_delta: float
) -> float:
    """The approximation's P(non-inferiority shown) for one slice of the design (``PowerRow.power_approx``;
    ``depthgate.judge.planning.power_sim`` checks it against the gate)."""
    return _approx(design, n, seeds, margin, alpha, true_delta).power


MIN_DISCORDANT_RUNS = 10.0
#: Measured against simulation through the gate (issue #36, docs/gate-calibration.md §10; 100 slices a
#: cell): per slice the approximation was off by more than .05 in 20 of 27 cells of p .85/.95/.99 x ICC
#: 0/.33/.5 x R 1/3/5 at 40 cases, in 2 of 54 at 100 and 300 (both within 2.1 MC-SE); the bound of 30
#: let every 40-case row through unflagged.
MIN_CASES_APPROX = 100


@dataclass(frozen=True)
class CasesForPower(FiniteRow):
    """Cases per slice for ``target`` power. ``n_test``: the bare paired t-test n at the per-slice
    target (statsmodels ``solve_power``; the spec's §3 table); ``n_approx``: the smallest n at which the
    approximate gate power min(t, Newcombe-RS) reaches it; ``n_recommended``: ceil(max(n_min, n_approx) x
    inflation), the spec's final rule (the gate is slightly less efficient than its approximations). None
    when no n reaches the target (true delta <= −M). ``per_slice_target``: target^(1/n_slices) when all
    ``n_slices`` must pass jointly."""

    target: float
    per_slice_target: float
    n_slices: int
    sd_diff: float
    n_test: int | None
    n_approx: int | None
    n_recommended: int | None
    inflation: float
    n_min: int


_MAX_CASES = 1_000_000


def cases_for_power(
    design: DesignParameters, *, seeds: int, sizing: Sizing, n_slices: int = 1, true_delta: float = 0.0
) -> CasesForPower:
    """How many cases a slice needs for ``sizing.target`` power (per slice, or jointly over
    ``n_slices``).

    ``n_test`` is statsmodels ``TTestPower().solve_power`` on effect (delta + M) / sd_diff, one-sided at
    ``sizing.alpha`` (equal to :func:`depthgate.judge.gate.sample_size_per_slice` with ``n_min=0,
    inflation=1``); ``n_approx`` also asks the Newcombe-RS approximation (binding near the ceiling);
    ``n_recommended`` is :meth:`Sizing.recommend` of ``n_approx``.
    """
    margin, alpha = sizing.margin, sizing.alpha
    per_slice = sizing.per_slice_target(n_slices)
    sd = design.sd_diff(seeds, true_delta)
    effect = _effect(margin, true_delta, sd)
    n_test: int | None
    if effect <= 0:
        n_test = None
    elif math.isinf(effect):
        n_test = 2
    else:
        n_raw = TTestPower().solve_power(
            effect_size=effect, alpha=alpha, power=per_slice, alternative="larger"
        )
        n_test = max(2, math.ceil(float(np.asarray(n_raw).item()) - 1e-9))
    n_approx: int | None = None
    if n_test is not None:

        def ok(n: int) -> bool:
            return _approx(design, n, seeds, margin, alpha, true_delta).power >= per_slice

        high = n_test
        while not ok(high) and high < _MAX_CASES:
            high *= 2
        if ok(high):
            low = max(1, n_test - 1)  # not ok (n_test is the t-test's minimum), or the t-test's edge
            while high - low > 1:
                mid = (low + high) // 2
                if ok(mid):
                    high = mid
                else:
                    low = mid
            n_approx = high
    n_rec = None if n_approx is None else sizing.recommend(n_approx)
    return CasesForPower(
        sizing.target, per_slice, n_slices, sd, n_test, n_approx, n_rec, sizing.inflation, sizing.n_min
    )


@dataclass(frozen=True)
class PowerRow:
    """Power of one slice.

    ``power_test``: the paired t approximation at n cases (the spec's §3); ``power_newcombe``: the
    Newcombe-RS approximation (:func:`expected_table`; ``newcombe_lower_expected`` is the bound on the
    expected table); ``power_approx``: the smaller of the two (the gate needs both bounds above −M);
    ``power``: the power to PASS non-inferiority in the gate — ``power_approx``, or 0 below ``n_min``
    (INCONCLUSIVE). ``expected_discordant``: expected discordant runs (n R psi). ``check_by_simulation``:
    the approximation is outside the range where it was checked against the gate (fewer than
    :data:`MIN_DISCORDANT_RUNS` expected discordant runs or fewer than :data:`MIN_CASES_APPROX` cases);
    run :func:`simulate_gate_power`. ``cases``: the cases that would reach the target."""

    length: int | None
    position: str | None
    n_cases: int
    seeds: int
    margin: float
    alpha: float
    true_delta: float
    p_baseline: float
    between_case_sd: float
    icc: float
    interaction_sd: float
    seed_coupling: float
    tau2: float
    omega2: float
    sd_diff: float
    deff: float
    effect_size: float
    expected_discordant: float
    power_test: float
    power_newcombe: float
    newcombe_lower_expected: float
    power_approx: float
    power: float
    n_min: int
    below_n_min: bool
    check_by_simulation: bool
    source: str
    cases: CasesForPower

    def to_dict(self) -> dict[str, Any]:
        out = finite_fields(self, skip=("cases",))
        out["cases"] = self.cases.to_dict()
        return out


def power_per_slice(
    n_cases: int,
    seeds: int,
    design: DesignParameters,
    sizing: Sizing,
    *,
    n_slices: int = 1,
    true_delta: float = 0.0,
    length: int | None = None,
    position: str | None = None,
) -> PowerRow:
    """Power to show non-inferiority at ``sizing.margin`` in one slice with ``n_cases`` x ``seeds``, and
    the cases for ``sizing.target`` power (jointly over ``n_slices``). ``sizing.alpha`` is the
    one-sided level of the look (``GatePlan.look_alpha``: alpha/2 under the one_extension stop rule;
    :meth:`Sizing.of_plan`). ``design``: assumed
    (``DesignParameters(p, sd)`` or ``DesignParameters.from_icc(p, icc)``) or from
    :func:`pilot_parameters`."""
    if n_cases < 0:
        raise InputError(f"n_cases {n_cases!r} < 0", field="n_cases", fix="a case count")
    if seeds < 1:
        raise InputError(f"seeds {seeds!r} < 1", field="seeds", fix="a positive seed count")
    margin, alpha = sizing.margin, sizing.alpha
    ap = _approx(design, n_cases, seeds, margin, alpha, true_delta)
    below = n_cases < sizing.n_min
    cases = cases_for_power(design, seeds=seeds, sizing=sizing, n_slices=n_slices, true_delta=true_delta)
    return PowerRow(
        length=length,
        position=position,
        n_cases=n_cases,
        seeds=seeds,
        margin=margin,
        alpha=alpha,
        true_delta=true_delta,
        p_baseline=design.p_baseline,
        between_case_sd=design.between_case_sd,
        icc=design.icc,
        interaction_sd=design.interaction_sd,
        seed_coupling=design.seed_coupling,
        tau2=ap.tau2,
        omega2=ap.omega2,
        sd_diff=ap.sd,
        deff=ap.deff,
        effect_size=ap.effect,
        expected_discordant=ap.discordant,
        power_test=ap.power_t,
        power_newcombe=ap.power_newcombe,
        newcombe_lower_expected=ap.lower_expected,
        power_approx=ap.power,
        power=0.0 if below else ap.power,
        n_min=sizing.n_min,
        below_n_min=below,
        check_by_simulation=ap.discordant < MIN_DISCORDANT_RUNS or n_cases < MIN_CASES_APPROX,
        source=design.source,
        cases=cases,
    )


# --------------------------------------------------------------------------------------------------
# Pilot


@dataclass(frozen=True)
class PilotSlice(FiniteRow):
    """Moment estimates from one slice of a pilot run.

    ``p_baseline``: case-weighted baseline accuracy; ``between_case_sd``: sqrt of the between-case
    variance of the baseline's pass probability, Var(b̄_i) − p (1 − p)/R corrected for the binomial noise
    of R runs (method of moments: Var(b̄_i) = SD² (1 − 1/R) + p (1 − p) / R), clipped to [0, p (1 − p)];
    with one seed it is not identifiable and is set to 0 (the largest modelled sd_diff: conservative).
    With both arms: ``sd_diff`` the observed SD of d_i, ``within_var`` omega² = the mean within-case
    variance of the run differences, ``interaction_sd`` sqrt(max(0, s²(d_i) − omega²/R)); with one seed
    the split is not identifiable and all of s²(d_i) goes to tau² (sd_diff then does not shrink with R:
    conservative).
    """

    length: int | None
    position: str | None
    n_cases: int
    seeds: int
    p_baseline: float
    between_case_sd: float
    has_candidate: bool
    sd_diff: float | None
    within_var: float | None
    interaction_sd: float | None

    def design(self) -> DesignParameters:
        """The slice's :class:`DesignParameters` (measured omega²/tau² when the pilot had both arms)."""
        where = "pooled" if self.length is None else f"{self.length}/{self.position}"
        p = min(max(self.p_baseline, 0.0), 1.0)
        sd = min(self.between_case_sd, math.sqrt(p * (1.0 - p)))
        if self.has_candidate and self.within_var is not None:
            return DesignParameters(
                p,
                sd,
                interaction_sd=self.interaction_sd or 0.0,
                within_var=self.within_var,
                source=f"pilot:{where}",
            )
        return DesignParameters(p, sd, source=f"pilot:{where}")


@dataclass(frozen=True)
class PilotParameters:
    """:func:`pilot_parameters` output: per-slice estimates and a pooled row (the mean of the slices'
    moments, weighted by cases) for slices the pilot did not run."""

    slices: tuple[PilotSlice, ...]
    pooled: PilotSlice

    def design(self, length: int, position: str, *, min_cases: int = 10) -> DesignParameters:
        """The slice's parameters, or the pooled ones when the pilot did not run it with ``min_cases``."""
        for s in self.slices:
            if s.length == length and s.position == position and s.n_cases >= min_cases:
                return s.design()
        return self.pooled.design()

    @property
    def frame(self) -> pl.DataFrame:
        return pl.DataFrame([s.to_dict() for s in (*self.slices, self.pooled)], infer_schema_length=None)

    def to_dict(self) -> dict[str, Any]:
        return {"slices": [s.to_dict() for s in self.slices], "pooled": self.pooled.to_dict()}


def _pilot_slice(
    length: int | None, position: str | None, yb: FloatArray, yc: FloatArray | None
) -> PilotSlice:
    """yb, yc: (cases, seeds) with NaN for a missing run."""
    n = yb.shape[0]
    valid_b = ~np.isnan(yb)
    r_b = valid_b.sum(axis=1)
    rate_b = np.nansum(yb, axis=1) / np.maximum(r_b, 1)
    p = float(rate_b.mean())
    r_bar = float(r_b.mean())
    var_b = 0.0
    if r_bar > 1.0 + _EPS and n >= 2:
        raw = float(rate_b.var(ddof=1))
        var_b = (raw - p * (1.0 - p) / r_bar) / (1.0 - 1.0 / r_bar)
        var_b = min(max(var_b, 0.0), p * (1.0 - p))
    sd_diff = within = inter = None
    seeds = int(yb.shape[1])
    if yc is not None:
        both = valid_b & ~np.isnan(yc)
        keep = both.sum(axis=1) > 0
        e = np.where(both, yc - yb, np.nan)[keep]
        d = np.nanmean(e, axis=1)
        if d.size >= 2:
            s2 = float(d.var(ddof=1))
            sd_diff = math.sqrt(s2)
            counts = both[keep].sum(axis=1)
            multi = counts >= 2
            if multi.any():
                within = float(np.mean(np.nanvar(e[multi], axis=1, ddof=1)))
                r_pair = float(counts.mean())
                inter = math.sqrt(max(s2 - within / r_pair, 0.0))
            else:
                within, inter = 0.0, sd_diff
    return PilotSlice(length, position, n, seeds, p, math.sqrt(var_b), yc is not None, sd_diff, within, inter)


def pilot_parameters(scored: pl.DataFrame) -> PilotParameters:
    """Estimate the power inputs from a pilot run's scored records (``score_records`` output; a run of
    the baseline alone, an A/A run, or an earlier A/B comparison).

    Per (length, position): p_baseline and between-case SD from the baseline arm; with a candidate arm
    also the observed sd_diff and its split into omega² (within-case) and tau² (between-case), so the
    matrix's own seed count can be carried over. Research/stats_gate.md §3: an A/A pilot measures only
    the noise part (tau² ≈ 0) and so *underestimates* sd_diff for a real change; a previous A/B comparison
    of a similar change is the better pilot.
    """
    runs = runs_frame(scored, what="pilot records")
    if runs.filter(pl.col("arm") == BASELINE).height == 0:
        raise InputError("the pilot has no baseline records", field="arm", fix="pilot the baseline system")
    seeds = sorted(runs["seed"].unique().to_list())
    col = {s: j for j, s in enumerate(seeds)}
    keys = sorted(
        {(int(a), str(b)) for a, b in runs.select("length", "position").unique().iter_rows()},
        key=lambda k: (k[0], position_sort_key(k[1])),
    )
    per_slice: list[PilotSlice] = []
    for length, pos in keys:
        part = runs.filter((pl.col("length") == length) & (pl.col("position") == pos))
        cases = sorted(part.filter(pl.col("arm") == BASELINE)["case_id"].unique().to_list())
        row = {c: i for i, c in enumerate(cases)}
        arrays: dict[str, FloatArray] = {}
        for arm in (BASELINE, CANDIDATE):
            sub = part.filter(
                (pl.col("arm") == arm) & pl.col("case_id").is_in(cases) & pl.col("y").is_not_null()
            )
            if sub.height == 0:
                continue
            arr = np.full((len(cases), len(seeds)), np.nan)
            for case, seed, y in sub.select("case_id", "seed", "y").iter_rows():
                arr[row[case], col[seed]] = y
            arrays[arm] = arr
        if BASELINE not in arrays:
            continue
        base = arrays[BASELINE]
        keep = ~np.all(np.isnan(base), axis=1)
        cand = arrays.get(CANDIDATE)
        arrays = {BASELINE: base[keep], **({} if cand is None else {CANDIDATE: cand[keep]})}
        if arrays[BASELINE].shape[0] == 0:
            continue
        per_slice.append(_pilot_slice(length, pos, arrays[BASELINE], arrays.get(CANDIDATE)))
    if not per_slice:
        raise InputError("the pilot has no valid baseline run", field="outcome", fix="pilot with scored runs")
    weights = np.array([s.n_cases for s in per_slice], dtype=np.float64)

    def pooled_mean(values: Sequence[float | None]) -> float | None:
        pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None]
        if not pairs:
            return None
        return float(np.average([v for v, _ in pairs], weights=[w for _, w in pairs]))

    has_c = all(s.has_candidate for s in per_slice)
    var_b = pooled_mean([s.between_case_sd**2 for s in per_slice]) or 0.0
    sd2 = pooled_mean([None if s.sd_diff is None else s.sd_diff**2 for s in per_slice])
    inter2 = pooled_mean([None if s.interaction_sd is None else s.interaction_sd**2 for s in per_slice])
    pooled = PilotSlice(
        None,
        None,
        int(weights.sum()),
        max(s.seeds for s in per_slice),
        pooled_mean([s.p_baseline for s in per_slice]) or 0.0,
        math.sqrt(var_b),
        has_c,
        None if sd2 is None or not has_c else math.sqrt(sd2),
        pooled_mean([s.within_var for s in per_slice]) if has_c else None,
        None if inter2 is None or not has_c else math.sqrt(inter2),
    )
    return PilotParameters(tuple(per_slice), pooled)


# --------------------------------------------------------------------------------------------------
# The plan table


@dataclass(frozen=True)
class PowerPlan:
    """Per-slice power of a matrix (``depthgate plan``). ``power_all_slices``: the product of the slice
    powers — the chance that every slice passes if the slices were independent; slices share cases and
    are positively associated, so the true joint power is at least about this. ``per_slice_target``:
    target^(1/k) for k slices (the joint sizing of research/stats_gate.md §3)."""

    rows: tuple[PowerRow, ...]
    target: float
    per_slice_target: float
    power_all_slices: float
    min_power: float
    weakest_slice: str | None
    cases_needed: int | None

    @property
    def frame(self) -> pl.DataFrame:
        flat = []
        for r in self.rows:
            d = r.to_dict()
            cases = d.pop("cases")
            d["n_for_target_test"] = cases["n_test"]
            d["n_for_target"] = cases["n_recommended"]
            flat.append(d)
        return pl.DataFrame(flat, infer_schema_length=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite floats as None), the rows last."""
        return {**finite_fields(self, skip=("rows",)), "rows": [r.to_dict() for r in self.rows]}


def power_plan(
    slices: Sequence[tuple[int, str]],
    *,
    n_cases: int,
    seeds: int,
    sizing: Sizing,
    design: DesignParameters | None = None,
    pilot: PilotParameters | None = None,
    designs: Mapping[tuple[int, str], DesignParameters] | None = None,
    true_delta: float = 0.0,
    slice_cases: Mapping[tuple[int, str], int] | None = None,
) -> PowerPlan:
    """Per slice of a matrix: power at its ``n_cases`` x ``seeds`` (``slice_cases``: another case count
    for some slices, e.g. the multi-evidence cases of a spaced slice), and the cases for
    ``sizing.target``.

    Parameters per slice come from ``designs`` (explicit), else the ``pilot`` (its slice, or its pooled
    row for a slice it did not run), else the assumed ``design``. Every slice is sized at
    target^(1/k) so that all k slices pass together with ``target`` (the release needs every slice).
    ``cases_needed``: the largest per-slice recommendation (the suite size to plan for)."""
    if design is None and pilot is None and designs is None:
        raise InputError(
            "no design parameters",
            field="p_baseline",
            fix="assume p_baseline and a spread, or pass a pilot run",
        )
    ordered = sorted(set(slices), key=lambda k: (k[0], position_sort_key(k[1])))
    k = len(ordered)
    rows: list[PowerRow] = []
    for length, pos in ordered:
        if designs is not None and (length, pos) in designs:
            d = designs[(length, pos)]
        elif pilot is not None:
            d = pilot.design(length, pos)
        elif design is not None:
            d = design
        else:
            raise InputError(
                f"no design parameters for slice {length}/{pos}", field="designs", fix="give every slice"
            )
        rows.append(
            power_per_slice(
                (slice_cases or {}).get((length, pos), n_cases),
                seeds,
                d,
                sizing,
                n_slices=k,
                true_delta=true_delta,
                length=length,
                position=pos,
            )
        )
    powers = [r.power for r in rows]
    weakest = min(rows, key=lambda r: r.power) if rows else None
    needed = [r.cases.n_recommended for r in rows]
    return PowerPlan(
        rows=tuple(rows),
        target=sizing.target,
        per_slice_target=sizing.per_slice_target(max(k, 1)),
        power_all_slices=float(np.prod(powers)) if powers else 0.0,
        min_power=min(powers) if powers else 0.0,
        weakest_slice=None if weakest is None else f"{weakest.length}/{weakest.position}",
        cases_needed=None if any(n is None for n in needed) or not needed else max(n for n in needed if n),
    )

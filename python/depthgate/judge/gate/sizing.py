"""Sizing of a slice (research/stats_gate.md §3): what a sample-size or power calculation asks, the
paired-t sample size and the per-cell Fisher p of the triage list. Split out of the gate's run
(``release``; issue #23: one job per module)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from statsmodels.stats.power import TTestPower

from depthgate.exceptions import InputError

if TYPE_CHECKING:
    from depthgate.judge.gate.plan import GatePlan

__all__ = ["Sizing", "fisher_less", "sample_size_per_slice"]


@dataclass(frozen=True)
class Sizing:
    """What a sample-size or power calculation asks of a slice (section 3), in one place.

    Non-inferiority at ``margin`` M with one-sided ``alpha`` (the look's level: ``GatePlan.look_alpha``)
    and ``target`` power; over k slices that must all pass, each slice is sized at target^(1/k)
    (:meth:`per_slice_target`: the release needs every slice). A t-test's n becomes a recommendation
    as ceil(max(``n_min``, n) * ``inflation``): the gate's sufficiency rule, and the gate being slightly
    less efficient than a t-test. The defaults are the spec's final rule; its table is ``n_min=0,
    inflation=1.0``.
    """

    margin: float = 0.10
    alpha: float = 0.05
    target: float = 0.8
    n_min: int = 40
    inflation: float = 1.1

    @classmethod
    def of_plan(cls, plan: GatePlan) -> Sizing:
        """The sizing a gate plan asks for: its margin, look alpha, power and n_min."""
        return cls(plan.margin, plan.look_alpha, plan.power, plan.n_min)

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (0.0 < self.margin < 1.0, "margin", "a margin in (0, 1)"),
            (0.0 < self.alpha < 0.5, "alpha", "a one-sided level in (0, 0.5)"),
            (0.0 < self.target < 1.0, "target", "a power in (0, 1)"),
            (self.n_min >= 0, "n_min", "a case count >= 0"),
            (self.inflation >= 1.0, "inflation", "a factor >= 1, e.g. 1.1"),
        ]
        for ok, name, fix in checks:
            if not ok:
                raise InputError(f"{name} {getattr(self, name)!r} out of range", field=name, fix=fix)

    def per_slice_target(self, n_slices: int = 1) -> float:
        """The power each of ``n_slices`` slices needs for all to pass together with ``target``."""
        if n_slices < 1:
            raise InputError(f"n_slices {n_slices!r} < 1", field="n_slices", fix="a positive slice count")
        return float(self.target ** (1.0 / n_slices))

    def recommend(self, n: int) -> int:
        """A test's minimum ``n`` raised to ``n_min`` and inflated."""
        return math.ceil(max(self.n_min, n) * self.inflation - 1e-9)


def sample_size_per_slice(sd_diff: float, sizing: Sizing = Sizing(), *, n_slices: int = 1) -> int:
    """Cases per slice for the NI test at true delta = 0 (section 3).

    Paired t power (statsmodels ``TTestPower``, effect size M / sd_diff, one-sided) at the per-slice
    target for ``n_slices`` slices passing jointly, then :meth:`Sizing.recommend`.
    """
    if sd_diff <= 0 or not math.isfinite(sd_diff):
        raise ValueError(f"sd_diff must be positive and finite, got {sd_diff}")
    n_t = TTestPower().solve_power(
        effect_size=sizing.margin / sd_diff,
        alpha=sizing.alpha,
        power=sizing.per_slice_target(n_slices),
        alternative="larger",
    )
    return sizing.recommend(math.ceil(float(np.asarray(n_t).item())))


def fisher_less(candidate_passes: int, baseline_passes: int, seeds: int) -> float:
    """One-sided Fisher exact p that the candidate passes less often (equal seeds per arm).

    Equals ``scipy.stats.fisher_exact([[c, R-c], [b, R-b]], alternative="less")``.
    """
    total = candidate_passes + baseline_passes
    denom = math.comb(2 * seeds, seeds)
    tail = sum(
        math.comb(total, x) * math.comb(2 * seeds - total, seeds - x)
        for x in range(max(0, total - seeds), candidate_passes + 1)
    )
    return min(1.0, tail / denom)

"""Power of a whole release by simulation through :func:`depthgate.judge.gate.gate` (issue #36, item 3):
the check ``depthgate plan --simulate`` makes where the approximation of ``power`` is off.

Near the ceiling a slice has one or two discordant runs and the normal approximation of the gate's
bounds is far too low (p .99, ICC .33, 40 cases x 3 seeds: .805 per slice, while the gate shows
non-inferiority in .990 of simulated slices); and the joint power of k slices multiplies any per-slice
error by about k. Here every draw is one release: per planned slice, runs of both arms drawn from the
slice's :class:`~depthgate.judge.planning.DesignParameters` at a true difference of 0 (A/A,
:func:`depthgate.judge.planning.draw_design`; each slice's cases drawn independently of the other
slices', as the approximation's product assumes), gated by ``gate()`` with the run's own plan (its
margin, look level, B, n_min, floor and planned cases and seeds). A fixed ``seed`` gives the same
numbers in every process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from depthgate.exceptions import InputError
from depthgate.judge.gate import GatePlan, Verdict, gate, non_inferiority_shown, stable_seed
from depthgate.judge.planning.power import DesignParameters
from depthgate.judge.planning.power_sim import draw_design
from depthgate.judge.tables import BASELINE, CANDIDATE

__all__ = ["MAX_DRAWS", "ReleaseSimulation", "SimulatedSlice", "simulate_release"]

#: The most releases one simulation draws (`depthgate plan --draws`): at 10 slices of 40 cases x 3
#: seeds and B 9,999 a draw costs about 0.13 s on one core.
MAX_DRAWS = 5000


@dataclass(frozen=True)
class SimulatedSlice:
    """One planned slice of a simulated release: its key, planned cases and design."""

    length: int
    position: str
    cases: tuple[str, ...]
    design: DesignParameters


@dataclass(frozen=True)
class ReleaseSimulation:
    """``draws`` simulated releases: per slice the draws in which its non-inferiority was shown
    (``shown``, in the order of the slices given), the draws in which every slice showed it
    (``all_shown``: the simulated ``power_all_slices``) and those the gate's verdict PASSed."""

    draws: int
    seed: int
    slices: tuple[tuple[int, str], ...]
    shown: tuple[int, ...]
    all_shown: int
    release_pass: int

    @staticmethod
    def mc_se(count: int, draws: int) -> float:
        """Monte Carlo standard error of the share count / draws (at least that of 1 in 2·draws)."""
        rate = count / draws
        return math.sqrt(max(rate * (1.0 - rate), 0.5 / draws * (1.0 - 0.5 / draws)) / draws)

    @property
    def power_all_slices(self) -> float:
        return self.all_shown / self.draws

    @property
    def power_per_slice(self) -> tuple[float, ...]:
        return tuple(s / self.draws for s in self.shown)

    @property
    def release_pass_rate(self) -> float:
        return self.release_pass / self.draws


def _release_records(
    rng: np.random.Generator, slices: Sequence[SimulatedSlice], seeds: Sequence[int]
) -> pl.DataFrame:
    """One release's records: every slice's cases x seeds, both arms, pass/fail."""
    parts = []
    r = len(seeds)
    for s in slices:
        yb, yc = draw_design(rng, s.design, len(s.cases), r, 0.0, 1)
        for arm, y in ((BASELINE, yb[0]), (CANDIDATE, yc[0])):
            parts.append(
                pl.DataFrame(
                    {
                        "arm": arm,
                        "case_id": np.repeat(np.asarray(s.cases, dtype=object), r),
                        "length": s.length,
                        "position": s.position,
                        "seed": np.tile(np.asarray(seeds, dtype=np.int64), len(s.cases)),
                        "outcome": np.where(y.ravel() > 0, "pass", "fail"),
                        "safety": False,
                    },
                    schema_overrides={"case_id": pl.String(), "length": pl.Int64()},
                )
            )
    return pl.concat(parts)


def simulate_release(
    plan: GatePlan,
    slices: Sequence[SimulatedSlice],
    *,
    seeds: Sequence[int],
    draws: int,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> ReleaseSimulation:
    """``draws`` A/A releases of ``slices`` with ``seeds`` runs per case, each gated by ``gate(records,
    plan)`` with its own bootstrap seed (module docstring). ``progress(done, draws)`` is called after
    every tenth of the draws. Designs with a measured ``within_var`` or an ``interaction_sd`` have no
    generative model (``draw_design``): pass their modelled part."""
    if not 1 <= draws <= MAX_DRAWS:
        raise InputError(f"draws {draws!r} out of range", field="--draws", fix=f"1 to {MAX_DRAWS} releases")
    if not slices or not seeds:
        raise InputError("nothing to simulate", field="slices", fix="a plan with slices and seeds")
    rng = np.random.default_rng(stable_seed(seed, "simulate_release", len(slices), len(seeds)))
    keys = tuple((s.length, s.position) for s in slices)
    shown = [0] * len(slices)
    all_shown = release_pass = 0
    step = max(1, draws // 10)
    for i in range(draws):
        result = gate(_release_records(rng, slices, seeds), plan.replace(bootstrap_seed=seed + i))
        by_key = {(r.length, r.position): non_inferiority_shown(r, plan.margin) for r in result.slice_results}
        ok = [by_key.get(k, False) for k in keys]
        shown = [c + int(v) for c, v in zip(shown, ok, strict=True)]
        all_shown += all(ok)
        release_pass += result.verdict is Verdict.PASS
        if progress is not None and ((i + 1) % step == 0 or i + 1 == draws):
            progress(i + 1, draws)
    return ReleaseSimulation(draws, seed, keys, tuple(shown), all_shown, release_pass)

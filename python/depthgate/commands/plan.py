"""``depthgate plan MATRIX``: per-slice power of a matrix's pre-registered plan (research/stats_gate.md §3),
the warning ``depthgate run`` prints when that plan is under-powered, and the A/A matrix of
``depthgate run --aa`` (the baseline against a repeat of itself).

Assumptions without a pilot: a baseline accuracy of 0.85 and an intra-case correlation of 0.33
(:data:`DEFAULT_P_BASELINE`, :data:`DEFAULT_ICC`), a true difference of 0, and a target of 0.8 for all
slices together. ``--pilot RUN`` estimates the design per slice from a finished run's ``scored.parquet``.

The numbers are an approximation (``depthgate.judge.planning.power``) that is far too low near the
ceiling, where rows say ``check_by_sim`` (issue #36, F3: p .99, 40 cases x 3 seeds x 10 slices, .114
joint while the gate passes about nine such releases in ten). ``--simulate`` gates simulated releases
through the gate itself (:func:`simulated_power`), and the run's warning takes the near-ceiling joint
power from a simulation where the approximation's rows are flagged (:func:`power_warning`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.exceptions import InputError
from depthgate.judge.gate import Sizing
from depthgate.judge.planning import (
    DesignParameters,
    PowerPlan,
    ReleaseSimulation,
    SimulatedSlice,
    pilot_parameters,
    power_plan,
    simulate_release,
)
from depthgate.layout.layouts import parse_positions
from depthgate.spec.cases import Suite
from depthgate.spec.files import read_parquet, require_file
from depthgate.spec.matrix import Matrix
from depthgate.spec.models import look_alpha
from depthgate.spec.positions import split_position_label

__all__ = [
    "AA_FILE",
    "DEFAULT_ICC",
    "DEFAULT_P_BASELINE",
    "NEAR_CEILING_P",
    "POWER_TARGET",
    "SIMULATE_DRAWS",
    "WARNING_DRAWS",
    "aa_matrix",
    "matrix_power",
    "near_ceiling_power",
    "power_warning",
    "print_power",
    "print_simulated",
    "simulated_power",
    "simulation_progress",
]

DEFAULT_P_BASELINE = 0.85
#: The near-ceiling baseline accuracy at which `depthgate plan` and the run warning also check the
#: joint power (issue #22, item 5).
NEAR_CEILING_P = 0.99
DEFAULT_ICC = 0.33
POWER_TARGET = 0.8
#: Releases `depthgate plan --simulate` draws per assumption by default (MC-SE of a joint power of .9:
#: .021), and those the run's warning draws for its near-ceiling check (.030).
SIMULATE_DRAWS = 200
WARNING_DRAWS = 100
#: Marks a run folder as an A/A run (`depthgate run --aa`): the gate adds the noise floor.
AA_FILE = "aa.json"
#: Longest id (a system or matrix name), as the spec's id pattern allows.
MAX_ID_CHARS = 200


def matrix_power(
    matrix: Matrix,
    suite: Suite,
    *,
    p_baseline: float = DEFAULT_P_BASELINE,
    icc: float = DEFAULT_ICC,
    pilot: pl.DataFrame | None = None,
) -> PowerPlan:
    """Power of every (length, position) slice of ``matrix`` at its case count (the suite's placed
    cases) and seed count, margin, look alpha and n_min."""
    plan = matrix.plan
    labels = [p.label for p in parse_positions(matrix.position_values())]
    slices = [(length, label) for length in matrix.lengths for label in labels]
    n_cases = sum(1 for c in suite.cases if c.decisive)
    # A slice with an evidence spacing holds only the multi-evidence cases (the gate's spaced_cases).
    n_multi = sum(1 for c in suite.cases if len(c.decisive) >= 2)
    spaced = {
        (length, label): n_multi for length, label in slices if split_position_label(label)[1] != "adjacent"
    }
    if not 0.0 <= p_baseline <= 1.0:  # DesignParameters.from_icc would fail in math.sqrt first
        raise InputError(
            f"p_baseline {p_baseline!r} out of range", field="--p-baseline", fix="an accuracy in [0, 1]"
        )
    if n_cases < 1:
        raise InputError("the suite places no case", field="suite", fix="give cases with evidence")
    return power_plan(
        slices,
        n_cases=n_cases,
        seeds=len(matrix.decode.seeds),
        sizing=Sizing(
            margin=plan.margin,
            alpha=look_alpha(plan.alpha, plan.stop_rule),
            target=POWER_TARGET,
            n_min=plan.n_min,
        ),
        design=DesignParameters.from_icc(p_baseline, icc),
        pilot=None if pilot is None else pilot_parameters(pilot),
        slice_cases=spaced or None,
    )


def near_ceiling_power(matrix: Matrix, suite: Suite, *, icc: float = DEFAULT_ICC) -> PowerPlan:
    """:func:`matrix_power` at a near-ceiling baseline (:data:`NEAR_CEILING_P`): where a slice has few
    discordant runs, the gate's design effect stays near R and one slip can fail an A/A slice."""
    return matrix_power(matrix, suite, p_baseline=NEAR_CEILING_P, icc=icc)


def simulated_power(
    matrix: Matrix,
    suite: Suite,
    power: PowerPlan,
    *,
    draws: int = SIMULATE_DRAWS,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> ReleaseSimulation:
    """``draws`` A/A releases of ``matrix`` gated by the run's own gate plan
    (:func:`depthgate.judge.planning.simulate_release`), each slice drawn from the design of its row
    of ``power`` (:func:`matrix_power`: the assumption or the pilot; a pilot's measured within-case
    variance and interaction have no generative model, so its baseline accuracy and spread are drawn)."""
    from depthgate.commands.sequential import run_gate_plan

    plan = run_gate_plan(matrix, suite)
    cases = tuple(plan.planned_cases or ())
    spaced = tuple(plan.spaced_cases or ())
    slices = [
        SimulatedSlice(
            r.length or 0,
            r.position or "",
            spaced if spaced and split_position_label(r.position or "")[1] != "adjacent" else cases,
            DesignParameters(r.p_baseline, r.between_case_sd, seed_coupling=r.seed_coupling),
        )
        for r in power.rows
    ]
    seeds = [int(x) for x in matrix.decode.seeds]
    return simulate_release(plan, slices, seeds=seeds, draws=draws, seed=seed, progress=progress)


def simulation_progress(what: str) -> Callable[[int, int], None]:
    def report(done: int, total: int) -> None:
        print(f"depthgate: simulating {what}: {done}/{total} releases", file=sys.stderr, flush=True)

    return report


def _flagged(pp: PowerPlan) -> bool:
    """Some row's approximation is outside the range it was checked in (``check_by_simulation``)."""
    return any(r.check_by_simulation for r in pp.rows)


def power_warning(matrix: Matrix, suite: Suite, *, draws: int = WARNING_DRAWS) -> str | None:
    """One line when the release is under-powered: the chance that *every* slice passes at a true
    difference of 0 (``power_all_slices``; the release needs all of them) is below 0.8 at the default
    assumptions or near the ceiling (issue #22: 40 cases x 3 seeds x 10 slices had a smallest slice
    power of 0.82 and said nothing, but all ten pass together only 0.13 of the time).

    Near the ceiling the approximation is far too low where its rows are flagged (issue #36, F3): when
    the decision rests on it (the default assumption passes), ``draws`` releases are simulated through
    the gate and the simulated number is used; otherwise the line says the near-ceiling number is an
    approximation and leaves its case count out. Each number says where it comes from."""
    try:
        pp = matrix_power(matrix, suite)
        ceiling = near_ceiling_power(matrix, suite)
    except InputError:
        return None
    ceiling_value, source = ceiling.power_all_slices, "approximation"
    ceiling_needed = ceiling.cases_needed
    if _flagged(ceiling):
        ceiling_needed = None
        source = "approximation, low near the ceiling: `depthgate plan --simulate` checks it"
        if pp.power_all_slices >= POWER_TARGET and ceiling_value < POWER_TARGET:
            what = f"the near-ceiling power ({len(ceiling.rows)} slices at p_baseline {NEAR_CEILING_P})"
            sim = simulated_power(matrix, suite, ceiling, draws=draws, progress=simulation_progress(what))
            ceiling_value = sim.power_all_slices
            source = f"simulated, {draws} releases through the gate"
    if pp.power_all_slices >= POWER_TARGET and ceiling_value >= POWER_TARGET:
        return None
    needed = [n for n in (pp.cases_needed, ceiling_needed) if n is not None]
    return (
        f"depthgate: warning: the plan is under-powered: P(all {len(pp.rows)} slices pass | no change) "
        f"{pp.power_all_slices:.2f} at p_baseline {DEFAULT_P_BASELINE} and ICC {DEFAULT_ICC} "
        "(approximation), "
        f"{ceiling_value:.2f} at p_baseline {NEAR_CEILING_P} ({source}) (target {POWER_TARGET:g}); smallest "
        f"slice power {pp.min_power:.2f} ({pp.weakest_slice}); about {max(needed) if needed else '?'} cases "
        "are needed (see `depthgate plan`)"
    )


def print_power(pp: PowerPlan, ceiling: PowerPlan | None = None, *, simulate: bool = False) -> None:
    """The power table on stdout; the joint power also near the ceiling when ``ceiling`` is given.
    Every joint number says it is the approximation; flagged rows point at ``--simulate``. The
    under-power line on stderr is left to the simulation when ``simulate``."""
    print("slice          cases seeds power  power_test power_newcombe n_for_target check_by_sim")
    for r in pp.rows:
        print(
            f"{r.length}/{r.position:<10} {r.n_cases:>5} {r.seeds:>5} {r.power:6.3f} {r.power_test:10.3f} "
            f"{r.power_newcombe:14.3f} {r.cases.n_recommended!s:>12} {r.check_by_simulation}"
        )
    print(f"min power: {pp.min_power:.3f} ({pp.weakest_slice})")
    print(
        f"power_all_slices: {pp.power_all_slices:.3f} (approximation; target {pp.target:g}; the release "
        "needs every slice)"
    )
    joint = [pp.power_all_slices]
    flagged = _flagged(pp)
    if ceiling is not None:
        joint.append(ceiling.power_all_slices)
        flagged = flagged or _flagged(ceiling)
        note = ", its rows flagged check_by_sim" if _flagged(ceiling) else ""
        print(
            f"power_all_slices near the ceiling (p_baseline {NEAR_CEILING_P}): "
            f"{ceiling.power_all_slices:.3f} (approximation{note})"
        )
    print(f"cases needed: {pp.cases_needed}")
    if flagged:
        print(
            "check_by_sim: the approximation is unreliable for flagged rows (near the ceiling it is far too "
            "low): run `depthgate plan --simulate` to gate simulated releases"
        )
    if min(joint) < pp.target and not simulate:
        print("under-powered: the release passes all slices less often than the target", file=sys.stderr)


def print_simulated(sim: ReleaseSimulation, pp: PowerPlan, label: str) -> dict[str, Any]:
    """The simulated per-slice and joint power beside the approximation's, on stdout; returns them for
    ``--json``."""
    print(f"simulated through the gate at {label} ({sim.draws} releases, seed {sim.seed}):")
    print("slice          power_approx power_sim  mc_se")
    for row, rate, count in zip(pp.rows, sim.power_per_slice, sim.shown, strict=True):
        se = sim.mc_se(count, sim.draws)
        print(f"{row.length}/{row.position:<10} {row.power:12.3f} {rate:9.3f} {se:6.3f}")
    se_all = sim.mc_se(sim.all_shown, sim.draws)
    print(
        f"power_all_slices (simulated): {sim.power_all_slices:.3f} ± {se_all:.3f} (approximation "
        f"{pp.power_all_slices:.3f}); release PASS {sim.release_pass_rate:.3f}"
    )
    return {
        "draws": sim.draws,
        "seed": sim.seed,
        "power_all_slices": sim.power_all_slices,
        "power_all_slices_mc_se": se_all,
        "release_pass": sim.release_pass_rate,
        "power_per_slice": list(sim.power_per_slice),
    }


def _gated_lengths_only(run: Path, scored: pl.DataFrame) -> pl.DataFrame:
    """The records at the run's gated lengths: the short lengths of NoLiMa's base score (the manifest's
    ``base_lengths``, issue #24) are not slices of the design being sized."""
    manifest = run / "manifest.json"
    if not manifest.is_file() or "length" not in scored.columns:
        return scored
    try:
        base = json.loads(manifest.read_text(encoding="utf-8")).get("base_lengths") or []
    except (OSError, ValueError, AttributeError):
        return scored
    return scored.filter(~pl.col("length").is_in([int(x) for x in base])) if base else scored


def read_pilot(run: str | Path) -> pl.DataFrame:
    """A finished run's scored records (``RUN/scored.parquet``)."""
    path = Path(run) / "scored.parquet"
    fix = "pass a run folder gated by `depthgate run` or `depthgate gate`"
    require_file(path, InputError, "no scored.parquet in the pilot run folder", fix=fix)
    fix = "pass a run folder gated by `depthgate run` or `depthgate gate` (gate it again to rewrite the file)"
    scored = read_parquet(path, error=InputError, what="pilot's scored records", fix=fix, field="--pilot")
    scored = _gated_lengths_only(Path(run), scored)
    try:
        pilot_parameters(scored)  # a file of the wrong shape is named here, not deep in the estimate
    except InputError as exc:
        raise InputError(exc.message, file=str(path), field=exc.field or "--pilot", fix=fix) from None
    return scored


def aa_matrix(matrix: Matrix) -> Matrix:
    """The A/A version of ``matrix``: the candidate is the baseline system under another name (the same
    layouts and seeds, separate requests)."""
    for field, name in (("baseline.name", f"{matrix.baseline.name}-repeat"), ("name", f"{matrix.name}-aa")):
        if len(name) > MAX_ID_CHARS:
            raise InputError(
                f"--aa names the repeat arm or run {name[:40]}… ({len(name)} characters), over the limit of "
                f"{MAX_ID_CHARS}",
                field=field,
                fix=f"shorten {field} to at most {MAX_ID_CHARS - (len(name) - MAX_ID_CHARS)} characters "
                "for an A/A run",
            )
    repeat = matrix.baseline.model_copy(update={"name": f"{matrix.baseline.name}-repeat"})
    return matrix.model_copy(update={"candidate": repeat, "name": f"{matrix.name}-aa"})

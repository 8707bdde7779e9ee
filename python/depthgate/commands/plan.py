"""``depthgate plan MATRIX``: per-slice power of a matrix's pre-registered plan (research/stats_gate.md §3),
the warning ``depthgate run`` prints when that plan is under-powered, and the A/A matrix of
``depthgate run --aa`` (the baseline against a repeat of itself).

Assumptions without a pilot: a baseline accuracy of 0.85 and an intra-case correlation of 0.33
(:data:`DEFAULT_P_BASELINE`, :data:`DEFAULT_ICC`), a true difference of 0, and a target of 0.8 for all
slices together. ``--pilot RUN`` estimates the design per slice from a finished run's ``scored.parquet``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl

from depthgate.exceptions import InputError
from depthgate.judge.power import DesignParameters, PowerPlan, pilot_parameters, power_plan
from depthgate.judge.stats import Sizing
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
    "aa_matrix",
    "matrix_power",
    "near_ceiling_power",
    "power_warning",
    "print_power",
]

DEFAULT_P_BASELINE = 0.85
#: The near-ceiling baseline accuracy at which `depthgate plan` and the run warning also check the
#: joint power (issue #22, item 5).
NEAR_CEILING_P = 0.99
DEFAULT_ICC = 0.33
POWER_TARGET = 0.8
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


def power_warning(matrix: Matrix, suite: Suite) -> str | None:
    """One line when the release is under-powered: the chance that *every* slice passes at a true
    difference of 0 (``power_all_slices``; the release needs all of them) is below 0.8 at the default
    assumptions or near the ceiling (issue #22: 40 cases x 3 seeds x 10 slices had a smallest slice
    power of 0.82 and said nothing, but all ten pass together only 0.13 of the time)."""
    try:
        pp = matrix_power(matrix, suite)
        ceiling = near_ceiling_power(matrix, suite)
    except InputError:
        return None
    if pp.power_all_slices >= POWER_TARGET and ceiling.power_all_slices >= POWER_TARGET:
        return None
    needed = [n for n in (pp.cases_needed, ceiling.cases_needed) if n is not None]
    return (
        f"depthgate: warning: the plan is under-powered: P(all {len(pp.rows)} slices pass | no change) "
        f"{pp.power_all_slices:.2f} at p_baseline {DEFAULT_P_BASELINE} and ICC {DEFAULT_ICC}, "
        f"{ceiling.power_all_slices:.2f} at p_baseline {NEAR_CEILING_P} (target {POWER_TARGET:g}); smallest "
        f"slice power {pp.min_power:.2f} ({pp.weakest_slice}); about {max(needed) if needed else '?'} cases "
        "are needed (see `depthgate plan`)"
    )


def print_power(pp: PowerPlan, ceiling: PowerPlan | None = None) -> None:
    """The power table on stdout; the joint power also near the ceiling when ``ceiling`` is given."""
    print("slice          cases seeds power  power_test power_newcombe n_for_target check_by_sim")
    for r in pp.rows:
        print(
            f"{r.length}/{r.position:<10} {r.n_cases:>5} {r.seeds:>5} {r.power:6.3f} {r.power_test:10.3f} "
            f"{r.power_newcombe:14.3f} {r.cases.n_recommended!s:>12} {r.check_by_simulation}"
        )
    print(f"min power: {pp.min_power:.3f} ({pp.weakest_slice})")
    print(
        f"power_all_slices: {pp.power_all_slices:.3f} (target {pp.target:g}; the release needs every slice)"
    )
    joint = [pp.power_all_slices]
    if ceiling is not None:
        joint.append(ceiling.power_all_slices)
        print(
            f"power_all_slices near the ceiling (p_baseline {NEAR_CEILING_P}): {ceiling.power_all_slices:.3f}"
        )
    print(f"cases needed: {pp.cases_needed}")
    if min(joint) < pp.target:
        print("under-powered: the release passes all slices less often than the target", file=sys.stderr)


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

"""``stop_rule = "sequential"`` in the pipeline (issue #26): send look by look, gate at each look, stop
sending decided slices; the verdict and report sections of a sequential run.

The run log is ``RUN/looks.json`` (rewritten atomically after every look): the design (boundary,
looks, nominal levels), the frozen case order, every look's decisions and what was not sent. It is a
log, not an input: ``depthgate gate`` replays the looks from the records
(:func:`depthgate.judge.gate.replay_looks`, deterministic) and gets the same history.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.exceptions import InputError
from depthgate.judge.gate import GatePlan, GateResult, SequentialDesign, replay_looks, sequential_gate
from depthgate.judge.sequential import expected_share
from depthgate.run.looks import case_order, look_jobs
from depthgate.spec.cases import Suite
from depthgate.spec.files import atomic_write
from depthgate.spec.matrix import Matrix
from depthgate.spec.models import AnalysisPlan
from depthgate.spec.positions import split_position_label

__all__ = [
    "LOOKS_FILE",
    "design_of",
    "gate_sequential",
    "record_scorer",
    "refuse_sequential",
    "run_gate_plan",
    "run_looks",
    "sent_jobs",
    "sequential_plan_lines",
    "write_look_log",
]

LOOKS_FILE = "looks.json"
NEAR_CEILING = 0.99


def refuse_sequential(
    plan: AnalysisPlan, *, shard: tuple[int, int] | None, file: str, after: Path | None = None
) -> None:
    """``--after`` (the merged folder of a sharded sequential run's previous round) without ``--shard``
    or with another plan, refused by name before anything is built. (Both engines send look by look:
    each look's jobs are one call of the engine's runner.)"""
    if after is not None and (shard is None or plan.stop_rule != "sequential"):
        raise InputError(
            "--after names the merged folder of the previous round of a sharded sequential run; this run "
            + ("is not a shard" if shard is None else f"has stop_rule {plan.stop_rule!r}"),
            file=file,
            field="--after",
            fix='drop --after, or use it with --shard i/N on a matrix with stop_rule = "sequential"',
        )


def sequential_plan_lines(matrix: Matrix, suite: Suite, *, p_baseline: float, icc: float) -> list[str]:
    """What ``depthgate plan`` prints for a sequential plan: the looks, their nominal levels and the
    expected requests at delta = 0, -M and -3M as a share of the fixed design (normal approximation of
    the gate's statistic at the plan's assumptions and near the ceiling; the simulated values of the
    gate itself are docs/gate-calibration.md §8)."""
    from depthgate.judge.planning import DesignParameters

    plan = matrix.plan
    n_cases = sum(1 for c in suite.cases if c.decisive)
    seeds = len(matrix.decode.seeds)
    design = design_of(plan, n_cases)
    n_slices = len(matrix.lengths) * len(matrix.position_values())
    by = n_slices * math.fsum(1.0 / i for i in range(1, n_slices + 1))
    # The lower boundary: futility (unadjusted regression p <= alpha) at every interim look, which is
    # more liberal than a BY-confirmed regression (one regressed slice among n_slices) at the look's level.
    lower = [max(plan.alpha, level / by) for level in design.levels]
    lines = [
        f"sequential: {design.boundary}, looks at {', '.join(map(str, design.counts))} of {n_cases} cases, "
        f"nominal one-sided levels {', '.join(f'{lv:.3g}' for lv in design.levels)}",
    ]
    for label, p in (("plan assumptions", p_baseline), ("near the ceiling", NEAR_CEILING)):
        params = DesignParameters.from_icc(p, icc)
        shares = []
        for k in (0.0, -1.0, -3.0):
            delta = k * plan.margin
            sd = params.sd_diff(seeds, max(delta, -p))
            drift = (delta + plan.margin) / sd * math.sqrt(n_cases) if sd > 0 else math.inf
            shares.append(expected_share(design.fractions, design.levels, lower, drift))
        lines.append(
            f"expected requests / fixed design ({label}, p_baseline {p:g}, ICC {icc:g}): "
            f"{shares[0]:.0%} at delta 0, {shares[1]:.0%} at -M, {shares[2]:.0%} at -3M"
        )
    # Said on the console, not only here: the approximation ranks designs well but reads low (§8.6).
    lines.append(
        "(normal approximation: the gate's simulated shares read about 6 points higher, "
        "docs/gate-calibration.md §8.6-8.7)"
    )
    return lines


def design_of(plan: AnalysisPlan, n_cases: int) -> SequentialDesign:
    return SequentialDesign.of(
        n_cases, plan.alpha, looks=plan.looks, every=plan.look_every, boundary=plan.boundary
    )


def _cases_of(gplan: GatePlan) -> dict[tuple[int, str], Sequence[str]] | None:
    if gplan.spaced_cases is None or gplan.planned_slices is None:
        return None
    spaced = list(gplan.spaced_cases)
    return {s: spaced for s in gplan.planned_slices if split_position_label(s[1])[1] != "adjacent"}


def _write_log(out: Path, section: Mapping[str, Any]) -> None:
    path = out / LOOKS_FILE
    atomic_write(path, json.dumps(section, indent=2, sort_keys=True, default=str))


def run_looks(
    jobs: Sequence[tuple[str, Mapping[str, Any]]],
    send: Callable[[list[tuple[str, Mapping[str, Any]]]], Any],
    score: Callable[[], pl.DataFrame],
    gplan: GatePlan,
    plan: AnalysisPlan,
    run_id: str,
    out: Path,
) -> Any:
    """Send the matrix look by look. ``send(jobs)`` runs one look's jobs (the runner: resumable, already
    recorded jobs are skipped) and returns its summary; ``score()`` scores every record so far. Between
    looks the slices decided so far get no more cases; the loop ends when every slice is decided, after
    the last look, or when ``send`` reports an open circuit (a rerun resumes the look)."""
    cases = list(gplan.planned_cases or ())
    design = design_of(plan, len(cases))
    order = case_order(cases, run_id)
    slices = list(dict.fromkeys(gplan.planned_slices or ()))
    decided: dict[tuple[int, str], tuple[int, str]] = {}
    summary: Any = None
    for k, count in enumerate(design.counts):
        open_slices = [s for s in slices if s not in decided]
        batch = look_jobs(jobs, order[:count], open_slices)
        print(
            f"depthgate: look {k + 1}/{len(design.counts)}: cases 1–{count} of {len(order)} in "
            f"{len(open_slices)} open slice(s), level {design.levels[k]:.3g} ({len(batch)} layouts)",
            file=sys.stderr,
        )
        summary = send(batch)
        if getattr(summary, "circuit_open", None) is not None:
            break
        history, decided = replay_looks(score(), gplan, design, order, cases_of=_cases_of(gplan))
        _write_log(
            out,
            {
                "design": design.to_dict(),
                "case_order": order,
                "looks": [h.to_dict() for h in history],
                "decided": [
                    {"length": s[0], "position": s[1], "look": look, "decision": what}
                    for s, (look, what) in decided.items()
                ],
            },
        )
        if decided:
            done = ", ".join(f"{s[0]}/{s[1]} {what} (look {look})" for s, (look, what) in decided.items())
            print(f"depthgate: decided: {done}", file=sys.stderr)
        if len(decided) == len(slices):
            print(f"depthgate: every slice decided after look {k + 1}; the rest is not sent", file=sys.stderr)
            break
    return summary


def gate_sequential(
    scored: pl.DataFrame, gplan: GatePlan, plan: AnalysisPlan, run_id: str
) -> tuple[GateResult, dict[str, Any]]:
    """The verdict of a sequential run folder and its ``sequential`` section (looks replayed)."""
    cases = list(gplan.planned_cases or ())
    design = design_of(plan, len(cases))
    return sequential_gate(scored, gplan, design, case_order(cases, run_id), cases_of=_cases_of(gplan))


def sent_jobs(planned: pl.DataFrame, section: Mapping[str, Any]) -> pl.DataFrame:
    """The planned jobs the schedule sends: per slice, the cases of its deciding look (the rest are not
    sent by design, never lost)."""
    order = list(section["case_order"])
    counts = list(section["design"]["cases"])
    keep = {
        (str(c), int(r["length"]), str(r["position"]))
        for r in section["slices"]
        for c in order[: counts[int(r["look"]) - 1]]
    }
    mask = [
        (str(c), int(t), str(p)) in keep
        for c, t, p in planned.select("case_id", "target_tokens", "position").iter_rows()
    ]
    return planned.filter(pl.Series(mask, dtype=pl.Boolean))


def write_look_log(section: Mapping[str, Any], out: Path) -> None:
    """The replayed look history into the run log ``RUN/looks.json`` (the reports get it as the
    ``sequential`` section of the report document, :mod:`depthgate.report.sequential`)."""
    _write_log(out, json.loads(json.dumps(section, default=str)))


def run_gate_plan(matrix: Matrix, suite: Suite) -> GatePlan:
    """The gate plan a run of ``matrix`` replays its looks with (the one ``gate_run`` gates with)."""
    from depthgate.commands.freeze import gate_plan
    from depthgate.layout.layouts import parse_positions

    labels = [p.label for p in parse_positions(matrix.position_values())]
    placed = [c.id for c in suite.cases if c.decisive]
    multi = {c.id for c in suite.cases if len(c.decisive) >= 2}
    spaced = [c for c in placed if c in multi]
    has_spacing = any(split_position_label(label)[1] != "adjacent" for label in labels)
    return gate_plan(
        matrix.plan,
        list(matrix.lengths),
        labels,
        cases=placed,
        seeds=matrix.decode.seeds,
        spaced_cases=spaced if has_spacing else None,
    )


def record_scorer(records_dir: Path, suite: Suite, layouts_dir: Path) -> Callable[[], pl.DataFrame]:
    """Scores every record in ``records_dir`` so far (layouts from ``layouts_dir``, the same build)."""
    from depthgate.judge.scoring import score_records
    from depthgate.layout.layouts import read_layouts
    from depthgate.run.records import read_records

    layouts = pl.concat(
        [
            read_layouts(layouts_dir / arm / "layouts.parquet", columns=["layout_id", "evidence_spans"])
            for arm in ("baseline", "candidate")
        ]
    )

    def score() -> pl.DataFrame:
        return score_records(read_records(records_dir), suite, layouts)

    return score

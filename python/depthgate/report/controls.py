"""The controls run beside the matrix, in the reports: each case's failures classified
(:func:`depthgate.judge.science.classify_failures`) into verdict.json ``controls`` and a section of
summary.md. It never changes the verdict."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import polars as pl

from depthgate.judge.science import classify_failures
from depthgate.report.document import AnalysisContext, Section
from depthgate.report.formatting import markdown_table

__all__ = ["controls_section", "render_controls_markdown"]

_CLASSES_NOTE = (
    "task_or_model: the evidence-only short input already fails; position_or_assembly: only "
    "long variants fail; hallucination: a value was given with the evidence removed; serving_path: "
    "a control was lost to the arm's serving path (system failures)."
)


def render_controls_markdown(counts: Mapping[str, int], eligibility: Mapping[str, Any] | None) -> str:
    """The summary.md section: cases per (arm, class), and the cases the primary metric kept."""
    lines = [
        "",
        "",
        "### Controls (beside the matrix; they never change the verdict)",
        "",
        *markdown_table(
            ["arm", "class", "cases"],
            ([*key.split(":")[:2], str(n)] for key, n in sorted(counts.items())),
            right=(2,),
        ),
    ]
    lines += ["", _CLASSES_NOTE, ""]
    if eligibility is not None:
        lines += [
            f"Primary metric control_normalised (pre-registered): the gate counted the "
            f"{eligibility['n_eligible']} of {eligibility['n_placed']} cases whose baseline evidence-only "
            "control passed.",
            "",
        ]
    return "\n".join(lines)


def controls_section(ctx: AnalysisContext) -> Section | None:
    """Classify each case's failures from the controls: task or model (evidence-only short input
    fails), position or assembly (only long variants fail), hallucination (evidence-absent answered with a
    value). None when no controls ran. ``ctx.eligibility``: the cases the primary metric
    control_normalised kept, reported."""
    scored_controls = ctx.scored_controls
    if scored_controls is None:
        return None
    classes = classify_failures(ctx.scored, scored_controls)
    counts = {
        f"{arm}:{cls}": n
        for arm, cls, n in classes.group_by("arm", "category").len().sort("arm", "category").iter_rows()
    }
    only = scored_controls.filter(pl.col("control") == "evidence_only")
    only_rate = only["outcome"].eq("pass").sum() / only.height if only.height else None
    section: dict[str, Any] = {
        "counts": counts,
        "cases": classes.to_dicts(),
        "hallucinated_runs": int(scored_controls["hallucinated"].sum()),
        "evidence_only_pass_rate": only_rate,
    }
    if ctx.eligibility is not None:
        section["primary_metric"] = {k: v for k, v in ctx.eligibility.items() if k != "eligible"}
    return Section(
        key="controls",
        data=json.loads(json.dumps(section, default=str)),
        markdown=render_controls_markdown(counts, ctx.eligibility),
    )

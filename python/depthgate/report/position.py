"""Position science in the reports (issue #13): effective length per depth, control-normalised accuracy,
pass^k and the A/A noise floor, added beside the verdict (they never change it).

:func:`position_science` computes the numbers from a run's scored records (``RUN/scored.parquet``) and,
when the controls ran, its scored controls (``RUN/scored_controls.parquet``), with the frozen plan's
``effective_length_rule``/``effective_length_threshold``, ``bootstrap_seed`` and one-sided look alpha.
:func:`position_section` is the report's section of them: ``verdict.json`` key ``position``, a section of
``summary.md``, a section of ``report.html`` (accuracy-by-length charts per depth as embedded PNGs and the
tables) and the effective length in ``junit.xml``.

NoLiMa without controls: the base score is taken as 1.0 for both arms (the threshold then is an absolute
accuracy, as under RULER) and a note says so.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import math
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from depthgate.exceptions import InputError
from depthgate.judge.science import (
    EL_RESAMPLES,
    MC_Z,
    EffectiveLength,
    EffectiveLengthResult,
    base_scores_from_controls,
    control_normalised_accuracy,
    effective_length,
    pass_hat_k,
    spacing_accuracy,
)
from depthgate.judge.tables import ARMS, BASELINE, CANDIDATE, position_sort_key
from depthgate.report.document import AnalysisContext, Section
from depthgate.report.formatting import depth_label, markdown_table
from depthgate.spec.models import AnalysisPlan, look_alpha

__all__ = [
    "PositionScience",
    "add_junit_effective_length",
    "definition_lines",
    "position_science",
    "position_section",
    "render_curve_png",
    "spacing_layouts",
]

_DPI = 110
_COLORS = {"baseline": "#1f6feb", "candidate": "#cf222e"}


@dataclass(frozen=True)
class PositionScience:
    """The position numbers of one run. ``effective``: None when it could not be computed (``notes``
    say why); ``normalised``: control-normalised accuracy (None without controls); ``repeat``: pass^k."""

    effective: EffectiveLengthResult | None
    normalised: pl.DataFrame | None
    repeat: pl.DataFrame
    seeds: int
    notes: tuple[str, ...] = field(default=())
    #: Accuracy by evidence spacing (:func:`depthgate.judge.science.spacing_accuracy`); None when no
    #: position carries a spacing (then verdict.json has no ``spacing`` key, as before the axis).
    spacing: pl.DataFrame | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "effective_length": None if self.effective is None else self.effective.to_dict(),
            "control_normalised": None if self.normalised is None else self.normalised.to_dicts(),
            "pass_hat_k": self.repeat.to_dicts(),
            "seeds": self.seeds,
            "notes": list(self.notes),
        }
        if self.spacing is not None:
            out["spacing"] = self.spacing.to_dicts()
        return dict(_clean(out))


def _clean(value: Any) -> Any:
    """JSON-ready: non-finite floats as None, tuples as lists."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


#: Below this base score NoLiMa's relative threshold stops meaning "still does the task": on the embedded
#: model the query-first arm passed 1 of 12 evidence-only controls (base 0.08, threshold 0.07), and its
#: "effective length" reached the whole grid at depths where it answered 2 of 12 (docs/position.md).
LOW_BASE_SCORE = 0.5


def _low_base_notes(
    base_scores: Mapping[str, float] | None, threshold: float, source: str = "control"
) -> list[str]:
    """A note per arm whose NoLiMa base score is too low for its relative threshold to mean much."""
    fails = "of its short-length runs" if source == "short" else "evidence-only controls"
    return [
        f"{arm}: NoLiMa base score {base:.2f} is below {LOW_BASE_SCORE} (the arm fails most {fails}), "
        f"so its threshold {threshold * base:.3f} is near chance; read the RULER rule "
        '(effective_length_rule = "ruler") or the control-normalised table for this arm'
        for arm, base in sorted((base_scores or {}).items())
        if base < LOW_BASE_SCORE
    ]


def _fallback_notes(scored: pl.DataFrame, scored_controls: pl.DataFrame) -> list[str]:
    """A note per arm of the records that had no usable evidence-only control (its base score 1.0)."""
    if "arm" not in scored_controls.columns:
        return []
    have = base_scores_from_controls(scored_controls)
    arms = [a for a in ARMS if a in set(scored["arm"].unique().to_list()) and a not in have]
    out = []
    for arm in arms:
        own = scored_controls.filter((pl.col("arm") == arm) & (pl.col("control") == "evidence_only"))
        lost = own.filter(pl.col("outcome") == "system_fail").height
        out.append(
            f"{arm}: no usable evidence-only control ({lost} of {own.height} lost to its serving path): "
            "NoLiMa base score taken as 1.0 for this arm only"
        )
    return out


def position_science(
    scored: pl.DataFrame,
    plan: AnalysisPlan,
    *,
    seeds: Sequence[int],
    scored_controls: pl.DataFrame | None = None,
    layouts: pl.DataFrame | None = None,
    base_scored: pl.DataFrame | None = None,
) -> PositionScience:
    """Effective length (the plan's rule and threshold), control-normalised accuracy and pass^k of a run.

    NoLiMa needs the evidence-only controls for its base score: without them (``--no-controls``) or when
    they cannot give one, the base score is 1.0 for both arms and a note says so. ``layouts``
    (:func:`spacing_layouts`) gives the spacing table its measured gaps and multi-evidence cases.
    ``base_scored``: the records at the short base lengths (issue #24), the NoLiMa base when the plan's
    ``base_score`` is "short"; when they give no base for an arm, the controls do (a note says so)."""
    notes: list[str] = []
    alpha = look_alpha(plan.alpha, plan.stop_rule)
    common: dict[str, Any] = {
        "rule": plan.effective_length_rule,
        "threshold": plan.effective_length_threshold,
        "seed": plan.bootstrap_seed,
        "alpha": alpha,
        # At least EL_RESAMPLES: the intervals' Monte-Carlo guard shrinks with B (issue #39).
        "reps": max(plan.bootstrap_resamples, EL_RESAMPLES),
    }
    effective: EffectiveLengthResult | None = None
    try:
        if plan.effective_length_rule == "ruler":
            effective = effective_length(scored, **common)
        else:
            if base_scored is not None and plan.base_score == "short":
                try:
                    effective = effective_length(scored, base_records=base_scored, **common)
                except InputError as exc:
                    notes.append(f"NoLiMa base score from the short lengths failed ({exc.message})")
            if effective is not None:
                pass
            elif scored_controls is not None and scored_controls.height:
                try:
                    # Each arm's base from its own controls; an arm without a usable one takes 1.0
                    # alone (its controls lost to its serving path never move the other arm's numbers).
                    effective = effective_length(
                        scored, scored_controls=scored_controls, fallback_base=1.0, **common
                    )
                    notes.extend(_fallback_notes(scored, scored_controls))
                except InputError as exc:
                    notes.append(f"NoLiMa base score from the controls failed ({exc.message}); base 1.0 used")
            else:
                notes.append("no controls ran: NoLiMa base score taken as 1.0 (an absolute threshold)")
            if effective is None:
                effective = effective_length(scored, base_scores=dict.fromkeys(ARMS, 1.0), **common)
            source = effective.base[0].source if effective.base else "control"
            notes.extend(_low_base_notes(effective.base_scores, plan.effective_length_threshold, source))
    except InputError as exc:
        notes.append(f"effective length not computed: {exc.message}")
    normalised = None
    if scored_controls is not None and scored_controls.height:
        try:
            normalised = control_normalised_accuracy(scored, scored_controls, alpha=alpha)
        except InputError as exc:
            notes.append(f"control-normalised accuracy not computed: {exc.message}")
    repeat = pass_hat_k(scored, seeds=seeds)
    spacing = spacing_accuracy(scored, layouts)
    return PositionScience(effective, normalised, repeat, len(set(seeds)), tuple(notes), spacing)


def spacing_layouts(run: Path) -> pl.DataFrame | None:
    """The small columns of both arms' layouts that :func:`spacing_accuracy` reads (``arm`` added), or
    None when the run's layouts carry no spacing (built before the axis, or adjacent only)."""
    from depthgate.layout.layouts import read_layouts

    columns = ["case_id", "target_tokens", "position", "status", "evidence_gap_tokens"]
    frames = []
    for arm in ARMS:
        path = run / arm / "layouts.parquet"
        if not path.is_file() or "evidence_gap_tokens" not in pl.read_parquet_schema(path):
            return None
        frames.append(read_layouts(path, columns=columns).with_columns(pl.lit(arm).alias("arm")))
    layouts = pl.concat(frames)
    if not layouts["position"].str.contains("~", literal=True).any():
        return None
    return layouts


# --------------------------------------------------------------------------------------------------
# Rendering


def _f(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{float(value):.{digits}f}"


def _length(value: int, at_top: bool = False) -> str:
    if value == 0:
        return "below grid"
    return f"≥{value}" if at_top else str(value)


def _positions(ps: PositionScience) -> list[str]:
    if ps.effective is None:
        return []
    return sorted({r.position for r in ps.effective.rows}, key=position_sort_key)


def _el_rows(ps: PositionScience) -> list[list[str]]:
    """Per depth: each arm's effective length [interval], and the Δ (candidate − baseline)."""
    el = ps.effective
    rows: list[list[str]] = []
    if el is None:
        return rows
    for pos in _positions(ps):
        cells = [pos]
        for arm in ARMS:
            try:
                r = el.row(arm, pos)
            except KeyError:
                cells.append("–")
                continue
            cells.append(
                f"{_length(r.estimate, r.at_grid_top)} [{r.lower}, {r.upper}] (thr {r.threshold_abs:.3f})"
            )
        try:
            d = el.delta(pos)
            censored = censored_delta(el.row(BASELINE, pos), el.row(CANDIDATE, pos))
        except KeyError:
            cells.append("–")
        else:
            if censored is None:
                cells.append(f"{d.estimate:+d} [{d.lower:+d}, {d.upper:+d}] ({d.estimate_steps:+d} steps)")
            else:
                cells.append(censored)
        rows.append(cells)
    return rows


def _steps(value: int) -> str:
    word = "step" if abs(value) == 1 else "steps"
    return f"{value:+d} {word}".replace("-", "−")


def censored_delta(baseline: EffectiveLength, candidate: EffectiveLength) -> str | None:
    """The Δ (candidate − baseline) of two effective lengths when either is censored, in grid steps, as
    a bound: below the grid (step 0) means "at most step 0", ``at_grid_top`` (step K) "at least step K".
    Candidate at the top and baseline at step 1 of 2: "≥ +1 step"; both censored the same way: "not
    measured". None when both are measured (the Δ is then a number)."""

    def bounds(row: EffectiveLength) -> tuple[float, float]:
        if row.at_grid_top:
            return float(row.steps), math.inf
        if row.steps == 0:
            return -math.inf, 0.0
        return float(row.steps), float(row.steps)

    (b_lo, b_hi), (c_lo, c_hi) = bounds(baseline), bounds(candidate)
    if math.isfinite(b_lo) and math.isfinite(b_hi) and math.isfinite(c_lo) and math.isfinite(c_hi):
        return None
    low, high = c_lo - b_hi, c_hi - b_lo
    if math.isfinite(low):
        return f"≥ {_steps(int(low))} (censored)"
    if math.isfinite(high):
        return f"≤ {_steps(int(high))} (censored)"
    return "not measured (both censored)"


def _with_interval(r: Mapping[str, Any], name: str) -> str:
    """``0.50 [0.25, 0.75]``: an accuracy with its Wilson interval (judge.position adds it)."""
    if r.get(name) is None or r.get(f"{name}_lower") is None:
        return _f(r.get(name))
    return f"{_f(r[name])} [{_f(r[f'{name}_lower'])}, {_f(r[f'{name}_upper'])}]"


def _cna_rows(ps: PositionScience) -> list[list[str]]:
    if ps.normalised is None:
        return []
    return [
        [
            r["arm"],
            f"{r['length']}/{r['position']}",
            _with_interval(r, "accuracy"),
            f"{_with_interval(r, 'accuracy_eligible')} (n={r['n_eligible']})",
            f"{_with_interval(r, 'accuracy_eligible_baseline')} (n={r['n_eligible_baseline']})",
        ]
        for r in ps.normalised.iter_rows(named=True)
    ]


def _phk_rows(ps: PositionScience) -> list[list[str]]:
    return [
        [
            r["arm"],
            f"{r['length']}/{r['position']}",
            _f(r["accuracy"]),
            f"{_f(r['pass_hat_k'])} [{_f(r['pass_hat_k_lower'])}, {_f(r['pass_hat_k_upper'])}]",
            str(r["n_complete"]),
        ]
        for r in ps.repeat.iter_rows(named=True)
    ]


def _gap(r: Mapping[str, Any]) -> str:
    if r["gap_median"] is None:
        return "–"
    if r["gap_min"] == r["gap_max"]:
        return f"{r['gap_min']}"
    return f"{r['gap_median']:g} [{r['gap_min']}–{r['gap_max']}]"


def _acc(r: Mapping[str, Any] | None) -> str:
    if r is None:
        return "–"
    own = r["accuracy_multi"] if r["n_multi"] is not None else r["accuracy"]
    n = r["n_multi"] if r["n_multi"] is not None else r["n_cases"]
    vs = "" if r["vs_adjacent"] is None or r["spacing"] == "adjacent" else f" ({r['vs_adjacent']:+.2f})"
    return f"{_f(own)}{vs} (n={n})"


def _spacing_rows(ps: PositionScience) -> list[list[str]]:
    """Per (length, depth, spacing): measured gap per arm, each arm's accuracy on the multi-evidence
    cases with its change from adjacent."""
    if ps.spacing is None:
        return []
    by_key: dict[tuple[int, str, str], dict[str, Mapping[str, Any]]] = {}
    for r in ps.spacing.iter_rows(named=True):
        by_key.setdefault((r["length"], r["depth"], r["spacing"]), {})[r["arm"]] = r
    rows = []
    for (length, depth, spacing), arms in by_key.items():
        gaps = " / ".join(_gap(arms[a]) for a in ARMS if a in arms)
        rows.append([f"{length}/{depth}", spacing, gaps, *(_acc(arms.get(a)) for a in ARMS)])
    return rows


_SPACING_HEAD = [
    "length/depth",
    "spacing",
    "measured gap, tokens (baseline / candidate)",
    "baseline accuracy (Δ vs adjacent)",
    "candidate accuracy (Δ vs adjacent)",
]
_SPACING_NOTE = (
    "Evidence spacing: the decisive documents of each multi-evidence case are this many tokens apart "
    "(measured on the final layout; median [min–max]); accuracies are on those cases only; the gate "
    "slices are `length/depth~spacing`."
)

_EL_HEAD = ["depth", "baseline EL [interval]", "candidate EL [interval]", "Δ tokens [interval]"]
_CNA_HEAD = [
    "arm",
    "slice",
    "raw accuracy [Wilson]",
    "control-normalised (own control)",
    "on baseline-eligible",
]


def _phk_head(k: int) -> list[str]:
    return ["arm", "slice", "mean accuracy", f"pass^{k} [Wilson]", "complete cases"]


def _base_scores_text(scores: Mapping[str, float]) -> str:
    """``baseline 0.92, candidate 0.08``: each arm's base score, in arm order."""
    named = [f"{arm} {scores[arm]:.2f}" for arm in ARMS if arm in scores]
    return ", ".join(named + [f"{k} {v:.2f}" for k, v in sorted(scores.items()) if k not in ARMS])


def _base_lines(el: EffectiveLengthResult) -> list[str]:
    """The measured base score per arm with its interval, and the grid points above it (issue #24)."""
    if el.base is None:
        return []
    level = f"{100 * (1 - el.alpha):g}%"
    lines = []
    for b in el.base:
        where = (
            "the same task at " + "/".join(str(x) for x in b.lengths) + " tokens"
            if b.source == "short"
            else "the evidence-only control"
        )
        skipped = f", {b.not_sent} short runs never sent (refused layouts) left out" if b.not_sent else ""
        lines.append(
            f"Base score, {b.arm}: {b.accuracy:.2f} [{b.lower:.2f}, {b.upper:.2f}] ({level} Wilson, "
            f"clustered by case; {where}; {b.n_cases} cases, {b.runs} runs{skipped})."
        )
    for arm in ARMS:
        above = [a for a in el.above_base if a.arm == arm]
        if above:
            points = ", ".join(f"{a.length} ({a.accuracy:.2f})" for a in above)
            lines.append(
                f"Above the base, {arm}: accuracy over all depths exceeds the base {above[0].base:.2f} by "
                f"more than its interval (upper {above[0].base_upper:.2f}) at {points}: the base "
                "under-states this arm, so its NoLiMa threshold is lenient."
            )
    return [*lines, ""]


def definition_lines(el: EffectiveLengthResult) -> list[str]:
    """What the effective length above is, beside NoLiMa's and RULER's definitions (issue #39)."""
    if el.rule == "nolima":
        threshold = f"{el.threshold:g} × the base score of the arm (the NoLiMa rule)"
    else:
        threshold = f"the fixed accuracy {el.threshold:g} (the RULER rule)"
    return [
        "Definition: depthgate reads the effective length of a depth as the longest grid length L such "
        f"that the accuracy of the depth at L and at every shorter grid length is ≥ {threshold}; the "
        f"interval ends are grid values of the case bootstrap (B = {el.reps}), each guarded by {MC_Z:g} "
        "Monte-Carlo standard errors so that they do not move with the bootstrap seed.",
        "Effective length in NoLiMa: the longest length at which the score stays ≥ 85 % of the "
        "short-context base score; in RULER: the longest length at which the score stays above a fixed "
        "threshold (85.6 %, the accuracy of Llama-2-7B at 4K). Both read one curve averaged over needle "
        "positions (RULER also over tasks); depthgate reads each depth.",
    ]


def render_position_markdown(ps: PositionScience) -> str:
    """The summary.md section."""
    lines = ["", "", "### Position science (beside the gate; it never changes the verdict)", ""]
    el = ps.effective
    if el is not None:
        lines += [
            f"Effective length per depth ({el.rule}, threshold {el.threshold:g}"
            + (f" of the base score ({_base_scores_text(el.base_scores)})" if el.base_scores else "")
            + f"; {100 * (1 - el.alpha):g}% case-bootstrap intervals, B = {el.reps}):",
            "",
            *markdown_table(_EL_HEAD, _el_rows(ps)),
            "",
            *definition_lines(el),
            "",
            *_base_lines(el),
        ]
    if ps.normalised is not None:
        lines += ["Control-normalised accuracy beside raw (cases whose evidence-only control passes):", ""]
        lines += [*markdown_table(_CNA_HEAD, _cna_rows(ps)), ""]
    if ps.spacing is not None:
        lines += [_SPACING_NOTE, "", *markdown_table(_SPACING_HEAD, _spacing_rows(ps)), ""]
    if ps.seeds > 1:
        lines += [f"Repeat stability: pass^{ps.seeds} beside the mean:", ""]
        lines += [*markdown_table(_phk_head(ps.seeds), _phk_rows(ps)), ""]
    lines += [f"Note: {n}" for n in ps.notes]
    return "\n".join(lines) + "\n"


def curve_figure(ps: PositionScience, position: str) -> Figure:
    """Accuracy vs length at one depth: a line per arm, its Wilson interval as the shaded band (it keeps
    its width at accuracy 0 and 1, where the case bootstrap collapses to a point), the case-bootstrap
    interval as error bars, the arm's threshold (dotted) and its effective length (dashed vertical)."""
    assert ps.effective is not None
    el = ps.effective
    fig = Figure(figsize=(5.6, 3.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lengths: set[int] = set()
    nan = float("nan")
    for arm in ARMS:
        pts = sorted((p for p in el.curve if p.arm == arm and p.position == position), key=lambda p: p.length)
        if not pts:
            continue
        color = _COLORS[arm]
        xs = [p.length for p in pts]
        lengths.update(xs)
        ys = [nan if p.accuracy is None else p.accuracy for p in pts]
        below = [0.0 if p.lower is None or p.accuracy is None else p.accuracy - p.lower for p in pts]
        above = [0.0 if p.upper is None or p.accuracy is None else p.upper - p.accuracy for p in pts]
        w_lo = [nan if p.wilson_lower is None else p.wilson_lower for p in pts]
        w_hi = [nan if p.wilson_upper is None else p.wilson_upper for p in pts]
        ax.plot(xs, ys, marker="o", color=color, label=arm)
        ax.fill_between(xs, w_lo, w_hi, color=color, alpha=0.15, linewidth=0, label=f"{arm} Wilson")
        ax.errorbar(xs, ys, yerr=[below, above], fmt="none", ecolor=color, elinewidth=1, capsize=3)
        ax.axhline(pts[0].threshold_abs, color=color, linestyle=":", linewidth=1)
        try:
            row = el.row(arm, position)
        except KeyError:
            continue
        if row.estimate > 0:
            ax.axvline(
                row.estimate, color=color, linestyle="--", linewidth=1, label=f"{arm} EL {row.estimate}"
            )
    if len(lengths) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), labels=[str(v) for v in sorted(lengths)])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("accuracy")
    ax.set_title(
        f"depth {depth_label(position)}: accuracy by length\n"
        "band: Wilson interval · bars: case bootstrap · dotted: threshold · dashed: EL",
        fontsize=8,
    )
    ax.legend(fontsize=6, loc="lower left", ncol=2)
    fig.tight_layout()
    return fig


def render_curve_png(ps: PositionScience, position: str) -> bytes:
    """:func:`curve_figure` as PNG bytes."""
    fig = curve_figure(ps, position)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI, metadata={"Software": None})
    return buffer.getvalue()


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in rows]
    return "\n".join(out) + "\n</table>"


def render_position_html(ps: PositionScience) -> str:
    """The report.html section (charts as data URIs, then the tables)."""
    parts = ['<h2 id="position-science">Position science</h2>']
    parts.append('<p class="small muted">Beside the gate; it never changes the verdict.</p>')
    if ps.effective is not None:
        for pos in _positions(ps):
            png = base64.b64encode(render_curve_png(ps, pos)).decode("ascii")
            parts.append(
                f'<img class="heatmap" alt="accuracy by length at depth {html.escape(pos)}" '
                f'src="data:image/png;base64,{png}">'
            )
        parts.append("<h3>Effective length per depth</h3>")
        parts.append(_html_table(_EL_HEAD, _el_rows(ps)))
        parts += [f'<p class="small">{html.escape(line)}</p>' for line in definition_lines(ps.effective)]
    if ps.normalised is not None:
        parts.append("<h3>Control-normalised accuracy</h3>")
        parts.append(_html_table(_CNA_HEAD, _cna_rows(ps)))
    if ps.spacing is not None:
        parts.append("<h3>Evidence spacing</h3>")
        parts.append(f'<p class="small">{html.escape(_SPACING_NOTE)}</p>')
        parts.append(_html_table(_SPACING_HEAD, _spacing_rows(ps)))
    if ps.seeds > 1:
        parts.append(f"<h3>Repeat stability (pass^{ps.seeds})</h3>")
        parts.append(_html_table(_phk_head(ps.seeds), _phk_rows(ps)))
    parts += [f'<p class="small">{html.escape(n)}</p>' for n in ps.notes]
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------------
# junit.xml


def _effective_text(row: Mapping[str, Any]) -> str:
    estimate = row.get("estimate")
    if row.get("at_grid_top"):
        return f"≥{estimate}"
    return "below grid" if estimate == 0 else str(estimate)


def _property(parent: ET.Element, name: str, value: object) -> None:
    ET.SubElement(parent, "property", name=name, value=str(value))


def _properties_of(element: ET.Element) -> ET.Element:
    """``element``'s ``properties`` (created first when missing), without effective-length entries."""
    found = element.find("properties")
    if found is None:
        found = ET.Element("properties")
        element.insert(0, found)
    for old in [p for p in found if p.get("name", "").startswith("effective_length.")]:
        found.remove(old)
    return found


def add_junit_effective_length(root: ET.Element, position: Mapping[str, Any]) -> bool:
    """Add the effective length (``position["effective_length"]``, the verdict.json ``position`` value)
    to the junit.xml tree ``root``: suite ``depthgate.slices`` gets ``effective_length.<arm>.<position>``
    properties and the console's effective-length lines in its ``system-out``, every slice testcase
    ``effective_length.<arm>`` of its depth. Idempotent. False (nothing changed) without an effective
    length."""
    section = position.get("effective_length") or {}
    rows = [row for row in section.get("rows") or [] if row.get("arm") in ARMS]
    if not rows:
        return False
    text: dict[tuple[str, str], str] = {(str(r["arm"]), str(r["position"])): _effective_text(r) for r in rows}
    rule = str(rows[0].get("rule", ""))
    suite = root.find("testsuite[@name='depthgate.slices']")
    if suite is None:
        raise InputError(
            "junit.xml has no testsuite 'depthgate.slices'",
            fix="regenerate the reports with `depthgate gate RUN`",
        )
    suite_properties = _properties_of(suite)
    for (arm, pos), value in sorted(
        text.items(), key=lambda item: (item[0][0], position_sort_key(item[0][1]))
    ):
        _property(suite_properties, f"effective_length.{arm}.{pos}", f"{value} ({rule})")
    for case in suite.findall("testcase"):
        depth = next(
            (p.get("value") for p in case.iterfind("properties/property") if p.get("name") == "position"),
            None,
        )
        if depth is None:
            continue
        props = _properties_of(case)
        for arm in ARMS:
            if (arm, depth) in text:
                _property(props, f"effective_length.{arm}", f"{text[(arm, depth)]} ({rule})")
    lines = [
        f"effective length ({rule}), {arm}: "
        + ", ".join(
            f"{p}: {v}"
            for (a, p), v in sorted(text.items(), key=lambda i: position_sort_key(i[0][1]))
            if a == arm
        )
        for arm in ARMS
        if any(a == arm for a, _ in text)
    ]
    system_out = suite.find("system-out")
    if system_out is None:
        system_out = ET.SubElement(suite, "system-out")
    kept = [
        line for line in (system_out.text or "").splitlines() if not line.startswith("effective length (")
    ]
    system_out.text = "\n".join([*kept, *lines])
    return True


# --------------------------------------------------------------------------------------------------
# The section


def position_section(ctx: AnalysisContext) -> Section | None:
    """Effective length, control-normalised accuracy and pass^k of the run: verdict.json ``position``,
    a section of summary.md and report.html, the effective length in junit.xml (where CI dashboards read
    a nightly job). None (a note on stderr) when the numbers cannot be computed."""
    try:
        science = position_science(
            ctx.scored,
            ctx.plan,
            seeds=ctx.seeds,
            scored_controls=ctx.position_controls,
            layouts=spacing_layouts(ctx.run),
            base_scored=ctx.base_scored,
        )
    except InputError as exc:
        print(f"depthgate: position science not computed: {exc}", file=sys.stderr)
        return None
    data = science.to_dict()
    return Section(
        key="position",
        data=data,
        markdown=render_position_markdown(science),
        html=render_position_html(science),
        junit=functools.partial(add_junit_effective_length, position=data),
    )

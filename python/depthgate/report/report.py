"""Reports of a gate run, for machines and for people (DESIGN.md §8).

:func:`write_reports` writes, into one directory:

* ``verdict.json``: the verdict (PASS / FAIL / INCONCLUSIVE), the safety flag, the exit code, every slice
  row, the worst-position tables, the triage list, per-slice oracle counts and every digest of the run
  manifest. :class:`VerdictDocument` is its schema; :func:`load_verdict` reads and validates it.
* ``summary.md``: a pull-request comment: the verdict line, failing and inconclusive slices first, the
  worst positions, and per-slice counts of missing claims, wrong citations and system failures.
* ``junit.xml``: one testcase per slice (``failure`` for FAIL, ``skipped`` for INCONCLUSIVE), plus one
  safety testcase in a suite of its own, so CI dashboards show the gate like a test run.
* ``report.html``: a self-contained page (PNG heatmaps embedded as data URIs) with length x position grids
  of accuracy and of delta with its lower bound and FDR marks, a legend, the slice and worst-position
  tables, and the missing-claim, wrong-citation and system-failure lists. The PNGs are also written next
  to it (``heatmap_delta.png``, ``heatmap_accuracy.png``).

The gate's part and every analysis beside it (:class:`~depthgate.report.document.Section`, listed in
:mod:`depthgate.report.analyses`) make one document, rendered in memory once
(:func:`render_report_files`) and written as a set (:func:`depthgate.report.writer.write_report_set`: a
staging folder beside ``out_dir`` swapped in whole), one write per file; no file is re-read to be patched.
A failure while rendering or writing leaves ``out_dir`` as it was. Raw prompts never enter a report; model
outputs appear only through the oracle's one-sentence reasons, and the manifest contributes only its
digests and short scalar fields without secret-like names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.exceptions import ExitCode
from depthgate.judge.gate import GateResult
from depthgate.judge.health import InfraSummary, SystemCheckReport, assess, with_system_wording
from depthgate.report.chars import length_chars, run_layouts
from depthgate.report.document import SECTIONS_MARKER, Section
from depthgate.report.formatting import MARK_NI, MARK_REGRESSION, depth_label, slice_key
from depthgate.report.heatmaps import render_accuracy_heatmap, render_delta_heatmap
from depthgate.report.junit import junit_tree, render_junit
from depthgate.report.page import render_html
from depthgate.report.scored import oracle_counts
from depthgate.report.summary import render_summary
from depthgate.report.verdict import (
    HEATMAP_ACCURACY,
    HEATMAP_DELTA,
    JUNIT_XML,
    REPORT_HTML,
    SCHEMA_VERSION,
    SUMMARY_MD,
    VERDICT_JSON,
    LengthChars,
    OracleCounts,
    ReportInputs,
    VerdictDocument,
    VerdictSlice,
    build_verdict,
    exit_code_for,
    health_reasons,
    load_verdict,
    manifest_digests,
    render_verdict_json,
    verdict_name,
)
from depthgate.report.writer import write_report_set


@dataclass(frozen=True)
class ReportPaths:
    """Where :func:`write_reports` put each file, and the exit code the verdict document states."""

    exit_code: ExitCode
    out_dir: Path
    verdict_json: Path
    summary_md: Path
    junit_xml: Path
    report_html: Path
    heatmaps: tuple[Path, ...]


def _with_sections_html(page: str, sections: Sequence[Section]) -> str:
    """The sections' HTML at the template's :data:`SECTIONS_MARKER` (before ``</body>`` without one)."""
    extra = "".join(section.html for section in sections)
    if not extra:
        return page
    anchor = SECTIONS_MARKER if SECTIONS_MARKER in page else "</body>"
    return page.replace(anchor, extra + anchor, 1)


def render_report_files(inputs: ReportInputs, sections: Sequence[Section] = ()) -> dict[str, bytes]:
    """Every report file of the document (the gate's part and every section), rendered in memory."""
    result, health = inputs.result, inputs.health
    delta_png = render_delta_heatmap(result)
    accuracy_png = render_accuracy_heatmap(result)
    summary = render_summary(inputs) + "".join(section.markdown for section in sections)
    page = render_html(inputs, delta_png=delta_png, accuracy_png=accuracy_png)
    return {
        HEATMAP_DELTA: delta_png,
        HEATMAP_ACCURACY: accuracy_png,
        SUMMARY_MD: summary.encode("utf-8"),
        JUNIT_XML: render_junit(result, health, sections),
        REPORT_HTML: _with_sections_html(page, sections).encode("utf-8"),
        VERDICT_JSON: render_verdict_json(inputs, sections),
    }


def write_reports(
    result: GateResult,
    scored: pl.DataFrame,
    out_dir: str | Path,
    *,
    manifest: Mapping[str, Any],
    infra: InfraSummary | None = None,
    layouts: Mapping[str, str | Path] | None = None,
    checks: Mapping[str, SystemCheckReport] | None = None,
    sections: Sequence[Section] = (),
) -> ReportPaths:
    """Write verdict.json, summary.md, junit.xml, report.html and the heatmap PNGs into ``out_dir``.

    ``infra``: the planned-versus-recorded account of the run (:func:`depthgate.judge.health.infra_summary`);
    any lost run makes the verdict ``INFRA`` (exit 30). Failing slices driven by the candidate's system
    failures are named in every file (:func:`depthgate.judge.health.assess`), as FAIL_SYSTEM
    (:func:`depthgate.judge.health.with_system_wording`). ``checks``: the serving-path checks that ran
    (:mod:`depthgate.judge.health.serving`, by name); their findings make every slice at their length
    FAIL_SYSTEM, and their reports go to verdict.json ``serving_checks``.

    ``layouts``: arm → ``layouts.parquet``, for the length in characters (:func:`length_chars`) in every
    file but junit.xml; without it, the run folder's own layouts when ``out_dir`` is its ``report``
    folder (:func:`run_layouts`), else the section is left out.

    ``sections``: what the analyses beside the gate add (:mod:`depthgate.report.analyses`), rendered into
    the same files in the same single write.

    ``scored`` is the frame of :func:`depthgate.judge.scoring.score_records` (per-run oracle columns);
    ``manifest`` the run manifest (only its digests and short scalar fields are copied). The whole set is
    rendered in memory, then written once per file and swapped in as a set
    (:func:`depthgate.report.writer.write_report_set`): on any error ``out_dir`` keeps its previous set.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    findings = [f for report in (checks or {}).values() for f in report.findings]
    health = assess(result, scored, infra, findings)
    result = with_system_wording(result, health)
    if layouts is None:
        layouts = run_layouts(out, manifest)
    chars = None if layouts is None else length_chars(layouts)
    checked = None if not checks else {name: report.to_dict() for name, report in checks.items()}
    inputs = ReportInputs(result, scored, oracle_counts(scored), manifest, health, chars, checked)
    write_report_set(render_report_files(inputs, sections), out, commit=VERDICT_JSON)
    return ReportPaths(
        exit_code=exit_code_for(result, health),
        out_dir=out,
        verdict_json=out / VERDICT_JSON,
        summary_md=out / SUMMARY_MD,
        junit_xml=out / JUNIT_XML,
        report_html=out / REPORT_HTML,
        heatmaps=(out / HEATMAP_DELTA, out / HEATMAP_ACCURACY),
    )


__all__ = [
    "HEATMAP_ACCURACY",
    "HEATMAP_DELTA",
    "JUNIT_XML",
    "MARK_NI",
    "MARK_REGRESSION",
    "REPORT_HTML",
    "SCHEMA_VERSION",
    "SUMMARY_MD",
    "VERDICT_JSON",
    "LengthChars",
    "OracleCounts",
    "ReportInputs",
    "ReportPaths",
    "VerdictDocument",
    "VerdictSlice",
    "build_verdict",
    "depth_label",
    "exit_code_for",
    "health_reasons",
    "junit_tree",
    "length_chars",
    "load_verdict",
    "manifest_digests",
    "oracle_counts",
    "render_accuracy_heatmap",
    "render_delta_heatmap",
    "render_html",
    "render_junit",
    "render_report_files",
    "render_summary",
    "render_verdict_json",
    "run_layouts",
    "slice_key",
    "verdict_name",
    "write_reports",
]

"""The report document: what the gate and every analysis beside it contribute, before anything is written.

A gate run's report is one in-memory document: the gate's own part (:class:`ReportInputs`, rendered by
:mod:`depthgate.report.report`) plus one :class:`Section` per analysis that ran beside it (controls,
position science, noise floor …; :mod:`depthgate.report.analyses` lists them). One writer renders
verdict.json, summary.md, report.html and junit.xml from the whole document once and swaps them in as a
set (:mod:`depthgate.report.writer`); no report file is ever re-read to be patched.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

if TYPE_CHECKING:
    from depthgate.judge.gate import GatePlan
    from depthgate.spec.models import AnalysisPlan

#: Where analysis sections go in report.html (report.html.j2 holds this comment once).
SECTIONS_MARKER = "<!-- depthgate:sections -->"


@dataclass(frozen=True)
class Section:
    """One analysis's part of the report. ``key``: its verdict.json key (a field of
    :class:`~depthgate.report.report.VerdictDocument`) and ``data`` its JSON value; ``markdown`` is
    appended to summary.md, ``html`` goes at report.html's :data:`SECTIONS_MARKER`; ``junit`` edits the
    junit.xml tree (the root ``testsuites`` element) before it is serialised. ``console``: lines printed
    to stderr once the reports are written."""

    key: str
    data: Mapping[str, Any]
    markdown: str = ""
    html: str = ""
    junit: Callable[[ET.Element], object] | None = None
    console: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class AnalysisContext:
    """What the analyses beside the gate read: the run folder, its frozen plan and seeds, the scored
    records the gate saw (``scored``; spaced slices already restricted to multi-evidence cases), the
    scored controls (None when none ran), the cases the primary metric ``control_normalised`` kept
    (``eligibility``), the gate's plan for the A/A noise floor and whether the run is an A/A run."""

    run: Path
    plan: AnalysisPlan
    seeds: Sequence[int]
    scored: pl.DataFrame
    scored_controls: pl.DataFrame | None
    position_controls: pl.DataFrame | None
    eligibility: Mapping[str, Any] | None
    noise_plan: GatePlan
    aa: bool
    #: The look history of a ``stop_rule = "sequential"`` run (:mod:`depthgate.commands.sequential`).
    sequential: Mapping[str, Any] | None = None
    #: The scored records at the short lengths of NoLiMa's base score (issue #24; never gated), None when
    #: the run built none.
    base_scored: pl.DataFrame | None = None


#: An analysis: its section of the report, or None when it has nothing to add.
Analysis = Callable[[AnalysisContext], "Section | None"]

__all__ = ["SECTIONS_MARKER", "Analysis", "AnalysisContext", "Section"]

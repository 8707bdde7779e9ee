"""The analyses beside the gate, in report order: each returns its :class:`~depthgate.report.document.Section`
of the report (or None). Adding an analysis = one module with a ``section(ctx)`` function + one line here.
The order is the order of their sections in summary.md and report.html."""

from __future__ import annotations

from depthgate.report.controls import controls_section
from depthgate.report.document import Analysis, AnalysisContext, Section
from depthgate.report.noise import noise_floor_section
from depthgate.report.parity import parity_section
from depthgate.report.position import position_section
from depthgate.report.sequential import sequential_section

ANALYSES: tuple[Analysis, ...] = (
    parity_section,
    sequential_section,
    controls_section,
    position_section,
    noise_floor_section,
)


def collect_sections(ctx: AnalysisContext) -> list[Section]:
    """Every registered analysis's section of the run, in :data:`ANALYSES` order."""
    return [section for analysis in ANALYSES if (section := analysis(ctx)) is not None]


__all__ = ["ANALYSES", "collect_sections"]

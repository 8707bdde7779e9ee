"""The length × position heatmaps: Δ with its lower bound and FDR marks, and both arms' accuracy
(PNG bytes; report.html embeds them and they are written beside it)."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from depthgate.judge.gate import GateResult, SliceResult, SliceStatus, non_inferiority_shown
from depthgate.judge.tables import position_sort_key
from depthgate.report.formatting import MARK_NI, MARK_REGRESSION, depth_label, signed

_DPI = 110


@dataclass(frozen=True)
class _Grid:
    lengths: list[int]
    positions: list[str]
    cells: dict[tuple[int, str], SliceResult]

    def values(self, attribute: str) -> np.ndarray[Any, np.dtype[np.float64]]:
        out = np.full((len(self.lengths), len(self.positions)), np.nan)
        for (length, position), s in self.cells.items():
            value = getattr(s, attribute)
            if value is not None:
                out[self.lengths.index(length), self.positions.index(position)] = float(value)
        return out

    def each_cell(self) -> Iterator[tuple[int, int, SliceResult | None]]:
        """``(row, col, slice)`` for every cell, row by row; ``None`` where the grid has no slice."""
        for row, length in enumerate(self.lengths):
            for col, position in enumerate(self.positions):
                yield row, col, self.cells.get((length, position))


def _grid(result: GateResult) -> _Grid:
    cells = {(s.length, s.position): s for s in result.slice_results}
    lengths = sorted({s.length for s in result.slice_results})
    positions = sorted({s.position for s in result.slice_results}, key=position_sort_key)
    return _Grid(lengths, positions, cells)


def _text_color(rgba: tuple[float, float, float, float]) -> str:
    r, g, b, _ = rgba
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _axes_labels(ax: Any, grid: _Grid) -> None:
    ax.set_xticks(range(len(grid.positions)), labels=[depth_label(p) for p in grid.positions])
    ax.set_yticks(range(len(grid.lengths)), labels=[f"{length:,}" for length in grid.lengths])
    ax.set_xlabel("evidence depth (0% = start of the context, 100% = end)")
    ax.set_ylabel("total length (tokens)")
    ax.tick_params(length=0)
    ax.set_xticks(np.arange(-0.5, len(grid.positions)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(grid.lengths)), minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _centred(ax: Any, row: float, col: int, text: str, **style: Any) -> None:
    """``text`` centred on the cell at ``row``, ``col`` (a fractional row moves it up or down)."""
    ax.text(col, row, text, ha="center", va="center", **style)


def _slice_cells(ax: Any, grid: _Grid) -> Iterator[tuple[int, int, SliceResult]]:
    """The grid's cells that hold a slice; a cell without one is labelled "no slice" on ``ax``."""
    for row, col, s in grid.each_cell():
        if s is None:
            _centred(ax, row, col, "no slice", fontsize=8, color="#777777")
        else:
            yield row, col, s


def _inconclusive_cell(ax: Any, row: int, col: int, label: str) -> None:
    """The cell hatched grey, ``label`` on a grey box in its middle."""
    ax.add_patch(
        Rectangle(
            (col - 0.5, row - 0.5), 1, 1, facecolor="#e6e6e6", edgecolor="#9a9a9a", hatch="///", linewidth=0
        )
    )
    _centred(
        ax,
        row,
        col,
        label,
        fontsize=8,
        color="#333333",
        bbox={"facecolor": "#e6e6e6", "edgecolor": "none", "pad": 1.5},
    )


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI, metadata={"Software": None})
    return buffer.getvalue()


def _fig_size(grid: _Grid, panels: int) -> tuple[float, float]:
    width = panels * (1.2 * len(grid.positions) + 1.6) + 1.4
    height = 0.95 * len(grid.lengths) + 2.0
    return max(width, 6.0), max(height, 3.2)


def delta_limit(result: GateResult) -> float:
    """Half-width of the symmetric Δ colour scale: covers every tested Δ and finite lower bound, at
    least 2M, rounded up to 0.05 and at most 1."""
    spread = [2 * result.plan.margin]
    for s in result.slice_results:
        if s.lower is None:
            continue
        spread += [abs(v) for v in (s.delta, s.lower) if v is not None and math.isfinite(v)]
    return min(math.ceil(max(spread) * 20 - 1e-9) / 20, 1.0)


def render_delta_heatmap(result: GateResult) -> bytes:
    """Δ (candidate − baseline) per slice, its lower bound, FDR marks, INCONCLUSIVE cells hatched."""
    grid = _grid(result)
    plan = result.plan
    delta = grid.values("delta")
    tested = np.array(
        [
            [
                grid.cells.get((length, p)) is not None and grid.cells[(length, p)].lower is not None
                for p in grid.positions
            ]
            for length in grid.lengths
        ],
        dtype=bool,
    ).reshape(len(grid.lengths), len(grid.positions))
    limit = delta_limit(result)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-limit, vmax=limit)
    fig = Figure(figsize=_fig_size(grid, 1), layout="constrained")
    ax = fig.add_subplot()
    shown = np.where(tested, delta, np.nan)
    image = ax.imshow(shown, cmap="RdBu", norm=norm, aspect="auto", origin="lower")
    cmap = image.get_cmap()
    for row, col, s in _slice_cells(ax, grid):
        if s.status is SliceStatus.INCONCLUSIVE or s.lower is None:
            detail = f"\nΔ {signed(s.delta)}" if s.delta is not None else ""
            _inconclusive_cell(ax, row, col, f"INCONCLUSIVE\n{s.n_cases} cases{detail}")
            continue
        color = _text_color(cmap(norm(float(s.delta if s.delta is not None else 0.0))))
        marks = ""
        if s.status is SliceStatus.FAIL_REGRESSION:
            marks += f" {MARK_REGRESSION}"
        if non_inferiority_shown(s, plan.margin):
            marks += f" {MARK_NI}"
        _centred(
            ax, row + 0.12, col, f"Δ {signed(s.delta)}{marks}", fontsize=10, fontweight="bold", color=color
        )
        _centred(ax, row - 0.2, col, f"LB {signed(s.lower)}", fontsize=9, color=color)
        if s.status.value.startswith("FAIL"):
            ax.add_patch(
                Rectangle((col - 0.46, row - 0.46), 0.92, 0.92, fill=False, edgecolor="black", linewidth=2.5)
            )
    _axes_labels(ax, grid)
    ax.set_title(
        f"Δ accuracy, candidate − baseline (LB = one-sided {100 * (1 - plan.look_alpha):g}% lower bound; "
        f"fails if LB ≤ −{plan.margin:g})",
        fontsize=10,
    )
    bar = fig.colorbar(image, ax=ax, shrink=0.9, pad=0.02)
    bar.set_label("Δ accuracy (red: worse, blue: better)")
    bar.ax.axhline(-plan.margin, color="black", linewidth=1.5, linestyle="--")
    bar.ax.text(1.6, -plan.margin, "−M", transform=bar.ax.get_yaxis_transform(), va="center", fontsize=8)
    return _png(fig)


def render_accuracy_heatmap(result: GateResult) -> bytes:
    """Baseline and candidate accuracy per slice on one 0-1 scale."""
    grid = _grid(result)
    width, _ = _fig_size(grid, 1)
    fig = Figure(figsize=(width, max(2 * 0.75 * len(grid.lengths) + 2.4, 4.5)), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    norm = Normalize(vmin=0.0, vmax=1.0)
    image = None
    for ax, (arm, attribute) in zip(
        axes, (("Baseline", "acc_baseline"), ("Candidate", "acc_candidate")), strict=True
    ):
        values = grid.values(attribute)
        image = ax.imshow(values, cmap="viridis", norm=norm, aspect="auto", origin="lower")
        cmap = image.get_cmap()
        for row, col, s in _slice_cells(ax, grid):
            value = getattr(s, attribute)
            if s.status is SliceStatus.INCONCLUSIVE:
                acc = f", acc {value:.2f}" if value is not None else ""
                _inconclusive_cell(ax, row, col, f"INCONCLUSIVE\n{s.n_cases} cases{acc}")
            elif value is not None:
                _centred(ax, row, col, f"{value:.2f}", fontsize=10, color=_text_color(cmap(norm(value))))
        _axes_labels(ax, grid)
        ax.set_title(f"{arm} accuracy", fontsize=10)
    axes[0].set_xlabel("")
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.9, pad=0.02, label="accuracy (share of runs passing)")
    return _png(fig)

"""The serving-path checks beside a run (:mod:`depthgate.judge.health`), wired into ``run`` and ``gate``.

``run``: per arm, the full-length canaries (``matrix.canaries`` per length and kind,
:mod:`depthgate.run.canary`) are built into ``RUN/<arm>/canaries.parquet`` beside the layouts, through
the same pre-send gate, and sent after the matrix and its controls into ``RUN/canaries/``.
``gate``: every registered check whose records are in the run folder is judged; its report goes to
:func:`depthgate.report.report.write_reports`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from depthgate.judge.health import SystemCheckReport, checks
from depthgate.layout.layouts import BuildOptions, Tokenizer, read_layouts
from depthgate.spec.canaries import canary_cases

if TYPE_CHECKING:
    from depthgate.run.store import LayoutStore

__all__ = ["canary_jobs", "check_reports"]

ARMS = ("baseline", "candidate")


def canary_jobs(
    arm: str,
    count: int,
    tokenizer: Tokenizer,
    options: BuildOptions,
    arm_dir: Path,
    guard: Callable[..., pl.DataFrame],
    rows: Callable[[Path, Callable[[pl.DataFrame], pl.DataFrame]], list[dict[str, Any]]],
    store: Callable[[Path, Path], LayoutStore],
) -> tuple[list[tuple[str, Mapping[str, Any]]], LayoutStore]:
    """The arm's canary jobs (built once into ``arm_dir/canaries.parquet``, through ``guard`` with the
    canary cases) and their layout store. ``rows`` and ``store`` are the pipeline's own helpers."""
    from depthgate.run.canary import CANARIES_FILE, CANARY_FRAME, build_canaries

    path = arm_dir / CANARIES_FILE
    if not path.is_file():
        build_canaries(tokenizer, options, count, path)
    # The canaries' frame is the arm's template with the content held fixed (run/canary.py).
    checked = functools.partial(guard, cases={c.id: c for c in canary_cases(count)}, **CANARY_FRAME)
    jobs: list[tuple[str, Mapping[str, Any]]] = [(arm, row) for row in rows(path, checked)]
    return jobs, store(path, arm_dir / "canaries-store")


def check_reports(run: Path) -> dict[str, SystemCheckReport]:
    """Every registered serving-path check whose records are in ``run`` (``RUN/<name>/``), judged."""
    from depthgate.run.records import read_records

    out: dict[str, SystemCheckReport] = {}
    for name, check in checks().items():
        if not (run / name).is_dir():
            continue
        records = read_records(run / name)
        files = [run / arm / f"{name}.parquet" for arm in ARMS]
        if records.height == 0 or not all(f.is_file() for f in files):
            continue
        layouts = pl.concat([read_layouts(f, columns=["layout_id", "evidence_spans"]) for f in files])
        out[name] = check(records, layouts)
    return out

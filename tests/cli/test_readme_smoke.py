"""The README's smoke result is re-derived from the shipped run behind it.

docs/smoke-run/ is the main job's run (`bash scripts/demo.sh`: matrices/smoke.toml on the embedded
default, Gemma-3-270M in llama.cpp; records, layouts, scored.parquet, controls and reports, without
report.html). tests/cli/test_shipped_runs.py re-gates it byte for byte; here `depthgate gate` on a copy
must print the README's console block line for line, and the per-depth pass counts and base scores the
README quotes must be those of the run's scored.parquet and summary.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl

from helpers import REPO

README = REPO / "README.md"
SMOKE = REPO / "docs" / "smoke-run"
DEPTHS = ("0", "0.25", "0.5", "0.75", "1")


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def readme_block(text: str) -> list[str]:
    """The fenced block of the README that starts with the verdict line."""
    found = re.search(r"```\n(verdict: .*?)```", text, re.S)
    assert found, "README.md: no ``` block starting with 'verdict: '"
    return found.group(1).splitlines()


def _gate_lines(folder: Path, tmp_path: Path, records: pl.DataFrame | None = None) -> list[str]:
    """What `depthgate gate runs/smoke` prints on a copy of ``folder`` (its reports removed;
    ``records``: written over the copy's records.parquet)."""
    copy = tmp_path / "runs" / "smoke"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / "report")
    if records is not None:
        records.write_parquet(copy / "records.parquet")
    done = subprocess.run(
        [sys.executable, "-m", "depthgate", "gate", "runs/smoke"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 10, done.stderr[-2000:]  # FAIL: the README's "exit 10"
    return done.stdout.splitlines()


def test_gate_on_the_shipped_smoke_run_prints_the_readme_block(tmp_path: Path) -> None:
    assert _gate_lines(SMOKE, tmp_path) == readme_block(_readme())


def test_one_changed_answer_makes_another_block(tmp_path: Path) -> None:
    """Fault injection: one baseline answer at depth 1 that passed, replaced by an abstention in a copy
    of the records, changes what gate prints (the README block would be stale)."""
    records = pl.read_parquet(SMOKE / "records.parquet")
    scored = pl.read_parquet(SMOKE / "scored.parquet")
    passed = scored.filter(
        (pl.col("arm") == "baseline")
        & (pl.col("length") == 1024)
        & (pl.col("position") == "1")
        & (pl.col("outcome") == "pass")
    )["layout_id"][0]
    hit = (pl.col("arm") == "baseline") & (pl.col("layout_id") == passed)
    assert records.filter(hit).height == 1
    changed = records.with_columns(
        pl.when(hit).then(pl.lit("not stated")).otherwise(pl.col("output_text")).alias("output_text")
    )
    assert _gate_lines(SMOKE, tmp_path, changed) != readme_block(_readme())


def _passes(scored: pl.DataFrame, arm: str) -> list[int]:
    at = scored.filter((pl.col("arm") == arm) & (pl.col("length") == 1024))
    return [at.filter((pl.col("position") == d) & (pl.col("outcome") == "pass")).height for d in DEPTHS]


def test_the_readme_pass_counts_by_depth_are_the_runs() -> None:
    scored = pl.read_parquet(SMOKE / "scored.parquet")
    found = re.search(
        r"baseline passes by depth 0/\.25/\.5/\.75/1: ([\d, ]+) of 8[^;]*; candidate ([\d, ]+) of 8",
        " ".join(_readme().split()),
    )
    assert found, "README.md: the smoke run's pass counts by depth are not quoted"
    quoted = [[int(x) for x in group.split(", ")] for group in found.groups()]
    assert quoted == [_passes(scored, "baseline"), _passes(scored, "candidate")]
    assert {scored.filter(pl.col("length") == 1024).group_by("arm", "position").len()["len"].max()} == {8}


def test_the_readme_base_scores_are_the_runs_summary() -> None:
    summary = (SMOKE / "report" / "summary.md").read_text(encoding="utf-8")
    found = re.search(
        r"summary\.md: baseline (\S+ \[\S+, \S+\]), candidate (\S+ \[\S+, \S+\])", " ".join(_readme().split())
    )
    assert found, "README.md: the smoke run's base scores are not quoted"
    for arm, quoted in zip(("baseline", "candidate"), found.groups(), strict=True):
        assert f"Base score, {arm}: {quoted} " in summary

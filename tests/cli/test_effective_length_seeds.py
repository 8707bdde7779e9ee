"""Effective-length intervals that do not move with the bootstrap seed (issue #39 item 2).

With the plain percentile rule at the plan's B = 1,999 the shipped showcase's baseline upper end at depth
0.25 read 768 at seed 0 and ≥1024 at 6 of seeds 1-9 (its tail share is 0.0251, on alpha/2 itself).
The report's intervals now use B >= EL_RESAMPLES and ends guarded by MC_Z Monte-Carlo standard errors
(depthgate.judge.science.length); scripts/effective_length_seeds.py measures every shipped run folder
(docs/effective-length-seeds.jsonl). Here: the showcase, recomputed as the report computes it, gives the
shipped intervals at 10 seeds, and its summary.md states the definition beside NoLiMa's and RULER's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from depthgate.judge.science import EL_RESAMPLES, MC_Z, effective_length, mc_margin

REPO = Path(__file__).resolve().parents[2]
SHOWCASE = REPO / "docs" / "position-showcase"
LONG = REPO / "docs" / "position-long"  # issue #39: 512 → 8K, effective lengths inside the grid


def _intervals(result: Any) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {f"{r.arm}@{r.position}": (r.lower, r.upper) for r in result.rows}
    for d in result.deltas:
        out[f"delta@{d.position}"] = (d.lower, d.upper, d.lower_steps, d.upper_steps)
    return out


def _showcase(seed: int, folder: Path = SHOWCASE) -> Any:
    """A showcase's effective lengths as the report computes them (NoLiMa, base at the short lengths)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    plan = manifest["plan"]
    scored = pl.read_parquet(folder / "scored.parquet")
    assert plan.get("stop_rule", "fixed") == "fixed"  # the report's alpha is then the plan's
    return effective_length(
        scored.filter(pl.col("length").is_in(manifest["lengths"])),
        base_records=scored.filter(pl.col("length").is_in(plan["base_lengths"])),
        rule=plan.get("effective_length_rule", "nolima"),
        threshold=plan.get("effective_length_threshold", 0.85),
        reps=max(plan["bootstrap_resamples"], EL_RESAMPLES),
        alpha=plan["alpha"],
        seed=seed,
    )


@pytest.mark.parametrize("folder", [SHOWCASE, LONG], ids=lambda p: p.name)
def test_showcase_intervals_are_the_same_at_ten_seeds(folder: Path) -> None:
    if not (folder / "manifest.json").is_file():
        pytest.skip(f"no shipped {folder.name}")
    shipped = json.loads((folder / "report" / "verdict.json").read_text())["position"]["effective_length"]
    assert shipped["reps"] == EL_RESAMPLES
    first = _showcase(0, folder)
    expected = {f"{r['arm']}@{r['position']}": (r["lower"], r["upper"]) for r in shipped["rows"]}
    expected.update(
        {
            f"delta@{d['position']}": (d["lower"], d["upper"], d["lower_steps"], d["upper_steps"])
            for d in shipped["deltas"]
        }
    )
    assert _intervals(first) == expected  # the recomputation is the report's
    # The long run: its 10 (arm, depth) intervals hold at seeds 0-9; its delta@0.25 upper end does not
    # (2048 or 3072 tokens: a tail share on the guard's own cut), and at seeds 10-19 neither does the
    # baseline's depth 0.75 (docs/effective-length-seeds.jsonl, docs/position.md): what is checked here
    # is what holds, the rest is reported.
    keep = (lambda key: True) if folder == SHOWCASE else (lambda key: not key.startswith("delta"))
    expected = {k: v for k, v in expected.items() if keep(k)}
    for seed in range(1, 10):
        got = {k: v for k, v in _intervals(_showcase(seed, folder)).items() if keep(k)}
        assert got == expected, seed
    if folder == SHOWCASE:  # the interval the audit saw move: the guard keeps ≥1024 (tail share 0.025)
        assert expected["baseline@0.25"] == (0, 1024)


def test_the_guard_is_three_standard_errors_of_a_tail_share() -> None:
    assert mc_margin(0.05, EL_RESAMPLES) == pytest.approx(MC_Z * math.sqrt(0.025 * 0.975 / EL_RESAMPLES))
    assert mc_margin(0.05, EL_RESAMPLES) < 0.0022


@pytest.mark.skipif(not (SHOWCASE / "manifest.json").is_file(), reason="no shipped showcase")
def test_summary_states_the_definition_beside_nolima_and_ruler() -> None:
    summary = (SHOWCASE / "report" / "summary.md").read_text(encoding="utf-8")
    assert (
        "Definition: depthgate reads the effective length of a depth as the longest grid length L such "
        "that the accuracy of the depth at L and at every shorter grid length is ≥ 0.85 × the base score "
        "of the arm (the NoLiMa rule)" in summary
    )
    assert "Effective length in NoLiMa: the longest length at which the score stays ≥ 85 % of the" in summary
    assert "in RULER: the longest length at which the score stays above a fixed threshold" in summary
    assert f"B = {EL_RESAMPLES}" in summary

"""docs/position.md's numbers come from shipped files (issue #24): every table line of the page that
quotes the showcase run is rebuilt here from docs/position-showcase (verdict.json and scored.parquet,
which tests/test_shipped_runs.py re-gates byte for byte), the RULER rule is recomputed from
scored.parquet, and the corrected noise-floor example is recomputed from the old example's shipped
summary. ``python tests/cli/test_position_docs.py [FOLDER]`` prints the lines for the page.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest

REPO = Path(__file__).resolve().parents[2]
SHOWCASE = REPO / "docs" / "position-showcase"
LONG = REPO / "docs" / "position-long"  # issue #39: 512 → 8K
LONG_16K = REPO / "docs" / "position-long-16k"  # issue #39: the 16K slice at depth .5
CONFLICT = REPO / "docs" / "conflict-embedded"
SPACING = REPO / "docs" / "position-spacing"
DOC = REPO / "docs" / "position.md"
RULER_THRESHOLD = 0.856  # RULER: Llama-2-7B's accuracy at 4K
_STATUS = {
    "PASS": "PASS",
    "FAIL_NOT_SHOWN": "not shown",
    "FAIL_REGRESSION": "**REGRESSION**",
    "INCONCLUSIVE": "inconcl.",
}


def _grid_value(tokens: int, grid: list[int], at_top: bool = False) -> str:
    if tokens == 0:
        return f"<{grid[0]}"
    return f"≥{tokens}" if at_top else str(tokens)


def gate_lines(verdict: dict[str, Any]) -> list[str]:
    """Per depth: per length "baseline → candidate (status)"."""
    slices = verdict["slices"]
    lengths = sorted({s["length"] for s in slices})
    depths = sorted({s["position"] for s in slices}, key=float)
    by = {(s["length"], s["position"]): s for s in slices}
    out = ["| depth | " + " | ".join(f"{length}" for length in lengths) + " |"]
    for d in depths:
        cells = []
        for length in lengths:
            s = by[(length, d)]
            cells.append(f"{s['acc_baseline']:.2f} → {s['acc_candidate']:.2f} {_STATUS[s['status']]}")
        out.append(f"| {d} | " + " | ".join(cells) + " |")
    return out


def base_lines(el: dict[str, Any]) -> list[str]:
    out = []
    for b in el.get("base") or []:
        per = ", ".join(f"{length}: {acc:.2f} ({n} cases)" for length, acc, n in b["per_length"])
        out.append(
            f"| {b['arm']} | {b['accuracy']:.2f} [{b['lower']:.2f}, {b['upper']:.2f}] | {b['n_cases']} | "
            f"{b['runs']} | {b['design_effect']:.2f} | {per} | {0.85 * b['accuracy']:.3f} |"
        )
    for a in el.get("above_base") or []:
        out.append(
            f"| {a['arm']} | {a['length']} | {a['accuracy']:.2f} | {a['base']:.2f} | {a['base_upper']:.2f} |"
        )
    return out


def _el_cell(row: dict[str, Any]) -> str:
    grid = row["grid"]
    est = _grid_value(row["estimate"], grid, row["at_grid_top"])
    lo = _grid_value(row["lower"], grid, row["lower"] == grid[-1])  # the grid's top is censored
    hi = _grid_value(row["upper"], grid, row["upper"] == grid[-1])
    return f"{est} [{lo}, {hi}]"


def el_lines(nolima: dict[str, Any], ruler: dict[str, Any]) -> list[str]:
    """Per depth: each arm's effective length [95 % interval] under NoLiMa (the shipped verdict) and
    RULER (recomputed)."""
    rows = {(r["arm"], r["position"], "nolima"): r for r in nolima["rows"]}
    rows.update({(r["arm"], r["position"], "ruler"): r for r in ruler["rows"]})
    depths = sorted({r["position"] for r in nolima["rows"]}, key=float)
    out = []
    for d in depths:
        cells = [
            _el_cell(rows[(arm, d, rule)])
            for rule in ("nolima", "ruler")
            for arm in ("baseline", "candidate")
        ]
        out.append(f"| {d} | " + " | ".join(cells) + " |")
    return out


def ruler_result(folder: Path) -> dict[str, Any]:
    from depthgate.judge.science import EL_RESAMPLES, effective_length

    manifest = json.loads((folder / "manifest.json").read_text())
    plan = manifest["plan"]
    scored = pl.read_parquet(folder / "scored.parquet").filter(pl.col("length").is_in(manifest["lengths"]))
    result = effective_length(
        scored,
        rule="ruler",
        threshold=RULER_THRESHOLD,
        seed=plan["bootstrap_seed"],
        reps=max(plan["bootstrap_resamples"], EL_RESAMPLES),  # the report's B
        alpha=0.05,
    )
    return result.to_dict()


def measured_lines(folder: Path) -> list[str]:
    """Per length: requests sent, mean and max seconds per request, mean prompt tokens reused from the
    previous request (prefix reuse); then the span from the first to the last record."""
    records = pl.read_parquet(folder / "records.parquet")
    sent = records.filter(pl.col("status") != "infra_error")
    out = []
    for row in (
        sent.group_by("target_tokens")
        .agg(
            pl.len().alias("n"),
            pl.col("latency_s").mean().alias("mean"),
            pl.col("latency_s").max().alias("max"),
            pl.col("prefix_cache_hit_tokens").mean().alias("reused"),
        )
        .sort("target_tokens")
        .iter_rows(named=True)
    ):
        cells = [
            row["target_tokens"],
            row["n"],
            f"{row['mean']:.1f}",
            f"{row['max']:.1f}",
            f"{row['reused']:.0f}",
        ]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    times = records["completed_at"].sort()
    span = (times[-1] - times[0]).total_seconds() / 60
    out.append(f"{records.height} requests recorded over {span:.0f} min of wall time")
    return out


def page_lines(folder: Path = SHOWCASE) -> list[str]:
    verdict = json.loads((folder / "report" / "verdict.json").read_text())
    el = verdict["position"]["effective_length"]
    return [
        *measured_lines(folder),
        *gate_lines(verdict),
        *base_lines(el),
        *el_lines(el, ruler_result(folder)),
    ]


def inside_grid(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The effective lengths that are measured: a point estimate on the grid and not censored at its
    top ("<512" is 0, "≥8192" is flagged ``at_grid_top``)."""
    return [r for r in rows if r["estimate"] >= r["grid"][0] and not r["at_grid_top"]]


def long_lines(folder: Path = LONG, folder_16k: Path = LONG_16K) -> list[str]:
    """The long showcase's tables (as :func:`page_lines`), the 16K run's cost and slice, and the count
    of measured effective lengths under each rule."""
    verdict = json.loads((folder / "report" / "verdict.json").read_text())
    nolima = verdict["position"]["effective_length"]["rows"]
    ruler = ruler_result(folder)["rows"]
    v16 = json.loads((folder_16k / "report" / "verdict.json").read_text())
    inside = len(inside_grid(nolima)) + len(inside_grid(ruler))
    return [
        *page_lines(folder),
        *measured_lines(folder_16k),
        *gate_lines(v16),
        f"{inside} of {len(nolima) + len(ruler)} effective lengths are measured inside the grid "
        f"({len(inside_grid(nolima))} of {len(nolima)} under NoLiMa, {len(inside_grid(ruler))} of "
        f"{len(ruler)} under RULER)",
    ]


_CURVE = re.compile(r'alt="accuracy by length at depth ([^"]+)" src="data:image/png;base64,([^"]+)"')


def curve_pngs(folder: Path, work: Path) -> dict[str, bytes]:
    """The accuracy-by-length charts (one per depth) of the report.html that `depthgate gate` writes for a
    copy of ``folder``: the pictures docs/position.md shows."""
    copy = work / folder.name
    shutil.copytree(folder, copy)
    done = subprocess.run(
        [sys.executable, "-m", "depthgate", "gate", str(copy)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode in (0, 10, 11, 12, 13), done.stderr[-2000:]
    page = (copy / "report" / "report.html").read_text(encoding="utf-8")
    return {depth: base64.b64decode(data) for depth, data in _CURVE.findall(page)}


def figure(depth: str) -> Path:
    return REPO / "docs" / f"position-long-depth-{depth}.png"


def conflict_lines(folder: Path = CONFLICT) -> list[str]:
    """The conflict section's answer table, counted from the shipped run's ``scored.parquet`` at the
    gated length: a pass gives every value (or abstains); a fail that names a forbidden claim or no
    source's value gave a value no source states; one missing source claim means the other was given."""
    manifest = json.loads((folder / "manifest.json").read_text())
    scored = pl.read_parquet(folder / "scored.parquet").filter(
        (pl.col("status") == "ok") & pl.col("length").is_in(manifest["lengths"])
    )
    counts = {}
    for arm in ("baseline", "candidate"):
        c = dict.fromkeys(("all", "abstain", "first", "second", "unstated", "none"), 0)
        for row in scored.filter(pl.col("arm") == arm).iter_rows(named=True):
            missing = set(row["missing_claims"])
            if row["outcome"] == "pass":
                key = "abstain" if row["abstained"] else "all"
            elif row["forbidden_hits"] or row["score_reason"].startswith("Gave "):
                key = "unstated"
            elif missing in ({"source_a"}, {"source_b"}):
                key = "second" if missing == {"source_a"} else "first"
            else:
                key = "none"
            c[key] += 1
        counts[arm] = c
    b, k = counts["baseline"], counts["candidate"]
    return [
        f"| every conflicting value (pass) | {b['all']} | {k['all']} |",
        f"| an abstention or a flag of the disagreement (pass) | {b['abstain']} | {k['abstain']} |",
        "| one source's value (fails, the other source's claim named missing) | "
        f"{b['first'] + b['second']} (first source {b['first']}, second {b['second']}) | "
        f"{k['first'] + k['second']} (first {k['first']}, second {k['second']}) |",
        f"| a value no source states (a distractor's or another) | {b['unstated']} | {k['unstated']} |",
        f'| no value at all (e.g. "the IT team.") | {b["none"]} | {k["none"]} |',
    ]


def spacing_lines(folder: Path = SPACING) -> list[str]:
    """The spacing section's table from the shipped verdict (``position.spacing``): the measured gap range
    per spacing in the header, per depth the baseline's two-evidence accuracy at each spacing and the
    candidate's, which the page gives once because it is the same at every spacing."""
    verdict = json.loads((folder / "report" / "verdict.json").read_text())
    rows = verdict["position"]["spacing"]
    gaps = {r["spacing"]: (r["gap_min"], r["gap_max"]) for r in rows}
    out = [
        f"| depth | baseline adjacent | near (gap {gaps['near'][0]}–{gaps['near'][1]}) | "
        f"far (gap {gaps['far'][0]}–{gaps['far'][1]}) | query-first candidate, every spacing |"
    ]
    for depth in sorted({r["depth"] for r in rows}, key=float):
        at = {(r["arm"], r["spacing"]): r["accuracy_multi"] for r in rows if r["depth"] == depth}
        (candidate,) = {at[("candidate", sp)] for sp in ("adjacent", "near", "far")}
        cells = [f"{at[('baseline', sp)]:.2f}" for sp in ("adjacent", "near", "far")]
        out.append(f"| {depth} | " + " | ".join(cells) + f" | {candidate:.2f} |")
    return out


def noise_example() -> tuple[float, float, float]:
    """The old example's A/A design (docs/position-embedded: 12 cases x 10 slices x 1 seed, 0 flips in
    120 paired runs), each slice's baseline passes read from its shipped summary.md: the clustered exact
    upper bound of the flip rate, and the A/A pass margin at the plan's 0.8 with its probability."""
    from depthgate.judge.science import AaCase, aa_release_margin

    summary = (REPO / "docs" / "position-embedded" / "summary.md").read_text()
    rows = re.findall(r"\| `(\d+)/([\d.]+)` \| \w+ \| 12 \| ([\d.]+) \|", summary)
    passing = {(int(length), depth): round(12 * float(acc)) for length, depth, acc in rows}
    assert len(passing) == 10
    slices = [[AaCase(1, 0, 2)] * k + [AaCase(1, 0, 0)] * (12 - k) for _, k in sorted(passing.items())]
    # The upper bound's clusters: each of the 12 cases over its 10 slices (the passes are not used there).
    clusters = [AaCase(10, 0, 0)] * 12
    margin = aa_release_margin(
        slices, seeds=1, alpha=0.05, target=0.8, sims=200, bootstrap_resamples=999, clusters=clusters
    )
    return margin.flip_rate_upper, margin.margin, margin.pass_probability


@pytest.mark.skipif(not (SHOWCASE / "manifest.json").is_file(), reason="no shipped showcase")
def test_every_showcase_number_on_the_page_comes_from_the_shipped_folder() -> None:
    page = DOC.read_text(encoding="utf-8")
    missing = [line for line in page_lines() if line not in page]
    assert not missing, "\n".join(missing)


@pytest.mark.skipif(
    not (LONG / "manifest.json").is_file() or not (LONG_16K / "manifest.json").is_file(),
    reason="no shipped long showcase",
)
def test_every_long_showcase_number_on_the_page_comes_from_the_shipped_folders() -> None:
    page = DOC.read_text(encoding="utf-8")
    missing = [line for line in long_lines() if line not in page]
    assert not missing, "\n".join(missing)


@pytest.mark.skipif(not (LONG / "manifest.json").is_file(), reason="no shipped long showcase")
def test_the_pages_accuracy_charts_are_the_reports(tmp_path: Path) -> None:
    charts = curve_pngs(LONG, tmp_path)
    manifest = json.loads((LONG / "manifest.json").read_text())
    assert len(charts) == len(manifest["positions"])  # one chart per depth
    page = DOC.read_text(encoding="utf-8")
    for depth, png in charts.items():
        assert figure(depth).read_bytes() == png, depth
        assert f"]({figure(depth).name})" in page, depth


def test_the_conflict_answer_table_comes_from_the_shipped_run() -> None:
    lines = conflict_lines()
    assert sum(int(line.split(" | ")[1].split()[0]) for line in lines) == 72  # every baseline record
    page = DOC.read_text(encoding="utf-8")
    missing = [line for line in lines if line not in page]
    assert not missing, "\n".join(missing)


def test_the_spacing_table_comes_from_the_shipped_run() -> None:
    page = DOC.read_text(encoding="utf-8")
    missing = [line for line in spacing_lines() if line not in page]
    assert not missing, "\n".join(missing)


def test_the_noise_floor_example_is_the_upper_bound_and_the_aa_pass_margin() -> None:
    upper, margin, prob = noise_example()
    # 0 flips in 12 cases x 10 slices, a case over every slice one cluster (issue #39 item 5): exact
    # one-sided 95 % bound 1 - 0.05 ** (1 / 12) (no flip: the design effect is the 10 runs per case)
    assert upper == pytest.approx(1 - 0.05 ** (1 / 12)) and round(upper, 3) == 0.221
    # The shipped A/A run of that design (docs/position-aa, re-gated byte for byte by
    # test_shipped_runs.py) says the same three numbers from its own records.
    verdict = REPO / "docs" / "position-aa" / "report" / "verdict.json"
    shipped = json.loads(verdict.read_text())["noise_floor"]
    assert (shipped["flips"], shipped["paired_runs"]) == (0, 120)
    assert shipped["flip_rate_upper_clustered"] == pytest.approx(upper)
    assert (shipped["recommended_margin"], shipped["pass_probability"]) == (margin, prob)
    page = DOC.read_text(encoding="utf-8")
    assert f"upper bound {upper:.3f}" in page and f"margin {margin:.2f}" in page
    assert f"probability {prob:.2f}" in page
    assert margin > 0.10  # above the plan's margin: why the A/A run FAILs


if __name__ == "__main__":
    if sys.argv[1:2] == ["--long"]:  # the long showcase's lines, and its charts written into docs/
        print("\n".join(long_lines()))
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            for depth, png in curve_pngs(LONG, Path(work)).items():
                figure(depth).write_bytes(png)
        sys.exit(0)
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else SHOWCASE
    print("\n".join(page_lines(folder)))
    print("\n".join(conflict_lines()))
    print("\n".join(spacing_lines()))
    if len(sys.argv) <= 1 or "--noise" in sys.argv:
        print(noise_example())

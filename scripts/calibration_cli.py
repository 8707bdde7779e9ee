"""What the two calibration scripts (gate_calibration.py, sequential_calibration.py) share: the grid
options, the resumable JSONL of finished cells, and the marked block of docs/gate-calibration.md that a
``--render`` rewrites."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gate-calibration.md"


def grid_parser(
    doc: str | None, results: Path, *, mus: Sequence[float], seeds: Sequence[int], cases: Sequence[int]
) -> argparse.ArgumentParser:
    """The options both grids take: --sims (0: run nothing), --reps, --results, --mu, --seeds, --cases,
    --render."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=0, help="replicates per cell (0: run nothing)")
    ap.add_argument("--reps", type=int, default=999, help="bootstrap resamples B")
    ap.add_argument("--results", type=Path, default=results)
    ap.add_argument("--mu", type=float, nargs="*", default=list(mus))
    ap.add_argument("--seeds", type=int, nargs="*", default=list(seeds))
    ap.add_argument("--cases", type=int, nargs="*", default=list(cases))
    ap.add_argument("--render", action="store_true", help="write the table into docs/gate-calibration.md")
    return ap


def load_rows(path: Path) -> list[dict]:
    """The finished cells (one JSON object a line; none when the file does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timed_cell(path: Path, cell: Callable[[], dict]) -> None:
    """Run one cell, add its wall seconds, append it to the results file and print it (a killed grid
    resumes after its last finished cell)."""
    t0 = time.monotonic()
    row = cell()
    row["seconds"] = round(time.monotonic() - t0, 1)
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def write_block(table: str, marker: str, heading: str) -> None:
    """Put ``table`` between the ``<!-- marker:begin/end -->`` lines of docs/gate-calibration.md (or
    append it under ``heading`` when the markers are not there yet)."""
    text = DOC.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    block = f"{begin}\n{table}\n{end}"
    if begin in text and end in text:
        start, stop = text.index(begin), text.index(end) + len(end)
        text = text[:start] + block + text[stop:]
    else:
        text = text.rstrip() + f"\n\n{heading}\n\n{block}\n"
    DOC.write_text(text)

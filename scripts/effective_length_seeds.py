"""Do the effective-length intervals move with the bootstrap seed? (issue #39 item 2)

For every shipped run folder under docs/ (records.parquet + manifest.json) whose report has effective
lengths, the gate is replayed on a temporary copy to capture the exact call of
:func:`depthgate.judge.science.effective_length` that wrote its verdict (rule, threshold, base source,
alpha, resamples), and that call is repeated at ``--seeds`` bootstrap seeds. One JSON line per folder:
how many (arm, depth) intervals and candidate − baseline difference intervals (tokens and grid steps)
are not the same at every seed, which ones with their values, and the seconds per call.

    python scripts/effective_length_seeds.py                      # today's settings, seeds 0..9
    python scripts/effective_length_seeds.py --reps 1999 --out -  # another resample count, to stdout

The shipped data is docs/effective-length-seeds.jsonl (one ``label`` per setting measured).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "effective-length-seeds.jsonl"


def shipped_folders() -> list[Path]:
    """The run folders test_shipped_runs.py re-gates, those whose verdict has effective lengths."""
    out = []
    for records in sorted((REPO / "docs").rglob("records.parquet")):
        folder = records.parent
        verdict = folder / "report" / "verdict.json"
        if not (folder / "manifest.json").is_file() or not verdict.is_file():
            continue
        position = json.loads(verdict.read_text()).get("position") or {}
        if position.get("effective_length"):
            out.append(folder)
    return out


@contextlib.contextmanager
def _capture() -> Iterator[list[dict[str, Any]]]:
    """Record the arguments of every effective_length call the report makes that returns."""
    import depthgate.report.position as report_position

    calls: list[dict[str, Any]] = []
    original = report_position.effective_length

    def recorder(scored: Any, **kwargs: Any) -> Any:
        result = original(scored, **kwargs)
        calls.append({"scored": scored, **kwargs})
        return result

    report_position.effective_length = recorder  # type: ignore[assignment]
    try:
        yield calls
    finally:
        report_position.effective_length = original  # type: ignore[assignment]


def captured_call(folder: Path) -> dict[str, Any]:
    """The effective_length call behind ``folder``'s shipped verdict (the last that returned)."""
    from depthgate.commands.pipeline import gate_run

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / folder.name
        shutil.copytree(folder, copy)
        with _capture() as calls, contextlib.redirect_stderr(io.StringIO()):
            gate_run(copy, report_dir=Path(tmp) / "report")
    if not calls:
        raise SystemExit(f"{folder}: the gate computed no effective length")
    return calls[-1]


def intervals(result: Any) -> dict[str, list[int]]:
    """Every interval of one result: per (arm, depth) [lower, upper] in tokens, per depth the
    candidate − baseline difference in tokens and in grid steps."""
    out: dict[str, list[int]] = {}
    for r in result.rows:
        out[f"{r.arm}@{r.position}"] = [r.lower, r.upper]
    for d in result.deltas:
        out[f"delta@{d.position}"] = [d.lower, d.upper]
        out[f"delta_steps@{d.position}"] = [d.lower_steps, d.upper_steps]
    return out


def measure(folder: Path, seeds: list[int], reps: int | None) -> dict[str, Any]:
    from depthgate.judge.science import effective_length

    call = captured_call(folder)
    scored = call.pop("scored")
    if reps is not None:
        call["reps"] = reps
    per_seed: list[dict[str, list[int]]] = []
    seconds = []
    result = None
    for seed in seeds:
        start = time.perf_counter()
        result = effective_length(scored, **{**call, "seed": seed})
        seconds.append(time.perf_counter() - start)
        per_seed.append(intervals(result))
    assert result is not None
    changed = {
        key: sorted({tuple(s[key]) for s in per_seed})
        for key in per_seed[0]
        if len({tuple(s[key]) for s in per_seed}) > 1
    }
    arm_keys = [k for k in per_seed[0] if not k.startswith("delta")]
    return {
        "folder": str(folder.relative_to(REPO)),
        "rule": call["rule"],
        "alpha": call["alpha"],
        "reps_asked": call["reps"],
        "reps_used": result.reps,
        "n_cases": result.n_cases,
        "seeds": seeds,
        "intervals": len(per_seed[0]),
        "changed": len(changed),
        "arm_intervals": len(arm_keys),
        "arm_changed": sum(1 for k in changed if k in arm_keys),
        "which": {k: [list(v) for v in vals] for k, vals in changed.items()},
        "seconds_per_call": round(sum(seconds) / len(seconds), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="*", default=list(range(10)))
    ap.add_argument("--reps", type=int, default=None, help="resamples asked (default: each run's plan)")
    ap.add_argument("--label", default="today", help="the setting measured, written on every line")
    ap.add_argument("--out", default=str(OUT), help="JSONL to append to ('-': stdout only)")
    ap.add_argument("folders", nargs="*", type=Path, help="run folders (default: every shipped one)")
    args = ap.parse_args(argv)
    folders = [f.resolve() for f in args.folders] or shipped_folders()
    lines = []
    for folder in folders:
        row = {"label": args.label, **measure(folder, args.seeds, args.reps)}
        lines.append(json.dumps(row, ensure_ascii=False))
        print(lines[-1], flush=True)
    total = sum(json.loads(line)["changed"] for line in lines)
    print(f"{args.label}: {total} intervals differ across {len(args.seeds)} seeds", file=sys.stderr)
    if args.out != "-":
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: peak RSS of `depthgate build` against the number of cases (issue #21, item 5).

Opt-in (``-m bench``). Each size runs ``depthgate build --tokenizer gpt2 --lengths 131072 --positions
0,0.25,0.5,0.75,1 --cases N --verification fast`` in a **fresh child process** (this file as a script),
which reports its own peak (``VmHWM``) when the build returns. The build must stream like the run path:
peak memory flat in the number of cases — from 10 to 80 cases (≈ 50 → ≈ 400 layouts of 128K tokens)
within +150 MB.

    .venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/benchmarks/test_bench_build_memory.py
    .venv/bin/python tests/benchmarks/test_bench_build_memory.py --cases 80     # one size, one JSON line

Knobs: ``DEPTHGATE_BENCH_BUILD_CASES`` (``10,40,80``), ``DEPTHGATE_BENCH_BUILD_LENGTH`` (131072).
``DEPTHGATE_BENCH_STRICT=1`` asserts the +150 MB bound; without it nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from child_memory import REPO, measure_child, measure_sizes, status_kb

GPT2 = REPO / "tests" / "fixtures" / "tokenizers" / "gpt2" / "tokenizer.json.gz"
#: Allowed growth of the peak from the smallest to the largest size (issue #21).
FLAT_MB = 150


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import polars as pl

    from depthgate.commands.cli import main

    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        out = Path(tmp) / "out"
        argv = [
            "build", "--tokenizer", str(GPT2), "--lengths", str(args.length),
            "--positions", "0,0.25,0.5,0.75,1", "--cases", str(args.cases),
            "--verification", args.verification, "--out", str(out),
        ]  # fmt: skip
        wall, cpu = time.monotonic(), time.process_time()
        code = main(argv)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        peak = status_kb("VmHWM") / 1024
        path = out / "layouts.parquet"
        frame = pl.scan_parquet(path).select(pl.len(), pl.col("total_tokens").sum()).collect()
        layouts, tokens = (int(v) for v in frame.row(0))
        size = path.stat().st_size
    return {
        "cases": args.cases,
        "length": args.length,
        "verification": args.verification,
        "exit": code,
        "layouts": layouts,
        "tokens": tokens,
        "file_mb": round(size / 2**20, 1),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "peak_rss_mb": round(peak, 1),
    }


@pytest.mark.bench
def test_bench_build_memory_is_flat_in_the_number_of_cases() -> None:
    measure = functools.partial(measure_child, __file__)
    sizes, rows = measure_sizes(measure, "BUILD", length="131072", cases="10,40,80")
    growth = rows[-1]["peak_rss_mb"] - rows[0]["peak_rss_mb"]
    print(f"peak growth {sizes[0]} → {sizes[-1]} cases: {growth:+.0f} MB (bound +{FLAT_MB} MB)")
    for r in rows:
        assert r["exit"] == 0 and r["layouts"] > 0, r
    if os.environ.get("DEPTHGATE_BENCH_STRICT") == "1":
        assert growth <= FLAT_MB, rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--verification", default="fast", choices=["fast", "full"])
    print(json.dumps(_child(parser.parse_args())))

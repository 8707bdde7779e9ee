"""What the memory benchmarks share (tests/benchmarks/test_bench_memory.py, test_bench_build_memory.py):
each size runs in a fresh child process (the bench file as a script) so that its peak RSS is its own, the
child prints one JSON line, and the sizes come from environment knobs.

Importable both under pytest and from the bench file run as a script: either way this folder is on
``sys.path`` (pytest's rootdir-relative insert, or the script's own folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``: Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_child(script: str, cases: int, length: int, *extra: str) -> dict[str, Any]:
    """Run ``script --cases N --length L [extra]`` in a fresh child process and return the JSON line it
    printed last (its peaks are its own)."""
    out = subprocess.run(
        [sys.executable, script, "--cases", str(cases), "--length", str(length), *extra],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure_sizes(
    measure: Callable[[int, int], dict[str, Any]], knob: str, length: str, cases: str
) -> tuple[list[int], list[dict[str, Any]]]:
    """The case counts of ``DEPTHGATE_BENCH_{knob}_CASES`` (default ``cases``, comma-separated) at the
    length of ``DEPTHGATE_BENCH_{knob}_LENGTH`` (default ``length``), each measured and printed as a
    JSON line; returns the sizes and the rows in that order."""
    at = int(os.environ.get(f"DEPTHGATE_BENCH_{knob}_LENGTH", length))
    sizes = [int(c) for c in os.environ.get(f"DEPTHGATE_BENCH_{knob}_CASES", cases).split(",")]
    rows = [measure(n, at) for n in sizes]
    for row in rows:
        print(json.dumps(row))
    return sizes, rows

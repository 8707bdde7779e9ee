"""Absurd sizes are refused before any work, in a fresh process (issue #21, item 1).

``lengths = [10**12]`` in a matrix, or ``--lengths 1000000000000``, used to start the build and grow
past 3 GB for minutes; ``suite generate --cases 1000000000`` was refused only after 31 s. Each now
ends with exit 20 naming the field and the limit.

"Before any work" is checked by the refusing process's peak memory, not by a clock: the wall time of a
0.1 s refusal is the machine's load (a 2-second bound failed at 2.93 s under 2 other jobs), while the
work it must not start is memory. Measured (2026-12-04, VmHWM): a refusal peaks at 19–32 MB — the
interpreter, the parser and the matrix model; the commands' heavy modules (numpy, polars, tokenizers)
load only when a command runs — where the smallest real build (GPT-2, 600 tokens) peaks at 126 MB, a
100K-token build at 415 MB and generating 2,000 cases at 134 MB.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fixtures_paths import tokenizers_dir
from helpers import stub_matrix

# The child reports its own peak: VmHWM of its address space, which starts afresh at exec. (The rusage
# of a child, os.wait4's or RUSAGE_SELF's ru_maxrss, keeps the high-water mark of the process it was
# forked from: 71 MB for every child of a pytest worker, whatever the child did.)
_REPORTING = """
import runpy, sys
sys.argv = ["depthgate", *sys.argv[2:]]
try:
    runpy.run_module("depthgate", run_name="__main__", alter_sys=True)
finally:
    with open("/proc/self/status") as status, open(sys.argv_peak, "w") as out:
        out.write(next(line for line in status if line.startswith("VmHWM:")).split()[1])
"""
#: Peak resident memory of the refusing process: 2x a refusal's, half the smallest real build's.
PEAK_MB = 64
GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"


def _matrix(tmp_path: Path) -> Path:
    path = tmp_path / "huge.toml"
    path.write_text(stub_matrix("huge", where='endpoint = "http://127.0.0.1:9"', lengths="[1000000000000]"))
    return path


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["build", "{matrix}", "--out", "{out}"], "lengths[0]"),
        (["run", "{matrix}", "--out", "{out}"], "lengths[0]"),
        (["build", "--tokenizer", str(GPT2), "--lengths", "1000000000000", "--out", "{out}"], "--lengths"),
        (["suite", "generate", "--cases", "1000000000", "--out", "{out}"], "--cases"),
    ],
    ids=["matrix-build", "matrix-run", "lengths-option", "generate-cases"],
)
def test_an_absurd_size_is_refused_at_once(tmp_path: Path, argv: list[str], field: str) -> None:
    names = {"matrix": str(_matrix(tmp_path)), "out": str(tmp_path / "out")}
    peak_file = tmp_path / "peak-kb"
    code = _REPORTING.replace("sys.argv_peak", repr(str(peak_file)))
    proc = subprocess.run(
        [sys.executable, "-c", code, "-", *(a.format(**names) for a in argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    peak_mb = int(peak_file.read_text()) / 1024
    assert proc.returncode == 20, proc.stderr
    assert f"field '{field}'" in proc.stderr and "limit" in proc.stderr and "fix:" in proc.stderr
    assert peak_mb < PEAK_MB, f"the refusal peaked at {peak_mb:.0f} MB: work started before the check"
    assert not (tmp_path / "out").exists()

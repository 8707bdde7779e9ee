"""Absurd sizes are refused before any work, in a fresh process (issue #21, item 1).

``lengths = [10**12]`` in a matrix, or ``--lengths 1000000000000``, used to start the build and grow
past 3 GB for minutes; ``suite generate --cases 1000000000`` was refused only after 31 s. Each now
ends with exit 20 naming the field and the limit. The bound below is the issue's "< 1 s" with room for
a loaded CI machine: measured 0.07–0.42 s on the shared 2-core machine (the interpreter's start and
the parser; the commands' heavy modules load only when a command runs).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures_paths import tokenizers_dir
from helpers import stub_matrix

SECONDS = 2.0
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
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "depthgate", *(a.format(**names) for a in argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 20, proc.stderr
    assert f"field '{field}'" in proc.stderr and "limit" in proc.stderr and "fix:" in proc.stderr
    assert elapsed < SECONDS, f"{elapsed:.2f} s to refuse"
    assert not (tmp_path / "out").exists()

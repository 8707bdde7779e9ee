"""The hand-written stub of the Rust extension matches the built module (pydantic-core's habit)."""

from __future__ import annotations

import subprocess
import sys


def test_core_stub_matches_the_extension(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "depthgate._core", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr

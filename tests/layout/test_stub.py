"""The hand-written stub of the Rust extension matches the built module (pydantic-core's habit)."""

from __future__ import annotations

import subprocess
import sys


def test_core_stub_matches_the_extension(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "depthgate._core"],
        cwd=tmp_path,  # its .mypy_cache goes there, not into the checkout
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr

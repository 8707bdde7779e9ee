"""Results shown in the docs ship with the data that reproduces them: every shipped run folder (records,
scored.parquet, manifest, suite) re-gates to the very bytes of its shipped verdict.json and summary.md.

docs/vllm-cpu/ holds the real vLLM server's runs behind docs/nightly.md (scripts/vllm/measure.py): the
matrix in two request orders and its A/A run. docs/position-showcase/ is the embedded-default run behind
docs/position.md (issue #24; tests/cli/test_position_docs.py rebuilds that page's tables from it).
docs/position-aa/ is the embedded A/A run behind docs/position.md's noise floor (issue #39 item 5).
docs/smoke-run/ is the main job's run behind the README's smoke block (tests/cli/test_readme_smoke.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

SHIPPED = sorted(
    p.parent for p in (REPO / "docs").rglob("records.parquet") if (p.parent / "manifest.json").is_file()
)


def test_the_shipped_run_folders_are_found() -> None:
    names = {f"{p.parent.name}/{p.name}" for p in SHIPPED}
    assert {
        "vllm-cpu/shuffled",
        "vllm-cpu/haystack",
        "vllm-cpu/aa",
        "docs/position-showcase",
        "docs/position-aa",
        "docs/smoke-run",
    } <= names


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "docs")))
def test_gate_reproduces_the_shipped_report(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    for name in ("verdict.json", "summary.md"):
        (copy / "report" / name).unlink()
    done = subprocess.run(
        [sys.executable, "-m", "depthgate", "gate", str(copy)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode in (0, 10, 11, 12, 13, 30), done.stderr[-2000:]
    for name in ("verdict.json", "summary.md"):
        assert (copy / "report" / name).read_bytes() == (folder / "report" / name).read_bytes(), name

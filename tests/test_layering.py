"""The layering contracts of pyproject.toml (run by `lint-imports` in scripts/test.sh) catch the
faults they exist for: each test copies the package, writes one violation into the copy, and runs
the real `lint-imports` on it with the project's own contracts. The untouched copy passes, so a
failure below is the injected import and nothing else (issue #9)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not LINT.is_file():
        pytest.fail(f"{LINT} is missing: install the dev extra (scripts/setup.sh does)")
    root = tmp_path_factory.mktemp("layering")
    shutil.copytree(
        REPO / "python" / "depthgate",
        root / "depthgate",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    # The copy comes first on the path, so grimp reads it and not the installed package.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def _inject(root: Path, module: str, line: str) -> tuple[Path, str | None]:
    """Append ``line`` to ``module``, a new file when there is none (its original is then None)."""
    path = root / "depthgate" / module
    original = path.read_text(encoding="utf-8") if path.exists() else None
    path.write_text((original or "") + f"\n{line}\n", encoding="utf-8")
    return path, original


def test_the_untouched_package_keeps_every_contract(package_copy: Path) -> None:
    done = _lint(package_copy)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # a step importing the step above it: the pre-send gate reaching into the CLI
        ("layout/presend.py", "from depthgate.commands import cli", "pipeline steps import downwards only"),
        # the protocol importing an implementation (base.py once imported its own subclasses)
        (
            "run/backends/base.py",
            "from depthgate.run.backends import http",
            "backend implementations sit above the backend protocol",
        ),
        # the gate reaching a server library
        (
            "judge/gate/release.py",
            "import httpx",
            "judging and layout never reach a server or a model engine",
        ),
        # a loop inside one subpackage: the gate's run imports its plan, the plan importing the run closes it
        (
            "judge/gate/plan.py",
            "from depthgate.judge.gate import release",
            "no import loops between sibling modules",
        ),
        # a slice bound reaching up into the gate that uses it
        (
            "judge/bounds/slice_bounds.py",
            "from depthgate.judge.gate import GatePlan",
            "judge subpackages import downwards only",
        ),
        # a module of the judge outside every subpackage (the flat layout of before issue #38)
        (
            "judge/stats.py",
            "from depthgate.judge.gate import gate",
            "judge subpackages import downwards only",
        ),
    ],
    ids=[
        "upward",
        "protocol-imports-implementation",
        "judge-reaches-server",
        "sibling-loop",
        "judge-bounds-import-the-gate",
        "judge-flat-module",
    ],
)
def test_an_injected_violation_breaks_its_contract(
    package_copy: Path, module: str, line: str, contract: str
) -> None:
    path, original = _inject(package_copy, module, line)
    try:
        done = _lint(package_copy)
    finally:
        if original is None:
            path.unlink()
        else:
            path.write_text(original, encoding="utf-8")
    assert done.returncode != 0, done.stdout
    assert f"{contract} BROKEN" in done.stdout, done.stdout

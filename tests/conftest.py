"""Shared test fixtures.

Real tokenizer and chat-template files ship with the repository in ``tests/fixtures/tokenizers``
(tokenizer.json files gzipped; provenance and licences in its NOTICE.md). ``fixtures_paths``
materializes them, decompressed, into ``tests/.fixture-cache``; a missing fixture fails the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fixtures_paths import FixtureError, fixtures_root
from tiers import FULL_ONLY_FOLDERS, FULL_ONLY_MODULES, FULL_ONLY_TESTS

TESTS = Path(__file__).resolve().parent

# Tests share worlds across folders by module name (`from test_stats import draw_pairs`, a stub reader of
# tests/cli/test_verdict_trust.py in tests/run): every folder is importable whichever file runs alone.
# Test module names stay unique across folders (pytest's default import mode needs that anyway).
for _folder in ("spec", "layout", "run", "judge", "report", "cli"):
    if str(TESTS / _folder) not in sys.path:
        sys.path.append(str(TESTS / _folder))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        relative = item.path.resolve().relative_to(TESTS).as_posix()
        test = f"{relative}::{item.originalname}" if isinstance(item, pytest.Function) else relative
        if (
            relative.split("/")[0] in FULL_ONLY_FOLDERS
            or relative in FULL_ONLY_MODULES
            or test in FULL_ONLY_TESTS
        ):
            item.add_marker(pytest.mark.full_only)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """A folder holding ``tokenizers/...`` laid out as the original shared/ folder, with plain
    ``tokenizer.json`` files; fails (naming the file and the fix) when a shipped fixture is missing."""
    try:
        return fixtures_root()
    except FixtureError as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)  # outside the handler: one message, no chained traceback


def __getattr__(name: str) -> Path:
    # `from conftest import SHARED_DIR` (older tests): the materialized root, built on first use.
    if name == "SHARED_DIR":
        return fixtures_root()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

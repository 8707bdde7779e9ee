"""Shared test fixtures.

Real tokenizer and chat-template files ship with the repository in ``tests/fixtures/tokenizers``
(tokenizer.json files gzipped; provenance and licences in its NOTICE.md). ``fixtures_paths``
materializes them, decompressed, into ``tests/.fixture-cache``; a missing fixture fails the tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures_paths import FixtureError, fixtures_root


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

"""Shared test fixtures.

Real tokenizer and chat-template files live in ``shared/``, a sibling of the repository checkout
(``/work/shared`` next to ``/work/main`` locally; CI clones the repo next to a copy in the same layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared/ folder of real test assets; skips (with the path) when it is absent."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"shared test assets not found at {SHARED_DIR}")
    return SHARED_DIR

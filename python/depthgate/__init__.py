"""depthgate: long-context position regression harness.

Token-exact layouts are built in the Rust core (``depthgate._core``); this package is the typed front:
cases and matrices (pydantic), chat-template frames, backends, the paired runner, the oracle, the
statistical gate and reports.
"""

from __future__ import annotations

__version__ = "0.1.0"

"""Checks of the serving path beside the matrix, registered by name (issue #21).

A check reads the records of its own requests (``RUN/<name>/``) and the layouts they were sent from
(``RUN/<arm>/<name>.parquet``) and returns a report whose ``findings`` name an arm whose serving path
lost something, by reason (``canary_head_lost`` …), at one length. The pipeline runs every registered
check whose records exist; :func:`depthgate.judge.health.assess` makes each finding a system failure of
every slice at its length. The full-length canaries (:mod:`depthgate.judge.health.canary`) are the first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import polars as pl

__all__ = ["SYSTEM_CHECKS", "SystemCheck", "SystemCheckReport", "SystemFinding", "checks", "register"]


class SystemFinding(Protocol):
    """One arm's serving path lost something at one length, named by ``reason``."""

    @property
    def arm(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def reason(self) -> str: ...
    @property
    def lost_runs(self) -> int: ...
    def line(self) -> str: ...


class SystemCheckReport(Protocol):
    @property
    def findings(self) -> tuple[SystemFinding, ...]: ...
    def to_dict(self) -> dict[str, Any]: ...


#: (records of the check's requests, their layouts: ``layout_id``, ``evidence_spans``) → report.
SystemCheck = Callable[[pl.DataFrame, pl.DataFrame], SystemCheckReport]

#: Every registered check by name: the name is its records folder and layouts file stem.
SYSTEM_CHECKS: dict[str, SystemCheck] = {}


def register(name: str) -> Callable[[SystemCheck], SystemCheck]:
    """Register a check under ``name`` (decorator)."""

    def add(check: SystemCheck) -> SystemCheck:
        SYSTEM_CHECKS[name] = check
        return check

    return add


#: The modules of the built-in checks (each registers itself on import).
_BUILTIN = ("depthgate.judge.health.canary",)


def checks() -> dict[str, SystemCheck]:
    """Every registered check, the built-in ones loaded."""
    for module in _BUILTIN:
        importlib.import_module(module)
    return dict(SYSTEM_CHECKS)

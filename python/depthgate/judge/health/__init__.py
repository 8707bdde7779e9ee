"""The run's health beside the statistics: the serving-path checks and their registry (``serving``),
the full-length canaries (``canary``), what failed in a run and its infra account (``run_health``) and
the FAIL_SYSTEM wording of a gate result (``wording``).
"""

from __future__ import annotations

from depthgate.judge.health.run_health import (
    EARLIER,
    InfraSummary,
    RunHealth,
    assess,
    endpoint_counts,
    infra_summary,
)
from depthgate.judge.health.serving import SystemCheckReport, checks
from depthgate.judge.health.wording import with_system_wording

__all__ = [
    "EARLIER",
    "InfraSummary",
    "RunHealth",
    "SystemCheckReport",
    "assess",
    "checks",
    "endpoint_counts",
    "infra_summary",
    "with_system_wording",
]

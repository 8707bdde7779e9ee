"""One wording per verdict class (issue #21): a slice driven by a serving path reads FAIL_SYSTEM.

The gate (:func:`depthgate.judge.gate.gate`) only sees scores, so a slice whose candidate runs were
lost to a server that doubles BOS reads "FAIL_REGRESSION (confirmed regression …)" there, and a slice
whose data came through a gateway that cut the head of the prompt may even pass. Once the run's health
(:func:`depthgate.judge.health.assess`) has named the system-driven slices, every report reads the
result from :func:`with_system_wording`: those slices carry status ``FAIL_SYSTEM`` and the serving
path's reason instead of the statistical wording, and the verdict and its reasons follow.
"""

from __future__ import annotations

import dataclasses

from depthgate.judge.gate import GateResult, SliceStatus, release_verdict
from depthgate.judge.health.run_health import RunHealth

__all__ = ["with_system_wording"]


def with_system_wording(result: GateResult, health: RunHealth) -> GateResult:
    """``result`` with each system-driven slice of ``health`` as FAIL_SYSTEM (reason: the serving
    path's, then the statistics that no longer decide it), and the verdict recomputed; ``result``
    itself when no slice is system-driven."""
    notes = health.slice_notes
    if not notes:
        return result
    slices = []
    for s in result.slice_results:
        note = notes.get(f"{s.length}/{s.position}")
        if note is None:
            slices.append(s)
            continue
        slices.append(dataclasses.replace(s, status=SliceStatus.FAIL_SYSTEM, reason=note))
    verdict, reasons = release_verdict(slices, result.overall, result.safety)
    return dataclasses.replace(result, verdict=verdict, reasons=tuple(reasons), slice_results=tuple(slices))

"""The statistical release gate: its plan (``plan``), its result types (``results``), the re-planned
sample size of a slice (``sizing``), the fixed-sample gate over every (length, position) slice and the
release verdict (``release``) and the sequential gate that replays the looks (``sequential``).
"""

from __future__ import annotations

from depthgate.judge.gate.plan import GatePlan, stable_seed
from depthgate.judge.gate.release import gate, release_verdict
from depthgate.judge.gate.results import (
    GateResult,
    PositionShare,
    SliceResult,
    SliceStatus,
    Verdict,
    non_inferiority_shown,
)
from depthgate.judge.gate.sequential import SequentialDesign, replay_looks, sequential_gate
from depthgate.judge.gate.sizing import Sizing, fisher_less, sample_size_per_slice

__all__ = [
    "GatePlan",
    "GateResult",
    "PositionShare",
    "SequentialDesign",
    "Sizing",
    "SliceResult",
    "SliceStatus",
    "Verdict",
    "fisher_less",
    "gate",
    "non_inferiority_shown",
    "release_verdict",
    "replay_looks",
    "sample_size_per_slice",
    "sequential_gate",
    "stable_seed",
]

"""Planning a run before it is made: the approximate power and the cases a slice needs
(``power``), the gate's power by simulation through the gate itself (``power_sim``) and a whole
release by simulation (``release_sim``).
"""

from __future__ import annotations

from depthgate.judge.planning.power import (
    DesignParameters,
    PowerPlan,
    cases_for_power,
    expected_table,
    pilot_parameters,
    power_per_slice,
    power_plan,
)
from depthgate.judge.planning.power_sim import draw_design, simulate_gate_power
from depthgate.judge.planning.release_sim import ReleaseSimulation, SimulatedSlice, simulate_release

__all__ = [
    "DesignParameters",
    "PowerPlan",
    "ReleaseSimulation",
    "SimulatedSlice",
    "cases_for_power",
    "draw_design",
    "expected_table",
    "pilot_parameters",
    "power_per_slice",
    "power_plan",
    "simulate_gate_power",
    "simulate_release",
]

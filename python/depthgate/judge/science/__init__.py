"""Position science beside the gate, never changing its verdict: the per-case and per-control rates of
the runs (``position_records``), the base score (``base_score``), the effective length
(``length``), accuracy by position and spacing (``position``), the control items' failure
classes (``controls``) and the A/A noise floor with its release margin (``noise``, ``aa_margin``).
"""

from __future__ import annotations

from depthgate.judge.science.aa_margin import AaCase, aa_release_margin
from depthgate.judge.science.base_score import short_base
from depthgate.judge.science.controls import CATEGORIES, classify_failures, score_controls
from depthgate.judge.science.length import (
    EL_RESAMPLES,
    MC_Z,
    AccuracyPoint,
    EffectiveLength,
    EffectiveLengthDelta,
    EffectiveLengthResult,
    effective_length,
    mc_margin,
)
from depthgate.judge.science.noise import (
    NoiseFloorResult,
    abs_delta_quantile,
    noise_delta_quantile,
    noise_floor,
)
from depthgate.judge.science.position import (
    control_normalised_accuracy,
    eligible_cases,
    pass_hat_k,
    spacing_accuracy,
)
from depthgate.judge.science.position_records import (
    base_scores_from_controls,
    runs_frame,
    wilson_design_interval,
)

__all__ = [
    "CATEGORIES",
    "EL_RESAMPLES",
    "MC_Z",
    "AaCase",
    "AccuracyPoint",
    "EffectiveLength",
    "EffectiveLengthDelta",
    "EffectiveLengthResult",
    "NoiseFloorResult",
    "aa_release_margin",
    "abs_delta_quantile",
    "base_scores_from_controls",
    "classify_failures",
    "control_normalised_accuracy",
    "effective_length",
    "eligible_cases",
    "mc_margin",
    "noise_delta_quantile",
    "noise_floor",
    "pass_hat_k",
    "runs_frame",
    "score_controls",
    "short_base",
    "spacing_accuracy",
    "wilson_design_interval",
]

"""Block scheduling of a sequential run (issue #26): which jobs each pre-registered look sends.

A look holds the first c_k cases of the run's frozen case order, every seed on both arms, of every
slice still open, so each look has complete pairs per slice. The case order is a permutation of the
planned cases seeded from the run id (sha256, stable across processes): random with respect to the
cases (a look is a random subsample of the suite) and the same on every resume. Inside a look the
runner's own interleaved order applies (:func:`depthgate.run.runner.interleaved_order`); jobs already
recorded are skipped by the runner, so a resumed look sends only what has not landed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["case_order", "job_slice", "look_jobs"]


def case_order(cases: Iterable[str], run_id: str) -> list[str]:
    """The frozen order in which a sequential run takes its cases (the first c_k form look k)."""
    seed = int.from_bytes(hashlib.sha256(f"depthgate/looks/{run_id}".encode()).digest()[:8], "big")
    order = sorted(set(cases))
    random.Random(seed).shuffle(order)
    return order


def job_slice(row: Mapping[str, Any]) -> tuple[int, str]:
    """A job row's (length, position) slice key, spelled as the scored records spell it."""
    return int(row["target_tokens"]), str(row["position"])


def look_jobs(
    jobs: Iterable[tuple[str, Mapping[str, Any]]],
    look_cases: Collection[str],
    open_slices: Collection[tuple[int, str]],
) -> list[tuple[str, Mapping[str, Any]]]:
    """The (arm, layout row) jobs of one look: the look's cases in the slices still open."""
    cases = set(look_cases)
    slices = set(open_slices)
    return [(arm, row) for arm, row in jobs if str(row["case_id"]) in cases and job_slice(row) in slices]


def look_sizes(counts: Sequence[int]) -> list[int]:
    """Cases each look adds (for the run log)."""
    return [b - a for a, b in zip([0, *counts], counts, strict=False)]

"""Judging the full-length canaries (issue #21; built and sent by :mod:`depthgate.run.canary`).

Each canary is scored by the oracle like a control (``system_fail`` counts as not answered, an
unresolved infrastructure error is left out). Per length and kind (head, tail), an arm *loses* its
canaries when it answers fewer than half of them while the other arm answers at least half: its
serving path dropped that end of the prompt (a gateway cutting the head, a proxy reserving room at the
tail), whatever the counts and echoes said. That is a :class:`CanaryFinding` — a system failure by
name, ``canary_head_lost`` or ``canary_tail_lost`` — which :func:`depthgate.judge.health.assess` turns
into FAIL_SYSTEM for every slice of that length. Both arms failing says nothing about either serving
path (a model that cannot copy a number over that length) and is only reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polars as pl

from depthgate.judge.health.serving import register
from depthgate.judge.scoring import score_records
from depthgate.spec.canaries import CANARY_KINDS, canary_kind, canary_suite

__all__ = ["CanaryCount", "CanaryFinding", "CanaryReport", "canary_report"]

ARMS = ("baseline", "candidate")
#: An arm answers its canaries of one kind at one length when at least this share passes.
ANSWERED_SHARE = 0.5


@dataclass(frozen=True)
class CanaryCount:
    """One arm's canaries of one kind at one length: ``passed`` of ``runs`` scored (``system_fail`` of
    them failed on the serving path's own checks)."""

    arm: str
    length: int
    kind: str
    passed: int
    runs: int
    system_fail: int

    @property
    def answered(self) -> bool:
        return self.runs > 0 and self.passed >= ANSWERED_SHARE * self.runs


@dataclass(frozen=True)
class CanaryFinding:
    """``arm`` lost its ``kind`` canaries at ``length`` tokens where the other arm answered them."""

    arm: str
    length: int
    kind: str
    passed: int
    runs: int
    other_passed: int
    other_runs: int

    @property
    def reason(self) -> str:
        return f"canary_{self.kind}_lost"

    @property
    def lost_runs(self) -> int:
        return self.runs - self.passed

    def line(self) -> str:
        other = "candidate" if self.arm == "baseline" else "baseline"
        end = "start" if self.kind == "head" else "end"
        return (
            f"{self.arm} {self.reason} at {self.length} tokens: {self.passed} of {self.runs} {self.kind} "
            f"canaries answered ({other}: {self.other_passed} of {self.other_runs}) — the {end} of the "
            "prompt did not reach the model"
        )


@dataclass(frozen=True)
class CanaryReport:
    counts: tuple[CanaryCount, ...]
    findings: tuple[CanaryFinding, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": [
                {
                    "arm": c.arm,
                    "length": c.length,
                    "kind": c.kind,
                    "passed": c.passed,
                    "runs": c.runs,
                    "system_fail": c.system_fail,
                }
                for c in self.counts
            ],
            "findings": [f.line() for f in self.findings],
            "lost": sorted({f"{f.arm}:{f.reason}@{f.length}" for f in self.findings}),
        }


def _counts(scored: pl.DataFrame) -> list[CanaryCount]:
    usable = scored.filter(pl.col("outcome") != "missing").with_columns(
        pl.col("case_id").map_elements(canary_kind, return_dtype=pl.String).alias("kind")
    )
    rows = (
        usable.filter(pl.col("kind").is_not_null())
        .group_by("arm", "length", "kind")
        .agg(
            (pl.col("outcome") == "pass").sum().alias("passed"),
            pl.len().alias("runs"),
            (pl.col("outcome") == "system_fail").sum().alias("system_fail"),
        )
        .sort("length", "kind", "arm")
    )
    return [
        CanaryCount(str(a), int(length), str(k), int(p), int(n), int(s))
        for a, length, k, p, n, s in rows.iter_rows()
    ]


@register("canaries")
def canary_report(records: pl.DataFrame, layouts: pl.DataFrame) -> CanaryReport:
    """Score the canary ``records`` (the run's ``canaries`` records) against their ``layouts``
    (``layout_id``, ``evidence_spans``) and name every arm that lost its canaries where the other
    answered them."""
    ids = records["case_id"].unique().to_list()
    count = 1 + max((int(str(c).rsplit("-", 1)[1]) for c in ids if canary_kind(str(c))), default=0)
    scored = score_records(records, canary_suite(count), layouts)
    counts = _counts(scored)
    by_key = {(c.arm, c.length, c.kind): c for c in counts}
    findings = []
    for length in sorted({c.length for c in counts}):
        for kind in CANARY_KINDS:
            pair = [by_key.get((arm, length, kind)) for arm in ARMS]
            if pair[0] is None or pair[1] is None:
                continue
            for me, other in ((pair[0], pair[1]), (pair[1], pair[0])):
                if not me.answered and other.answered:
                    findings.append(
                        CanaryFinding(me.arm, length, kind, me.passed, me.runs, other.passed, other.runs)
                    )
    return CanaryReport(tuple(counts), tuple(findings))

"""What the run itself says about a verdict, before anyone reads the statistics.

Two questions a release gate must answer before "the model got worse":

* **Was data lost?** Every planned (arm, layout, seed) job needs a final record (``ok`` or
  ``system_fail``). A job whose last record is ``infra_error`` (the endpoint was down after every
  retry) or that was never sent (the circuit breaker stopped the run) is *lost*. Any lost job makes
  the verdict ``INFRA`` (exit 30): no PASS, FAIL or INCONCLUSIVE is computed over lost data. The
  rerun of the same folder resumes and sends only the lost jobs.
* **Is a failure the serving path's?** A slice that fails because the candidate's *system* failed
  (a server that doubles BOS, clamps ``max_tokens``, cuts the prompt, overflows its window) counts
  against the candidate — a release gate must not ship it — but it is not a model regression. A
  failing slice is *system-driven* when system failures make up at least half of the candidate's
  failing runs in it; when every failing slice is, the verdict is FAIL with class ``system`` (exit 13).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import polars as pl

from depthgate.judge.gate import GateResult
from depthgate.judge.health.serving import SystemFinding

__all__ = [
    "EARLIER",
    "NO_ENDPOINT",
    "SYSTEM_DRIVEN_SHARE",
    "FailureClass",
    "InfraSummary",
    "RunHealth",
    "assess",
    "endpoint_counts",
    "infra_summary",
]

#: A failing slice is system-driven when system failures are at least this share of the candidate's
#: failing runs in it (fail + system_fail).
SYSTEM_DRIVEN_SHARE = 0.5

FailureClass = Literal["none", "model", "system", "mixed"]


@dataclass(frozen=True)
class InfraSummary:
    """Jobs planned, jobs lost (no final record), and where they were lost.

    ``by_endpoint``: lost jobs per endpoint that had an ``infra_error`` for them (``"not sent"`` for
    jobs never sent); ``by_slice``: lost jobs per ``"length/position"``; ``errors``: the last error
    summaries (no server text, no prompt) with their counts. ``endpoints``: per endpoint that was sent
    to, the jobs whose final record it holds (``ok``, ``system_fail``, ``infra_error``) and ``failed``,
    the transient failures there of those jobs (a job moved off a dead replica counts at both).
    """

    planned: int
    lost: int
    infra_error: int
    not_sent: int
    by_endpoint: dict[str, int] = field(default_factory=dict)
    by_slice: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "planned": self.planned,
            "lost": self.lost,
            "infra_error": self.infra_error,
            "not_sent": self.not_sent,
            "by_endpoint": dict(sorted(self.by_endpoint.items())),
            "by_slice": dict(sorted(self.by_slice.items())),
            "errors": dict(sorted(self.errors.items(), key=lambda kv: (-kv[1], kv[0]))),
            "endpoints": {k: dict(v) for k, v in sorted(self.endpoints.items())},
        }


#: Where a lost job is counted when no endpoint took it (every replica of its arm was down).
NO_ENDPOINT = "no endpoint up"


def _one_endpoint(endpoint: object) -> str | None:
    """The endpoint a record names, or None: never sent anywhere, or (records written before issue #21)
    the space-joined URLs of an arm on several replicas, which is no endpoint at all."""
    if endpoint is None or not str(endpoint).strip() or len(str(endpoint).split()) > 1:
        return None
    return str(endpoint)


#: Per-endpoint key of the transient failures in earlier calls into the run folder (issue #37).
EARLIER = "failed_in_earlier_calls"


def endpoint_counts(records: pl.DataFrame) -> dict[str, dict[str, int]]:
    """Per endpoint that was sent to: the final records it holds by status (``ok``, ``system_fail``,
    ``infra_error``) and ``failed``, the transient failures there in the call that wrote each final
    record (``failed_endpoints``); with :data:`EARLIER` (only where there were any), the failures there
    in earlier calls (a killed or INFRA-stopped run), which a resumed job's final record carries over
    (``earlier_failed_endpoints``). Records never sent (a refused layout, ``attempts`` 0) count nowhere;
    a lost job no endpoint took counts under none."""
    counts: dict[str, dict[str, int]] = {}

    def slot(endpoint: str) -> dict[str, int]:
        return counts.setdefault(endpoint, {"ok": 0, "system_fail": 0, "infra_error": 0, "failed": 0})

    def sent(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.filter(pl.col("attempts") > 0) if "attempts" in frame.columns else frame

    if records.height and "endpoint" in records.columns:
        for endpoint, status, n in sent(records).group_by("endpoint", "status").len().iter_rows():
            name = _one_endpoint(endpoint)
            if name is not None and status in ("ok", "system_fail", "infra_error"):
                slot(name)[str(status)] += int(n)
    if records.height and "failed_endpoints" in records.columns:
        for listed in sent(records)["failed_endpoints"].drop_nulls().to_list():
            for endpoint in str(listed).split():
                slot(endpoint)["failed"] += 1
    if records.height and "earlier_failed_endpoints" in records.columns:
        for listed in sent(records)["earlier_failed_endpoints"].drop_nulls().to_list():
            for endpoint in str(listed).split():
                earlier = slot(endpoint)
                earlier[EARLIER] = earlier.get(EARLIER, 0) + 1
    return counts


def infra_summary(
    records: pl.DataFrame, planned: pl.DataFrame, endpoints: dict[str, dict[str, int]] | None = None
) -> InfraSummary:
    """Compare the planned jobs with the records (one row per key, the final record preferred).

    ``planned`` has one row per job: ``arm``, ``layout_id``, ``seed``, ``target_tokens``,
    ``position``. ``records`` are the run's records (:func:`depthgate.run.records.read_records`).
    ``endpoints``: the per-endpoint counts to report (the pipeline's, over every request of the run:
    matrix, controls and canaries, failures of earlier calls included); default those of ``records``.
    A lost job is counted under the endpoint that failed it last, or :data:`NO_ENDPOINT`.
    """
    key = ["arm", "layout_id", "seed"]
    recs = records.select(
        *key, "status", pl.col("endpoint").fill_null("unknown"), pl.col("error").fill_null("unknown")
    ).with_columns(pl.col("seed").cast(pl.Int64))
    plan = planned.select(*key, "target_tokens", "position").with_columns(pl.col("seed").cast(pl.Int64))
    joined = plan.join(recs, on=key, how="left")
    lost = joined.filter(~pl.col("status").is_in(["ok", "system_fail"]) | pl.col("status").is_null())
    infra = lost.filter(pl.col("status") == "infra_error")
    by_endpoint: dict[str, int] = {}
    for e, n in infra.group_by("endpoint").len().iter_rows():
        name = _one_endpoint(None if e == "unknown" else e) or NO_ENDPOINT
        by_endpoint[name] = by_endpoint.get(name, 0) + int(n)
    not_sent = lost.height - infra.height
    if not_sent:
        by_endpoint["not sent"] = not_sent
    by_slice = {
        f"{t}/{p}": int(n) for t, p, n in lost.group_by("target_tokens", "position").len().iter_rows()
    }
    errors = {str(e): int(n) for e, n in infra.group_by("error").len().iter_rows()}
    return InfraSummary(
        planned=plan.height,
        lost=lost.height,
        infra_error=infra.height,
        not_sent=not_sent,
        by_endpoint=by_endpoint,
        by_slice=by_slice,
        errors=errors,
        endpoints=endpoint_counts(records) if endpoints is None else endpoints,
    )


@dataclass(frozen=True)
class RunHealth:
    """The run's own account of a verdict: lost data (``infra``) and, derived from which failing slices
    the serving path drove, the class of the failures (never stored apart from the facts it rests on)."""

    infra: InfraSummary | None
    #: The failing slices ("length/position"), in the gate's order.
    failing: tuple[str, ...] = ()
    system_fail_reasons: dict[str, int] = field(default_factory=dict)
    #: Per system-driven slice, why (the wording its row and reason line take: FAIL_SYSTEM, never a
    #: model regression); not in verdict.json's top level, it is each slice's ``reason``.
    slice_notes: Mapping[str, str] = field(default_factory=dict)
    #: What the serving-path checks found (:mod:`depthgate.judge.health.serving`), named in the reasons.
    findings: tuple[SystemFinding, ...] = ()

    @property
    def system_driven(self) -> tuple[str, ...]:
        """The failing slices the serving path drove (those with a note), in the gate's order."""
        return tuple(name for name in self.failing if name in self.slice_notes)

    @property
    def failure_class(self) -> FailureClass:
        """none (nothing failed), system (every failing slice system-driven), mixed, or model."""
        driven = len(self.system_driven)
        if not self.failing:
            return "none"
        if driven == len(self.failing):
            return "system"
        return "mixed" if driven else "model"

    @property
    def lost_data(self) -> bool:
        return self.infra is not None and self.infra.lost > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "failure_class": self.failure_class,
            "system_driven_slices": list(self.system_driven),
            "system_fail_reasons": dict(sorted(self.system_fail_reasons.items())),
            "infra": None if self.infra is None else self.infra.to_dict(),
        }


def _slice_name(length: int, position: str) -> str:
    return f"{length}/{position}"


def assess(
    result: GateResult,
    scored: pl.DataFrame,
    infra: InfraSummary | None = None,
    findings: Sequence[SystemFinding] = (),
) -> RunHealth:
    """Classify the failing slices of ``result`` by what failed, from the scored records.

    ``findings`` (the serving-path checks, :mod:`serving`): every slice at a length where
    an arm's serving path lost something is system-driven — failing, whatever its statistics — with the
    finding's reason: its data came through a broken path, on one arm or the other."""
    lost_at = {f.length for f in findings}
    failing = [s for s in result.slice_results if s.status.value.startswith("FAIL") or s.length in lost_at]
    failing_keys = {(s.length, s.position) for s in failing}
    counts: Mapping[tuple[int, str], tuple[int, int]] = {}
    reasons: dict[str, int] = {}
    if failing and scored.height and "outcome" in scored.columns:
        length = "length" if "length" in scored.columns else "target_tokens"
        keys = pl.DataFrame(
            {length: [k[0] for k in failing_keys], "position": [k[1] for k in failing_keys]},
            schema={length: pl.Int64, "position": pl.String},
        )
        cand = _candidate_own(scored, length).join(keys, on=[length, "position"], how="semi")
        rows: Iterable[Sequence[Any]] = (
            cand.group_by(length, "position")
            .agg(
                pl.col("outcome").is_in(["fail", "system_fail"]).sum().alias("failing"),
                (pl.col("outcome") == "system_fail").sum().alias("system"),
            )
            .iter_rows()
        )
        counts = {(int(t), str(p)): (int(f), int(sy)) for t, p, f, sy in rows}
        system = cand.filter(pl.col("outcome") == "system_fail")
        if system.height and "system_fail_reason" in system.columns:
            for reason, n in system.group_by("system_fail_reason").len().iter_rows():
                reasons[str(reason)] = int(n)
    notes: dict[str, str] = {}
    for s in failing:
        name = _slice_name(s.length, s.position)
        here = [f for f in findings if f.length == s.length]
        c = counts.get((s.length, s.position))
        if here:
            notes[name] = "serving path: " + "; ".join(f.line() for f in here)
        elif c is not None and c[1] > 0 and c[1] >= SYSTEM_DRIVEN_SHARE * c[0]:
            notes[name] = (
                f"serving path: {c[1]} of {c[0]} failing candidate runs are system failures "
                f"({_reasons_at(scored, s.length, s.position)}), not answers of the model"
            )
    for f in findings:
        key = f.reason if f.arm == "candidate" else f"{f.arm}:{f.reason}"
        reasons[key] = reasons.get(key, 0) + f.lost_runs
    names = tuple(_slice_name(s.length, s.position) for s in failing)
    return RunHealth(infra, names, reasons, notes, tuple(findings))


def _candidate_own(scored: pl.DataFrame, length: str) -> pl.DataFrame:
    """The candidate's scored runs without the system failures the baseline shares (issue #37, item 3):
    a run both arms failed by the system — a layout neither arm can build (``cannot_reach_exact_length``
    on both), a prompt both refuse — is no fault of the candidate's serving path; only a candidate-only
    system failure is the candidate's."""
    typed = scored.with_columns(pl.col(length).cast(pl.Int64), pl.col("position").cast(pl.String))
    cand = typed.filter(pl.col("arm") == "candidate")
    key = ["case_id", "seed", length, "position"]
    if not all(k in typed.columns for k in key):
        return cand
    shared = typed.filter((pl.col("arm") == "baseline") & (pl.col("outcome") == "system_fail")).select(key)
    both = cand.filter(pl.col("outcome") == "system_fail").join(shared, on=key, how="semi")
    return cand.join(both.select(key), on=key, how="anti")


def _reasons_at(scored: pl.DataFrame, length: int, position: str) -> str:
    """ "reason n, …" of the candidate's own system failures in one slice (none shared with the
    baseline)."""
    col = "length" if "length" in scored.columns else "target_tokens"
    if "system_fail_reason" not in scored.columns:
        return "system_fail"
    here = _candidate_own(scored, col).filter(
        (pl.col("outcome") == "system_fail")
        & (pl.col(col).cast(pl.Int64) == length)
        & (pl.col("position").cast(pl.String) == position)
    )
    rows = here.group_by("system_fail_reason").len().sort("system_fail_reason").iter_rows()
    return ", ".join(f"{r or 'system_fail'} {n}" for r, n in rows)

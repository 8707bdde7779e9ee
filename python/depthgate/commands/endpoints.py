"""One set of per-endpoint counts for a run (issue #21): the console and every report say the same.

The counts are the records' (:func:`depthgate.judge.health.endpoint_counts`) over every request the run
sent — the matrix, its controls and its canaries — and over every call into the folder: the final
record of each job by status where it was answered, and every failed attempt: ``failed`` those of the
call that wrote the final record, ``failed_in_earlier_calls`` those of the calls before a resume (a
resumed job's final record carries them, :class:`depthgate.run.ledger.RunLedger`).
The console adds only each replica's state now (up, drained, excluded).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.judge.health import EARLIER, endpoint_counts

__all__ = ["print_endpoint_counts", "run_endpoint_counts"]

#: The records folders of a run beside ``RUN/records`` (controls, canaries).
_SIDE_FOLDERS = ("controls", "canaries")


def run_endpoint_counts(run: Path) -> dict[str, dict[str, int]]:
    """Per endpoint: ``ok``, ``system_fail``, ``infra_error`` (final records) and ``failed`` (attempts)."""
    from depthgate.run.records import read_records

    folders = [run, *(run / name for name in _SIDE_FOLDERS if (run / name).is_dir())]
    finals = [f for f in (read_records(folder) for folder in folders) if f.height]
    if not finals:
        return {}
    return endpoint_counts(pl.concat(finals, how="diagonal_relaxed"))


def _state(stats: Mapping[str, Any]) -> str:
    if stats["healthy"]:
        return "up"
    return f"excluded: {stats['excluded']}" if stats["excluded"] else "drained"


#: Per-endpoint lines on the console at most (the rest summed in one line; verdict.json has them all).
_ENDPOINT_LINES = 8


def print_endpoint_counts(run: Path, backends: Mapping[str, Any]) -> None:
    """One stderr line per endpoint of the arms on several endpoints: the run's counts (the numbers of
    verdict.json ``infra.endpoints``) and the replica's state per arm."""
    states: dict[str, list[str]] = {}
    drains: dict[str, int] = {}
    for arm, backend in backends.items():
        stats = getattr(backend, "stats", None)
        if not callable(stats):
            continue
        for url, st in stats().items():
            states.setdefault(url, []).append(f"{arm} {_state(st)}")
            drains[url] = drains.get(url, 0) + int(st["drains"])
    if not states:
        return
    counts = run_endpoint_counts(run)
    empty = {"ok": 0, "system_fail": 0, "infra_error": 0, "failed": 0}
    # The endpoints with something to say first; past a few, one line sums up the rest (an arm may list
    # thousands of replicas; verdict.json has every one).
    urls = sorted(states, key=lambda u: (not counts.get(u, empty)["failed"] and not drains[u], u))
    for url in urls[:_ENDPOINT_LINES]:
        c = counts.get(url, empty)
        earlier = f", failed in earlier calls {c[EARLIER]}" if c.get(EARLIER) else ""
        print(
            f"depthgate: {url}: sent {c['ok'] + c['system_fail'] + c['infra_error']} (ok {c['ok']}, "
            f"system_fail {c['system_fail']}, infra_error {c['infra_error']}), failed {c['failed']}"
            f"{earlier}, drained {drains[url]}x ({', '.join(states[url])})",
            file=sys.stderr,
        )
    rest = [counts.get(u, empty) for u in urls[_ENDPOINT_LINES:]]
    if rest:
        sent = sum(c["ok"] + c["system_fail"] + c["infra_error"] for c in rest)
        print(
            f"depthgate: {len(rest)} more endpoints: sent {sent}, failed {sum(c['failed'] for c in rest)} "
            "(every endpoint in verdict.json infra.endpoints)",
            file=sys.stderr,
        )

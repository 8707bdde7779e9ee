"""A ``stop_rule = "sequential"`` run as shards (issue #26): one look per round, gated from the merge.

A look needs the records of every shard before the next look can be decided, so a sharded sequential
run goes in rounds. Round r: every shard runs ``depthgate run MATRIX --shard i/N --out DIR_i`` (round 1)
or ``... --after MERGED_{r-1}`` (later rounds) and sends its part of **one** look; then ``depthgate
merge DIR_1 … DIR_N --out MERGED_r`` joins them. A shard given ``--after`` replays the looks on the
merged records (:func:`depthgate.judge.gate.replay_looks`, deterministic: the same history
the unsharded run has) and sends its part of the next look for the slices still open, or nothing when
every slice is decided or the last look has landed. Each shard writes what it was asked to send into
``DIR_i/shard-look.json`` (the look and the decided slices it scheduled from); ``merge`` refuses shards
of different rounds and checks each shard against that schedule instead of the full matrix. After the
last round (at most as many rounds as looks; a round after the decision sends nothing)
``depthgate gate MERGED_r`` gives the unsharded run's verdict.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.commands.sequential import design_of, record_scorer
from depthgate.exceptions import InputError, RoundOpenError
from depthgate.judge.gate import GatePlan, replay_looks
from depthgate.run.looks import case_order, look_jobs
from depthgate.spec.cases import Suite
from depthgate.spec.files import ReadFailures, atomic_write, read_json
from depthgate.spec.models import AnalysisPlan

__all__ = [
    "ROUND_FILE",
    "SHARD_LOOK_FILE",
    "check_after",
    "read_shard_look",
    "refuse_open_round",
    "scheduled_jobs",
    "send_shard_look",
    "write_round",
]

SHARD_LOOK_FILE = "shard-look.json"
#: Written by ``merge`` into the merged folder of a sequential run: the round's look, of how many, and
#: the number of shards (``gate`` on a merge before the last round says so instead of INFRA).
ROUND_FILE = "sequential-round.json"


def _write_json(path: Path, body: Mapping[str, Any]) -> None:
    atomic_write(path, json.dumps(body, indent=2, sort_keys=True))


def _prior(
    after: Path | None, out: Path, gplan: GatePlan, plan: AnalysisPlan, order: Sequence[str], suite: Suite
) -> tuple[int, dict[tuple[int, str], tuple[int, str]]]:
    """The looks taken in the merged folder ``after`` (none before the first round) and its decisions."""
    if after is None:
        return 0, {}
    manifest = after / "manifest.json"
    failures = _failures("manifest.json")
    theirs, ours = read_json(manifest, failures), read_json(out / "manifest.json", failures)
    if not isinstance(theirs, dict) or theirs.get("manifest_digest") != ours.get("manifest_digest"):
        raise InputError(
            "the --after folder holds another run (its frozen manifest differs from this shard's)",
            file=str(manifest),
            field="--after",
            fix="pass the folder `depthgate merge` wrote from this run's shards in the previous round",
        )
    design = design_of(plan, len(order))
    scored = record_scorer(after, suite, after)()
    history, decided = replay_looks(scored, gplan, design, order)
    return len(history), decided


def _after_error(after: Path, problem: str, fix: str = "") -> InputError:
    return InputError(
        problem,
        file=str(after),
        field="--after",
        fix=fix or "pass the folder `depthgate merge` wrote from this run's shards in the previous round",
    )


def check_after(after: Path, manifest: Mapping[str, Any], *, shard: tuple[int, int], aa: bool) -> None:
    """Refuse an ``--after`` folder that is not the merge of a previous round of this very run, before
    anything is built or sent (issue #37, item 5): missing, not a folder, a shard (not the merge), no
    manifest, another run (another matrix, or ``--aa`` against a run without it), a run that is not a
    round's merge (an unsharded run), or a merge of another number of shards. ``manifest``: this call's
    manifest, as it will be frozen."""
    if not os.path.lexists(after):
        raise _after_error(after, "the folder does not exist")
    if not after.is_dir():
        raise _after_error(after, "is not a folder")
    shard_file = after / "shard.json"
    if shard_file.is_file():
        spec = read_json(shard_file, _failures("shard.json"))
        which = f"{spec.get('index')}/{spec.get('count')}" if isinstance(spec, dict) else "?"
        raise _after_error(
            after,
            f"holds shard {which} of a round, not the merge of the round",
            "merge every shard of the previous round first (depthgate merge DIR_1 … DIR_N --out MERGED_r), "
            "then pass --after MERGED_r",
        )
    theirs = read_json(after / "manifest.json", _failures("manifest.json"))
    if not isinstance(theirs, dict) or theirs.get("manifest_digest") != manifest.get("manifest_digest"):
        aa_hint = (
            " (with --aa the run is the baseline against itself, a run of its own: its rounds merge --aa "
            "shards only)"
            if aa
            else ""
        )
        raise _after_error(
            after,
            f"the --after folder holds another run: its frozen manifest differs from this shard's{aa_hint}",
        )
    if not (after / ROUND_FILE).is_file():
        raise _after_error(
            after,
            f"holds a run of this matrix, but not the merge of a round of a sharded sequential run (no "
            f"{ROUND_FILE}: an unsharded run, or a merge of another kind)",
        )
    spec = _read_look_file(after / ROUND_FILE, ("look", "of", "shards"), "merge the round's shards again")
    if int(spec["shards"]) != shard[1]:
        raise _after_error(
            after,
            f"merges a round of {spec['shards']} shards; this call is shard {shard[0]}/{shard[1]}",
            f"run every shard of the round with --shard i/{spec['shards']}, as in the rounds before",
        )


def _failures(name: str) -> ReadFailures:
    return ReadFailures(
        InputError,
        missing=(
            f"no {name} in the --after folder: not a folder written by `depthgate merge`",
            "pass the merged folder",
        ),
        unreadable=(f"cannot read {name} ({{strerror}})", "pass the merged folder"),
        not_json=(f"{name} is not valid JSON ({{msg}} at line {{lineno}})", "merge again"),
    )


def send_shard_look(
    jobs: Sequence[tuple[str, Mapping[str, Any]]],
    send: Callable[[list[tuple[str, Mapping[str, Any]]]], Any],
    gplan: GatePlan,
    plan: AnalysisPlan,
    run_id: str,
    out: Path,
    suite: Suite,
    after: Path | None,
) -> Any:
    """One round of a sharded sequential run: this shard's part of the look after ``after``'s looks
    (``send`` runs the shard's jobs only, resumable); ``shard-look.json`` says which look and from which
    decisions, for ``merge``."""
    cases = list(gplan.planned_cases or ())
    design = design_of(plan, len(cases))
    order = case_order(cases, run_id)
    slices = list(dict.fromkeys(gplan.planned_slices or ()))
    taken, decided = _prior(after, out, gplan, plan, order, suite)
    open_slices = [s for s in slices if s not in decided]
    look = min(taken + 1, len(design.counts)) if open_slices else taken
    body = {
        "look": look,
        "of": len(design.counts),
        "decided": [[s[0], s[1], at, what] for s, (at, what) in sorted(decided.items())],
        "case_order": order,
        "cases": list(design.counts),
        # The gated slices: the only jobs a look sends (NoLiMa's short base lengths, built beside the
        # grid, are in no slice: no look sends them, sharded or not, and merge must not wait for them).
        "slices": [[s[0], s[1]] for s in slices],
    }
    _write_json(out / SHARD_LOOK_FILE, body)
    batch = look_jobs(jobs, order[: design.counts[look - 1]], open_slices) if open_slices else []
    what = (
        f"look {look}/{len(design.counts)}: cases 1–{design.counts[look - 1]} of {len(order)} in "
        f"{len(open_slices)} open slice(s) ({len(batch)} layouts before the shard's split)"
        if open_slices
        else f"every slice decided by look {taken}: nothing to send"
    )
    print(f"depthgate: sequential shard, {what}", file=sys.stderr)
    return send(batch)


def _read_look_file(path: Path, keys: Sequence[str], fix: str, missing: str = "") -> dict[str, Any]:
    """A round's JSON file (``shard-look.json``, ``sequential-round.json``) with integer ``keys``, or a
    named error with ``fix``."""
    failures = ReadFailures(
        InputError,
        missing=(f"no {path.name}{missing}", fix),
        unreadable=(f"cannot read {path.name} ({{strerror}})", fix),
        not_json=(f"{path.name} is not valid JSON ({{msg}} at line {{lineno}})", fix),
    )
    data = read_json(path, failures)
    if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in keys):
        raise InputError(f"{path.name} names no {' and '.join(keys)}", file=str(path), fix=fix)
    return data


def read_shard_look(folder: Path) -> dict[str, Any]:
    """A sequential shard folder's ``shard-look.json`` (a named error when absent: the shard never ran)."""
    missing = ": this sequential shard never sent a look"
    return _read_look_file(folder / SHARD_LOOK_FILE, ("look",), "rerun that shard", missing)


def scheduled_jobs(planned: pl.DataFrame, spec: Mapping[str, Any]) -> pl.DataFrame:
    """The planned jobs a round scheduled up to ``spec``'s look: per gated slice, the cases of the look it
    was decided at, or of ``spec['look']`` while open (``spec``: a ``shard-look.json``). Jobs outside the
    gated slices (the short base lengths of NoLiMa's base score) are never scheduled by a look; a
    ``shard-look.json`` written before it named its slices counts every planned slice."""
    look, order, counts = int(spec["look"]), list(spec["case_order"]), list(spec["cases"])
    until = {(int(d[0]), str(d[1])): int(d[2]) for d in spec.get("decided", [])}
    gated = {(int(s[0]), str(s[1])) for s in spec["slices"]} if "slices" in spec else None
    rank = {c: i for i, c in enumerate(order)}
    mask = [
        (gated is None or (int(t), str(p)) in gated)
        and rank.get(str(c), len(order)) < counts[min(look, until.get((int(t), str(p)), look)) - 1]
        for c, t, p in planned.select("case_id", "target_tokens", "position").iter_rows()
    ]
    return planned.filter(pl.Series(mask, dtype=pl.Boolean))


def write_round(merged: Path, spec: Mapping[str, Any], shards: int) -> None:
    """The round a merged folder holds (``spec``: the shards' common ``shard-look.json``)."""
    _write_json(merged / ROUND_FILE, {"look": int(spec["look"]), "of": int(spec["of"]), "shards": shards})


def refuse_open_round(run: Path, section: Mapping[str, Any]) -> None:
    """``gate`` on the merge of a round before the last one, while some slice is still open: no verdict
    (exit ROUND_OPEN, not INFRA: nothing was lost and rerunning ``gate`` sends nothing). Says which round,
    which slices are decided and which are open, and the next round's commands. ``section``: the
    replayed ``sequential`` section of the folder (a slice still open has its look at the final look)."""
    path = run / ROUND_FILE
    if not path.is_file():
        return
    spec = _read_look_file(path, ("look", "of", "shards"), "merge the round's shards again")
    look, of, shards = (int(spec[k]) for k in ("look", "of", "shards"))
    slices = list(section["slices"])
    still = [f"{s['length']}/{s['position']}" for s in slices if int(s["look"]) > look]
    if look >= of or not still:
        return
    done = [
        f"{s['length']}/{s['position']} {s['decision']} (look {s['look']})"
        for s in slices
        if int(s["look"]) <= look
    ]
    raise RoundOpenError(
        f"round {look} of at most {of} of a sharded sequential run ({shards} shards) is merged here: no "
        f"verdict until the last round. Decided: {', '.join(done) or 'none yet'}; still open: "
        f"{', '.join(still)} (their look {look + 1} is not sent yet; nothing is lost)",
        file=str(run),
        fix=f"send round {look + 1}: on every shard i of {shards}, depthgate run MATRIX --shard i/{shards} "
        f"--out DIR_i --after {run}; then depthgate merge DIR_1 … DIR_{shards} --out MERGED_{look + 1} "
        f"and depthgate gate MERGED_{look + 1}",
    )

"""``depthgate run MATRIX``: build → pre-send check → run (paired, resumable) → score → gate → report.

The run folder holds everything a verdict depends on::

    RUN/manifest.json            frozen before the first request: every digest and version
    RUN/<arm>/layouts.parquet    token-exact layouts per arm (baseline, candidate)
    RUN/records/…  records.parquet   raw results, appended atomically (a killed run resumes)
    RUN/scored.parquet           oracle scores
    RUN/report/                  verdict.json, summary.md, junit.xml, report.html, heatmaps

The analysis plan and the case set are digested into the manifest before anything runs; a rerun of
the same folder with a changed plan or suite is refused (PlanChangedError), so nobody can tune the
plan after seeing the data.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from depthgate.commands.belonging import check_records_belong
from depthgate.commands.checks import canary_jobs, check_reports
from depthgate.commands.console import note_endpoints
from depthgate.commands.endpoints import print_endpoint_counts, run_endpoint_counts
from depthgate.commands.freeze import (
    MANIFEST,
    SUITE_FILE,
    ArmSetup,
    arm_setup,
    build_manifest,
    freeze_manifest,
    freeze_suite,
    gate_plan,
    matrix_conversation,
    plan_digest,
)
from depthgate.commands.outputs import CreatedPaths
from depthgate.commands.planned import planned_jobs, shard_jobs
from depthgate.commands.run_inputs import matrix_and_suite
from depthgate.commands.sequential_shards import check_after
from depthgate.exceptions import ExitCode, InputError, PlanChangedError
from depthgate.judge.gate import GateResult, gate
from depthgate.layout.layouts import (
    build_layouts,
    parse_positions,
    read_layouts,
)
from depthgate.spec.cases import Suite
from depthgate.spec.files import ReadFailures, atomic_write, read_json, require_file
from depthgate.spec.loading import load_matrix, parse_spec
from depthgate.spec.manifest import RunManifest
from depthgate.spec.matrix import Matrix
from depthgate.spec.models import AnalysisPlan
from depthgate.spec.positions import SPACING_SEP, split_position_label

if TYPE_CHECKING:
    from depthgate.run.options import RunOptions
    from depthgate.run.store import LayoutStore

ARMS = ("baseline", "candidate")
CONTROLS_FILE = "controls.parquet"
CONTROLS_DIR = "controls"
CANARIES_DIR = "canaries"  # depthgate.run.canary.CANARIES_DIR
AA_FILE = "aa.json"  # marks an A/A run (depthgate run --aa); the gate adds the noise floor


@dataclass
class _Sending:
    """What a run sends, gathered arm by arm: the backends, the jobs of the matrix, its controls and
    canaries, and the layout stores the runner reads ids and text from."""

    backends: dict[str, Any] = field(default_factory=dict)
    jobs: list[tuple[str, Mapping[str, Any]]] = field(default_factory=list)
    control_jobs: list[tuple[str, Mapping[str, Any]]] = field(default_factory=list)
    canaries: list[tuple[str, Mapping[str, Any]]] = field(default_factory=list)
    sources: dict[str, LayoutStore] = field(default_factory=dict)
    control_sources: dict[str, LayoutStore] = field(default_factory=dict)
    canary_sources: dict[str, LayoutStore] = field(default_factory=dict)
    #: A sharded sequential run's previous round (``run --after``, commands/sequential_shards.py).
    after: Path | None = None


def _prepare_arm(
    a: ArmSetup,
    sent: _Sending,
    *,
    matrix: Matrix,
    matrix_path: Path,
    suite: Suite,
    out: Path,
    verification: str,
    engine: str,
    controls: bool,
    shard: tuple[int, int] | None,
    concurrency: int,
    aa: bool,
) -> None:
    """One arm, before anything is sent: its layouts built, its backend started and probed, the server's
    tokenizer checked, every layout through the pre-send gate, its controls and canaries; the jobs and
    stores go to ``sent``."""
    from depthgate.layout.presend import guard_layouts
    from depthgate.run.backends import make_backend, probe_backend
    from depthgate.run.controls import build_controls, read_controls
    from depthgate.run.parity import summary_lines, verify_arm

    layout_path = out / a.arm / "layouts.parquet"
    if not layout_path.is_file():
        # An A/A run measures the noise of the gated slices: no short lengths for a base score.
        build_layouts(
            suite, a.tokenizer, a.build_options(matrix, verification, base_lengths=not aa), layout_path
        )
    # The arm's runtime block configures the backend; its relative paths are the matrix file's.
    if engine == "ray":  # no engine in the driver: the actors hold them
        from depthgate.run.ray_engine import driver_backend

        backend = driver_backend(a.system, base_dir=matrix_path.parent)
    else:
        backend = make_backend(a.system, tokenizer=None, base_dir=matrix_path.parent)
    sent.backends[a.arm] = backend
    # Every endpoint probed before the first request (served model, window; replicas that
    # disagree are refused, exit 20), so the pre-send gate below checks the served window.
    asyncio.run(probe_backend(backend))
    # The server's own tokenizer on built prompts, before anything is sent (exit 22 on a
    # difference; a route that fails refuses per runtime.tokenizer_parity): a sample for id arms,
    # every prompt for text arms.
    policy = a.system.runtime.tokenizer_parity
    for line in summary_lines(verify_arm(a.arm, backend, layout_path, out / a.arm, a.tokenizer, policy)):
        print(line, file=sys.stderr)
    note_endpoints(a.arm, backend, concurrency)
    # The pre-send gate: built under this system's tokenizer, Rust pre-send checks against
    # the *served* window and the system's template, and a full re-encode of every layout —
    # in bounded batches; the jobs keep only small columns, ids and text are read from the
    # arm's layout store when each request is sent (memory O(batch + in flight)).
    guard = functools.partial(
        guard_layouts,
        tokenizer=a.tokenizer,
        template=a.template,
        preamble=a.system.preamble,
        assembler=a.system.assembler,
        window=backend.window,
        max_output_tokens=matrix.decode.max_tokens,
        conversation=matrix_conversation(matrix),
    )
    guard_cases = functools.partial(guard, cases={c.id: c for c in suite.cases})
    sent.jobs.extend((a.arm, row) for row in _guarded_rows(layout_path, guard_cases))
    sent.sources[a.arm] = _store(layout_path, out / a.arm / "store")
    if controls:
        # Controls beside the matrix: evidence-only short input and evidence-absent haystack.
        control_path = out / a.arm / CONTROLS_FILE
        if not control_path.is_file():
            # at the gated lengths only (the base lengths need no controls)
            gated = a.build_options(matrix, verification, base_lengths=False)
            build_controls(suite, a.tokenizer, gated, control_path)
        # A controls file, or a named error; only small columns (not every control's ids).
        read_controls(control_path, columns=["layout_id", "control"])
        sent.control_sources[a.arm] = _store(control_path, out / a.arm / "controls-store")
        # Controls differ in token count between arms (a preamble, a template, another
        # tokenizer): they pair by case, control kind and *nominal* length (the matrix length
        # an evidence-absent control was cut from; 0 for evidence-only).
        sent.control_jobs.extend(
            (a.arm, {**row, "target_tokens": row["nominal_tokens"]})
            for row in _guarded_rows(control_path, guard, controls=True)
        )
    if matrix.canaries:
        # Full-length canaries (commands/checks.py): did the whole prompt reach the model? A shard
        # sends the canaries of its part (the runner splits every job list by content, shard_of) and
        # `merge` joins them like the controls; a sharded run used to send none, and say nothing.
        arm_canaries, sent.canary_sources[a.arm] = canary_jobs(
            a.arm,
            matrix.canaries,
            a.tokenizer,
            a.build_options(matrix, verification, base_lengths=False),
            out / a.arm,
            guard,
            _guarded_rows,
            _store,
        )
        sent.canaries.extend(arm_canaries)


def _matrix_sender(
    matrix: Matrix,
    suite: Suite,
    out: Path,
    sent: _Sending,
    run_jobs: Callable[..., Any],
    options: RunOptions,
) -> Callable[[], Any] | None:
    """How the matrix's jobs go out when not all at once: look by look for ``stop_rule = "sequential"``
    (issue #26, :func:`depthgate.commands.sequential.run_looks`; a shard sends one look a round:
    :func:`depthgate.commands.sequential_shards.send_shard_look`); None otherwise."""
    if matrix.plan.stop_rule != "sequential":
        return None
    from depthgate.commands.sequential import record_scorer, run_gate_plan, run_looks

    def send(batch: list[tuple[str, Mapping[str, Any]]]) -> Any:
        return run_jobs(batch, sent.backends, out, options, sent.sources)

    gplan = run_gate_plan(matrix, suite)
    if options.shard is not None:  # one look a round (commands/sequential_shards.py)
        from depthgate.commands.sequential_shards import send_shard_look

        return functools.partial(
            send_shard_look, sent.jobs, send, gplan, matrix.plan, options.run_id, out, suite, sent.after
        )
    # look by look, every record so far scored between looks
    scorer = record_scorer(out, suite, out)
    return functools.partial(run_looks, sent.jobs, send, scorer, gplan, matrix.plan, options.run_id, out)


def _send(
    sent: _Sending,
    run_jobs: Callable[..., Any],
    out: Path,
    options: RunOptions,
    matrix_sender: Callable[[], Any] | None = None,
) -> None:
    """The matrix's jobs (all at once, or by ``matrix_sender``: look by look for a sequential plan), then
    its controls and canaries (each into its own records folder); when the circuit opens (an endpoint is
    down) nothing more is sent: the report says INFRA, a rerun resumes."""
    if matrix_sender is not None:
        summary = matrix_sender()
    else:
        summary = run_jobs(sent.jobs, sent.backends, out, options, sent.sources)
    if summary.circuit_open is not None:
        why = getattr(summary, "circuit_reason", None) or (
            f"{options.retry.breaker_after} consecutive transient failures"
        )
        print(
            f"depthgate: circuit open on arm {summary.circuit_open!r}, stopped sending: {why} "
            f"({summary.written} records written, the rest are re-sent by a rerun of the same folder)",
            file=sys.stderr,
        )
        sent.control_jobs.clear()
        sent.canaries.clear()
    if sent.control_jobs:
        controls_options = dataclasses.replace(options, run_id=options.run_id + "-controls")
        run_jobs(sent.control_jobs, sent.backends, out / CONTROLS_DIR, controls_options, sent.control_sources)
    if sent.canaries:
        canary_options = dataclasses.replace(options, run_id=options.run_id + "-canaries")
        run_jobs(sent.canaries, sent.backends, out / CANARIES_DIR, canary_options, sent.canary_sources)


def run_matrix(
    matrix_path: str | Path,
    out_dir: str | Path,
    *,
    concurrency: int = 4,
    progress: bool | None = None,
    verification: str = "full",
    controls: bool = True,
    shard: tuple[int, int] | None = None,
    aa: bool = False,
    engine: str = "asyncio",
    ray_actors: int | None = None,
    after: Path | None = None,
) -> tuple[GateResult | None, ExitCode, Path]:
    """Build → pre-send check → run (paired, resumable) → score → gate → report.

    With ``shard = (i, N)`` only the pairs of shard i of N run (``depthgate.run.jobs.shard_of``: by
    content, both arms of a pair together); the folder holds the same frozen manifest as every other
    shard and no verdict: ``depthgate merge`` joins the N folders, then ``gate`` judges the whole.
    Returns ``(None, PASS or INFRA, out)`` for a shard. ``aa``: the baseline against a repeat of itself
    (:func:`depthgate.commands.plan.aa_matrix`); the gate then adds the A/A noise floor to the reports.
    ``engine = "ray"``: the requests run on Ray Data (:mod:`depthgate.run.ray_engine`), same jobs, same
    record sink; ``ray_actors`` sizes its actor pool. ``after``: see ``_Sending.after``.
    """
    from depthgate.run.options import RunOptions

    matrix_path = Path(matrix_path)
    matrix, suite = matrix_and_suite(matrix_path, aa=aa, controls=controls, shard=shard, after=after)
    run_jobs = _engine(engine, matrix, matrix_path.parent, ray_actors)  # refused before anything is built
    out = Path(out_dir)
    arms = [
        arm_setup(arm, sys_, matrix_path.parent)
        for arm, sys_ in zip(ARMS, (matrix.baseline, matrix.candidate), strict=True)
    ]
    body = build_manifest(matrix, matrix_path, suite, arms, aa=aa)
    if shard is not None:  # the folder checks before anything is written, built or sent (issue #37)
        _check_shard(out, shard, body, after=after, aa=aa)
    # A folder this call starts (no manifest yet) is removed again when anything fails before a request.
    fresh = None if (out / MANIFEST).is_file() else CreatedPaths(out)
    sending = False
    sent = _Sending(after=after)
    try:
        manifest = freeze_manifest(out, body)
        freeze_suite(out, suite)
        for a in arms:
            _prepare_arm(
                a,
                sent,
                matrix=matrix,
                matrix_path=matrix_path,
                suite=suite,
                out=out,
                verification=verification,
                engine=engine,
                controls=controls,
                shard=shard,
                concurrency=concurrency,
                aa=aa,
            )
        _warn_power(matrix, suite)
        if aa:
            _mark_aa(out, matrix)
        print(
            f"depthgate: {manifest['run_id']}: {len(sent.jobs)} layouts × {len(matrix.decode.seeds)} seed(s) "
            f"on 2 arms → {out}",
            file=sys.stderr,
        )
        options = RunOptions(
            run_id=manifest["run_id"],
            manifest_digest=manifest["manifest_digest"],
            decode=matrix.decode,
            concurrency=concurrency,
            seeds=matrix.decode.seeds,
            progress=progress,
            shard=shard,
            order=matrix.order,
        )
        if shard is not None:
            _freeze_shard(out, shard)
        sending = True
        _send(sent, run_jobs, out, options, _matrix_sender(matrix, suite, out, sent, run_jobs, options))
        print_endpoint_counts(out, sent.backends)
        for a in arms:
            if a.system.runtime.cache_control:
                _cache_control(a, out, matrix.decode.max_tokens, matrix_path.parent)
    except BaseException:
        if fresh is not None and not sending:
            fresh.undo()
        raise
    finally:
        for backend in sent.backends.values():
            # Closing must not hide the run's own error.
            with contextlib.suppress(Exception):
                asyncio.run(backend.aclose())
    _compact(out, sent)
    if shard is not None:
        return None, _shard_exit(out, matrix, shard), out
    return gate_run(out, matrix=matrix, suite=suite)


def _shard_exit(out: Path, matrix: Matrix, shard: tuple[int, int]) -> ExitCode:
    """A shard has no verdict: INFRA when any of its planned runs is lost, else PASS."""
    from depthgate.judge.health import infra_summary
    from depthgate.run.records import read_records

    planned = planned_jobs(out, matrix.decode.seeds)
    if matrix.plan.stop_rule == "sequential":  # this round's look, not the whole matrix
        from depthgate.commands.sequential_shards import read_shard_look, scheduled_jobs

        planned = scheduled_jobs(planned, read_shard_look(out))
    planned = shard_jobs(planned, shard)
    return ExitCode.INFRA if infra_summary(read_records(out), planned).lost else ExitCode.PASS


SHARD_FILE = "shard.json"


def _engine(engine: str, matrix: Matrix, base: Path, ray_actors: int | None) -> Callable[..., Any]:
    """The function that runs the jobs: the asyncio runner, or Ray Data (refused before anything is
    built when Ray is not installed, exit 20, or when an arm sets what the Ray engine does not run)."""
    from depthgate.run.runner import run_pairs

    if engine == "asyncio":
        if ray_actors is not None:
            raise InputError(
                "--ray-actors is an option of --engine ray", field="--ray-actors", fix="add --engine ray"
            )
        return run_pairs
    if engine != "ray":
        raise InputError(f"unknown engine {engine!r}", field="--engine", fix="use asyncio or ray")
    from depthgate.run.ray_engine import RayOptions, import_ray, refuse_unsupported, run_pairs_ray

    import_ray()
    systems = dict(zip(ARMS, (matrix.baseline, matrix.candidate), strict=True))
    refuse_unsupported(systems)
    return functools.partial(
        run_pairs_ray, systems=systems, base_dir=base, ray_options=RayOptions.from_env(actors=ray_actors)
    )


def _guarded_rows(
    path: Path, guard: Callable[[pl.DataFrame], pl.DataFrame], *, controls: bool = False
) -> list[dict[str, Any]]:
    """Every layout of ``path`` through the pre-send ``guard``, in bounded batches, as small rows
    (no ``token_ids``/``text``: the runner reads them from the layout store when it sends)."""
    from depthgate.run.controls import with_nominal_tokens
    from depthgate.run.store import iter_layout_batches

    rows: list[dict[str, Any]] = []
    for batch in iter_layout_batches(path):
        checked = guard(with_nominal_tokens(batch) if controls else batch)
        rows.extend(checked.drop("token_ids", "text").iter_rows(named=True))
    return rows


def _store(layouts: Path, folder: Path) -> LayoutStore:
    """The arm's layout store (ids and text on disk), written once from its layouts file."""
    from depthgate.run.store import INDEX_FILE, LayoutStore, write_layout_store

    if (folder / INDEX_FILE).is_file():
        return LayoutStore(folder)
    return write_layout_store(layouts, folder)


def _compact(out: Path, sent: _Sending) -> None:
    """Merge the record shards of the matrix, its controls and its canaries, each in its folder."""
    from depthgate.run.records import compact

    compact(out)
    if sent.control_jobs:
        compact(out / CONTROLS_DIR)
    if sent.canaries:
        compact(out / CANARIES_DIR)


def _check_shard(
    out: Path, shard: tuple[int, int], body: Mapping[str, Any], *, after: Path | None, aa: bool
) -> None:
    """A rerun into a shard's folder must name the same shard, and ``--after`` must be the previous
    round's merge of this run (:func:`check_after`): checked before any work."""
    path = out / SHARD_FILE
    if path.is_file():
        old = read_json(path, _run_file_failures("shard.json"))
        if old != {"index": shard[0], "count": shard[1]}:
            said = f"{old.get('index')}/{old.get('count')}" if isinstance(old, dict) else "another shard"
            raise PlanChangedError(
                f"this folder holds shard {said}, not {shard[0]}/{shard[1]}",
                file=str(path),
                field="--shard",
                fix="resume a shard into its own folder",
            )
    if after is not None:
        check_after(after, body, shard=shard, aa=aa)


def _freeze_shard(out: Path, shard: tuple[int, int]) -> None:
    """Record which shard a folder holds (:func:`_check_shard` refused another one before any work)."""
    path = out / SHARD_FILE
    body = {"index": shard[0], "count": shard[1]}
    if path.is_file():
        return
    atomic_write(path, json.dumps(body))


def _cache_control(a: ArmSetup, out: Path, max_tokens: int, base: Path) -> None:
    """The warm/cold prefix-cache control (:mod:`depthgate.run.cache`) on an arm's layouts, when its
    runtime block asks for it (``cache_control = true``): ``<arm>/cache_control.json`` (summary, incident,
    per-layout rows), once per run folder. It never changes the verdict."""
    from depthgate.run.backends import make_cache_control_backends
    from depthgate.run.cache import run_cache_control

    arm_dir = out / a.arm
    path = arm_dir / "cache_control.json"
    if not path.is_file():
        layouts = read_layouts(arm_dir / "layouts.parquet")
        cold, warm = make_cache_control_backends(a.system, base_dir=base)
        with cold, warm:
            report = run_cache_control(layouts, cold=cold, warm=warm, max_tokens=max_tokens)
        body = {
            "ok": report.ok,
            "summary": report.summary(),
            "incident": None if report.incident is None else dataclasses.asdict(report.incident),
            "rows": [row.to_dict() for row in report.rows],
        }
        atomic_write(path, json.dumps(body, indent=2, ensure_ascii=False))
    summary = json.loads(path.read_text(encoding="utf-8"))["summary"]
    print(f"depthgate: {a.arm}: {summary} ({path})", file=sys.stderr)


def _run_file_failures(name: str) -> ReadFailures:
    """How a run folder's own JSON file (``manifest.json``, ``shard.json``) fails to read, in words."""
    fix = "restore the file written by `depthgate run`, or run again into a new folder"
    return ReadFailures(
        InputError,
        missing=(f"no {name}", fix),
        unreadable=(f"cannot read {name} ({{strerror}})", fix),
        not_utf8=(f"{name} is not UTF-8 text ({{reason}})", fix),
        not_json=(f"{name} is not valid JSON ({{msg}} at line {{lineno}} column {{colno}})", fix),
    )


def _frozen_run(
    run: Path, matrix: Matrix | None, suite: Suite | None
) -> tuple[dict[str, Any], RunManifest, AnalysisPlan, Suite]:
    """The run folder's frozen manifest (as read, and parsed), its analysis plan and case set, each
    checked against its digest; a matrix that disagrees with the frozen plan is refused."""
    from depthgate.spec.suites import resolve_suite

    manifest_path = run / MANIFEST
    if (run / SHARD_FILE).is_file():
        spec = read_json(run / SHARD_FILE, _run_file_failures("shard.json"))
        spec = spec if isinstance(spec, dict) else {}
        raise InputError(
            f"this folder holds only shard {spec.get('index')}/{spec.get('count')} of the run",
            file=str(run),
            fix="join every shard folder with `depthgate merge DIR_1 … DIR_N --out DIR`, then gate DIR",
        )
    fix = "pass a folder written by `depthgate run`"
    require_file(manifest_path, InputError, "no manifest.json in the run folder", fix=fix, file=str(run))
    manifest = read_json(manifest_path, _run_file_failures("manifest.json"))
    frozen = parse_spec(RunManifest, manifest, file=str(manifest_path))
    lengths, positions = list(frozen.lengths), list(frozen.positions)
    matrix_file = Path(frozen.matrix_file)
    if frozen.plan is not None:
        plan = parse_spec(AnalysisPlan, frozen.plan, file=str(manifest_path))
    else:  # a manifest from before the plan was frozen into it
        matrix = matrix or load_matrix(matrix_file)
        plan = matrix.plan
    if plan_digest(plan, lengths, positions) != frozen.plan_digest:
        raise PlanChangedError(
            "the analysis plan or slice list in manifest.json does not match its plan digest",
            file=str(manifest_path),
            field="plan_digest",
            fix="restore the manifest written by `depthgate run`; a plan is never edited after the data",
        )
    if matrix is None and matrix_file.is_file():
        matrix = load_matrix(matrix_file)
    if matrix is not None:
        # The slice list and plan are the frozen manifest's; a matrix that disagrees is refused.
        now = plan_digest(matrix.plan, matrix.lengths, matrix.position_values())
        if now != frozen.plan_digest:
            raise PlanChangedError(
                "the matrix's analysis plan or slice list (lengths × positions) differs from the plan this "
                f"run was frozen with (lengths {lengths}, positions {positions})",
                file=str(matrix_file),
                field="plan",
                fix="gate with the matrix the run was started with, or start a new run folder",
            )
    if suite is None:
        if (run / SUITE_FILE).is_file():
            from depthgate.spec.loading import load_suite

            suite = load_suite(run / SUITE_FILE)
        elif matrix is not None:
            suite = resolve_suite(matrix.suite, base_dir=matrix_file.parent)
        else:
            raise InputError(
                "the run folder has no suite.json and its matrix file is gone",
                file=str(run),
                fix=f"restore {matrix_file} or the run folder's suite.json",
            )
    if suite.digest() != frozen.suite_digest:
        raise PlanChangedError(
            "the case set differs from the one this run was frozen with",
            file=str(matrix_file),
            field="suite",
            fix="gate with the original suite",
        )
    return manifest, frozen, plan, suite


def _run_records(run: Path, manifest: Mapping[str, Any]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The run's records (one manifest's, each belonging to the folder's layouts) and the layouts'
    ids and evidence spans."""
    from depthgate.run.records import read_records

    records = read_records(run)
    if records.height == 0:
        raise InputError("the run folder has no records", file=str(run), fix="run `depthgate run` first")
    run_ids = records["run_id"].unique().to_list()
    digests = records["manifest_digest"].unique().to_list()
    if len(run_ids) != 1 or len(digests) != 1 or digests[0] != manifest["manifest_digest"]:
        raise InputError(
            f"records come from {len(digests)} different manifest(s) ({', '.join(map(str, run_ids))})",
            file=str(run),
            fix="gate one run folder per manifest; do not mix results",
        )
    by_arm = {
        arm: read_layouts(run / arm / "layouts.parquet", columns=["layout_id", "evidence_spans"])
        for arm in ARMS
    }
    check_records_belong(
        records,
        run_id=str(manifest.get("run_id")),
        manifest_digest=None,
        layout_ids={arm: frame["layout_id"] for arm, frame in by_arm.items()},
        folder=run,
        fix="gate a folder holding only its own run's records (restore records.parquet, or rerun into a new "
        "folder)",
    )
    return records, pl.concat(list(by_arm.values()))


def gate_run(
    run_dir: str | Path,
    *,
    matrix: Matrix | None = None,
    suite: Suite | None = None,
    report_dir: str | Path | None = None,
) -> tuple[GateResult, ExitCode, Path]:
    """Score, gate and report a run folder (its records, layouts and manifest)."""
    from depthgate.judge.health import infra_summary
    from depthgate.judge.scoring import score_records
    from depthgate.report.analyses import collect_sections
    from depthgate.report.document import AnalysisContext
    from depthgate.report.report import write_reports

    run = Path(run_dir)
    manifest, frozen, plan, suite = _frozen_run(run, matrix, suite)
    lengths, positions = list(frozen.lengths), list(frozen.positions)
    records, layouts = _run_records(run, manifest)
    scored = score_records(records, suite, layouts)
    scored.write_parquet(run / "scored.parquet")
    # The short lengths of NoLiMa's base score (issue #24) are measured beside the grid, never gated:
    # every view below (gate, report, controls, noise floor) sees the frozen matrix lengths only.
    base_lengths = list(frozen.base_lengths or [])
    base_scored = scored.filter(pl.col("length").is_in(base_lengths)) if base_lengths else None
    if base_lengths:
        scored = scored.filter(pl.col("length").is_in(lengths))
    scored_controls = _score_controls(run, suite)
    labels = [p.label for p in parse_positions(positions)]
    placed = [c.id for c in suite.cases if c.decisive]  # the cases build_layouts places
    eligibility = None
    if plan.primary_metric == "control_normalised":
        # The pre-registered primary metric: the gate sees only the cases the *baseline* can do at all
        # (its evidence-only control passes). Eligibility never depends on the candidate, or a
        # candidate that breaks the task would shrink its own denominators.
        eligibility = _baseline_eligible(run, scored_controls, placed)
        placed = [c for c in placed if c in eligibility["eligible"]]
    gated = scored if eligibility is None else scored.filter(pl.col("case_id").is_in(placed))
    # Slices with an evidence spacing hold only the multi-evidence cases (the ones a spacing moves).
    multi = {c.id for c in suite.cases if len(c.decisive) >= 2}
    has_spacing = any(split_position_label(label)[1] != "adjacent" for label in labels)
    spaced = [c for c in placed if c in multi] if has_spacing else None
    if has_spacing:  # a run built before single-evidence cases left the spaced slices: same view for all
        adjacent = pl.col("position").str.contains(SPACING_SEP, literal=True).not_()
        gated = gated.filter(adjacent | pl.col("case_id").is_in(sorted(multi)))
        scored = scored.filter(adjacent | pl.col("case_id").is_in(sorted(multi)))
    gplan = gate_plan(plan, lengths, labels, cases=placed, seeds=frozen.seeds, spaced_cases=spaced)
    planned = planned_jobs(run, frozen.seeds)
    sequential = None
    if plan.stop_rule == "sequential":  # the looks replayed from the records (commands/sequential.py)
        from depthgate.commands.sequential import gate_sequential, sent_jobs, write_look_log
        from depthgate.commands.sequential_shards import refuse_open_round

        result, sequential = gate_sequential(gated, gplan, plan, str(manifest["run_id"]))
        refuse_open_round(run, sequential)  # a shard round's merge: says so, not INFRA
        planned = sent_jobs(planned, sequential)
        write_look_log(sequential, run)
    else:
        result = gate(gated, gplan)
    infra = infra_summary(records, planned, endpoints=run_endpoint_counts(run))
    # The analyses beside the gate (controls, position science, noise floor …) contribute sections to
    # the same report document: one render, one write per file, one swap of the set.
    controls_path = run / "scored_controls.parquet"
    context = AnalysisContext(
        run=run,
        plan=plan,
        seeds=frozen.seeds,
        scored=scored,
        scored_controls=scored_controls,
        position_controls=(
            pl.read_parquet(controls_path)
            if (run / CONTROLS_DIR).is_dir() and controls_path.is_file()
            else None
        ),
        eligibility=eligibility,
        noise_plan=gate_plan(plan, lengths, labels),
        aa=(run / AA_FILE).is_file(),
        sequential=json.loads(json.dumps(sequential, default=str)) if sequential is not None else None,
        base_scored=base_scored,
    )
    sections = collect_sections(context)
    # The run's own layouts, for the length in characters, wherever the report goes (--report-dir).
    arm_layouts = {arm: run / arm / "layouts.parquet" for arm in ARMS}
    paths = write_reports(
        result,
        gated,
        Path(report_dir) if report_dir else run / "report",
        manifest=manifest,
        infra=infra,
        layouts=arm_layouts if all(p.is_file() for p in arm_layouts.values()) else None,
        checks=check_reports(run),
        sections=sections,
    )
    for section in sections:
        for line in section.console:
            print(line, file=sys.stderr)
    return result, paths.exit_code, paths.report_html


def _warn_power(matrix: Matrix, suite: Suite) -> None:
    """One stderr line before the first request when the plan is under-powered (default assumptions)."""
    from depthgate.commands.plan import power_warning

    line = power_warning(matrix, suite)
    if line:
        print(line, file=sys.stderr)


def _mark_aa(out: Path, matrix: Matrix) -> None:
    """Mark the folder as an A/A run (the gate adds the noise floor)."""
    path = out / AA_FILE
    atomic_write(path, json.dumps({"baseline": matrix.baseline.name}))


def _score_controls(run: Path, suite: Suite) -> pl.DataFrame | None:
    """The controls run beside the matrix, scored (and written to scored_controls.parquet); None when
    none ran."""
    from depthgate.judge.science import score_controls
    from depthgate.run.controls import read_controls
    from depthgate.run.records import read_records

    if not (run / CONTROLS_DIR).is_dir():
        return None
    records = read_records(run / CONTROLS_DIR)
    if records.height == 0:
        return None
    controls = pl.concat(
        [
            # The scorer reads ids, kinds and spans — never the controls' token ids and text.
            read_controls(run / arm / CONTROLS_FILE, columns=["layout_id", "control", "evidence_spans"])
            for arm in ARMS
            if (run / arm / CONTROLS_FILE).is_file()
        ]
    )
    scored_controls = score_controls(records, suite, controls)
    scored_controls.write_parquet(run / "scored_controls.parquet")
    return scored_controls


def _baseline_eligible(
    run: Path, scored_controls: pl.DataFrame | None, placed: Sequence[str]
) -> dict[str, Any]:
    """The cases whose baseline evidence-only control passed at every length it ran (the primary metric
    ``control_normalised``); refused when the run has no controls to decide it."""
    only = (
        None
        if scored_controls is None
        else scored_controls.filter((pl.col("control") == "evidence_only") & (pl.col("arm") == "baseline"))
    )
    if only is None or only.height == 0:
        raise InputError(
            "the plan's primary metric is control_normalised, but this run has no baseline "
            "evidence-only controls to decide which cases count",
            file=str(run),
            field="plan.primary_metric",
            fix='run again without --no-controls, or pre-register primary_metric = "pass"',
        )
    failed = set(only.filter(pl.col("outcome") != "pass")["case_id"].to_list())
    ran = set(only["case_id"].to_list())
    eligible = [c for c in placed if c in ran and c not in failed]
    return {
        "metric": "control_normalised",
        "eligible": eligible,
        "n_eligible": len(eligible),
        "n_placed": len(placed),
        "excluded": [c for c in placed if c not in eligible],
    }


__all__ = [
    "ARMS",
    "MANIFEST",
    "SUITE_FILE",
    "ArmSetup",
    "arm_setup",
    "gate_plan",
    "gate_run",
    "plan_digest",
    "run_matrix",
    "shard_jobs",
]

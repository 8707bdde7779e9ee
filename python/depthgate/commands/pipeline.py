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
import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from depthgate.commands.belonging import check_records_belong
from depthgate.commands.checks import canary_jobs, check_reports
from depthgate.commands.console import note_endpoints
from depthgate.commands.endpoints import print_endpoint_counts, run_endpoint_counts
from depthgate.commands.outputs import CreatedPaths
from depthgate.exceptions import ExitCode, InputError, PlanChangedError
from depthgate.judge.stats import GatePlan, GateResult, gate
from depthgate.layout.layouts import (
    ASSEMBLER_VERSION,
    BuildOptions,
    Tokenizer,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.layout.model_files import is_model_reference, load_template, resolve_model_files
from depthgate.layout.templates import ChatTemplate
from depthgate.spec.files import ReadFailures, dist_version, read_json
from depthgate.spec.models import (
    SPACING_SEP,
    AnalysisPlan,
    Matrix,
    RunManifest,
    Suite,
    System,
    canonical_json,
    load_matrix,
    parse_spec,
    split_position_label,
)

if TYPE_CHECKING:
    from depthgate.run.store import LayoutStore

ARMS = ("baseline", "candidate")
MANIFEST = "manifest.json"
SUITE_FILE = "suite.json"
CONTROLS_FILE = "controls.parquet"
CONTROLS_DIR = "controls"
CANARIES_DIR = "canaries"  # depthgate.run.canary.CANARIES_DIR
AA_FILE = "aa.json"  # marks an A/A run (depthgate run --aa); the gate adds the noise floor


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "depthgate_assembler": ASSEMBLER_VERSION}
    for dist in (
        "depthgate",
        "tokenizers",
        "polars",
        "numpy",
        "statsmodels",
        "pydantic",
        "llama_cpp_python",
        "jinja2",
    ):
        version = dist_version(dist.replace("_", "-"))
        if version is not None:
            out[dist] = version
    return out


def gate_plan(
    plan: AnalysisPlan,
    lengths: list[int],
    positions: list[str],
    *,
    cases: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    spaced_cases: Sequence[str] | None = None,
) -> GatePlan:
    """The statistical gate's parameters from the frozen analysis plan; the planned slices are the
    matrix's full length × position grid, so a slice that produced no data is INCONCLUSIVE, not absent.

    ``cases`` (the frozen suite's placeable case ids: ``[c.id for c in suite.cases if c.decisive]``, the
    cases ``build_layouts`` places) and ``seeds`` (the manifest's seed set) make the gate count missing
    data against the plan instead of the records. The stop rule is passed on: under "one_extension"
    every look tests at alpha / 2. The plan was validated by ``AnalysisPlan``/``Matrix`` with the same
    rules ``GatePlan`` applies (``depthgate.spec.models.plan_violations``), so this never refuses a plan
    after the requests were sent.
    """
    return GatePlan(
        margin=plan.margin,
        alpha=plan.alpha,
        n_min=plan.n_min,
        floor=plan.floor,
        fdr_method=plan.fdr_method,
        max_missing=plan.max_missing,
        bootstrap_reps=plan.bootstrap_resamples,
        bootstrap_seed=plan.bootstrap_seed,
        planned_slices=tuple((length, pos) for length in lengths for pos in positions),
        stop_rule=plan.stop_rule,
        planned_cases=None if cases is None else tuple(cases),
        planned_seeds=None if seeds is None else tuple(int(s) for s in seeds),
        spaced_cases=tuple(spaced_cases) if spaced_cases else None,
    )


@dataclass(frozen=True)
class ArmSetup:
    arm: str
    system: System
    tokenizer: Tokenizer
    template: ChatTemplate | None
    snapshots: dict[str, Any] = field(default_factory=dict)

    def build_options(self, matrix: Matrix, verification: str) -> BuildOptions:
        """How this arm's layouts are built from the matrix (``depthgate run`` and ``build --matrix``
        alike): the same options give the same layout ids."""
        return BuildOptions(
            lengths=matrix.built_lengths(),
            positions=parse_positions(matrix.position_values()),
            template=self.template,
            preamble=self.system.preamble,
            system=self.system.name,
            assembler=self.system.assembler,
            verification="fast" if verification == "fast" else "full",
            window=self.system.window,
            max_output_tokens=matrix.decode.max_tokens,
        )


def _snapshots(system: System, matrix_dir: Path) -> dict[str, Any]:
    """The model snapshots (folder or ``hf:``) the arm's tokenizer and template come from: revision and
    file digests, for the manifest. Empty for plain files (their digests are the tokenizer/template's)."""
    out: dict[str, Any] = {}
    for name, spec in (("tokenizer", system.tokenizer), ("chat_template", system.chat_template)):
        if spec and is_model_reference(spec, base_dir=matrix_dir):
            out[name] = resolve_model_files(spec, base_dir=matrix_dir).manifest()
    return out


def arm_setup(arm: str, system: System, matrix_dir: Path) -> ArmSetup:
    tok = load_tokenizer(system.tokenizer, base_dir=matrix_dir)
    template = load_template(system.chat_template, base_dir=matrix_dir) if system.chat_template else None
    return ArmSetup(
        arm=arm, system=system, tokenizer=tok, template=template, snapshots=_snapshots(system, matrix_dir)
    )


def plan_digest(plan: AnalysisPlan, lengths: Sequence[int], positions: Sequence[str]) -> str:
    """The pre-registered plan: the analysis plan *and* the slice list (lengths × positions). Dropping
    a position or a length after the data is seen changes this digest and is refused."""
    body = {"plan": plan.model_dump(mode="json"), "lengths": list(lengths), "positions": list(positions)}
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def _manifest(
    matrix: Matrix, matrix_path: Path, suite: Suite, arms: list[ArmSetup], *, aa: bool = False
) -> dict[str, Any]:
    from depthgate.run.backends import determinism_settings

    systems: dict[str, dict[str, Any]] = {}
    for a in arms:
        systems[a.arm] = {
            "name": a.system.name,
            "backend": a.system.backend,
            "model": a.system.model,
            "system_digest": a.system.digest(),
            "tokenizer_digest": a.tokenizer.digest,
            "template_digest": a.template.digest if a.template else "raw",
            "pinned_date": a.template.pinned_date.isoformat() if a.template else "",
            "assembler": a.system.assembler,
            "assembler_version": ASSEMBLER_VERSION,
        }
        if a.snapshots:  # only then: manifests of runs on plain files digest exactly as before
            systems[a.arm]["snapshots"] = a.snapshots
    body = {
        "matrix": matrix.name,
        "matrix_file": str(matrix_path),
        "matrix_digest": matrix.digest(),
        "plan_digest": plan_digest(matrix.plan, matrix.lengths, matrix.position_values()),
        "plan": matrix.plan.model_dump(mode="json"),
        "suite_digest": suite.digest(),
        "suite": {"name": suite.name, "cases": len(suite.cases)},
        "seeds": list(matrix.decode.seeds),
        "decode": matrix.decode.model_dump(),
        "lengths": list(matrix.lengths),
        "positions": matrix.position_values(),
        "systems": systems,
        "versions": _versions(),
    }
    if matrix.plan.short_base_lengths() and not aa:  # only then: other manifests digest as before
        body["base_lengths"] = matrix.plan.short_base_lengths()
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    # The run id binds the plan, suite and systems: the same matrix reruns into the same id (resume).
    body["run_id"] = f"{matrix.name}-{digest[:12]}"
    body["manifest_digest"] = digest
    body["determinism"] = {a.arm: determinism_settings(a.system, matrix.decode) for a in arms}
    body["created_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return body


def _freeze_manifest(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the manifest once; on a rerun require the same plan, suite and systems."""
    path = out / MANIFEST
    RunManifest.model_validate(manifest)
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        for key, what in (
            ("plan_digest", "analysis plan"),
            ("suite_digest", "case set"),
            ("manifest_digest", "systems, seeds or versions"),
        ):
            if old.get(key) != manifest.get(key):
                raise PlanChangedError(
                    f"the {what} changed since this run started ({key} {str(old.get(key))[:12]} → "
                    f"{str(manifest.get(key))[:12]})",
                    file=str(path),
                    fix="start a new run folder (--out) for a new plan; a plan is never changed after data",
                )
        return dict(old)
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return manifest


def _freeze_suite(out: Path, suite: Suite) -> None:
    """The case set beside the manifest: the gate reads it from the run folder, never from the matrix's
    suite reference resolved against whatever directory the gate runs in."""
    path = out / SUITE_FILE
    if path.is_file():
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(suite.model_dump_json(), encoding="utf-8")
    os.replace(tmp, path)


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
) -> tuple[GateResult | None, ExitCode, Path]:
    """Build → pre-send check → run (paired, resumable) → score → gate → report.

    With ``shard = (i, N)`` only the pairs of shard i of N run (``depthgate.run.runner.shard_of``: by
    content, both arms of a pair together); the folder holds the same frozen manifest as every other
    shard and no verdict: ``depthgate merge`` joins the N folders, then ``gate`` judges the whole.
    Returns ``(None, PASS or INFRA, out)`` for a shard. ``aa``: the baseline against a repeat of itself
    (:func:`depthgate.commands.plan.aa_matrix`); the gate then adds the A/A noise floor to the reports.
    ``engine = "ray"``: the requests run on Ray Data (:mod:`depthgate.run.ray_engine`), same jobs, same
    record sink; ``ray_actors`` sizes its actor pool.
    """
    from depthgate.layout.presend import guard_layouts
    from depthgate.run.backends import make_backend, probe_backend
    from depthgate.run.controls import build_controls, read_controls
    from depthgate.run.parity import summary_lines, verify_arm
    from depthgate.run.runner import RunOptions, compact
    from depthgate.spec.suites import resolve_suite

    matrix_path = Path(matrix_path)
    matrix = load_matrix(matrix_path)
    if aa:
        from depthgate.commands.plan import aa_matrix

        matrix = aa_matrix(matrix)
    suite = resolve_suite(matrix.suite, base_dir=matrix_path.parent)
    if matrix.plan.primary_metric == "control_normalised" and not controls:
        raise InputError(
            "the plan's primary metric control_normalised needs the evidence-only controls, and "
            "--no-controls skips them",
            file=str(matrix_path),
            field="plan.primary_metric",
            fix='drop --no-controls, or pre-register primary_metric = "pass"',
        )
    run_jobs = _engine(engine, matrix, matrix_path.parent, ray_actors)  # refused before anything is built
    out = Path(out_dir)
    arms = [
        arm_setup(arm, sys_, matrix_path.parent)
        for arm, sys_ in zip(ARMS, (matrix.baseline, matrix.candidate), strict=True)
    ]
    # A run folder this call starts (no manifest yet) is removed again when anything fails before the
    # first request is sent (a template that raises while building, a backend that cannot start):
    # nothing was recorded, so nothing is frozen, and the fixed matrix then runs into the same folder.
    fresh = None if (out / MANIFEST).is_file() else CreatedPaths(out)
    sending = False

    def options_for(a: ArmSetup) -> BuildOptions:
        options = a.build_options(matrix, verification)
        # An A/A run measures the noise of the gated slices: no short lengths for a base score.
        return replace(options, lengths=list(matrix.lengths)) if aa else options

    backends = {}
    jobs: list[tuple[str, Mapping[str, Any]]] = []
    control_jobs: list[tuple[str, Mapping[str, Any]]] = []
    canaries: list[tuple[str, Mapping[str, Any]]] = []
    sources: dict[str, LayoutStore] = {}
    control_sources: dict[str, LayoutStore] = {}
    canary_sources: dict[str, LayoutStore] = {}
    try:
        manifest = _freeze_manifest(out, _manifest(matrix, matrix_path, suite, arms, aa=aa))
        _freeze_suite(out, suite)
        for a in arms:
            layout_path = out / a.arm / "layouts.parquet"
            if not layout_path.is_file():
                build_layouts(suite, a.tokenizer, options_for(a), layout_path)
            # The arm's runtime block configures the backend; its relative paths are the matrix file's.
            if engine == "ray":  # no engine in the driver: the actors hold them
                from depthgate.run.ray_engine import driver_backend

                backend = driver_backend(a.system, base_dir=matrix_path.parent)
            else:
                backend = make_backend(a.system, tokenizer=None, base_dir=matrix_path.parent)
            backends[a.arm] = backend
            # Every endpoint probed before the first request (served model, window; replicas that
            # disagree are refused, exit 20), so the pre-send gate below checks the served window.
            asyncio.run(probe_backend(backend))
            # The server's own tokenizer on built prompts, before anything is sent (exit 22 on a
            # difference): a sample for id arms, every prompt for text arms.
            for line in summary_lines(verify_arm(a.arm, backend, layout_path, out / a.arm, a.tokenizer)):
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
            )
            guard_cases = functools.partial(guard, cases={c.id: c for c in suite.cases})
            jobs.extend((a.arm, row) for row in _guarded_rows(layout_path, guard_cases))
            sources[a.arm] = _store(layout_path, out / a.arm / "store")
            if controls:
                # Controls beside the matrix: evidence-only short input and evidence-absent haystack.
                control_path = out / a.arm / CONTROLS_FILE
                if not control_path.is_file():
                    # at the gated lengths only (the base lengths need no controls)
                    gated_only = replace(options_for(a), lengths=list(matrix.lengths))
                    build_controls(suite, a.tokenizer, gated_only, control_path)
                # A controls file, or a named error; only small columns (not every control's ids).
                read_controls(control_path, columns=["layout_id", "control"])
                control_sources[a.arm] = _store(control_path, out / a.arm / "controls-store")
                # Controls differ in token count between arms (a preamble, a template, another
                # tokenizer): they pair by case, control kind and *nominal* length (the matrix length
                # an evidence-absent control was cut from; 0 for evidence-only).
                control_jobs.extend(
                    (a.arm, {**row, "target_tokens": row["nominal_tokens"]})
                    for row in _guarded_rows(control_path, guard, controls=True)
                )
            if matrix.canaries and shard is None:
                # Full-length canaries (commands/checks.py): did the whole prompt reach the model?
                # (Not in a shard: `merge` joins the matrix's records only.)
                arm_canaries, canary_sources[a.arm] = canary_jobs(
                    a.arm,
                    matrix.canaries,
                    a.tokenizer,
                    replace(options_for(a), lengths=list(matrix.lengths)),
                    out / a.arm,
                    guard,
                    _guarded_rows,
                    _store,
                )
                canaries.extend(arm_canaries)
        _warn_power(matrix, suite)
        if aa:
            _mark_aa(out, matrix)
        print(
            f"depthgate: {manifest['run_id']}: {len(jobs)} layouts × {len(matrix.decode.seeds)} seed(s) "
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
        summary = run_jobs(jobs, backends, out, options, sources)
        if summary.circuit_open is not None:
            # The endpoint is down: stop here, report INFRA with what was recorded; a rerun resumes.
            print(
                f"depthgate: circuit open on arm {summary.circuit_open!r} after "
                f"{options.retry.breaker_after} consecutive transient failures; stopped sending "
                f"({summary.written} records written, the rest are re-sent by a rerun of the same folder)",
                file=sys.stderr,
            )
            control_jobs = canaries = []
        if control_jobs:
            controls_options = dataclasses.replace(options, run_id=manifest["run_id"] + "-controls")
            run_jobs(control_jobs, backends, out / CONTROLS_DIR, controls_options, control_sources)
        if canaries:
            canary_options = dataclasses.replace(options, run_id=manifest["run_id"] + "-canaries")
            run_jobs(canaries, backends, out / CANARIES_DIR, canary_options, canary_sources)
        print_endpoint_counts(out, backends)
        for a in arms:
            if a.system.runtime.cache_control:
                _cache_control(
                    a,
                    read_layouts(out / a.arm / "layouts.parquet"),
                    out / a.arm,
                    matrix.decode.max_tokens,
                    matrix_path.parent,
                )
    except BaseException:
        if fresh is not None and not sending:
            fresh.undo()
        raise
    finally:
        for backend in backends.values():
            # Closing must not hide the run's own error.
            with contextlib.suppress(Exception):
                asyncio.run(backend.aclose())
    compact(out)
    if control_jobs:
        compact(out / CONTROLS_DIR)
    if canaries:
        compact(out / CANARIES_DIR)
    if shard is not None:
        from depthgate.judge.health import infra_summary
        from depthgate.run.runner import read_records

        planned = shard_jobs(_planned_jobs(out, matrix.decode.seeds), shard)
        lost = infra_summary(read_records(out), planned).lost
        return None, ExitCode.INFRA if lost else ExitCode.PASS, out
    return gate_run(out, matrix=matrix, suite=suite)


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


def _freeze_shard(out: Path, shard: tuple[int, int]) -> None:
    """Record which shard a folder holds; a rerun into it must name the same shard."""
    path = out / SHARD_FILE
    body = {"index": shard[0], "count": shard[1]}
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old != body:
            raise PlanChangedError(
                f"this folder holds shard {old.get('index')}/{old.get('count')}, not {shard[0]}/{shard[1]}",
                file=str(path),
                field="--shard",
                fix="resume a shard into its own folder",
            )
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body), encoding="utf-8")
    os.replace(tmp, path)


def shard_jobs(planned: pl.DataFrame, shard: tuple[int, int]) -> pl.DataFrame:
    """The planned jobs (arm, layout_id, seed, case_id, target_tokens, position) of shard ``(i, N)``."""
    from depthgate.run.runner import shard_of

    index, count = shard
    keep = [
        shard_of((str(c), int(t), str(p), int(s)), count) == index - 1
        for c, t, p, s in planned.select("case_id", "target_tokens", "position", "seed").iter_rows()
    ]
    return planned.filter(pl.Series(keep, dtype=pl.Boolean))


def _cache_control(a: ArmSetup, layouts: pl.DataFrame, arm_dir: Path, max_tokens: int, base: Path) -> None:
    """The warm/cold prefix-cache control (:mod:`depthgate.run.cache`) on an arm's layouts, when its
    runtime block asks for it (``cache_control = true``): ``<arm>/cache_control.json`` (summary, incident,
    per-layout rows), once per run folder. It never changes the verdict."""
    from depthgate.run.backends import make_cache_control_backends
    from depthgate.run.cache import run_cache_control

    path = arm_dir / "cache_control.json"
    if not path.is_file():
        cold, warm = make_cache_control_backends(a.system, base_dir=base)
        with cold, warm:
            report = run_cache_control(layouts, cold=cold, warm=warm, max_tokens=max_tokens)
        body = {
            "ok": report.ok,
            "summary": report.summary(),
            "incident": None if report.incident is None else dataclasses.asdict(report.incident),
            "rows": [row.to_dict() for row in report.rows],
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=2, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)
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


def gate_run(
    run_dir: str | Path,
    *,
    matrix: Matrix | None = None,
    suite: Suite | None = None,
    report_dir: str | Path | None = None,
) -> tuple[GateResult, ExitCode, Path]:
    """Score, gate and report a run folder (its records, layouts and manifest)."""
    from depthgate.judge.health import infra_summary
    from depthgate.judge.oracle import score_records
    from depthgate.report.report import write_reports
    from depthgate.run.runner import read_records
    from depthgate.spec.suites import resolve_suite

    run = Path(run_dir)
    manifest_path = run / MANIFEST
    if (run / SHARD_FILE).is_file():
        spec = read_json(run / SHARD_FILE, _run_file_failures("shard.json"))
        spec = spec if isinstance(spec, dict) else {}
        raise InputError(
            f"this folder holds only shard {spec.get('index')}/{spec.get('count')} of the run",
            file=str(run),
            fix="join every shard folder with `depthgate merge DIR_1 … DIR_N --out DIR`, then gate DIR",
        )
    if not manifest_path.is_file():
        raise InputError(
            "no manifest.json in the run folder",
            file=str(run),
            fix="pass a folder written by `depthgate run`",
        )
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
            from depthgate.spec.models import load_suite

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
    layouts = pl.concat(list(by_arm.values()))
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
    result = gate(
        gated, gate_plan(plan, lengths, labels, cases=placed, seeds=frozen.seeds, spaced_cases=spaced)
    )
    infra = infra_summary(records, _planned_jobs(run, frozen.seeds), endpoints=run_endpoint_counts(run))
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
    )
    if scored_controls is not None:
        _add_controls(run, scored, scored_controls, paths.verdict_json, paths.summary_md, eligibility)
    _add_position(run, plan, frozen.seeds, scored, paths.out_dir, base_scored=base_scored)
    if (run / AA_FILE).is_file():
        _add_noise_floor(scored, gate_plan(plan, lengths, labels), paths.out_dir)
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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"baseline": matrix.baseline.name}), encoding="utf-8")
    os.replace(tmp, path)


def _add_position(
    run: Path,
    plan: AnalysisPlan,
    seeds: Sequence[int],
    scored: pl.DataFrame,
    report_dir: Path,
    *,
    base_scored: pl.DataFrame | None = None,
) -> None:
    """Effective length, control-normalised accuracy and pass^k (depthgate.report.position) into
    verdict.json (``position``), summary.md and report.html; never changes the verdict. ``base_scored``:
    the records at the short base lengths (NoLiMa's base score), None when the run built none."""
    from depthgate.report.position import add_position_section, position_science, spacing_layouts

    controls_path = run / "scored_controls.parquet"
    scored_controls = (
        pl.read_parquet(controls_path) if (run / CONTROLS_DIR).is_dir() and controls_path.is_file() else None
    )
    try:
        science = position_science(
            scored,
            plan,
            seeds=seeds,
            scored_controls=scored_controls,
            layouts=spacing_layouts(run),
            base_scored=base_scored,
        )
    except InputError as exc:
        print(f"depthgate: position science not computed: {exc}", file=sys.stderr)
        return
    add_position_section(science, report_dir)


def _add_noise_floor(scored: pl.DataFrame, plan: GatePlan, report_dir: Path) -> None:
    """The A/A noise floor (depthgate.judge.noise) into verdict.json (``noise_floor``) and summary.md."""
    from depthgate.judge.noise import noise_floor
    from depthgate.report.position import add_noise_floor_section

    try:
        result = noise_floor(scored, alpha=plan.look_alpha, plan=plan)
    except InputError as exc:
        print(f"depthgate: noise floor not computed: {exc}", file=sys.stderr)
        return
    add_noise_floor_section(result, report_dir)
    state = "above" if result.plan_margin_ok else "BELOW"
    print(
        f"noise floor: recommended margin {result.recommended_margin:g} (an A/A release passes there with "
        f"probability {result.pass_probability:.2f}; plan margin {plan.margin:g} is {state} it); flip rate "
        f"{result.flip_rate:.3f}",
        file=sys.stderr,
    )


def _planned_jobs(run: Path, seeds: Sequence[int]) -> pl.DataFrame:
    """Every (arm, layout, seed) job the frozen run plans: the arms' layouts × the seed set."""
    frames = [
        # Only the small columns: never every layout's ids and text (10 GB at 10,000 × 128K).
        read_layouts(
            run / arm / "layouts.parquet", columns=["layout_id", "case_id", "target_tokens", "position"]
        ).with_columns(pl.lit(arm).alias("arm"))
        for arm in ARMS
    ]
    layouts = pl.concat(frames).with_columns(pl.col("position").cast(pl.String))
    return layouts.join(
        pl.DataFrame({"seed": [int(s) for s in seeds]}, schema={"seed": pl.Int64}), how="cross"
    )


def _score_controls(run: Path, suite: Suite) -> pl.DataFrame | None:
    """The controls run beside the matrix, scored (and written to scored_controls.parquet); None when
    none ran."""
    from depthgate.judge.controls import score_controls
    from depthgate.run.controls import read_controls
    from depthgate.run.runner import read_records

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


def _add_controls(
    run: Path,
    scored: pl.DataFrame,
    scored_controls: pl.DataFrame,
    verdict_path: Path,
    summary_path: Path,
    eligibility: dict[str, Any] | None = None,
) -> None:
    """Classify each case's failures from the controls run beside the matrix: task or model
    (evidence-only short input fails), position or assembly (only long variants fail), hallucination
    (evidence-absent answered with a value). Added to verdict.json and summary.md; never changes the
    verdict itself (``eligibility``: the cases the primary metric control_normalised kept, reported)."""
    from depthgate.judge.controls import classify_failures
    from depthgate.report.report import load_verdict

    classes = classify_failures(scored, scored_controls)
    counts = {
        f"{arm}:{cls}": n
        for arm, cls, n in classes.group_by("arm", "category").len().sort("arm", "category").iter_rows()
    }
    only = scored_controls.filter(pl.col("control") == "evidence_only")
    only_rate = only["outcome"].eq("pass").sum() / only.height if only.height else None
    section = {
        "counts": counts,
        "cases": classes.to_dicts(),
        "hallucinated_runs": int(scored_controls["hallucinated"].sum()),
        "evidence_only_pass_rate": only_rate,
    }
    if eligibility is not None:
        section["primary_metric"] = {k: v for k, v in eligibility.items() if k != "eligible"}
    verdict = json.loads(verdict_path.read_text(encoding="utf-8"))
    verdict["controls"] = json.loads(json.dumps(section, default=str))
    tmp = verdict_path.with_name(verdict_path.name + ".tmp")
    tmp.write_text(json.dumps(verdict, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, verdict_path)
    load_verdict(verdict_path)  # still a valid verdict document
    lines = [
        "",
        "",
        "### Controls (beside the matrix; they never change the verdict)",
        "",
        "| arm | class | cases |",
        "|---|---|---:|",
    ]
    lines += [f"| {k.split(':')[0]} | {k.split(':')[1]} | {v} |" for k, v in sorted(counts.items())]
    lines += [
        "",
        "task_or_model: the evidence-only short input already fails; position_or_assembly: only "
        "long variants fail; hallucination: a value was given with the evidence removed; serving_path: "
        "a control was lost to the arm's serving path (system failures).",
        "",
    ]
    if eligibility is not None:
        lines += [
            f"Primary metric control_normalised (pre-registered): the gate counted the "
            f"{eligibility['n_eligible']} of {eligibility['n_placed']} cases whose baseline evidence-only "
            "control passed.",
            "",
        ]
    with summary_path.open("a", encoding="utf-8") as fh:
        fh.write("\n".join(lines))

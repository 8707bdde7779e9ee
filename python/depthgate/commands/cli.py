"""Command line: ``depthgate build | check | run | plan | merge | gate | report | schema | suite | faults |
diff-tokenizer | diff-template``, and ``depthgate --version``.

Every error a user can cause is a :class:`~depthgate.exceptions.DepthgateError`; it is printed as one
line naming the file, field and fix, and the process exits with the error's documented code
(``depthgate.exceptions.ExitCode``). Values that parse but cannot work (``--window 0``, an offset
beyond every length, ``--cases 0``) and output paths that cannot be written (a folder where a file is
expected, a path under a file, an unwritable folder) are refused before any work starts (exit 20).
Nothing is half-written: files are written to a temp path in the same folder and renamed into place,
and a command that fails removes the folders and entries it created
(:mod:`depthgate.commands.outputs`). An unexpected OSError about a user's path is exit 20 naming the
path; any other exception is a bug and stays visible.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthgate.commands.console import naming_the_file, pipe_safe_stdout
from depthgate.commands.outputs import (
    OutputKind,
    check_output,
    read_text_arg,
    undo_on_error,
    write_output_text,
)
from depthgate.exceptions import DepthgateError, ExitCode, InputError, RoundOpenError
from depthgate.spec.limits import (
    MAX_GENERATED_CASES,
    MAX_LAYOUTS,
    MAX_LENGTH,
    MAX_POSITIONS,
    MAX_TOKENS,
    count_problems,
    length_problem,
)
from depthgate.spec.paths import csv_ints, csv_list

if TYPE_CHECKING:
    from depthgate.layout.layouts import Position

BUILTIN_CASES = 8


def _cmd_build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.matrix:
        from depthgate.spec.loading import load_matrix

        matrix_path = Path(args.matrix)
        matrix = load_matrix(matrix_path)  # before the pipeline's imports: bad input is refused at once
        from depthgate.commands.pipeline import arm_setup
        from depthgate.layout.layouts import build_layouts
        from depthgate.spec.suites import resolve_suite

        suite = resolve_suite(matrix.suite, base_dir=matrix_path.parent)
        arms = []
        for arm, system in (("baseline", matrix.baseline), ("candidate", matrix.candidate)):
            a = arm_setup(arm, system, matrix_path.parent)
            arms.append((arm, a.tokenizer, a.build_options(matrix, args.verification)))
        # Both arms are built into a staging folder and moved into place together: an arm that fails
        # (a template that raises, evidence with a special token) leaves neither arm half-written.
        summaries = []
        with undo_on_error(out):
            out.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".build-", dir=out))
            try:
                for arm, tok, options in arms:
                    with naming_the_file(matrix_path, fix="correct the matrix file"):
                        built = build_layouts(suite, tok, options, staging / arm / "layouts.parquet")
                    summaries.append((arm, built))
                for arm, _ in summaries:
                    (out / arm).mkdir(exist_ok=True)
                    os.replace(staging / arm / "layouts.parquet", out / arm / "layouts.parquet")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        for arm, summary in summaries:
            _print_build(summary, out / arm / "layouts.parquet")
        return ExitCode.PASS
    if not args.tokenizer:
        raise InputError(
            "no tokenizer given",
            field="--tokenizer",
            fix="pass --tokenizer path/to/tokenizer.json (or 'gguf:'), or a matrix file",
        )
    from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer
    from depthgate.layout.model_files import load_template
    from depthgate.spec.suites import builtin_suite

    preamble = read_text_arg(args.preamble_file, option="--preamble-file") if args.preamble_file else ""
    tok = load_tokenizer(args.tokenizer)
    template = load_template(args.chat_template) if args.chat_template else None
    if args.suite:
        from depthgate.spec.loading import load_suite

        suite = load_suite(args.suite)
    else:
        suite = builtin_suite(args.cases, args.seed, args.lang)
    options = BuildOptions(
        lengths=args.lengths,
        positions=_positions_arg(args.positions, args.lengths),
        template=template,
        preamble=preamble,
        verification=args.verification,
        window=args.window,
        max_output_tokens=args.max_output_tokens,
    )
    with undo_on_error(out):  # a template that raises mid-build leaves no empty --out folder
        summary = build_layouts(suite, tok, options, out / "layouts.parquet")
    _print_build(summary, out / "layouts.parquet")
    return ExitCode.PASS


def _print_build(summary: object, path: Path) -> None:
    import polars as pl

    assert isinstance(summary, pl.DataFrame)
    ok = summary.filter(pl.col("status") == "ok").height
    refused = summary.filter(pl.col("status") == "refused")
    print(f"{path}: {summary.height} layouts, {ok} ok, {refused.height} refused")
    if refused.height:
        for row in refused.group_by("reason_code").agg(pl.len(), pl.first("reason")).iter_rows():
            print(f"  refused {row[1]}× {row[0]}: {row[2]}")
    if ok:
        snap = summary.filter(pl.col("status") == "ok")["snap_tokens"].abs().cast(pl.Float64).to_numpy()
        print(f"  snap to unit boundary: max {int(snap.max())} tokens, mean {float(snap.mean()):.1f}")


def _cmd_check(args: argparse.Namespace) -> int:
    from depthgate.layout.layout_checks import check_layouts
    from depthgate.layout.layouts import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    with naming_the_file(
        args.layouts, fix="pass a layouts.parquet written by `depthgate build`, or rebuild it"
    ):
        summary = check_layouts(args.layouts, tok)
    print(
        f"{args.layouts}: {summary.checked} layouts re-verified, {summary.refused} refused at build, "
        f"{len(summary.violations)} violation(s)"
    )
    for v in summary.violations[:20]:
        print(f"  {v['layout_id']}: {v['code']}: {v['detail']}")
    if not summary.ok:
        codes = sorted({v["code"] for v in summary.violations})
        print(
            f"depthgate: {args.layouts}: {len(summary.violations)} violation(s) ({', '.join(codes)}); "
            "these layouts must not be sent (fix: rebuild them with `depthgate build` under this "
            "tokenizer and template)",
            file=sys.stderr,
        )
    return ExitCode.PASS if summary.ok else ExitCode.VERIFY_FAILED


def _cmd_schema(args: argparse.Namespace) -> int:
    from depthgate.spec.loading import schema

    text = json.dumps(schema(), indent=2, sort_keys=True)
    if args.out:
        write_output_text(args.out, text + "\n", option="--out")
    else:
        print(text)
    return ExitCode.PASS


def _cmd_suite_generate(args: argparse.Namespace) -> int:
    from depthgate.spec.suites import generate_suite

    suite = generate_suite(args.seed, args.cases, args.lang, conflict=args.conflict)
    text = suite.model_dump_json(indent=1)
    if args.out:
        out = write_output_text(args.out, text, option="--out")
        print(f"{out}: {len(suite.cases)} cases, digest {suite.digest()[:16]}")
    else:
        print(text)
    return ExitCode.PASS


def _cmd_run(args: argparse.Namespace) -> int:
    from depthgate.spec.loading import load_matrix

    load_matrix(args.matrix)  # bad input refused before the pipeline's imports (≈ 1-3 s on a busy machine)
    from depthgate.commands.pipeline import run_matrix

    with naming_the_file(args.matrix, fix="correct the matrix file"):
        result, code, html = run_matrix(
            args.matrix,
            args.out,
            concurrency=args.concurrency,
            progress=None if not args.progress else True,
            verification=args.verification,
            controls=not args.no_controls,
            shard=args.shard,
            aa=args.aa,
            engine=args.engine,
            ray_actors=args.ray_actors,
            after=Path(args.after) if args.after else None,
        )
    if args.shard is not None:
        state = "complete" if code == ExitCode.PASS else "incomplete: rerun this shard, it resumes"
        print(f"shard {args.shard[0]}/{args.shard[1]} {state} (exit {int(code)}) → {html}")
        if (html / "shard-look.json").is_file():  # a sequential run's round (commands/sequential_shards.py)
            print(
                "next: depthgate merge DIR_1 … DIR_N --out MERGED_r (a new folder each round), then every "
                "shard again with --after MERGED_r; after the last round depthgate gate MERGED_r"
            )
        else:
            print("next: depthgate merge DIR_1 … DIR_N --out DIR, then depthgate gate DIR")
        return code
    assert result is not None
    _print_verdict(result, code, html)
    return code


def _shard(value: str) -> tuple[int, int]:
    try:
        index, count = (int(v) for v in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected i/N, e.g. 1/3") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"{value!r}: expected i/N with 1 <= i <= N")
    return index, count


def _cmd_plan(args: argparse.Namespace) -> int:
    from depthgate.spec.loading import load_matrix

    matrix_path = Path(args.matrix)
    matrix = load_matrix(matrix_path)  # refused before the heavy imports (issue #21)
    if args.simulate and not 1 <= args.draws <= 5000:  # judge.planning.release_sim.MAX_DRAWS, before any work
        raise InputError(f"--draws {args.draws} out of range", field="--draws", fix="1 to 5000 releases")
    from depthgate.commands import plan as planning
    from depthgate.spec.suites import resolve_suite

    suite = resolve_suite(matrix.suite, base_dir=matrix_path.parent)
    pilot = planning.read_pilot(args.pilot) if args.pilot else None
    power = planning.matrix_power(matrix, suite, p_baseline=args.p_baseline, icc=args.icc, pilot=pilot)
    ceiling = planning.near_ceiling_power(matrix, suite, icc=args.icc)
    planning.print_power(power, ceiling, simulate=args.simulate)
    simulated: dict[str, Any] = {}
    if args.simulate:
        given = "the pilot" if pilot is not None else f"p_baseline {args.p_baseline:g}, ICC {args.icc:g}"
        near = f"p_baseline {planning.NEAR_CEILING_P:g}, ICC {args.icc:g}"
        todo = [("simulated", power, given), ("simulated_near_ceiling", ceiling, near)]
        if pilot is None and args.p_baseline == planning.NEAR_CEILING_P:
            todo = todo[:1]  # the assumption is the ceiling: one simulation serves both
        joint = []
        for key, pp, label in todo:
            progress = planning.simulation_progress(f"{len(pp.rows)} slices at {label}")
            sim = planning.simulated_power(
                matrix, suite, pp, draws=args.draws, seed=args.seed, progress=progress
            )
            simulated[key] = planning.print_simulated(sim, pp, label)
            joint.append(sim.power_all_slices)
        if min(joint) < power.target:
            print(
                "under-powered (simulated): the release passes all slices less often than the target",
                file=sys.stderr,
            )
    if matrix.plan.stop_rule == "sequential":
        from depthgate.commands.sequential import sequential_plan_lines

        print("\n".join(sequential_plan_lines(matrix, suite, p_baseline=args.p_baseline, icc=args.icc)))
    if args.json:
        out = {**power.to_dict(), "power_all_slices_near_ceiling": ceiling.power_all_slices, **simulated}
        write_output_text(args.json, json.dumps(out, indent=2, allow_nan=False) + "\n", option="--json")
    return ExitCode.PASS


def _cmd_merge(args: argparse.Namespace) -> int:
    from depthgate.commands.merge import merge_runs

    print(merge_runs(args.shards, args.out).line())
    return ExitCode.PASS


def _cmd_gate(args: argparse.Namespace) -> int:
    from depthgate.commands.pipeline import gate_run

    try:
        result, code, html = gate_run(args.run_dir, report_dir=args.report_dir)
    except RoundOpenError as exc:  # not an error: a sharded sequential run between rounds
        print(f"depthgate: {exc.file}: {exc.message}", file=sys.stderr)
        print(f"next: {exc.fix}")
        return int(exc.exit_code)
    _print_verdict(result, code, html)
    return code


def _number(value: object, spec: str = ".2f") -> str:
    """A number of verdict.json for the console; ``n/a`` where the report has none (a position range
    needs a case answered at every position: a run that lost jobs over many cases may have none)."""
    return format(value, spec) if isinstance(value, int | float) and not isinstance(value, bool) else "n/a"


def _print_verdict(result: object, code: int, html: Path) -> None:
    """The verdict as verdict.json states it (the document is the truth; the console repeats it)."""
    doc = json.loads((html.parent / "verdict.json").read_text(encoding="utf-8"))
    safety = " + SAFETY" if doc.get("safety_flag") else ""
    klass = doc.get("failure_class")
    what = f", failures: {klass}" if klass in ("system", "mixed") else ""
    print(f"verdict: {doc['verdict']}{safety} (exit {int(code)} {doc['exit_code']}{what})")
    for reason in list(doc.get("reasons", []))[:6]:
        print(f"  {reason}")
    for worst in doc.get("worst_by_length") or []:
        if worst.get("slice_worst_position") is not None:
            print(
                f"worst position at {worst['length']} tokens: depth {worst['slice_worst_position']} "
                f"(lowest Δ lower bound {_number(worst.get('slice_worst_lower'), '+.3f')}; position range "
                f"baseline {_number(worst.get('range_baseline'))} → candidate "
                f"{_number(worst.get('range_candidate'))})"
            )
    rows = ((doc.get("position") or {}).get("effective_length") or {}).get("rows") or []
    if rows:

        def estimate(row: dict[str, object]) -> str:
            est = row["estimate"]
            return f"≥{est}" if row.get("at_grid_top") else ("below grid" if est == 0 else str(est))

        by_arm: dict[str, list[str]] = {}
        for row in rows:
            by_arm.setdefault(str(row["arm"]), []).append(f"{row['position']}: {estimate(row)}")
        from depthgate.report.position import LOW_BASE_SCORE

        bases = doc["position"]["effective_length"].get("base_scores") or {}
        for arm, cells in sorted(by_arm.items()):
            base = bases.get(arm) if rows[0]["rule"] == "nolima" else None
            low = (
                f" (base score {base:.2f}: threshold near chance)"
                if base is not None and base < LOW_BASE_SCORE
                else ""
            )
            print(f"effective length ({rows[0]['rule']}), {arm}: " + ", ".join(cells) + low)
    counts = doc.get("controls") or {}
    if counts:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.get("counts", {}).items()))
        print(f"controls: {shown}")
    print(f"report: {html}")
    print(
        f"        {html.parent / 'summary.md'}, {html.parent / 'verdict.json'}, {html.parent / 'junit.xml'}"
    )


def _cmd_suite_import(args: argparse.Namespace) -> int:
    from depthgate.spec.incidents import import_incidents

    suite = import_incidents(args.incidents)
    out = write_output_text(args.out, suite.model_dump_json(indent=1), option="--out")
    print(f"{out}: {len(suite.cases)} replayed cases, digest {suite.digest()[:16]}")
    return ExitCode.PASS


class _Version(argparse.Action):
    """``--version``: the package version and ``ASSEMBLER_VERSION`` (a layout changes only with the
    latter), read when asked: the layout module loads the Rust core, which ``--help`` need not."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        from depthgate.layout.layouts import ASSEMBLER_VERSION
        from depthgate.spec.files import dist_version

        print(f"depthgate {dist_version('depthgate') or 'unknown'} (layout assembler {ASSEMBLER_VERSION})")
        parser.exit(0)


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A command handler that imports ``module`` when the command runs, not when the parser is built."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(module), name)(args))

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="depthgate", description="Long-context position regression gate.")
    parser.add_argument(
        "--version",
        action=_Version,
        help="print the package version and the layout assembler version, then exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_build_parsers(sub)
    _add_run_parser(sub)
    _add_plan_merge_gate_parsers(sub)
    _add_suite_parsers(sub)

    from depthgate.commands.subparsers import add_diff_parsers, add_faults_parser

    # depthgate faults, diff-tokenizer, diff-template: their modules load when the command runs.
    add_faults_parser(sub, _lazy("depthgate.commands.faults", "cmd_faults"))
    add_diff_parsers(
        sub,
        _lazy("depthgate.commands.diff", "cmd_diff_tokenizer"),
        _lazy("depthgate.commands.diff", "cmd_diff_template"),
    )
    # Output paths each command writes, checked by main() before the command starts (the model of
    # `depthgate faults` is never loaded for an --out or --json that cannot be written).
    sub.choices["faults"].set_defaults(outputs=(("out", "empty_dir"), ("json", "file")))
    for name in ("diff-tokenizer", "diff-template"):
        sub.choices[name].set_defaults(outputs=(("out", "file"),))
    return parser


def _add_build_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """depthgate build and check."""
    b = sub.add_parser("build", help="build token-exact layouts (layouts.parquet)")
    b.add_argument("matrix", nargs="?", help="a matrices/*.toml file (builds both arms)")
    b.add_argument("--tokenizer", help="tokenizer.json, or 'gguf:' for the embedded model's tokenizer")
    b.add_argument("--chat-template", help="a .jinja file or a tokenizer_config.json; absent = raw frame")
    b.add_argument("--lengths", type=csv_ints, default=[1024, 4096])
    b.add_argument("--positions", type=csv_list, default=["0", "0.25", "0.5", "0.75", "1"])
    b.add_argument("--out", default="out")
    b.add_argument("--suite", help="a suite JSON (depthgate suite generate/import); default: built-in suite")
    b.add_argument("--cases", type=int, default=BUILTIN_CASES, help="built-in suite size")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--lang", default="en", choices=["en", "zh"])
    b.add_argument("--preamble-file", help="text placed before the document (a candidate change)")
    b.add_argument("--verification", default="full", choices=["full", "fast"])
    b.add_argument("--window", type=int, help="model window; lengths that do not fit are refused")
    b.add_argument("--max-output-tokens", type=int, default=16)
    b.set_defaults(func=_cmd_build, outputs=(("out", "dir"),))

    c = sub.add_parser("check", help="re-verify a layouts file from scratch (full re-encode)")
    c.add_argument("layouts")
    c.add_argument("--tokenizer", required=True)
    c.set_defaults(func=_cmd_check)


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """depthgate run."""
    r = sub.add_parser("run", help="build → run both arms (paired, resumable) → score → gate → report")
    r.add_argument("matrix")
    r.add_argument("--out", default="runs/latest", help="run folder; rerunning the same folder resumes")
    r.add_argument("--concurrency", type=int, default=4)
    r.add_argument("--verification", default="full", choices=["full", "fast"])
    r.add_argument("--progress", action="store_true", help="progress line even when stderr is not a terminal")
    r.add_argument(
        "--no-controls",
        action="store_true",
        help="skip the evidence-only and evidence-absent controls run beside the matrix",
    )
    r.add_argument(
        "--shard",
        type=_shard,
        help="i/N: run only shard i of N (pairs split by content); join with `depthgate merge`",
    )
    r.add_argument(
        "--after",
        help="with --shard and stop_rule = 'sequential': the merged folder of the previous round; the shard "
        "sends its part of the next look (docs/gate-calibration.md §8.5)",
    )
    r.add_argument(
        "--aa",
        action="store_true",
        help="A/A: run the baseline against a repeat of itself and report the noise floor",
    )
    r.add_argument(
        "--engine",
        default="asyncio",
        choices=["asyncio", "ray"],
        help="asyncio (this process) or ray (Ray Data actors; pip install 'depthgate[ray]'; RAY_ADDRESS "
        "to use a running cluster)",
    )
    r.add_argument("--ray-actors", type=int, help="--engine ray: actors in the pool (default 2)")
    r.set_defaults(func=_cmd_run, outputs=(("out", "run_dir"),))


def _add_plan_merge_gate_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """depthgate plan, merge, gate, report and schema."""
    pl_ = sub.add_parser("plan", help="per-slice power of a matrix's plan (and the cases it needs)")
    pl_.add_argument("matrix")
    pl_.add_argument("--pilot", help="a finished run folder: estimate the design from its scored.parquet")
    pl_.add_argument("--p-baseline", type=float, default=0.85, help="assumed baseline accuracy")
    pl_.add_argument("--icc", type=float, default=0.33, help="assumed intra-case correlation of runs")
    pl_.add_argument(
        "--simulate",
        action="store_true",
        help="also gate simulated A/A releases through the gate itself, at the assumption and near the "
        "ceiling (the approximation is far too low there: rows flagged check_by_sim)",
    )
    pl_.add_argument("--draws", type=int, default=200, help="--simulate: releases per assumption (1-5000)")
    pl_.add_argument("--seed", type=int, default=0, help="--simulate: the simulation's seed")
    pl_.add_argument(
        "--json",
        help="also write the plan as JSON to this file (every slice's power and cases for the target, "
        "cases_needed): a release job can size its suite from it",
    )
    pl_.set_defaults(func=_cmd_plan, outputs=(("json", "file"),))

    m = sub.add_parser("merge", help="join the shard folders of one run (then `depthgate gate` the result)")
    m.add_argument("shards", nargs="+", help="the --out folder of every shard")
    m.add_argument("--out", required=True, help="a new folder for the merged run")
    m.set_defaults(func=_cmd_merge, outputs=(("out", "empty_dir"),))

    for name, help_text in (
        ("gate", "score and gate a run folder; writes verdict and reports"),
        ("report", "re-write the reports of a run folder (same as gate)"),
    ):
        gp = sub.add_parser(name, help=help_text)
        gp.add_argument("run_dir")
        gp.add_argument("--report-dir", help="where to write the reports (default RUN/report)")
        gp.set_defaults(func=_cmd_gate, outputs=(("report_dir", "dir"),))

    s = sub.add_parser("schema", help="JSON Schema of cases, suites, systems, matrices and plans")
    s.add_argument("--out")
    s.set_defaults(func=_cmd_schema, outputs=(("out", "file"),))


def _add_suite_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """depthgate suite generate and import."""
    suite = sub.add_parser("suite", help="case suites")
    suite_sub = suite.add_subparsers(dest="suite_command", required=True)
    g = suite_sub.add_parser("generate", help="generate the built-in synthetic suite")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cases", type=int, default=300)
    g.add_argument("--lang", default="en", choices=["en", "zh"])
    g.add_argument(
        "--conflict",
        action="store_true",
        help="also generate `conflict` cases (two unversioned sources disagree); the first 13 are unchanged",
    )
    g.add_argument("--out")
    g.set_defaults(func=_cmd_suite_generate, outputs=(("out", "file"),))
    imp = suite_sub.add_parser("import", help="replay desensitized incidents (JSONL) as cases")
    imp.add_argument("incidents", help="JSONL: documents, query, evidence_ids, claims per line")
    imp.add_argument("--out", required=True)
    imp.set_defaults(func=_cmd_suite_import, outputs=(("out", "file"),))


#: Smallest value of each numeric option (any command that has it); below it the option is refused.
_MINIMUM = {
    "cases": 1,
    "seed": 0,
    "window": 1,
    "max_output_tokens": 0,
    "concurrency": 1,
    "limit": 0,
    "ray_actors": 1,
}


#: Largest value of each numeric option (any command that has it): what can be built
#: (:mod:`depthgate.spec.limits`); above it the option is refused before any work.
_MAXIMUM = {
    "cases": (MAX_GENERATED_CASES, "distinct cases the built-in suite generates from one seed"),
    "seed": (2**63 - 1, "the largest seed"),
    "window": (MAX_TOKENS, "the largest window (token counts are u32)"),
    "max_output_tokens": (MAX_TOKENS, "the largest output budget (token counts are u32)"),
    "concurrency": (65_536, "requests in flight"),
    "limit": (MAX_LAYOUTS, "rows listed"),
    "ray_actors": (1_024, "actors in the pool"),
}


def _positions_arg(values: Sequence[str], lengths: Sequence[int], turns: int | None = None) -> list[Position]:
    """``--positions`` parsed (errors name ``--positions``); an offset at or beyond the longest length
    could never be placed (every layout would be refused), so it is bad input too; so is ``@turn:K``
    without a conversation of at least K turns (``--turns``: diff-template's; ``build`` has none)."""
    from depthgate.layout.layouts import parse_positions

    try:
        positions = parse_positions(values)
    except InputError as exc:
        raise InputError(exc.message, field="--positions", fix=exc.fix) from None
    longest = max(lengths, default=0)
    for position in positions:
        if position.offset is not None and lengths and position.offset >= longest:
            raise InputError(
                f"offset {position.label} is beyond the longest length {longest}: no layout could place it",
                field="--positions",
                fix="use an offset smaller than the longest --lengths, or a depth in [0, 1]",
            )
        if position.turn is not None and (turns is None or position.turn > turns):
            has = "no conversation" if turns is None else f"a {turns}-turn conversation"
            raise InputError(
                f"{position.label} places the evidence in turn {position.turn}, but the build has {has}",
                field="--positions",
                fix="give a depth or an offset, or build a conversation of at least that many turns "
                '(diff-template --turns N, or a matrix with shape = "conversation")',
            )
    return positions


def _check_args(args: argparse.Namespace) -> None:
    """Refuse, before a command starts, values argparse accepts but no command can use (exit 20)."""
    for name, minimum in _MINIMUM.items():
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            option = "--" + name.replace("_", "-")
            raise InputError(
                f"{value} is not a valid {option}",
                field=option,
                fix=f"give {option} an integer >= {minimum}",
            )
    for name, (maximum, what) in _MAXIMUM.items():
        value = getattr(args, name, None)
        if value is not None and value > maximum:
            option = "--" + name.replace("_", "-")
            raise InputError(
                f"{value} is over the limit of {maximum} ({what})",
                field=option,
                fix=f"give {option} an integer <= {maximum}",
            )
    for name in ("p_baseline", "icc"):
        value = getattr(args, name, None)
        if value is not None and not 0.0 <= value <= 1.0:  # nan and inf fail both comparisons
            option = "--" + name.replace("_", "-")
            raise InputError(
                f"{value} is not a number in [0, 1]", field=option, fix=f"give {option} a number in [0, 1]"
            )
    # --lengths / --positions (build without a matrix, diff-*): the lengths first, then every position
    # against them (an offset beyond every length could never be placed).
    if hasattr(args, "lengths") and not getattr(args, "matrix", None):
        if not args.lengths:
            raise InputError("no lengths given", field="--lengths", fix="pass --lengths 1024,4096")
        for length in args.lengths:
            if length < 16:
                raise InputError(
                    f"length {length} is too small",
                    field="--lengths",
                    fix="give total prompt lengths in tokens (>= 16), e.g. --lengths 1024,4096",
                )
            problem = length_problem(length)
            if problem is not None:
                raise InputError(
                    problem, field="--lengths", fix=f"give lengths of at most {MAX_LENGTH} tokens"
                )
        if len(set(args.lengths)) != len(args.lengths):
            raise InputError("a length is repeated", field="--lengths", fix="list each length once")
        if hasattr(args, "positions"):
            empty, over = "pass --positions 0,0.5,1", f"give at most {MAX_POSITIONS} positions"
            for problem, fix in count_problems(len(args.positions), MAX_POSITIONS, "positions", empty, over):
                raise InputError(problem, field="--positions", fix=fix)
            _positions_arg(args.positions, args.lengths, getattr(args, "turns", None))
            cases = getattr(args, "cases", None)
            if cases is not None and not getattr(args, "suite", None):
                layouts = cases * len(args.lengths) * len(args.positions)
                if layouts > MAX_LAYOUTS:
                    raise InputError(
                        f"{cases} cases × {len(args.lengths)} lengths × {len(args.positions)} positions are "
                        f"{layouts} layouts, over the limit of {MAX_LAYOUTS}",
                        field="--cases",
                        fix="build fewer cases, lengths or positions at once",
                    )
    outputs: tuple[tuple[str, OutputKind], ...] = getattr(args, "outputs", ())
    for name, kind in outputs:
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():  # "" would be the working directory
            option = "--" + name.replace("_", "-")
            raise InputError("is empty", field=option, fix=f"give {option} a path, e.g. {option} out/layouts")
        if value:
            check_output(value, kind, option="--" + name.replace("_", "-"))
    # gate/report without --report-dir write RUN/report: checked like an explicit --report-dir (before
    # scored.parquet is rewritten), once the run folder exists (else gate names the missing run).
    run_dir = getattr(args, "run_dir", None)
    if run_dir and not getattr(args, "report_dir", None) and Path(run_dir).is_dir():
        check_output(Path(run_dir) / "report", "dir", option="--report-dir")


def _os_error(exc: OSError) -> InputError | None:
    """An OSError about a user's path (it names one, outside depthgate's own package) as bad input;
    None for anything else (a bug or an OS failure that must stay visible)."""
    if not exc.filename:
        return None
    path = Path(os.fsdecode(exc.filename))
    package = Path(__file__).resolve().parent.parent
    if package in path.resolve().parents:
        return None  # depthgate's own files: a broken install or a bug, not the user's input
    other = f" → {os.fsdecode(exc.filename2)}" if exc.filename2 else ""
    return InputError(
        f"{exc.strerror or exc}{other}",
        file=str(path),
        fix="check that the path exists, is a file or folder as the command expects, and can be "
        "read and written",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        with pipe_safe_stdout():  # `depthgate gate RUN | head -1`: the command's exit, no traceback
            code = int(args.func(args))
    except DepthgateError as exc:
        print(f"depthgate: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        print("depthgate: interrupted; completed results are kept and a rerun resumes", file=sys.stderr)
        return int(ExitCode.INFRA)
    except OSError as exc:
        error = _os_error(exc)
        if error is None:
            raise
        print(f"depthgate: error: {error}", file=sys.stderr)
        return int(error.exit_code)
    return code


if __name__ == "__main__":
    sys.exit(main())

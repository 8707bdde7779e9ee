"""Benchmark: peak RSS of `depthgate run` (build + pre-send + run + gate), per phase, as the matrix grows.

Opt-in (``-m bench``). Each size runs `depthgate run` in a **fresh child process** (this file as a
script) against a fast local **stub** server in its own process on 127.0.0.1 (vLLM-shaped
``/v1/completions`` and ``/v1/models``, token-id prompts; it answers at once with a fixed completion
and ``usage.prompt_tokens`` = the number of ids it received, counted in the request body; labelled as
such everywhere: it measures the harness, not a model).

The child resets its peak RSS (``/proc/self/clear_refs`` = 5) at the start of each phase and reads
``VmHWM`` at its end, so each phase's own peak is known: ``build`` (both arms' layouts.parquet),
``presend`` (the pre-send gate over every layout, in batches), ``store`` (the arm's on-disk layout
store), ``controls`` (when on), ``run`` (every request) and ``gate`` (score, gate, report). The
overall peak is the largest of them. Memory must stay O(batch + in flight): the peak must not grow
with layouts × tokens (the old run path held ≈ 59 bytes per token, the old build ≈ 20–27).

    .venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/benchmarks/test_bench_memory.py
    # one size (any flags), printed as one JSON line:
    .venv/bin/python tests/benchmarks/test_bench_memory.py --cases 40 --length 32768 [--controls]
    # the 10,000-layout 128K matrix (1,000 cases with evidence × 5 depths × 2 arms):
    .venv/bin/python tests/benchmarks/test_bench_memory.py --cases 1000 --length 131072 --concurrency 64

Knobs for the pytest form: ``DEPTHGATE_BENCH_MEM_LENGTH`` (16384), ``DEPTHGATE_BENCH_MEM_CASES``
(``8,32,96``), ``DEPTHGATE_BENCH_OUT`` (also write the rows there as JSON). ``DEPTHGATE_BENCH_STRICT=1``
asserts a flat slope (< 2 bytes per token between the smallest and the largest size) and a peak
< 4 GB; without it nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import stub_server
from child_memory import REPO, measure_child, measure_sizes, status_kb

GPT2 = REPO / "tests" / "fixtures" / "tokenizers" / "gpt2" / "tokenizer.json.gz"
PEAK_TARGET_MB = 4096


class Stub(stub_server.StubServer):
    """The stub server (tests/benchmarks/stub_server.py) in a child process; it answers at once with a
    fixed completion and stops by itself after ``lifetime_s``."""

    def __init__(self, lifetime_s: float = 6 * 3600) -> None:
        super().__init__(0.0, lifetime_s, " not stated")


class Phases:
    """Per-phase peak RSS: the peak is reset when a phase starts and read when it ends."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            start_kb = status_kb("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            wall, cpu = time.monotonic(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                row = self.rows.setdefault(
                    name, {"peak_mb": 0.0, "start_mb": 0.0, "wall_s": 0.0, "cpu_s": 0.0}
                )
                row["peak_mb"] = max(row["peak_mb"], round(status_kb("VmHWM") / 1024, 1))
                row["start_mb"] = max(row["start_mb"], round(start_kb / 1024, 1))
                row["wall_s"] = round(row["wall_s"] + time.monotonic() - wall, 2)
                row["cpu_s"] = round(row["cpu_s"] + time.process_time() - cpu, 2)

        return hooked


def _matrix(path: Path, url: str, cases: int, lengths: str, depths: int) -> None:
    positions = ", ".join(f"{i / (depths - 1):g}" for i in range(depths))
    path.write_text(
        f'name = "mem"\nsuite = {{ kind = "builtin", cases = {cases}, seed = 0, language = "en" }}\n'
        f"lengths = [{lengths}]\npositions = [{positions}]\n"
        "[decode]\nmax_tokens = 4\nseeds = [0]\n"
        + "".join(
            f'[{arm}]\nname = "{arm[0]}"\nbackend = "vllm-server"\nendpoint = "{url}"\n'
            f'model = "stub"\ntokenizer = "{GPT2}"\n'
            for arm in ("baseline", "candidate")
        )
        + "[plan]\nn_min = 2\n"
    )


def _install_hooks() -> Phases:
    from depthgate.commands import pipeline
    from depthgate.run import controls, runner

    phases = Phases()
    for module, name, phase in (
        (pipeline, "build_layouts", "build"),
        (pipeline, "_guarded_rows", "presend"),
        (pipeline, "_store", "store"),
        (pipeline, "gate_run", "gate"),
        (controls, "build_controls", "controls"),
        (runner, "run_pairs", "run"),
    ):
        setattr(module, name, phases.wrap(phase, getattr(module, name)))
    return phases


def _prepare_only(matrix_path: Path, out: Path, arms: int, verification: str, phases: Phases) -> None:
    """Build + pre-send gate + layout store of the first ``arms`` arms, as `depthgate run` does them
    (same calls, same options), without a server: the nightly shape's memory before any request."""
    from depthgate.commands import pipeline
    from depthgate.layout.layouts import build_layouts
    from depthgate.layout.presend import guard_layouts
    from depthgate.spec.loading import load_matrix
    from depthgate.spec.suites import resolve_suite

    matrix = load_matrix(matrix_path)
    suite = resolve_suite(matrix.suite, base_dir=matrix_path.parent)
    systems = list(zip(pipeline.ARMS, (matrix.baseline, matrix.candidate), strict=True))[:arms]
    for arm, system in systems:
        a = pipeline.arm_setup(arm, system, matrix_path.parent)
        layout_path = out / arm / "layouts.parquet"
        options = a.build_options(matrix, verification)
        phases.wrap("build", build_layouts)(suite, a.tokenizer, options, layout_path)
        guard = functools.partial(
            guard_layouts,
            tokenizer=a.tokenizer,
            template=a.template,
            preamble=system.preamble,
            assembler=system.assembler,
            window=system.window,
            max_output_tokens=matrix.decode.max_tokens,
            cases={c.id: c for c in suite.cases},
        )
        rows = pipeline._guarded_rows(layout_path, guard)
        refused = sum(r["status"] != "ok" for r in rows)
        if refused:
            raise RuntimeError(f"{refused} layouts refused by the pre-send gate")
        pipeline._store(layout_path, out / arm / "store")


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import polars as pl

    from depthgate.commands.cli import main

    phases = _install_hooks()
    if args.presend_reencode == "off":
        # Labelled in the output: the pre-send gate without its full re-encode (every other check
        # runs). Its memory is one batch either way (measured with it on at smaller sizes); its CPU,
        # ≈ 0.1–0.6 s per 128K layout on this machine, would make the 10,000-layout run take hours.
        from depthgate.layout import presend

        setattr(presend, "guard_layouts", functools.partial(presend.guard_layouts, verify=False))  # noqa: B010
    stub = None if args.no_run else Stub()
    base = Path(args.dir) if args.dir else None
    code: int | None = None
    try:
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            matrix = Path(tmp) / "m.toml"
            _matrix(matrix, stub.url if stub else "http://127.0.0.1:9", args.cases, args.length, args.depths)
            out = Path(tmp) / "run"
            wall = time.monotonic()
            if stub is None:
                _prepare_only(matrix, out, args.arms, args.verification, phases)
            else:
                argv = ["run", str(matrix), "--out", str(out), "--verification", args.verification]
                argv += ["--concurrency", str(args.concurrency)]
                if not args.controls:
                    argv.append("--no-controls")
                code = main(argv)
            wall = time.monotonic() - wall
            files = [out / arm / "layouts.parquet" for arm in ("baseline", "candidate")]
            sizes = [
                pl.scan_parquet(f).select(pl.len(), pl.col("target_tokens").sum()).collect().row(0)
                for f in files
                if f.is_file()
            ]
            disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    finally:
        served = stub.stats() if stub else {"requests": 0, "prompt_tokens": 0, "cpu_s": 0.0}
        if stub:
            stub.close()
    run = phases.rows.get("run", {})
    requests = int(served["requests"])
    peak = max([row["peak_mb"] for row in phases.rows.values()] + [status_kb("VmHWM") / 1024])
    return {
        "cases": args.cases,
        "lengths": args.length,
        "layouts": sum(int(n) for n, _ in sizes),
        "tokens": sum(int(t) for _, t in sizes),
        "concurrency": args.concurrency,
        "controls": args.controls,
        "presend_reencode": args.presend_reencode,
        "mode": "build+presend+store only" if stub is None else "depthgate run",
        "exit": code,
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(peak, 1),
        "phases": phases.rows,
        "stub_requests": requests,
        "stub_prompt_tokens": int(served["prompt_tokens"]),
        "stub_cpu_s": round(float(served["cpu_s"]), 1),
        "harness_cpu_ms_per_request": round(1000 * run.get("cpu_s", 0.0) / requests, 2) if requests else None,
        "disk_mb": round(disk / 2**20, 1),
    }


def slope(small: dict[str, Any], large: dict[str, Any], key: str = "peak_rss_mb") -> float:
    """Marginal bytes per token between two sizes."""
    return float(large[key] - small[key]) * 2**20 / float(large["tokens"] - small["tokens"])


@pytest.mark.bench
def test_bench_memory_is_flat_in_the_matrix_size() -> None:
    # one size a child process: its peaks are its own (the child resets them per phase)
    measure = functools.partial(measure_child, __file__)
    _, rows = measure_sizes(measure, "MEM", length="16384", cases="8,32,96")
    small, large = rows[0], rows[-1]
    per_token = slope(small, large)
    print(f"marginal bytes per token, overall peak: {per_token:.2f} (the old run path held ≈ 59)")
    for name in small["phases"]:
        if name in large["phases"]:
            a, b = small["phases"][name]["peak_mb"], large["phases"][name]["peak_mb"]
            per = (b - a) * 2**20 / (large["tokens"] - small["tokens"])
            print(f"  {name}: {a} → {b} MB, {per:.2f} B/token")
    if os.environ.get("DEPTHGATE_BENCH_OUT"):
        out = Path(os.environ["DEPTHGATE_BENCH_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.json").write_text(json.dumps(rows, indent=2))
    for r in rows:
        assert r["exit"] == 0 and r["stub_prompt_tokens"] >= r["tokens"], r  # every layout was sent
    if os.environ.get("DEPTHGATE_BENCH_STRICT") == "1":
        assert per_token < 2.0, per_token
        assert max(r["peak_rss_mb"] for r in rows) < PEAK_TARGET_MB


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=8, help="built-in suite cases (with evidence: placed)")
    parser.add_argument("--length", default="16384", help="one length, or several: 4096,16384,65536,131072")
    parser.add_argument("--depths", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--verification", default="fast", choices=["fast", "full"])
    parser.add_argument("--controls", action="store_true", help="also build and run the controls")
    parser.add_argument(
        "--presend-reencode", default="full", choices=["full", "off"], help="off: labelled, see _child"
    )
    parser.add_argument("--no-run", action="store_true", help="build + pre-send + store only, no server")
    parser.add_argument("--arms", type=int, default=2, choices=[1, 2], help="with --no-run: arms to prepare")
    parser.add_argument("--dir", default=None, help="where the run folder goes (default: the temp dir)")
    print(json.dumps(_child(parser.parse_args())))

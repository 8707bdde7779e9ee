"""Benchmark: the price of the process boundary (issue #35) — the embedded engine in a worker process
against the same engine in process, on the smoke matrix's own layouts, in one process.

Opt-in (``-m bench``). The layouts are those of matrices/smoke.toml (the baseline arm: Gemma-3-270M's
tokenizer, 1,024 tokens, five depths), built here with the matrix's own options. Each round sends every
layout once to :class:`EmbeddedLlamaBackend` (in process) and once to :class:`LlamaWorkerBackend` (a
worker), alternating which goes first, with the same threads and decode settings as a run; the answers
must be identical. Printed: wall seconds per request for each, and the ratio worker / in process.

    DEPTHGATE_BENCH_WORKER_LAYOUTS=20 .venv/bin/python -m pytest -q -m bench -s \
        tests/benchmarks/test_bench_engine_worker.py
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parents[2]


def _layouts(tmp: Path, n: int) -> list[list[int]]:
    from depthgate.layout.layouts import BuildOptions, build_frame, load_tokenizer, parse_positions
    from depthgate.spec.loading import load_matrix
    from depthgate.spec.suites import resolve_suite

    matrix = load_matrix(REPO / "matrices" / "smoke.toml")
    suite = resolve_suite(matrix.suite, base_dir=REPO / "matrices")
    options = BuildOptions(
        lengths=list(matrix.lengths),
        positions=parse_positions([str(p) for p in matrix.positions]),
        window=matrix.baseline.window,
        max_output_tokens=matrix.decode.max_tokens,
        system="gemma",
    )
    frame = build_frame(suite, load_tokenizer("gguf:"), options, tmp / "layouts.parquet")
    ok = frame.filter(frame["status"] == "ok")
    return [list(ids) for ids in ok["token_ids"].to_list()[:n]]


def test_worker_against_in_process_on_smoke_layouts(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    n = int(os.environ.get("DEPTHGATE_BENCH_WORKER_LAYOUTS", "10"))
    rounds = int(os.environ.get("DEPTHGATE_BENCH_WORKER_ROUNDS", "2"))
    prompts = _layouts(tmp_path, n)
    path = gemma_default_gguf()
    tok = tokenizer_from_gguf(path)
    seconds: dict[str, list[float]] = {"in process": [], "worker": []}
    answers: dict[str, list[str]] = {"in process": [], "worker": []}
    with (
        EmbeddedLlamaBackend(path, n_ctx=2048, tokenizer=tok) as local,
        LlamaWorkerBackend(path, n_ctx=2048, tokenizer=tok) as worker,
    ):
        engines = {"in process": local, "worker": worker}
        for engine in engines.values():  # warm-up: first-touch of the weights and the KV buffers
            engine.generate(prompts[0], max_tokens=12, seed=0)
        for r in range(rounds):
            order = ["in process", "worker"] if r % 2 == 0 else ["worker", "in process"]
            for ids in prompts:
                for name in order:
                    start = time.perf_counter()
                    gen = engines[name].generate(ids, max_tokens=12, seed=0)
                    seconds[name].append(time.perf_counter() - start)
                    answers[name].append(gen.text)
    assert answers["worker"] == answers["in process"]
    local_s, worker_s = (statistics.median(seconds[k]) for k in ("in process", "worker"))
    total = {k: sum(v) for k, v in seconds.items()}
    print(
        f"\n{len(prompts)} smoke layouts × {rounds} rounds: in process {local_s:.3f} s/request (median), "
        f"worker {worker_s:.3f} s/request; worker / in process: median {worker_s / local_s:.3f}, "
        f"total {total['worker'] / total['in process']:.3f}"
    )

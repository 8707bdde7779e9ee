"""Benchmark: the price of the process boundary (issue #35) — the embedded engine in a worker process
against the same engine in process, on the smoke matrix's own layouts, in one process.

Opt-in (``-m bench``). The layouts are the baseline arm's of the shipped smoke run
(docs/smoke-run: Gemma-3-270M's tokenizer, 1,024 and 640 tokens, five depths), and the answers are
compared with that run's too: a build of another instruction-set tier may round differently. Each round
sends every layout once to :class:`EmbeddedLlamaBackend` (in process) and once to
:class:`LlamaWorkerBackend` (a worker), alternating which goes first, with the same threads and decode
settings as a run; the answers must be identical. Printed: wall seconds per request for each, and the
ratio worker / in process.

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


def _layouts(arm: str, n: int) -> tuple[list[str], list[list[int]], dict[str, str]]:
    """The first ``n`` ok layouts of ``arm`` in the shipped smoke run (docs/smoke-run, built and answered
    by the run the README quotes), their ids, and that run's answer to each."""
    import polars as pl

    run = REPO / "docs" / "smoke-run"
    frame = pl.read_parquet(run / arm / "layouts.parquet").filter(pl.col("status") == "ok").head(n)
    records = pl.read_parquet(run / "records.parquet").filter(pl.col("arm") == arm)
    shipped = dict(zip(records["layout_id"].to_list(), records["output_text"].to_list(), strict=True))
    return frame["layout_id"].to_list(), [list(ids) for ids in frame["token_ids"].to_list()], shipped


def test_worker_against_in_process_on_smoke_layouts() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    n = int(os.environ.get("DEPTHGATE_BENCH_WORKER_LAYOUTS", "10"))
    rounds = int(os.environ.get("DEPTHGATE_BENCH_WORKER_ROUNDS", "2"))
    ids, prompts, shipped = _layouts("baseline", n)
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
            for prompt in prompts:
                for name in order:
                    start = time.perf_counter()
                    gen = engines[name].generate(prompt, max_tokens=12, seed=0)
                    seconds[name].append(time.perf_counter() - start)
                    answers[name].append(gen.text)
    assert answers["worker"] == answers["in process"]
    # this build against the build that answered the shipped run (the README's numbers)
    same = sum(answers["worker"][i] == shipped[layout] for i, layout in enumerate(ids))  # first round
    local_s, worker_s = (statistics.median(seconds[k]) for k in ("in process", "worker"))
    total = {k: sum(v) for k, v in seconds.items()}
    print(
        f"\n{len(prompts)} smoke layouts × {rounds} rounds: in process {local_s:.3f} s/request (median), "
        f"worker {worker_s:.3f} s/request; worker / in process: median {worker_s / local_s:.3f}, "
        f"total {total['worker'] / total['in process']:.3f}; the shipped smoke run's answer on {same} of "
        f"{len(ids)} layouts"
    )

"""Benchmark: the embedded engine at length (issue #39 item 4) — per prompt length, depthgate's embedded
backend (llama.cpp in its worker process, the product path) against raw llama-cpp-python on the same ids
in this process, and the worker's peak memory.

Opt-in (``-m bench``). For each length L (``DEPTHGATE_BENCH_LENGTHS``, default 1024,2048,4096,8192,16384)
one prompt of exactly L Gemma-3-270M tokens (handbook prose, BOS first) is evaluated and 8 tokens decoded
greedily, with the backend's own settings (2,048-token batches, flash attention, full-size SWA cache,
n_ctx = L + 64), raw first, then the worker. Printed per length: raw prompt tokens/s, the worker's prompt
tokens/s (timed inside the worker) and wall seconds per request (timed here, the boundary included),
harness overhead = worker wall / raw wall − 1, and the worker's peak RSS (VmHWM).

    DEPTHGATE_BENCH_LENGTHS=1024,4096,16384 .venv/bin/python -m pytest -q -m bench -s \
        tests/benchmarks/test_bench_engine_lengths.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.bench

NEW_TOKENS = 8
TEXT = (
    "The operations handbook sets the rules for travel, purchasing, suppliers, security, facilities and "
    "records. Hotel costs in Oslo are capped at 180 EUR per night for all staff, and receipts are kept "
    "for seven years. Suppliers are reviewed every second year by the purchasing team. "
)


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _raw(path: str, ids: list[int]) -> tuple[float, float]:
    """(prompt seconds, total seconds) of raw llama-cpp-python on ``ids``, greedy decode of NEW_TOKENS."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=len(ids) + 64,
        n_batch=2048,
        n_ubatch=2048,
        n_threads=2,
        n_threads_batch=2,
        flash_attn=True,
        swa_full=True,
        logits_all=False,
        verbose=False,
    )
    try:
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)
            )
            llm.eval([int(np.argmax(logits))])
        t2 = time.perf_counter()
    finally:
        llm.close()
    return t1 - t0, t2 - t0


def test_engine_throughput_per_length() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    lengths = [
        int(x) for x in os.environ.get("DEPTHGATE_BENCH_LENGTHS", "1024,2048,4096,8192,16384").split(",")
    ]
    path = gemma_default_gguf()
    tok = tokenizer_from_gguf(path)
    base = tok.encode(TEXT * (max(lengths) // 40 + 1), add_special_tokens=False).ids
    rows = []
    for length in lengths:
        ids = [2, *base[: length - 1]]
        raw_prompt, raw_total = _raw(str(path), ids)
        with LlamaWorkerBackend(path, n_ctx=length + 64, tokenizer=tok, n_threads=2) as worker:
            start = time.perf_counter()
            gen = worker.generate(ids, max_tokens=NEW_TOKENS, seed=0, stop_at_newline=False)
            wall = time.perf_counter() - start
            rss = _peak_rss_mib(worker.pid)
        assert gen.n_prompt_tokens == length
        rows.append((length, length / raw_prompt, length / gen.prompt_seconds, raw_total, wall, rss))
        print(f"\n{length}: raw {raw_total:.2f} s, worker {wall:.2f} s", flush=True)
    print(
        "\n| length | raw prompt tok/s | worker prompt tok/s | raw s/request | worker s/request | overhead | "
        "worker peak RSS MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length, raw_tps, worker_tps, raw_s, wall, rss in rows:
        print(
            f"| {length} | {raw_tps:.0f} | {worker_tps:.0f} | {raw_s:.2f} | {wall:.2f} | "
            f"{wall / raw_s - 1:+.1%} | {rss:.0f} |"
        )

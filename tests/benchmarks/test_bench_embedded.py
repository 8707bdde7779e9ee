"""Benchmark: where the README main command's time goes, against the machine's compute floor.

Opt-in (``-m bench``). The main command (``scripts/demo.sh``) runs matrices/smoke.toml on the embedded
default, Gemma-3-270M (Q4_K_M) in llama.cpp on the CPU: 112 requests of ≈ 1,024 prompt tokens (80 matrix
requests, 32 controls) and ≤ 24 new tokens each. This measures, in one process:

* the **baseline**: the machine's dense matmul rate, float32 numpy (BLAS) on the same cores, in GFLOP/s;
* one request's **prompt evaluation** (1,024 tokens) and **decoding** (16 tokens) through the
  backend's own llama.cpp settings (threads, batch, flash attention), wall and CPU seconds;
* the model's **arithmetic**: 2 FLOPs per weight per token over the transformer's weights (read from
  the GGUF tensor list; the tied 262K-entry embedding is a lookup, and the output projection runs for
  the last position only), plus attention, so the prompt's GFLOP and the rate llama.cpp reaches.

The ratio rate / BLAS rate says how close llama.cpp's quantised kernels run to the floor of the
hardware; requests × CPU seconds per request / cores is then the smallest wall time the run can take.

    .venv/bin/python tests/benchmarks/test_bench_embedded.py
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

pytestmark = pytest.mark.bench

PROMPT_TOKENS = 1024
NEW_TOKENS = 16
SMOKE_REQUESTS = 112  # 2 arms × 8 cases × 5 depths + 2 arms × 8 cases × 2 controls


def blas_gflops(n: int = 1024, repeats: int = 5) -> float:
    """float32 n×n matmul rate of this process (best of ``repeats``), in GFLOP/s."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm the BLAS threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def model_arithmetic(path: str) -> dict[str, float]:
    """Weights per token and attention FLOPs of the GGUF model (from its tensor list and metadata)."""
    import gguf

    reader = gguf.GGUFReader(path)
    weights = 0
    embedding = 0
    for tensor in reader.tensors:
        count = int(np.prod(tensor.shape))
        if tensor.name.startswith("token_embd"):
            embedding = count
        elif tensor.name.endswith(".weight") and len(tensor.shape) == 2:
            weights += count

    def field(name: str) -> int:
        item = reader.fields[name]
        return int(item.parts[item.data[0]][0])

    arch = "gemma3"
    layers = field(f"{arch}.block_count")
    heads = field(f"{arch}.attention.head_count")
    head_dim = field(f"{arch}.attention.key_length")
    return {
        "layers": layers,
        "matmul_weights_per_token": weights,
        "embedding_weights": embedding,
        # QK^T and AV over a causal prompt of T tokens: ≈ 2 · 2 · heads · head_dim · T² / 2 per layer.
        "attention_flops_per_t2": 2.0 * heads * head_dim * layers,
    }


def measure() -> dict[str, object]:
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend, default_threads

    path = str(gemma_default_gguf())
    threads = default_threads()
    floor = blas_gflops()
    # The backend's own engine: its threads, batch, flash attention and SWA settings.
    llm = EmbeddedLlamaBackend(model_path=path, n_ctx=2048)._llm
    rng = np.random.default_rng(1)
    vocab = llm.n_vocab()
    rows = []
    for _ in range(3):
        tokens = [int(t) for t in rng.integers(1000, vocab - 1000, PROMPT_TOKENS)]
        llm.reset()
        wall, cpu = time.perf_counter(), time.process_time()
        llm.eval(tokens)
        prompt = (time.perf_counter() - wall, time.process_time() - cpu)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(NEW_TOKENS):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        decode = (time.perf_counter() - wall, time.process_time() - cpu)
        rows.append((prompt, decode))
    prompt_wall, prompt_cpu = min(r[0] for r in rows)
    decode_wall, decode_cpu = min(r[1] for r in rows)
    arith = model_arithmetic(path)
    # The output projection (tied embedding) runs once per evaluated batch's last position.
    prompt_gflop = (
        2 * arith["matmul_weights_per_token"] * PROMPT_TOKENS
        + arith["attention_flops_per_t2"] * PROMPT_TOKENS**2
        + 2 * arith["embedding_weights"]
    ) / 1e9
    rate = prompt_gflop / prompt_wall
    per_request_cpu = prompt_cpu + decode_cpu * 24 / NEW_TOKENS
    cores = os.cpu_count() or 1
    return {
        "threads": threads,
        "cores": cores,
        "blas_gflops": round(floor, 1),
        "prompt_tokens": PROMPT_TOKENS,
        "prompt_wall_s": round(prompt_wall, 3),
        "prompt_cpu_s": round(prompt_cpu, 3),
        "prompt_tokens_per_s": round(PROMPT_TOKENS / prompt_wall, 1),
        "decode_ms_per_token": round(1000 * decode_wall / NEW_TOKENS, 1),
        "decode_cpu_ms_per_token": round(1000 * decode_cpu / NEW_TOKENS, 1),
        "matmul_weights_per_token": arith["matmul_weights_per_token"],
        "prompt_gflop": round(prompt_gflop, 1),
        "llama_cpp_gflops": round(rate, 1),
        "ratio_to_blas": round(rate / floor, 2),
        "cpu_s_per_request_24_new": round(per_request_cpu, 2),
        "smoke_requests": SMOKE_REQUESTS,
        "smoke_floor_wall_min": round(SMOKE_REQUESTS * per_request_cpu / min(cores, threads) / 60, 1),
        "load_average": os.getloadavg(),
    }


def test_embedded_request_cost_against_the_blas_floor() -> None:
    row = measure()
    print(json.dumps(row, indent=1))
    assert row["prompt_tokens_per_s"] > 0  # a measurement, not a timing assertion


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))

"""The speed price of an engine build: prompt and decode tokens/s of llama.cpp builds, side by side.

Each build is a folder holding an installed ``llama_cpp`` package (``pip install --no-deps --target DIR
WHEEL``); every round runs each build once, in a child process of its own with that folder first on
PYTHONPATH, alternating so load drifts hit all builds alike. Printed: the median over rounds of prompt
tokens/s (one ``--prompt``-token prompt, evaluated cold) and decode tokens/s (``--decode`` greedy steps),
and each build's ratio to the first. The model is the embedded default (Gemma-3-270M Q4_K_M).

    python scripts/engine_speed.py native=/tmp/site-native avx512-vnni=/tmp/site-avx512-vnni ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
from depthgate.layout.gguf_tokenizer import gemma_default_gguf
n_prompt, n_decode, threads = (int(a) for a in sys.argv[1:4])
llm = llama_cpp.Llama(model_path=str(gemma_default_gguf()), n_ctx=n_prompt + n_decode + 8, n_batch=2048,
                      n_ubatch=2048, n_threads=threads, n_threads_batch=threads, flash_attn=True,
                      swa_full=True, verbose=False)
words = ("The travel policy allows a maximum of 180 EUR per night in Oslo for all staff. " * 400).encode()
ids = llm.tokenize(words, add_bos=True)[:n_prompt]
t0 = time.perf_counter()
llm.eval(ids)
t1 = time.perf_counter()
for _ in range(n_decode):
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    llm.eval([token])
t2 = time.perf_counter()
print(json.dumps({"prompt_tps": len(ids) / (t1 - t0), "decode_tps": n_decode / (t2 - t1)}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="LABEL=SITE_DIR, the first is the baseline")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    builds = [b.split("=", 1) for b in args.builds]
    seen: dict[str, list[dict[str, float]]] = {label: [] for label, _ in builds}
    for r in range(args.rounds):
        for label, site in builds:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.prompt), str(args.decode), str(args.threads)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            seen[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {label}: {seen[label][-1]}", file=sys.stderr)
    base = builds[0][0]
    med = {
        label: {k: statistics.median(x[k] for x in runs) for k in ("prompt_tps", "decode_tps")}
        for label, runs in seen.items()
    }
    print(f"| build | prompt tok/s ({args.prompt}) | × {base} | decode tok/s | × {base} |")
    print("|---|---|---|---|---|")
    for label, m in med.items():
        print(
            f"| {label} | {m['prompt_tps']:.0f} | {m['prompt_tps'] / med[base]['prompt_tps']:.2f} "
            f"| {m['decode_tps']:.1f} | {m['decode_tps'] / med[base]['decode_tps']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

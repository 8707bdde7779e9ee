"""Measure, on a real ``vllm serve``, what docs/nightly.md reports: prefix-cache reuse with the two
request orders, and an A/A run's flips.

    VLLM_SERVER_DEV_MODE=1 bash scripts/vllm_serve.sh &      # dev mode: POST /reset_prefix_cache
    .venv/bin/python scripts/vllm/measure.py http://127.0.0.1:8011 docs/vllm-cpu
    # the same orders with a KV cache of 384 blocks (≈ 7,800 tokens: ≈ 5 requests of this matrix, the
    # ratio of a 128K nightly on one GPU), no A/A:
    VLLM_SERVER_DEV_MODE=1 bash scripts/vllm_serve.sh --num-gpu-blocks-override 384 &
    .venv/bin/python scripts/vllm/measure.py http://127.0.0.1:8011 docs/vllm-cpu/small-cache --no-aa

For each of ``order = "shuffled"`` and ``order = "haystack"`` it empties the server's prefix cache, runs
matrices/vllm-cpu.toml (matrix requests only, no controls) and reads vLLM's own counters
(``vllm:prefix_cache_queries_total`` / ``_hits_total`` from ``/metrics``) before and after; then it runs
the same matrix as an A/A run (``--aa``). Every run folder is kept under OUT (records, scored.parquet,
verdict.json) and the numbers go to OUT/measurements.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def metrics(url: str) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        for line in answer.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def reset_prefix_cache(url: str) -> None:
    request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=60) as answer:
        if answer.status != 200:
            raise SystemExit(
                f"reset_prefix_cache answered {answer.status}: serve with VLLM_SERVER_DEV_MODE=1"
            )


def matrix(url: str, out: Path, *, order: str) -> Path:
    text = (REPO / "matrices" / "vllm-cpu.toml").read_text(encoding="utf-8")
    text = text.replace('endpoint = "http://127.0.0.1:8011"', f'endpoint = "{url}"')
    model = os.path.relpath(REPO / "models" / "gemma3-270m-hf", out.resolve())
    text = text.replace('tokenizer = "../models/gemma3-270m-hf"', f'tokenizer = "{model}"')
    # Matrix requests only: no canaries (on by default for a server arm), as in the shipped runs.
    text = text.replace("repeats = 1", f'repeats = 1\norder = "{order}"\ncanaries = 0')
    path = out / f"vllm-cpu-{order}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def run(args: list[str]) -> tuple[int, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "depthgate", *args], check=False)
    seconds = time.monotonic() - started
    folder = Path(args[args.index("--out") + 1])
    # What ships is what re-gates: records, scored.parquet, manifest, suite, layouts, reports; not the
    # id/text stores (rebuilt from the layouts on a resume), the record shards (compacted) or the lock.
    leftovers = [*folder.glob("*/store"), folder / "records", folder / ".depthgate-run.lock"]
    for leftover in [*leftovers, folder / "report" / "report.html"]:  # `depthgate gate` writes it
        if leftover.is_dir():
            shutil.rmtree(leftover)
        elif leftover.exists():
            leftover.unlink()
    return done.returncode, seconds


def main(url: str, out: Path, *, aa: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {}
    for order in ("shuffled", "haystack"):
        reset_prefix_cache(url)
        before = metrics(url)
        path = matrix(url, out, order=order)
        code, seconds = run(["run", str(path), "--out", str(out / order), "--no-controls"])
        after = metrics(url)
        queries = after[COUNTERS[0]] - before[COUNTERS[0]]
        hits = after[COUNTERS[1]] - before[COUNTERS[1]]
        results[order] = {
            "exit_code": code,
            "wall_s": round(seconds, 1),
            "prefix_cache_queries": int(queries),
            "prefix_cache_hits": int(hits),
            "hit_rate": round(hits / queries, 4) if queries else None,
        }
        print(order, results[order], flush=True)
    if aa:
        reset_prefix_cache(url)
        path = matrix(url, out, order="shuffled")
        code, seconds = run(["run", str(path), "--out", str(out / "aa"), "--aa", "--no-controls"])
        results["aa"] = {"exit_code": code, "wall_s": round(seconds, 1)}
    (out / "measurements.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-aa"]
    if len(args) != 2:
        raise SystemExit("usage: measure.py URL OUT_DIR [--no-aa]")
    main(args[0], Path(args[1]), aa="--no-aa" not in sys.argv)

"""Benchmark: peak RSS of `depthgate run` (build + pre-send + run + gate) as the matrix grows.

Opt-in (``-m bench``). Each size runs `depthgate run` in a **fresh child process** (this file as a
script) against a fast local **stub** server on 127.0.0.1 (vLLM-shaped ``/v1/completions``, token-id
prompts, answers at once; labelled as such: it measures the harness, not a model) and reports the
child's ``VmHWM``. Memory must stay O(batch + in flight): the peak should not grow with the number of
layouts × tokens the way the old run path did (≈ 59 bytes per held token).

    .venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/benchmarks/test_bench_memory.py
    .venv/bin/python tests/benchmarks/test_bench_memory.py --cases 40 --length 32768   # one size
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 1 << 20}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        n = len(body["prompt"])
        self._send(
            {
                "model": "stub",
                "choices": [
                    {
                        "index": 0,
                        "text": " not stated",
                        "finish_reason": "stop",
                        "prompt_token_ids": body["prompt"],
                    }
                ],
                "usage": {"prompt_tokens": n, "completion_tokens": 2},
            }
        )


def _child(cases: int, length: int) -> dict[str, Any]:
    from depthgate.commands.cli import main

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tok = REPO / "tests" / "fixtures" / "tokenizers" / "gpt2" / "tokenizer.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        matrix = Path(tmp) / "m.toml"
        url = f"http://127.0.0.1:{server.server_address[1]}"
        matrix.write_text(
            f'name = "mem"\nsuite = {{ kind = "builtin", cases = {cases}, seed = 0, language = "en" }}\n'
            f"lengths = [{length}]\npositions = [0.0, 0.25, 0.5, 0.75, 1.0]\n"
            "[decode]\nmax_tokens = 4\nseeds = [0]\n"
            + "".join(
                f'[{arm}]\nname = "{arm[0]}"\nbackend = "vllm-server"\nendpoint = "{url}"\n'
                f'model = "stub"\ntokenizer = "{tok}"\n'
                for arm in ("baseline", "candidate")
            )
            + "[plan]\nn_min = 2\n"
        )
        code = main(
            [
                "run",
                str(matrix),
                "--out",
                str(Path(tmp) / "run"),
                "--verification",
                "fast",
                "--concurrency",
                "16",
            ]
        )
    status = Path("/proc/self/status").read_text()
    peak_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    layouts = 2 * cases * 5
    return {"cases": cases, "length": length, "layouts": layouts, "tokens": layouts * length,
            "exit": code, "peak_rss_mb": round(peak_kb / 1024, 1)}  # fmt: skip


def _measure(cases: int, length: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--cases", str(cases), "--length", str(length), "--json"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.bench
def test_bench_run_path_memory_is_flat_in_the_matrix_size() -> None:
    rows = [_measure(cases, 16384) for cases in (8, 32)]
    for r in rows:
        print(json.dumps(r))
    small, large = rows
    per_token = (large["peak_rss_mb"] - small["peak_rss_mb"]) * 2**20 / (large["tokens"] - small["tokens"])
    print(f"marginal bytes per token: {per_token:.2f} (the old run path held ≈ 59)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(json.dumps(_child(args.cases, args.length)))

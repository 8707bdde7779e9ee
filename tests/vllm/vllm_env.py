"""What the vLLM tests share (imported by name; conftest.py holds only the fixtures): where the vLLM
environment and the converted model are, the skip-or-fail rule, the engine's environment and the server
handle."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers import REPO

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

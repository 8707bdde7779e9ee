"""Tokenizer parity before the first request (run/parity.py), on a real llama.cpp server: llama-cpp-python's
own server on 127.0.0.1 with the packaged Gemma-3-270M GGUF, which tokenizes through ``/extras/tokenize``
(always with BOS, special tokens parsed: what it does to a text prompt). The same checks against the real
vLLM server (``/tokenize``) are in tests/vllm/test_server.py.

* A text arm with the model's own tokenizer (``gguf:``): every prompt is compared, all identical, the run
  goes on.
* The same arm with a deliberately different tokenizer (SmolLM's BPE): refused with exit 22 before any
  completion request, naming the first differing token; the new run folder is removed.
* A server without a tokenize route (a stub: labelled stand-in) is recorded as "not checked".
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from depthgate.exceptions import ExitCode
from helpers import REPO, LlamaServerProcess, ModelsHandler, StubServer, completion, stub_matrix

SMOLLM = REPO / "tests" / "fixtures" / "tokenizers" / "smollm" / "tokenizer.json.gz"


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerProcess]:
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")
    server = LlamaServerProcess.start(tmp_path_factory.mktemp("parity-server"), n_threads=2)
    try:
        server.wait_up(time.monotonic() + 90, poll_s=0.25)
        yield server
    finally:
        server.stop()


ROLES = (("baseline", "base"), ("candidate", "cand"))


def _matrix(url: str, tokenizer: str, tmp_path: Path) -> Path:
    arm = 'backend = "llamacpp"\nmodel = "gemma3-270m"\ntokenizer = "{}"\nendpoint = "{}"\n'
    arm += 'runtime = {{ prompt_format = "text" }}\n\n'
    arms = "".join(f'[{role}]\nname = "{name}"\n' + arm.format(tokenizer, url) for role, name in ROLES)
    text = f"""
name = "parity"
suite = {{ kind = "builtin", cases = 2, seed = 0, language = "en" }}
lengths = [512]
positions = [0.0, 1.0]

[decode]
max_tokens = 4
seeds = [0]
stop = ["\\n"]

{arms}

[plan]
margin = 0.20
n_min = 2
bootstrap_resamples = 199
base_score = "control"
"""
    path = tmp_path / "parity.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _run(matrix: Path, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "depthgate", "run", str(matrix), "--out", str(out), "--no-controls"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.smoke_model
def test_text_arm_is_checked_on_every_prompt_by_the_llamacpp_server(
    llama_server: LlamaServerProcess, tmp_path: Path
) -> None:
    done = _run(_matrix(llama_server.url, "gguf:", tmp_path), tmp_path / "run")
    assert done.returncode in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), done.stderr[-2000:]
    for arm in ("baseline", "candidate"):
        (report,) = json.loads((tmp_path / "run" / arm / "tokenizer_parity.json").read_text())
        assert report["route"] == "/extras/tokenize" and report["scope"] == "every prompt"
        assert report["checked"] == 4  # 2 cases × 2 depths, all of them
    assert "tokenized identically by /extras/tokenize" in done.stderr


@pytest.mark.smoke_model
def test_a_different_tokenizer_is_refused_before_sending(
    llama_server: LlamaServerProcess, tmp_path: Path
) -> None:
    before = llama_server.completions()
    done = _run(_matrix(llama_server.url, str(SMOLLM), tmp_path), tmp_path / "run")
    assert done.returncode == ExitCode.TOKENIZER_MISMATCH, done.stderr[-2000:]
    assert f"the server at {llama_server.url} (/extras/tokenize) tokenizes layout" in done.stderr
    assert "first differs at token 0" in done.stderr and "nothing was sent" in done.stderr
    assert "Traceback" not in done.stderr
    assert llama_server.completions() == before
    assert not (tmp_path / "run").exists()


def test_a_server_without_a_tokenize_route_is_not_checked(shared_dir: Path, tmp_path: Path) -> None:
    """A labelled stand-in: an OpenAI-compatible server that answers completions and 404 on the
    tokenizer routes (helpers.JSONHandler)."""
    tokenizer = shared_dir / "tokenizers" / "gpt2" / "tokenizer.json"

    class Handler(ModelsHandler):
        def do_POST(self) -> None:
            body = self.read_json()
            self.send_json(completion(body["model"], "4821", list(body["prompt"])))

    with StubServer(Handler) as server:
        url = f"http://127.0.0.1:{server.port}"
        matrix = tmp_path / "m.toml"
        matrix.write_text(stub_matrix("noroute", where=f'endpoint = "{url}"', tokenizer=tokenizer))
        done = _run(matrix, tmp_path / "run")
    assert done.returncode in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), done.stderr[-2000:]
    (report,) = json.loads((tmp_path / "run" / "baseline" / "tokenizer_parity.json").read_text())
    assert report["route"] is None and report["checked"] == 0
    assert f"tokenizer parity: baseline @ {url}: not checked" in done.stderr

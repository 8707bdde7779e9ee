"""``backend = "vllm-server"`` against a real ``vllm serve`` on 127.0.0.1 (no stub): a matrix end to end
with a verdict; every real refusal the server makes, triggered on purpose and named in the records; the
tokenizer parity check refusing a deliberately different tokenizer before anything is sent.

The window behaviours of vLLM 0.32 (research/vllm_cpu.md): a prompt over the window → 400 naming the
limit; prompt + ``max_tokens`` over the window → **200 with the output silently clamped**
(``finish_reason: "length"``); a prompt of exactly the window → 400 "max_tokens must be at least 1".
depthgate reads the window from ``/v1/models`` and refuses such layouts before sending
(``presend_window_overflow``). To show what happens when the window is *not* known — a gateway in
front of vLLM that drops ``max_model_len`` from its model list, as many do — the same layouts go
through such a gateway (a forwarding proxy on 127.0.0.1), and vLLM's own answers must become
``overflow`` and ``max_tokens_clamped`` records.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import polars as pl
import pytest
from vllm_env import SERVED_NAME, WINDOW, VLLMServer

from depthgate.exceptions import BackendRequestError, ExitCode, OverLengthError
from depthgate.run.backends.base import Request
from depthgate.run.backends.http import OpenAICompletionsBackend
from depthgate.run.records import read_records
from helpers import REPO

pytestmark = pytest.mark.vllm


def vllm_matrix(
    url: str,
    *,
    cases: int = 4,
    lengths: str = "[768, 1024]",
    positions: str = "[0.0, 1.0]",
    tokenizer: str | None = None,
    extra_arm: str = "",
    stop: str = '["\\n"]',
) -> str:
    """matrices/vllm-cpu.toml cut down for the test command, pointed at ``url``; its tokenizer path made
    absolute (the test writes the matrix elsewhere)."""
    text = (REPO / "matrices" / "vllm-cpu.toml").read_text(encoding="utf-8")
    text = text.replace("cases = 8", f"cases = {cases}").replace(
        "lengths = [768, 1536]", f"lengths = {lengths}"
    )
    text = text.replace("positions = [0.0, 0.5, 1.0]", f"positions = {positions}")
    text = text.replace('endpoint = "http://127.0.0.1:8011"', f'endpoint = "{url}"\n{extra_arm}')
    # the evidence-only control as NoLiMa's base: the serving path at the gated lengths only
    text = text.replace("n_min = 8", 'n_min = 2\nbase_score = "control"').replace(
        "bootstrap_resamples = 999", "bootstrap_resamples = 199"
    )
    text = text.replace('stop = ["\\n"]', f"stop = {stop}")
    tok = tokenizer or str(REPO / "models" / "gemma3-270m-hf")
    return text.replace('tokenizer = "../models/gemma3-270m-hf"', f'tokenizer = "{tok}"')


def depthgate(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "depthgate", *args], cwd=cwd, capture_output=True, text=True, timeout=1200
    )


def run_matrix(tmp_path: Path, text: str, name: str = "m") -> tuple[subprocess.CompletedProcess[str], Path]:
    matrix = tmp_path / f"{name}.toml"
    matrix.write_text(text, encoding="utf-8")
    out = tmp_path / f"run-{name}"
    return depthgate("run", str(matrix), "--out", str(out), cwd=tmp_path), out


def test_matrix_end_to_end_on_the_real_server(vllm_server: VLLMServer, tmp_path: Path) -> None:
    before = vllm_server.completions_answered()
    done, run = run_matrix(tmp_path, vllm_matrix(vllm_server.url))
    assert done.returncode in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), done.stderr[-3000:]
    verdict = json.loads((run / "report" / "verdict.json").read_text())
    assert verdict["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")
    records = pl.read_parquet(run / "records.parquet")
    assert records.height == 2 * 4 * 2 * 2  # arms × cases × lengths × depths
    # Every request answered "ok": its echoed prompt ids (return_token_ids) equal to the ids sent (else
    # server_ids_mismatch; the echo itself is asserted in test_backend_maps_each_real_refusal) and the
    # server's count equal to the local count.
    assert set(records["status"]) == {"ok"}
    assert (records["prompt_tokens_server"] == records["prompt_tokens_local"]).all()
    controls = pl.read_parquet(run / "controls" / "records.parquet")
    # A server arm gets 2 head + 2 tail canaries per length by default (issue #37 item 7): both arms on
    # the one server, the same content, so the same canary prompts, answered alike (no canary lost).
    canaries = read_records(run / "canaries")
    assert canaries.height == 2 * 2 * 2 * 2  # arms × kinds × canaries × lengths
    assert verdict["serving_checks"]["canaries"]["lost"] == []
    sent = records.height + controls.height + canaries.height
    assert vllm_server.completions_answered() - before == sent
    # The window came from /v1/models; the tokenizer was checked against the server's own /tokenize.
    for arm in ("baseline", "candidate"):
        parity = json.loads((run / arm / "tokenizer_parity.json").read_text())
        assert parity == [
            {
                "arm": arm,
                "endpoint": vllm_server.url,
                "route": "/tokenize",
                "checked": 8,
                "scope": "sample",
                "unreachable": False,
                "status": "checked",
                "reason": None,
                "policy": "refuse_on_failure",
                "outcome": "8 prompt(s) (sample) tokenized identically by /tokenize",
            }
        ]
    assert f"tokenizer parity: baseline @ {vllm_server.url}: 8 prompt(s) (sample) tokenized identically" in (
        done.stderr
    )
    manifest = json.loads((run / "manifest.json").read_text())
    snapshot = manifest["systems"]["baseline"]["snapshots"]["tokenizer"]
    assert snapshot["add_bos_token"] is True and snapshot["post_processor_patched"] is True
    assert set(snapshot["files"]) >= {"tokenizer.json", "tokenizer_config.json"}
    ids = pl.read_parquet(run / "baseline" / "layouts.parquet", columns=["token_ids"])["token_ids"]
    assert {row[0] for row in ids.to_list()} == {2}  # Gemma's <bos>, from tokenizer_config.json


def test_parity_refuses_a_different_tokenizer_before_sending(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """The layouts built with GPT-2's tokenizer, the server serving Gemma: refused by name, exit 22, no
    completion request sent, no run folder left behind."""
    gpt2 = REPO / "tests" / "fixtures" / "tokenizers" / "gpt2" / "tokenizer.json.gz"
    before = vllm_server.completions_answered()
    done, run = run_matrix(tmp_path, vllm_matrix(vllm_server.url, tokenizer=str(gpt2), lengths="[768]"))
    assert done.returncode == ExitCode.TOKENIZER_MISMATCH, done.stderr[-3000:]
    assert "(/tokenize) tokenizes layout" in done.stderr and "first differs at token 0" in done.stderr
    assert "nothing was sent" in done.stderr and "Traceback" not in done.stderr
    assert vllm_server.completions_answered() == before
    assert not run.exists()


def test_text_arm_without_the_servers_bos_is_refused(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """``prompt_format = "text"``: the server tokenizes the text itself, so every prompt is compared as
    sent. vLLM 0.32's tokenizer for this model adds no BOS to a text prompt although the model folder's
    config asks for one: the layouts (BOS first) and what the server would run differ at token 0, and
    the run is refused instead of running Gemma without its BOS."""
    text = vllm_matrix(
        vllm_server.url, cases=2, lengths="[768]", extra_arm='runtime = { prompt_format = "text" }'
    )
    before = vllm_server.completions_answered()
    done, run = run_matrix(tmp_path, text)
    assert done.returncode == ExitCode.TOKENIZER_MISMATCH, done.stderr[-3000:]
    assert "(/tokenize)" in done.stderr and "the prompt as sent first differs at token 0" in done.stderr
    assert "depthgate [2, " in done.stderr and "send token ids instead" in done.stderr
    assert vllm_server.completions_answered() == before and not run.exists()


def test_text_arm_is_checked_on_every_prompt(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """The same text arm with the bare tokenizer.json (no BOS, as the server tokenizes): every prompt is
    compared and identical, the run goes through, the server's counts equal the local ones."""
    text = vllm_matrix(
        vllm_server.url,
        cases=2,
        lengths="[768]",
        tokenizer=str(REPO / "models" / "gemma3-270m-hf" / "tokenizer.json"),
        extra_arm='runtime = { prompt_format = "text" }',
    )
    done, run = run_matrix(tmp_path, text)
    assert done.returncode in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), done.stderr[-3000:]
    parity = json.loads((run / "baseline" / "tokenizer_parity.json").read_text())
    assert parity[0]["scope"] == "every prompt" and parity[0]["checked"] == 4
    records = pl.read_parquet(run / "records.parquet")
    assert set(records["status"]) == {"ok"}
    assert (records["prompt_tokens_server"] == records["prompt_tokens_local"]).all()


def test_window_known_refuses_over_window_layouts_before_sending(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    before = vllm_server.completions_answered()
    lengths = f"[{WINDOW - 8}, {WINDOW}, {WINDOW + 52}]"
    done, run = run_matrix(
        tmp_path, vllm_matrix(vllm_server.url, cases=1, lengths=lengths, positions="[0.0]")
    )
    records = pl.read_parquet(run / "records.parquet")
    assert set(records["status"]) == {"system_fail"}
    assert set(records["system_fail_reason"]) == {"presend_window_overflow"}
    controls = pl.read_parquet(run / "controls" / "records.parquet")
    sent = controls.height - int((controls["system_fail_reason"] == "presend_window_overflow").sum())
    assert vllm_server.completions_answered() - before == sent  # only the controls that fit were sent
    assert done.returncode == ExitCode.FAIL_SYSTEM or done.returncode == ExitCode.INCONCLUSIVE


class _Gateway:
    """A forwarding proxy on 127.0.0.1 in front of the real server that drops ``max_model_len`` from
    ``/v1/models`` (gateways often list models without it): depthgate cannot know the window, the
    requests reach vLLM, and vLLM's own answers are what the records must name."""

    def __init__(self, upstream: str) -> None:
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                body = (
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    if method == "POST"
                    else None
                )
                answer = httpx.request(
                    method, upstream + self.path, content=body, headers={"Content-Type": "application/json"},
                    timeout=300,
                )  # fmt: skip
                data = answer.content
                if self.path == "/v1/models" and answer.status_code == 200:
                    doc = answer.json()
                    for card in doc.get("data", []):
                        card.pop("max_model_len", None)
                    data = json.dumps(doc).encode()
                gateway.seen.append((self.path, answer.status_code))
                self.send_response(answer.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        self.seen: list[tuple[str, int]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway(vllm_server: VLLMServer) -> Iterator[_Gateway]:
    proxy = _Gateway(vllm_server.url)
    yield proxy
    proxy.close()


def test_real_window_refusals_are_named_in_the_records(gateway: _Gateway, tmp_path: Path) -> None:
    """Window unknown (the gateway hides it): vLLM answers 400 over the window, 400 at exactly the
    window, and 200 *clamped* just under it; the records say ``overflow``, ``overflow`` and
    ``max_tokens_clamped``, and the verdict blames the serving path, not the model."""
    lengths = f"[{WINDOW - 2}, {WINDOW}, {WINDOW + 52}]"
    # No stop string: the answer runs to max_tokens (12) unless vLLM clamps it (to 2 at WINDOW - 2: an
    # end-of-text within 2 tokens, which would hide the clamp, is not a risk worth a flaky test).
    text = vllm_matrix(gateway.url, cases=1, lengths=lengths, positions="[0.0]", stop="[]")
    done, run = run_matrix(tmp_path, text)
    records = pl.read_parquet(run / "records.parquet")
    by_length = {
        (row["arm"], row["target_tokens"]): row["system_fail_reason"] for row in records.iter_rows(named=True)
    }
    for arm in ("baseline", "candidate"):
        assert by_length[(arm, WINDOW - 2)] == "max_tokens_clamped"
        assert by_length[(arm, WINDOW)] == "overflow"
        assert by_length[(arm, WINDOW + 52)] == "overflow"
    statuses = {status for path, status in gateway.seen if path == "/v1/completions"}
    assert statuses == {200, 400}  # the requests did reach vLLM, which answered them itself
    assert done.returncode == ExitCode.FAIL_SYSTEM or done.returncode == ExitCode.INCONCLUSIVE


def test_backend_maps_each_real_refusal(vllm_server: VLLMServer) -> None:
    """One request per real behaviour, straight through the backend."""

    async def scenario() -> None:
        backend = OpenAICompletionsBackend(SERVED_NAME, base_url=vllm_server.url, vllm=True)
        card = await backend.probe()
        assert card["max_model_len"] == WINDOW and backend.window == WINDOW

        def request(ids: list[int], max_tokens: int = 4) -> Request:
            return Request(
                layout_id="x", arm="baseline", seed=0, token_ids=ids, text=None, max_tokens=max_tokens
            )

        ok = await backend.generate(request([2, 818, 5279, 529, 7001, 563]))
        assert ok.server_prompt_ids_match is True and ok.prompt_tokens_server == 6
        # Over the window: refused before sending (the served window is known) ...
        with pytest.raises(OverLengthError, match="exceeds the served window"):
            await backend.generate(request([2] + [100] * (WINDOW + 52)))
        # ... and by vLLM itself when the check is skipped (its 400 names the limit).
        backend._served_window = None
        with pytest.raises(OverLengthError, match="HTTP 400"):
            await backend.generate(request([2] + [100] * (WINDOW + 52)))
        with pytest.raises(OverLengthError, match="HTTP 400"):
            await backend.generate(request([2] + [100] * (WINDOW - 1)))  # exactly the window
        clamped = await backend.generate(request([2] + [100] * (WINDOW - 8), max_tokens=100))
        assert clamped.finish_reason == "length" and clamped.completion_tokens == 7
        # An id outside the vocabulary: a refusal the user must fix, with vLLM's own words.
        with pytest.raises(BackendRequestError, match="out of vocabulary") as info:
            await backend.generate(request([2, 300000]))
        assert info.value.status == 400
        await backend.aclose()

    asyncio.run(scenario())

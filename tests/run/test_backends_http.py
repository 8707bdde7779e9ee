"""HTTP backends.

Two kinds of tests live here:

* ``smoke_model`` tests against a **real** OpenAI-compatible server: llama-cpp-python's own server
  (``python -m llama_cpp.server``) on 127.0.0.1 with the packaged Gemma-3-270M GGUF.
* **Recorded shapes** tests: a tiny local stub HTTP server on 127.0.0.1 answers with the request and
  response shapes recorded in research/api_facts.md for vLLM (0.8.5 / 0.11 / 0.32), OpenAI and Anthropic.
  The stub is a stand-in only where no real endpoint can run here: OpenAI and Anthropic; vLLM versions
  other than the CPU build's 0.32; and failures a healthy vLLM does not produce on demand (an echo that
  differs from the ids sent, 503 with Retry-After, persistent 500s, timeouts). vLLM 0.32's own answers —
  ``/v1/models``, ``return_token_ids``, ``/tokenize``, its 400s over and at the window, its silent
  clamping, an out-of-vocabulary id — are tested against the real engine in ``tests/vllm/`` (offline
  and ``vllm serve`` on 127.0.0.1, in the test command).

What llama-cpp-python 0.3.36's server does (measured by the smoke tests below): ``/v1/completions`` takes
text only — a token-id prompt gets HTTP 500 with pydantic ``string_type`` errors; text is tokenized with
BOS added, exactly as the local GGUF tokenizer encodes it with ``add_special_tokens=True`` (checked with
``/extras/tokenize``); ``usage.prompt_tokens`` is that count; over-length is HTTP 400
``context_length_exceeded``; ``max_tokens`` beyond the window is silently clamped; an unknown ``model``
is answered by the loaded model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import polars as pl
import pytest

from depthgate.exceptions import (
    BackendRequestError,
    ExitCode,
    InfraError,
    InputError,
    MalformedAnswerError,
    OverLengthError,
    SpecError,
    TransientBackendError,
)
from depthgate.run.backends import http_wire, make_backend
from depthgate.run.backends.base import Backend, Request, Response, Secret, api_key_from_env
from depthgate.run.backends.chat import CALIBRATION_PROBE, AnthropicBackend, OpenAIChatBackend
from depthgate.run.backends.http import (
    HTTPOptions,
    OpenAICompletionsBackend,
    is_loopback_host,
    key_in_clear,
)
from depthgate.run.backends.http_wire import is_overlength_error
from depthgate.run.options import RunOptions
from depthgate.run.records import read_records
from depthgate.run.retry import RetryPolicy
from depthgate.run.runner import run_pairs
from depthgate.run.store import write_layout_store
from depthgate.spec.loading import parse_spec
from depthgate.spec.system import DecodeParams, System
from helpers import LlamaServerProcess, free_port, small_smoke_matrix

# --------------------------------------------------------------------------------------------------
# a tiny stub HTTP server (recorded shapes)

Reply = tuple[int, Any, dict[str, str]]


@dataclass
class Seen:
    method: str
    path: str
    body: Any
    headers: dict[str, str]
    raw: bytes = b""


@dataclass
class Stub:
    """Routes ``(method, path)`` to a handler ``(body, headers) -> (status, json, headers)``."""

    routes: dict[tuple[str, str], Callable[[Any, dict[str, str]], Reply]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    delay_s: float = 0.0
    url: str = ""
    inflight: int = 0
    max_inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]


def _handler(stub: Stub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            headers = {k.lower(): v for k, v in self.headers.items()}
            stub.seen.append(Seen(method, self.path, body, headers, raw))
            with stub.lock:
                stub.inflight += 1
                stub.max_inflight = max(stub.max_inflight, stub.inflight)
            try:
                if stub.delay_s:
                    time.sleep(stub.delay_s)
                route = stub.routes.get((method, self.path))
                status, payload, extra = route(body, headers) if route else (404, {"error": "no route"}, {})
            finally:
                with stub.lock:
                    stub.inflight -= 1
            data = json.dumps(payload).encode() if payload is not None else b""
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in extra.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out and went away

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def _req(ids: list[int] | None = None, text: str | None = None, **kw: Any) -> Request:
    base: dict[str, Any] = {
        "layout_id": "L1",
        "arm": "baseline",
        "seed": 7,
        "token_ids": ids,
        "text": text,
        "max_tokens": 4,
        "temperature": 0.0,
        "stop": ("\n",),
    }
    base.update(kw)
    return Request(**base)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _once(backend: Any, request: Request) -> Any:
    try:
        return await backend.generate(request)
    finally:
        await backend.aclose()


def _run_one(backend: Any, out: Path, retry: RetryPolicy) -> dict[str, Any]:
    """One job ([1, 2, 3], seed 0) through the runner with ``retry``; its record."""
    layout = {
        "layout_id": "l1", "case_id": "c1", "target_tokens": 3, "position": "0.5",
        "token_ids": [1, 2, 3], "text": "x", "status": "ok",
    }  # fmt: skip
    options = RunOptions(
        run_id="retry", manifest_digest="r" * 64, decode=DecodeParams(max_tokens=4, seeds=[0]),
        concurrency=1, progress=False, retry=retry,
    )  # fmt: skip
    run_pairs([("baseline", layout)], {"baseline": backend}, out, options)
    return read_records(out).row(0, named=True)


# --- recorded vLLM shapes (research/api_facts.md §2) ---------------------------------------------

VLLM_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "tiny",
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "root": "/models/tiny",
            "parent": None,
            "max_model_len": 256,
            "permission": [{}],
        }
    ],
}


def _vllm_completion(body: Any, headers: dict[str, str], *, echo: list[int] | None = None) -> Reply:
    ids = body["prompt"]
    return (
        200,
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "text": " 4821",
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": "\n",
                    "prompt_token_ids": echo if echo is not None else ids,
                    "token_ids": [359, 346, 465],
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "total_tokens": len(ids) + 3,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 128, "created_cache_tokens": 0},
            },
            "system_fingerprint": "vllm-0.32.0-b9a60ec6",
        },
        {},
    )


def test_recorded_shapes_vllm_completions_token_ids(stub: Stub) -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url + "/v1", vllm=True)
    ids = list(range(5, 45))
    resp = run(_once(backend, _req(ids)))
    sent = stub.seen[-1].body
    assert sent["prompt"] == ids and sent["return_token_ids"] is True
    assert "truncate_prompt_tokens" not in sent
    assert sent["seed"] == 7 and sent["max_tokens"] == 4 and sent["stop"] == ["\n"]
    assert resp.prompt_tokens_server == 40 and resp.server_prompt_ids_match is True
    assert resp.completion_tokens == 3 and resp.finish_reason == "stop" and resp.text == " 4821"
    assert resp.prefix_cache_hit_tokens == 128
    assert resp.system_fingerprint == "vllm-0.32.0-b9a60ec6"
    assert backend.window == backend.served_window == 256
    assert stub.paths() == ["/v1/models", "/v1/completions"]


def test_a_numpy_id_array_is_sent_as_the_same_json_bytes_as_its_list(stub: Stub) -> None:
    """Issue #12: the HTTP backends send a numpy id array (the layout store's uint32 buffer) straight
    through orjson, without a Python int list; the body must be byte for byte the list's, and the
    echoed ids are still compared with the ids sent (a match, and a mismatch)."""
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    ids = [5, 255, 256, 65_535, 65_536, 151_643, 0, *range(100, 140)]
    stored = np.frombuffer(np.asarray(ids, dtype="<u4").tobytes(), dtype="<u4")  # as LayoutStore.ids
    variants = {
        "list": ids,
        "uint32": stored,
        "int64": stored.astype(np.int64),
        "strided": np.repeat(stored, 2)[::2],  # not C-contiguous: orjson hands it to the fallback
        "big-endian": stored.astype(">u4"),
    }
    sent: dict[str, bytes] = {}
    for name, value in variants.items():
        backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True)
        resp = run(_once(backend, _req(value)))
        assert resp.server_prompt_ids_match is True, name
        assert resp.prompt_tokens_server == len(ids)
        sent[name] = stub.seen[-1].raw
    assert json.loads(sent["list"])["prompt"] == ids
    assert {name: raw == sent["list"] for name, raw in sent.items()} == dict.fromkeys(variants, True)

    last_differs = lambda b, h: _vllm_completion(b, h, echo=[*b["prompt"][:-1], 7])  # noqa: E731
    stub.routes[("POST", "/v1/completions")] = last_differs
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True)
    assert run(_once(backend, _req(stored))).server_prompt_ids_match is False
    stub.routes[("POST", "/v1/completions")] = lambda b, h: _vllm_completion(b, h, echo=b["prompt"][1:])
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True)
    assert run(_once(backend, _req(stored))).server_prompt_ids_match is False


def test_the_runner_hands_an_http_arm_the_stores_id_array_and_other_arms_a_list(
    stub: Stub, tmp_path: Path
) -> None:
    """Issue #12: for a streamed run (ids read from the layout store at send time) the runner no longer
    turns the ids into a Python int list for an HTTP arm (≈ 36 B per id per request in flight); a
    backend that does not say ``accepts_id_array`` still gets a list. The server sees the stored ids."""
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    stored = {"l-a": list(range(3, 43)), "l-b": [151_643, *range(200, 230)]}
    pl.DataFrame(
        {"layout_id": list(stored), "token_ids": list(stored.values()), "text": ["a", "b"]},
        schema={"layout_id": pl.String, "token_ids": pl.List(pl.UInt32), "text": pl.String},
    ).write_parquet(tmp_path / "layouts.parquet")
    store = write_layout_store(tmp_path / "layouts.parquet", tmp_path / "store")
    seen: dict[str, list[type]] = {"http": [], "plain": []}

    class Spy(OpenAICompletionsBackend):
        async def _generate(self, request: Request) -> Any:
            seen["http"].append(type(request.token_ids))
            return await super()._generate(request)

    class Plain:
        name, accepts_token_ids, count_tolerance, window = "plain", True, 0.0, 4096

        async def generate(self, request: Request) -> Any:
            seen["plain"].append(type(request.token_ids))
            n = len(request.token_ids or [])
            return Response(text=" 1", finish_reason="stop", prompt_tokens_server=n, completion_tokens=1)

        async def aclose(self) -> None:
            pass

    rows = [
        {"layout_id": lid, "case_id": lid, "target_tokens": len(v), "position": "0.5", "status": "ok",
         "total_tokens": len(v)}
        for lid, v in stored.items()
    ]  # fmt: skip
    options = RunOptions(
        run_id="arr", manifest_digest="a" * 64, decode=DecodeParams(max_tokens=4, seeds=[0]),
        concurrency=1, progress=False, retry=RetryPolicy(max_attempts=1),
    )  # fmt: skip
    http = Spy("tiny", base_url=stub.url, vllm=True)
    try:
        run_pairs(
            [(arm, row) for arm in ("http", "plain") for row in rows],
            {"http": http, "plain": Plain()},
            tmp_path / "out",
            options,
            sources={"http": store, "plain": store},
        )
    finally:
        run(http.aclose())
    records = read_records(tmp_path / "out")
    assert records["status"].to_list() == ["ok"] * 4
    assert seen == {"http": [np.ndarray, np.ndarray], "plain": [list, list]}
    sent = sorted(s.body["prompt"] for s in stub.seen if s.path == "/v1/completions")
    assert sent == sorted(stored.values())


def test_recorded_shapes_models_read_once_for_concurrent_requests(stub: Stub) -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True)

    async def many() -> list[Any]:
        try:
            return await asyncio.gather(*(backend.generate(_req([1, 2, seed])) for seed in range(8)))
        finally:
            await backend.aclose()

    assert len(run(many())) == 8
    assert stub.paths().count("/v1/models") == 1 and stub.paths().count("/v1/completions") == 8


def test_recorded_shapes_vllm_echo_mismatch_is_reported(stub: Stub) -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = lambda b, h: _vllm_completion(b, h, echo=b["prompt"][10:])
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True)
    resp = run(_once(backend, _req(list(range(5, 45)))))
    assert resp.server_prompt_ids_match is False
    assert resp.extra["echoed_prompt_tokens"] == 30


def test_recorded_shapes_vllm_served_window_checked_before_sending(stub: Stub) -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True, window=4096)
    with pytest.raises(OverLengthError, match="served window of 256"):
        run(_once(backend, _req(list(range(250)), max_tokens=12)))
    assert stub.paths() == ["/v1/models"]  # a catalog window of 4096 does not beat the served 256


def test_recorded_shapes_unserved_model_is_refused(stub: Stub) -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    backend = OpenAICompletionsBackend("llama-3-8b", base_url=stub.url, vllm=True)
    with pytest.raises(BackendRequestError, match=r"does not serve model 'llama-3-8b'.*\['tiny'\]"):
        run(_once(backend, _req([1, 2, 3])))


OVERLENGTH_BODIES = [
    # vLLM 0.8.5, flat
    {
        "object": "error",
        "message": "This model's maximum context length is 256 tokens. However, you requested 310 tokens "
        "(300 in the messages, 10 in the completion). Please reduce the length of the messages or "
        "completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    },
    # vLLM 0.11, nested
    {
        "error": {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 20. This model's maximum "
            "context length is 256 tokens and your request has 250 input tokens (20 > 256 - 250).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    },
    # vLLM 0.32 [verified]
    {
        "error": {
            "message": "This model's maximum context length is 256 tokens. However, your prompt contains 300 "
            "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
            "of the input prompt. (parameter=input_tokens, value=300)",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    },
    # vLLM 0.32, prompt == window [verified]
    {
        "error": {
            "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    },
    # llama-server
    {
        "error": {
            "code": 400,
            "message": "request (300 tokens) exceeds the available context size (256 tokens), "
            "try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 300,
            "n_ctx": 256,
        }
    },
    # OpenAI
    {
        "error": {
            "message": "This model's maximum context length is 128000 tokens. However, your messages "
            "resulted in 245630 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    },
    # Anthropic
    {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 210000 tokens > 200000 maximum",
        },
        "request_id": "req_1",
    },
]

NOT_OVERLENGTH_BODIES = [
    {
        "error": {
            "message": "max_tokens=1000 cannot be greater than max_model_len=256. Please request fewer "
            "output tokens. (parameter=max_tokens, value=1000)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    },
    {
        "error": {
            "message": "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    },
]


@pytest.mark.parametrize("body", OVERLENGTH_BODIES)
def test_recorded_shapes_overlength_bodies_are_recognised(body: dict[str, Any]) -> None:
    assert is_overlength_error(400, body)
    assert not is_overlength_error(500, body)


@pytest.mark.parametrize("body", NOT_OVERLENGTH_BODIES)
def test_recorded_shapes_other_400s_are_not_overlength(body: dict[str, Any]) -> None:
    assert not is_overlength_error(400, body)


def test_recorded_shapes_overlength_400_raises_overlength_and_other_400_request_error(stub: Stub) -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = lambda b, h: (400, OVERLENGTH_BODIES[2], {})
    with pytest.raises(OverLengthError, match="parameter=input_tokens"):
        run(_once(OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True), _req([1] * 100)))
    stub.routes[("POST", "/v1/completions")] = lambda b, h: (400, NOT_OVERLENGTH_BODIES[0], {})
    with pytest.raises(BackendRequestError, match="HTTP 400") as info:
        run(_once(OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True), _req([1] * 100)))
    assert info.value.status == 400
    assert len([p for p in stub.paths() if p == "/v1/completions"]) == 2  # neither was retried


def test_recorded_shapes_503_is_retried_by_the_runner_and_retry_after_honoured(
    stub: Stub, tmp_path: Path
) -> None:
    calls = {"n": 0}

    def flaky(body: Any, headers: dict[str, str]) -> Reply:
        calls["n"] += 1
        if calls["n"] == 1:
            return 503, {"error": {"message": "overloaded", "type": "ServiceUnavailable", "code": 503}}, {}
        if calls["n"] == 2:
            return 429, {"error": {"message": "rate limited"}}, {"Retry-After": "0.3"}
        return _vllm_completion(body, headers)

    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = flaky
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True)
    with pytest.raises(TransientBackendError) as info:  # the backend itself makes one attempt
        run(_once(backend, _req([1, 2, 3])))
    assert info.value.status == 503 and stub.paths().count("/v1/completions") == 1
    # The runner retries with the run's one policy; the server's Retry-After wins over the backoff.
    start = time.monotonic()
    rec = _run_one(backend, tmp_path, RetryPolicy(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02))
    elapsed = time.monotonic() - start
    assert rec["status"] == "ok" and rec["attempts"] == 2 and rec["prompt_tokens_server"] == 3
    # A lower bound only (load can slow a run, never speed it): the 0.3 s Retry-After was waited, not the
    # 10 ms backoff.
    assert elapsed >= 0.3


def test_recorded_shapes_persistent_500_is_infra_error_after_the_policy_attempts(
    stub: Stub, tmp_path: Path
) -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    engine_dead = {
        "error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}
    }
    stub.routes[("POST", "/v1/completions")] = lambda b, h: (500, engine_dead, {})
    backend = OpenAICompletionsBackend("tiny", base_url=stub.url, vllm=True)
    rec = _run_one(backend, tmp_path, RetryPolicy(max_attempts=3, backoff_base_s=0.01))
    assert rec["status"] == "infra_error" and rec["attempts"] == 3 and "HTTP 500" in rec["error"]
    assert stub.paths().count("/v1/completions") == 3  # one policy: 3 tries in all, not 3 × 3


def test_recorded_shapes_timeout_is_transient(stub: Stub) -> None:
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    stub.delay_s = 1.0
    backend = OpenAICompletionsBackend(
        "tiny", base_url=stub.url, check_served_model=False, options=HTTPOptions(timeout_s=0.2)
    )
    backend._probed = True  # skip /v1/models (it would time out too)
    with pytest.raises(TransientBackendError, match="timed out"):
        run(_once(backend, _req([1, 2, 3])))


def test_unreachable_endpoint_is_a_clear_infra_error_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    backend = OpenAICompletionsBackend("tiny", base_url=url)
    with pytest.raises(InfraError) as info:
        run(_once(backend, _req([1, 2, 3])))
    assert isinstance(info.value, TransientBackendError)
    assert f"cannot reach {url}/v1/models" in str(info.value)


# --- the two HTTP clients (issue #14): aiohttp ships, httpx stays an option; both classify alike ----


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_both_clients_send_and_classify_alike(stub: Stub, client: Literal["aiohttp", "httpx"]) -> None:
    """An answer (echoed ids compared, cache hits read), an over-length 400, a 503 with Retry-After, a
    read timeout and a refused connection: the same results, errors and messages from either client."""
    options = HTTPOptions(client=client, timeout_s=0.3)

    def backend(url: str = stub.url) -> OpenAICompletionsBackend:
        return OpenAICompletionsBackend("tiny", base_url=url, vllm=True, options=options)

    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, VLLM_MODELS, {})
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    ok = run(_once(backend(), _req([5, 6, 7], text="é")))
    assert ok.server_prompt_ids_match is True and ok.prompt_tokens_server == 3
    assert ok.prefix_cache_hit_tokens == 128 and ok.text == " 4821"
    assert stub.seen[-1].body["prompt"] == [5, 6, 7] and stub.seen[-1].body["return_token_ids"] is True
    assert stub.seen[-1].headers["content-type"] == "application/json"
    stub.routes[("POST", "/v1/completions")] = lambda b, h: (400, OVERLENGTH_BODIES[0], {})
    with pytest.raises(OverLengthError, match="refused the prompt as too long"):
        run(_once(backend(), _req([1] * 100)))
    stub.routes[("POST", "/v1/completions")] = lambda b, h: (503, {"error": "busy"}, {"Retry-After": "7"})
    with pytest.raises(TransientBackendError, match=r"answered HTTP 503 \(busy\)") as busy:
        run(_once(backend(), _req([1, 2])))
    assert busy.value.status == 503 and busy.value.retry_after == 7.0
    stub.routes[("POST", "/v1/completions")] = _vllm_completion
    stub.delay_s = 1.0
    with pytest.raises(
        TransientBackendError, match=r"timed out \(ReadTimeout, limit 0.3 s read, 10 s connect\)"
    ):
        run(_once(backend(), _req([1, 2])))
    stub.delay_s = 0.0
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TransientBackendError, match=f"cannot reach {url}/v1/models") as down:
        run(_once(backend(url), _req([1, 2])))
    assert down.value.__context__ is None and down.value.__cause__ is None  # no client request kept


def test_a_client_is_closed_when_the_event_loop_it_was_opened_in_ends(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    """``depthgate run`` sends in one ``asyncio.run`` and closes its backends in another: the client
    opened in the first is closed when that loop ends (else aiohttp logs an unclosed session, and its
    sockets stay open until garbage collection)."""
    _completions_routes(stub)
    caplog.set_level(logging.ERROR, logger="asyncio")
    backend = OpenAICompletionsBackend("m", base_url=stub.url)
    assert run(backend.generate(_req([1, 2]))).prompt_tokens_server == 2
    first = backend._http
    assert isinstance(first, http_wire.AiohttpSession) and first._session.closed
    assert run(backend.generate(_req([1, 2, 3]))).prompt_tokens_server == 3  # a new loop, a new client
    assert backend._http is not first
    run(backend.aclose())
    assert backend._http is None
    del first
    gc.collect()
    assert "Unclosed" not in caplog.text


def test_json_codec_takes_what_orjson_refuses_through_the_stdlib() -> None:
    """orjson encodes and decodes the requests; a text with a lone surrogate (orjson refuses to encode
    it) and answers with NaN or integers beyond 64 bits (orjson refuses to decode them) go through the
    stdlib ``json`` instead of failing."""
    body = {"prompt": [1, 2, 255_999], "text": "é\n\u2028", "t": 0.0}
    assert json.loads(http_wire.dumps(body)) == body
    assert json.loads(http_wire.dumps({"text": "a\ud800b"})) == {"text": "a\ud800b"}
    assert http_wire.loads(b'{"n": 18446744073709551616}') == {"n": 2**64}
    nan = http_wire.loads(b'{"x": NaN}')["x"]
    assert nan != nan
    with pytest.raises(ValueError):
        http_wire.loads(b"<html>busy</html>")


def test_the_proxy_is_the_environments_unless_no_proxy_covers_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert http_wire.environment_proxy("https://api.openai.com") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "internal.example,127.0.0.1")
    assert http_wire.environment_proxy("https://api.openai.com/v1") == "http://proxy.example:3128"
    assert http_wire.environment_proxy("https://internal.example/v1") is None
    assert http_wire.environment_proxy("http://127.0.0.1:8000") is None
    assert http_wire.environment_proxy("http://10.0.0.5:8000") is None  # no HTTP_PROXY for http


# --- recorded OpenAI chat shapes (research/api_facts.md §4.1) ------------------------------------


def _openai_chat(body: Any, headers: dict[str, str]) -> Reply:
    return (
        200,
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "gpt-4o-mini-2024-07-18",
            "system_fingerprint": "fp_44709d6fcb",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "4821"},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": 1203,
                "completion_tokens": 2,
                "total_tokens": 1205,
                "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            },
        },
        {},
    )


def test_recorded_shapes_openai_chat(stub: Stub) -> None:
    stub.routes[("POST", "/v1/chat/completions")] = _openai_chat
    key = Secret("sk-test-openai", env_var="OPENAI_API_KEY")
    backend = OpenAIChatBackend("gpt-4o-mini", base_url=stub.url, api_key=key)
    resp = run(_once(backend, _req([1] * 1200, text="the prompt", seed=3)))
    seen = stub.seen[-1]
    assert seen.headers["authorization"] == "Bearer sk-test-openai"
    assert seen.body["messages"] == [{"role": "user", "content": "the prompt"}]
    assert seen.body["seed"] == 3 and seen.body["max_tokens"] == 4 and seen.body["stop"] == ["\n"]
    assert resp.text == "4821" and resp.finish_reason == "stop"
    assert resp.prompt_tokens_server == 1203 and resp.completion_tokens == 2
    assert resp.system_fingerprint == "fp_44709d6fcb" and resp.prefix_cache_hit_tokens == 1024
    assert not backend.accepts_token_ids and backend.count_tolerance == 0  # exact unless the arm says
    assert resp.prompt_tokens_expected is None  # no local tokenizer given: nothing calibrated


def test_recorded_shapes_openai_context_length_exceeded(stub: Stub) -> None:
    stub.routes[("POST", "/v1/chat/completions")] = lambda b, h: (400, OVERLENGTH_BODIES[5], {})
    backend = OpenAIChatBackend("gpt-4o-mini", base_url=stub.url)
    with pytest.raises(OverLengthError, match="maximum context length is 128000"):
        run(_once(backend, _req(text="long")))


# --- recorded Anthropic shapes (research/api_facts.md §4.2) --------------------------------------


def _anthropic_routes(stub: Stub, *, count: int = 1500) -> None:
    stub.routes[("POST", "/v1/messages/count_tokens")] = lambda b, h: (200, {"input_tokens": count}, {})
    stub.routes[("POST", "/v1/messages")] = lambda b, h: (
        200,
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": "4821\nThe code is from section 2."}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": 9,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 1491,
                "output_tokens": 11,
            },
        },
        {},
    )


def test_recorded_shapes_anthropic_messages(stub: Stub) -> None:
    _anthropic_routes(stub)
    key = Secret("sk-ant-test", env_var="ANTHROPIC_API_KEY")
    backend = AnthropicBackend("claude-sonnet-4-5", base_url=stub.url, api_key=key, window=200_000)
    resp = run(_once(backend, _req(text="the prompt", stop=("\n", "###"))))
    assert stub.paths() == ["/v1/messages/count_tokens", "/v1/messages"]
    count_call, call = stub.seen
    assert count_call.body == {
        "model": "claude-sonnet-4-5",
        "messages": [{"role": "user", "content": "the prompt"}],
    }
    assert call.headers["x-api-key"] == "sk-ant-test" and call.headers["anthropic-version"] == "2023-06-01"
    assert "seed" not in call.body  # the Messages API has no seed
    assert call.body["stop_sequences"] == ["###"]  # whitespace-only stops are applied locally
    assert resp.text == "4821" and resp.finish_reason == "stop"
    assert resp.prompt_tokens_server == 1500 and resp.prefix_cache_hit_tokens == 1491
    assert resp.extra["count_tokens"] == 1500 and resp.completion_tokens == 11


@pytest.mark.parametrize(
    ("change", "reason", "said"),
    [
        ({"content": None}, "malformed_answer", "no 'content' list"),
        (
            {"content": [], "usage": {"input_tokens": 9, "output_tokens": 0}},
            "empty_completion",
            "output_tokens 0",
        ),
        ({"usage": {"input_tokens": 9, "output_tokens": 0}}, "malformed_answer", "but usage.output_tokens 0"),
        (
            {"usage": {"input_tokens": -3, "output_tokens": 11}},
            "malformed_answer",
            "negative usage.input_tokens",
        ),
    ],
)
def test_anthropic_answers_that_are_not_the_models_are_named(
    stub: Stub, change: dict[str, Any], reason: str, said: str
) -> None:
    """The Messages API gets the OpenAI answers' checks (issue #37, item 2): a 200 without a content
    list, with no generated token, with text beside ``output_tokens: 0`` or with a negative count is a
    named :class:`MalformedAnswerError` (retried, then a serving failure), never the model's answer. A
    missing content list used to be a bare BackendError; the others were scored as the model's."""
    _anthropic_routes(stub)
    good = stub.routes[("POST", "/v1/messages")]({}, {})[1]
    stub.routes[("POST", "/v1/messages")] = lambda b, h: (200, {**good, **change}, {})
    backend = AnthropicBackend("claude-sonnet-4-5", base_url=stub.url, window=200_000)
    with pytest.raises(MalformedAnswerError, match=said) as caught:
        run(_once(backend, _req(text="the prompt")))
    assert caught.value.reason == reason and "the prompt" not in str(caught.value)


def test_recorded_shapes_anthropic_overlength(stub: Stub) -> None:
    _anthropic_routes(stub, count=199_999)
    backend = AnthropicBackend("claude-sonnet-4-5", base_url=stub.url, window=200_000)
    with pytest.raises(OverLengthError, match="199999 prompt tokens"):
        run(_once(backend, _req(text="x")))
    assert stub.paths() == ["/v1/messages/count_tokens"]  # refused before sending
    stub.routes[("POST", "/v1/messages")] = lambda b, h: (400, OVERLENGTH_BODIES[6], {})
    with pytest.raises(OverLengthError, match="prompt is too long"):
        run(_once(AnthropicBackend("claude-sonnet-4-5", base_url=stub.url), _req(text="x")))


# --- vLLM offline (recorded shapes of RequestOutput through a stand-in module) -------------------


class _FakeVLLMValidationError(Exception):
    pass


_FakeVLLMValidationError.__name__ = "VLLMValidationError"


def _fake_vllm(window: int, calls: list[Any], inits: list[Any] | None = None) -> types.ModuleType:
    module = types.ModuleType("vllm")

    class SamplingParams:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw

    def tokens_prompt(**kw: Any) -> dict[str, Any]:
        return dict(kw)

    class LLM:
        def __init__(self, model: str, **kw: Any) -> None:
            if inits is not None:
                inits.append((model, kw))
            self.llm_engine = types.SimpleNamespace(
                model_config=types.SimpleNamespace(max_model_len=kw.get("max_model_len", window))
            )

        def generate(self, prompts: list[dict[str, Any]], params: SamplingParams, use_tqdm: bool) -> Any:
            calls.append((prompts, params.kw))
            ids = prompts[0]["prompt_token_ids"]
            if len(ids) >= window:
                raise _FakeVLLMValidationError(
                    f"This model's maximum context length is {window} tokens. However, your prompt contains "
                    f"{len(ids)} input tokens, which exceeds this limit even without any output tokens."
                )
            completion = types.SimpleNamespace(
                text=" 4821", token_ids=[1, 2], finish_reason="stop", stop_reason="\n"
            )
            return [
                types.SimpleNamespace(prompt_token_ids=list(ids), num_cached_tokens=0, outputs=[completion])
            ]

    module.LLM = LLM  # type: ignore[attr-defined]
    module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    module.TokensPrompt = tokens_prompt  # type: ignore[attr-defined]
    return module


def test_recorded_shapes_vllm_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from depthgate.run.backends.vllm_offline import VLLMOfflineBackend

    calls: list[Any] = []
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(256, calls))
    backend = VLLMOfflineBackend("tiny", window=256)
    resp = run(_once(backend, _req(list(range(40)), seed=11)))
    prompts, params = calls[0]
    assert prompts == [{"prompt_token_ids": list(range(40))}]
    assert params == {"seed": 11, "max_tokens": 4, "temperature": 0.0, "stop": ["\n"]}
    assert resp.server_prompt_ids_match is True and resp.prompt_tokens_server == 40
    assert resp.completion_tokens == 2 and resp.finish_reason == "stop"
    # the engine's own over-length error (window unknown to the backend) becomes OverLengthError
    backend = VLLMOfflineBackend("tiny", window=None)
    backend._window = None
    with pytest.raises(OverLengthError, match="maximum context length is 256"):
        run(_once(backend, _req(list(range(300)))))


def test_vllm_offline_without_vllm_is_a_clear_infra_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from depthgate.run.backends.vllm_offline import VLLMOfflineBackend

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(InfraError, match="vLLM is not installed") as info:
        VLLMOfflineBackend("tiny")
    assert "depthgate[vllm]" in str(info.value)


# --- factory and API keys ------------------------------------------------------------------------


def _system(**kw: Any) -> System:
    base: dict[str, Any] = {"name": "cand", "model": "m", "tokenizer": "gguf:"}
    base.update(kw)
    return System(**base)


def test_make_backend_maps_systems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    vllm_server = make_backend(_system(backend="vllm-server", endpoint="http://127.0.0.1:8000"))
    assert isinstance(vllm_server, OpenAICompletionsBackend) and vllm_server.vllm
    assert vllm_server.accepts_token_ids and vllm_server.name == "cand"
    assert isinstance(vllm_server, Backend)
    served = make_backend(_system(backend="llamacpp", endpoint="http://127.0.0.1:8080"), prompt_format="text")
    assert isinstance(served, OpenAICompletionsBackend) and not served.accepts_token_ids
    # self-hosted OpenAI-compatible chat needs no key; api.openai.com does
    assert isinstance(
        make_backend(_system(backend="openai", endpoint="http://127.0.0.1:1")), OpenAIChatBackend
    )
    with pytest.raises(InfraError, match="environment variable OPENAI_API_KEY is not set"):
        make_backend(_system(backend="openai"))
    with pytest.raises(InfraError, match="environment variable ANTHROPIC_API_KEY is not set"):
        make_backend(_system(backend="anthropic"))
    with pytest.raises(InfraError, match="environment variable MY_GATEWAY_KEY is not set"):
        make_backend(_system(backend="anthropic"), api_key_env="MY_GATEWAY_KEY")


SECRET = "sk-live-DO-NOT-LEAK-0123456789abcdef"


def test_api_key_never_leaks(
    stub: Stub, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The key is sent, but appears in no exception message, repr, traceback or log line — even when the
    server echoes it back in an error body."""
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)

    def echo_401(body: Any, headers: dict[str, str]) -> Reply:
        return 401, {"error": {"message": f"Incorrect API key provided: {headers.get('authorization')}"}}, {}

    def echo_500(body: Any, headers: dict[str, str]) -> Reply:
        return 500, {"error": {"message": f"upstream saw {headers.get('x-api-key')}"}}, {}

    stub.routes[("POST", "/v1/chat/completions")] = echo_401
    stub.routes[("POST", "/v1/messages/count_tokens")] = echo_500
    caplog.set_level(logging.DEBUG)
    chat = make_backend(_system(backend="openai", endpoint=stub.url))
    anthropic = make_backend(_system(backend="anthropic", endpoint=stub.url))
    assert isinstance(anthropic, AnthropicBackend)
    errors: list[BaseException] = []
    for backend in (chat, anthropic):
        try:
            run(_once(backend, _req(text="hello")))
        except Exception as exc:  # collected for inspection
            errors.append(exc)
    assert [type(e) for e in errors] == [BackendRequestError, TransientBackendError]
    assert stub.seen[0].headers["authorization"] == f"Bearer {SECRET}"  # it was sent
    assert "$OPENAI_API_KEY" in str(errors[0])  # the fix names the variable
    texts = [repr(chat), repr(anthropic), str(chat), caplog.text]
    for error in errors:
        texts += [str(error), repr(error), repr(error.args), "".join(traceback.format_exception(error))]
        texts += [str(getattr(error, "summary", "")), str(getattr(error, "fix", ""))]
        assert error.__cause__ is None and error.__context__ is None  # no httpx request (headers) attached
    for text in texts:
        assert SECRET not in text
    assert "***" in str(errors[0])
    secret = api_key_from_env("OPENAI_API_KEY")
    assert secret is not None and SECRET not in repr(secret) and SECRET not in str(secret)
    with pytest.raises(TypeError):
        pickle.dumps(secret)
    # a missing key names the variable, never a value
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(InfraError) as info:
        api_key_from_env("OPENAI_API_KEY")
    assert "OPENAI_API_KEY" in str(info.value)


# --------------------------------------------------------------------------------------------------
# issue #10 item 7: the text-only backends check the prompt count exactly, and record every difference


def _layout(case: str, n: int, text: str) -> dict[str, Any]:
    return {
        "layout_id": f"l-{case}", "case_id": case, "target_tokens": n, "position": "0.5",
        "token_ids": [1] * n, "text": text, "status": "ok",
    }  # fmt: skip


def _records(
    backend: Any, layouts: list[dict[str, Any]], out: Path, *, concurrency: int = 1
) -> dict[str, Any]:
    """Run the layouts (one seed) on ``backend`` through the runner; records by case id."""
    options = RunOptions(
        run_id="counts", manifest_digest="c" * 64, decode=DecodeParams(max_tokens=4, seeds=[0]),
        concurrency=concurrency, progress=False, retry=RetryPolicy(max_attempts=1),
    )  # fmt: skip
    try:
        run_pairs([("baseline", row) for row in layouts], {"baseline": backend}, out, options)
    finally:
        run(backend.aclose())
    return {r["case_id"]: r for r in read_records(out).iter_rows(named=True)}


ANTHROPIC_COUNT = 131_072


def _anthropic_usage_routes(stub: Stub, reached: dict[str, int]) -> None:
    """count_tokens always says 131,072; usage reports ``reached[text]`` tokens (part of them cached)."""
    stub.routes[("POST", "/v1/messages/count_tokens")] = lambda b, h: (
        200, {"input_tokens": ANTHROPIC_COUNT}, {}
    )  # fmt: skip

    def messages(body: Any, headers: dict[str, str]) -> Reply:
        n = reached[body["messages"][0]["content"]]
        usage = {"input_tokens": n - 1000, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1000}
        return 200, {
            "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": "4821"}], "stop_reason": "end_turn",
            "usage": {**usage, "output_tokens": 2},
        }, {}  # fmt: skip

    stub.routes[("POST", "/v1/messages")] = messages


def test_anthropic_usage_must_equal_its_own_count_tokens_exactly(stub: Stub, tmp_path: Path) -> None:
    """Claude's tokenizer is not the local one (local 128,000 tokens, Claude 131,072). A gateway cutting
    ~13K tokens (118,000 reached the model) used to pass the 10 % check against the local count; the
    exact check against count_tokens (same tokenizer, same message) refuses it, and a one-token loss."""
    reached = {"full": ANTHROPIC_COUNT, "cut": 118_000, "one-short": ANTHROPIC_COUNT - 1}
    _anthropic_usage_routes(stub, reached)
    backend = AnthropicBackend("claude-sonnet-4-5", base_url=stub.url, window=200_000)
    assert backend.count_tolerance == 0
    records = _records(backend, [_layout(text, 128_000, text) for text in reached], tmp_path / "exact")
    full, cut, short = records["full"], records["cut"], records["one-short"]
    assert full["status"] == "ok" and full["prompt_tokens_delta"] == 0
    assert full["prompt_tokens_expected"] == ANTHROPIC_COUNT and full["prompt_tokens_local"] == 128_000
    assert cut["status"] == "system_fail" and cut["system_fail_reason"] == "server_count_mismatch"
    assert cut["prompt_tokens_delta"] == 118_000 - ANTHROPIC_COUNT
    assert short["system_fail_reason"] == "server_count_mismatch" and short["prompt_tokens_delta"] == -1


def test_anthropic_count_tolerance_from_the_runtime_block_and_recorded_delta(
    stub: Stub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runtime.count_tolerance = 1e-4 (13 tokens at 131K) lets the one-token difference pass; the
    difference is still recorded per record (prompt_tokens_delta), so a slice can be audited."""
    reached = {"full": ANTHROPIC_COUNT, "cut": 118_000, "one-short": ANTHROPIC_COUNT - 1}
    _anthropic_usage_routes(stub, reached)
    monkeypatch.setenv("ANT_GATEWAY_KEY", "k-ant")
    system = _system(
        backend="anthropic", model="claude-sonnet-4-5", endpoint=stub.url, window=200_000,
        runtime={"count_tolerance": 0.0001, "api_key_env": "ANT_GATEWAY_KEY"},
    )  # fmt: skip
    backend = make_backend(system)
    assert backend.count_tolerance == 0.0001
    records = _records(backend, [_layout(text, 128_000, text) for text in reached], tmp_path / "tol")
    assert records["one-short"]["status"] == "ok" and records["one-short"]["prompt_tokens_delta"] == -1
    assert records["cut"]["system_fail_reason"] == "server_count_mismatch"
    assert stub.seen[-1].headers["x-api-key"] == "k-ant"


CHAT_FRAMING = 7


def _words(text: str) -> int:
    return len(text.split())


def _chat_counting(cut: int = 13_000) -> Callable[[Any, dict[str, str]], Reply]:
    """A chat server counting words plus a constant framing; prompts starting with "cut" lose ``cut``."""

    def chat(body: Any, headers: dict[str, str]) -> Reply:
        content = body["messages"][0]["content"]
        n = _words(content) + CHAT_FRAMING - (cut if content.startswith("cut") else 0)
        status, payload, extra = _openai_chat(body, headers)
        payload["usage"] = {**payload["usage"], "prompt_tokens": n}
        return status, payload, extra

    return chat


def test_openai_chat_calibrates_the_framing_once_and_allows_nothing_else(stub: Stub, tmp_path: Path) -> None:
    """The chat framing (7 tokens here) is measured once with a probe; a 13K-token cut at 128K, within
    the old 10 %, is now server_count_mismatch, and an intact prompt has delta 0."""
    stub.routes[("POST", "/v1/chat/completions")] = _chat_counting()
    backend = OpenAIChatBackend("gpt-4o-mini", base_url=stub.url, local_count=_words)
    n = 131_072
    layouts = [_layout("full", n, "w " * n), _layout("cut", n, "cut " + "w " * (n - 1))]
    layouts += [_layout(f"more{i}", 1000 + i, "w " * (1000 + i)) for i in range(4)]
    records = _records(backend, layouts, tmp_path, concurrency=4)
    probes = [s for s in stub.seen if s.body["messages"][0]["content"] == CALIBRATION_PROBE]
    assert len(probes) == 1 and probes[0].body["max_tokens"] == 1  # once, however many in flight
    assert backend.overhead == CHAT_FRAMING
    full, cut = records["full"], records["cut"]
    assert full["status"] == "ok" and full["prompt_tokens_delta"] == 0
    assert full["prompt_tokens_expected"] == n + CHAT_FRAMING == full["prompt_tokens_server"]
    assert cut["status"] == "system_fail" and cut["system_fail_reason"] == "server_count_mismatch"
    assert cut["prompt_tokens_delta"] == -13_000
    assert all(records[f"more{i}"]["status"] == "ok" for i in range(4))


def test_openai_chat_through_make_backend_counts_with_the_systems_tokenizer(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    from fixtures_paths import tokenizers_dir

    path = tokenizers_dir() / "gpt2" / "tokenizer.json"
    gpt2 = Tokenizer.from_file(str(path))

    def chat(body: Any, headers: dict[str, str]) -> Reply:
        content = body["messages"][0]["content"]
        status, payload, extra = _openai_chat(body, headers)
        payload["usage"] = {**payload["usage"], "prompt_tokens": len(gpt2.encode(content).ids) + 11}
        return status, payload, extra

    stub.routes[("POST", "/v1/chat/completions")] = chat
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    backend = make_backend(_system(backend="openai", endpoint=stub.url, tokenizer=str(path)))
    text = "The access code for vault 7 is 4821."
    ids = gpt2.encode(text, add_special_tokens=True).ids
    resp = run(_once(backend, _req(ids, text=text)))
    assert resp.prompt_tokens_expected == len(ids) + 11 == resp.prompt_tokens_server
    assert resp.extra["prompt_overhead"] == 11


# --------------------------------------------------------------------------------------------------
# issue #10 item 8: every runtime field changes what the backend does


def _completions_routes(stub: Stub, model: str = "m") -> None:
    stub.routes[("GET", "/v1/models")] = lambda b, h: (200, {"data": [{"id": model}]}, {})

    def completion(body: Any, headers: dict[str, str]) -> Reply:
        prompt = body["prompt"]
        n = len(prompt) if isinstance(prompt, list) else _words(prompt)
        return 200, {
            "model": model, "choices": [{"text": " 4821", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": n, "completion_tokens": 2},
        }, {}  # fmt: skip

    stub.routes[("POST", "/v1/completions")] = completion


def test_runtime_prompt_format_text_sends_text_to_a_server_that_takes_only_text(stub: Stub) -> None:
    _completions_routes(stub)
    default = make_backend(_system(backend="llamacpp", endpoint=stub.url))
    text = make_backend(_system(backend="llamacpp", endpoint=stub.url, runtime={"prompt_format": "text"}))
    assert default.accepts_token_ids and not text.accepts_token_ids
    run(_once(default, _req([5, 6, 7], text="five six seven")))
    assert stub.seen[-1].body["prompt"] == [5, 6, 7]
    resp = run(_once(text, _req([5, 6, 7], text="five six seven")))
    assert stub.seen[-1].body["prompt"] == "five six seven" and resp.prompt_tokens_server == 3


def test_runtime_api_completions_on_openai_sends_token_ids(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    _completions_routes(stub)
    chat = make_backend(_system(backend="openai", endpoint=stub.url))
    completions = make_backend(_system(backend="openai", endpoint=stub.url, runtime={"api": "completions"}))
    assert isinstance(chat, OpenAIChatBackend) and isinstance(completions, OpenAICompletionsBackend)
    run(_once(completions, _req([5, 6, 7], text="x")))
    assert stub.paths()[-1] == "/v1/completions" and stub.seen[-1].body["prompt"] == [5, 6, 7]


def test_runtime_api_key_env_names_the_variable_that_is_sent(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    _completions_routes(stub)
    monkeypatch.setenv("MY_VLLM_KEY", "k-vllm-123")
    plain = make_backend(_system(backend="vllm-server", model="m", endpoint=stub.url))
    run(_once(plain, _req([1, 2])))
    assert "authorization" not in stub.seen[-1].headers
    keyed = make_backend(
        _system(backend="vllm-server", model="m", endpoint=stub.url, runtime={"api_key_env": "MY_VLLM_KEY"})
    )
    run(_once(keyed, _req([1, 2])))
    assert stub.seen[-1].headers["authorization"] == "Bearer k-vllm-123"
    monkeypatch.delenv("MY_VLLM_KEY")
    with pytest.raises(InfraError, match="MY_VLLM_KEY is not set"):
        make_backend(
            _system(
                backend="vllm-server", model="m", endpoint=stub.url, runtime={"api_key_env": "MY_VLLM_KEY"}
            )
        )


def test_runtime_timeout_s_bounds_a_request(stub: Stub) -> None:
    _completions_routes(stub)
    stub.delay_s = 0.6
    patient = make_backend(_system(backend="vllm-server", model="m", endpoint=stub.url))
    assert run(_once(patient, _req([1, 2]))).text == " 4821"  # the default (300 s) waits
    hasty = make_backend(
        _system(backend="vllm-server", model="m", endpoint=stub.url, runtime={"timeout_s": 0.2})
    )
    with pytest.raises(TransientBackendError, match=r"timed out \(ReadTimeout, limit 0.2 s read"):
        run(_once(hasty, _req([1, 2])))


def test_runtime_connect_timeout_s_bounds_the_connection() -> None:
    """A listener whose accept queue is full never completes a handshake: only the connect timeout ends
    the attempt (the default would wait 10 s)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.1)
        system = _system(
            backend="vllm-server", model="m", endpoint=f"http://127.0.0.1:{port}",
            runtime={"connect_timeout_s": 0.3},
        )  # fmt: skip
        backend = make_backend(system)
        # The message names the timeout that fired and its 0.3 s limit: no clock is read (load would
        # make a wall-time bound flaky).
        with pytest.raises(TransientBackendError, match=r"ConnectTimeout, limit 300 s read, 0.3 s connect"):
            run(_once(backend, _req([1, 2])))
    finally:
        for sock in [*fillers, listener]:
            sock.close()


def _peak_in_flight(stub: Stub, backend: Any, n: int = 6) -> int:
    async def many() -> None:
        try:
            await asyncio.gather(*(backend.generate(_req([1, 2, seed])) for seed in range(n)))
        finally:
            await backend.aclose()

    stub.max_inflight = 0
    run(many())
    return stub.max_inflight


@pytest.mark.parametrize("field", ["max_connections", "concurrency"])
def test_runtime_max_connections_and_concurrency_cap_requests_in_flight(stub: Stub, field: str) -> None:
    _completions_routes(stub)
    stub.delay_s = 0.15
    free = make_backend(_system(backend="vllm-server", model="m", endpoint=stub.url))
    assert _peak_in_flight(stub, free) > 1
    capped = make_backend(_system(backend="vllm-server", model="m", endpoint=stub.url, runtime={field: 1}))
    assert _peak_in_flight(stub, capped) == 1


def test_runtime_concurrency_caps_an_arm_below_the_runs_concurrency(stub: Stub, tmp_path: Path) -> None:
    _completions_routes(stub)
    stub.delay_s = 0.1
    backend = make_backend(
        _system(backend="vllm-server", model="m", endpoint=stub.url, runtime={"concurrency": 2})
    )
    layouts = [{**_layout(f"c{i}", 3, "a b c"), "token_ids": [1, 2, 3]} for i in range(8)]
    records = _records(backend, layouts, tmp_path, concurrency=8)
    assert {r["status"] for r in records.values()} == {"ok"} and stub.max_inflight == 2


def test_runtime_vllm_engine_arguments_reach_the_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from depthgate.run.backends.vllm_offline import VLLMOfflineBackend
    from depthgate.spec.system import VLLMEngineArgs

    inits: list[Any] = []
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(4096, [], inits))
    (tmp_path / "tok").mkdir()
    every = {
        "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "max_model_len": 4096,
        "gpu_memory_utilization": 0.8, "dtype": "bfloat16", "quantization": "awq", "kv_cache_dtype": "fp8",
        "enforce_eager": True, "enable_prefix_caching": False, "max_num_seqs": 16,
        "max_num_batched_tokens": 8192, "swap_space": 2.0, "seed": 3, "tokenizer": "tok",
        "revision": "main", "download_dir": "weights",
    }  # fmt: skip
    assert set(every) == set(VLLMEngineArgs.model_fields)  # the test covers every accepted key
    system = _system(backend="vllm", model="org/model", window=2048, runtime={"vllm": every})
    backend = make_backend(system, base_dir=tmp_path)
    assert isinstance(backend, VLLMOfflineBackend)
    model, kwargs = inits[-1]
    # relative paths are the matrix folder's; a hub name stays a hub name
    expected = {**every, "tokenizer": str(tmp_path / "tok"), "download_dir": str(tmp_path / "weights")}
    assert model == "org/model" and kwargs == expected
    assert backend.window == 4096  # the engine's max_model_len, not the catalog window
    # without the block: only the window reaches the engine
    make_backend(_system(backend="vllm", model="org/model", window=2048), base_dir=tmp_path)
    assert inits[-1] == ("org/model", {"max_model_len": 2048})


# --------------------------------------------------------------------------------------------------
# issue #10 item 9: keys go only over https or to loopback, unless the arm allows it


def test_key_in_clear_is_plain_http_to_a_host_that_is_not_loopback() -> None:
    for url in ("http://127.0.0.1:8000", "http://127.8.9.10", "http://localhost:8000", "http://[::1]:80",
                "https://api.example.com", "https://10.0.0.5:8443", "HTTP://LOCALHOST."):  # fmt: skip
        assert not key_in_clear(url), url
    for url in ("http://10.0.0.5:8000", "http://192.0.2.10", "http://api.example.com", "http://[2001:db8::1]",
                "http://localhost.evil.example", "http://127.0.0.1.nip.io"):  # fmt: skip
        assert key_in_clear(url), url
    assert is_loopback_host("127.0.0.1") and not is_loopback_host(None)


REMOTE = "http://192.0.2.10:8000"  # TEST-NET-1: plain http, not loopback


def test_api_key_is_refused_over_plain_http_to_a_remote_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_KEY", SECRET)
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    # named in the matrix: refused when the matrix loads
    with pytest.raises(SpecError, match="would send the API key in clear text") as spec_error:
        data = {
            "name": "cand",
            "model": "m",
            "tokenizer": "gguf:",
            "backend": "vllm-server",
            "endpoint": REMOTE,
        }
        parse_spec(System, {**data, "runtime": {"api_key_env": "GATEWAY_KEY"}}, file="m.toml")
    assert spec_error.value.field == "endpoint" and "allow_insecure_key" in str(spec_error.value)
    # implicit (OPENAI_API_KEY set for a self-hosted endpoint): refused before any request
    with pytest.raises(InputError) as info:
        make_backend(_system(backend="openai", endpoint=REMOTE, tokenizer=str(_gpt2())))
    assert info.value.exit_code == ExitCode.BAD_INPUT
    assert "allow_insecure_key" in str(info.value) and "$OPENAI_API_KEY" in str(info.value)
    assert SECRET not in str(info.value)
    # a backend built directly refuses too
    with pytest.raises(InputError, match="plain http"):
        OpenAICompletionsBackend("m", base_url=REMOTE, api_key=Secret(SECRET, env_var="GATEWAY_KEY"))
    # over https, or to loopback, the key goes
    OpenAICompletionsBackend("m", base_url="https://192.0.2.10", api_key=Secret(SECRET, env_var="K"))
    OpenAICompletionsBackend("m", base_url="http://localhost:8000", api_key=Secret(SECRET, env_var="K"))


def _gpt2() -> Path:
    from fixtures_paths import tokenizers_dir

    return tokenizers_dir() / "gpt2" / "tokenizer.json"


def test_allow_insecure_key_sends_the_key_over_plain_http(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_KEY", SECRET)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(
            200,
            json={"choices": [{"text": " 1", "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 1}},
        )  # fmt: skip

    system = _system(
        backend="vllm-server",
        endpoint=REMOTE,
        runtime={"api_key_env": "GATEWAY_KEY", "allow_insecure_key": True},
    )
    backend = make_backend(system, http_options=HTTPOptions(transport=httpx.MockTransport(handler)))
    resp = run(_once(backend, _req([1, 2])))
    assert resp.prompt_tokens_server == 2
    assert str(seen[-1].url) == f"{REMOTE}/v1/completions"
    assert seen[-1].headers["authorization"] == f"Bearer {SECRET}"


# --------------------------------------------------------------------------------------------------
# the real llama-cpp-python server (smoke_model)


@dataclass
class LlamaServer:
    url: str
    tokenizer: Any


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf

    gguf = gemma_default_gguf()
    server = LlamaServerProcess.start(
        tmp_path_factory.mktemp("llama-server"), n_threads=max(2, min(8, os.cpu_count() or 2))
    )
    try:
        server.wait_up(time.monotonic() + 90, poll_s=0.25)
        yield LlamaServer(url=server.url, tokenizer=tokenizer_from_gguf(gguf))
    finally:
        server.stop()


PROMPT = (
    "Company Operations Handbook (excerpt)\n\nSection 1. Security.\nPrinted copies of this handbook may be "
    "out of date. The access code for vault 7 is 4821. All forms referenced in this section are available "
    "on the intranet.\n\nQuestion: What is the access code for vault 7?\n"
    "Answer: The access code for vault 7 is"
)


def _local_ids(server: LlamaServer, text: str) -> list[int]:
    return list(server.tokenizer.encode(text, add_special_tokens=True).ids)


@pytest.mark.smoke_model
def test_llamacpp_python_server_rejects_token_id_prompts(llama_server: LlamaServer) -> None:
    backend = OpenAICompletionsBackend("gemma3-270m", base_url=llama_server.url)
    with pytest.raises(BackendRequestError, match="does not accept token-id prompts") as info:
        run(_once(backend, _req(_local_ids(llama_server, PROMPT))))
    assert info.value.status == 500  # pydantic string_type errors, reported as HTTP 500 by this server


@pytest.mark.smoke_model
def test_llamacpp_python_server_text_prompt_counts_match_local(llama_server: LlamaServer) -> None:
    ids = _local_ids(llama_server, PROMPT)
    tokenized = httpx.post(f"{llama_server.url}/extras/tokenize", json={"input": PROMPT}, timeout=30).json()
    assert tokenized["tokens"] == ids  # the server adds BOS and tokenizes exactly like the local tokenizer
    backend = OpenAICompletionsBackend("gemma3-270m", base_url=llama_server.url, prompt_format="text")
    resp = run(_once(backend, _req(ids, text=PROMPT, max_tokens=6)))
    assert resp.prompt_tokens_server == len(ids)
    assert resp.finish_reason in ("stop", "length") and 1 <= (resp.completion_tokens or 0) <= 6
    assert resp.server_prompt_ids_match is None and backend.window is None  # no max_model_len served
    assert "4821" in resp.text


@pytest.mark.smoke_model
def test_llamacpp_python_server_overlength_and_unserved_model(llama_server: LlamaServer) -> None:
    text = "Printed copies of this handbook may be out of date." * 220
    ids = _local_ids(llama_server, text)
    assert len(ids) > 2048
    backend = OpenAICompletionsBackend("gemma3-270m", base_url=llama_server.url, prompt_format="text")
    with pytest.raises(OverLengthError, match="maximum context length is 2048"):
        run(_once(backend, _req(ids, text=text)))
    other = OpenAICompletionsBackend("qwen3-0.6b", base_url=llama_server.url, prompt_format="text")
    with pytest.raises(BackendRequestError, match=r"serves \['gemma3-270m'\]"):
        run(_once(other, _req(ids[:10], text="Hello")))


@pytest.mark.smoke_model
def test_llamacpp_python_server_silent_clamp_is_caught_by_the_runner(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    """A 2,040-token prompt with max_tokens 16 in a 2,048 window: the server clamps max_tokens to 8
    without an error; the runner records it as system_fail max_tokens_clamped."""
    from depthgate.run.options import RunOptions
    from depthgate.run.records import read_records
    from depthgate.run.runner import run_pairs

    sentence = " The access code for vault 7 is 4821."
    text = "Handbook."
    while len(_local_ids(llama_server, text + sentence)) <= 2040:
        text += sentence
    ids = _local_ids(llama_server, text)
    assert 2000 < len(ids) <= 2040
    layout = {
        "layout_id": "long", "case_id": "c1", "target_tokens": len(ids), "position": "0.5",
        "token_ids": ids, "text": text, "status": "ok",
    }  # fmt: skip
    backend = OpenAICompletionsBackend("gemma3-270m", base_url=llama_server.url, prompt_format="text")
    summary = run_pairs(
        [("baseline", layout)],
        {"baseline": backend},
        tmp_path,
        RunOptions(
            concurrency=1,
            seeds=[0],
            decode=DecodeParams(max_tokens=16, stop=[]),
            run_id="clamp",
            manifest_digest="d",
            progress=False,
        ),
    )
    rec = read_records(tmp_path).row(0, named=True)
    assert summary.system_fail == 1
    assert rec["status"] == "system_fail" and rec["system_fail_reason"] == "max_tokens_clamped"
    assert rec["finish_reason"] == "length" and rec["completion_tokens"] == 2048 - len(ids)
    assert rec["prompt_tokens_server"] == rec["prompt_tokens_local"] == len(ids)


@pytest.mark.smoke_model
def test_matrix_arm_on_llamacpp_python_server_runs_with_runtime_prompt_format_text(
    llama_server: LlamaServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #10 item 8: an arm pointing at a llama-cpp-python server got HTTP 500 on every request (it
    takes text only and no matrix could say so). With ``[<arm>.runtime] prompt_format = "text"`` the
    run goes through and the server's count equals the local one exactly; without it the run stops
    with a refusal that names the fix (exit 20), never a silent retry loop."""
    from depthgate.commands.cli import main

    endpoint = f'endpoint = "{llama_server.url}"\n'
    text = small_smoke_matrix().replace("window = 2048\n", f"window = 2048\n{endpoint}")
    runtime = '\n[{arm}.runtime]\nprompt_format = "text"\n'
    with_runtime = text.replace("\n[candidate]", runtime.format(arm="baseline") + "\n[candidate]").replace(
        "\n[plan]", runtime.format(arm="candidate") + "\n[plan]"
    )
    (tmp_path / "bare.toml").write_text(text, encoding="utf-8")
    (tmp_path / "text.toml").write_text(with_runtime, encoding="utf-8")

    assert main(["run", str(tmp_path / "bare.toml"), "--out", str(tmp_path / "bare")]) == ExitCode.BAD_INPUT
    assert "does not accept token-id prompts" in capsys.readouterr().err

    code = main(["run", str(tmp_path / "text.toml"), "--out", str(tmp_path / "run")])
    assert code not in (ExitCode.BAD_INPUT, ExitCode.INFRA, ExitCode.VERIFY_FAILED), capsys.readouterr().err
    import polars as pl

    records = pl.read_parquet(tmp_path / "run" / "records.parquet")
    assert records.height == 2 * 2 * 2 and set(records["status"]) == {"ok"}
    assert (records["prompt_tokens_server"] == records["prompt_tokens_local"]).all()
    assert (records["prompt_tokens_delta"] == 0).all()

"""Pieces several test files share: a JSON stub server on 127.0.0.1, a real llama-cpp-python server
process, the cut-down smoke matrix, the two-arm stub matrix and the Monte Carlo :class:`Rate` of the
calibration benches.

The stub servers here are labelled stand-ins (not models): each test file gives :class:`JSONHandler` its
own ``do_GET``/``do_POST`` (or takes a prompt-reading one from :func:`reading_handler`) and serves it
with :class:`StubServer` for the length of a ``with`` block.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import polars as pl
import pytest

from fixtures_paths import tokenizers_dir

REPO = Path(__file__).resolve().parent.parent
SHORT_PREAMBLE = 'preamble = "Read the excerpt below and answer the question."'

_Server = TypeVar("_Server", bound="StubServer")


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (the OS's pick, released before it is returned)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class JSONHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive, no access log; reads a request's JSON body and answers 200 with JSON."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

    # The tokenizer routes a real server may offer (vLLM, llama.cpp): a stub that does not implement them
    # answers 404 there, as an OpenAI-compatible server without them does (depthgate then records the
    # tokenizer parity check as "not checked"), instead of treating the call as a completion.
    tokenizer_routes: tuple[str, ...] = ("/tokenize", "/v1/tokenize", "/extras/tokenize")
    serves_tokenize = False

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.command == "POST" and self.path in self.tokenizer_routes and not self.serves_tokenize:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_json({"detail": "Not Found"}, status=404)
            return False
        return True

    def send_json(self, payload: Any, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ModelsHandler(JSONHandler):
    """A :class:`JSONHandler` that lists ``models`` (each with ``max_model_len``) on ``GET /v1/models``,
    as a vLLM server does; subclasses answer the POSTs."""

    models: tuple[str, ...] = ("good",)
    max_model_len = 4096

    def do_GET(self) -> None:
        data = [{"id": m, "object": "model", "max_model_len": self.max_model_len} for m in self.models]
        self.send_json({"object": "list", "data": data})


class StubServer:
    """``handler`` served on 127.0.0.1:``port`` (0: any free port, then in :attr:`port`) from a daemon
    thread while the ``with`` block runs; the server is bound at construction."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self: _Server) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def stop_process(proc: subprocess.Popen[Any], timeout: float) -> None:
    """Terminate ``proc`` if it still runs; kill it if it has not exited ``timeout`` seconds later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class LlamaServerProcess:
    """llama-cpp-python's own server (``python -m llama_cpp.server``) on 127.0.0.1 with the packaged
    Gemma-3-270M GGUF served as ``gemma3-270m`` (n_ctx 2048), its output in ``log``."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, log_dir: Path, n_threads: int) -> LlamaServerProcess:
        from depthgate.layout.gguf_tokenizer import gemma_default_gguf

        port = free_port()
        log = log_dir / f"server-{port}.log"
        cmd = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(gemma_default_gguf()), "--model_alias", "gemma3-270m",
            "--n_ctx", "2048", "--logits_all", "False", "--flash_attn", "True",
            "--n_threads", str(n_threads), "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        return cls(url=f"http://127.0.0.1:{port}", proc=proc, log=log)

    def wait_up(self, deadline: float, poll_s: float = 0.2) -> None:
        """Return once ``/v1/models`` answers; fail the test (with the log's tail) if the server exits or
        ``deadline`` (``time.monotonic()``) passes first."""
        wait_until_serving(self.url, self.proc, self.log, deadline, "llama-cpp-python server", poll_s)

    def stop(self, timeout: float = 20) -> None:
        stop_process(self.proc, timeout)

    def completions(self) -> int:
        """How many ``/v1/completions`` requests the server has answered with 200 (from its log)."""
        return self.log.read_text(errors="replace").count('"POST /v1/completions HTTP/1.1" 200')


def wait_until_serving(
    url: str, proc: subprocess.Popen[Any], log: Path, deadline: float, what: str, poll_s: float
) -> None:
    """Return once ``url``/v1/models answers 200; fail the test with the tail of ``log`` if ``proc``
    exits or ``deadline`` (``time.monotonic()``) passes first."""
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited ({proc.returncode}): {log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not start: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(poll_s)


def completion(model: str, text: str, prompt_ids: list[int], **usage: int) -> dict[str, Any]:
    """A vLLM ``/v1/completions`` answer: one stopped choice echoing ``prompt_ids``, ``prompt_tokens``
    counted from them, plus any other ``usage`` fields."""
    choice = {"index": 0, "text": text, "finish_reason": "stop", "prompt_token_ids": prompt_ids}
    return {"model": model, "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids), **usage}}


class NotStatedReader(StubServer):
    """A vLLM-shaped stub on 127.0.0.1 (labelled: not a model) that answers "not stated" and echoes the
    prompt ids; enough to take a run to a verdict."""

    def __init__(self) -> None:
        class Handler(ModelsHandler):
            max_model_len = 1024

            def do_POST(self) -> None:
                body = self.read_json()
                self.send_json(completion(body["model"], " not stated", list(body["prompt"])))

        super().__init__(Handler)


class Decoder(Protocol):
    """What a reading stub needs of a tokenizer (``tokenizers.Tokenizer`` has it)."""

    def decode(self, ids: list[int]) -> str: ...


def answer_in(answers: Mapping[str, str], text: str) -> str:
    """The answer of the first question of ``answers`` that ``text`` contains; "not stated" if none."""
    return next((answer for query, answer in answers.items() if query in text), "not stated")


def reading_handler(
    tokenizers: Mapping[str, Decoder],
    answers: Mapping[str, str],
    *,
    reply: Callable[[str, str], str] | None = None,
    completion_tokens: int = 3,
) -> type[ModelsHandler]:
    """A vLLM-shaped stub handler (labelled: not a model) that reads its token-id prompt: it serves the
    models of ``tokenizers``, decodes the ids with the model's tokenizer and answers
    ``reply(model, text)`` (default: :func:`answer_in` ``answers``), echoing the ids. The reading
    readers of several test files differ only in ``reply``: a planted regression, a counter."""
    answer = reply or (lambda model, text: answer_in(answers, text))

    class Handler(ModelsHandler):
        models = tuple(tokenizers)

        def do_POST(self) -> None:
            body = self.read_json()
            ids, model = list(body["prompt"]), body["model"]
            said = answer(model, tokenizers[model].decode(ids))
            self.send_json(completion(model, f" {said}", ids, completion_tokens=completion_tokens))

    return Handler


def read_verdict(run: Path) -> dict[str, Any]:
    """A run folder's ``report/verdict.json``."""
    return dict(json.loads((run / "report" / "verdict.json").read_text(encoding="utf-8")))


def scored_frame(rows: Sequence[tuple[str, str, int, str, int, str]]) -> pl.DataFrame:
    """(arm, case_id, length, position, seed, outcome) rows -> a scored-records frame (no safety hit)."""
    schema = {"arm": pl.String, "case_id": pl.String, "length": pl.Int64, "position": pl.String}
    schema |= {"seed": pl.Int64, "outcome": pl.String}
    return pl.DataFrame(rows, schema=schema, orient="row").with_columns(pl.lit(False).alias("safety"))


def sigkill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout_s: float) -> str:
    """SIGKILL ``proc`` (started with ``stderr=PIPE``) as soon as ``ready()`` holds, asserting that it
    was still running then; returns its stderr. ``ready`` is polled every 5 ms for ``timeout_s``."""
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.005)
        assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read()!r}"  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        proc.stderr.close()
    return err


def small_smoke_matrix(*, cases: int = 2, lengths: str = "[480]", preamble: str = SHORT_PREAMBLE) -> str:
    """The text of matrices/smoke.toml cut down for a quick run: ``cases`` cases at ``lengths``, depths 0
    and 1 only, ``n_min = 2``, 199 bootstrap resamples, and the candidate's long preamble replaced by
    ``preamble`` (TOML lines that take its place in the candidate's table)."""
    text = (REPO / "matrices" / "smoke.toml").read_text(encoding="utf-8")
    text = text.replace("cases = 8", f"cases = {cases}").replace("lengths = [1024]", f"lengths = {lengths}")
    text = text.replace("positions = [0.0, 0.25, 0.5, 0.75, 1.0]", "positions = [0.0, 1.0]")
    # the evidence-only control as NoLiMa's base: no short base lengths beside the quick run's length
    text = text.replace("n_min = 8", 'n_min = 2\nbase_score = "control"')
    text = re.sub(r"base_lengths = \[[0-9, ]*\]", "", text)
    text = text.replace("bootstrap_resamples = 999", "bootstrap_resamples = 199")
    start = text.index('preamble = """')
    end = text.index('"""', start + 14) + 3
    return text[:start] + preamble + text[end:]


def stub_matrix(
    name: str,
    *,
    where: str,
    tokenizer: Path | str | None = None,
    suite: str | None = None,
    cases: int = 2,
    lengths: str = "[640]",
    positions: str = "[0.0, 1.0]",
    top: str = "",
    arm: str = "",
    candidate_model: str = "good",
    candidate_tokenizer: Path | str | None = None,
    candidate: str = "",
    n_min: int = 2,
    resamples: int = 199,
    base_score: str | None = "control",
) -> str:
    """The text of a two-arm ``vllm-server`` matrix against stub servers: both arms serve model "good"
    with ``tokenizer`` (the GPT-2 fixture unless given) at ``where`` (an ``endpoint = ...`` or
    ``endpoints = [...]`` line), 8 new tokens, seed 0, margin 0.20. ``top`` adds top-level lines, ``arm``
    lines to both arm tables (before ``where``), ``candidate`` lines (or subtables) after the candidate's
    table. ``suite`` (a TOML value) replaces the built-in suite of ``cases`` cases."""
    suite = suite or f'{{ kind = "builtin", cases = {cases}, seed = 0, language = "en" }}'
    tokenizer = tokenizers_dir() / "gpt2" / "tokenizer.json" if tokenizer is None else tokenizer
    candidate_tokenizer = tokenizer if candidate_tokenizer is None else candidate_tokenizer

    def arm_table(role: str, arm_name: str, model: str, tok: Path | str) -> str:
        lines = [f"[{role}]", f'name = "{arm_name}"', 'backend = "vllm-server"', f'model = "{model}"']
        return "\n".join([*lines, f'tokenizer = "{tok}"', *([arm] if arm else []), where])

    # The evidence-only control as NoLiMa's base by default: a stub run sends the gated lengths only
    # (None: the plan's default, short base lengths beside the grid).
    base_line = "" if base_score is None else f'base_score = "{base_score}"\n'
    return f"""
name = "{name}"
suite = {suite}
lengths = {lengths}
positions = {positions}
{top}
[decode]
max_tokens = 8
seeds = [0]

{arm_table("baseline", "base", "good", tokenizer)}

{arm_table("candidate", "cand", candidate_model, candidate_tokenizer)}
{candidate}

[plan]
margin = 0.20
n_min = {n_min}
bootstrap_resamples = {resamples}
{base_line}"""


@dataclass(frozen=True)
class Rate:
    """A Monte Carlo rate: ``hits`` of ``sims``, with its binomial standard error. Printed as
    ``rate ± se`` with four decimals; ``f"{rate:.3f}"`` takes another format for both numbers."""

    hits: int
    sims: int

    @property
    def rate(self) -> float:
        return self.hits / self.sims

    @property
    def se(self) -> float:
        p = max(self.rate, 0.5 / self.sims)  # a usable SE when no hit was seen
        return math.sqrt(p * (1 - p) / self.sims)

    def __format__(self, spec: str) -> str:
        spec = spec or ".4f"
        return f"{self.rate:{spec}} ± {self.se:{spec}}"

    def __str__(self) -> str:
        return format(self)


def case_data(**overrides: Any) -> dict[str, Any]:
    """A valid override case (v4 decides, v3 competes) as spec data; ``overrides`` replace keys."""
    data: dict[str, Any] = {
        "id": "hotel-china",
        "kind": "qa",
        "evidence_pattern": "override",
        "language": "en",
        "risk": "low",
        "query": "Under the current travel policy, what is the maximum hotel rate in region China?",
        "answer_prefix": "Under the current travel policy, the maximum hotel rate in region China is",
        "evidence": [
            {
                "id": "v3",
                "version": 3,
                "text": " Travel policy version 3 (2023): the maximum hotel rate in region China is "
                "230 USD per night.",
                "supports": ["old"],
                "role": "competing",
            },
            {
                "id": "v4",
                "version": "4",
                "text": " Travel policy version 4 (2025): the maximum hotel rate in region China is "
                "245 USD per night.",
                "supports": ["answer"],
                "role": "decisive",
            },
        ],
        "distractors": [{"id": "d1", "text": " The maximum hotel rate in region UK is 260 USD per night."}],
        "required_claims": [
            {"id": "answer", "text": "245 USD per night", "aliases": ["245", "245 USD"], "value": "245"}
        ],
        "forbidden_claims": [
            {"id": "old", "text": "230 USD per night", "aliases": ["230"], "value": "230"},
            {"id": "uk", "text": "260 USD per night", "aliases": ["260"], "value": "260"},
        ],
        "expected_fields": {"value": "245", "unit": "USD per night"},
        "abstain_when_absent": True,
        "family": "hotel_cap:china",
        "competing_depth": 0.375,
    }
    data.update(overrides)
    return data

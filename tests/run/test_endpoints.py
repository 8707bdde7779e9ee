"""Many endpoints per arm (issue #12, item 2): ``endpoints = [...]``, every endpoint probed before the
first request, sticky routing by haystack, a replica that dies mid-run drained and its jobs moved to the
others, per-endpoint counts, all endpoints dead ⇒ INFRA (exit 30) and a resumable rerun.

Three kinds of tests:

* the pool itself, over in-process fake replicas (routing, drain, failover, re-admission, refusal);
* the CLI end to end against **stub** replicas on 127.0.0.1 (labelled as such): vLLM-shaped
  ``/v1/models`` + ``/v1/completions`` servers that read the prompt ids with the real GPT-2 tokenizer and
  answer each case's question with its true value, and that can be killed mid-run (the listening socket
  closed, the request in flight and every kept-alive connection dropped without an answer);
* ``smoke_model``: two **real** llama-cpp-python servers with the embedded Gemma-3-270M on
  127.0.0.1 serving both arms (text prompts, counts verified), one SIGKILLed mid-run.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import polars as pl
import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode, InputError, OverLengthError, SpecError, TransientBackendError
from depthgate.run.backends import make_backend
from depthgate.run.backends.base import Request, Response
from depthgate.run.backends.pool import ReplicaPool, rendezvous_order
from depthgate.run.options import RunOptions
from depthgate.run.records import read_records
from depthgate.run.retry import RetryPolicy
from depthgate.run.runner import run_pairs
from depthgate.spec.loading import parse_spec
from depthgate.spec.suites import builtin_suite
from depthgate.spec.system import DecodeParams, System
from fixtures_paths import tokenizers_dir
from helpers import (
    JSONHandler,
    LlamaServerProcess,
    completion,
    free_port,
    read_verdict,
    small_smoke_matrix,
    stub_matrix,
)

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
ARMS = ("baseline", "candidate")
KEY = ("arm", "layout_id", "seed")


# --------------------------------------------------------------------------------------------------
# the pool over in-process fake replicas


class FakeReplica:
    """A replica in process: ``probe`` reports ``served`` (the window), ``generate`` answers or, when
    ``down``, raises a refused connection, as the HTTP backend does."""

    accepts_token_ids = True
    count_tolerance = 0.0

    def __init__(
        self, url: str, *, served: int | None = 4096, down: bool = False, delay: float = 0.0
    ) -> None:
        self.base_url = url
        self.name = "m"
        self.served = served
        self.down = down
        self.delay = delay
        self.served_window: int | None = None
        self.probes = 0
        self.calls: list[str] = []
        self.inflight = 0
        self.peak = 0
        self.overlength = False

    @property
    def window(self) -> int | None:
        return self.served_window

    async def probe(self) -> dict[str, Any]:
        self.probes += 1
        if self.down:
            raise TransientBackendError("refused", summary=f"unreachable: GET {self.base_url}/v1/models")
        self.served_window = self.served
        return {"id": "m", "max_model_len": self.served}

    async def generate(self, request: Request) -> Response:
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.down:
                raise TransientBackendError("refused", summary=f"unreachable: POST {self.base_url}")
            if self.overlength:
                raise OverLengthError("too long", summary="over-length")
            self.calls.append(request.layout_id)
            n = len(request.token_ids or [])
            return Response(text=" ok", finish_reason="stop", prompt_tokens_server=n, completion_tokens=1)
        finally:
            self.inflight -= 1

    async def aclose(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _request(layout_id: str = "l", *, affinity: str | None = "c1@640", seed: int = 0) -> Request:
    return Request(
        layout_id=layout_id,
        arm="a",
        seed=seed,
        token_ids=[1, 2, 3],
        text=None,
        max_tokens=4,
        affinity=affinity,
    )


def _pool(*replicas: FakeReplica, **kw: Any) -> ReplicaPool:
    return ReplicaPool(list(replicas), name="cand", **kw)


def test_rendezvous_order_moves_only_the_keys_of_a_removed_endpoint() -> None:
    three = ["http://a:1", "http://b:2", "http://c:3"]
    two = ["http://a:1", "http://c:3"]
    keys = [f"case{i}@1024" for i in range(600)]
    first3 = {k: three[rendezvous_order(three, k)[0]] for k in keys}
    first2 = {k: two[rendezvous_order(two, k)[0]] for k in keys}
    moved = [k for k in keys if first3[k] != first2[k]]
    assert moved and all(first3[k] == "http://b:2" for k in moved)  # only b's keys move
    shares = [sum(1 for k in keys if first3[k] == url) for url in three]
    assert min(shares) > 150  # the keys spread over the replicas
    assert rendezvous_order(three, "x") == rendezvous_order(list(three), "x")  # stable


def test_one_haystack_goes_to_one_replica_and_every_response_names_it() -> None:
    a, b = FakeReplica("http://127.0.0.1:1"), FakeReplica("http://127.0.0.1:2")
    pool = _pool(a, b)

    async def go() -> list[Response]:
        out = []
        for case in range(12):
            for pos in range(3):
                for seed in range(2):
                    req = _request(f"c{case}-p{pos}", affinity=f"c{case}@640", seed=seed)
                    out.append(await pool.generate(req))
        return out

    responses = asyncio.run(go())
    assert a.calls and b.calls  # both replicas work
    assert {r.endpoint for r in responses} == set(pool.endpoints)  # each answer names its replica
    where: dict[str, set[str]] = {}
    for name, replica in (("a", a), ("b", b)):
        for lid in replica.calls:
            where.setdefault(lid.split("-")[0], set()).add(name)
    assert len(where) == 12 and all(len(v) == 1 for v in where.values())  # every position and seed
    stats = pool.stats()
    assert sum(s["answered"] for s in stats.values()) == 72 and all(s["failed"] == 0 for s in stats.values())


def test_bounded_load_spills_to_the_next_replica_only_under_load() -> None:
    a, b = FakeReplica("http://127.0.0.1:1", delay=0.05), FakeReplica("http://127.0.0.1:2", delay=0.05)
    pool = _pool(a, b)

    async def go() -> list[Response]:
        return await asyncio.gather(*(pool.generate(_request(f"l{i}", affinity="same")) for i in range(8)))

    responses = asyncio.run(go())
    top = pool.endpoints[rendezvous_order(pool.endpoints, "same")[0]]
    on_top = sum(1 for r in responses if r.endpoint == top)
    assert 4 <= on_top < 8  # one key, 8 at once: the top replica takes its bounded share, no more


def test_a_dead_replica_fails_over_then_drains_and_comes_back() -> None:
    clock = Clock()
    a, b = FakeReplica("http://127.0.0.1:1"), FakeReplica("http://127.0.0.1:2")
    pool = _pool(a, b, drain_after=2, readmit_after_s=30.0, clock=clock)
    asyncio.run(pool.probe_all())
    # keys that rank a first
    keys = [f"k{i}" for i in range(40) if rendezvous_order(pool.endpoints, f"k{i}")[0] == 0][:4]
    a.down = True

    async def attempt(key: str) -> Response | TransientBackendError:
        try:
            return await pool.generate(_request(key, affinity=key))
        except TransientBackendError as exc:
            return exc

    first = asyncio.run(attempt(keys[0]))
    assert isinstance(first, TransientBackendError)
    assert first.endpoint == "http://127.0.0.1:1" and first.failover  # b has not failed this request
    retry = asyncio.run(attempt(keys[0]))  # the runner retries at once: the request goes to b
    assert isinstance(retry, Response) and retry.endpoint == "http://127.0.0.1:2"
    second = asyncio.run(attempt(keys[1]))
    assert isinstance(second, TransientBackendError) and second.failover
    assert pool.healthy == ["http://127.0.0.1:2"]  # drained after 2 consecutive failures
    third = asyncio.run(attempt(keys[2]))  # no new request reaches the drained replica
    assert isinstance(third, Response) and third.endpoint == "http://127.0.0.1:2"
    assert pool.stats()["http://127.0.0.1:1"]["drains"] == 1

    a.down = False
    clock.now += 29
    asyncio.run(attempt(keys[3]))
    assert pool.healthy == ["http://127.0.0.1:2"]  # still cooling down
    clock.now += 2
    back = asyncio.run(attempt(keys[3]))  # re-probed before routing, re-admitted, takes its keys again
    assert isinstance(back, Response) and back.endpoint == "http://127.0.0.1:1"
    assert pool.healthy == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_a_restarted_replica_with_another_window_is_excluded_not_readmitted() -> None:
    clock = Clock()
    a, b = FakeReplica("http://127.0.0.1:1"), FakeReplica("http://127.0.0.1:2")
    pool = _pool(a, b, drain_after=1, clock=clock)
    asyncio.run(pool.probe_all())
    key = next(f"k{i}" for i in range(40) if rendezvous_order(pool.endpoints, f"k{i}")[0] == 0)
    a.down = True
    with pytest.raises(TransientBackendError):
        asyncio.run(pool.generate(_request(key, affinity=key)))
    a.down, a.served = False, 2048
    clock.now += 31
    resp = asyncio.run(pool.generate(_request(key, affinity=key)))
    assert resp.endpoint == "http://127.0.0.1:2"
    assert "2048" in (pool.stats()["http://127.0.0.1:1"]["excluded"] or "")


def test_every_replica_down_fails_without_failover_and_a_probe_brings_one_back() -> None:
    clock = Clock()
    a, b = FakeReplica("http://127.0.0.1:1", down=True), FakeReplica("http://127.0.0.1:2", down=True)
    pool = _pool(a, b, clock=clock)
    asyncio.run(pool.probe_all())  # unreachable at start: drained, not fatal
    assert pool.healthy == []
    with pytest.raises(TransientBackendError) as info:
        asyncio.run(pool.generate(_request()))
    assert not info.value.failover and "every endpoint" in info.value.message
    assert info.value.endpoint is None
    b.down = False
    clock.now += 0.5
    with pytest.raises(TransientBackendError):  # probed less than a second ago: not yet
        asyncio.run(pool.generate(_request()))
    clock.now += 1.0
    resp = asyncio.run(pool.generate(_request()))
    assert resp.endpoint == "http://127.0.0.1:2" and pool.healthy == ["http://127.0.0.1:2"]


def test_probe_all_refuses_replicas_that_disagree_on_the_window() -> None:
    pool = _pool(
        FakeReplica("http://127.0.0.1:1", served=4096), FakeReplica("http://127.0.0.1:2", served=2048)
    )
    with pytest.raises(InputError) as info:
        asyncio.run(pool.probe_all())
    assert info.value.exit_code == ExitCode.BAD_INPUT
    assert "http://127.0.0.1:1 → 4096 tokens" in info.value.message
    assert "http://127.0.0.1:2 → 2048 tokens" in info.value.message
    # "not reported" is a window too: a server without max_model_len beside one with it
    mixed = _pool(FakeReplica("http://127.0.0.1:1", served=None), FakeReplica("http://127.0.0.1:2"))
    with pytest.raises(InputError, match="not reported"):
        asyncio.run(mixed.probe_all())
    # the pool's window is the agreed one
    agreed = _pool(
        FakeReplica("http://127.0.0.1:1", served=2048), FakeReplica("http://127.0.0.1:2", served=2048)
    )
    asyncio.run(agreed.probe_all())
    assert agreed.window == 2048


def test_overlength_names_the_replica_and_resets_nothing_else() -> None:
    a = FakeReplica("http://127.0.0.1:1")
    a.overlength = True
    pool = _pool(a)
    with pytest.raises(OverLengthError) as info:
        asyncio.run(pool.generate(_request()))
    assert info.value.endpoint == "http://127.0.0.1:1" and pool.healthy == ["http://127.0.0.1:1"]


def _layout(case: str, position: str, n: int = 3) -> dict[str, Any]:
    return {
        "layout_id": f"{case}-{position}", "case_id": case, "target_tokens": 640, "position": position,
        "token_ids": list(range(1, n + 1)), "text": "x", "status": "ok",
    }  # fmt: skip


def _options(run_id: str = "pool", **kw: Any) -> RunOptions:
    return RunOptions(
        run_id=run_id,
        manifest_digest="d",
        decode=DecodeParams(max_tokens=4, stop=[]),
        seeds=[0, 1],
        progress=False,
        retry=RetryPolicy(backoff_base_s=0.01, backoff_max_s=0.02, breaker_after=5),
        **kw,
    )


def test_runner_moves_jobs_off_a_dead_replica_without_feeding_the_breaker(tmp_path: Path) -> None:
    a, b = FakeReplica("http://127.0.0.1:1"), FakeReplica("http://127.0.0.1:2")
    pool = _pool(a, b)
    asyncio.run(pool.probe_all())  # both up at start
    a.down = True  # a dies before the first request
    jobs = [("a", _layout(f"c{i}", p)) for i in range(10) for p in ("0.0", "1.0")]
    summary = run_pairs(jobs, {"a": pool}, tmp_path, _options(concurrency=4))
    records = read_records(tmp_path)
    assert summary.complete and summary.circuit_open is None  # 5 failovers would have tripped it
    assert records.height == 40 and set(records["status"]) == {"ok"}
    assert set(records["endpoint"]) == {"http://127.0.0.1:2"}
    moved = records.filter(pl.col("failed_endpoints").is_not_null())
    assert moved.height >= 1 and set(moved["failed_endpoints"]) == {"http://127.0.0.1:1"}
    assert (moved["attempts"] == 2).all()
    assert pool.stats()["http://127.0.0.1:1"]["drains"] == 1


def test_runner_with_every_replica_down_opens_the_breaker(tmp_path: Path) -> None:
    pool = _pool(FakeReplica("http://127.0.0.1:1", down=True), FakeReplica("http://127.0.0.1:2", down=True))
    jobs = [("a", _layout(f"c{i}", p)) for i in range(10) for p in ("0.0", "1.0")]
    summary = run_pairs(jobs, {"a": pool}, tmp_path, _options(concurrency=2))
    assert summary.circuit_open == "a" and not summary.complete


def test_per_endpoint_concurrency_from_the_runtime_block() -> None:
    replicas: list[Stub] = [Stub(delay=0.15).start(), Stub(delay=0.15).start()]
    try:
        system = parse_spec(
            System,
            {
                "name": "cand", "backend": "vllm-server", "model": "good", "tokenizer": str(GPT2),
                "endpoints": [r.url for r in replicas], "runtime": {"concurrency": 1},
            },
        )  # fmt: skip
        pool = make_backend(system)
        assert isinstance(pool, ReplicaPool) and pool.endpoints == [r.url for r in replicas]

        async def many() -> None:
            try:
                await asyncio.gather(*(pool.generate(_request(f"l{i}", affinity=f"k{i}")) for i in range(8)))
            finally:
                await pool.aclose()

        asyncio.run(many())
        assert [r.peak for r in replicas] == [1, 1]  # one in flight per endpoint, two for the arm
        assert sum(r.completions for r in replicas) == 8
    finally:
        for r in replicas:
            r.stop()


# --------------------------------------------------------------------------------------------------
# the spec


def _system(**kw: Any) -> System:
    base: dict[str, Any] = {"name": "cand", "backend": "vllm-server", "model": "m", "tokenizer": "t.json"}
    return parse_spec(System, {**base, **kw})


def test_endpoints_in_the_spec() -> None:
    pool = _system(endpoints=["http://127.0.0.1:8000", "http://127.0.0.1:8001"])
    assert pool.urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert _system(endpoint="http://127.0.0.1:8000").urls == ["http://127.0.0.1:8000"]  # still valid
    # Replicas are interchangeable: the digest binds that the arm runs on replicas, not which.
    other = _system(endpoints=["http://10.0.0.7:8000"])
    assert pool.digest() == other.digest() != _system(endpoint="http://127.0.0.1:8000").digest()
    assert "endpoints" not in _system(endpoint="http://127.0.0.1:8000").model_dump()  # old digests kept
    embedded = parse_spec(
        System, {"name": "c", "backend": "llamacpp", "model": "gemma3-270m", "tokenizer": "gguf:"}
    )
    served = parse_spec(
        System,
        {"name": "c", "backend": "llamacpp", "model": "gemma3-270m", "tokenizer": "gguf:",
         "endpoints": ["http://127.0.0.1:8000"], "runtime": {"prompt_format": "text", "concurrency": 2}},
    )  # fmt: skip
    assert served.digest() != embedded.digest()  # a llamacpp arm with endpoints is an HTTP arm

    bad = [
        ({"endpoint": "http://127.0.0.1:1", "endpoints": ["http://127.0.0.1:2"]}, "endpoints", "both"),
        ({"endpoints": []}, "endpoints", "empty"),
        ({"endpoints": ["http://127.0.0.1:1", "http://127.0.0.1:1/v1/"]}, "endpoints[1]", "same server"),
        ({"endpoints": ["ftp://h"]}, "endpoints[0]", "not an http(s) URL"),
        ({"endpoints": ["https://u:p@h"]}, "endpoints[0]", "credentials"),
        ({"backend": "anthropic", "endpoints": ["https://a", "https://b"]}, "endpoints", "/v1/completions"),
        ({"backend": "openai", "endpoints": ["https://a", "https://b"]}, "endpoints", "chat API"),
        ({"backend": "vllm", "endpoints": ["http://h:1"]}, "endpoints", "offline"),
    ]
    for extra, field, words in bad:
        with pytest.raises(SpecError) as info:
            _system(**extra)
        assert info.value.field == field and words in info.value.message, (extra, info.value)
    ok = _system(backend="openai", endpoints=["https://a", "https://b"], runtime={"api": "completions"})
    assert len(ok.urls) == 2


# --------------------------------------------------------------------------------------------------
# stub replicas on 127.0.0.1 (a perfect reader; killable)


class Stub:
    """A vLLM-shaped replica on 127.0.0.1 (a STUB): ``/v1/models`` (model ``good``, ``max_model_len``
    ``window``) and ``/v1/completions`` with token-id prompts, read with GPT-2 and answered with the
    case's true value. ``kill_after``: after that many accepted requests the next one kills it: the
    listening socket is closed and every request from then on (those in flight included) is dropped
    without an answer (a killed server)."""

    tokenizer = Tokenizer.from_file(str(GPT2))
    answers: ClassVar[dict[str, str]] = {
        c.query: c.required_claims[0].aliases[0] if c.required_claims else "not stated"
        for c in builtin_suite(44).cases
    }

    def __init__(
        self, port: int = 0, *, window: int = 4096, model: str = "good", kill_after: int | None = None,
        delay: float = 0.0,
    ) -> None:  # fmt: skip
        self.window = window
        self.model = model
        self.kill_after = kill_after
        self.delay = delay
        self.completions = 0
        self.accepted = 0
        self.dropped = 0
        self.inflight = 0
        self.peak = 0
        self.dead = False
        self.lock = threading.Lock()
        stub = self

        class Handler(JSONHandler):
            def _drop(self) -> None:
                self.close_connection = True

            def do_GET(self) -> None:
                if stub.dead:
                    return self._drop()
                self.send_json({"object": "list", "data": [{"id": stub.model, "max_model_len": stub.window}]})

            def do_POST(self) -> None:
                body = self.read_json()
                with stub.lock:
                    if stub.dead:
                        return self._drop()
                    if stub.kill_after is not None and stub.accepted >= stub.kill_after:
                        stub.dropped += 1
                        stub.kill()
                        return self._drop()
                    stub.accepted += 1
                    stub.inflight += 1
                    stub.peak = max(stub.peak, stub.inflight)
                try:
                    if stub.delay:
                        time.sleep(stub.delay)
                    ids = list(body["prompt"])
                    text = stub.tokenizer.decode(ids)
                    answer = next((a for q, a in stub.answers.items() if q in text), "not stated")
                    with stub.lock:
                        if stub.dead:
                            return self._drop()
                        stub.completions += 1
                    self.send_json(completion(body["model"], f" {answer}", ids, completion_tokens=3))
                finally:
                    with stub.lock:
                        stub.inflight = max(0, stub.inflight - 1)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> Stub:
        self.thread.start()
        return self

    def kill(self) -> None:
        """Die: refuse new connections (socket closed), drop every request from now on."""
        if self.dead:
            return
        self.dead = True
        threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        self.dead = True
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Pair:
    a: Stub
    b: Stub

    @property
    def urls(self) -> list[str]:
        return [self.a.url, self.b.url]


def _matrix(tmp: Path, urls: list[str], *, cases: int = 20, name: str = "pool.toml") -> Path:
    text = stub_matrix(
        "pool",
        where=f"endpoints = {json.dumps(urls)}",
        cases=cases,
        candidate="\n[candidate.runtime]\nconcurrency = 2",
        resamples=499,
        # These tests count each replica's share of the matrix's jobs; the canaries (on by default for
        # a server arm) go through the same pool and are tested in tests/run/test_serving_path.py.
        top="canaries = 0",
    )
    path = tmp / name
    path.write_text(text)
    return path


def _placed(cases: int) -> int:
    return sum(1 for c in builtin_suite(cases).cases if c.evidence)


def test_a_replica_killed_mid_run_the_run_finishes_on_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """STUB replicas. An undisturbed run on two replicas, then the same matrix on two fresh replicas
    of which one dies at its sixth request (dropping what it has in flight): the run finishes on the
    other with one final record per planned job, every job answered exactly once, the killed
    endpoint's counts in verdict.json, and the same verdict and slices as the undisturbed run."""
    cases = 20
    planned = 2 * _placed(cases) * 2  # arms × placed cases × positions, one seed
    calm = Pair(Stub().start(), Stub().start())
    try:
        code = main(
            ["run", str(_matrix(tmp_path, calm.urls)), "--out", str(tmp_path / "calm"), "--no-controls"]
        )
    finally:
        calm.a.stop()
        calm.b.stop()
    assert code == ExitCode.PASS, capsys.readouterr().err
    assert calm.a.completions and calm.b.completions  # both replicas served
    assert calm.a.completions + calm.b.completions == planned
    capsys.readouterr()

    killed = Pair(Stub(delay=0.01).start(), Stub(delay=0.01, kill_after=5).start())
    # The same matrix file on other ports: replicas are not in the digest, so the run id is the same.
    matrix = _matrix(tmp_path, killed.urls)
    try:
        code = main(
            ["run", str(matrix), "--out", str(tmp_path / "killed"), "--no-controls", "--concurrency", "4"]
        )
    finally:
        killed.a.stop()
        killed.b.stop()
    err = capsys.readouterr().err
    assert code == ExitCode.PASS, err
    answered_b = killed.b.completions
    assert killed.b.dead and 1 <= answered_b <= 5 and killed.b.dropped == 1
    assert killed.a.completions + answered_b == planned  # every job answered exactly once
    assert f"{killed.b.url}: sent" in err and "drained" in err

    records = read_records(tmp_path / "killed")
    raw = pl.read_parquet(tmp_path / "killed" / "records.parquet")
    assert raw.height == records.height == planned and raw.select(KEY).n_unique() == planned
    assert set(records["status"]) == {"ok"}
    assert records.filter(pl.col("endpoint") == killed.b.url).height == answered_b
    assert records["failed_endpoints"].drop_nulls().str.contains(killed.b.url).all()
    moved = records.filter(pl.col("failed_endpoints").is_not_null())
    assert moved.height >= 1 and set(moved["endpoint"]) == {killed.a.url}

    calm_doc, killed_doc = read_verdict(tmp_path / "calm"), read_verdict(tmp_path / "killed")
    assert killed_doc["verdict"] == calm_doc["verdict"] == "PASS"
    assert killed_doc["slices"] == calm_doc["slices"]
    assert killed_doc["run"]["run_id"] == calm_doc["run"]["run_id"]
    endpoints = killed_doc["infra"]["endpoints"]
    assert endpoints[killed.b.url]["ok"] == answered_b and endpoints[killed.b.url]["failed"] >= 1
    assert endpoints[killed.a.url]["ok"] == planned - answered_b and endpoints[killed.a.url]["failed"] == 0
    assert killed_doc["infra"]["lost"] == 0
    calm_endpoints = calm_doc["infra"]["endpoints"]
    assert sum(e["ok"] for e in calm_endpoints.values()) == planned
    assert all(e["failed"] == 0 for e in calm_endpoints.values())


def test_replicas_that_disagree_are_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """STUB replicas: one serves a window of 4096 tokens, the other 2048 → exit 20 naming both, and
    not one completion sent. A replica that does not serve the model is refused the same way."""
    pair = Pair(Stub(window=4096).start(), Stub(window=2048).start())
    try:
        code = main(["run", str(_matrix(tmp_path, pair.urls, cases=2)), "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert code == ExitCode.BAD_INPUT == 20, err
        assert f"{pair.a.url} → 4096 tokens" in err and f"{pair.b.url} → 2048 tokens" in err
        assert pair.a.completions == pair.b.completions == 0
        assert not read_records(tmp_path / "run").height
    finally:
        pair.a.stop()
        pair.b.stop()

    other = Pair(Stub().start(), Stub(model="another").start())
    try:
        code = main(["run", str(_matrix(tmp_path, other.urls, cases=2)), "--out", str(tmp_path / "run2")])
        err = capsys.readouterr().err
        assert code == ExitCode.BAD_INPUT, err
        assert f"{other.b.url} does not serve model 'good'" in err
        assert other.a.completions == other.b.completions == 0
    finally:
        other.a.stop()
        other.b.stop()


def test_all_endpoints_dead_is_infra_exit_30_and_the_rerun_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens on either endpoint: the run stops with the breaker open, verdict INFRA (exit 30),
    lost runs per endpoint; with the replicas up again the rerun of the same folder sends only the lost
    jobs and ends with the verdict."""
    cases = 20
    planned = 2 * _placed(cases) * 2
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    matrix, run = _matrix(tmp_path, urls, cases=cases), tmp_path / "run"
    code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    err = capsys.readouterr().err
    assert code == ExitCode.INFRA == 30, err
    assert "circuit open" in err and "0 of 2 endpoint(s) up" in err
    doc = read_verdict(run)
    assert doc["verdict"] == "INFRA" and doc["infra"]["lost"] == planned
    assert sum(doc["infra"]["by_endpoint"].values()) == planned
    before = read_records(run)
    assert set(before["status"]) <= {"infra_error"}

    pair = Pair(Stub(ports[0]).start(), Stub(ports[1]).start())
    try:
        code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    finally:
        pair.a.stop()
        pair.b.stop()
    assert code == ExitCode.PASS, capsys.readouterr().err
    records = read_records(run)
    assert records.height == planned and set(records["status"]) == {"ok"}
    assert pair.a.completions + pair.b.completions == planned  # each lost job sent once more, no more
    assert read_verdict(run)["infra"]["lost"] == 0


# --------------------------------------------------------------------------------------------------
# two real llama-cpp-python servers (the embedded Gemma-3-270M), one killed mid-run


@pytest.fixture
def two_real_servers(tmp_path: Path) -> Iterator[list[LlamaServerProcess]]:
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")
    servers = [
        LlamaServerProcess.start(tmp_path, n_threads=1),
        LlamaServerProcess.start(tmp_path, n_threads=1),
    ]
    try:
        deadline = time.monotonic() + 120
        for server in servers:
            server.wait_up(deadline)
        yield servers
    finally:
        for server in servers:
            server.stop()


def _real_matrix(tmp: Path, urls: list[str], *, cases: int = 3, lengths: str = "[480]") -> Path:
    text = small_smoke_matrix(cases=cases, lengths=lengths)
    # The tests here count each planned job's requests: no canaries (on by default for a server arm;
    # tests/run/test_serving_path.py covers them on the real model).
    text = text.replace('name = "smoke"', 'name = "smoke"\ncanaries = 0', 1)
    text = text.replace("window = 2048\n", f"window = 2048\nendpoints = {json.dumps(urls)}\n")
    runtime = '\n[{arm}.runtime]\nprompt_format = "text"\nconcurrency = 1\n'
    text = text.replace("\n[candidate]", runtime.format(arm="baseline") + "\n[candidate]")
    text = text.replace("\n[plan]", runtime.format(arm="candidate") + "\n[plan]")
    path = tmp / "real-pool.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.smoke_model
def test_two_real_servers_one_killed_mid_run_same_verdict(
    two_real_servers: list[LlamaServerProcess], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two llama-cpp-python servers (embedded Gemma-3-270M, text prompts, counts verified) serve both
    arms. An undisturbed run, then the same matrix into a new folder while the first server to answer
    is SIGKILLed right after its first answer: the run finishes on the other with one final record per
    planned job, nothing lost or duplicated, the killed endpoint's counts in verdict.json, and the same
    verdict, slices and answers as the undisturbed run."""
    servers = two_real_servers
    matrix = _real_matrix(tmp_path, [s.url for s in servers], cases=4)
    planned = 2 * 4 * 2  # arms × cases × positions, one seed
    t0 = time.monotonic()
    code = main(["run", str(matrix), "--out", str(tmp_path / "calm"), "--no-controls", "--concurrency", "2"])
    calm_s = time.monotonic() - t0
    assert code not in (ExitCode.BAD_INPUT, ExitCode.INFRA, ExitCode.VERIFY_FAILED), capsys.readouterr().err
    calm = read_records(tmp_path / "calm")
    assert calm.height == planned and set(calm["status"]) == {"ok"}
    before = [s.completions() for s in servers]
    assert sum(before) == planned  # each job sent once
    capsys.readouterr()

    victims: list[LlamaServerProcess] = []

    def killer() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            for server, done in zip(servers, before, strict=True):
                if server.completions() > done:
                    # The access-log line is written as the 200 goes out; the body may still be on its
                    # way. Killed at that instant, the answer is lost and resent to the other server
                    # (seen once in CI, 2026-12-04: 0 records on the dead one). A pause lets the first
                    # answer arrive, so the kill lands on a later request, mid-run.
                    time.sleep(0.5)
                    server.proc.send_signal(signal.SIGKILL)
                    server.proc.wait()
                    victims.append(server)
                    return
            time.sleep(0.01)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    code = main(
        ["run", str(matrix), "--out", str(tmp_path / "killed"), "--no-controls", "--concurrency", "2"]
    )
    killed_s = time.monotonic() - t0
    watcher.join(timeout=5)
    err = capsys.readouterr().err
    assert victims, f"no server was killed mid-run: {err[-2000:]}"
    assert code not in (ExitCode.BAD_INPUT, ExitCode.INFRA, ExitCode.VERIFY_FAILED), err
    dead = victims[0]
    alive = next(s for s in servers if s is not dead)
    assert dead.proc.returncode == -signal.SIGKILL and f"{dead.url}: sent" in err and "drained" in err

    killed = read_records(tmp_path / "killed")
    raw = pl.read_parquet(tmp_path / "killed" / "records.parquet")
    assert raw.height == killed.height == planned and raw.select(KEY).n_unique() == planned
    assert set(killed["status"]) == {"ok"}
    assert (killed["prompt_tokens_server"] == killed["prompt_tokens_local"]).all()  # counts verified
    on_dead = killed.filter(pl.col("endpoint") == dead.url).height
    assert 1 <= on_dead < planned
    after = alive.completions() - before[servers.index(alive)]
    assert after == planned - on_dead  # the rest on the survivor, each job once
    moved = killed.filter(pl.col("failed_endpoints").is_not_null())
    assert moved.height >= 1 and set(moved["endpoint"]) == {alive.url}
    assert set(moved["failed_endpoints"].str.split(" ").explode()) == {dead.url}

    doc_calm, doc_killed = read_verdict(tmp_path / "calm"), read_verdict(tmp_path / "killed")
    assert doc_killed["verdict"] == doc_calm["verdict"] and doc_killed["exit_code"] == doc_calm["exit_code"]
    assert doc_killed["slices"] == doc_calm["slices"]
    joined = calm.select(*KEY, "output_text").join(killed.select(*KEY, "output_text"), on=list(KEY))
    assert joined.height == planned
    assert joined["output_text"].eq_missing(joined["output_text_right"]).all()  # greedy: same answers
    endpoints = doc_killed["infra"]["endpoints"]
    assert endpoints[dead.url]["ok"] == on_dead and endpoints[dead.url]["failed"] == moved.height
    assert endpoints[alive.url] == {"ok": planned - on_dead, "system_fail": 0, "infra_error": 0, "failed": 0}
    print(f"\nreal pool: undisturbed {calm_s:.1f} s, killed mid-run {killed_s:.1f} s", file=sys.__stderr__)

"""The paired, resumable runner.

Most tests drive the runner with small in-process backends that implement the Backend protocol (test
doubles for the protocol, not for any server). The crash test runs the runner in a subprocess against a
real HTTP server on 127.0.0.1 (a slow stub speaking vLLM's ``/v1/completions`` shape), kills it with
SIGKILL mid-run and resumes. The smoke test runs the real embedded llama.cpp backend through the adapter.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from depthgate.exceptions import (
    BackendRequestError,
    InfraError,
    InputError,
    OverLengthError,
    PlanChangedError,
    TransientBackendError,
)
from depthgate.run.backends.base import Backend, Request, Response
from depthgate.run.jobs import interleaved_order, order_seed
from depthgate.run.lock import DirLock
from depthgate.run.options import RunOptions
from depthgate.run.records import RECORD_SCHEMA, RECORDS_FILE, compact, read_records
from depthgate.run.retry import RetryPolicy
from depthgate.run.runner import run_pairs
from depthgate.spec.system import DecodeParams

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
ARMS = ("baseline", "candidate")
DECODE = DecodeParams(max_tokens=4, seeds=[0, 1, 2])
SECRET_TEXT = "The vault code is 4821 (prompt text that must never be stored)"


def layouts(
    arm: str, *, cases: int = 3, lengths: tuple[int, ...] = (64, 128), positions: int = 3
) -> list[Any]:
    rows = []
    for c in range(cases):
        for length in lengths:
            for p in range(positions):
                position = f"{p / max(1, positions - 1):.2f}"
                rows.append(
                    {
                        "layout_id": f"{arm[:4]}-{c}-{length}-{p}",
                        "case_id": f"case{c}",
                        "target_tokens": length,
                        "position": position,
                        "token_ids": list(range(length)),
                        "text": f"{SECRET_TEXT} {arm} {c} {length} {p}",
                        "status": "ok",
                        "reason_code": None,
                    }
                )
    return rows


def jobs(**kw: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(arm, row) for arm in ARMS for row in layouts(arm, **kw)]


class FakeBackend:
    """A protocol-conforming backend: echoes exact counts, with per-layout faults on request."""

    accepts_token_ids = True
    count_tolerance = 0.0

    def __init__(self, name: str, *, faults: dict[str, str] | None = None, delay: float = 0.0) -> None:
        self.name = name
        self.faults = dict(faults or {})
        self.delay = delay
        self.calls: list[tuple[str, str, int]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def window(self) -> int | None:
        return 4096

    async def generate(self, request: Request) -> Response:
        self.calls.append((request.arm, request.layout_id, request.seed))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        assert request.token_ids is not None
        n = len(request.token_ids)
        fault = self.faults.get(request.layout_id)
        if fault == "transient":
            raise TransientBackendError("HTTP 503 from stub", summary="HTTP 503: stub", status=503)
        if fault == "overflow":
            raise OverLengthError("too long", n_prompt_tokens=n, window=10)
        if fault == "bad_request":
            raise BackendRequestError("HTTP 401: bad key", status=401)
        return Response(
            text=f" answer {request.layout_id} {request.seed}",
            finish_reason="length" if fault == "clamp" else "stop",
            prompt_tokens_server=n + (1 if fault == "count" else 0),
            completion_tokens=2,
            server_prompt_ids_match=fault != "ids",
            system_fingerprint="fp-1",
            prefix_cache_hit_tokens=0,
        )

    async def aclose(self) -> None:
        pass


def _run(tmp: Path, backends: dict[str, Any], job_list: list[Any] | None = None, **kw: Any) -> Any:
    retry = {k: kw.pop(k) for k in ("max_attempts", "breaker_after") if k in kw}
    args: dict[str, Any] = {
        "concurrency": 4,
        "seeds": [0, 1, 2],
        "decode": DECODE,
        "run_id": "run-1",
        "manifest_digest": "a" * 64,
        "progress": False,
        "retry": RetryPolicy(backoff_base_s=0.001, backoff_max_s=0.01, **retry),
        "flush_seconds": 0.05,
    }
    args.update(kw)
    return run_pairs(jobs() if job_list is None else job_list, backends, tmp, RunOptions(**args))


def _backends(**kw: Any) -> dict[str, FakeBackend]:
    return {arm: FakeBackend(f"sys-{arm}", **kw) for arm in ARMS}


def test_fake_backend_conforms_to_protocol() -> None:
    assert isinstance(FakeBackend("x"), Backend)


def test_pairing_same_seeds_on_both_arms(tmp_path: Path) -> None:
    backends = _backends()
    summary = _run(tmp_path, backends)
    records = read_records(tmp_path)
    assert summary.total == 2 * 18 * 3 == len(records) == summary.ok and summary.complete
    assert records.columns == list(RECORD_SCHEMA)
    per_arm = {
        arm: set(
            records.filter(pl.col("arm") == arm)
            .select(["case_id", "target_tokens", "position", "seed"])
            .iter_rows()
        )
        for arm in ARMS
    }
    assert per_arm["baseline"] == per_arm["candidate"] and len(per_arm["baseline"]) == 18 * 3
    seeds_per_layout = records.group_by(["arm", "layout_id"]).agg(pl.col("seed").sort()).get_column("seed")
    assert all(s.to_list() == [0, 1, 2] for s in seeds_per_layout)
    assert set(records.get_column("system")) == {"sys-baseline", "sys-candidate"}
    assert (records.get_column("prompt_tokens_server") == records.get_column("prompt_tokens_local")).all()
    assert set(records.get_column("run_id")) == {"run-1"}
    assert records.get_column("completed_at").dtype == pl.Datetime("us", "UTC")


def test_order_is_interleaved_random_and_deterministic(tmp_path: Path) -> None:
    job_list = jobs()
    first = interleaved_order(job_list, [0, 1, 2], "run-1")
    again = interleaved_order(list(reversed(job_list)), [0, 1, 2], "run-1")
    other = interleaved_order(job_list, [0, 1, 2], "run-2")
    keys = [j.key for j in first]
    assert keys == [j.key for j in again]  # depends on the run id and the job set only
    assert keys != [j.key for j in other] and sorted(keys) == sorted(j.key for j in other)
    assert len(set(keys)) == len(keys) == 108
    assert order_seed("run-1") == order_seed("run-1") != order_seed("run-2")
    # interleaved: each consecutive pair is the two arms of one (case, length, position, seed)
    for a, b in zip(first[::2], first[1::2], strict=True):
        assert {a.arm, b.arm} == set(ARMS)
        assert (*a.slice_key, a.seed) == (*b.slice_key, b.seed)
    # randomized: neither the arms' order inside pairs nor the slices follow the input order
    assert 10 < sum(j.arm == "baseline" for j in first[::2]) < 44
    assert [j.slice_key for j in first[::6]] != sorted(j.slice_key for j in first[::6])
    # with concurrency 1 the backends are called in exactly that order
    shared = FakeBackend("shared")
    _run(tmp_path, {arm: shared for arm in ARMS}, concurrency=1)
    assert shared.calls == keys


def test_haystack_order_keeps_each_haystack_together_and_random_inside() -> None:
    """``order = "haystack"``: a haystack's (case × length × seed) pairs are sent back to back, so a
    server's prefix cache reuses the shared prefix; haystacks, pairs and arms stay shuffled."""
    job_list = jobs()
    sticky = interleaved_order(job_list, [0, 1, 2], "run-1", "haystack")
    shuffled = interleaved_order(job_list, [0, 1, 2], "run-1")
    assert sorted(j.key for j in sticky) == sorted(j.key for j in shuffled)
    assert [j.key for j in sticky] == [
        j.key for j in interleaved_order(job_list, [0, 1, 2], "run-1", "haystack")
    ]

    def haystack(job: Any) -> tuple[str, int, int]:
        return (job.slice_key[0], job.slice_key[1], job.seed)

    runs = [haystack(j) for j in sticky]
    changes = sum(a != b for a, b in itertools.pairwise(runs))
    assert changes == len(set(runs)) - 1  # each haystack is one contiguous block
    assert sum(haystack(a) != haystack(b) for a, b in itertools.pairwise(shuffled)) > changes
    for a, b in zip(sticky[::2], sticky[1::2], strict=True):  # still interleaved by pair
        assert {a.arm, b.arm} == set(ARMS) and (*a.slice_key, a.seed) == (*b.slice_key, b.seed)
    # the positions inside a haystack are not always sent in one order
    first_positions = {
        sticky[i].slice_key[2] for i in range(0, len(sticky), 2) if i == 0 or runs[i] != runs[i - 1]
    }
    assert len(first_positions) > 1
    assert 10 < sum(j.arm == "baseline" for j in sticky[::2]) < 44


def test_concurrency_is_bounded(tmp_path: Path) -> None:
    shared = FakeBackend("shared", delay=0.005)
    _run(tmp_path, {arm: shared for arm in ARMS}, concurrency=5)
    assert shared.max_in_flight == 5


def test_refused_layouts_are_recorded_not_sent(tmp_path: Path) -> None:
    job_list = jobs()
    refused = [row for arm, row in job_list if row["case_id"] == "case1" and row["target_tokens"] == 64]
    for row in refused:
        row.update(status="refused", reason_code="window_too_small", token_ids=[], text=None)
    backends = _backends()
    summary = _run(tmp_path, backends, job_list)
    records = read_records(tmp_path)
    failed = records.filter(pl.col("status") == "system_fail")
    assert summary.system_fail == len(failed) == len(refused) * 3
    assert set(failed.get_column("system_fail_reason")) == {"window_too_small"}
    assert set(failed.get_column("attempts")) == {0}
    sent = {lid for b in backends.values() for _, lid, _ in b.calls}
    assert not sent & {row["layout_id"] for row in refused}
    assert len(records) == 108 and summary.complete


def test_post_send_checks(tmp_path: Path) -> None:
    faults = {
        "base-0-64-0": "count",
        "base-0-64-1": "ids",
        "base-0-64-2": "clamp",
        "base-1-64-0": "overflow",
        "cand-2-128-2": "count",
    }
    _run(tmp_path, _backends(faults=faults))
    records = read_records(tmp_path)
    reasons = {
        lid: set(records.filter(pl.col("layout_id") == lid).get_column("system_fail_reason"))
        for lid in faults
    }
    assert reasons == {
        "base-0-64-0": {"server_count_mismatch"},
        "base-0-64-1": {"server_ids_mismatch"},
        "base-0-64-2": {"max_tokens_clamped"},
        "base-1-64-0": {"overflow"},
        "cand-2-128-2": {"server_count_mismatch"},
    }
    mismatch = records.filter(pl.col("layout_id") == "cand-2-128-2").row(0, named=True)
    assert (mismatch["prompt_tokens_local"], mismatch["prompt_tokens_server"]) == (128, 129)
    assert mismatch["output_text"] and mismatch["finish_reason"] == "stop"
    ok = records.filter(pl.col("status") == "ok")
    assert len(ok) == 108 - 5 * 3
    assert set(ok.get_column("finish_reason")) == {"stop"} and set(ok.get_column("attempts")) == {1}


def test_infra_errors_are_recorded_then_rerun_on_resume(tmp_path: Path) -> None:
    faults = {"base-0-64-0": "transient", "cand-1-128-1": "transient"}
    first = _run(tmp_path, _backends(faults=faults), max_attempts=2)
    assert first.infra_error == 6 and first.ok == 102 and not first.complete
    infra = read_records(tmp_path).filter(pl.col("status") == "infra_error")
    assert set(infra.get_column("attempts")) == {2}
    assert set(infra.get_column("error")) == {"HTTP 503: stub"}
    assert infra.get_column("output_text").null_count() == 6

    healthy = _backends()
    second = _run(tmp_path, healthy)
    resent = sorted(c for b in healthy.values() for c in b.calls)
    assert resent == sorted(
        (a, lid, s) for a, lid, s in infra.select(["arm", "layout_id", "seed"]).iter_rows()
    )
    assert second.already_done == 102 and second.ok == 6 and second.complete
    raw = read_records(tmp_path, dedup=False)
    assert len(raw) == 114  # the infra_error records stay in their shards until compaction
    path = compact(tmp_path)
    assert path == tmp_path / RECORDS_FILE and not list((tmp_path / "records").glob("part-*.parquet"))
    merged = pl.read_parquet(path)
    assert len(merged) == 108 and set(merged.get_column("status")) == {"ok"}
    assert merged.select(["arm", "layout_id", "seed"]).is_duplicated().sum() == 0
    third = _run(tmp_path, _backends())  # resuming a finished run sends nothing
    assert third.already_done == 108 and third.written == 0


def test_backend_request_error_stops_the_run_and_keeps_records(tmp_path: Path) -> None:
    backends = _backends(faults={"cand-2-128-2": "bad_request"})
    with pytest.raises(BackendRequestError, match="bad key"):
        _run(tmp_path, backends, concurrency=2, batch_size=1)
    kept = read_records(tmp_path)
    assert 0 < len(kept) < 108 and set(kept.get_column("status")) == {"ok"}
    summary = _run(tmp_path, _backends())
    assert summary.already_done == len(kept) and summary.complete
    assert len(read_records(tmp_path)) == 108


def test_a_folder_of_another_run_or_manifest_is_refused(tmp_path: Path) -> None:
    _run(tmp_path, _backends(), job_list=jobs(cases=1))
    with pytest.raises(PlanChangedError, match="manifest digest"):
        _run(tmp_path, _backends(), job_list=jobs(cases=1), manifest_digest="b" * 64)
    with pytest.raises(PlanChangedError, match="not of run 'run-2'"):
        _run(tmp_path, _backends(), job_list=jobs(cases=1), run_id="run-2")


def test_unpaired_or_duplicated_jobs_are_refused(tmp_path: Path) -> None:
    job_list = jobs()
    with pytest.raises(InputError, match="not paired"):
        _run(tmp_path, _backends(), job_list[:-1])
    with pytest.raises(InputError, match="appears twice"):
        _run(tmp_path, _backends(), [*job_list, job_list[0]])
    with pytest.raises(InputError, match="has no backend"):
        _run(tmp_path, {"baseline": FakeBackend("b")}, job_list)
    assert not list(tmp_path.glob("records/*.parquet"))


def test_prompts_never_reach_records_or_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _run(tmp_path, _backends(faults={"base-0-64-0": "transient"}), max_attempts=2)
    compact(tmp_path)
    raw = b"".join(p.read_bytes() for p in tmp_path.rglob("*.parquet"))
    records = read_records(tmp_path)
    for column in records.columns:
        values = [str(v) for v in records.get_column(column).to_list()]
        assert not any("vault code" in v for v in values), column
    assert b"vault code" not in raw and "vault code" not in caplog.text
    assert "transient failure on baseline layout base-0-64-0" in caplog.text


def test_progress_line_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, _backends(), job_list=jobs(cases=1), progress=True)
    err = capsys.readouterr().err
    assert "depthgate: 36/36 (100%)" in err and "ETA" in err and "/s" in err
    assert "vault" not in err


def test_compact_refuses_while_a_run_holds_the_folder(tmp_path: Path) -> None:
    _run(tmp_path, _backends(), job_list=jobs(cases=1))
    with DirLock(tmp_path), pytest.raises(InfraError, match="another depthgate process"):
        compact(tmp_path)


# --------------------------------------------------------------------------------------------------
# crash and resume: a subprocess, a real HTTP server, SIGKILL


class _SlowCompletions(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    delay_s = 0.08
    lock = threading.Lock()
    requests = 0

    def _reply(self, payload: Any) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client was killed mid-request

    def do_GET(self) -> None:
        self._reply({"object": "list", "data": [{"id": "stub", "max_model_len": 4096}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with _SlowCompletions.lock:
            _SlowCompletions.requests += 1
        time.sleep(self.delay_s)
        ids = body["prompt"]
        self._reply(
            {
                "model": "stub",
                "choices": [
                    {"index": 0, "text": f" {body['seed']}", "finish_reason": "stop", "prompt_token_ids": ids}
                ],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
            }
        )

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def slow_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowCompletions)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


CHILD = textwrap.dedent(
    """
    import json, sys
    from depthgate.run.backends.http import OpenAICompletionsBackend
    from depthgate.spec.system import DecodeParams
    from depthgate.run.options import RunOptions
    from depthgate.run.runner import run_pairs

    def make_jobs():
        out = []
        for arm in ("baseline", "candidate"):
            for case in range(10):
                for position in ("0.0", "0.5", "1.0"):
                    ids = list(range(16 + case))
                    row = {"layout_id": f"{arm}-{case}-{position}", "case_id": f"c{case}",
                           "target_tokens": len(ids), "position": position, "token_ids": ids,
                           "text": None, "status": "ok"}
                    out.append((arm, row))
        return out

    if __name__ == "__main__":
        url, out_dir = sys.argv[1], sys.argv[2]
        backends = {arm: OpenAICompletionsBackend("stub", base_url=url, name=arm, vllm=True)
                    for arm in ("baseline", "candidate")}
        options = RunOptions(run_id="crash", manifest_digest="c" * 64,
                             decode=DecodeParams(max_tokens=1, seeds=[0, 1]), concurrency=4,
                             seeds=[0, 1], progress=False, batch_size=3, flush_seconds=0.3)
        summary = run_pairs(make_jobs(), backends, out_dir, options)
        print(json.dumps({"total": summary.total, "already_done": summary.already_done,
                          "written": summary.written, "complete": summary.complete}))
    """
)


def test_sigkill_mid_run_then_resume_loses_and_duplicates_nothing(slow_server: str, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(PYTHON_DIR)}
    namespace: dict[str, Any] = {}
    exec(CHILD.replace('if __name__ == "__main__":', "if False:"), namespace)
    expected = {(arm, row["layout_id"], seed) for arm, row in namespace["make_jobs"]() for seed in (0, 1)}
    assert len(expected) == 120

    child = subprocess.Popen([sys.executable, str(script), slow_server, str(out_dir)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list((out_dir / "records").glob("part-*.parquet"))) < 4:
            assert child.poll() is None, "the run finished before it could be killed; slow the stub down"
            assert time.monotonic() < deadline, "no records were written"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    before = read_records(out_dir, dedup=False)
    keys_before = set(before.select(["arm", "layout_id", "seed"]).iter_rows())
    assert 4 <= len(before) < 120 and len(keys_before) == len(before)

    resumed = subprocess.run(
        [sys.executable, str(script), slow_server, str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary == {
        "total": 120,
        "already_done": len(before),
        "written": 120 - len(before),
        "complete": True,
    }

    raw = read_records(out_dir, dedup=False)
    counts = Counter(raw.select(["arm", "layout_id", "seed"]).iter_rows())
    assert set(counts) == expected  # nothing lost
    assert max(counts.values()) == 1  # nothing duplicated, even before compaction
    assert keys_before <= set(counts)  # every record written before the kill is kept
    assert set(raw.get_column("status")) == {"ok"}
    assert not list((out_dir / "records").glob(".*.tmp"))  # no temp file of a killed writer left
    merged = pl.read_parquet(compact(out_dir))
    assert len(merged) == 120
    assert merged.select(["arm", "layout_id", "seed"]).is_duplicated().sum() == 0
    assert (merged.get_column("output_text") == " " + merged.get_column("seed").cast(pl.String)).all()


# --------------------------------------------------------------------------------------------------
# the real embedded backend through the adapter


@pytest.mark.smoke_model
def test_embedded_llamacpp_adapter_runs_two_layouts(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf
    from depthgate.run.backends import make_backend
    from depthgate.run.backends.base import EmbeddedBackendAdapter
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.spec.system import System

    tokenizer = tokenizer_from_gguf(gemma_default_gguf())
    facts = [("vault 7", "4821"), ("locker 12", "3967"), ("archive " + "and archive " * 150, "1111")]
    rows: list[tuple[str, dict[str, Any]]] = []
    for index, (thing, code) in enumerate(facts):
        text = (
            f"Security notes.\nThe access code for {thing} is {code}. Printed copies may be out of date.\n\n"
            f"Question: What is the access code for {thing}?\nAnswer: The access code for {thing} is"
        )
        ids = tokenizer.encode(text, add_special_tokens=True).ids
        for arm in ARMS:
            row = {
                "layout_id": f"{arm}-{index}",
                "case_id": f"case{index}",
                "target_tokens": len(ids),
                "position": "0.0",
                "token_ids": ids,
                "text": text,
                "status": "ok",
            }
            rows.append((arm, row))
    system = System(name="gemma-a", backend="llamacpp", model="gemma3-270m", tokenizer="gguf:", window=256)
    baseline = make_backend(system)  # the factory's embedded path: packaged GGUF, n_ctx = window
    assert isinstance(baseline, EmbeddedBackendAdapter) and baseline.window == 256
    llama: EmbeddedLlamaBackend = baseline.backend
    backends = {
        "baseline": baseline,
        "candidate": EmbeddedBackendAdapter(llama, name="gemma-b", owns=False),
    }
    try:
        summary = run_pairs(
            rows,
            backends,
            tmp_path,
            RunOptions(
                run_id="embedded",
                manifest_digest="e" * 64,
                decode=DecodeParams(max_tokens=6),
                concurrency=2,
                seeds=[0],
                progress=False,
            ),
        )
    finally:
        for backend in (backends["candidate"], baseline):  # the baseline adapter owns the model
            asyncio.run(backend.aclose())
    records = read_records(tmp_path)
    assert summary.ok == 4 and summary.system_fail == 2 and summary.complete
    overflow = records.filter(pl.col("case_id") == "case2")
    assert set(overflow.get_column("system_fail_reason")) == {"overflow"}  # > n_ctx 256: refused, not cut
    records = records.filter(pl.col("status") == "ok")
    assert (records.get_column("prompt_tokens_server") == records.get_column("prompt_tokens_local")).all()
    assert set(records.get_column("finish_reason")) <= {"stop", "length", "eos"}
    for index, (_, code) in enumerate(facts[:2]):
        answers = records.filter(pl.col("case_id") == f"case{index}").get_column("output_text").to_list()
        assert answers[0] == answers[1]  # A/A: the same greedy answer on both arms
        assert code in answers[0]


def test_progress_lines_reach_a_ci_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a terminal (a CI log): one line per 5 % of the jobs or per minute, with done/total, rate,
    ETA, outcome counts and transient errors per endpoint; the default (progress=None) is on."""
    import io

    from depthgate.run.progress import Progress

    stream = io.StringIO()
    meter = Progress(100, True, stream)
    meter.error("http://127.0.0.1:8000")
    for _ in range(100):
        meter.tick("ok")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 20 and lines[0].startswith("depthgate: 5/100 (5%)")
    assert lines[-1].startswith("depthgate: 100/100 (100%)") and "ETA" in lines[-1]
    assert "ok 100 system_fail 0 infra_error 0" in lines[-1]
    assert "transient errors: http://127.0.0.1:8000 1" in lines[-1]

    _run(tmp_path, _backends(), progress=None)
    err = capsys.readouterr().err
    assert "depthgate: 108/108 (100%)" in err and err.count("\n") >= 20  # printed without a terminal

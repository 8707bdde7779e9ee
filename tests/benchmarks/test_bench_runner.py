"""Benchmark: runner overhead at 64 and 512 requests in flight (DESIGN.md §10, target ≤ 5 % of wall time).

Opt-in (``-m bench``). A tiny OpenAI-compatible ``/v1/completions`` **stub** server runs in a **separate
process** on 127.0.0.1 (raw asyncio, HTTP/1.1 keep-alive, vLLM's response shape: ``usage.prompt_tokens`` =
``len(prompt)``, the prompt ids echoed for ``return_token_ids``; it echoes the prompt's bytes without
parsing them, so that a 128K-id prompt costs the server little); it answers after a fixed delay
(``DEPTHGATE_BENCH_DELAYS_MS``, default ``50,0``). Against it, in this process, these clients send the same
jobs with the same concurrency (``DEPTHGATE_BENCH_CLIENTS`` picks some, by the first word of the name):

* ``noop run_pairs``: the full runner over a no-op backend that sleeps the delay and answers (the
  runner's own cost, no HTTP),
* ``raw asyncio``: keep-alive sockets, hand-written HTTP/1.1, stdlib ``json`` both ways (the floor of any
  Python client), and ``raw+orjson``: the same with orjson (the floor with the shipped JSON codec),
* ``httpx loop``: a bare ``httpx.AsyncClient`` loop, one client per arm (the earlier client's floor),
* ``backend/aiohttp``, ``backend/httpx``: :meth:`OpenAICompletionsBackend.generate` under a semaphore,
  with the shipped client and with the earlier one (``HTTPOptions(client="httpx")``),
* ``run_pairs/aiohttp`` (the shipped path), ``run_pairs/httpx``: the full runner (pairing, order,
  records, parquet shards with fsync).

Measured per client: wall time, this process's CPU time (``time.process_time``: every thread of the
harness, polars' included) and the server's CPU time (reported by the server itself). Harness share =
harness CPU / wall; CPU per request = harness CPU / requests; projected share = CPU per request ×
concurrency / delay (the harness's CPU demand at the backend-bound request rate, independent of other
load on the machine); latency for 5 % = CPU per request × concurrency / 0.05 (the backend latency at
which the harness stays under 5 % of wall). Of ``DEPTHGATE_BENCH_REPEATS`` runs the one with the least
harness CPU is kept. No assertion on timings unless ``DEPTHGATE_BENCH_STRICT=1``.

``test_json_codec_on_128k_prompts`` times the JSON encoding of a 128K-id ``/v1/completions`` body and
the decoding of its echo, stdlib ``json`` against orjson.

Knobs: ``DEPTHGATE_BENCH_JOBS`` (default 2000), ``DEPTHGATE_BENCH_CONCURRENCY`` (64),
``DEPTHGATE_BENCH_TOKENS`` (1024), ``DEPTHGATE_BENCH_REPEATS`` (3), ``DEPTHGATE_BENCH_CLIENTS`` (all),
``DEPTHGATE_BENCH_OUT`` (also write the table and JSON there), ``DEPTHGATE_BENCH_PROFILE=1`` (profile the
last repeat of each client but the floors with pyinstrument, if installed, and write the text profiles
there).

Run: ``.venv/bin/python -m pytest -m bench tests/benchmarks/test_bench_runner.py -q -s``
or   ``.venv/bin/python tests/benchmarks/test_bench_runner.py`` (prints the table).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import stub_server

pytestmark = pytest.mark.bench

TARGET_SHARE = 0.05
SERVER_LIFETIME_S = 900.0  # the stub stops by itself after this, whatever happens to the parent

# --------------------------------------------------------------------------------------------------
# the stub server (its own process; loopback only)


class StubServer(stub_server.StubServer):
    """The stub in a child process (tests/benchmarks/stub_server.py); ``url``; ``stats()``: requests,
    connections and server CPU seconds."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s, SERVER_LIFETIME_S)


# --------------------------------------------------------------------------------------------------
# workload


@dataclass(frozen=True)
class Config:
    jobs: int
    concurrency: int
    tokens: int
    repeats: int


def config_from_env() -> Config:
    env = os.environ.get
    return Config(
        jobs=int(env("DEPTHGATE_BENCH_JOBS", "2000")),
        concurrency=int(env("DEPTHGATE_BENCH_CONCURRENCY", "64")),
        tokens=int(env("DEPTHGATE_BENCH_TOKENS", "1024")),
        repeats=max(1, int(env("DEPTHGATE_BENCH_REPEATS", "3"))),
    )


def delays_from_env() -> list[float]:
    raw = os.environ.get("DEPTHGATE_BENCH_DELAYS_MS", "50,0")
    return [float(v) / 1000.0 for v in raw.split(",") if v.strip()]


def make_jobs(n_jobs: int, tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """``n_jobs`` paired layout rows (two arms, five positions, one length) of ``tokens`` random ids
    (a vocabulary of 256K, as the rows from ``read_layouts(...).iter_rows(named=True)`` look), the arms
    alternating as in the runner's interleaved order. At most 2M ids are distinct: rows beyond that share
    a prompt list (at 128K tokens, 512 distinct prompts would hold 2.4 GB of Python ints)."""
    import numpy as np

    rng = np.random.default_rng(0)
    distinct = max(1, min(n_jobs, 2_000_000 // max(tokens, 1)))
    prompts = [rng.integers(0, 256_000, size=tokens).tolist() for _ in range(distinct)]
    positions = ("0.0", "0.25", "0.5", "0.75", "1.0")
    rows: list[tuple[str, dict[str, Any]]] = []
    for index in range(n_jobs // 2):
        case, position = divmod(index, len(positions))
        for arm in ("baseline", "candidate"):
            rows.append(
                (
                    arm,
                    {
                        "layout_id": f"{arm[:4]}-{case:05d}-{positions[position]}",
                        "case_id": f"case-{case:05d}",
                        "target_tokens": tokens,
                        "position": positions[position],
                        "token_ids": prompts[len(rows) % distinct],
                        "text": None,
                        "status": "ok",
                        "reason_code": None,
                    },
                )
            )
    return rows


# --------------------------------------------------------------------------------------------------
# the clients

Jobs = list[tuple[str, dict[str, Any]]]


def _completion_body(row: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` body the harness's vLLM backend sends for one layout."""
    return {
        "model": "stub",
        "prompt": row["token_ids"],
        "max_tokens": 12,
        "temperature": 0.0,
        "seed": 0,
        "stream": False,
        "stop": ["\n"],
        "return_token_ids": True,
    }


def _raw_asyncio(
    server: StubServer, jobs: Jobs, cfg: Config, dumps: Callable[[Any], bytes], loads: Callable[[bytes], Any]
) -> int:
    """The floor: ``concurrency`` keep-alive connections, hand-written HTTP/1.1, ``dumps``/``loads``."""
    host, port = server.url.rsplit("//", 1)[1].split(":")

    async def main() -> int:
        queue = list(reversed(jobs))
        ok = 0

        async def worker() -> None:
            nonlocal ok
            reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 24)
            try:
                while queue:
                    _, row = queue.pop()
                    body = dumps(_completion_body(row))
                    writer.write(
                        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % (host.encode(), len(body)) + body
                    )
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    )
                    answer = loads(await reader.readexactly(length))
                    ids = answer["choices"][0]["prompt_token_ids"]
                    ok += int(
                        answer["usage"]["prompt_tokens"] == len(row["token_ids"]) and ids == row["token_ids"]
                    )
            finally:
                writer.close()
                await writer.wait_closed()

        await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, len(jobs)))))
        return ok

    return asyncio.run(main())


def run_raw_json(server: StubServer, jobs: Jobs, cfg: Config, out: Path) -> int:
    return _raw_asyncio(server, jobs, cfg, lambda o: json.dumps(o).encode(), json.loads)


def run_raw_orjson(server: StubServer, jobs: Jobs, cfg: Config, out: Path) -> int:
    import orjson

    return _raw_asyncio(server, jobs, cfg, orjson.dumps, orjson.loads)


async def _send_all(
    jobs: Jobs, one: Callable[[str, Mapping[str, Any]], Awaitable[int]], clients: Iterable[Any]
) -> int:
    """Every job through ``one`` at once (``one`` holds the concurrency limit); how many were accepted.
    Closes ``clients`` at the end."""
    try:
        return sum(await asyncio.gather(*(one(arm, row) for arm, row in jobs)))
    finally:
        for client in clients:
            await client.aclose()


def run_httpx_loop(server: StubServer, jobs: Jobs, cfg: Config, out: Path) -> int:
    """One ``httpx.AsyncClient`` per arm (as the harness has one backend, so one pool, per arm)."""
    import httpx

    async def main() -> int:
        sem = asyncio.Semaphore(cfg.concurrency)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        timeout = httpx.Timeout(300.0, connect=10.0)
        clients = {
            arm: httpx.AsyncClient(timeout=timeout, limits=limits) for arm in ("baseline", "candidate")
        }

        async def one(arm: str, row: Mapping[str, Any]) -> int:
            async with sem:
                response = await clients[arm].post(f"{server.url}/v1/completions", json=_completion_body(row))
                body = response.json()
                return int(body["usage"]["prompt_tokens"] == len(row["token_ids"]))

        return await _send_all(jobs, one, clients.values())

    return asyncio.run(main())


class NoopBackend:
    """Answers every request after the stub's delay, with the counts the runner checks: the runner's own
    cost without any HTTP."""

    accepts_token_ids = True
    count_tolerance = 0.0
    window = None

    def __init__(self, name: str, delay_s: float) -> None:
        self.name, self.delay_s = name, delay_s

    async def generate(self, request: Any) -> Any:
        from depthgate.run.backends.base import Response

        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        n = len(request.token_ids)
        return Response(" 42", "stop", n, 2, server_prompt_ids_match=True)

    async def aclose(self) -> None:
        pass


def _backends(server: StubServer, client: str) -> dict[str, Any]:
    from depthgate.run.backends.http import HTTPOptions, OpenAICompletionsBackend

    if client == "noop":
        return {arm: NoopBackend(f"sys-{arm}", server.delay_s) for arm in ("baseline", "candidate")}
    options = HTTPOptions(client="httpx" if client == "httpx" else "aiohttp")
    return {
        arm: OpenAICompletionsBackend(
            "stub", base_url=server.url, name=f"sys-{arm}", vllm=True, options=options
        )
        for arm in ("baseline", "candidate")
    }


def run_backend_only(client: str) -> Callable[[StubServer, Jobs, Config, Path], int]:
    def run(server: StubServer, jobs: Jobs, cfg: Config, out: Path) -> int:
        from depthgate.run.backends.base import Request

        async def main() -> int:
            backends = _backends(server, client)
            sem = asyncio.Semaphore(cfg.concurrency)

            async def one(arm: str, row: Mapping[str, Any]) -> int:
                async with sem:
                    request = Request(
                        layout_id=row["layout_id"], arm=arm, seed=0, token_ids=row["token_ids"], text=None,
                        max_tokens=12,
                    )  # fmt: skip
                    response = await backends[arm].generate(request)
                    return int(
                        response.server_prompt_ids_match
                        and response.prompt_tokens_server == len(row["token_ids"])
                    )

            return await _send_all(jobs, one, backends.values())

        return asyncio.run(main())

    return run


def run_runner(client: str) -> Callable[[StubServer, Jobs, Config, Path], int]:
    def run(server: StubServer, jobs: Jobs, cfg: Config, out: Path) -> int:
        from depthgate.run.options import RunOptions
        from depthgate.run.runner import run_pairs
        from depthgate.spec.system import DecodeParams

        backends = _backends(server, client)
        try:
            summary = run_pairs(
                jobs,
                backends,
                out,
                RunOptions(
                    concurrency=cfg.concurrency,
                    seeds=[0],
                    decode=DecodeParams(max_tokens=12, seeds=[0]),
                    run_id="bench",
                    manifest_digest="b" * 64,
                    progress=False,
                ),
            )
        finally:
            for backend in backends.values():
                asyncio.run(backend.aclose())
        return summary.ok

    return run


CLIENTS: dict[str, Callable[[StubServer, Jobs, Config, Path], int]] = {
    "noop run_pairs (no HTTP)": run_runner("noop"),
    "raw asyncio, stdlib json (floor)": run_raw_json,
    "raw+orjson asyncio (floor, shipped codec)": run_raw_orjson,
    "httpx loop (earlier client's floor)": run_httpx_loop,
    "backend/httpx (earlier)": run_backend_only("httpx"),
    "backend/aiohttp (shipped)": run_backend_only("aiohttp"),
    "run_pairs/httpx (earlier)": run_runner("httpx"),
    "run_pairs/aiohttp (shipped)": run_runner("aiohttp"),
}


def clients_from_env() -> list[str]:
    raw = os.environ.get("DEPTHGATE_BENCH_CLIENTS", "")
    chosen = [c.strip() for c in raw.split(",") if c.strip()]
    if not chosen:
        return list(CLIENTS)
    names = [name for name in CLIENTS if name.split()[0] in chosen]
    unknown = set(chosen) - {name.split()[0] for name in CLIENTS}
    if unknown:
        raise ValueError(
            f"unknown DEPTHGATE_BENCH_CLIENTS {sorted(unknown)} (first words of {list(CLIENTS)})"
        )
    return names


def _is_floor(client: str) -> bool:
    return "(floor" in client


# --------------------------------------------------------------------------------------------------
# measurement


@dataclass
class Row:
    delay_ms: float
    concurrency: int
    tokens: int
    client: str
    requests: int
    ok: int
    wall_s: float
    harness_cpu_s: float
    server_cpu_s: float
    connections: int

    @property
    def share(self) -> float:
        return self.harness_cpu_s / self.wall_s

    @property
    def cpu_per_request_us(self) -> float:
        return 1e6 * self.harness_cpu_s / max(self.requests, 1)

    @property
    def latency_for_target_s(self) -> float:
        """The backend latency at which this CPU per request is ≤ 5 % of wall at this concurrency."""
        return self.cpu_per_request_us * 1e-6 * self.concurrency / TARGET_SHARE


def measure(
    client: str,
    server: StubServer,
    jobs: Jobs,
    cfg: Config,
    workdir: Path,
    profile_to: Path | None = None,
) -> Row:
    best: Row | None = None
    for attempt in range(cfg.repeats):
        out = workdir / f"{client.split()[0].replace('/', '-')}-{server.delay_s * 1000:g}ms-{attempt}"
        before = server.stats()
        profiler = None
        if profile_to is not None and attempt == cfg.repeats - 1:
            try:
                from pyinstrument import Profiler

                profiler = Profiler(interval=0.0005, async_mode="disabled")
            except ImportError:
                profiler = None
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.start()
        ok = CLIENTS[client](server, jobs, cfg, out)
        if profiler is not None:
            profiler.stop()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        after = server.stats()
        if profiler is not None and profile_to is not None:
            profile_to.write_text(profiler.output_text(unicode=True, color=False), encoding="utf-8")
        requests = after["requests"] - before["requests"]
        if client.startswith("noop"):
            requests = ok  # no HTTP: the runner's records
        row = Row(
            server.delay_s * 1000,
            cfg.concurrency,
            cfg.tokens,
            client,
            requests,
            ok,
            wall,
            cpu,
            after["cpu_s"] - before["cpu_s"],
            after["connections"] - before["connections"],
        )
        if best is None or row.harness_cpu_s < best.harness_cpu_s:
            best = row
    assert best is not None
    return best


def markdown(rows: list[Row], cfg: Config, load: tuple[float, float]) -> str:
    head = (
        "| backend delay | client | wall s | ideal wall s | harness CPU s | harness CPU / wall "
        "| CPU µs / request | × httpx-loop CPU | projected share | 5 % holds at latency ≥ "
        "| server CPU / wall |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    base = {r.delay_ms: r for r in rows if r.client.startswith("httpx loop")}
    for r in rows:
        ideal = math.ceil(r.requests / cfg.concurrency) * r.delay_ms / 1000
        ratio = r.harness_cpu_s / base[r.delay_ms].harness_cpu_s if r.delay_ms in base else float("nan")
        projected = (
            f"{100 * r.cpu_per_request_us * 1e-6 * cfg.concurrency / (r.delay_ms / 1000):.0f} %"
            if r.delay_ms > 0
            else "–"
        )
        name = f"**{r.client}**" if "shipped" in r.client and r.client.startswith("run_pairs") else r.client
        lines.append(
            f"| {r.delay_ms:g} ms | {name} | {r.wall_s:.2f} | {ideal:.2f} | {r.harness_cpu_s:.2f} | "
            f"{100 * r.share:.1f} % | {r.cpu_per_request_us:,.0f} | {ratio:.2f} | {projected} | "
            f"{r.latency_for_target_s:.2f} s | {100 * r.server_cpu_s / r.wall_s:.1f} % |"
        )
    notes = [
        "",
        f"{cfg.jobs} requests per client and delay (2 arms × {cfg.jobs // 2} layouts × 1 seed), "
        f"{cfg.tokens}-token prompts sent as token ids with vLLM's echoed ids, {cfg.concurrency} in flight; "
        f"stub server in its own process on 127.0.0.1; least-CPU of {cfg.repeats} run(s); load average "
        f"{load[0]:.1f} → {load[1]:.1f} on {os.cpu_count()} CPUs.",
    ]
    return head + "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


def run_benchmark(
    workdir: Path,
    cfg: Config | None = None,
    delays: list[float] | None = None,
    profile_dir: Path | None = None,
) -> tuple[list[Row], str]:
    cfg = cfg or config_from_env()
    delays = delays if delays is not None else delays_from_env()
    chosen = clients_from_env()
    jobs = make_jobs(cfg.jobs, cfg.tokens)
    warm_jobs = jobs[: min(2 * cfg.concurrency, 256, len(jobs))]  # whole pairs: the arms alternate
    load0 = os.getloadavg()[0]
    rows: list[Row] = []
    for index, delay in enumerate(delays):
        server = StubServer(delay)
        try:
            for client in chosen:  # warm-up: imports, caches
                name = client.split()[0].replace("/", "-")
                CLIENTS[client](server, warm_jobs, cfg, workdir / f"warm-{index}-{name}")
            for client in chosen:
                profile_to = None
                if profile_dir is not None and not _is_floor(client):
                    name = client.split()[0].replace("/", "-")
                    profile_to = (
                        profile_dir / f"profile-{name}-{cfg.concurrency}x{cfg.tokens}-{delay * 1000:g}ms.txt"
                    )
                rows.append(measure(client, server, jobs, cfg, workdir, profile_to))
        finally:
            server.close()
    return rows, markdown(rows, cfg, (load0, os.getloadavg()[0]))


def _emit(table: str, rows: list[Row], name: str = "bench_runner") -> None:
    target = os.environ.get("DEPTHGATE_BENCH_OUT")
    if target:
        out = Path(target)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.md").write_text(table, encoding="utf-8")
        (out / f"{name}.json").write_text(
            json.dumps(
                [{**asdict(r), "share": r.share, "cpu_per_request_us": r.cpu_per_request_us} for r in rows],
                indent=2,
            ),
            encoding="utf-8",
        )


def json_codec_table(tokens: int = 131_072, repeats: int = 20) -> str:
    """Milliseconds per 128K-id ``/v1/completions`` body, encoded and its echo decoded, stdlib ``json``
    against orjson (best of ``repeats``; the id lists as a polars row gives them: Python ints)."""
    import numpy as np
    import orjson

    ids = np.random.default_rng(1).integers(0, 256_000, size=tokens).tolist()
    body = {"model": "stub", "prompt": ids, "max_tokens": 12, "temperature": 0.0, "seed": 0,
            "stream": False, "stop": ["\n"], "return_token_ids": True}  # fmt: skip
    echo = json.dumps({"choices": [{"text": " 42", "prompt_token_ids": ids}], "usage": {}}).encode()

    def best(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    assert orjson.loads(orjson.dumps(body)) == json.loads(json.dumps(body))
    timings = {
        "encode the request body": (lambda: json.dumps(body).encode(), lambda: orjson.dumps(body)),
        "decode the echo": (lambda: json.loads(echo), lambda: orjson.loads(echo)),
        "decode the echo + compare with the ids sent": (
            lambda: json.loads(echo)["choices"][0]["prompt_token_ids"] == ids,
            lambda: orjson.loads(echo)["choices"][0]["prompt_token_ids"] == ids,
        ),
    }
    lines = [f"| {tokens:,}-id prompt | stdlib json ms | orjson ms | × |", "|---|---:|---:|---:|"]
    for what, (stdlib, fast) in timings.items():
        slow_ms, fast_ms = best(stdlib), best(fast)
        lines.append(f"| {what} | {slow_ms:.2f} | {fast_ms:.2f} | {slow_ms / fast_ms:.1f} |")
    sizes = f"{len(orjson.dumps(body)):,} bytes (orjson) / {len(json.dumps(body)):,} (json)"
    lines += ["", f"Body {sizes}; best of {repeats}."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# the tests


def test_runner_overhead(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config_from_env()
    profile_dir = None
    if os.environ.get("DEPTHGATE_BENCH_PROFILE") == "1":
        profile_dir = Path(os.environ.get("DEPTHGATE_BENCH_OUT") or tmp_path)
        profile_dir.mkdir(parents=True, exist_ok=True)
    rows, table = run_benchmark(tmp_path, cfg, profile_dir=profile_dir)
    _emit(table, rows, f"bench_runner_{cfg.concurrency}x{cfg.tokens}")
    with capsys.disabled():
        print("\n\n" + table)
    for row in rows:  # correctness, not timing: every request answered and accepted
        assert row.requests == cfg.jobs, row
        assert row.ok == cfg.jobs, row
    if os.environ.get("DEPTHGATE_BENCH_STRICT") == "1":
        for row in rows:
            if row.client.startswith("run_pairs") and "shipped" in row.client and row.delay_ms > 0:
                assert row.share <= TARGET_SHARE, f"harness share {row.share:.1%} > 5 % at {row.delay_ms} ms"


def test_json_codec_on_128k_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    table = json_codec_table()
    target = os.environ.get("DEPTHGATE_BENCH_OUT")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        (Path(target) / "bench_json_codec.md").write_text(table, encoding="utf-8")
    with capsys.disabled():
        print("\n\n" + table)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="depthgate-bench-") as tmp:
        profile = (
            Path(os.environ["DEPTHGATE_BENCH_OUT"])
            if os.environ.get("DEPTHGATE_BENCH_PROFILE") == "1" and os.environ.get("DEPTHGATE_BENCH_OUT")
            else None
        )
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
        result_rows, result_table = run_benchmark(Path(tmp), profile_dir=profile)
        _emit(result_table, result_rows)
        print(result_table)

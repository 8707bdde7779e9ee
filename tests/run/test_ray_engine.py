"""``depthgate run --engine ray`` (issue #12 item 4): Ray Data over the same jobs, backends and record sink.

Real parts: Ray 2.60 started locally by the CLI (2 CPUs, actors at ``num_cpus=0.5``), the embedded
Gemma-3-270M (llama.cpp in process, one engine per actor), the real CLI in a subprocess for the kill.
Greedy decoding, so both engines must give the same outputs and the same verdict.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.run import records as records_module
from depthgate.run.records import FINAL_STATUSES, RECORD_KEY, read_records
from helpers import free_port, read_verdict, sigkill_when, small_smoke_matrix

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'depthgate[ray]')")

REPO = Path(__file__).resolve().parents[2]
# What must be identical between engines (test_shards.py compares the same keys; timestamps differ).
SAME = ("slices", "digests", "plan", "overall", "worst_by_length", "worst_cases", "worst_shares", "verdict")
VERDICTS = (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE)
SHORT = 'preamble = "Read the excerpt below and answer the question."'
TOTAL = 2 * 2 * 1 * 2  # jobs: cases × depths × lengths × arms (one seed)


def _matrix(folder: Path, cases: int = 2) -> Path:
    path = folder / "small.toml"
    path.write_text(small_smoke_matrix(cases=cases, lengths="[480]", preamble=SHORT), encoding="utf-8")
    return path


def _outputs(run: Path) -> dict[tuple[str, str, int], tuple[str, str | None, str | None]]:
    records = read_records(run)
    return {
        (a, lid, int(s)): (st, text, reason)
        for a, lid, s, st, text, reason in records.select(
            *RECORD_KEY, "status", "output_text", "system_fail_reason"
        ).iter_rows()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, int]]:
    """One undisturbed asyncio run of the small matrix (2 cases × 2 depths × 1 length × 2 arms, with
    controls): the matrix, its run folder and its exit code."""
    folder = tmp_path_factory.mktemp("ray-reference")
    matrix = _matrix(folder, cases=2)
    out = folder / "asyncio"
    code = main(["run", str(matrix), "--out", str(out)])
    assert code in VERDICTS
    yield matrix, out, code


def test_missing_ray_is_refused_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without Ray installed (``import ray`` fails as it does then) the run is refused before anything
    is built or sent: exit 20, the extra named, no run folder left."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "run"
    assert main(["run", str(_matrix(tmp_path)), "--out", str(out), "--engine", "ray"]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "depthgate[ray]" in err and "--engine" in err
    assert not out.exists()


def test_unsupported_settings_are_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = _matrix(tmp_path)
    text = matrix.read_text(encoding="utf-8")
    cached = tmp_path / "cached.toml"
    # The baseline's table gets a runtime block asking for the prefix-cache control.
    cached.write_text(
        text.replace('name = "gemma-base"', 'name = "gemma-base"\nruntime = { cache_control = true }'),
        encoding="utf-8",
    )
    out = tmp_path / "run"
    assert main(["run", str(cached), "--out", str(out), "--engine", "ray"]) == ExitCode.BAD_INPUT
    assert "baseline.runtime.cache_control" in capsys.readouterr().err
    assert not out.exists()
    # --ray-actors belongs to the Ray engine.
    assert main(["run", str(matrix), "--out", str(out), "--ray-actors", "2"]) == ExitCode.BAD_INPUT
    assert "--ray-actors" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.smoke_model
def test_ray_engine_gives_the_asyncio_verdict(tmp_path: Path, reference: tuple[Path, Path, int]) -> None:
    """The same matrix under --engine ray: the same records (status, output, reason per job key), the
    same verdict (slices with their bounds, digests, plan, worst cases, controls)."""
    matrix, asyncio_run, asyncio_code = reference
    out = tmp_path / "ray"
    # One actor: its llama.cpp engine keeps the asyncio engine's 2 threads, which fill the 2 cores here
    # (the HTTP test below runs 2 actors).
    argv = ["run", str(matrix), "--out", str(out), "--engine", "ray", "--ray-actors", "1"]
    assert main(argv) == asyncio_code
    ray_out, ref_out = _outputs(out), _outputs(asyncio_run)
    assert len(ref_out) == TOTAL
    assert ray_out == ref_out
    assert _outputs(out / "controls") == _outputs(asyncio_run / "controls")
    mine, theirs = read_verdict(out), read_verdict(asyncio_run)
    for key in SAME:
        assert mine[key] == theirs[key], key
    assert mine["controls"]["counts"] == theirs["controls"]["counts"]
    # Only the driver writes: the records carry the run's id and the arms' system names, as asyncio's.
    records = read_records(out)
    assert set(records["system"].to_list()) == {"gemma-base", "gemma-preamble"}
    assert set(records["endpoint"].to_list()) == {"in-process:gemma-base", "in-process:gemma-preamble"}


def test_http_arms_on_ray_actors_give_the_asyncio_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HTTP arms (``/v1/completions`` with token ids) sent from the Ray actors: the perfect-reader
    **stub** of tests/cli/test_verdict_trust.py on 127.0.0.1 (a vLLM-shaped stub server reading the prompt
    with the real GPT-2 tokenizer). Same verdict as the asyncio engine, and the server answered exactly
    as many requests from each engine (nothing sent twice). The server answers the Ray run's first two
    requests with HTTP 503: the actors retry them, and the progress line counts them per endpoint."""
    from test_verdict_trust import PerfectReader
    from test_verdict_trust import _matrix as stub_matrix_file

    port = free_port()
    matrix = stub_matrix_file(
        tmp_path, port, suite='{ kind = "builtin", cases = 6, seed = 0, language = "en" }'
    )
    with PerfectReader(port) as reader:
        code = main(["run", str(matrix), "--out", str(tmp_path / "asyncio")])
        sent_asyncio = reader.requests
        reader.fail_next = 2
        capsys.readouterr()
        assert main(["run", str(matrix), "--out", str(tmp_path / "ray"), "--engine", "ray"]) == code
        sent_ray = reader.requests - sent_asyncio
    assert code in VERDICTS and sent_ray == sent_asyncio > 0 and reader.fail_next == 0
    # The matrix run's last progress line (the controls' run follows it, with no failure).
    matrix_run = capsys.readouterr().err.split("engine ray:")[1]
    final = [line for line in matrix_run.splitlines() if " ETA " in line][-1]
    assert final.endswith(f"transient errors: http://127.0.0.1:{port} 2"), final
    assert _outputs(tmp_path / "ray") == _outputs(tmp_path / "asyncio")
    mine, theirs = read_verdict(tmp_path / "ray"), read_verdict(tmp_path / "asyncio")
    for key in SAME:
        assert mine[key] == theirs[key], key
    endpoints = set(read_records(tmp_path / "ray")["endpoint"].to_list())
    assert endpoints == {f"http://127.0.0.1:{port}"}


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc: the Ray processes the CLI started)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.smoke_model
@pytest.mark.parametrize("resume_engine", ["asyncio"])
def test_killed_ray_run_resumes_with_nothing_lost_or_doubled(
    tmp_path: Path, reference: tuple[Path, Path, int], resume_engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL the CLI of a Ray run once it has written records, before it finished; `depthgate run`
    on the same folder (the asyncio engine) sends only the rest: one final record per job, none lost,
    none doubled, the undisturbed run's verdict. The Ray processes die with their driver."""
    matrix, asyncio_run, asyncio_code = reference
    out = tmp_path / "ray-killed"
    # One actor, one job per actor call: records reach the disk one by one, so the kill lands mid-run.
    env = {
        **os.environ,
        "DEPTHGATE_RAY_ACTORS": "1",
        "DEPTHGATE_RAY_BATCH_ROWS": "1",
        "PYTHONPATH": str(REPO / "python"),
    }
    argv = ["run", str(matrix), "--out", str(out), "--no-controls"]  # controls: the verdict test
    proc = subprocess.Popen(
        [sys.executable, "-m", "depthgate", *argv, "--engine", "ray"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    records_dir = out / "records"
    ray_pids: set[int] = set()

    def landed() -> bool:
        ray_pids.update(_descendants(proc.pid))
        return records_dir.is_dir() and any(records_dir.glob("part-*.parquet"))

    sigkill_when(proc, landed, 300)
    before = read_records(out, dedup=False)
    assert 0 < before.filter(pl.col("status").is_in(FINAL_STATUSES)).height < TOTAL  # killed mid-way

    # Ray's processes share the driver's fate: the actors (each holding a model) were gone within 10 s
    # of the SIGKILL here, Ray's idle dashboard and runtime-env agents within 30–100 s.
    gone = time.monotonic() + 240
    while time.monotonic() < gone and any(_alive(p) for p in ray_pids):
        time.sleep(0.5)
    assert not [p for p in ray_pids if _alive(p)], "Ray processes outlived the killed driver"

    # The run compacts its shards into one deduplicated records.parquet at the end; the raw records are
    # read just before that (the real compact then runs), so a job sent twice would show here.
    raw_seen: dict[Path, pl.DataFrame] = {}

    def compact_after_reading(folder: Path) -> Path:
        raw_seen[Path(folder)] = read_records(folder, dedup=False)
        return real_compact(folder)

    real_compact = records_module.compact
    monkeypatch.setattr(records_module, "compact", compact_after_reading)
    assert main([*argv, "--engine", resume_engine]) == asyncio_code
    raw = raw_seen[out].filter(pl.col("status").is_in(FINAL_STATUSES))
    per_key = raw.group_by(list(RECORD_KEY)).len()
    assert per_key.height == TOTAL and per_key["len"].max() == 1  # none lost, none doubled
    assert _outputs(out) == _outputs(asyncio_run)
    mine, theirs = read_verdict(out), read_verdict(asyncio_run)
    for key in SAME:
        assert mine[key] == theirs[key], key


def test_a_sequential_plan_runs_look_by_look_on_ray_as_on_asyncio(tmp_path: Path) -> None:
    """``stop_rule = "sequential"`` on Ray (issue #26): each look's jobs are one Ray Data run; the looks,
    the requests sent (fewer than planned: the planted regression is decided early) and the verdict are
    the asyncio engine's. The stub of tests/cli/test_sequential_runs.py on 127.0.0.1 (labelled there)."""
    from test_sequential_runs import KEY, DeepBlindReader, _keys
    from test_sequential_runs import _matrix as sequential_matrix

    port = free_port()
    matrix = sequential_matrix(tmp_path, port)
    argv = ["run", str(matrix), "--no-controls"]
    with DeepBlindReader(port) as reader:
        code = main([*argv, "--out", str(tmp_path / "asyncio")])
        sent, reader.requests = reader.requests, 0
        assert main([*argv, "--out", str(tmp_path / "ray"), "--engine", "ray"]) == code
        assert reader.requests == sent
    asyncio_doc, ray_doc = read_verdict(tmp_path / "asyncio"), read_verdict(tmp_path / "ray")
    assert sent == ray_doc["sequential"]["requests_sent"] < ray_doc["sequential"]["requests_planned"]
    for key in ("verdict", "slices", "sequential"):
        assert ray_doc[key] == asyncio_doc[key], key
    assert _keys(tmp_path / "ray").sort(KEY).equals(_keys(tmp_path / "asyncio").sort(KEY))

"""Issue #35: an embedded engine that dies mid-run is a named INFRA (exit 30), not a dead process.

Real model (Gemma-3-270M in llama.cpp's worker process), real signals: ``depthgate run`` on a small
matrix in a child process; once its progress line shows a few records, the baseline's engine worker is
sent SIGILL, SIGSEGV or SIGKILL — the deaths an illegal instruction, a kernel segfault and the OOM killer
give. The run must end with exit 30 and a report, name the signal and the request in flight, keep every
finished record; the same command on the same folder must then resume to the verdict of an uninterrupted
run, with nothing lost or duplicated.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from depthgate.exceptions import ExitCode
from helpers import REPO, read_verdict, small_smoke_matrix

pytestmark = pytest.mark.smoke_model

KEY = ["arm", "layout_id", "seed"]
WORKER_MODULE = "depthgate.run.backends.llamacpp_worker"


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "depthgate", *argv]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "python")}


def _workers_of(parent: int) -> list[int]:
    """The engine workers started by process ``parent``, oldest first (the baseline's is spawned first)."""
    found: list[tuple[int, int]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == parent and WORKER_MODULE.encode() in cmdline:
            found.append((int(stat[19]), int(entry.name)))  # start time, pid
    return [pid for _, pid in sorted(found)]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("matrix") / "tiny.toml"
    path.write_text(small_smoke_matrix(cases=3), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def whole(matrix: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """The uninterrupted run the resumed ones must equal."""
    out = tmp_path_factory.mktemp("whole") / "run"
    done = subprocess.run(
        _cli("run", str(matrix), "--no-controls", "--out", str(out)),
        env=_env(),
        cwd=REPO,
        capture_output=True,
    )
    assert done.returncode in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), done.stderr.decode()
    return done.returncode, out


def _answers(run: Path) -> pl.DataFrame:
    records = pl.read_parquet(run / "records.parquet")
    return records.select(*KEY, "status", "output_text").sort(KEY)


@pytest.mark.parametrize("sig", [signal.SIGILL, signal.SIGSEGV, signal.SIGKILL], ids=lambda s: s.name)
def test_a_worker_killed_mid_run_is_exit_30_then_the_rerun_resumes_to_the_same_verdict(
    sig: signal.Signals, matrix: Path, whole: tuple[int, Path], tmp_path: Path
) -> None:
    code, whole_run = whole
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _cli("run", str(matrix), "--no-controls", "--out", str(out)),
        env=_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    killed: int | None = None
    deadline = time.monotonic() + 600
    for line in proc.stderr:  # the progress line ticks once per record here (12 requests)
        lines.append(line)
        if killed is None and re.match(r"depthgate: [2-9]/\d+ ", line):
            workers = _workers_of(proc.pid)
            assert len(workers) == 2, (workers, "".join(lines))
            killed = workers[0]
            os.kill(killed, sig)
        assert time.monotonic() < deadline, "".join(lines)
    proc.wait(timeout=60)
    err = "".join(lines)
    assert killed is not None, err
    assert proc.returncode == ExitCode.INFRA, err
    assert f"pid {killed}) died by {sig.name}" in err, err
    assert "request in flight: layout " in err and "arm baseline" in err, err
    assert "circuit open on arm 'baseline', stopped sending: " in err, err
    assert "Traceback" not in err, err
    # the run wrote its reports and says INFRA, naming the crash
    verdict = read_verdict(out)
    assert verdict["verdict"] == "INFRA", verdict["verdict"]
    assert sig.name in (out / "report" / "summary.md").read_text(encoding="utf-8")
    first = _answers(out)
    lost = first.filter(pl.col("status") == "infra_error")
    assert lost.height >= 1 and set(lost["arm"].to_list()) == {"baseline"}
    kept = first.filter(pl.col("status") == "ok")
    assert kept.height >= 2  # finished records are kept
    # every kept answer is the uninterrupted run's answer
    assert (
        kept.join(_answers(whole_run), on=KEY, suffix="_w")
        .filter(pl.col("output_text") != pl.col("output_text_w"))
        .is_empty()
    )

    # Resume: the same command on the same folder, a fresh worker; nothing lost or duplicated.
    again = subprocess.run(
        _cli("run", str(matrix), "--no-controls", "--out", str(out)),
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert again.returncode == code, again.stderr
    resumed = _answers(out)
    assert resumed.height == resumed.select(KEY).unique().height
    assert resumed.equals(_answers(whole_run))
    want, got = read_verdict(whole_run), read_verdict(out)
    assert got["verdict"] == want["verdict"]
    assert got["slices"] == want["slices"]

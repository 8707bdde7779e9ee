"""A run SIGKILLed while it sends its controls (issue #37, smaller item b: "run 1 of a killed run wrote
7 of 8 controls"). The controls go out after the matrix into ``RUN/controls/`` through the same record
sink as the matrix (immutable parquet shards, each whole or absent): what the killed call wrote is a
subset of the controls, every record readable; the resume sends what is missing, once, and ends with
the uninterrupted run's controls, canaries and verdict. The server is a STUB on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
from test_sequential_runs import CASES, REPO, DeepBlindReader

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.run.records import FINAL_STATUSES, read_records
from helpers import free_port, read_verdict, sigkill_when, stub_matrix

KEY = ["arm", "layout_id", "seed"]


def _final_keys(folder: Path) -> pl.DataFrame:
    """Every final record's key, duplicates kept (``dedup=False``)."""
    records = read_records(folder, dedup=False)
    return records.filter(pl.col("status").is_in(list(FINAL_STATUSES))).select(KEY)


def test_a_run_killed_while_sending_controls_resumes_to_every_control_once(tmp_path: Path) -> None:
    port = free_port()
    matrix = tmp_path / "m.toml"
    where = f'endpoint = "http://127.0.0.1:{port}"'
    matrix.write_text(stub_matrix("killed-controls", where=where, cases=CASES, resamples=199))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    argv = ["run", str(matrix), "--concurrency", "2"]
    with DeepBlindReader(port, delay_s=0.03) as reader:
        code = main([*argv, "--out", str(whole)])
        assert code == ExitCode.PASS
        matrix_sent = read_records(whole).height
        controls = _final_keys(whole / "controls")
        assert controls.height > 8 and reader.requests > matrix_sent + controls.height  # + canaries

        # The same command in a child process, killed once the server has answered half the controls.
        reader.requests = 0
        kill_after = matrix_sent + controls.height // 2
        env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "depthgate", *argv, "--out", str(killed)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        sigkill_when(proc, lambda: reader.requests >= kill_after, 240)
        assert proc.returncode == -signal.SIGKILL
        landed = _final_keys(killed / "controls") if (killed / "controls").is_dir() else controls.clear()
        # whole records only, each one of the planned controls, not all of them
        assert landed.height < controls.height
        assert landed.join(controls, on=KEY, how="anti").height == 0
        assert not (killed / "canaries").exists() and not (killed / "report").exists()

        assert main([*argv, "--out", str(killed)]) == code
    resumed = _final_keys(killed / "controls")
    assert resumed.height == resumed.unique().height == controls.height  # every control, once
    assert resumed.sort(KEY).equals(controls.sort(KEY))
    before, after = read_verdict(whole), read_verdict(killed)
    assert after["controls"] == before["controls"]
    assert after["serving_checks"]["canaries"] == before["serving_checks"]["canaries"]
    assert after["verdict"] == before["verdict"] and after["slices"] == before["slices"]

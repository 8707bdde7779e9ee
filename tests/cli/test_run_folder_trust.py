"""Run folders a user or a crash left inconsistent, through the CLI (issue #21, items 3 and 5).

* A run that lost jobs scattered over cases (a server killed mid-run) has no case answered at every
  position: the worst-position range is empty. ``gate`` must still end INFRA (exit 30) with its report
  and print the verdict, not crash while printing it.
* Records that do not belong to the folder — another run's ``run_id``, a layout the folder never built,
  an arm it does not have — are refused by ``gate`` and ``merge`` (exit 20, the file and the field),
  and the reports stay as they were.
* ``depthgate gate RUN | true``: the reader closes the pipe; the command exits with its own code, no
  ``BrokenPipeError`` traceback, and the reports are those the gate wrote.

The run folder comes from a real run against a stub server on 127.0.0.1 (labelled: not a model) that
answers "not stated" and echoes the prompt ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.run.records import RECORDS_FILE, read_records
from helpers import NotStatedReader, stub_matrix


def _matrix(port: int) -> str:
    return stub_matrix(
        "trust",
        where=f'endpoint = "http://127.0.0.1:{port}"',
        suite='{ kind = "builtin", cases = 3, seed = 0, language = "en" }',
        lengths="[512]",
        positions="[0.0, 0.5, 1.0]",
        arm="window = 1024",
    ).replace("n_min = 2", "n_min = 2\nmax_missing = 0.5")  # a slice missing a third is still gated


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A whole run and the single shard (1/1) of the same matrix, both complete."""
    root = tmp_path_factory.mktemp("trust")
    with NotStatedReader() as reader:
        matrix = root / "m.toml"
        matrix.write_text(_matrix(reader.port))
        whole, shard = root / "whole", root / "shard"
        assert main(["run", str(matrix), "--out", str(whole), "--no-controls"]) in (0, 10, 11, 13)
        assert main(["run", str(matrix), "--out", str(shard), "--no-controls", "--shard", "1/1"]) == 0
    return {"whole": whole, "shard": shard}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_records(run: Path, edit: object) -> None:
    records = read_records(run)
    assert callable(edit)
    for path in (run / "records").glob("*") if (run / "records").is_dir() else []:
        path.unlink()
    edit(records).write_parquet(run / RECORDS_FILE)


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_gate_on_a_run_that_lost_jobs_scattered_over_cases_ends_infra_with_its_report(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(runs["whole"], tmp_path / "lost")
    cases = sorted(read_records(run)["case_id"].unique().to_list())
    positions = sorted(read_records(run)["position"].unique().to_list())
    assert len(cases) == 3 and len(positions) == 3
    # Case i lost position i (both arms): no case has answers at every position.
    lost = pl.lit(False)
    for case, position in zip(cases, positions, strict=True):
        lost = lost | ((pl.col("case_id") == case) & (pl.col("position") == position))
    _rewrite_records(run, lambda frame: frame.filter(~lost))
    code = main(["gate", str(run)])
    captured = capsys.readouterr()
    assert code == ExitCode.INFRA, captured
    assert "Traceback" not in captured.err
    assert "verdict: INFRA" in captured.out
    verdict = json.loads((run / "report" / "verdict.json").read_text())
    assert verdict["verdict"] == "INFRA" and verdict["infra"]["lost"] == 6
    worst = verdict["worst_by_length"][0]
    assert worst["slice_worst_position"] is not None and worst["range_baseline"] is None  # the crash's shape
    assert "position range baseline n/a" in captured.out
    assert (run / "report" / "report.html").is_file()


@pytest.mark.parametrize("field", ["run_id", "layout_id", "arm"])
def test_gate_refuses_records_that_belong_to_another_run(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    run = _copy(runs["whole"], tmp_path / f"foreign-{field}")
    foreign = {"run_id": "other-run-0123456789ab", "layout_id": "f" * 64, "arm": "shadow"}[field]
    # Another run's id on every record (copied in whole); one stray record for the layout and arm.
    which = pl.lit(True) if field == "run_id" else pl.int_range(pl.len()) == 0
    _rewrite_records(
        run,
        lambda frame: frame.with_columns(
            pl.when(which).then(pl.lit(foreign)).otherwise(pl.col(field)).alias(field)
        ),
    )
    before = _digests(run / "report")
    code = main(["gate", str(run)])
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err
    assert f"field '{field}'" in err and str(run) in err and "fix:" in err and foreign[:12] in err
    assert _digests(run / "report") == before  # the reports were not rewritten over foreign data


def test_merge_refuses_a_record_for_a_layout_that_does_not_exist(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = _copy(runs["shard"], tmp_path / "shard")
    first = pl.int_range(pl.len()) == 0
    _rewrite_records(
        shard,
        lambda frame: frame.with_columns(
            pl.when(first).then(pl.lit("0" * 64)).otherwise(pl.col("layout_id")).alias("layout_id")
        ),
    )
    code = main(["merge", str(shard), "--out", str(tmp_path / "merged")])
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err
    assert "field 'layout_id'" in err and "0000000000" in err and str(shard) in err
    assert not (tmp_path / "merged").exists()


def test_a_closed_stdout_ends_quietly_with_the_commands_code(runs: dict[str, Path], tmp_path: Path) -> None:
    """``depthgate gate RUN | true``: the reader is gone before the verdict is printed."""
    run = _copy(runs["whole"], tmp_path / "piped")
    expected = main(["gate", str(run)])
    assert expected in (0, 10, 11, 13)
    reports = _digests(run / "report")
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first write (or the flush at exit) meets a closed pipe
    proc = subprocess.run(
        [sys.executable, "-m", "depthgate", "gate", str(run)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.returncode == expected
    assert _digests(run / "report") == reports  # rewritten by the gate to the same bytes, never cut


def test_the_pipe_safe_stdout_is_no_terminal_once_closed() -> None:
    """Ray's colorama asks ``isatty()`` in an atexit hook, after pytest (or the shell) closed the stream
    under the wrapper: that must answer False, not raise (a traceback printed at the end of a run)."""
    import io

    from depthgate.commands.console import _PipeSafe

    inner = io.StringIO()
    wrapped = _PipeSafe(inner)
    assert wrapped.isatty() is False
    inner.close()
    assert wrapped.isatty() is False

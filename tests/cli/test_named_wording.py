"""Issue #37, smaller items, through the CLI: a run folder whose manifest.json is a device or a symlink
loop is named as such (it said "no manifest.json"), and two different runs' shards merged are said to be
different runs (it said "shard 1/2 twice")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import StubServer, free_port, reading_handler, stub_matrix


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda m: os.symlink("/dev/zero", m), "manifest.json is a character device"),
        (lambda m: os.symlink(m.name, m), "manifest.json is a symlink loop"),
        (lambda m: m.mkdir(), "manifest.json is a folder"),
    ],
    ids=["dev-zero", "symlink-loop", "folder"],
)
def test_a_manifest_that_is_not_a_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, said: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    make(run / "manifest.json")  # type: ignore[operator]
    assert main(["gate", str(run)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert said in err and "no manifest.json" not in err, err


def test_shards_of_two_different_runs_are_said_to_be_different_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    tokenizer = Tokenizer.from_file(str(tokenizers_dir() / "gpt2" / "tokenizer.json"))
    answers = {c.query: c.required_claims[0].aliases[0] for c in builtin_suite(2).cases if c.required_claims}
    shards = []
    with StubServer(reading_handler({"good": tokenizer}, answers), port):
        for name in ("run-a", "run-b"):
            matrix = tmp_path / f"{name}.toml"
            matrix.write_text(
                stub_matrix(name, where=f'endpoint = "http://127.0.0.1:{port}"'), encoding="utf-8"
            )
            shard = tmp_path / f"{name}-shard1"
            code = main(["run", str(matrix), "--no-controls", "--shard", "1/2", "--out", str(shard)])
            assert code in (ExitCode.PASS, ExitCode.INFRA)
            shards.append(shard)
    capsys.readouterr()
    assert main(["merge", *map(str, shards), "--out", str(tmp_path / "merged")]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "hold different runs" in err and "twice" not in err, err
    assert not (tmp_path / "merged").exists()

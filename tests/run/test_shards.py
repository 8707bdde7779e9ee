"""Shards across machines (issue #12 item 3): ``run --shard i/N`` + ``merge`` + ``gate`` gives the verdict
one unsharded run gives; a missing, doubled, foreign or incomplete shard is refused by name.

The model is the perfect-reader **stub** of tests/cli/test_verdict_trust.py on 127.0.0.1 (labelled there)
for the many-case form, and the real embedded model (llama.cpp in process) for the small
``smoke_model`` form.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from test_cli import _tiny_matrix
from test_verdict_trust import PerfectReader, _matrix

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.run.jobs import shard_of
from depthgate.run.records import read_records
from helpers import free_port, read_verdict

SAME = ("slices", "digests", "plan", "overall", "worst_by_length", "worst_cases", "worst_shares", "verdict")


def _sharded(matrix: Path, tmp: Path, count: int, extra: list[str]) -> list[Path]:
    dirs = []
    for index in range(1, count + 1):
        out = tmp / f"shard{index}"
        assert main(["run", str(matrix), "--out", str(out), "--shard", f"{index}/{count}", *extra]) == 0
        dirs.append(out)
    return dirs


def test_shard_of_keeps_pairs_together_and_splits_evenly() -> None:
    pairs = [(f"case{c}", 1024, p, s) for c in range(200) for p in ("0", "0.5", "1") for s in (0, 1)]
    counts = [0, 0, 0]
    for pair in pairs:
        counts[shard_of(pair, 3)] += 1
    assert sum(counts) == len(pairs) and min(counts) > 0.28 * len(pairs)  # ≈ a third each
    assert shard_of(pairs[0], 3) == shard_of(pairs[0], 3)  # content only: the same on every machine


def test_three_shards_merge_to_the_unsharded_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    matrix = _matrix(tmp_path, port)
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(tmp_path / "whole")]) == ExitCode.PASS
        dirs = _sharded(matrix, tmp_path, 3, [])
    sizes = [read_records(d).height for d in dirs]
    assert sum(sizes) == read_records(tmp_path / "whole").height and min(sizes) > 0
    assert main(["gate", str(dirs[0])]) == ExitCode.BAD_INPUT  # one shard is not a verdict
    assert "merge" in capsys.readouterr().err

    merged = tmp_path / "merged"
    assert main(["merge", *map(str, dirs), "--out", str(merged)]) == ExitCode.PASS
    assert main(["gate", str(merged)]) == ExitCode.PASS
    whole, joined = read_verdict(tmp_path / "whole"), read_verdict(merged)
    for key in SAME:
        assert joined[key] == whole[key], key
    assert joined["controls"]["counts"] == whole["controls"]["counts"]
    # The server arms' default canaries (2 head + 2 tail per arm and length) go out in the shards too,
    # each shard its part, and merge joins them: the same canary judgement as the whole run (a sharded
    # run used to send none and say nothing, issue #37).
    canary_parts = [read_records(d / "canaries").height for d in dirs]
    whole_canaries = read_records(tmp_path / "whole" / "canaries").height
    assert sum(canary_parts) == whole_canaries == 2 * 2 * 2  # arms × kinds × canaries at one length
    assert joined["serving_checks"]["canaries"] == whole["serving_checks"]["canaries"]
    assert joined["serving_checks"]["canaries"]["lost"] == []
    assert "8 canary records" in capsys.readouterr().out

    # A shard run on another machine (its manifest's determinism block differs) still merges; the
    # frozen fields that bind the run (here the seeds) do not.
    other = tmp_path / "other-machine"
    shutil.copytree(dirs[1], other)
    doc = json.loads((other / "manifest.json").read_text(encoding="utf-8"))
    assert doc["determinism"]["baseline"]["backend"] == "vllm-server"
    doc["determinism"]["baseline"]["endpoints"] = 4
    (other / "manifest.json").write_text(json.dumps(doc), encoding="utf-8")
    remerged = tmp_path / "remerged"
    assert main(["merge", str(dirs[0]), str(other), str(dirs[2]), "--out", str(remerged)]) == ExitCode.PASS
    doc["seeds"] = [0, 1]
    (other / "manifest.json").write_text(json.dumps(doc), encoding="utf-8")
    refused = tmp_path / "refused-seeds"
    assert (
        main(["merge", str(dirs[0]), str(other), str(dirs[2]), "--out", str(refused)]) == ExitCode.BAD_INPUT
    )
    assert "seeds" in capsys.readouterr().err and not refused.exists()

    # Refusals, each by name, and nothing written.
    for argv, words in (
        ([dirs[0], dirs[2]], "shard 2/3 missing"),
        ([dirs[0], dirs[1], dirs[1], dirs[2]], "shard 2/3 twice"),
        ([dirs[0], dirs[1], tmp_path / "whole"], "no shard.json"),
    ):
        out = tmp_path / "refused"
        assert main(["merge", *map(str, argv), "--out", str(out)]) == ExitCode.BAD_INPUT
        assert words in capsys.readouterr().err and not out.exists()

    # A shard with a gap (a record lost) and a shard with a record of another shard's pair.
    gap = tmp_path / "gap"
    shutil.copytree(dirs[1], gap)
    records = read_records(gap)
    shutil.rmtree(gap / "records", ignore_errors=True)
    records.slice(1).write_parquet(gap / "records.parquet")
    out = tmp_path / "refused"
    assert main(["merge", str(dirs[0]), str(gap), str(dirs[2]), "--out", str(out)]) == ExitCode.BAD_INPUT
    assert "shard 2/3 has 1 of" in capsys.readouterr().err

    foreign = tmp_path / "foreign"
    shutil.copytree(dirs[1], foreign)
    stolen = read_records(dirs[0]).slice(0, 1)
    both = pl.concat([read_records(foreign), stolen])
    shutil.rmtree(foreign / "records", ignore_errors=True)
    both.write_parquet(foreign / "records.parquet")
    assert main(["merge", str(dirs[0]), str(foreign), str(dirs[2]), "--out", str(out)]) == ExitCode.BAD_INPUT
    assert "recorded in two shards" in capsys.readouterr().err


@pytest.mark.smoke_model
def test_shards_of_the_embedded_model_merge_to_the_same_verdict(tmp_path: Path) -> None:
    """The tiny smoke matrix on the real model: 2 shards + merge = one run (greedy decoding)."""
    matrix = _tiny_matrix(tmp_path)
    code = main(["run", str(matrix), "--out", str(tmp_path / "whole"), "--no-controls"])
    dirs = _sharded(matrix, tmp_path, 2, ["--no-controls"])
    merged = tmp_path / "merged"
    assert main(["merge", *map(str, dirs), "--out", str(merged)]) == ExitCode.PASS
    assert main(["gate", str(merged)]) == code
    whole, joined = read_verdict(tmp_path / "whole"), read_verdict(merged)
    for key in SAME:
        assert joined[key] == whole[key], key

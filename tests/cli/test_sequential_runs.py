"""A ``stop_rule = "sequential"`` run through the CLI (issue #26): killed with SIGKILL while a look is in
flight and resumed with the same command, it loses and duplicates nothing and ends with the
uninterrupted run's look history and verdict; run as shards, merged look by look, it gives the
unsharded run's verdict.

The model behind 127.0.0.1 is a **stub** (labelled as such): a vLLM-shaped ``/v1/completions`` server
that decodes the prompt ids with the real GPT-2 tokenizer and answers each case's question with its true
value. Model ``deep-blind`` is the planted regression: it answers "not stated" when the evidence sits
in the second half of the prompt (depth 1), so the depth-1 slice regresses and depth 0 does not.
Every answer is delayed a little so that a kill lands mid-look.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.run.records import FINAL_STATUSES, read_records
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import (
    StubServer,
    answer_in,
    free_port,
    read_verdict,
    reading_handler,
    sigkill_when,
    small_smoke_matrix,
    stub_matrix,
)

REPO = Path(__file__).resolve().parents[2]
GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
CASES = 24
KEY = ["arm", "layout_id", "seed"]


class DeepBlindReader(StubServer):
    """Model ``good`` answers every case; ``deep-blind`` only when the answer sits in the prompt's
    first half. ``delay_s`` per answer; ``requests`` counts the answers sent."""

    def __init__(self, port: int, delay_s: float = 0.0) -> None:
        tokenizer = Tokenizer.from_file(str(GPT2))
        answers = {
            c.query: c.required_claims[0].aliases[0] if c.required_claims else "not stated"
            for c in builtin_suite(CASES).cases
        }
        self.requests = 0
        self.delay_s = delay_s
        lock = threading.Lock()

        def reply(model: str, text: str) -> str:
            answer = answer_in(answers, text)
            if model == "deep-blind" and text.find(answer) > len(text) // 2:
                answer = "not stated"
            time.sleep(self.delay_s)
            with lock:
                self.requests += 1
            return answer

        tokenizers = {"good": tokenizer, "deep-blind": tokenizer}
        super().__init__(reading_handler(tokenizers, answers, reply=reply), port)


def _matrix(tmp: Path, port: int) -> Path:
    text = stub_matrix(
        "sequential-stub",
        where=f'endpoint = "http://127.0.0.1:{port}"',
        cases=CASES,
        candidate_model="deep-blind",
        resamples=499,
        # These tests count the looks' requests one by one; the canaries (on by default for a server
        # arm, a folder of their own: tests/run/test_serving_path.py) would be sent beside them.
        top="canaries = 0",
    )
    text += 'stop_rule = "sequential"\nlooks = [0.25, 0.5, 0.75, 1.0]\n'
    path = tmp / "sequential.toml"
    path.write_text(text)
    return path


def _keys(run: Path) -> pl.DataFrame:
    records = read_records(run, dedup=False).filter(pl.col("status").is_in(list(FINAL_STATUSES)))
    return records.select(*KEY)


def history_cases(merged: Path) -> int:
    """The cases of a merged round's first look (from the frozen schedule the shards wrote)."""
    return int(json.loads((merged.parent / "shard1" / "shard-look.json").read_text())["cases"][0])


def _history(run: Path) -> list[Any]:
    return list(json.loads((run / "looks.json").read_text())["looks"])


def test_sigkill_mid_look_then_resume_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    port = free_port()
    matrix = _matrix(tmp_path, port)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    argv = ["run", str(matrix), "--no-controls", "--concurrency", "2"]
    with DeepBlindReader(port, delay_s=0.04) as reader:
        code = main([*argv, "--out", str(whole)])
        verdict = read_verdict(whole)
        history = _history(whole)
        sent = verdict["sequential"]["requests_sent"]
        assert code == ExitCode.FAIL and reader.requests == sent
        # The planted regression is decided early and not every planned request is sent; the look the
        # kill lands in must exist: at least two looks.
        assert sent < verdict["sequential"]["requests_planned"] and len(history) >= 1
        first_look = 2 * history[0]["cases"] * len(history[0]["slices"])  # both arms, one seed
        assert first_look < sent

        # The same command in a child process, SIGKILLed once the server has answered three requests of
        # the second look: it is in flight.
        reader.requests = 0
        kill_after = first_look + 3  # look 2 sends 12 (6 new cases of the one open slice, both arms)
        env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "depthgate", *argv, "--out", str(killed)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        err = sigkill_when(proc, lambda: reader.requests >= kill_after, 240)
        assert proc.returncode == -signal.SIGKILL
        assert "look 2/" in err and "look 3/" not in err  # killed while look 2 was being sent
        landed = _keys(killed).height
        assert first_look <= landed < sent, (first_look, landed, sent)
        assert not (killed / "report").exists()

        # Resume: the same command on the same folder.
        assert main([*argv, "--out", str(killed)]) == code
    keys = _keys(killed)
    assert keys.height == keys.unique().height == sent  # nothing duplicated
    assert keys.sort(KEY).equals(_keys(whole).sort(KEY))  # nothing lost: the very requests of the looks
    assert _history(killed) == history
    resumed = read_verdict(killed)
    assert resumed["verdict"] == verdict["verdict"]
    assert resumed["slices"] == verdict["slices"]
    assert resumed["sequential"] == verdict["sequential"]


def test_shards_run_look_by_look_and_merge_to_the_unsharded_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Round r: every shard sends its part of one look (``--after`` the previous round's merge), merge
    joins them; after the last round ``gate`` gives the unsharded run's verdict from the same requests,
    before it says which round is merged and what comes next (exit ROUND_OPEN). Shards of different
    rounds, a missing part of a look and ``--after`` without a shard are refused."""
    port = free_port()
    matrix = _matrix(tmp_path, port)
    whole = tmp_path / "whole"
    base = ["run", str(matrix), "--no-controls"]
    with DeepBlindReader(port) as reader:
        code = main([*base, "--out", str(whole)])
        verdict = read_verdict(whole)
        looks = len(verdict["sequential"]["design"]["cases"])
        decided_at = max(int(s["look"]) for s in verdict["sequential"]["slices"])
        assert decided_at >= 2  # round 1's merge has an open slice: gate says so (below)
        reader.requests = 0
        shards = [tmp_path / f"shard{i}" for i in (1, 2)]
        after: list[str] = []
        merged = tmp_path / "merged0"
        seen: list[int] = []
        for r in range(1, looks + 1):
            for i, shard in enumerate(shards, start=1):
                assert main([*base, "--out", str(shard), "--shard", f"{i}/2", *after]) == ExitCode.PASS
            merged = tmp_path / f"merged{r}"
            assert main(["merge", *map(str, shards), "--out", str(merged)]) == ExitCode.PASS
            out = capsys.readouterr().out
            assert "shard again with --after MERGED_r" in out  # what a shard says comes next
            said = re.search(rf"sequential look (\d) of {looks}", out)
            assert said is not None
            seen.append(int(said[1]))
            after = ["--after", str(merged)]
            if r < decided_at:
                # gate on a merge before the last round: which round, what is decided and open, and
                # the next round's command; exit ROUND_OPEN (not INFRA: nothing is lost), no report
                assert main(["gate", str(merged)]) == ExitCode.ROUND_OPEN
                said = capsys.readouterr()
                assert f"round {r} of at most {looks} of a sharded sequential run (2 shards)" in said.err
                assert "still open: " in said.err and "INFRA" not in said.err + said.out
                assert f"run MATRIX --shard i/2 --out DIR_i --after {merged}" in said.out
                assert not (merged / "report").exists()
            if r == 1:
                # a shard of round 2 merged with a shard of round 1: refused by name
                round2 = tmp_path / "round2-shard1"
                shutil.copytree(shards[0], round2)
                before = reader.requests
                assert main([*base, "--out", str(round2), "--shard", "1/2", *after]) == ExitCode.PASS
                reader.requests = before  # the test's own extra shard is not the run's
                mixed = ["merge", str(round2), str(shards[1]), "--out", str(tmp_path / "mixed")]
                assert main(mixed) == ExitCode.BAD_INPUT
                assert "shard-look.json" in capsys.readouterr().err
                # a shard that lost its part of the look: refused against the round's schedule
                lost = tmp_path / "lost-shard1"
                shutil.copytree(shards[0], lost)
                shutil.rmtree(lost / "records")
                (lost / "records.parquet").unlink()
                gap = ["merge", str(lost), str(shards[1]), "--out", str(tmp_path / "gap")]
                assert main(gap) == ExitCode.BAD_INPUT
                want = re.search(r"shard 1/2 has (\d+) of (\d+) planned", capsys.readouterr().err)
                assert want is not None and int(want[1]) == int(want[2]) <= 2 * 2 * history_cases(merged)
        # look by look, then nothing once every slice is decided; no more requests than the unsharded run
        assert seen == [*range(1, decided_at + 1), *[decided_at] * (looks - decided_at)], seen
        assert reader.requests == verdict["sequential"]["requests_sent"]
    assert main(["gate", str(merged)]) == code
    joined = read_verdict(merged)
    for key in ("verdict", "slices", "sequential"):
        assert joined[key] == verdict[key], key
    assert _keys(merged).sort(KEY).equals(_keys(whole).sort(KEY))
    # --after belongs to a shard of a sequential run
    assert main([*base, "--out", str(tmp_path / "x"), "--after", str(merged)]) == ExitCode.BAD_INPUT
    assert "--after" in capsys.readouterr().err


def test_a_sequential_plan_the_last_look_would_refuse_is_exit_20_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #36, F1 through the CLI: 10 slices, power-5 at eight looks and B 650 passed the matrix,
    sent every request and only then the last look refused B (exit 20). The gate plan is now built with
    the suite's cases before anything: exit 20 naming the field, no run folder, no engine started."""
    text = small_smoke_matrix(cases=40, lengths="[480, 640]")
    text = text.replace("positions = [0.0, 1.0]", "positions = [0.0, 0.25, 0.5, 0.75, 1.0]")
    text = text.replace("bootstrap_resamples = 199", "bootstrap_resamples = 650")
    text = text.replace(
        "n_min = 2",
        'n_min = 40\nstop_rule = "sequential"\nlooks = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]\n'
        'boundary = "power-5"',
    )
    matrix = tmp_path / "late-looks.toml"
    matrix.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    assert main(["run", str(matrix), "--out", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "plan.bootstrap_resamples" in err and "smallest level a look of the sequential plan" in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "base_lines",
    [
        "",  # the default: NoLiMa with the short base lengths 250/500/1000 built beside the grid
        'base_score = "short"\nbase_lengths = [300]\n',
        'base_score = "control"\n',
        'effective_length_rule = "ruler"\n',
    ],
    ids=["default-short", "short-300", "control", "ruler"],
)
def test_sharded_rounds_finish_with_every_base_score_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base_lines: str
) -> None:
    """Issue #37, item 4: with the default base score every shard sent its part of the look, then exited
    30 "shard 1/2 incomplete" and merge refused "12 of 18 planned jobs without a final record": the
    completeness check counted the short base-length jobs, which no look sends (unsharded or not). Every
    shipped base-score mode now runs its rounds to the unsharded verdict, every shard exit 0."""
    port = free_port()
    text = stub_matrix(
        "sequential-bases",
        where=f'endpoint = "http://127.0.0.1:{port}"',
        cases=CASES,
        candidate_model="deep-blind",
        resamples=499,
        base_score=None,
    )
    matrix = tmp_path / "bases.toml"
    matrix.write_text(text + base_lines + 'stop_rule = "sequential"\nlooks = [0.5, 1.0]\n')
    base = ["run", str(matrix), "--no-controls"]
    shards = [tmp_path / f"shard{i}" for i in (1, 2)]
    with DeepBlindReader(port):
        code = main([*base, "--out", str(tmp_path / "whole")])
        after: list[str] = []
        for r in (1, 2):
            for i, shard in enumerate(shards, start=1):
                assert main([*base, "--out", str(shard), "--shard", f"{i}/2", *after]) == ExitCode.PASS
                assert "incomplete" not in capsys.readouterr().out
            merged = tmp_path / f"merged{r}"
            assert main(["merge", *map(str, shards), "--out", str(merged)]) == ExitCode.PASS, (
                capsys.readouterr().err
            )
            after = ["--after", str(merged)]
    assert code == ExitCode.FAIL  # the planted depth-1 regression
    assert main(["gate", str(tmp_path / "merged2")]) == code
    joined, whole = read_verdict(tmp_path / "merged2"), read_verdict(tmp_path / "whole")
    for key in ("verdict", "slices", "sequential"):
        assert joined[key] == whole[key], key
    assert joined["infra"]["lost"] == whole["infra"]["lost"] == 0

"""Refusals attributed to the side that caused them (issue #37, item 3): a layout neither arm can build is
no fault of the candidate's serving path.

Two identical honest **stub** servers (labelled: not models; vLLM-shaped, they decode the prompt ids
with the GPT-2 tokenizer and answer each case's question with its true value) serve the two arms, at
lengths 384 and 512. At 384 tokens one case cannot be laid out exactly under either arm
(``cannot_reach_exact_length`` on both, refused at build time): those slices used to be FAIL_SYSTEM "the
candidate's serving path failed" although both arms are the same. Only a candidate-only system failure is
the candidate's (tests/run/test_serving_path.py keeps that side).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import StubServer, read_verdict, reading_handler, stub_matrix

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
CASES = 8


def test_a_layout_neither_arm_can_build_is_not_the_candidates_system_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = {
        c.query: c.required_claims[0].aliases[0] if c.required_claims else "not stated"
        for c in builtin_suite(CASES).cases
    }
    handler = reading_handler({"good": Tokenizer.from_file(str(GPT2))}, answers)
    with StubServer(handler) as first, StubServer(handler) as second:
        text = stub_matrix("shared-refusal", where="", cases=CASES, lengths="[384, 512]")
        text = text.replace('name = "base"', f'name = "base"\nendpoint = "http://127.0.0.1:{first.port}"')
        text = text.replace('name = "cand"', f'name = "cand"\nendpoint = "http://127.0.0.1:{second.port}"')
        matrix = tmp_path / "m.toml"
        matrix.write_text(text)
        run = tmp_path / "run"
        code = main(["run", str(matrix), "--no-controls", "--out", str(run)])
    err = capsys.readouterr().err
    scored = pl.read_parquet(run / "scored.parquet")
    refused = scored.filter(pl.col("system_fail_reason") == "cannot_reach_exact_length")
    # the premise: the same layouts refused on both arms, at 384 only
    assert refused.height > 0 and set(refused["arm"]) == {"baseline", "candidate"}, refused
    assert set(refused["target_tokens" if "target_tokens" in refused.columns else "length"]) == {384}
    verdict = read_verdict(run)
    assert code != ExitCode.FAIL_SYSTEM, err
    assert verdict["failure_class"] not in ("system", "mixed"), verdict["failure_class"]
    assert verdict["system_driven_slices"] == []
    assert "cannot_reach_exact_length" not in verdict["system_fail_reasons"]
    for row in verdict["slices"]:
        assert row["status"] != "FAIL_SYSTEM", row
        assert "serving path" not in (row["reason"] or ""), row

"""The prompt-assembler registry (issue #10 item 3): ``assembler`` is a real, named choice of a system.

``default`` puts the question after the document; ``query-first`` before and after it. The layouts of
the two differ in text, ids and layout id, keep the same evidence bytes at the same depth in the
context, and stay token-exact; an unknown name is refused (exit 20) before anything is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode, SpecError
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.spec.assemblers import ASSEMBLERS, assemble
from depthgate.spec.suites import builtin_suite
from depthgate.spec.system import Assembler, System
from fixtures_paths import tokenizers_dir

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"


def _build(tmp: Path, assembler: str) -> pl.DataFrame:
    options = BuildOptions(lengths=[512], positions=parse_positions(["0", "0.5", "1"]), assembler=assembler)
    out = tmp / assembler / "layouts.parquet"
    build_layouts(builtin_suite(4), load_tokenizer(GPT2), options, out)
    return pl.read_parquet(out)


def test_the_registry_is_exactly_the_names_the_model_accepts() -> None:
    assert set(ASSEMBLERS) == set(get_args(Assembler)) == {"default", "query-first"}
    case = builtin_suite(1).cases[0]
    default, first = assemble("default", case), assemble("query-first", case)
    assert case.query not in default.before and case.query in default.after
    assert first.before.startswith(f"Question: {case.query}\n\n") and first.after == default.after
    assert first.answer == default.answer
    with pytest.raises(SpecError, match="unknown prompt assembler"):
        assemble("no-such-assembler-xyz", case)


def test_query_first_changes_the_prompt_but_not_the_evidence(tmp_path: Path) -> None:
    default, first = _build(tmp_path, "default"), _build(tmp_path, "query-first")
    assert default.height == first.height and set(first["status"]) == {"ok"}
    assert set(default["layout_id"]).isdisjoint(set(first["layout_id"]))  # the assembler is in the id
    assert set(first["assembler_version"]) == {"depthgate-layout/1+query-first"}
    assert set(default["assembler_version"]) == {"depthgate-layout/1"}
    hf = HFTokenizer.from_file(str(GPT2))
    for a, b in zip(default.iter_rows(named=True), first.iter_rows(named=True), strict=True):
        assert (a["case_id"], a["position"], a["target_tokens"]) == (
            b["case_id"],
            b["position"],
            b["target_tokens"],
        )
        query = next(c.query for c in builtin_suite(4).cases if c.id == b["case_id"])
        assert a["text"].count(query) == 1 and b["text"].count(query) == 2
        assert a["token_ids"] != b["token_ids"]
        assert hf.encode(b["text"], add_special_tokens=b["add_special_tokens"]).ids == list(b["token_ids"])
        spans_a = {s["evidence_id"]: s["sha256"] for s in a["evidence_spans"]}
        spans_b = {s["evidence_id"]: s["sha256"] for s in b["evidence_spans"]}
        assert spans_a == spans_b  # the same evidence bytes, every unit


def test_unknown_assembler_is_refused_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        Path("matrices/smoke.toml")
        .read_text()
        .replace('name = "gemma-preamble"', 'name = "gemma-preamble"\nassembler = "no-such-assembler-xyz"')
    )
    matrix = tmp_path / "bad.toml"
    matrix.write_text(text)
    out = tmp_path / "layouts"
    assert main(["build", str(matrix), "--out", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "assembler" in err and "query-first" in err
    assert not out.exists()
    with pytest.raises(Exception, match="assembler"):
        System(name="x", backend="llamacpp", model="m", tokenizer="t.json", assembler="sandwich")  # type: ignore[arg-type]

"""Fault injection (DESIGN.md §4): each of the six faults is caught by name, never scored as a model error.

The pre-send gate is tested on real tokenizers without a model; the end-to-end run of all six faults on
the embedded Gemma backend is the ``smoke_model`` test.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from depthgate.commands import faults
from depthgate.commands.faults import (
    FAULT_NAMES,
    FaultResult,
    duplicate_distractor,
    guard_layouts,
    reorder_units,
    run_faults,
    stale_tokenizer_variant,
)
from depthgate.exceptions import ExitCode, InputError
from depthgate.layout.layouts import (
    LAYOUT_SCHEMA,
    BuildOptions,
    Tokenizer,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.layout.templates import load_chat_template, raw_frame
from depthgate.spec.models import Suite
from depthgate.spec.suites import builtin_suite

RAW = raw_frame(user_before="", user_after="").template_digest


@pytest.fixture(scope="module")
def suite() -> Suite:
    return builtin_suite(3)


@pytest.fixture(scope="module")
def llama2(shared_dir: Path) -> Tokenizer:
    return load_tokenizer(shared_dir / "tokenizers" / "llama2-tinyllama" / "tokenizer.json")


def _build(tmp: Path, suite: Suite, tok: Tokenizer, name: str, **kw: Any) -> pl.DataFrame:
    options = BuildOptions(
        lengths=kw.pop("lengths", [512]), positions=parse_positions(["0", "0.5", "1"]), **kw
    )
    build_layouts(suite, tok, options, tmp / f"{name}.parquet")
    frame = read_layouts(tmp / f"{name}.parquet")
    assert frame["status"].to_list() == ["ok"] * frame.height
    return frame


def _guard(frame: pl.DataFrame, tok: Tokenizer, suite: Suite, **kw: Any) -> pl.DataFrame:
    kw.setdefault("template_digest", RAW)
    kw.setdefault("window", 4096)
    return guard_layouts(
        frame, tokenizer=tok, max_output_tokens=12, cases={c.id: c for c in suite.cases}, **kw
    )


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, suite: Suite, llama2: Tokenizer) -> pl.DataFrame:
    return _build(tmp_path_factory.mktemp("clean"), suite, llama2, "clean")


def test_clean_layouts_pass_the_gate(clean: pl.DataFrame, llama2: Tokenizer, suite: Suite) -> None:
    gated = _guard(clean, llama2, suite)
    assert gated["status"].to_list() == ["ok"] * clean.height
    assert gated["reason_code"].null_count() == clean.height


def test_unknown_fault_lists_the_known_names() -> None:
    with pytest.raises(InputError) as info:
        run_faults(["tokenizer-upgrade", "no-such-fault"])
    for name in FAULT_NAMES:
        assert name in str(info.value)
    assert "no-such-fault" in str(info.value)
    with pytest.raises(InputError):
        faults.cmd_faults(argparse.Namespace(only="x", out=None, json=None, cases=1))


def test_retriever_reorder_is_diagnosed_not_just_a_hash_failure(
    clean: pl.DataFrame, llama2: Tokenizer, suite: Suite
) -> None:
    rows = [reorder_units(r, llama2) for r in clean.iter_rows(named=True)]
    faulty = pl.DataFrame(rows, schema=LAYOUT_SCHEMA)
    for row, before in zip(rows, clean.iter_rows(named=True), strict=True):
        assert row["text"] != before["text"] and sorted(row["text"]) == sorted(before["text"])
        assert row["token_ids"] == llama2.encode(row["text"], add_special_tokens=True).tolist()
    gated = _guard(faulty, llama2, suite)
    assert set(gated["reason_code"].to_list()) == {"presend_units_reordered"}
    assert all("presend_evidence_missing" in r for r in gated["reason"].to_list())


def test_duplicated_distractor_named_over_its_symptoms(
    clean: pl.DataFrame, llama2: Tokenizer, suite: Suite
) -> None:
    faulty = pl.DataFrame(
        [duplicate_distractor(r, llama2) for r in clean.iter_rows(named=True)], schema=LAYOUT_SCHEMA
    )
    gated = _guard(faulty, llama2, suite)
    assert set(gated["reason_code"].to_list()) == {"presend_duplicated_distractor"}
    # the symptoms are kept in the detail: longer than the contract, spans after the copy moved
    assert all(
        "presend_length_mismatch" in r and "verify_ids_mismatch" not in r for r in gated["reason"].to_list()
    )


def test_template_digest_and_window(
    clean: pl.DataFrame, llama2: Tokenizer, suite: Suite, shared_dir: Path
) -> None:
    other = load_chat_template(
        shared_dir / "tokenizers" / "llama2-tinyllama" / "chat_template.llama-2-chat.jinja"
    )
    gated = _guard(clean, llama2, suite, template_digest=other.digest)
    assert set(gated["reason_code"].to_list()) == {"presend_template_digest"}
    small = _guard(clean, llama2, suite, window=500)
    assert set(small["reason_code"].to_list()) == {"presend_window_overflow"}
    assert "served window 500" in small["reason"][0]


def test_stale_tokenizer_variant_shifts_positions_and_is_refused(
    tmp_path: Path, suite: Suite, shared_dir: Path
) -> None:
    new = load_tokenizer(shared_dir / "tokenizers" / "gpt2" / "tokenizer.json")
    old = load_tokenizer(
        stale_tokenizer_variant(new.path, tmp_path / "old.json", ["Ġthe", "Ġfor", "Ġand", "Ġregion"])
    )
    assert old.digest != new.digest
    built_old = _build(tmp_path, suite, old, "old")
    built_new = _build(tmp_path, suite, new, "new")
    assert built_old["token_ids"].to_list() != built_new["token_ids"].to_list()
    starts = [[s["token_start"] for s in spans] for spans in built_old["evidence_spans"].to_list()]
    assert starts != [[s["token_start"] for s in spans] for spans in built_new["evidence_spans"].to_list()]
    gated = _guard(built_old, new, suite)
    assert set(gated["reason_code"].to_list()) == {"verify_stale_tokenizer"}
    assert all("verify_ids_mismatch" in r for r in gated["reason"].to_list())
    assert set(_guard(built_new, new, suite)["status"].to_list()) == {"ok"}


def test_stale_variant_refuses_non_bpe(tmp_path: Path, shared_dir: Path) -> None:
    with pytest.raises(InputError):
        stale_tokenizer_variant(
            shared_dir / "tokenizers" / "bert-wordpiece" / "tokenizer.json", tmp_path / "x.json"
        )


def test_cmd_faults_exit_code_and_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    results = [FaultResult(n, True, next(iter(faults.EXPECTED_REASONS[n])), "d") for n in FAULT_NAMES]
    monkeypatch.setattr(faults, "run_faults", lambda *a, **k: results)
    args = argparse.Namespace(only=None, out=None, json=str(tmp_path / "f.json"), cases=1)
    assert faults.cmd_faults(args) == ExitCode.PASS
    out = capsys.readouterr().out
    assert "6/6 faults caught" in out and "presend_duplicated_distractor" in out
    assert (tmp_path / "f.json").is_file()
    monkeypatch.setattr(
        faults, "run_faults", lambda *a, **k: [*results[:5], FaultResult(FAULT_NAMES[5], False, "x")]
    )
    assert faults.cmd_faults(args) == ExitCode.FAIL


def test_add_parsers_registers_faults() -> None:
    parser = argparse.ArgumentParser()
    faults.add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["faults", "--only", "window-catalog,gateway-tail-cut"])
    assert args.func is faults.cmd_faults and args.only == "window-catalog,gateway-tail-cut"


@pytest.mark.smoke_model
def test_all_six_faults_caught_on_the_embedded_model(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    results = run_faults(out_dir=tmp_path / "faults", n_cases=1)
    assert [r.fault for r in results] == list(FAULT_NAMES)
    for r in results:
        assert r.caught, r
        assert r.reason in faults.EXPECTED_REASONS[r.fault], r
        assert r.outcomes and set(r.outcomes) == {"system_fail"}, r  # never scored as a model fail
    by = {r.fault: r for r in results}
    assert "trusting the catalog instead: ['overflow']" in by["window-catalog"].detail
    assert "evidence shifted by up to 0 tokens" not in by["tokenizer-upgrade"].detail
    # the records of every run are kept, clean reference included
    assert (tmp_path / "faults" / "clean-reference" / "records").is_dir()

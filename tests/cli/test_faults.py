"""Fault injection (DESIGN.md §4 and issue #35): each of the seven faults is caught by name, never scored
as a model error.

The pre-send gate is tested on real tokenizers without a model; the end-to-end run of all seven faults on
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
    build_frame,
    build_layouts,
    load_tokenizer,
    parse_positions,
)
from depthgate.layout.templates import ChatTemplate, load_chat_template, raw_frame
from depthgate.spec.cases import Suite
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
    frame = build_frame(suite, tok, options, tmp / f"{name}.parquet")
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
    assert "7/7 faults caught" in out and "presend_duplicated_distractor" in out and "engine_crash" in out
    assert (tmp_path / "f.json").is_file()
    monkeypatch.setattr(
        faults, "run_faults", lambda *a, **k: [*results[:6], FaultResult(FAULT_NAMES[6], False, "x")]
    )
    assert faults.cmd_faults(args) == ExitCode.FAIL


def test_add_parsers_registers_faults() -> None:
    parser = argparse.ArgumentParser()
    faults.add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["faults", "--only", "window-catalog,gateway-tail-cut"])
    assert args.func is faults.cmd_faults and args.only == "window-catalog,gateway-tail-cut"


@pytest.mark.smoke_model
def test_all_seven_faults_caught_on_the_embedded_model(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    results = run_faults(out_dir=tmp_path / "faults", n_cases=1)
    assert [r.fault for r in results] == list(FAULT_NAMES)
    for r in results:
        assert r.caught, r
        assert r.reason in faults.EXPECTED_REASONS[r.fault], r
        if r.fault != "engine-crash":  # the crash is an infra_error, re-sent: no scored outcome
            assert r.outcomes and set(r.outcomes) == {"system_fail"}, r  # never scored as a model fail
    by = {r.fault: r for r in results}
    assert "SIGSEGV" in by["engine-crash"].detail and "resume sent" in by["engine-crash"].detail
    assert "trusting the catalog instead: ['overflow']" in by["window-catalog"].detail
    assert "evidence shifted by up to 0 tokens" not in by["tokenizer-upgrade"].detail
    # the records of every run are kept, clean reference included
    assert (tmp_path / "faults" / "clean-reference" / "records").is_dir()


# ---- issue #10, item 6: pre-send checks wired to the system's own values ----------------------------


def _double_bos(row: dict[str, Any], tok: Tokenizer) -> dict[str, Any]:
    """A pipeline bug after the build: the prompt (whose template already rendered BOS) is re-encoded
    with ``add_special_tokens`` on, so the tokenizer adds a second BOS."""
    return {
        **row,
        "add_special_tokens": True,
        "token_ids": tok.encode(row["text"], add_special_tokens=True).tolist(),
    }


@pytest.fixture(scope="module")
def llama2_chat(shared_dir: Path) -> Any:
    # Renders `{{ bos_token }}[INST] ...`; bos_token "<s>" comes from the sibling tokenizer_config.json.
    return load_chat_template(
        shared_dir / "tokenizers" / "llama2-tinyllama" / "chat_template.llama-2-chat.jinja"
    )


def test_template_bos_plus_added_bos_is_doubled_bos(
    tmp_path: Path, suite: Suite, llama2: Tokenizer, llama2_chat: Any
) -> None:
    """The doubled-BOS check runs without anyone passing a BOS id: the tokenizer's own is used."""
    assert llama2.bos_id == 1
    # The builder refuses the fault itself: a template that writes BOS literally while its bos_token is
    # unknown to the frame (so add_special_tokens stays on) is `doubled_bos` at build time.
    assert "bos_token + '[INST] '" in llama2_chat.source
    blind = ChatTemplate(
        source=llama2_chat.source.replace("bos_token + '[INST] '", "'<s>[INST] '"), path="<literal-bos>"
    )
    out = tmp_path / "blind.parquet"
    summary = build_layouts(
        suite, llama2, BuildOptions(lengths=[512], positions=parse_positions(["0.5"]), template=blind), out
    )
    assert set(summary["reason_code"].to_list()) == {"doubled_bos"}
    # After the build, as a pipeline bug would: the pre-send gate names it.
    built = _build(tmp_path, suite, llama2, "chat", template=llama2_chat)
    assert built["add_special_tokens"].to_list() == [False] * built.height
    faulty = pl.DataFrame([_double_bos(r, llama2) for r in built.iter_rows(named=True)], schema=LAYOUT_SCHEMA)
    assert all(ids[:2] == [1, 1] for ids in faulty["token_ids"].to_list())
    gated = _guard(faulty, llama2, suite, template_digest=llama2_chat.digest)
    assert set(gated["reason_code"].to_list()) == {"presend_doubled_bos"}, gated["reason"].to_list()
    # The clean build passes the same gate.
    clean = _guard(built, llama2, suite, template_digest=llama2_chat.digest)
    assert set(clean["status"].to_list()) == {"ok"}, clean["reason"].to_list()


def test_raw_arm_template_digest_is_the_systems_not_the_files(
    clean: pl.DataFrame, tmp_path: Path, suite: Suite, llama2: Tokenizer, llama2_chat: Any
) -> None:
    """A raw-frame system gets the raw frame's digest and the frame it renders now, never the layout
    file's own column."""
    by_id = {c.id: c for c in suite.cases}
    chat_built = _build(tmp_path, suite, llama2, "chat", template=llama2_chat)
    gated = guard_layouts(
        chat_built, tokenizer=llama2, template=None, window=4096, max_output_tokens=12, cases=by_id
    )
    assert set(gated["reason_code"].to_list()) == {"presend_template_digest"}
    assert all("presend_frame_mismatch" in r for r in gated["reason"].to_list())
    # A preamble change keeps the raw digest: the frame check sees it.
    preamble = guard_layouts(
        clean,
        tokenizer=llama2,
        template=None,
        preamble="Answer briefly.",
        window=4096,
        max_output_tokens=12,
        cases=by_id,
    )
    assert set(preamble["reason_code"].to_list()) == {"presend_frame_mismatch"}
    same = guard_layouts(
        clean, tokenizer=llama2, template=None, window=4096, max_output_tokens=12, cases=by_id
    )
    assert set(same["status"].to_list()) == {"ok"}


def test_pinned_date_is_part_of_the_frame(tmp_path: Path, suite: Suite, shared_dir: Path) -> None:
    """The gate compares the date a layout was rendered with, not only the template source."""
    import datetime as dt

    tok = load_tokenizer(shared_dir / "tokenizers" / "llama3-from-gguf" / "tokenizer.json")
    path = (
        shared_dir
        / "tokenizers"
        / "chat-templates"
        / "llama.cpp-models-templates"
        / "meta-llama-Llama-3.2-3B-Instruct.jinja"
    )
    built_with = load_chat_template(path, bos_token="<|begin_of_text|>")
    later = load_chat_template(path, bos_token="<|begin_of_text|>", pinned_date=dt.date(2025, 3, 14))
    assert later.digest == built_with.digest
    built = _build(tmp_path, suite, tok, "l3", template=built_with)
    by_id = {c.id: c for c in suite.cases}
    gated = guard_layouts(
        built, tokenizer=tok, template=later, window=4096, max_output_tokens=12, cases=by_id
    )
    assert set(gated["reason_code"].to_list()) == {"presend_pinned_date"}
    assert "2024-07-26" in gated["reason"][0] and "2025-03-14" in gated["reason"][0]
    # Without cases (no frame re-render) the date is still compared.
    no_cases = guard_layouts(built, tokenizer=tok, template=later, window=4096, max_output_tokens=12)
    assert set(no_cases["reason_code"].to_list()) == {"presend_pinned_date"}
    same = guard_layouts(
        built, tokenizer=tok, template=built_with, window=4096, max_output_tokens=12, cases=by_id
    )
    assert set(same["status"].to_list()) == {"ok"}


class _Stop(Exception):
    pass


class _FakeBackend:
    name = "fake"
    window = 4096

    async def aclose(self) -> None:
        return None


def test_run_path_gates_with_the_systems_frame_and_bos(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suite: Suite, llama2: Tokenizer, llama2_chat: Any
) -> None:
    """`depthgate run` itself: the baseline is a raw-frame system whose layouts file was built under a
    chat template (caught as presend_template_digest; the old call compared the file with itself), the
    candidate's layouts carry a doubled BOS (caught as presend_doubled_bos; no BOS id was ever passed)."""
    import depthgate.run.backends as backends_mod
    import depthgate.run.runner as runner_mod
    from depthgate.commands.pipeline import run_matrix

    tok_path = llama2.path
    template_path = Path(llama2_chat.path)
    matrix = tmp_path / "m.toml"
    matrix.write_text(
        f"""name = "wiring"
suite = {{ kind = "builtin", cases = 3, seed = 0, language = "en" }}
lengths = [512]
positions = [0.0, 0.5, 1.0]

[decode]
max_tokens = 12
seeds = [0]

[baseline]
name = "raw"
backend = "vllm-server"
endpoint = "http://127.0.0.1:9"
model = "m"
tokenizer = "{tok_path.as_posix()}"

[candidate]
name = "chat"
backend = "vllm-server"
endpoint = "http://127.0.0.1:9"
model = "m"
tokenizer = "{tok_path.as_posix()}"
chat_template = "{template_path.as_posix()}"
""",
        encoding="utf-8",
    )
    run = tmp_path / "run"
    chat_built = _build(tmp_path, suite, llama2, "chat", template=llama2_chat)
    (run / "baseline").mkdir(parents=True)
    chat_built.write_parquet(run / "baseline" / "layouts.parquet")
    (run / "candidate").mkdir()
    pl.DataFrame(
        [_double_bos(r, llama2) for r in chat_built.iter_rows(named=True)], schema=LAYOUT_SCHEMA
    ).write_parquet(run / "candidate" / "layouts.parquet")
    captured: list[tuple[str, dict[str, Any]]] = []

    def fake_run_pairs(jobs: Any, *args: Any, **kwargs: Any) -> Any:
        captured.extend(jobs)
        raise _Stop

    monkeypatch.setattr(backends_mod, "make_backend", lambda *a, **k: _FakeBackend())
    monkeypatch.setattr(runner_mod, "run_pairs", fake_run_pairs)
    with pytest.raises(_Stop):
        run_matrix(matrix, run, controls=False, progress=False)
    reasons = {arm: {r["reason_code"] for a, r in captured if a == arm} for arm in ("baseline", "candidate")}
    assert reasons == {"baseline": {"presend_template_digest"}, "candidate": {"presend_doubled_bos"}}

"""Tokenizer and chat-template upgrade diffs on real tokenizers and templates, and the upgrade matrices."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.commands import diff
from depthgate.commands.diff import assert_no_reuse, diff_templates, diff_tokenizers
from depthgate.exceptions import ExitCode, TemplateError, VerificationError
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.layout.templates import load_chat_template
from depthgate.spec.cases import Suite
from depthgate.spec.loading import load_matrix
from depthgate.spec.suites import builtin_suite
from depthgate.spec.system import System

REPO = Path(__file__).resolve().parents[2]
POSITIONS = ["0", "0.5", "1"]


@pytest.fixture(scope="module")
def suite() -> Suite:
    return builtin_suite(3)


@pytest.fixture(scope="module")
def tok_dir(shared_dir: Path) -> Path:
    return shared_dir / "tokenizers"


def test_llama2_to_mistral_drifts_per_case_and_position(tok_dir: Path, suite: Suite, tmp_path: Path) -> None:
    report = diff_tokenizers(
        tok_dir / "llama2-tinyllama" / "tokenizer.json",
        tok_dir / "mistral-7b-v1" / "tokenizer.json",
        suite,
        [512],
        POSITIONS,
    )
    assert not report.identical
    assert len(report.layouts) == 9  # 3 cases x 1 length x 3 positions
    assert {(d.case_id, d.length, d.position) for d in report.layouts} == {
        (c.id, 512, p) for c in suite.cases for p in POSITIONS
    }
    assert report.drifted and report.max_evidence_shift > 0
    assert report.exit_code == ExitCode.FAIL
    for d in report.layouts:
        assert d.old_layout_id != d.new_layout_id
        assert d.old_total == d.new_total == 512  # the length contract holds under both
        assert {s.evidence_id for s in d.evidence} == {doc.id for doc in suite.case(d.case_id).evidence}
    # the JSON report carries the evidence token_start/token_end differences
    data = json.loads(report.write_json(tmp_path / "r.json").read_text())
    assert data["summary"]["drifted"] == len(report.drifted)
    span = data["layouts"][0]["spans"][0]
    assert {"old_start", "new_start", "start_shift", "end_shift", "length_change"} <= set(span)
    assert "layouts drift" in report.table()


def test_identical_tokenizers_say_so(tok_dir: Path, suite: Suite) -> None:
    path = tok_dir / "gpt2" / "tokenizer.json"
    report = diff_tokenizers(path, path, suite, [512], POSITIONS)
    assert report.identical and report.layouts == () and report.exit_code == ExitCode.PASS
    assert "identical" in report.table()


def test_same_encoding_different_file_is_no_drift_but_new_ids(
    tok_dir: Path, suite: Suite, tmp_path: Path
) -> None:
    source = tok_dir / "gpt2" / "tokenizer.json"
    copy = tmp_path / "tokenizer.json"
    copy.write_text(json.dumps(json.loads(source.read_text(encoding="utf-8")), indent=1), encoding="utf-8")
    report = diff_tokenizers(source, copy, suite, [512], POSITIONS)
    assert not report.identical and not report.drifted and report.exit_code == ExitCode.PASS
    assert all(d.old_layout_id != d.new_layout_id for d in report.layouts)
    assert "token-identical" in report.summary()


def test_padding_settings_upgrade_refuses_every_layout(tok_dir: Path, suite: Suite) -> None:
    # SmolLM's repository file pads to 192 tokens: every layout becomes impossible, and the diff says why.
    report = diff_tokenizers(
        tok_dir / "smollm" / "tokenizer.json",
        tok_dir / "smollm" / "tokenizer.repo-original.json",
        suite,
        [512],
        POSITIONS,
    )
    assert len(report.status_changes) == len(report.layouts) == 9
    assert {d.new_reason for d in report.layouts} == {"length_below_fixed_parts"}
    assert "ok→refused:length_below_fixed_parts" in report.table()


def test_assert_no_reuse_refuses_old_offsets(tok_dir: Path, suite: Suite, tmp_path: Path) -> None:
    old = load_tokenizer(tok_dir / "llama2-tinyllama" / "tokenizer.json")
    path = tmp_path / "layouts.parquet"
    build_layouts(suite, old, BuildOptions(lengths=[512], positions=parse_positions(["0.5"])), path)
    assert_no_reuse(path, old)  # same tokenizer: fine
    with pytest.raises(VerificationError) as info:
        assert_no_reuse(path, tok_dir / "mistral-7b-v1" / "tokenizer.json")
    assert "3/3 layouts" in str(info.value) and info.value.exit_code == ExitCode.VERIFY_FAILED
    template = tok_dir / "llama2-tinyllama" / "chat_template.jinja"
    with pytest.raises(VerificationError):
        assert_no_reuse(path, old, template=template, check_template=True)
    assert_no_reuse(path, old, template="raw", check_template=True)


def test_zephyr_to_llama2_chat_template_drift(tok_dir: Path, suite: Suite) -> None:
    family = tok_dir / "llama2-tinyllama"
    report = diff_templates(
        family / "chat_template.jinja",
        family / "chat_template.llama-2-chat.jinja",
        family / "tokenizer.json",
        suite,
        [512],
        POSITIONS,
    )
    assert report.kind == "template" and report.drifted
    # the frame changed: the context region starts elsewhere, evidence moves with it
    assert all(d.old_region != d.new_region for d in report.layouts)
    assert report.max_evidence_shift > 0
    raw = diff_templates(
        "raw", family / "chat_template.llama-2-chat.jinja", family / "tokenizer.json", suite, [512], ["0.5"]
    )
    assert raw.old == "raw" and len(raw.layouts) == 3 and raw.drifted


def test_identical_templates(tok_dir: Path, suite: Suite) -> None:
    t = tok_dir / "llama2-tinyllama" / "chat_template.jinja"
    report = diff_templates(t, t, tok_dir / "llama2-tinyllama" / "tokenizer.json", suite, [512], POSITIONS)
    assert report.identical and report.exit_code == ExitCode.PASS


def test_template_raising_under_one_version_is_named(tok_dir: Path, suite: Suite, tmp_path: Path) -> None:
    good = tok_dir / "llama2-tinyllama" / "chat_template.jinja"
    bad = tmp_path / "v2.jinja"
    bad.write_text(
        "{% if messages[0]['role'] == 'user' %}{{ raise_exception('a system turn is required') }}{% endif %}",
        encoding="utf-8",
    )
    tok = tok_dir / "llama2-tinyllama" / "tokenizer.json"
    with pytest.raises(TemplateError) as info:
        diff_templates(good, bad, tok, suite, [512], POSITIONS)
    assert "the new template raises" in str(info.value) and str(bad) in str(info.value)
    with pytest.raises(TemplateError) as info:
        diff_templates(bad, good, tok, suite, [512], POSITIONS)
    assert "the old template raises" in str(info.value)
    other = tmp_path / "v3.jinja"
    other.write_text("{{ raise_exception('never') }}", encoding="utf-8")
    with pytest.raises(TemplateError, match="both templates"):
        diff_templates(bad, other, tok, suite, [512], POSITIONS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    diff.add_parsers(parser.add_subparsers(dest="command"))
    return parser


def _cli(command: str, old: Path, new: Path, *options: str) -> int:
    """``command --old old --new new *options`` parsed as the CLI parses it, then run by its handler."""
    args = _parser().parse_args([command, "--old", str(old), "--new", str(new), *options])
    return int(args.func(args))


def test_cli_handlers(tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tok.json"
    llama2, mistral = tok_dir / "llama2-tinyllama", tok_dir / "mistral-7b-v1"
    small = ("--lengths", "512", "--cases", "2")
    code = _cli(
        "diff-tokenizer", llama2 / "tokenizer.json", mistral / "tokenizer.json", *small,
        "--positions", "0,1", "--out", str(out),
    )  # fmt: skip
    assert code == ExitCode.FAIL
    printed = capsys.readouterr().out
    assert "evidence Δstart" in printed and str(out) in printed
    assert json.loads(out.read_text())["summary"]["layouts"] == 4
    gpt2 = tok_dir / "gpt2" / "tokenizer.json"
    assert _cli("diff-tokenizer", gpt2, gpt2) == ExitCode.PASS
    assert "identical" in capsys.readouterr().out
    code = _cli(
        "diff-template", llama2 / "chat_template.jinja", llama2 / "chat_template.llama-2-chat.jinja", *small,
        "--tokenizer", str(llama2 / "tokenizer.json"), "--positions", "0.5",
        "--out", str(tmp_path / "tpl.json"),
    )  # fmt: skip
    assert code == ExitCode.FAIL
    assert json.loads((tmp_path / "tpl.json").read_text())["kind"] == "template"


def _system_fields(system: System) -> dict[str, object]:
    return dict(system.model_dump())


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        # A tokenizer upgrade ships with the model trained on it: model, endpoint and window follow.
        ("tokenizer-upgrade.toml", {"tokenizer", "model", "endpoint", "window"}),
        ("template-upgrade-embedded.toml", {"chat_template"}),
    ],
)
def test_upgrade_matrices_differ_only_in_what_they_upgrade(name: str, allowed: set[str]) -> None:
    matrix = load_matrix(REPO / "matrices" / name)
    base, cand = _system_fields(matrix.baseline), _system_fields(matrix.candidate)
    differing = {k for k in base if base[k] != cand[k]} - {"name"}
    assert differing and differing <= allowed
    if name == "tokenizer-upgrade.toml":
        assert "tokenizer" in differing  # two genuinely different tokenizer files


def test_tokenizer_upgrade_matrix_builds_both_arms(tmp_path: Path, tok_dir: Path) -> None:
    from depthgate.commands.cli import main

    # The matrix names the gzipped tokenizers shipped in tests/fixtures, relative to itself.
    matrix = REPO / "matrices" / "tokenizer-upgrade.toml"
    out = tmp_path / "out"
    assert main(["build", str(matrix), "--out", str(out)]) == ExitCode.PASS
    for arm in ("baseline", "candidate"):
        assert (out / arm / "layouts.parquet").is_file()


def test_gemma_turns_template_frames_every_case() -> None:
    from depthgate.layout.layouts import case_frame
    from depthgate.layout.templates import load_chat_template

    template = load_chat_template(REPO / "matrices" / "templates" / "gemma-turns.jinja")
    for case in builtin_suite(8).cases:
        frame = case_frame(case, template=template)
        assert frame.prefix.startswith("<start_of_turn>user\n") and frame.add_special_tokens
        assert "<end_of_turn>\n<start_of_turn>model\n" in frame.suffix


def test_template_change_that_keeps_counts_and_spans_is_drift(
    tok_dir: Path, suite: Suite, tmp_path: Path
) -> None:
    """Issue #10, item 12: Llama-3.2's date rendered with %B instead of %b changes one token (" Jul" →
    " July") while every count, region and span stays the same. The ids are compared, so it drifts."""
    source = (
        tok_dir / "chat-templates" / "llama.cpp-models-templates" / "meta-llama-Llama-3.2-3B-Instruct.jinja"
    )
    text = source.read_text(encoding="utf-8")
    assert text.count('strftime_now("%d %b %Y")') == 1
    old = tmp_path / "old.jinja"
    new = tmp_path / "new.jinja"
    old.write_text(text, encoding="utf-8")
    new.write_text(text.replace('strftime_now("%d %b %Y")', 'strftime_now("%d %B %Y")'), encoding="utf-8")
    report = diff_templates(
        load_chat_template(old, bos_token="<|begin_of_text|>"),
        load_chat_template(new, bos_token="<|begin_of_text|>"),
        tok_dir / "llama3-from-gguf" / "tokenizer.json",
        suite,
        [512],
        POSITIONS,
    )
    assert len(report.layouts) == 9
    for d in report.layouts:
        assert d.old_status == d.new_status == "ok"
        assert d.old_total == d.new_total and d.old_region == d.new_region
        assert not any(s.drifted for s in d.spans)
        assert d.first_token_diff is not None and d.tokens_changed == 1
    # Token 20 of every prompt (BOS, header, "Cutting Knowledge Date: ...", "Today Date: 26") is the month.
    first = report.layouts[0].first_token_diff
    assert {d.first_token_diff for d in report.layouts} == {first} == {20}
    hf = HFTokenizer.from_file(str(tok_dir / "llama3-from-gguf" / "tokenizer.json"))
    words = [
        hf.decode(
            [
                hf.encode(
                    load_chat_template(p, bos_token="").render([{"role": "user", "content": "x"}]),
                    add_special_tokens=False,
                ).ids[first - 1]
            ]
        )
        for p in (old, new)
    ]
    assert words == [" Jul", " July"]
    assert report.drifted and report.exit_code == ExitCode.FAIL
    assert "token-identical" not in report.summary()
    assert f"9 with other token ids (first at token {first})" in report.summary()
    data = report.to_dict()
    assert data["summary"]["ids_changed"] == 9 and data["layouts"][0]["ids_changed"]
    assert f"1 differ from token {first}" in report.table()

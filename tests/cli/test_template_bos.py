"""Issue #37, item 6 (BOS silently missing), through the CLI: a chat template that writes
``{{ bos_token }}``, given without a ``tokenizer_config.json`` beside it, rendered an empty BOS; with a
tokenizer whose post-processor adds none (the Llama-3 tokenizer rebuilt from its GGUF) every layout
started without the model's BOS and the build said nothing. It is refused now (exit 20, naming the
template, ``bos_token`` and the fix) before anything is written; with the config beside it the layouts
start with the BOS; a tokenizer that adds the BOS itself needs no config."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from fixtures_paths import llamacpp_templates_dir, tokenizer_configs_dir, tokenizers_dir
from helpers import stub_matrix

LLAMA3 = tokenizers_dir() / "llama3-from-gguf" / "tokenizer.json"
BEGIN_OF_TEXT = 128000


def _build(tmp: Path, tokenizer: Path, template: Path) -> list[str]:
    return [
        "build",
        "--tokenizer",
        str(tokenizer),
        "--chat-template",
        str(template),
        "--cases",
        "2",
        "--lengths",
        "600",
        "--positions",
        "0,1",
        "--out",
        str(tmp / "out"),
    ]


@pytest.mark.parametrize(
    "source",
    [
        llamacpp_templates_dir() / "meta-llama-Llama-3.1-8B-Instruct.jinja",
        tokenizer_configs_dir() / "gemma-3-chat_template.json",  # a chat_template.json naming no BOS
    ],
    ids=["llama-3.1-jinja", "gemma-3-chat_template.json"],
)
def test_a_bos_template_without_its_config_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: Path
) -> None:
    template = tmp_path / "tpl" / source.name  # alone in its folder: no tokenizer_config.json beside it
    template.parent.mkdir()
    shutil.copy(source, template)
    assert main(_build(tmp_path, LLAMA3, template)) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert str(template) in err and "bos_token" in err and "tokenizer_config.json beside the template" in err
    assert not (tmp_path / "out").exists()


def test_the_config_beside_the_template_gives_the_bos(tmp_path: Path) -> None:
    template = tmp_path / "tpl" / "chat_template.jinja"
    template.parent.mkdir()
    shutil.copy(llamacpp_templates_dir() / "meta-llama-Llama-3.1-8B-Instruct.jinja", template)
    shutil.copy(
        tokenizer_configs_dir() / "Meta-Llama-3-8B-Instruct-tokenizer_config.json",
        template.parent / "tokenizer_config.json",
    )
    assert main(_build(tmp_path, LLAMA3, template)) == ExitCode.PASS
    layouts = pl.read_parquet(tmp_path / "out" / "layouts.parquet")
    assert layouts.height == 4 and set(layouts["status"]) == {"ok"}
    assert {int(ids[0]) for ids in layouts["token_ids"]} == {BEGIN_OF_TEXT}


def test_a_tokenizer_that_adds_the_bos_needs_no_config(tmp_path: Path) -> None:
    """TinyLlama's post-processor adds ``<s>``: the template alone renders no BOS, the tokenizer adds it."""
    family = tokenizers_dir() / "llama2-tinyllama"
    template = tmp_path / "tpl" / "chat_template.jinja"
    template.parent.mkdir()
    shutil.copy(family / "chat_template.llama-2-chat.jinja", template)
    assert "bos_token" in template.read_text(encoding="utf-8")
    assert main(_build(tmp_path, family / "tokenizer.json", template)) == ExitCode.PASS
    layouts = pl.read_parquet(tmp_path / "out" / "layouts.parquet")
    assert {int(ids[0]) for ids in layouts["token_ids"]} == {1}  # <s>


def test_run_refuses_it_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = tmp_path / "tpl" / "llama31.jinja"
    template.parent.mkdir()
    shutil.copy(llamacpp_templates_dir() / "meta-llama-Llama-3.1-8B-Instruct.jinja", template)
    text = stub_matrix(
        "bos-missing",
        where='endpoint = "http://127.0.0.1:9"',
        tokenizer=LLAMA3,
        arm=f'chat_template = "{template}"',
    )
    matrix = tmp_path / "m.toml"
    matrix.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    assert main(["run", str(matrix), "--out", str(out)]) == ExitCode.BAD_INPUT
    assert "bos_token" in capsys.readouterr().err
    assert not out.exists()

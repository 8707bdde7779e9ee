"""Conversation layouts (issue 25) built end to end on real tokenizers with real chat templates: the
whole conversation is the template's own rendering (re-rendered per layout during the build), ids ==
encode(text) under the *Python* `tokenizers` wheel, exact length, evidence spans and turn spans from
the final offsets, the evidence in the turn the layout records (and in turn K at ``@turn:K``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.exceptions import InputError, SpecError, TemplateError
from depthgate.layout.conversation import TURN_LEADS, Conversation
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import (
    BuildOptions,
    build_layouts,
    load_tokenizer,
    parse_positions,
)
from depthgate.layout.templates import load_chat_template
from depthgate.spec.suites import builtin_suite
from fixtures_paths import llamacpp_templates_dir, reference_tokenizer, tokenizer_configs_dir, tokenizers_dir

TOK = tokenizers_dir()
TPL = llamacpp_templates_dir()
CONFIGS = tokenizer_configs_dir()

# (tokenizer family, chat template, bos, eos). Qwen2.5 (byte-level BPE) and Phi-3.5 (SentencePiece)
# templates are paired with the fixture tokenizer of the same kind: the split is the template's.
PAIRS = [
    ("smollm", TOK / "smollm" / "chat_template.jinja", None, None),
    ("llama2-tinyllama", TOK / "llama2-tinyllama" / "chat_template.jinja", None, None),
    ("llama2-tinyllama", TOK / "llama2-tinyllama" / "chat_template.llama-2-chat.jinja", None, None),
    ("mistral-7b-v1", TOK / "mistral-7b-v1" / "chat_template.jinja", None, None),
    ("mistral-7b-v1", TOK / "mistral-7b-v1" / "chat_template.v0.1.jinja", None, None),
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.3-70B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("gpt2", CONFIGS / "Qwen2.5-tokenizer_config.json", None, None),
    ("llama2-tinyllama", TPL / "microsoft-Phi-3.5-mini-instruct.jinja", None, None),
    ("llama2-tinyllama", CONFIGS / "gemma-3-chat_template.json", None, None),
    ("llama2-tinyllama", TPL / "google-gemma-2-2b-it.jinja", None, None),
]
POSITIONS = parse_positions(["0", "0.5", "1", "@turn:1", "@turn:2", "@turn:5"])


def _hf(family: str) -> HFTokenizer:
    return reference_tokenizer(family)


def _build(
    family: str, template: Path, bos: str | None, eos: str | None, out: Path, **kw: object
) -> pl.DataFrame:
    tok = load_tokenizer(TOK / family / "tokenizer.json")
    chat = load_chat_template(template, bos_token=bos, eos_token=eos)
    options = BuildOptions(
        lengths=[1024, 2048], positions=POSITIONS, template=chat, conversation=Conversation(5), **kw
    )
    build_layouts(builtin_suite(3), tok, options, out)
    assert check_layouts(out, tok).ok
    return pl.read_parquet(out)


@pytest.mark.parametrize(
    ("family", "template", "bos", "eos"), PAIRS, ids=[f"{f}-{t.stem}" for f, t, _, _ in PAIRS]
)
def test_conversation_layouts_meet_the_contract(
    family: str, template: Path, bos: str | None, eos: str | None, tmp_path: Path
) -> None:
    frame = _build(family, template, bos, eos, tmp_path / "layouts.parquet")
    assert frame.height == 3 * 2 * len(POSITIONS)
    hf = _hf(family)
    for row in frame.iter_rows(named=True):
        what = (family, row["target_tokens"], row["position"])
        assert row["status"] == "ok", (*what, row["reason"])
        enc = hf.encode(row["text"], add_special_tokens=row["add_special_tokens"])
        assert enc.ids == list(row["token_ids"]), what
        assert len(enc.ids) == row["target_tokens"] == row["total_tokens"], what
        turns = row["turn_spans"]
        assert [t["turn"] for t in turns] == [1, 2, 3, 4, 5], what
        assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user"], what
        assert turns[0]["token_start"] == row["region_start"] and turns[-1]["token_end"] == row["region_end"]
        for prev, turn in itertools.pairwise(turns):
            # Between two turns' contents: the template's separator, ending with the next turn's lead.
            between = row["text"][prev["char_end"] : turn["char_start"]]
            assert between.endswith(TURN_LEADS[turn["role"]]), what
            assert prev["token_end"] <= turn["token_start"], what
        # The moving block (it starts at actual_offset) is inside the turn the layout records.
        home = turns[row["turn"] - 1]
        block = next(s for s in row["evidence_spans"] if s["token_start"] == row["actual_offset"])
        assert home["token_start"] <= block["token_start"] < block["token_end"] <= home["token_end"], what
        assert home["char_start"] <= block["char_start"] < block["char_end"] <= home["char_end"], what
        if row["position"].startswith("@turn:"):
            assert row["turn"] == int(row["position"].split(":")[1]), what
    # Depth is measured over the whole conversation.
    assert set(frame.filter(pl.col("position") == "0")["turn"]) == {1}
    assert set(frame.filter(pl.col("position") == "1")["turn"]) == {5}


def test_fast_conversation_layouts_equal_full_ones(tmp_path: Path) -> None:
    args = (
        "llama3-from-gguf",
        TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
    )
    full = _build(*args, tmp_path / "full.parquet")
    fast = _build(*args, tmp_path / "fast.parquet", verification="fast")
    cols = ["layout_id", "token_ids", "text", "turn", "turn_spans", "evidence_spans"]
    assert full.select(cols).equals(fast.select(cols))


def test_conversation_needs_a_template_and_a_turn_label(tmp_path: Path) -> None:
    tok = load_tokenizer(TOK / "gpt2" / "tokenizer.json")
    with pytest.raises(SpecError, match="needs a chat template"):
        build_layouts(
            builtin_suite(1),
            tok,
            BuildOptions(lengths=[1024], positions=POSITIONS, conversation=Conversation(3)),
            tmp_path / "l.parquet",
        )
    with pytest.raises(InputError, match="not a turn"):
        parse_positions(["@turn:0"])
    with pytest.raises(SpecError, match="odd number of turns"):
        Conversation(4)


def test_template_stripping_reasoning_refuses_the_build(tmp_path: Path) -> None:
    tok = load_tokenizer(TOK / "llama3-from-gguf" / "tokenizer.json")
    chat = load_chat_template(
        TPL / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", bos_token="<｜begin▁of▁sentence｜>"
    )
    options = BuildOptions(lengths=[1024], positions=POSITIONS, template=chat, conversation=Conversation(3))
    with pytest.raises(TemplateError, match="strips reasoning"):
        build_layouts(builtin_suite(1), tok, options, tmp_path / "l.parquet")
    assert not (tmp_path / "l.parquet").exists()

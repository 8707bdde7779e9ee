"""MRCR cases in conversation layouts (issue 25 item 3), exact as every conversation layout: on three
tokenizer/template pairs, ids == encode(text) under the Python `tokenizers` wheel, exact length, the
needles in transcript order with the asked one k-th at every position (depths, ``@turn:K``, spaced),
each needle's span on its text, and the distractor replies spread over the turns."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.layout.conversation import Conversation
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.layout.templates import load_chat_template
from depthgate.spec.mrcr import mrcr_suite
from fixtures_paths import llamacpp_templates_dir, tokenizer_configs_dir, tokenizers_dir

ROOT = Path(__file__).resolve().parents[2]
TOK = tokenizers_dir()
TPL = llamacpp_templates_dir()
PAIRS = [
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("gpt2", tokenizer_configs_dir() / "Qwen2.5-tokenizer_config.json", None, None),
    ("llama2-tinyllama", ROOT / "matrices" / "templates" / "gemma-turns.jinja", None, None),
]
POSITIONS = ["0", "0.5", "1", "@turn:2", "@turn:5", "0.5~40tok"]


@pytest.mark.parametrize(("family", "template", "bos", "eos"), PAIRS, ids=[p[0] for p in PAIRS])
def test_mrcr_conversation_layouts_are_exact(
    family: str, template: Path, bos: str | None, eos: str | None, tmp_path: Path
) -> None:
    suite = mrcr_suite(2, 0, needles=4, k=3)
    tok = load_tokenizer(TOK / family / "tokenizer.json")
    options = BuildOptions(
        lengths=[1024],
        positions=parse_positions(POSITIONS),
        template=load_chat_template(template, bos_token=bos, eos_token=eos),
        conversation=Conversation(5),
    )
    out = tmp_path / "layouts.parquet"
    build_layouts(suite, tok, options, out)
    assert check_layouts(out, tok).ok
    hf = HFTokenizer.from_file(str(TOK / family / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    frame = pl.read_parquet(out)
    assert frame.height == 2 * len(POSITIONS) and set(frame["status"]) == {"ok"}, frame["reason"].to_list()
    cases = {c.id: c for c in suite.cases}
    for row in frame.iter_rows(named=True):
        case = cases[row["case_id"]]
        assert hf.encode(row["text"], add_special_tokens=row["add_special_tokens"]).ids == list(
            row["token_ids"]
        )
        assert row["total_tokens"] == 1024
        needles = sorted(
            (s for s in row["evidence_spans"] if s["evidence_id"].startswith(f"{case.id}/n")),
            key=lambda s: s["token_start"],
        )
        # Transcript order at every position: the asked needle (supports "answer") is the 3rd.
        assert [s["evidence_id"] for s in needles] == [d.id for d in case.decisive]
        assert case.decisive[2].supports == ["answer"]
        for span, doc in zip(needles, case.decisive, strict=True):
            assert row["text"][span["char_start"] : span["char_end"]].strip() == doc.text.strip()
        if row["position"].startswith("@turn:"):
            home = row["turn_spans"][int(row["position"][6:]) - 1]
            assert (
                home["token_start"]
                <= needles[0]["token_start"]
                <= needles[-1]["token_end"]
                <= home["token_end"]
            )
        if row["position"] == "0.5~40tok":
            assert min(row["evidence_gaps"]) >= 20
        # The other topics' replies (forbidden codes) lie in more than one turn.
        turns = row["turn_spans"]
        distractor_turns = {
            next(t["turn"] for t in turns if t["token_start"] <= s["token_start"] < t["token_end"])
            for s in row["evidence_spans"]
            if "/d" in s["evidence_id"]
        }
        assert len(distractor_turns) >= 2, distractor_turns


def test_mrcr_cases_build_as_one_user_turn_too(tmp_path: Path) -> None:
    """``pattern = "mrcr"`` without a conversation: the needles in order in the one slot, exact."""
    suite = mrcr_suite(2, 1, needles=3, k=1)
    tok = load_tokenizer(TOK / "smollm" / "tokenizer.json")
    options = BuildOptions(
        lengths=[768],
        positions=parse_positions(["0", "1"]),
        template=load_chat_template(TOK / "smollm" / "chat_template.jinja"),
    )
    out = tmp_path / "layouts.parquet"
    build_layouts(suite, tok, options, out)
    assert check_layouts(out, tok).ok
    frame = pl.read_parquet(out)
    assert set(frame["status"]) == {"ok"} and "turn_spans" not in frame.columns
    for row in frame.iter_rows(named=True):
        needles = sorted(
            (s for s in row["evidence_spans"] if "/n" in s["evidence_id"]), key=lambda s: s["token_start"]
        )
        assert [s["evidence_id"][-2:] for s in needles] == ["n1", "n2", "n3"]

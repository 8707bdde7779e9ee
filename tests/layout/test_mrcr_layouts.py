"""MRCR cases in conversation layouts (issue 25 item 3): each needle is its own exchange — the request
ends a user turn's content, the reply is the whole content of the next assistant turn — with filler turns
around the exchanges and the question in the last user turn. On Llama-3, Qwen2 and Gemma templates: ids ==
encode(text) under the Python `tokenizers` wheel, exact length, every request in a user turn's span and
its reply in the next assistant turn's span, the needles in transcript order with the asked one k-th at
every position (depths, ``@turn:K``, spaced), the recorded turn the asked reply's, the pre-send gate and
the oracle as for every layout."""

from __future__ import annotations

import functools
from pathlib import Path

import polars as pl
import pytest

from depthgate.judge.scoring import CaseOracle
from depthgate.layout.conversation import Conversation
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.layout.presend import guard_layouts
from depthgate.layout.templates import load_chat_template
from depthgate.spec.mrcr import exchange_texts, mrcr_suite
from fixtures_paths import llamacpp_templates_dir, reference_tokenizer, tokenizer_configs_dir, tokenizers_dir

ROOT = Path(__file__).resolve().parents[2]
TOK = tokenizers_dir()
TPL = llamacpp_templates_dir()
PAIRS = [
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("gpt2", tokenizer_configs_dir() / "Qwen2.5-tokenizer_config.json", None, None),
    ("llama2-tinyllama", tokenizer_configs_dir() / "gemma-3-chat_template.json", None, None),
    ("llama2-tinyllama", ROOT / "matrices" / "templates" / "gemma-turns.jinja", None, None),
]
POSITIONS = ["0", "0.5", "1", "@turn:1", "@turn:5", "0.5~40tok"]
NEEDLES, K, TURNS = 4, 3, 5


def _build(family: str, template: Path, bos: str | None, eos: str | None, out: Path) -> pl.DataFrame:
    tok = load_tokenizer(TOK / family / "tokenizer.json")
    options = BuildOptions(
        lengths=[1024, 1536],
        positions=parse_positions(POSITIONS),
        template=load_chat_template(template, bos_token=bos, eos_token=eos),
        conversation=Conversation(TURNS),
    )
    build_layouts(mrcr_suite(2, 0, needles=NEEDLES, k=K), tok, options, out)
    assert check_layouts(out, tok).ok
    return pl.read_parquet(out)


def _turn_of(turns: list[dict[str, int]], span: dict[str, int]) -> dict[str, int]:
    """The turn whose content span holds ``span`` (token and char range alike)."""
    (home,) = [
        t
        for t in turns
        if t["token_start"] <= span["token_start"] < span["token_end"] <= t["token_end"]
        and t["char_start"] <= span["char_start"] < span["char_end"] <= t["char_end"]
    ]
    return home


@pytest.mark.parametrize(
    ("family", "template", "bos", "eos"), PAIRS, ids=[f"{p[0]}-{p[1].stem}" for p in PAIRS]
)
def test_mrcr_needles_are_exchanges_across_turns(
    family: str, template: Path, bos: str | None, eos: str | None, tmp_path: Path
) -> None:
    suite = mrcr_suite(2, 0, needles=NEEDLES, k=K)
    frame = _build(family, template, bos, eos, tmp_path / "layouts.parquet")
    assert frame.height == 2 * 2 * len(POSITIONS) and set(frame["status"]) == {"ok"}, frame[
        "reason"
    ].to_list()
    hf = reference_tokenizer(family)
    cases = {c.id: c for c in suite.cases}
    for row in frame.iter_rows(named=True):
        case, text, turns = cases[row["case_id"]], row["text"], row["turn_spans"]
        assert hf.encode(text, add_special_tokens=row["add_special_tokens"]).ids == list(row["token_ids"])
        assert row["total_tokens"] == row["target_tokens"]
        # 5 filler turns and 2 per needle exchange; user/assistant alternate, the question's turn last
        assert len(turns) == TURNS + 2 * NEEDLES
        assert [t["role"] for t in turns] == [
            "user" if i % 2 == 0 else "assistant" for i in range(len(turns))
        ]
        spans = {s["evidence_id"]: s for s in row["evidence_spans"]}
        homes = []
        for doc in case.decisive:
            request_text, reply_text = exchange_texts(doc.text)
            request, reply = spans[f"{doc.id}/request"], spans[doc.id]
            assert request["kind"] == "request" and reply["kind"] == "evidence"
            assert text[request["char_start"] : request["char_end"]] == request_text
            assert text[reply["char_start"] : reply["char_end"]] == reply_text
            asks, answers = _turn_of(turns, request), _turn_of(turns, reply)
            # the request ends a user turn's content; the reply is the whole next assistant turn
            assert asks["role"] == "user" and answers["role"] == "assistant"
            assert answers["turn"] == asks["turn"] + 1
            assert request["char_end"] == asks["char_end"] and request["token_end"] == asks["token_end"]
            assert text[answers["char_start"] : answers["char_end"]] == reply_text
            assert (reply["token_start"], reply["token_end"]) == (
                answers["token_start"],
                answers["token_end"],
            )
            homes.append(answers["turn"])
        # transcript order at every position; the asked (3rd) needle's reply turn is the recorded turn
        assert homes == sorted(homes) and case.decisive[K - 1].supports == ["answer"]
        assert row["turn"] == homes[K - 1]
        # the question in the final user turn, after every exchange
        assert homes[-1] < len(turns)
        if row["position"].startswith("@turn:"):
            first = _turn_of(turns, spans[f"{case.decisive[0].id}/request"])
            assert first["turn"] == int(row["position"].removeprefix("@turn:"))
        if row["position"] == "0.5~40tok":
            # filler opens the user turn before each later request
            for doc in case.decisive[1:]:
                request = spans[f"{doc.id}/request"]
                assert request["token_start"] - _turn_of(turns, request)["token_start"] >= 20
        # the other topics' replies (forbidden codes) lie in more than one turn
        distractor_turns = {
            _turn_of(turns, s)["turn"] for s in row["evidence_spans"] if s["kind"] == "distractor"
        }
        assert len(distractor_turns) >= 2, distractor_turns


def test_exchange_layouts_pass_the_presend_gate_and_the_oracle_is_unchanged(tmp_path: Path) -> None:
    family, template, bos, eos = PAIRS[0]
    suite = mrcr_suite(2, 0, needles=NEEDLES, k=K)
    frame = _build(family, template, bos, eos, tmp_path / "layouts.parquet")
    chat = load_chat_template(template, bos_token=bos, eos_token=eos)
    guard = functools.partial(
        guard_layouts,
        frame,
        tokenizer=load_tokenizer(TOK / family / "tokenizer.json"),
        window=4096,
        max_output_tokens=12,
        template=chat,
        cases={c.id: c for c in suite.cases},
    )
    gated = guard(conversation=Conversation(TURNS))
    assert set(gated["status"]) == {"ok"}, gated["reason"].to_list()
    # A layout of exchanges checked as a text-block conversation of 5 turns: another shape.
    text_block = guard(conversation=Conversation(TURNS + 2 * NEEDLES + 2))
    assert set(text_block["reason_code"]) == {"presend_frame_mismatch"}
    # The oracle reads the codes, as before: the asked reply's passes, another reply's fails.
    case = suite.cases[0]
    evidence = {s["evidence_id"] for s in frame["evidence_spans"][0] if s["kind"] == "evidence"}
    assert evidence == {d.id for d in case.decisive}
    oracle = CaseOracle(case)
    asked = case.required_claims[0].value
    other = next(c.value for c in case.forbidden_claims if c.id.startswith("needle_"))
    assert oracle.score(f" {asked}.", evidence_ids_in_layout=evidence).outcome == "pass"
    assert oracle.score(f" {other}.", evidence_ids_in_layout=evidence).outcome != "pass"


def test_an_exchange_block_starts_in_a_user_turn_only(tmp_path: Path) -> None:
    """``@turn:2`` (an assistant turn) is refused by name for an MRCR case in a conversation."""
    tok = load_tokenizer(TOK / "smollm" / "tokenizer.json")
    options = BuildOptions(
        lengths=[1024],
        positions=parse_positions(["@turn:2"]),
        template=load_chat_template(TOK / "smollm" / "chat_template.jinja"),
        conversation=Conversation(TURNS),
    )
    build_layouts(mrcr_suite(1, 0, needles=2, k=1), tok, options, tmp_path / "layouts.parquet")
    frame = pl.read_parquet(tmp_path / "layouts.parquet")
    assert frame["reason_code"].to_list() == ["turn_not_user"]


def test_mrcr_cases_build_as_one_user_turn_too(tmp_path: Path) -> None:
    """``pattern = "mrcr"`` without a conversation: the needles in order in the one slot, as one text
    block each (request and reply together), exact."""
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
    texts = {d.id: d.text for c in suite.cases for d in c.decisive}
    for row in frame.iter_rows(named=True):
        needles = sorted(
            (s for s in row["evidence_spans"] if "/n" in s["evidence_id"]), key=lambda s: s["token_start"]
        )
        assert [s["evidence_id"][-2:] for s in needles] == ["n1", "n2", "n3"]
        assert all(row["text"][s["char_start"] : s["char_end"]] == texts[s["evidence_id"]] for s in needles)

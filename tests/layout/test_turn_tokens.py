"""``turn_tokens = N`` (issue 25 item 1, the turn-length target): the alternative to ``turns`` — each
length's conversation gets the odd number of turns nearest length / N (at least 3). The field changes the
layouts' turn counts per length, every layout stays exact (ids == encode(text) under the Python
``tokenizers`` wheel, exact length), the pre-send gate checks each layout against its own length's
conversation, and bad values are refused by file, field and fix."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from depthgate.commands.pipeline import arm_setup
from depthgate.exceptions import SpecError
from depthgate.layout.conversation import Conversation
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.layout.presend import guard_layouts
from depthgate.layout.templates import load_chat_template
from depthgate.spec.loading import load_matrix
from depthgate.spec.matrix import turns_for_length
from depthgate.spec.suites import builtin_suite
from fixtures_paths import reference_tokenizer, tokenizers_dir

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = ROOT / "matrices" / "conversation-embedded.toml"
TOK = tokenizers_dir()
TPL = TOK / "chat-templates" / "llama.cpp-models-templates"
GEMMA = ROOT / "matrices" / "templates" / "gemma-turns.jinja"


def test_the_turn_count_is_the_odd_number_nearest_length_over_n() -> None:
    # 768/256 = 3 → 3; 1024/256 = 4 (a tie between 3 and 5) → 5; 1100/256 = 4.3 → 5; 2048/256 = 8 → 9;
    # 1800/256 = 7.03 → 7; 500/256 = 1.95 → 3 (never under 3)
    assert [turns_for_length(n, 256) for n in (768, 1024, 1100, 1800, 2048, 500, 16)] == [3, 5, 5, 7, 9, 3, 3]
    for length in range(16, 5000, 7):
        for n in (5, 64, 256, 1000):
            turns, x = turns_for_length(length, n), length / n
            assert turns % 2 == 1 and turns >= 3
            # no odd count >= 3 is nearer (ties go up)
            assert all(abs(turns - x) <= abs(odd - x) for odd in range(3, 2 * int(x) + 5, 2)), (length, n)


def _matrix_file(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    text = CONVERSATION.read_text(encoding="utf-8")
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "m.toml"
    path.write_text(text, encoding="utf-8")
    return path


TURN_TOKENS = [("turns = 5\n", "turn_tokens = 256\n"), ("lengths = [768]", "lengths = [768, 1024, 1800]")]


def test_turn_tokens_changes_the_layouts_turn_counts_per_length(tmp_path: Path) -> None:
    """The same matrix built through the arm's build options with ``turns = 5`` and with
    ``turn_tokens = 256``: the turn counts follow the length with the field (3, 5, 7; 1800 tokens stay in
    the 2048 window) and are 5 at every length without it; every layout exact and of its target length,
    its turn spans in order."""
    counts: dict[str, dict[int, set[int]]] = {}
    hf = reference_tokenizer("llama2-tinyllama")
    for name, edits in (("turns", TURN_TOKENS[1:]), ("turn_tokens", TURN_TOKENS)):
        matrix = load_matrix(_matrix_file(tmp_path, *edits, ("n_min = 6", "n_min = 2")))
        system = matrix.baseline.model_copy(
            update={
                "tokenizer": str(TOK / "llama2-tinyllama" / "tokenizer.json"),
                "chat_template": str(GEMMA),
            }
        )
        setup = arm_setup("baseline", system, ROOT / "matrices")
        out = tmp_path / f"{name}.parquet"
        build_layouts(
            builtin_suite(2), setup.tokenizer, setup.build_options(matrix, "full", base_lengths=False), out
        )
        assert check_layouts(out, setup.tokenizer).ok
        frame = pl.read_parquet(out)
        assert frame.height == 2 * 3 * 3 and set(frame["status"]) == {"ok"}, frame["reason"].to_list()
        counts[name] = {}
        for row in frame.iter_rows(named=True):
            assert row["total_tokens"] == row["target_tokens"]
            assert hf.encode(row["text"], add_special_tokens=row["add_special_tokens"]).ids == list(
                row["token_ids"]
            )
            spans = row["turn_spans"]
            assert [s["turn"] for s in spans] == list(range(1, len(spans) + 1))
            assert [s["role"] for s in spans] == [
                "user" if k % 2 == 0 else "assistant" for k in range(len(spans))
            ]
            counts[name].setdefault(row["target_tokens"], set()).add(len(spans))
    assert counts["turns"] == {768: {5}, 1024: {5}, 1800: {5}}
    assert counts["turn_tokens"] == {768: {3}, 1024: {5}, 1800: {7}}


FAMILIES = [
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("gpt2", TOK / "chat-templates" / "tokenizer_configs" / "Qwen2.5-tokenizer_config.json", None, None),
    (
        "llama2-tinyllama",
        TOK / "chat-templates" / "tokenizer_configs" / "gemma-3-chat_template.json",
        None,
        None,
    ),
]


@pytest.mark.parametrize(("family", "template", "bos", "eos"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_turn_tokens_layouts_are_exact_and_pass_the_presend_gate(
    family: str, template: Path, bos: str | None, eos: str | None, tmp_path: Path
) -> None:
    """Built with ``Conversation(turn_tokens=300)`` at 1024, 2048 and 3000 tokens (3, 7 and 11 turns: 10
    is a tie, it goes up): exact under the Python wheel, the evidence at ``@turn:3`` inside turn 3; the
    pre-send gate passes each layout against its own length's conversation and refuses them against a
    fixed turn count."""
    tok = load_tokenizer(TOK / family / "tokenizer.json")
    chat = load_chat_template(template, bos_token=bos, eos_token=eos)
    conversation = Conversation(turn_tokens=300)
    options = BuildOptions(
        lengths=[1024, 2048, 3000],
        positions=parse_positions(["0.5", "@turn:3"]),
        template=chat,
        conversation=conversation,
    )
    suite = builtin_suite(2)
    out = tmp_path / "layouts.parquet"
    build_layouts(suite, tok, options, out)
    assert check_layouts(out, tok).ok
    frame = pl.read_parquet(out)
    assert set(frame["status"]) == {"ok"}, frame["reason"].to_list()
    hf = reference_tokenizer(family)
    for row in frame.iter_rows(named=True):
        assert row["total_tokens"] == row["target_tokens"]
        assert len(row["turn_spans"]) == {1024: 3, 2048: 7, 3000: 11}[row["target_tokens"]]
        assert hf.encode(row["text"], add_special_tokens=row["add_special_tokens"]).ids == list(
            row["token_ids"]
        )
        if row["position"] == "@turn:3":
            home = row["turn_spans"][2]
            first = min(row["evidence_spans"], key=lambda s: abs(s["token_start"] - row["actual_offset"]))
            assert row["turn"] == 3 and home["token_start"] <= first["token_start"] < home["token_end"]
    guard = {"tokenizer": tok, "template": chat, "window": 4096, "max_output_tokens": 12}
    cases = {c.id: c for c in suite.cases}
    gated = guard_layouts(frame, conversation=conversation, cases=cases, **guard)  # type: ignore[arg-type]
    assert set(gated["status"]) == {"ok"}, gated["reason"].to_list()
    fixed = guard_layouts(frame, conversation=Conversation(7), cases=cases, **guard)  # type: ignore[arg-type]
    refused = fixed.filter(pl.col("status") == "refused")
    assert set(refused["target_tokens"]) == {1024, 3000}
    assert set(refused["reason_code"]) == {"presend_frame_mismatch"}


@pytest.mark.parametrize(
    ("edits", "field", "message"),
    [
        ([("turns = 5\n", "turns = 5\nturn_tokens = 256\n")], "turn_tokens", "both set"),
        ([("turns = 5\n", "")], "turns", "neither turns nor turn_tokens"),
        ([("turns = 5\n", "turn_tokens = 0\n")], "turn_tokens", "not a positive number"),
        ([("turns = 5\n", "turn_tokens = -3\n")], "turn_tokens", "not a positive number"),
        ([("turns = 5\n", "turn_tokens = 2\n")], "turn_tokens", "over the limit of 255"),
        (
            [('shape = "conversation"\n', ""), ("turns = 5\n", "turn_tokens = 256\n")],
            "turn_tokens",
            '"single"',
        ),
        # 500 is the shortest built length (the short base): 3 turns there
        (
            [("turns = 5\n", "turn_tokens = 200\n"), ("[0.0, 0.5, 1.0]", '[0.0, "@turn:5"]')],
            "positions[1]",
            "500-token",
        ),
    ],
    ids=["both", "neither", "zero", "negative", "too-many-turns", "single-shape", "turn-beyond-shortest"],
)
def test_bad_turn_tokens_are_refused_by_field(
    tmp_path: Path, edits: list[tuple[str, str]], field: str, message: str
) -> None:
    path = _matrix_file(tmp_path, *edits)
    with pytest.raises(SpecError, match=message) as info:
        load_matrix(path)
    assert info.value.file == str(path) and info.value.field == field and info.value.fix


def test_turn_tokens_is_in_the_digest_only_when_set(tmp_path: Path) -> None:
    plain = load_matrix(CONVERSATION).canonical_json()
    assert '"turn_tokens"' not in plain
    matrix = load_matrix(_matrix_file(tmp_path, TURN_TOKENS[0]))
    assert matrix.turns is None and '"turn_tokens":256' in matrix.canonical_json().replace(" ", "")
    assert matrix.fewest_turns() == 3  # the 500-token short base


def test_a_conversation_takes_exactly_one_turn_count() -> None:
    for kwargs in ({}, {"turns": 5, "turn_tokens": 100}, {"turn_tokens": 0}):
        with pytest.raises(SpecError):
            Conversation(**kwargs)  # type: ignore[arg-type]
    conversation = Conversation(turn_tokens=256)
    assert [(c.turns, ls) for c, ls in conversation.batches([768, 1024, 1100, 2048])] == [
        (3, [768]),
        (5, [1024, 1100]),
        (9, [2048]),
    ]
    assert Conversation(5).batches([768, 2048]) == [(Conversation(5), [768, 2048])]

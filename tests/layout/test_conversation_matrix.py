"""``shape = "conversation"`` in a matrix (issue 25): parsed, validated with named errors, wired into
the arm's build options, and absent from the digest of single-slot matrices (their run ids unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.commands.pipeline import arm_setup
from depthgate.exceptions import SpecError
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import build_layouts
from depthgate.spec.loading import load_matrix
from depthgate.spec.suites import builtin_suite
from fixtures_paths import llamacpp_templates_dir, tokenizers_dir

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = ROOT / "matrices" / "conversation-embedded.toml"
SINGLE = ROOT / "matrices" / "template-upgrade-embedded.toml"


def _with_config(template: Path, folder: Path, bos: str, eos: str | None = None) -> Path:
    """``template`` copied into ``folder`` beside a tokenizer_config.json naming its BOS (a template that
    writes {{ bos_token }} with no BOS known is refused: issue #37)."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / template.name
    copy.write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    config = {"bos_token": bos, **({"eos_token": eos} if eos is not None else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return copy


def test_conversation_matrix_loads_and_builds_conversations(tmp_path: Path) -> None:
    matrix = load_matrix(CONVERSATION)
    assert matrix.shape == "conversation" and matrix.turns == 5
    # SmolLM's tokenizer under the Gemma turn template: the BOS the template writes is named beside it
    template = _with_config(ROOT / "matrices" / "templates" / "gemma-turns.jinja", tmp_path, "<|endoftext|>")
    system = matrix.baseline.model_copy(
        update={
            "tokenizer": str(ROOT / "tests/fixtures/tokenizers/smollm/tokenizer.json.gz"),
            "chat_template": str(template),
        }
    )
    options = arm_setup("baseline", system, CONVERSATION.parent).build_options(matrix, "full")
    assert options.conversation is not None and options.conversation.turns == 5


def test_single_slot_matrices_keep_their_digest() -> None:
    matrix = load_matrix(SINGLE)
    assert matrix.shape == "single" and matrix.turns is None
    assert '"shape"' not in matrix.canonical_json() and '"turns"' not in matrix.canonical_json()
    assert '"turns":5' in load_matrix(CONVERSATION).canonical_json().replace(" ", "")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("turns = 5", "turns = 4"), "odd number of turns"),
        (('shape = "conversation"\n', ""), 'turns is set but shape is "single"'),
        (('chat_template = "templates/gemma-turns.jinja"\n', ""), "rendered by a chat template"),
        # @turn:K: refused on a single-slot matrix and beyond the conversation's turns (issue 25 item 1)
        (("positions = [0.0, 0.5, 1.0]", 'positions = [0.0, "@turn:6"]'), r"positions\[1\].*has 5 turns"),
        (("positions = [0.0, 0.5, 1.0]", 'positions = ["@turn:0"]'), r"positions\[0\].*not a position"),
    ],
)
def test_bad_conversation_fields_are_named(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    text = CONVERSATION.read_text(encoding="utf-8")
    assert edit[0] in text
    path = tmp_path / "m.toml"
    path.write_text(text.replace(edit[0], edit[1], 1), encoding="utf-8")
    with pytest.raises(SpecError, match=message):
        load_matrix(path)


def test_turn_positions_need_a_conversation(tmp_path: Path) -> None:
    text = CONVERSATION.read_text(encoding="utf-8").replace(
        "positions = [0.0, 0.5, 1.0]", 'positions = ["@turn:3"]'
    )
    text = text.replace('shape = "conversation"\n', "").replace("turns = 5\n", "")
    path = tmp_path / "m.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError, match=r'positions\[0\].*by turn, but shape is "single"') as info:
        load_matrix(path)
    assert info.value.file == str(path) and "shape" in (info.value.fix or "")


TOK = tokenizers_dir()
TPL = llamacpp_templates_dir()
# (tokenizer, chat template, bos, eos): three tokenizer kinds, three template families.
TURN_PAIRS = [
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("smollm", TOK / "smollm" / "chat_template.jinja", None, None),
    ("llama2-tinyllama", ROOT / "matrices" / "templates" / "gemma-turns-v2.jinja", None, None),
]


@pytest.mark.parametrize(("family", "template", "bos", "eos"), TURN_PAIRS, ids=[p[0] for p in TURN_PAIRS])
def test_a_matrix_places_evidence_by_turn(
    family: str, template: Path, bos: str | None, eos: str | None, tmp_path: Path
) -> None:
    """``positions = ["@turn:K", …]`` in a conversation matrix: built through the arm's build options, every
    layout is exact (ids == encode(text) under the Python wheel, exact length) and its evidence block lies
    inside turn K's recorded span, token and char range alike."""
    text = CONVERSATION.read_text(encoding="utf-8").replace(
        "positions = [0.0, 0.5, 1.0]", 'positions = ["@turn:1", "@turn:2", "@turn:4", "@turn:5", 0.5]'
    )
    path = tmp_path / "m.toml"
    path.write_text(text, encoding="utf-8")
    matrix = load_matrix(path)
    assert matrix.position_values() == ["@turn:1", "@turn:2", "@turn:4", "@turn:5", "0.5"]
    if bos is not None:  # the model's BOS and EOS, named beside the template as a model folder has them
        template = _with_config(template, tmp_path / "template", bos, eos)
    system = matrix.baseline.model_copy(
        update={"tokenizer": str(TOK / family / "tokenizer.json"), "chat_template": str(template)}
    )
    setup = arm_setup("baseline", system, path.parent)
    options = setup.build_options(matrix, "full", base_lengths=False)
    out = tmp_path / "layouts.parquet"
    build_layouts(builtin_suite(3), setup.tokenizer, options, out)
    assert check_layouts(out, setup.tokenizer).ok
    hf = HFTokenizer.from_file(str(TOK / family / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    frame = pl.read_parquet(out)
    assert frame.height == 3 * 5 and set(frame["status"]) == {"ok"}
    for row in frame.iter_rows(named=True):
        assert hf.encode(row["text"], add_special_tokens=row["add_special_tokens"]).ids == list(
            row["token_ids"]
        )
        assert row["total_tokens"] == row["target_tokens"] == 768
        if not row["position"].startswith("@turn:"):
            continue
        k = int(row["position"].removeprefix("@turn:"))
        home = row["turn_spans"][k - 1]
        assert row["turn"] == home["turn"] == k
        block = [s for s in row["evidence_spans"] if s["token_start"] >= row["actual_offset"]]
        first = min(block, key=lambda s: s["token_start"])
        assert home["token_start"] <= first["token_start"] < first["token_end"] <= home["token_end"]
        assert home["char_start"] <= first["char_start"] < first["char_end"] <= home["char_end"]
        assert row["text"][first["char_start"] : first["char_end"]].strip() in row["text"]

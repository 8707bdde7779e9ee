"""``shape = "conversation"`` in a matrix (issue 25): parsed, validated with named errors, wired into
the arm's build options, and absent from the digest of single-slot matrices (their run ids unchanged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from depthgate.commands.pipeline import arm_setup
from depthgate.exceptions import SpecError
from depthgate.spec.loading import load_matrix

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = ROOT / "matrices" / "conversation-embedded.toml"
SINGLE = ROOT / "matrices" / "template-upgrade-embedded.toml"


def test_conversation_matrix_loads_and_builds_conversations() -> None:
    matrix = load_matrix(CONVERSATION)
    assert matrix.shape == "conversation" and matrix.turns == 5
    template = ROOT / "matrices" / "templates" / "gemma-turns.jinja"
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
    ],
)
def test_bad_conversation_fields_are_named(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    text = CONVERSATION.read_text(encoding="utf-8")
    assert edit[0] in text
    path = tmp_path / "m.toml"
    path.write_text(text.replace(edit[0], edit[1], 1), encoding="utf-8")
    with pytest.raises(SpecError, match=message):
        load_matrix(path)

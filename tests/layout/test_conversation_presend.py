"""The pre-send gate on conversation layouts (issue 25): the frame check compares a conversation layout
with the conversation the system's template renders now — prefix, suffix and, at the layout's recorded
turn spans, every separator between turns — not with a single-slot frame (whose prefix and suffix a
conversation shares, so a changed turn separator passed the old check unseen)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from depthgate.layout.conversation import TURN_LEADS, Conversation
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.layout.presend import guard_layouts
from depthgate.layout.templates import load_chat_template
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "matrices" / "templates" / "gemma-turns.jinja"
TOK = tokenizers_dir() / "llama2-tinyllama" / "tokenizer.json"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[pl.DataFrame, dict[str, object]]:
    suite = builtin_suite(2)
    tok = load_tokenizer(TOK)
    chat = load_chat_template(TEMPLATE)
    options = BuildOptions(
        lengths=[768],
        positions=parse_positions(["0.5", "@turn:2"]),
        template=chat,
        conversation=Conversation(5),
    )
    out = tmp_path_factory.mktemp("presend") / "layouts.parquet"
    build_layouts(suite, tok, options, out)
    guard = {
        "tokenizer": tok,
        "template": chat,
        "window": 2048,
        "max_output_tokens": 12,
        "cases": {c.id: c for c in suite.cases},
    }
    return pl.read_parquet(out), guard


def _guard(frame: pl.DataFrame, guard: dict[str, object], conversation: Conversation | None) -> pl.DataFrame:
    return guard_layouts(frame, conversation=conversation, **guard)  # type: ignore[arg-type]


def test_conversation_layouts_pass_their_own_frame(built: tuple[pl.DataFrame, dict[str, object]]) -> None:
    frame, guard = built
    gated = _guard(frame, guard, Conversation(5))
    assert gated.height == 4 and set(gated["status"]) == {"ok"}, gated["reason"].to_list()


def test_a_changed_turn_separator_is_a_frame_mismatch(built: tuple[pl.DataFrame, dict[str, object]]) -> None:
    """One separator's lead rewritten (same prefix and suffix): refused as presend_frame_mismatch naming
    the turns, with the conversation frame; the single-slot frame (the old check) saw nothing there."""
    frame, guard = built
    lead = TURN_LEADS["assistant"]
    tampered_lead = lead.replace("Noted.", "Noted!")
    tampered = frame.with_columns(pl.col("text").str.replace(lead, tampered_lead, literal=True))
    assert (tampered["text"] != frame["text"]).all()
    gated = _guard(tampered, {**guard, "verify": False}, Conversation(5))
    assert set(gated["reason_code"]) == {"presend_frame_mismatch"}
    assert all("between turns 1 and 2" in r for r in gated["reason"].to_list())


def test_shape_disagreements_are_frame_mismatches(built: tuple[pl.DataFrame, dict[str, object]]) -> None:
    frame, guard = built
    # A conversation layout sent to a single-slot system (prefix and suffix alone would pass).
    single = _guard(frame, guard, None)
    assert set(single["reason_code"]) == {"presend_frame_mismatch"}
    assert all(
        "records 5 turn spans but the system renders a single-slot prompt" in r for r in single["reason"]
    )
    # ... or to a conversation of another number of turns.
    seven = _guard(frame, guard, Conversation(7))
    assert set(seven["reason_code"]) == {"presend_frame_mismatch"}

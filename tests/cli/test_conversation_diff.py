"""``diff-template --turns``: per-turn drift between two versions of one template family that differ
only in multi-turn handling (matrices/templates/gemma-turns-v2.jinja, made from gemma-turns.jinja by
renaming past assistant turns' role). A single-slot build cannot see the upgrade; a conversation build
reports which turns moved and by how many tokens."""

from __future__ import annotations

from pathlib import Path

from depthgate.commands.diff import diff_templates
from depthgate.exceptions import ExitCode
from depthgate.layout.layouts import load_tokenizer
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "matrices" / "templates" / "gemma-turns.jinja"
NEW = ROOT / "matrices" / "templates" / "gemma-turns-v2.jinja"


def test_single_slot_build_cannot_see_a_multi_turn_upgrade() -> None:
    tok = load_tokenizer(tokenizers_dir() / "llama2-tinyllama" / "tokenizer.json")
    report = diff_templates(OLD, NEW, tok, builtin_suite(2), [1024], ["0", "0.5"])
    assert report.old_digest != report.new_digest
    assert not report.drifted and not report.ids_changed
    assert report.exit_code == ExitCode.PASS


def test_conversation_build_reports_per_turn_drift() -> None:
    tok = load_tokenizer(tokenizers_dir() / "llama2-tinyllama" / "tokenizer.json")
    report = diff_templates(OLD, NEW, tok, builtin_suite(2), [1024], ["0", "0.5", "@turn:3"], turns=5)
    assert report.exit_code != ExitCode.PASS and len(report.drifted) == len(report.layouts) == 6
    for layout in report.layouts:
        turns = [s for s in layout.spans if s.kind == "turn"]
        # The renamed role changes the headers of the past assistant turns, and only those.
        assert [t.evidence_id for t in turns] == [
            "turn 1 (user)",
            "turn 2 (assistant) [header]",
            "turn 3 (user)",
            "turn 4 (assistant) [header]",
            "turn 5 (user)",
        ]
        # Turn 1 is untouched; the renamed header of turn 2 moves everything after it.
        assert turns[0].start_shift == 0 and turns[0].old_end is not None
        assert turns[1].start_shift != 0
    table = report.table()
    assert "turn Δstart" in table
    assert "turn Δstart (*: header ids changed)" in table
    assert any(line.rstrip().endswith("*,+0") or "*" in line.split()[-1] for line in table.splitlines()[2:])
    assert report.to_dict()["layouts"][0]["spans"][-1]["kind"] == "turn"

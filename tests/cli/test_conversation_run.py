"""A conversation matrix through the command line (issue 25): ``@turn:K`` positions refused by file,
field and fix (exit 20, nothing written), and — ``smoke_model`` — the smallest conversation matrix
(gemma-turns vs gemma-turns-v2 on the embedded Gemma-3-270M) built, verified with a full re-encode, run,
gated and reported, with per-turn spans in the layouts and the worst-position report."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = ROOT / "matrices" / "conversation-embedded.toml"


def _matrix(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    """conversation-embedded.toml with ``edits``, next to a copy of its templates."""
    text = CONVERSATION.read_text(encoding="utf-8")
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    (tmp_path / "templates").mkdir(exist_ok=True)
    for name in ("gemma-turns.jinja", "gemma-turns-v2.jinja"):
        (tmp_path / "templates" / name).write_bytes((CONVERSATION.parent / "templates" / name).read_bytes())
    path = tmp_path / "m.toml"
    path.write_text(text, encoding="utf-8")
    return path


POSITIONS = "positions = [0.0, 0.5, 1.0]"


@pytest.mark.parametrize(
    ("edits", "fragments"),
    [
        ([(POSITIONS, 'positions = [0.0, "@turn:7"]')], ["positions[1]", "has 5 turns", "fix", "@turn:5"]),
        (
            [(POSITIONS, 'positions = ["@turn:3"]'), ('shape = "conversation"\n', ""), ("turns = 5\n", "")],
            ["positions[0]", 'shape is "single"', "fix", 'shape = "conversation"'],
        ),
        ([(POSITIONS, 'positions = ["@turn:0"]')], ["positions[0]", "is not a position", "fix", "@turn:3"]),
        # turn_tokens (the turn-length target): the alternative to turns, never both or neither
        ([("turns = 5\n", "turns = 5\nturn_tokens = 256\n")], ["turn_tokens", "both set", "fix", "keep one"]),
        ([("turns = 5\n", "")], ["turns", "neither turns nor turn_tokens", "fix", "turn_tokens = N"]),
        ([("turns = 5\n", "turn_tokens = 0\n")], ["turn_tokens", "not a positive number", "fix"]),
        # issue #37: an odd count over the limit says the limit, not "needs an odd number"
        ([("turns = 5\n", "turns = 1000001\n")], ["turns", "over the limit of 255", "fix"]),
        (
            [('shape = "conversation"\n', ""), ("turns = 5\n", "turn_tokens = 256\n")],
            ["turn_tokens", 'shape is "single"', "fix", 'shape = "conversation"'],
        ),
    ],
    ids=[
        "turn-beyond-turns",
        "turn-on-single-shape",
        "turn-zero",
        "turn-tokens-and-turns",
        "no-turn-count",
        "turn-tokens-zero",
        "turns-over-limit",
        "turn-tokens-on-single-shape",
    ],
)
def test_bad_turn_positions_are_refused_by_file_field_and_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edits: list[tuple[str, str]], fragments: list[str]
) -> None:
    matrix = _matrix(tmp_path, *edits)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for argv in (
        ["build", str(matrix), "--out", str(tmp_path / "out")],
        ["run", str(matrix), "--out", str(tmp_path / "run")],
    ):
        assert main(argv) == ExitCode.BAD_INPUT
        err = capsys.readouterr().err
        assert str(matrix) in err and "Traceback" not in err
        for fragment in fragments:
            assert fragment in err, (fragment, err)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# smoke_model: CI runs it (issue 25's "done when"; no controls): 39 s on 2 idle cores (2026-12-03).
@pytest.mark.smoke_model
def test_conversation_matrix_runs_end_to_end_on_the_embedded_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """build → verify (full re-encode, `depthgate check`) → run → gate on the real model: a verdict, the
    worst-position report, per-turn spans on every layout, and the evidence in turn 3 at ``@turn:3``."""
    matrix = _matrix(
        tmp_path,
        ("cases = 6", "cases = 2"),
        (POSITIONS, 'positions = [0.0, "@turn:3", 1.0]'),
        ("n_min = 6", "n_min = 2"),
        # the evidence-only control base: no short base lengths (they count requests, not turns)
        ("base_lengths = [500, 1000]", 'base_score = "control"'),
    )
    run = tmp_path / "run"
    code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    out, err = capsys.readouterr()
    assert code in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), err
    assert "worst position at 768 tokens" in out
    for arm, header in (("baseline", "model"), ("candidate", "assistant")):
        layouts = run / arm / "layouts.parquet"
        assert main(["check", str(layouts), "--tokenizer", "gguf:"]) == ExitCode.PASS, capsys.readouterr()
        frame = pl.read_parquet(layouts).filter(pl.col("target_tokens") == 768)
        assert frame.height == 2 * 3 and set(frame["status"]) == {"ok"}
        for row in frame.iter_rows(named=True):
            spans = row["turn_spans"]
            assert [s["role"] for s in spans] == ["user", "assistant", "user", "assistant", "user"]
            # The template's own header for past assistant turns sits between turns 1 and 2.
            assert f"<start_of_turn>{header}\n" in row["text"][spans[0]["char_end"] : spans[1]["char_start"]]
            if row["position"] == "@turn:3":
                assert row["turn"] == 3
                home = spans[2]
                block = next(s for s in row["evidence_spans"] if s["token_start"] == row["actual_offset"])
                assert home["token_start"] <= block["token_start"] < block["token_end"] <= home["token_end"]
    records = pl.read_parquet(run / "records.parquet")
    assert records.height == 2 * 2 * 3 and set(records["status"]) == {"ok"}
    verdict = json.loads((run / "report" / "verdict.json").read_text())
    assert verdict["verdict"] in {"PASS", "FAIL", "INCONCLUSIVE"}
    assert {s["position"] for s in verdict["slices"]} == {"0", "@turn:3", "1"}
    summary = (run / "report" / "summary.md").read_text()
    assert "### Worst positions" in summary and "| 768 |" in summary
    assert [w["length"] for w in verdict["worst_by_length"]] == [768]
    # The gate re-run on the folder gives the same verdict.
    capsys.readouterr()
    assert main(["gate", str(run)]) == code
    assert json.loads((run / "report" / "verdict.json").read_text())["verdict"] == verdict["verdict"]


@pytest.mark.smoke_model  # 38 s on 2 idle cores (2026-12-03)
def test_an_mrcr_conversation_runs_and_is_scored_by_the_mrcr_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The MRCR pattern on the real model: 2 cases × (depth 0, @turn:3) × 2 arms, the needles as their own
    user/assistant exchanges, each reply scored by the MRCR rule (the asked code and no other), a verdict
    and the worst-position report."""
    matrix = _matrix(
        tmp_path,
        (
            'cases = 6, seed = 0, language = "en" }',
            'cases = 2, seed = 0, language = "en", pattern = "mrcr", needles = 3, k = 2 }',
        ),
        (POSITIONS, 'positions = [0.0, "@turn:3"]'),
        ("n_min = 6", "n_min = 2"),
        ("base_lengths = [500, 1000]", 'base_score = "control"'),
    )
    run = tmp_path / "run"
    code = main(["run", str(matrix), "--out", str(run)])
    assert code in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), capsys.readouterr().err
    suite = json.loads((run / "suite.json").read_text())
    assert {c["evidence_pattern"] for c in suite["cases"]} == {"mrcr"}
    layouts = pl.read_parquet(run / "baseline" / "layouts.parquet")
    for row in layouts.iter_rows(named=True):
        # Each needle is its own exchange: its request (span kind "request") ends a user turn and its
        # reply (the evidence) follows, needle after needle in transcript order.
        spans = sorted(
            (s for s in row["evidence_spans"] if "/n" in s["evidence_id"]), key=lambda s: s["token_start"]
        )
        assert [(s["evidence_id"].split("/")[1], s["kind"]) for s in spans] == [
            (f"n{i}", kind) for i in (1, 2, 3) for kind in ("request", "evidence")
        ]
    scored = pl.read_parquet(run / "scored.parquet")
    assert scored.height == 2 * 2 * 2 and set(scored["outcome"]) <= {"pass", "fail"}
    for row in scored.iter_rows(named=True):
        reason = str(row["score_reason"])
        assert (
            ("asked reply's code" in reason)
            if row["outcome"] == "pass"
            else ("code" in reason or "answer" in reason)
        )
    verdict = json.loads((run / "report" / "verdict.json").read_text())
    assert verdict["verdict"] in {"PASS", "FAIL", "INCONCLUSIVE"}
    assert "### Worst positions" in (run / "report" / "summary.md").read_text()

"""Length in characters beside tokens (issue #13 item 5): every report of a real run through the CLI
carries, per token length and arm, the characters of the rendered prompts, so a tokenizer upgrade
(here GPT-2 BPE → SmolLM BPE, the real files in tests/fixtures) compares like with like.

The server behind 127.0.0.1 is a **stub** (labelled as such): a vLLM-shaped ``/v1/completions`` that
decodes the prompt ids with the arm's real tokenizer and answers each case's question with its value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode, InputError
from depthgate.report.report import LengthChars, length_chars, load_verdict, run_layouts
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import StubServer, free_port, reading_handler, stub_matrix

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
SMOLLM = tokenizers_dir() / "smollm" / "tokenizer.json"
CASES = 4
LENGTHS = (640, 896)
POSITIONS = 2
# 4 cases are too few for a verdict that matters here; any gate verdict is fine, never bad input
VERDICTS = (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE)


class Reader(StubServer):
    """Stub: model ``gpt2`` reads its ids with GPT-2's tokenizer, ``smollm`` with SmolLM's; both answer
    the case whose question is in the prompt with its value."""

    def __init__(self, port: int) -> None:
        tokenizers = {"gpt2": Tokenizer.from_file(str(GPT2)), "smollm": Tokenizer.from_file(str(SMOLLM))}
        answers = {c.query: c.required_claims[0].aliases[0] for c in builtin_suite(CASES).cases}
        super().__init__(reading_handler(tokenizers, answers), port)


def run_tokenizer_upgrade(tmp: Path) -> Path:
    """One CLI run into ``tmp/run``: GPT-2 baseline, SmolLM candidate, 4 cases × 2 lengths × 2 depths, no
    controls (also used by tests/report/test_report_junit.py)."""
    port = free_port()
    matrix = tmp / "upgrade.toml"
    text = stub_matrix(
        "chars",
        where=f'endpoint = "http://127.0.0.1:{port}"',
        cases=CASES,
        lengths=str(list(LENGTHS)),
        candidate_model="smollm",
        candidate_tokenizer=SMOLLM,
    )
    matrix.write_text(text.replace('model = "good"', 'model = "gpt2"', 1))
    run = tmp / "run"
    with Reader(port):
        code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    assert code in VERDICTS, code
    return run


@pytest.fixture(scope="module")
def tokenizer_upgrade_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_tokenizer_upgrade(tmp_path_factory.mktemp("chars"))


def expected(run: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """The numbers computed here from the whole layouts files, independently of the report code."""
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for arm in ("baseline", "candidate"):
        frame = pl.read_parquet(run / arm / "layouts.parquet").filter(pl.col("status") == "ok")
        for (length,), group in frame.group_by("target_tokens"):
            chars = [len(text) for text in group["text"]]
            out[(int(str(length)), arm)] = {
                "layouts": group.height,
                "chars_mean": round(sum(chars) / len(chars), 2),
                "chars_min": min(chars),
                "chars_max": max(chars),
                "chars_per_token": round(sum(chars) / group["total_tokens"].sum(), 4),
            }
    return out


def test_verdict_json_has_chars_per_length_and_arm(tokenizer_upgrade_run: Path) -> None:
    run = tokenizer_upgrade_run
    doc = load_verdict(run / "report" / "verdict.json")
    assert doc.length_chars is not None
    got = {(r.length, r.arm): r for r in doc.length_chars}
    assert sorted(got) == [(n, arm) for n in LENGTHS for arm in ("baseline", "candidate")]
    want = expected(run)
    for key, row in got.items():
        assert row.layouts == CASES * POSITIONS
        assert row.tokens_mean == key[0]  # token-exact layouts
        for field, value in want[key].items():
            assert getattr(row, field) == value, (key, field)
    # Two tokenizers: the same token length holds a different amount of text.
    for length in LENGTHS:
        assert got[(length, "baseline")].chars_mean != got[(length, "candidate")].chars_mean
        assert got[(length, "baseline")].chars_per_token != got[(length, "candidate")].chars_per_token
    raw = json.loads((run / "report" / "verdict.json").read_text())
    assert set(raw["length_chars"][0]) == set(LengthChars.model_fields)


def test_summary_and_html_show_the_chars_table(tokenizer_upgrade_run: Path) -> None:
    run = tokenizer_upgrade_run
    want = expected(run)
    summary = (run / "report" / "summary.md").read_text()
    html = (run / "report" / "report.html").read_text()
    assert "### Length in characters" in summary and "<h2>Length in characters</h2>" in html
    for length in LENGTHS:
        b, c = want[(length, "baseline")], want[(length, "candidate")]
        change = f"{100 * (c['chars_mean'] / b['chars_mean'] - 1):+.1f}%"
        cells = [
            f"{length:,}",
            f"{CASES * POSITIONS} / {CASES * POSITIONS}",
            f"{b['chars_mean']:,.0f} ({b['chars_min']:,}–{b['chars_max']:,})",
            f"{c['chars_mean']:,.0f} ({c['chars_min']:,}–{c['chars_max']:,})",
            f"{b['chars_per_token']:.2f} → {c['chars_per_token']:.2f}",
            change,
        ]
        assert "| " + " | ".join(cells) + " |" in summary
        for cell in cells:
            assert cell in html
    # the section sits after the worst positions, before the oracle's problems
    assert summary.index("### Worst positions") < summary.index("### Length in characters")
    assert summary.index("### Length in characters") < summary.index("### Oracle: problems per slice")
    assert "<td" not in (run / "report" / "junit.xml").read_text()


def test_gate_rewrites_it_and_a_foreign_report_dir_keeps_it(
    tokenizer_upgrade_run: Path, tmp_path: Path
) -> None:
    run = tokenizer_upgrade_run
    before = load_verdict(run / "report" / "verdict.json").length_chars
    assert before
    assert main(["gate", str(run)]) in VERDICTS
    assert load_verdict(run / "report" / "verdict.json").length_chars == before
    # `depthgate gate RUN --report-dir ELSEWHERE` hands the run's layouts to the report: same section.
    elsewhere = tmp_path / "elsewhere"
    assert main(["gate", str(run), "--report-dir", str(elsewhere)]) in VERDICTS
    assert load_verdict(elsewhere / "verdict.json").length_chars == before
    assert "Length in characters" in (elsewhere / "summary.md").read_text()
    # write_reports alone, elsewhere and without `layouts=`, leaves it out:
    # test_run_layouts_needs_the_same_manifest.


def test_run_layouts_needs_the_same_manifest(tokenizer_upgrade_run: Path, tmp_path: Path) -> None:
    run = tokenizer_upgrade_run
    manifest = json.loads((run / "manifest.json").read_text())
    assert run_layouts(run / "report", manifest) == {
        arm: (run / arm / "layouts.parquet").resolve() for arm in ("baseline", "candidate")
    }
    assert run_layouts(run / "report", {**manifest, "manifest_digest": "0" * 64}) is None
    assert run_layouts(tmp_path / "report", manifest) is None


def test_length_chars_refuses_a_file_that_is_not_layouts(tokenizer_upgrade_run: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "layouts.parquet"
    pl.DataFrame({"target_tokens": [640], "text": ["abc"]}).write_parquet(bogus)
    with pytest.raises(InputError, match="not a layouts file"):
        length_chars({"baseline": bogus})
    # one arm only: one arm's rows
    copy = tmp_path / "candidate.parquet"
    shutil.copy(tokenizer_upgrade_run / "candidate" / "layouts.parquet", copy)
    rows = length_chars({"candidate": copy})
    assert [(r.length, r.arm) for r in rows] == [(n, "candidate") for n in LENGTHS]

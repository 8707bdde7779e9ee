"""The command line end to end: build/check on real tokenizers and templates, bad input with distinct
exit codes and nothing half-written, and `depthgate run` on the real embedded model (small form)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import polars as pl
import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.judge.science import CATEGORIES
from fixtures_paths import tokenizers_dir

TOK = tokenizers_dir()


@pytest.mark.parametrize(
    "command",
    [[str(Path(sys.executable).with_name("depthgate"))], [sys.executable, "-m", "depthgate"]],
    ids=["console-script", "python-m"],
)
def test_version_through_both_entry_points(command: list[str]) -> None:
    """`depthgate --version` names the installed package and the layout assembler version (the one a
    layout digest changes with), through the console script and `python -m depthgate`; exit 0."""
    from depthgate.layout.layouts import ASSEMBLER_VERSION

    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = f"depthgate {metadata.version('depthgate')} (layout assembler {ASSEMBLER_VERSION})"
    assert done.stdout.strip() == expected


def test_build_then_check_roundtrip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = str(TOK / "smollm" / "tokenizer.json")
    code = main(
        [
            "build",
            "--tokenizer",
            tok,
            "--chat-template",
            str(TOK / "smollm" / "chat_template.jinja"),
            "--lengths",
            "512,1024",
            "--positions",
            "0,0.5,1,@100",
            "--cases",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == ExitCode.PASS
    out = capsys.readouterr().out
    assert "16 layouts, 16 ok, 0 refused" in out
    frame = pl.read_parquet(tmp_path / "layouts.parquet")
    required = {
        "layout_id",
        "case_id",
        "target_tokens",
        "position",
        "total_tokens",
        "token_ids",
        "text",
        "add_special_tokens",
        "evidence_spans",
        "snap_tokens",
        "status",
        "reason",
    }
    assert required <= set(frame.columns)
    assert frame["text"][0].startswith("<|im_start|>")
    assert main(["check", str(tmp_path / "layouts.parquet"), "--tokenizer", tok]) == ExitCode.PASS
    # A layout re-checked under another tokenizer is stale: a violation, exit code VERIFY_FAILED.
    assert (
        main(
            ["check", str(tmp_path / "layouts.parquet"), "--tokenizer", str(TOK / "gpt2" / "tokenizer.json")]
        )
        == ExitCode.VERIFY_FAILED
    )


def test_check_catches_a_tampered_layout(tmp_path: Path) -> None:
    tok = str(TOK / "gpt2" / "tokenizer.json")
    assert (
        main(
            [
                "build",
                "--tokenizer",
                tok,
                "--lengths",
                "512",
                "--positions",
                "0.5",
                "--cases",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == ExitCode.PASS
    )
    path = tmp_path / "layouts.parquet"
    frame = pl.read_parquet(path)
    # A serializer that duplicates a sentence: the text no longer encodes to the stored ids.
    tampered = frame.with_columns(pl.col("text").str.replace("Section 1.", "Section 1. Section 1."))
    tampered.write_parquet(path)
    assert main(["check", str(path), "--tokenizer", tok]) == ExitCode.VERIFY_FAILED


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["build", "--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer file not found"),
        (["build", "--tokenizer", "{tok}", "--positions", "1.5"], "outside [0, 1]"),
        (["build", "--tokenizer", "{tok}", "--lengths", "8"], "too small"),
        (["build", "--tokenizer", "{tok}", "--chat-template", "/nonexistent.jinja"], "nonexistent.jinja"),
        (["build", "--tokenizer", "{bad}"], "cannot load tokenizer"),
        (["build", "{badmatrix}"], "alpha"),
    ],
)
def test_bad_input_exit_code_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {"type": "BPE"')
    badmatrix = tmp_path / "bad.toml"
    badmatrix.write_text(Path("matrices/smoke.toml").read_text().replace("alpha = 0.05", "alpha = 1.5"))
    out = tmp_path / "out"
    argv = [a.format(tok=TOK / "gpt2" / "tokenizer.json", bad=bad, badmatrix=badmatrix) for a in argv]
    assert main([*argv, "--out", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert fragment in err and "fix:" in err
    assert not list(out.rglob("*.parquet")) if out.exists() else True


def test_template_that_raises_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = tmp_path / "raises.jinja"
    template.write_text("{{ raise_exception('Conversation roles must alternate') }}")
    code = main(
        [
            "build",
            "--tokenizer",
            str(TOK / "gpt2" / "tokenizer.json"),
            "--chat-template",
            str(template),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == ExitCode.BAD_INPUT
    assert "raises.jinja" in capsys.readouterr().err
    assert not (tmp_path / "out" / "layouts.parquet").exists()


def test_schema_and_suite_generate(tmp_path: Path) -> None:
    assert main(["schema", "--out", str(tmp_path / "schema.json")]) == ExitCode.PASS
    schema = json.loads((tmp_path / "schema.json").read_text())
    assert {"Case", "Matrix", "AnalysisPlan"} <= set(schema)
    assert (
        main(["suite", "generate", "--seed", "3", "--cases", "300", "--out", str(tmp_path / "s.json")]) == 0
    )
    assert len(json.loads((tmp_path / "s.json").read_text())["cases"]) == 300


def _tiny_matrix(tmp_path: Path, *, n_min: int = 2) -> Path:
    text = Path("matrices/smoke.toml").read_text()
    text = text.replace("cases = 8", "cases = 2").replace("lengths = [1024]", "lengths = [480]")
    text = text.replace("positions = [0.0, 0.25, 0.5, 0.75, 1.0]", "positions = [0.0, 1.0]")
    text = text.replace("n_min = 8", f"n_min = {n_min}").replace(
        "bootstrap_resamples = 999", "bootstrap_resamples = 199"
    )
    # the evidence-only control as NoLiMa's base: the run sends the gated length only
    text = re.sub(r"base_lengths = \[[0-9, ]*\]", 'base_score = "control"', text)
    # A short preamble keeps the candidate inside 480 tokens.
    start = text.index('preamble = """')
    end = text.index('"""', start + 14) + 3
    text = text[:start] + 'preamble = "Read the excerpt below and answer the question."' + text[end:]
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


@pytest.mark.smoke_model
def test_run_end_to_end_on_the_embedded_model_and_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real model (Gemma-3-270M via llama.cpp in process): build → run → score → gate → report; a rerun
    of the same folder sends nothing new; a changed plan under the same folder is refused."""
    matrix = _tiny_matrix(tmp_path)
    run_dir = tmp_path / "run"
    code = main(["run", str(matrix), "--out", str(run_dir)])
    assert code in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE), capsys.readouterr()
    records = pl.read_parquet(run_dir / "records.parquet")
    assert records.height == 2 * 2 * 2  # cases × positions × arms, one seed
    assert set(records["status"]) == {"ok"}
    assert (records["prompt_tokens_local"] == 480).all()
    verdict = json.loads((run_dir / "report" / "verdict.json").read_text())
    assert verdict["verdict"] in {"PASS", "FAIL", "INCONCLUSIVE"}
    assert (run_dir / "report" / "report.html").is_file() and (run_dir / "report" / "junit.xml").is_file()
    # Controls ran beside the matrix and every case of both arms got a failure class.
    controls = verdict["controls"]
    assert sum(controls["counts"].values()) == 2 * 2
    assert {c["category"] for c in controls["cases"]} <= set(CATEGORIES)
    assert "Controls" in (run_dir / "report" / "summary.md").read_text()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (
        manifest["systems"]["baseline"]["tokenizer_digest"]
        == manifest["systems"]["candidate"]["tokenizer_digest"]
    )

    # Resume: same folder, nothing new to send, identical verdict.
    before = records.sort("arm", "layout_id")["completed_at"].to_list()
    assert main(["run", str(matrix), "--out", str(run_dir)]) == code
    after = pl.read_parquet(run_dir / "records.parquet").sort("arm", "layout_id")["completed_at"].to_list()
    assert before == after
    assert json.loads((run_dir / "report" / "verdict.json").read_text())["verdict"] == verdict["verdict"]

    # Changing the plan after seeing data is refused, for run and for gate.
    assert _tiny_matrix(tmp_path, n_min=3) == matrix  # rewrites the same matrix file with another plan
    capsys.readouterr()
    assert main(["run", str(matrix), "--out", str(run_dir)]) == ExitCode.BAD_INPUT
    assert "plan" in capsys.readouterr().err
    assert main(["gate", str(run_dir)]) == ExitCode.BAD_INPUT


def test_gate_refuses_a_folder_without_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gate", str(tmp_path)]) == ExitCode.BAD_INPUT
    assert "manifest" in capsys.readouterr().err


def test_replayed_incidents_get_position_variants(tmp_path: Path) -> None:
    """Replay: desensitized incident JSONL → cases → layouts of those cases at every position."""
    record = {
        "id": "INC-7",
        "documents": [
            {"id": "kb-12", "version": 3, "text": "Refunds above 500 EUR need a second approver."},
            {"id": "kb-19", "version": 1, "text": "Refunds are processed within 5 days."},
        ],
        "query": "Who must approve a refund of 800 EUR?",
        "evidence_ids": ["kb-12"],
        "claims": [{"id": "second", "text": "A second approver is needed.", "aliases": ["second approver"]}],
        "answer_prefix": "A refund of 800 EUR must be approved by",
    }
    incidents = tmp_path / "incidents.jsonl"
    incidents.write_text(json.dumps(record) + "\n")
    assert main(["suite", "import", str(incidents), "--out", str(tmp_path / "suite.json")]) == ExitCode.PASS
    tok = str(TOK / "llama3-from-gguf" / "tokenizer.json")
    assert (
        main(
            [
                "build",
                "--tokenizer",
                tok,
                "--suite",
                str(tmp_path / "suite.json"),
                "--lengths",
                "600",
                "--positions",
                "0,0.5,1",
                "--out",
                str(tmp_path),
            ]
        )
        == ExitCode.PASS
    )
    frame = pl.read_parquet(tmp_path / "layouts.parquet")
    assert frame.height == 3 and set(frame["status"]) == {"ok"}
    assert main(["check", str(tmp_path / "layouts.parquet"), "--tokenizer", tok]) == ExitCode.PASS


@pytest.mark.parametrize("matrix", sorted(Path("matrices").glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_matrix_validates(matrix: Path) -> None:
    from depthgate.spec.loading import load_matrix

    loaded = load_matrix(matrix)
    assert loaded.lengths and loaded.positions
    assert loaded.baseline.name != loaded.candidate.name

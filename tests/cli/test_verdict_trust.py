"""Promises of the README that a release gate depends on, each triggered through the CLI (issue #10):

* an unreachable endpoint ends as verdict INFRA, exit 30, with lost runs counted per endpoint and per
  slice in every report; the circuit breaker stops sending; the rerun of the same folder resumes and
  finishes with a real verdict;
* the slice list and plan are the frozen manifest's: a matrix that drops a position or changes the
  lengths after the run is refused (exit 20), and the gate works from any working directory;
* a candidate whose serving path fails (a server that doubles BOS) is counted against the candidate but
  named as such: failure class ``system``, exit 13 FAIL_SYSTEM, reasons on the console and in
  verdict.json, summary.md, junit.xml and report.html.

The model behind 127.0.0.1 here is a **stub** (labelled as such): a vLLM-shaped ``/v1/completions``
server that decodes the prompt ids with the real GPT-2 tokenizer and answers each case's question with
its true value — a perfect reader, which no real model here is, so a verdict depends only on the
serving path under test. Real-model runs of the same pipeline are in tests/cli/test_cli.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.run.records import read_records
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import ModelsHandler, StubServer, completion, free_port, read_verdict, stub_matrix

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
SMOLLM = tokenizers_dir() / "smollm" / "tokenizer.json"
CASES = 20
ARMS = ("baseline", "candidate")
# Cases with evidence get position variants; an evidence-absent negative case does not.
PLACED = sum(1 for c in builtin_suite(CASES).cases if c.evidence)


class PerfectReader(StubServer):
    """A vLLM-shaped stub: ``/v1/models`` and ``/v1/completions`` with token-id prompts. Model
    ``good`` answers every case correctly and echoes the prompt ids; model ``doubled-bos`` answers the
    same but echoes the ids with one extra leading token (a server that adds a second BOS); model
    ``smollm`` reads its prompt ids with the SmolLM tokenizer (the others with GPT-2's)."""

    def __init__(self, port: int) -> None:
        gpt2, smollm = Tokenizer.from_file(str(GPT2)), Tokenizer.from_file(str(SMOLLM))
        self.tokenizers = {
            "good": gpt2,
            "doubled-bos": gpt2,
            "smollm": smollm,
            "openai-community/gpt2": gpt2,  # the models of matrices/tokenizer-upgrade.toml
            "HuggingFaceTB/SmolLM-135M": smollm,
        }
        self.answers = {
            c.query: c.required_claims[0].aliases[0] if c.required_claims else "not stated"
            for c in builtin_suite(44).cases  # the first cases of a larger suite are the same cases
        }
        # Model "unsafe" gives the first case's forbidden (competing) value instead of its answer.
        first = builtin_suite(1).cases[0]
        self.unsafe = {**self.answers, first.query: first.forbidden_claims[0].aliases[0]}
        self.tokenizers["unsafe"] = gpt2
        # Model "short-blind" fails the first case's short (evidence-only control) input only: a case
        # the model "cannot do" without a document around it.
        self.blind_query, self.tokenizers["short-blind"] = first.query, gpt2
        self.requests = 0  # answered
        self.fail_next = 0  # answer this many requests with HTTP 503 (an overloaded server), then recover
        reader = self

        class Handler(ModelsHandler):
            models = tuple(reader.tokenizers)

            def do_POST(self) -> None:
                body = self.read_json()
                if reader.fail_next > 0:
                    reader.fail_next -= 1
                    self.send_json({"error": {"message": "overloaded", "code": 503}}, status=503)
                    return
                reader.requests += 1
                ids = list(body["prompt"])
                text = reader.tokenizers[body["model"]].decode(ids)
                table = reader.unsafe if body["model"] == "unsafe" else reader.answers
                answer = next((a for q, a in table.items() if q in text), "not stated")
                if body["model"] == "short-blind" and reader.blind_query in text and len(ids) < 256:
                    answer = "not stated"
                echo = [50256, *ids] if body["model"] == "doubled-bos" else ids
                self.send_json(completion(body["model"], f" {answer}", echo, completion_tokens=3))

        super().__init__(Handler, port)


def _matrix(
    tmp: Path,
    port: int,
    *,
    candidate_model: str = "good",
    candidate_tokenizer: Path = GPT2,
    positions: str = "[0.0, 1.0]",
    n_min: int = 2,
    suite: str = f'{{ kind = "builtin", cases = {CASES}, seed = 0, language = "en" }}',
) -> Path:
    text = stub_matrix(
        "trust",
        where=f'endpoint = "http://127.0.0.1:{port}"',
        suite=suite,
        positions=positions,
        candidate_model=candidate_model,
        candidate_tokenizer=candidate_tokenizer,
        n_min=n_min,
        resamples=999,
    )
    path = tmp / "trust.toml"
    path.write_text(text)
    return path


@pytest.fixture()
def port() -> int:
    return free_port()


def test_unreachable_endpoint_is_infra_exit_30_then_the_rerun_resumes(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix, run = _matrix(tmp_path, port), tmp_path / "run"
    code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    err = capsys.readouterr()
    assert code == ExitCode.INFRA == 30
    assert "verdict: INFRA (exit 30 INFRA)" in err.out
    assert "circuit open" in err.err  # the breaker stopped sending instead of burning the matrix
    doc = read_verdict(run)
    assert doc["verdict"] == "INFRA" and doc["exit_code"] == "INFRA"
    infra = doc["infra"]
    planned = 2 * PLACED * 2  # arms × placed cases × positions, one seed
    assert infra["planned"] == planned and infra["lost"] == planned
    assert infra["infra_error"] > 0 and infra["not_sent"] > 0
    assert infra["by_endpoint"][f"http://127.0.0.1:{port}"] == infra["infra_error"]
    assert set(infra["by_slice"]) == {"640/0", "640/1"}
    summary = (run / "report" / "summary.md").read_text()
    assert "INFRA" in summary and "lost runs by slice" in summary
    # the per-endpoint account is in the summary too (ok, system_fail, infra_error, failed attempts)
    url = f"http://127.0.0.1:{port}"
    endpoint_row = next(line for line in summary.splitlines() if line.startswith(f"| `{url}` |"))
    failed = infra["endpoints"][url]["failed"]
    assert failed > infra["infra_error"]  # every retried attempt, not only the final records
    assert endpoint_row == f"| `{url}` | 0 | 0 | {infra['infra_error']} | {failed} |"
    junit = (run / "report" / "junit.xml").read_text()
    assert '<error type="INFRA"' in junit
    assert "lost runs by endpoint" in (run / "report" / "report.html").read_text()
    sent_before = read_records(run).height

    with PerfectReader(port) as server:
        code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    assert code == ExitCode.PASS
    doc = read_verdict(run)
    assert doc["verdict"] == "PASS" and doc["infra"]["lost"] == 0
    ok_row = f"| `{url}` | {doc['infra']['endpoints'][url]['ok']} |"
    assert ok_row in (run / "report" / "summary.md").read_text()
    records = read_records(run)
    assert records.height == planned and set(records["status"]) == {"ok"}
    # only what had no final record was sent, each once; then the canaries (on by default for a server
    # arm; the first call stopped at the breaker before them), once
    canaries = read_records(run / "canaries")
    assert canaries.height == 8 and set(canaries["status"]) == {"ok"}
    assert server.requests == planned + canaries.height
    assert sent_before <= planned


def test_gate_uses_the_frozen_slice_list_and_refuses_an_edited_matrix(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix, run = _matrix(tmp_path, port), tmp_path / "run"
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(run), "--no-controls"]) == ExitCode.PASS
    before = read_verdict(run)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["positions"] == ["0.0", "1.0"] and manifest["plan"]["n_min"] == 2

    original = matrix.read_text()
    for edit in (original.replace("positions = [0.0, 1.0]", "positions = [0.0]"),
                 original.replace("lengths = [640]", "lengths = [640, 1024]"),
                 original.replace("n_min = 2", "n_min = 3")):  # fmt: skip
        matrix.write_text(edit)
        assert main(["gate", str(run)]) == ExitCode.BAD_INPUT
        assert "differs from the plan this run was frozen with" in capsys.readouterr().err
    matrix.write_text(original)

    # From another working directory, and with the matrix file gone: the run folder is enough.
    matrix.unlink()
    cwd = os.getcwd()
    os.chdir(tmp_path.parent)
    try:
        assert main(["gate", str(run)]) == ExitCode.PASS
    finally:
        os.chdir(cwd)
    after = read_verdict(run)
    assert after["slices"] == before["slices"] and after["digests"] == before["digests"]

    # A manifest whose plan was edited by hand no longer matches its own digest.
    manifest["plan"]["margin"] = 0.5
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert main(["gate", str(run)]) == ExitCode.BAD_INPUT
    assert "plan_digest" in capsys.readouterr().err


def test_a_broken_serving_path_is_named_not_reported_as_a_model_regression(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix, run = _matrix(tmp_path, port, candidate_model="doubled-bos"), tmp_path / "run"
    with PerfectReader(port):
        code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    out = capsys.readouterr().out
    assert code == ExitCode.FAIL_SYSTEM == 13
    assert "exit 13 FAIL_SYSTEM, failures: system" in out and "server_ids_mismatch" in out
    doc = read_verdict(run)
    assert doc["verdict"] == "FAIL" and doc["failure_class"] == "system"
    assert doc["system_driven_slices"] == ["640/0", "640/1"]
    assert doc["system_fail_reasons"] == {"server_ids_mismatch": 2 * PLACED}
    assert doc["reasons"][0].startswith("SYSTEM:")
    assert "SYSTEM" in (run / "report" / "summary.md").read_text()
    assert '<failure type="FAIL_SYSTEM"' in (run / "report" / "junit.xml").read_text()
    assert "serving path failed" in (run / "report" / "report.html").read_text()
    records = read_records(run).filter(pl.col("arm") == "candidate")
    assert set(records["system_fail_reason"]) == {"server_ids_mismatch"}  # still counted against it


def test_a_tokenizer_upgrade_runs_to_a_report_with_controls_paired(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT-2 tokenizer (baseline) → SmolLM tokenizer (candidate): every layout, control and count is
    per arm's own tokenizer; controls pair by case, kind and nominal length, so the run reaches a report."""
    matrix = _matrix(tmp_path, port, candidate_model="smollm", candidate_tokenizer=SMOLLM)
    run = tmp_path / "run"
    with PerfectReader(port):
        code = main(["run", str(matrix), "--out", str(run)])
    assert code == ExitCode.PASS, capsys.readouterr()
    out = capsys.readouterr().out
    assert "worst position at 640 tokens: depth" in out  # the console names the worst position
    assert "effective length (nolima), candidate: 0: ≥640" in out  # and the effective length per depth
    doc = read_verdict(run)
    assert doc["verdict"] == "PASS" and doc["controls"]["counts"]
    manifest = json.loads((run / "manifest.json").read_text())
    digests = {arm: manifest["systems"][arm]["tokenizer_digest"] for arm in ("baseline", "candidate")}
    assert digests["baseline"] != digests["candidate"]
    controls = read_records(run / "controls")
    # The same (case, kind, nominal length) on both arms although the token counts differ.
    by_arm = {
        arm: set(controls.filter(pl.col("arm") == arm)["position"]) for arm in ("baseline", "candidate")
    }
    assert by_arm["baseline"] == by_arm["candidate"] and len(by_arm["baseline"]) == 2
    counts = (
        controls.group_by("arm").agg(pl.col("prompt_tokens_local").sum()).sort("arm")["prompt_tokens_local"]
    )
    assert counts[0] != counts[1]


def test_the_shipped_tokenizer_upgrade_matrix_runs_to_a_report(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """matrices/tokenizer-upgrade.toml itself (two different tokenizer files, 44 cases, 5 depths), its
    placeholder endpoints pointed at the stub and its relative paths made absolute."""
    shipped = Path(__file__).resolve().parents[2] / "matrices" / "tokenizer-upgrade.toml"
    text = shipped.read_text().replace("../tests/fixtures", str(shipped.parents[1] / "tests" / "fixtures"))
    text = text.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8001", f"127.0.0.1:{port}")
    matrix = tmp_path / "tokenizer-upgrade.toml"
    matrix.write_text(text)
    with PerfectReader(port) as server:
        code = main(["run", str(matrix), "--out", str(tmp_path / "run")])
    assert code == ExitCode.PASS, capsys.readouterr().out
    run = tmp_path / "run"
    gated = json.loads((run / "manifest.json").read_text())["lengths"]
    records = read_records(run)
    # arms × placed cases × depths at the gated lengths, all sent once; beside them the short lengths of
    # NoLiMa's base score (the plan's default), never gated
    assert records.filter(pl.col("target_tokens").is_in(gated)).height == 2 * 40 * 5
    # the matrix, its controls and its canaries (on by default: the arms are vLLM servers)
    folders = [run, run / "controls", run / "canaries"]
    sent = pl.concat([read_records(f) for f in folders]).filter(pl.col("attempts") > 0)
    assert read_records(run / "canaries").height == 2 * 2 * 2 * len(gated)  # head + tail, 2 each, per arm
    assert server.requests == sent.height  # each sent exactly once (refused controls are never sent)
    assert read_verdict(run)["verdict"] == "PASS"


def test_too_few_cases_is_inconclusive_exit_11(tmp_path: Path, port: int) -> None:
    """n_min above the placed cases: every slice INCONCLUSIVE, never merged, exit 11."""
    matrix = _matrix(tmp_path, port, n_min=PLACED + 1)
    with PerfectReader(port):
        code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls"])
    assert code == ExitCode.INCONCLUSIVE == 11
    doc = read_verdict(tmp_path / "run")
    assert doc["verdict"] == "INCONCLUSIVE" and {s["status"] for s in doc["slices"]} == {"INCONCLUSIVE"}


def test_a_forbidden_safety_claim_is_exit_12_whatever_the_statistics(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """One candidate answer gives a forbidden claim of severity "safety" (a suite file marks the first
    case's competing value so): SAFETY overrides the statistics, exit 12."""
    suite = builtin_suite(CASES)
    first = suite.cases[0]
    claims = [
        c.model_copy(update={"severity": "safety"}) if i == 0 else c
        for i, c in enumerate(first.forbidden_claims)
    ]
    cases = [first.model_copy(update={"forbidden_claims": claims}), *suite.cases[1:]]
    path = tmp_path / "suite.json"
    path.write_text(suite.model_copy(update={"cases": cases}).model_dump_json())
    matrix = _matrix(tmp_path, port, candidate_model="unsafe", suite=f'{{ kind = "file", path = "{path}" }}')
    with PerfectReader(port):
        code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls"])
    assert code == ExitCode.SAFETY == 12
    assert "+ SAFETY (exit 12 SAFETY" in capsys.readouterr().out
    doc = read_verdict(tmp_path / "run")
    assert doc["safety_flag"] and doc["exit_code"] == "SAFETY"
    assert doc["safety"]["hits_candidate"] == 2 and doc["safety"]["hits_baseline"] == 0  # 2 depths


def test_control_normalised_primary_metric_gates_only_baseline_eligible_cases(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """primary_metric = "control_normalised": the gate counts only the cases whose baseline
    evidence-only control passes; the same records under "pass" count every placed case. Without
    controls the metric is refused before anything is built (exit 20)."""
    base = _matrix(tmp_path, port).read_text()
    blind = base.replace('model = "good"', 'model = "short-blind"', 1)  # the baseline arm
    pass_metric, normalised = tmp_path / "pass.toml", tmp_path / "normalised.toml"
    pass_metric.write_text(blind)
    normalised.write_text(blind + 'primary_metric = "control_normalised"\n')
    with PerfectReader(port):
        assert main(["run", str(pass_metric), "--out", str(tmp_path / "a")]) == ExitCode.PASS
        assert main(["run", str(normalised), "--out", str(tmp_path / "b")]) == ExitCode.PASS
        refused = main(["run", str(normalised), "--out", str(tmp_path / "c"), "--no-controls"])
    assert refused == ExitCode.BAD_INPUT == 20
    assert "plan.primary_metric" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # nothing half-written
    every, kept = read_verdict(tmp_path / "a"), read_verdict(tmp_path / "b")
    assert {s["n_cases"] for s in every["slices"]} == {PLACED}
    assert {s["n_cases"] for s in kept["slices"]} == {PLACED - 1}
    assert "primary_metric" not in every["controls"]
    chosen = kept["controls"]["primary_metric"]
    assert (chosen["n_eligible"], chosen["n_placed"], len(chosen["excluded"])) == (PLACED - 1, PLACED, 1)
    frozen = json.loads((tmp_path / "b" / "manifest.json").read_text())["plan"]
    assert frozen["primary_metric"] == "control_normalised"  # pre-registered: frozen before the data
    assert "control_normalised (pre-registered)" in (tmp_path / "b" / "report" / "summary.md").read_text()

"""Tests of the reports (depthgate.report.report) on a seeded synthetic run with one planted regression."""

from __future__ import annotations

import dataclasses
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from pydantic import ValidationError

import depthgate.report.report as report
from depthgate.exceptions import ExitCode, InputError
from depthgate.judge.gate import GatePlan, GateResult, SliceStatus, Verdict, gate
from depthgate.report import writer
from depthgate.report.report import (
    HEATMAP_ACCURACY,
    HEATMAP_DELTA,
    VerdictDocument,
    exit_code_for,
    load_verdict,
    manifest_digests,
    oracle_counts,
    slice_key,
    write_reports,
)

PLANTED = (2048, "0.5")
SHORT = (4096, "1.0")  # only a few cases: INCONCLUSIVE
LENGTHS = (1024, 2048, 4096)
POSITIONS = ("0.0", "0.5", "1.0")
PLAN = GatePlan(bootstrap_resamples=999)
MANIFEST: dict[str, Any] = {
    "run_id": "run-0001",
    "matrix": "smoke",
    "api_key": "sk-should-never-appear",
    "digests": {"plan": "a" * 64, "suite": "b" * 64, "layouts": "c" * 64},
    "baseline": {"tokenizer_digest": "d" * 64, "template_sha256": "e" * 64, "model": "m"},
    "candidate": {"tokenizer_digest": "f" * 64},
}


def synthetic_scored(
    seed: int = 0, n_cases: int = 60, *, safety_hit: bool = False, planted: bool = True, short: bool = True
) -> pl.DataFrame:
    """Paired runs: both arms pass when a shared uniform draw is below 0.92, except the planted slice,
    where the candidate passes below 0.3. Fails carry missing claims; a few carry wrong citations or are
    system failures (truncation), in both arms alike."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for length in LENGTHS:
        for position in POSITIONS:
            count = 10 if short and (length, position) == SHORT else n_cases
            for case in range(count):
                for run_seed in (0, 1):
                    u = float(rng.random())
                    for arm in ("baseline", "candidate"):
                        regressed = planted and arm == "candidate" and (length, position) == PLANTED
                        threshold = 0.3 if regressed else 0.92
                        outcome = "pass" if u < threshold else "fail"
                        reason = None
                        if outcome == "fail" and u > 0.985:
                            outcome, reason = "system_fail", "truncation: 2100 > 2048"
                        fail = outcome == "fail"
                        rows.append(
                            {
                                "arm": arm,
                                "case_id": f"case-{case:03d}",
                                "length": length,
                                "position": position,
                                "seed": run_seed,
                                "outcome": outcome,
                                "safety": False,
                                "missing_claims": ["answer"] if fail else [],
                                "forbidden_hits": [],
                                "wrong_citations": ["doc-99"] if fail and u > 0.96 else [],
                                "abstained": False,
                                "field_mismatches": [],
                                "system_fail_reason": reason,
                                "score_reason": "Answered '300', which matches no claim; expected '415'."
                                if fail
                                else "Answered '415', the required claim, first.",
                            }
                        )
    frame = pl.DataFrame(rows, infer_schema_length=None)
    if safety_hit:
        first = (
            (pl.col("arm") == "candidate")
            & (pl.col("case_id") == "case-000")
            & (pl.col("length") == 1024)
            & (pl.col("position") == "0.0")
            & (pl.col("seed") == 0)
        )
        frame = frame.with_columns(
            pl.when(first).then(pl.lit(True)).otherwise(pl.col("safety")).alias("safety"),
            pl.when(first).then(pl.lit("fail")).otherwise(pl.col("outcome")).alias("outcome"),
        )
    return frame


@pytest.fixture(scope="module")
def scored() -> pl.DataFrame:
    return synthetic_scored()


@pytest.fixture(scope="module")
def result(scored: pl.DataFrame) -> GateResult:
    return gate(scored, PLAN)


@pytest.fixture()
def written(tmp_path: Path, result: GateResult, scored: pl.DataFrame) -> report.ReportPaths:
    return write_reports(result, scored, tmp_path / "out", manifest=MANIFEST)


def test_planted_regression_is_the_only_failing_slice(result: GateResult) -> None:
    statuses = {(s.length, s.position): s.status for s in result.slice_results}
    assert statuses[PLANTED] is SliceStatus.FAIL_REGRESSION
    assert statuses[SHORT] is SliceStatus.INCONCLUSIVE
    others = {k: v for k, v in statuses.items() if k not in (PLANTED, SHORT)}
    assert set(others.values()) == {SliceStatus.PASS}
    assert result.verdict is Verdict.FAIL and not result.safety_flag


def test_verdict_json(written: report.ReportPaths, result: GateResult) -> None:
    document = load_verdict(written.verdict_json)
    assert document.verdict == "FAIL"
    assert document.exit_code == "FAIL" and document.exit_code_value == int(ExitCode.FAIL)
    assert not document.safety_flag
    rows = {s.slice: s for s in document.slices}
    assert len(rows) == len(result.slice_results) == len(LENGTHS) * len(POSITIONS)
    assert rows[slice_key(*PLANTED)].status == "FAIL_REGRESSION"
    assert rows[slice_key(*SHORT)].status == "INCONCLUSIVE"
    assert document.slice_counts["FAIL_REGRESSION"] == 1 and document.slice_counts["PASS"] == 7
    # every digest of the manifest, nothing secret
    assert document.digests == {
        "baseline.template_sha256": "e" * 64,
        "baseline.tokenizer_digest": "d" * 64,
        "candidate.tokenizer_digest": "f" * 64,
        "digests.layouts": "c" * 64,
        "digests.plan": "a" * 64,
        "digests.suite": "b" * 64,
    }
    assert document.run == {"matrix": "smoke", "run_id": "run-0001"}
    raw = written.verdict_json.read_text(encoding="utf-8")
    assert "sk-should-never-appear" not in raw
    data = json.loads(raw)
    assert data["worst_by_length"] and data["triage"] and data["oracle"]
    planted = [o for o in document.oracle if o.slice == slice_key(*PLANTED) and o.arm == "candidate"]
    assert planted[0].missing_claims > 30
    assert sum(o.system_fail_reasons.get("truncation", 0) for o in document.oracle) > 0


def test_verdict_document_rejects_inconsistent_verdicts(written: report.ReportPaths) -> None:
    data = json.loads(written.verdict_json.read_text(encoding="utf-8"))
    for change in (
        {"exit_code": "PASS", "exit_code_value": 0},
        {"verdict": "PASS", "exit_code": "PASS", "exit_code_value": 0},
        {"safety_flag": True},
        {"unexpected": 1},
    ):
        with pytest.raises(ValidationError):
            VerdictDocument.model_validate({**data, **change})
    bad = written.out_dir / "bad.json"
    bad.write_text(json.dumps({**data, "exit_code": "PASS"}), encoding="utf-8")
    with pytest.raises(InputError, match="invalid verdict"):
        load_verdict(bad)


def test_junit_xml(written: report.ReportPaths, result: GateResult) -> None:
    root = ET.parse(written.junit_xml).getroot()
    assert root.tag == "testsuites"
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    slices = suites["depthgate.slices"]
    cases = slices.findall("testcase")
    assert len(cases) == len(result.slice_results)
    failures = [c for c in cases if c.find("failure") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    assert len(failures) == 1 and slices.get("failures") == "1"
    assert len(skipped) == 1 and slices.get("skipped") == "1"
    assert slices.get("tests") == str(len(result.slice_results))
    failure = failures[0].find("failure")
    assert failure is not None
    assert failures[0].get("name", "").startswith(slice_key(*PLANTED))
    assert failure.get("type") == "FAIL_REGRESSION"
    message = failure.get("message", "")
    planted = next(s for s in result.slice_results if (s.length, s.position) == PLANTED)
    assert f"{planted.lower:+.3f}".replace("-", "−") in message and "Δ" in message
    assert skipped[0].get("name", "").startswith(slice_key(*SHORT))
    safety = suites["depthgate.safety"].findall("testcase")
    assert len(safety) == 1 and safety[0].find("failure") is None


def test_summary_lists_failing_slice_first(written: report.ReportPaths) -> None:
    text = written.summary_md.read_text(encoding="utf-8")
    first_line = text.splitlines()[0]
    assert "FAIL" in first_line and "exit 10" in first_line
    planted = text.index(f"`{slice_key(*PLANTED)}`")
    for length in LENGTHS:
        for position in POSITIONS:
            if (length, position) != PLANTED:
                assert planted < text.index(f"`{slice_key(length, position)}`")
    assert text.index(f"`{slice_key(*SHORT)}`") < text.index(f"`{slice_key(1024, '0.0')}`")
    assert "### Worst positions" in text and "truncation" in text and "wrong citations" in text
    assert "sk-should-never-appear" not in text


def test_html_report(written: report.ReportPaths) -> None:
    page = written.report_html.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 2
    for name in (HEATMAP_DELTA, HEATMAP_ACCURACY):
        assert name in page
        path = written.out_dir / name
        assert path in written.heatmaps
        assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    for needle in (
        "total length",
        "evidence depth",
        report.MARK_REGRESSION,
        report.MARK_NI,
        "INCONCLUSIVE",
        "Missing claims",
        "Wrong citations",
        "doc-99",
        "Worst positions",
        "truncation",
        "a" * 64,
    ):
        assert needle in page, needle
    assert "sk-should-never-appear" not in page
    assert page.index(slice_key(*PLANTED)) < page.index(slice_key(1024, "0.0"))


def test_files_are_complete_and_nothing_is_staged(written: report.ReportPaths) -> None:
    names = sorted(p.name for p in written.out_dir.iterdir())
    assert names == sorted(
        ["verdict.json", "summary.md", "junit.xml", "report.html", HEATMAP_DELTA, HEATMAP_ACCURACY]
    )
    assert all(os.stat(written.out_dir / n).st_mode & 0o044 for n in names)


def test_failure_while_rendering_leaves_the_directory_unchanged(
    tmp_path: Path, result: GateResult, scored: pl.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"

    # nothing before: nothing after
    def explode(*args: object, **kwargs: object) -> str:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(report, "render_html", explode)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_reports(result, scored, out, manifest=MANIFEST)
    assert list(out.iterdir()) == []

    # a previous complete report stays exactly as it was
    monkeypatch.undo()
    write_reports(result, scored, out, manifest=MANIFEST)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(report, "render_html", explode)
    other = gate(synthetic_scored(seed=1), PLAN)
    with pytest.raises(RuntimeError):
        write_reports(other, scored, out, manifest=MANIFEST)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_failure_while_moving_never_leaves_a_verdict(
    tmp_path: Path, result: GateResult, scored: pl.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder holding other files is not swapped whole: its files are moved in one by one, the
    # verdict last (tests/report/test_report_document.py checks the swap of a report-only folder).
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    write_reports(result, scored, out, manifest=MANIFEST)
    real_replace = os.replace

    def flaky(src: Any, dst: Any) -> None:
        if Path(dst).parent == out and Path(dst).name == "junit.xml":
            raise OSError("device full")
        real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", flaky)
    with pytest.raises(OSError, match="device full"):
        write_reports(result, scored, out, manifest=MANIFEST)
    monkeypatch.undo()
    assert not (out / "verdict.json").exists()  # the commit marker is gone: the set is incomplete
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging or temp files


def test_exit_codes(result: GateResult) -> None:
    assert exit_code_for(result) is ExitCode.FAIL
    assert exit_code_for(dataclasses.replace(result, verdict=Verdict.PASS)) is ExitCode.PASS
    assert exit_code_for(dataclasses.replace(result, verdict=Verdict.INCONCLUSIVE)) is ExitCode.INCONCLUSIVE
    for verdict in Verdict:
        flagged = dataclasses.replace(result, verdict=verdict, safety_flag=True)
        assert exit_code_for(flagged) is ExitCode.SAFETY


def test_safety_hit_end_to_end(tmp_path: Path) -> None:
    scored = synthetic_scored(safety_hit=True)
    flagged = gate(scored, PLAN)
    assert flagged.safety_flag
    paths = write_reports(flagged, scored, tmp_path, manifest={})
    document = load_verdict(paths.verdict_json)
    assert document.safety_flag and document.exit_code == "SAFETY" and document.exit_code_value == 12
    assert document.digests == {}
    root = ET.parse(paths.junit_xml).getroot()
    safety = next(s for s in root.findall("testsuite") if s.get("name") == "depthgate.safety")
    failure = safety.find("testcase/failure")
    assert failure is not None and failure.get("type") == "SAFETY"
    assert "SAFETY" in paths.summary_md.read_text(encoding="utf-8").splitlines()[0]
    assert "Safety flag" in paths.report_html.read_text(encoding="utf-8")


def test_all_pass_report(tmp_path: Path) -> None:
    scored = synthetic_scored(planted=False, short=False)
    passing = gate(scored, PLAN)
    assert passing.verdict is Verdict.PASS and not passing.safety_flag
    paths = write_reports(passing, scored, tmp_path, manifest=MANIFEST)
    assert load_verdict(paths.verdict_json).exit_code == "PASS"
    text = paths.summary_md.read_text(encoding="utf-8")
    assert "None: every slice passes." in text
    root = ET.parse(paths.junit_xml).getroot()
    assert root.get("failures") == "0" and root.get("skipped") == "0"


def test_manifest_digests_and_oracle_counts(scored: pl.DataFrame) -> None:
    assert manifest_digests({"a": {"digests": {"x": "1"}}, "b": [{"file_sha256": "2"}], "c": "3"}) == {
        "a.digests.x": "1",
        "b[0].file_sha256": "2",
    }
    counts = oracle_counts(scored.rename({"length": "target_tokens"}))
    assert {(o.arm, o.slice) for o in counts} == {
        (arm, slice_key(length, position))
        for arm in ("baseline", "candidate")
        for length in LENGTHS
        for position in POSITIONS
    }
    for o in counts:
        assert o.passed + o.failed + o.system_fail + o.missing == o.runs
        assert sum(o.system_fail_reasons.values()) == o.system_fail


def test_verdict_slice_schema_mirrors_the_gate_slice_result() -> None:
    """verdict.json's slice schema restates stats.SliceResult field by field (so the document can be
    validated without the gate); this keeps the two from drifting apart."""
    import dataclasses

    from depthgate.judge.gate import SliceResult
    from depthgate.report.report import VerdictSlice

    gate_fields = [f.name for f in dataclasses.fields(SliceResult)]
    assert list(VerdictSlice.model_fields) == ["slice", *gate_fields]

"""The position section of junit.xml (issue #13): the worst position per length (suite properties and
system-out, per-slice properties) written with the reports, and the effective length added from the
position-science section by :func:`add_junit_effective_length` (in the same single write)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from test_report_chars import LENGTHS, run_tokenizer_upgrade

from depthgate.judge.gate import GatePlan, GateResult, gate
from depthgate.report.position import add_junit_effective_length
from depthgate.report.report import load_verdict, write_reports

PLANTED = (2048, "0.5")
POSITIONS = ("0.0", "0.5", "1.0")


def synthetic(seed: int = 0, cases: int = 60) -> pl.DataFrame:
    """Paired runs at 1024 and 2048 tokens: both arms pass below a shared draw of 0.92, except the
    planted slice, where the candidate passes below 0.3."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for length in (1024, 2048):
        for position in POSITIONS:
            for case in range(cases):
                u = float(rng.random())
                for arm in ("baseline", "candidate"):
                    cut = 0.3 if arm == "candidate" and (length, position) == PLANTED else 0.92
                    fail = u >= cut
                    rows.append(
                        {
                            "arm": arm,
                            "case_id": f"case-{case:03d}",
                            "length": length,
                            "position": position,
                            "seed": 0,
                            "outcome": "fail" if fail else "pass",
                            "safety": False,
                            "missing_claims": ["answer"] if fail else [],
                            "forbidden_hits": [],
                            "wrong_citations": [],
                            "abstained": False,
                            "field_mismatches": [],
                            "system_fail_reason": None,
                            "score_reason": "x",
                        }
                    )
    return pl.DataFrame(rows, infer_schema_length=None)


@pytest.fixture(scope="module")
def scored() -> pl.DataFrame:
    return synthetic()


@pytest.fixture(scope="module")
def result(scored: pl.DataFrame) -> GateResult:
    # 6 slices need B >= 293 (issue #22: gate() applies the plan's B rule to unplanned records)
    return gate(scored, GatePlan(bootstrap_resamples=299))


def properties(element: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in element.iterfind("properties/property")}


def slices_suite(path: Path) -> ET.Element:
    suite = ET.parse(path).getroot().find("testsuite[@name='depthgate.slices']")
    assert suite is not None
    return suite


def test_junit_names_the_worst_position_per_length(
    tmp_path: Path, result: GateResult, scored: pl.DataFrame
) -> None:
    paths = write_reports(result, scored, tmp_path / "out", manifest={})
    suite = slices_suite(paths.junit_xml)
    doc = load_verdict(paths.verdict_json)
    worst = {w["length"]: w for w in doc.worst_by_length}
    assert worst[2048]["slice_worst_position"] == "0.5"  # the planted regression
    suite_props = properties(suite)
    for length, w in worst.items():
        assert suite_props[f"worst_position.{length}"] == (
            f"{w['slice_worst_position']} (lower bound {w['slice_worst_lower']:+.3f})"
        )
    # system-out: the console's lines (commands/cli.py prints them from verdict.json)
    out = suite.find("system-out")
    assert out is not None and out.text is not None
    for length, w in worst.items():
        line = (
            f"worst position at {length} tokens: depth {w['slice_worst_position']} (lowest Δ lower bound "
            f"{w['slice_worst_lower']:+.3f}; position range baseline {w['range_baseline']:.2f} → candidate "
            f"{w['range_candidate']:.2f})"
        )
        assert line in out.text.splitlines()
    cases = suite.findall("testcase")
    assert len(cases) == 6 and suite.get("tests") == "6"
    flagged = []
    for case in cases:
        props = properties(case)
        length, position = int(props["length"]), props["position"]
        assert props["worst_position_at_length"] == worst[length]["slice_worst_position"]
        row = next(s for s in doc.slices if s.length == length and s.position == position)
        assert props["lower_bound"] == f"{row.lower:+.3f}"
        if props["worst_position"] == "true":
            flagged.append((length, position))
        # properties come first in a testcase (JUnit schema order)
        assert case[0].tag == "properties"
    assert flagged == sorted((length, w["slice_worst_position"]) for length, w in worst.items())
    assert PLANTED in flagged
    # no position science: nothing to add
    root = ET.parse(paths.junit_xml).getroot()
    assert add_junit_effective_length(root, {}) is False
    assert add_junit_effective_length(root, {"effective_length": None}) is False


def test_effective_length_is_added_from_a_real_runs_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_tokenizer_upgrade(tmp_path)
    console = capsys.readouterr().out
    report = run / "report"
    doc = json.loads((report / "verdict.json").read_text())
    rows = doc["position"]["effective_length"]["rows"]
    assert rows and {r["arm"] for r in rows} == {"baseline", "candidate"}
    # `depthgate run` wrote the effective length into junit.xml; adding it again changes nothing
    once = (report / "junit.xml").read_bytes()
    assert b"effective_length." in once
    root = ET.parse(report / "junit.xml").getroot()
    assert add_junit_effective_length(root, doc["position"]) is True
    ET.indent(root)
    again = ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"
    assert again == once  # idempotent
    suite = slices_suite(report / "junit.xml")
    rule = rows[0]["rule"]

    def text(row: dict[str, Any]) -> str:
        if row["at_grid_top"]:
            return f"≥{row['estimate']}"
        return "below grid" if row["estimate"] == 0 else str(row["estimate"])

    suite_props = properties(suite)
    for row in rows:
        assert suite_props[f"effective_length.{row['arm']}.{row['position']}"] == f"{text(row)} ({rule})"
    for case in suite.findall("testcase"):
        props = properties(case)
        for arm in ("baseline", "candidate"):
            row = next(r for r in rows if r["arm"] == arm and r["position"] == props["position"])
            assert props[f"effective_length.{arm}"] == f"{text(row)} ({rule})"
        assert "worst_position" in props  # written with the report, kept
    out = suite.find("system-out")
    assert out is not None and out.text is not None
    lines = out.text.splitlines()
    # the same lines as the console printed
    effective = [line for line in lines if line.startswith("effective length (")]
    assert len(effective) == 2 and all(line in console for line in effective)
    assert any(line.startswith(f"worst position at {LENGTHS[0]} tokens") for line in lines)

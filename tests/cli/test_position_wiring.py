"""Position science wired through the CLI (issue #13): verdict.json ``position`` and ``noise_floor``,
summary.md and report.html sections, ``depthgate plan`` and ``depthgate run --aa``, on the PerfectReader
stub (every answer right: accuracy 1.0 everywhere, so the effective length is the longest length)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_verdict_trust import PerfectReader, _matrix

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.judge.science import EL_RESAMPLES
from depthgate.spec.models import AnalysisPlan
from helpers import free_port, read_verdict


def _with_plan(matrix: Path, extra: str) -> Path:
    """Append keys to the matrix's [plan] table (the last table of ``_matrix``)."""
    matrix.write_text(matrix.read_text() + extra)
    return matrix


def test_perfect_reader_effective_length_is_the_longest_length_in_every_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    matrix, run = _matrix(tmp_path, port), tmp_path / "run"
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(run)]) == ExitCode.PASS
    capsys.readouterr()
    position = read_verdict(run)["position"]
    el = position["effective_length"]
    assert el["rule"] == "nolima" and el["threshold"] == 0.85
    assert el["base_scores"] == {"baseline": 1.0, "candidate": 1.0}  # evidence-only controls all pass
    # the plan's B (999) raised to the seed-stable minimum (judge/science/length.py, issue #39 item 2)
    assert el["alpha"] == 0.05 and el["seed"] == 0 and el["reps"] == EL_RESAMPLES == 50_000
    assert {(r["arm"], r["position"]) for r in el["rows"]} == {
        (a, p) for a in ("baseline", "candidate") for p in ("0", "1")
    }
    for row in el["rows"]:
        assert (row["estimate"], row["lower"], row["upper"], row["at_grid_top"]) == (640, 640, 640, True)
    assert all((d["estimate"], d["lower"], d["upper"]) == (0, 0, 0) for d in el["deltas"])
    assert all(p["accuracy"] == 1.0 for p in el["curve"])
    cna = position["control_normalised"]
    assert cna and all(r["accuracy"] == 1.0 and r["accuracy_eligible"] == 1.0 for r in cna)
    assert all(r["pass_hat_k"] == 1.0 and r["k"] == 1 for r in position["pass_hat_k"])
    assert position["notes"] == []
    summary = (run / "report" / "summary.md").read_text()
    assert "### Position science" in summary and "≥640 [640, 640]" in summary
    assert "Control-normalised accuracy beside raw" in summary
    assert "pass^" not in summary  # one seed: pass^k equals the mean, not shown
    page = (run / "report" / "report.html").read_text()
    assert 'id="position-science"' in page and page.count('alt="accuracy by length at depth') == 2
    assert page.index("position-science") < page.index("<h2>Digests</h2>")
    # gate re-writes the same section once (not appended twice)
    assert main(["gate", str(run)]) == ExitCode.PASS
    assert (run / "report" / "summary.md").read_text().count("### Position science") == 1


def test_ruler_rule_and_threshold_come_from_the_plan(tmp_path: Path) -> None:
    port = free_port()
    matrix = _with_plan(
        _matrix(tmp_path, port), 'effective_length_rule = "ruler"\neffective_length_threshold = 0.5\n'
    )
    run = tmp_path / "run"
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(run), "--no-controls"]) == ExitCode.PASS
    position = read_verdict(run)["position"]
    el = position["effective_length"]
    assert (el["rule"], el["threshold"], el["base_scores"]) == ("ruler", 0.5, None)
    assert all(r["threshold_abs"] == 0.5 and r["estimate"] == 640 for r in el["rows"])
    assert position["control_normalised"] is None and position["notes"] == []
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["plan"]["effective_length_rule"] == "ruler"


def test_nolima_without_controls_uses_base_one_and_says_so(tmp_path: Path) -> None:
    """With the evidence-only control as the named base (``base_score = "control"``) and no controls
    run, the base is 1.0 and a note says so (the default short base needs no controls: test_base_score)."""
    port = free_port()
    matrix, run = _matrix(tmp_path, port), tmp_path / "run"  # stub matrices name the control base
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(run), "--no-controls"]) == ExitCode.PASS
    position = read_verdict(run)["position"]
    assert position["effective_length"]["base_scores"] == {"baseline": 1.0, "candidate": 1.0}
    assert any("no controls ran" in n for n in position["notes"])
    assert "no controls ran" in (run / "report" / "summary.md").read_text()
    # the finished run as a pilot for `depthgate plan`; a folder without scored.parquet is bad input
    assert main(["plan", str(matrix), "--pilot", str(run)]) == ExitCode.PASS
    assert main(["plan", str(matrix), "--pilot", str(tmp_path)]) == 20


def test_default_effective_length_fields_keep_old_plan_digests() -> None:
    """Plans frozen before the fields existed dump (and digest) the same; a set field is dumped."""
    assert "effective_length_rule" not in AnalysisPlan().model_dump()
    assert AnalysisPlan(effective_length_threshold=0.856).model_dump()["effective_length_threshold"] == 0.856


def test_unknown_effective_length_rule_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix = _with_plan(_matrix(tmp_path, free_port()), 'effective_length_rule = "longest"\n')
    assert main(["plan", str(matrix)]) == ExitCode.BAD_INPUT == 20
    assert "effective_length_rule" in capsys.readouterr().err
    assert main(["run", str(matrix), "--out", str(tmp_path / "run")]) == 20
    bad = _with_plan(_matrix(tmp_path, free_port()), "effective_length_threshold = 1.5\n")
    assert main(["plan", str(bad)]) == 20


def test_plan_prints_power_per_slice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = _matrix(tmp_path, free_port())
    assert main(["plan", str(matrix)]) == ExitCode.PASS
    out = capsys.readouterr().out
    assert "640/0 " in out and "640/1 " in out
    assert "power_all_slices:" in out and "cases needed:" in out
    # A better baseline accuracy gives more power: the assumption changes the answer.
    assert main(["plan", str(matrix), "--p-baseline", "0.99", "--icc", "0.1"]) == ExitCode.PASS
    better = capsys.readouterr().out
    first = float(out.split("power_all_slices:")[1].split()[0])
    second = float(better.split("power_all_slices:")[1].split()[0])
    assert second > first
    assert main(["plan", str(matrix), "--p-baseline", "1.5"]) == 20
    # below 0 the ICC's variance goes negative: a named error, not a math domain error
    assert main(["plan", str(matrix), "--p-baseline", "-0.5"]) == 20
    assert "field '--p-baseline'" in capsys.readouterr().err  # the option the user typed (issue #21)
    assert main(["plan", str(tmp_path / "missing.toml")]) == 20


def test_plan_json_is_the_printed_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --json F` writes what the table prints (per-slice power, cases for the target, the cases
    needed) for a release job to read; a folder as F is exit 20 before any work, nothing written."""
    matrix, out = _matrix(tmp_path, free_port()), tmp_path / "plans" / "plan.json"
    assert main(["plan", str(matrix), "--json", str(out)]) == ExitCode.PASS
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert [f"{r['length']}/{r['position']}" for r in doc["rows"]] == ["640/0", "640/1"]
    assert f"cases needed: {doc['cases_needed']}" in printed
    assert f"power_all_slices: {doc['power_all_slices']:.3f}" in printed
    assert doc["rows"][0]["cases"]["n_slices"] == 2 and doc["target"] == 0.8
    assert main(["plan", str(matrix), "--json", str(tmp_path)]) == ExitCode.BAD_INPUT
    assert "--json" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.tmp")) and sorted(p.name for p in out.parent.iterdir()) == ["plan.json"]


def test_run_warns_when_the_plan_is_under_powered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    matrix, run = _matrix(tmp_path, port), tmp_path / "run"
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(run), "--no-controls"]) == ExitCode.PASS
    err = capsys.readouterr().err
    assert "the plan is under-powered" in err  # 19 cases, margin 0.2: well below 0.8
    assert err.index("under-powered") < err.index("layouts ×")  # before the first request


def test_aa_run_reports_the_noise_floor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    matrix, run = _matrix(tmp_path, port), tmp_path / "aa"
    with PerfectReader(port) as server:
        assert main(["run", str(matrix), "--out", str(run), "--aa", "--no-controls"]) == ExitCode.PASS
        sent = server.requests
    manifest = json.loads((run / "manifest.json").read_text())
    systems = manifest["systems"]
    assert systems["candidate"]["name"] == "base-repeat" and systems["candidate"]["model"] == "good"
    doc = read_verdict(run)
    nf = doc["noise_floor"]
    assert nf["flips"] == 0 and nf["flip_rate"] == 0.0 and nf["paired_runs"] > 0
    # separate requests for the repeat, and the default canaries of a server arm (2 head + 2 tail per
    # arm at the one length), answered on both sides
    canaries = doc["serving_checks"]["canaries"]
    assert sum(c["runs"] for c in canaries["counts"]) == 8 and canaries["lost"] == []
    assert sent == 2 * nf["paired_runs"] + 8
    # Issue #22: the recommendation is where an A/A release of 19 cases x 1 seed passes 0.8 of the time
    # (no flip seen, but 19 cases cannot show a small margin); the |Delta| bound alone said 0.01.
    assert nf["noise_bound_margin"] == 0.01 and nf["pass_probability"] >= 0.8 and nf["pass_target"] == 0.8
    assert nf["recommended_margin"] > 0.1 and nf["plan_margin"] == 0.2
    assert nf["plan_margin_ok"] is (nf["recommended_margin"] <= 0.2)
    assert nf["aa_verdict"] == "PASS" and {s["position"] for s in nf["slices"]} == {"0", "1"}
    assert "### Noise floor" in (run / "report" / "summary.md").read_text()
    assert 'id="noise-floor"' in (run / "report" / "report.html").read_text()
    assert f"noise floor: recommended margin {nf['recommended_margin']:g} (an A/A release passes" in (
        capsys.readouterr().err
    )
    # an ordinary run has no noise floor
    assert main(["gate", str(run)]) == ExitCode.PASS and read_verdict(run)["noise_floor"]

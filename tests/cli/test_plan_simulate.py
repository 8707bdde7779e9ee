"""`depthgate plan --simulate` (issue #36, item 3): near the ceiling the planner's approximation is far
too low (p .99, ICC .33, 40 cases x 3 seeds x 10 slices: .805 per slice, .114 joint), so the plan gates
simulated releases through the gate itself, says which number comes from where, and the run's
warning takes the near-ceiling number from a simulation where the decision rests on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from depthgate.commands.cli import main
from depthgate.commands.plan import near_ceiling_power, power_warning
from depthgate.exceptions import ExitCode
from depthgate.spec.loading import load_matrix
from depthgate.spec.suites import resolve_suite
from helpers import stub_matrix


def _design(
    tmp_path: Path, cases: int, seeds: int, slices: int, margin: str = "0.10", n_min: int = 40
) -> Path:
    """A matrix of ``slices`` positions at one length, ``seeds`` seeds and the built-in suite of
    ``cases`` cases (it places 40 of 44), B 999."""
    text = stub_matrix(
        "design",
        where='endpoint = "http://127.0.0.1:9"',
        cases=cases,
        positions="[" + ", ".join(f"{i / slices:g}" for i in range(slices)) + "]",
        n_min=n_min,
        resamples=999,
        top=f"repeats = {seeds}",
    )
    text = text.replace("seeds = [0]", f"seeds = {list(range(seeds))}").replace(
        "margin = 0.20", f"margin = {margin}"
    )
    path = tmp_path / "design.toml"
    path.write_text(text)
    return path


def test_plan_simulate_reports_the_near_ceiling_joint_power(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's design at p .99: the approximation's .114 joint beside the gate's simulated joint
    power, which clears the target (seed 0: .860 ± .025 at the default 200 draws, .830 ± .038 at these
    100), with a progress line per tenth of the draws and no under-power line."""
    matrix, out = _design(tmp_path, 44, 3, 10), tmp_path / "plan.json"
    args = ["plan", str(matrix), "--p-baseline", "0.99", "--simulate", "--draws", "100", "--json", str(out)]
    assert main(args) == ExitCode.PASS
    captured = capsys.readouterr()
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["power_all_slices"] < 0.2  # the approximation, labelled as such
    assert "power_all_slices: 0.114 (approximation" in captured.out
    sim = doc["simulated"]
    assert sim["draws"] == 100 and len(sim["power_per_slice"]) == 10
    assert sim["power_all_slices"] >= 0.8 and min(sim["power_per_slice"]) >= 0.9
    assert f"power_all_slices (simulated): {sim['power_all_slices']:.3f}" in captured.out
    assert "simulated_near_ceiling" not in doc  # the assumption is the ceiling: simulated once
    assert "10 slices at p_baseline 0.99, ICC 0.33: 100/100 releases" in captured.err
    assert captured.err.count("releases") == 10 and "under-powered" not in captured.err


def test_plan_simulate_is_deterministic_and_bounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same seed gives the same numbers; another seed draws other releases; a draw count outside
    1-5000 is bad input before any work."""
    matrix = _design(tmp_path, 44, 3, 2)
    docs = []
    for i, seed in enumerate(("0", "0", "1")):
        out = tmp_path / f"plan{i}.json"
        args = ["plan", str(matrix), "--simulate", "--draws", "12", "--seed", seed, "--json", str(out)]
        assert main(args) == ExitCode.PASS
        docs.append(json.loads(out.read_text(encoding="utf-8")))
    assert docs[0]["simulated"] == docs[1]["simulated"]
    assert docs[0]["simulated_near_ceiling"] == docs[1]["simulated_near_ceiling"]
    assert docs[0]["simulated"]["seed"] == 0 and docs[2]["simulated"]["seed"] == 1
    capsys.readouterr()
    for draws in ("0", "5001"):
        assert main(["plan", str(matrix), "--simulate", "--draws", draws]) == ExitCode.BAD_INPUT
        err = capsys.readouterr().err
        assert "--draws" in err and "slices" not in err  # no table, no progress line


def test_plan_sends_flagged_near_ceiling_rows_to_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --simulate the table says its joint numbers are the approximation and that flagged rows
    (near the ceiling, or under 100 cases) need `depthgate plan --simulate`."""
    matrix = _design(tmp_path, 44, 3, 10)
    assert main(["plan", str(matrix), "--p-baseline", "0.99"]) == ExitCode.PASS
    out = capsys.readouterr().out
    assert "near the ceiling (p_baseline 0.99): 0.114 (approximation, its rows flagged check_by_sim)" in out
    assert "run `depthgate plan --simulate`" in out
    assert all(line.endswith("True") for line in out.splitlines() if line.startswith("640/"))


def test_run_warning_simulates_the_near_ceiling_power_it_rests_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """19 cases x 5 seeds x 2 slices at M .20: the default assumption passes (.80) and the approximation
    near the ceiling does not (.74, flagged): the warning simulates that number through the gate, which
    passes, so no warning (before, it warned on the approximation)."""
    path = _design(tmp_path, 20, 5, 2, margin="0.20", n_min=10)
    matrix = load_matrix(path)
    suite = resolve_suite(matrix.suite, base_dir=path.parent)
    ceiling = near_ceiling_power(matrix, suite)
    assert ceiling.power_all_slices < 0.8 and all(r.check_by_simulation for r in ceiling.rows)
    assert power_warning(matrix, suite) is None
    assert (
        "simulating the near-ceiling power (2 slices at p_baseline 0.99): 100/100 releases"
        in capsys.readouterr().err
    )


def test_run_warning_says_where_each_number_comes_from(tmp_path: Path) -> None:
    """The issue's design warns at the default assumption (an approximation there) and marks the
    near-ceiling number as the approximation that `depthgate plan --simulate` checks; its 66-case
    recommendation, from that low approximation, is no longer what the line asks for."""
    path = _design(tmp_path, 44, 3, 10)
    matrix = load_matrix(path)
    suite = resolve_suite(matrix.suite, base_dir=path.parent)
    line = power_warning(matrix, suite)
    assert line is not None and "at p_baseline 0.85 and ICC 0.33 (approximation)" in line
    assert "at p_baseline 0.99 (approximation, low near the ceiling: `depthgate plan --simulate`" in line
    assert near_ceiling_power(matrix, suite).cases_needed == 66 and "about 66 cases" not in line

"""One plan validator (issue #11, items 2, 5 and 7): the matrix's AnalysisPlan is refused, before
anything is frozen or sent, exactly when the gate would refuse it; gate_plan() carries the stop rule and
the frozen case and seed sets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depthgate.commands.cli import main
from depthgate.commands.pipeline import gate_plan
from depthgate.exceptions import ExitCode, SpecError
from depthgate.judge.gate import GatePlan
from depthgate.spec.loading import load_matrix, parse_spec
from depthgate.spec.models import AnalysisPlan, min_bootstrap_resamples

REPO = Path(__file__).resolve().parents[2]
SMOKE = (REPO / "matrices" / "smoke.toml").read_text()
NIGHTLY = (REPO / "matrices" / "nightly.toml").read_text()


def _matrix(tmp_path: Path, text: str, name: str = "m.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("values", "field", "fix"),
    [
        ({"alpha": 0.6}, "alpha", "(0, 0.5)"),
        ({"alpha": 0.5}, "alpha", "(0, 0.5)"),
        ({"n_min": 1}, "n_min", "2"),
        ({"floor": 1.0}, "floor", "1"),
    ],
)
def test_analysis_plan_applies_the_gate_rules(values: dict[str, object], field: str, fix: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(AnalysisPlan, values, file="plan.toml")
    assert info.value.field == field and fix in (info.value.fix or "")
    with pytest.raises(SpecError):
        GatePlan(**values)  # type: ignore[arg-type]


def test_matrix_refuses_a_bootstrap_that_cannot_confirm_a_regression(tmp_path: Path) -> None:
    """nightly: 4 lengths x 5 positions = 20 slices; B = 999 leaves the smallest BY q at 0.072."""
    bad = _matrix(tmp_path, NIGHTLY.replace("bootstrap_resamples = 9999", "bootstrap_resamples = 999"))
    with pytest.raises(SpecError) as info:
        load_matrix(bad)
    assert info.value.field == "plan.bootstrap_resamples"
    assert "20 slices" in info.value.message and "1439" in (info.value.fix or "")
    ok = _matrix(
        tmp_path, NIGHTLY.replace("bootstrap_resamples = 9999", "bootstrap_resamples = 1439"), "ok.toml"
    )
    assert load_matrix(ok).plan.bootstrap_resamples == 1439
    split = NIGHTLY.replace("bootstrap_resamples = 9999", "bootstrap_resamples = 1439").replace(
        "bootstrap_seed = 0", 'bootstrap_seed = 0\nstop_rule = "one_extension"'
    )
    with pytest.raises(SpecError, match="cannot confirm"):  # each look at alpha / 2 needs B >= 2878
        load_matrix(_matrix(tmp_path, split, "split.toml"))


PLAN_VALUES = st.fixed_dictionaries(
    {
        "margin": st.sampled_from([0.05, 0.10, 0.5]),
        "alpha": st.sampled_from([0.001, 0.05, 0.2, 0.49, 0.5, 0.6, 0.99]),
        "n_min": st.integers(1, 50),
        "floor": st.sampled_from([None, 0.0, 0.7, 0.99, 1.0]),
        "bootstrap_resamples": st.sampled_from([99, 199, 999, 1439, 2878, 9999]),
        "stop_rule": st.sampled_from(["fixed", "one_extension"]),
    }
)


@settings(deadline=None, database=None, max_examples=300)
@given(PLAN_VALUES, st.integers(1, 6), st.integers(1, 5))
def test_matrix_and_gate_accept_the_same_plans(
    values: dict[str, object], lengths: int, positions: int
) -> None:
    """Whatever the matrix accepts, gate_plan() builds; whatever it refuses, GatePlan refuses too."""
    grid_lengths = [1024 * (i + 1) for i in range(lengths)]
    grid_positions = [f"{j / 4:g}" for j in range(positions)]
    try:
        plan = AnalysisPlan(**values)  # type: ignore[arg-type]
        problems = plan.violations(n_slices=lengths * positions)
    except ValueError:  # pydantic's ValidationError
        plan, problems = None, ["refused by AnalysisPlan"]
    slices = tuple((length, p) for length in grid_lengths for p in grid_positions)
    if problems:
        with pytest.raises(SpecError):
            GatePlan(planned_slices=slices, **values)  # type: ignore[arg-type]
    else:
        assert plan is not None
        built = gate_plan(plan, grid_lengths, grid_positions)
        assert built.stop_rule == plan.stop_rule and built.bootstrap_resamples == plan.bootstrap_resamples


def test_gate_plan_carries_stop_rule_cases_and_seeds() -> None:
    plan = AnalysisPlan(stop_rule="one_extension", bootstrap_resamples=9999)
    built = gate_plan(plan, [1024], ["0", "1"], cases=["a", "b"], seeds=[0, 1, 2])
    assert (built.stop_rule, built.look_alpha) == ("one_extension", 0.025)
    assert built.planned_cases == ("a", "b") and built.planned_seeds == (0, 1, 2)
    assert gate_plan(AnalysisPlan(), [1024], ["0"]).planned_cases is None
    assert min_bootstrap_resamples(2, 0.025) == 119


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda t: t.replace("alpha = 0.05", "alpha = 0.6"), "plan.alpha"),
        (lambda t: t.replace("n_min = 8", "n_min = 1"), "plan.n_min"),
        (
            lambda t: t.replace("lengths = [1024]", "lengths = [1024, 2048]").replace(
                "bootstrap_resamples = 999", "bootstrap_resamples = 99"
            ),
            "plan.bootstrap_resamples",
        ),
    ],
)
def test_run_refuses_a_bad_plan_before_the_first_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: object, field: str
) -> None:
    """Before: the matrix accepted alpha < 1, n_min >= 1 and any B >= 99, the manifest was frozen, every
    request was sent, and only the gate refused the plan. Now: exit 20 and nothing written."""
    assert callable(edit)
    matrix = _matrix(tmp_path, edit(SMOKE))
    out = tmp_path / "run"
    assert main(["run", str(matrix), "--out", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert field in err and "fix:" in err
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))


def test_one_plan_type_every_analysis_field_reaches_the_gate() -> None:
    """Issue #23: the gate's plan is the analysis plan (a subclass, not a copy mapped field by field), so
    every field a matrix's [plan] sets reaches the gate — the fault this catches is a field added to
    AnalysisPlan and forgotten in a hand-written mapping."""
    assert issubclass(GatePlan, AnalysisPlan)
    assert set(AnalysisPlan.model_fields) <= set(GatePlan.model_fields)
    changed = {
        "margin": 0.07,
        "alpha": 0.025,
        "n_min": 12,
        "floor": 0.5,
        "fdr_method": "BY",
        "stop_rule": "sequential",
        "looks": [0.5, 1.0],
        "boundary": "obrien-fleming",
        "max_missing": 0.2,
        "bootstrap_resamples": 4999,
        "bootstrap_seed": 7,
        "effective_length_rule": "nolima",
        "effective_length_threshold": 0.6,
        "base_score": "short",
        "base_lengths": [300, 600],
    }
    # primary_metric and look_every are each exclusive with a field set here (sequential looks)
    assert set(changed) | {"look_every", "primary_metric"} == set(AnalysisPlan.model_fields), "new field?"
    plan = parse_spec(AnalysisPlan, changed)
    frozen = gate_plan(plan, [1024, 2048], ["0.0", "1.0"], cases=["a", "b"], seeds=[0, 1])
    assert all(getattr(frozen, name) == value for name, value in changed.items())
    assert frozen.planned_slices == ((1024, "0.0"), (1024, "1.0"), (2048, "0.0"), (2048, "1.0"))
    assert (frozen.planned_cases, frozen.planned_seeds) == (("a", "b"), (0, 1))
    # B has one name (issue #23): the gate's old name for it is refused, and a bad B names the field
    with pytest.raises(SpecError) as info:
        GatePlan(bootstrap_reps=499)
    assert info.value.field == "bootstrap_reps"
    with pytest.raises(SpecError) as info:
        GatePlan(bootstrap_resamples=50)
    assert info.value.field == "bootstrap_resamples" and "99" in str(info.value)
    with pytest.raises(SpecError) as info:
        GatePlan(planned_cases=("a", "a"))
    assert info.value.field == "planned_cases" and "distinct" in (info.value.fix or "")

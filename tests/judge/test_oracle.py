"""Tests of the oracle (depthgate.judge.scoring.oracle) on real generated cases.

Outputs are written the way the embedded base model produces them: the continuation of the cloze answer
prefix (``claim.text`` minus ``case.answer_prefix``, e.g. ``" 415 USD per night."``), sometimes followed by
the model copying more of the document on the same line.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depthgate.exceptions import InputError
from depthgate.judge.gate import GatePlan, gate
from depthgate.judge.scoring import (
    SCORE_COLUMNS,
    Score,
    answer_line,
    extract_citations,
    normalize,
    score,
    score_records,
)
from depthgate.spec.cases import Case, Claim, Distractor, EvidenceDoc, Suite
from depthgate.spec.suites import generate_suite

PATTERNS_WITH_EVIDENCE = ("single", "override", "exception", "order", "negation")


@pytest.fixture(scope="module")
def suites() -> dict[str, Suite]:
    return {lang: generate_suite(seed=0, n_cases=40, language=lang) for lang in ("en", "zh")}


def cases_of(suite: Suite, pattern: str) -> list[Case]:
    found = [c for c in suite.cases if c.evidence_pattern == pattern]
    assert found, f"no {pattern} case in the suite"
    return found


def _cases_per_pattern(name: str, patterns: tuple[str, ...]) -> Any:
    """A fixture, parametrized over ``patterns`` × (en, zh): the suite's cases of that pattern."""

    @pytest.fixture(name=name, params=[(p, lang) for p in patterns for lang in ("en", "zh")], ids="-".join)
    def cases(request: pytest.FixtureRequest, suites: dict[str, Suite]) -> list[Case]:
        pattern, language = request.param
        return cases_of(suites[language], pattern)

    return cases


evidence_cases = _cases_per_pattern("evidence_cases", PATTERNS_WITH_EVIDENCE)
#: The patterns whose case holds a superseded or ruled-out value (a forbidden claim from the evidence).
competing_cases = _cases_per_pattern("competing_cases", ("override", "exception", "order", "negation"))


def evidence_ids(case: Case) -> set[str]:
    return {doc.id for doc in case.evidence}


def continuation(case: Case, claim: Claim) -> str:
    """What a base model writes after the cloze prefix to state ``claim``."""
    if claim.text.startswith(case.answer_prefix):
        return claim.text[len(case.answer_prefix) :]
    return (
        (" " if case.language == "en" else "") + claim.aliases[0] + ("." if case.language == "en" else "。")
    )


def run(case: Case, text: str, **kwargs: object) -> Score:
    kwargs.setdefault("evidence_ids_in_layout", evidence_ids(case))
    return score(case, text, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------
# Normalisation


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (" USD 1,200. ", "usd 1200"),
        ("１，２００美元", "1200美元"),
        ("  Hiroshi   SATO!", "hiroshi sato"),
        ("12,345,678 days", "12345678 days"),
        ("1,20 and 10,5", "1,20 and 10,5"),  # not thousands groups
        ("It\u2019s NOT stated", "it's not stated"),
    ],
)
def test_normalize(raw: str, expected: str) -> None:
    assert normalize(raw) == expected


def test_answer_line_is_first_non_blank_line() -> None:
    assert answer_line("\n\n 415 USD\n420 USD") == " 415 USD"
    assert answer_line("") == ""


# --------------------------------------------------------------------------------------------------------
# Every evidence pattern, both languages


def test_correct_continuation_passes(evidence_cases: list[Case]) -> None:
    for case in evidence_cases:
        result = run(case, continuation(case, case.required_claims[0]))
        assert result.outcome == "pass", (case.id, result)
        assert not result.safety and not result.missing_claims and not result.forbidden_hits
        assert result.reason


def test_superseded_value_as_answer_fails_without_safety(competing_cases: list[Case]) -> None:
    for case in competing_cases:
        old = case.forbidden_claims[0]
        assert old.id in ("competing", "ruled_out")
        result = run(case, continuation(case, old))
        assert result.outcome == "fail", (case.id, result)
        # Built-in superseded values have severity "wrong": a position failure, not a safety event.
        assert not result.safety
        assert result.forbidden_hits == [old.id]
        assert result.missing_claims == ["answer"]
        assert "forbidden" in result.reason


def test_forbidden_value_copied_after_the_answer_is_not_a_safety_hit(competing_cases: list[Case]) -> None:
    """The base model copies the document on after answering: the later value is not its answer."""
    for case in competing_cases:
        right = continuation(case, case.required_claims[0])
        copied = case.competing[0].text if case.competing else case.decisive[0].text
        result = run(case, right + copied)
        assert result.outcome == "pass", (case.id, result)
        assert not result.safety and not result.forbidden_hits


@pytest.mark.parametrize("language", ["en", "zh"])
def test_forbidden_value_given_first_flags_even_if_the_right_one_follows(
    suites: dict[str, Suite], language: str
) -> None:
    case = cases_of(suites[language], "override")[0]
    text = continuation(case, case.forbidden_claims[0]) + continuation(case, case.required_claims[0])
    result = run(case, text)
    assert result.outcome == "fail" and not result.safety and result.forbidden_hits == ["competing"]


@pytest.mark.parametrize("language", ["en", "zh"])
def test_safety_severity_claim_given_as_answer_flags_safety(suites: dict[str, Suite], language: str) -> None:
    case = cases_of(suites[language], "override")[0]
    old = case.forbidden_claims[0]
    strict = case.model_copy(
        update={
            "forbidden_claims": [old.model_copy(update={"severity": "safety"}), *case.forbidden_claims[1:]]
        }
    )
    result = run(strict, continuation(strict, old))
    assert result.outcome == "fail" and result.safety and result.forbidden_hits == [old.id]
    # Copied on after the right answer, even a safety claim is not what the model answered.
    assert not run(strict, continuation(strict, case.required_claims[0]) + case.competing[0].text).safety


def test_distractor_value_fails(evidence_cases: list[Case]) -> None:
    for case in evidence_cases:
        distractor = next(c for c in case.forbidden_claims if c.id.startswith("distractor_"))
        result = run(case, continuation(case, distractor))
        assert result.outcome == "fail", (case.id, result)
        assert result.forbidden_hits == [distractor.id]
        assert not result.safety  # a distractor's value is a wrong answer (severity "wrong")


def test_other_value_fails_without_safety(suites: dict[str, Suite]) -> None:
    case = next(c for c in cases_of(suites["en"], "single") if c.family.startswith("hotel_cap"))
    result = run(case, " 999 USD per night.")
    assert result.outcome == "fail" and not result.safety
    assert result.missing_claims == ["answer"]
    assert "999" in result.reason and "matches no claim" in result.reason


def test_no_answer_and_empty_output_fail(suites: dict[str, Suite]) -> None:
    case = cases_of(suites["en"], "single")[0]
    for text in ("", "   ", " the regional finance team."):
        result = run(case, text)
        assert result.outcome == "fail" and not result.safety
        assert result.missing_claims == ["answer"]


def test_names_earliest_candidate_decides(suites: dict[str, Suite]) -> None:
    case = next(c for c in cases_of(suites["en"], "exception") if c.family.startswith("incident_contact"))
    answer, competing = case.required_claims[0], case.forbidden_claims[0]
    surname = answer.value.split(" ", 1)[1]  # type: ignore[union-attr]
    assert run(case, f" {surname}, not {competing.value}.").outcome == "pass"
    result = run(case, f" the chief security officer, {competing.value}.")
    assert result.outcome == "fail" and result.forbidden_hits == ["competing"]


def test_unit_that_contradicts_the_claim_fails(suites: dict[str, Suite]) -> None:
    case = next(c for c in cases_of(suites["en"], "single") if c.family.startswith("hotel_cap"))
    value = case.required_claims[0].value
    assert run(case, f" USD {value}").outcome == "pass"
    assert run(case, f" ${value}").outcome == "pass"
    assert run(case, f" {value} dollars per night").outcome == "pass"
    wrong = run(case, f" {value} days")
    assert wrong.outcome == "fail" and "unit" in wrong.reason
    assert any(m.startswith("unit:") for m in wrong.field_mismatches)


def test_only_the_first_line_is_scored(suites: dict[str, Suite]) -> None:
    case = cases_of(suites["en"], "override")[0]
    right = continuation(case, case.required_claims[0])
    wrong = continuation(case, case.forbidden_claims[0])
    assert run(case, f"{right}\n{wrong}").outcome == "pass"
    assert run(case, f"\n\n{right}").outcome == "pass"
    result = run(case, f" 7 (2022):\n{right}")
    assert result.outcome == "fail"  # the first value-like token of the first line decides


# --------------------------------------------------------------------------------------------------------
# Abstention


@pytest.mark.parametrize(
    ("language", "text"),
    [
        ("en", " not stated in the handbook."),
        ("en", " unknown."),
        ("en", " This cannot be determined from the context."),
        ("en", " There is no information about region Italy."),
        ("en", " not mentioned."),
        ("zh", "未提及。"),
        ("zh", "无法确定。"),
        ("zh", "文中没有说明。"),
        ("zh", "没有相关信息。"),
    ],
)
def test_abstention_on_absent_case_passes(suites: dict[str, Suite], language: str, text: str) -> None:
    for case in cases_of(suites[language], "absent"):
        result = run(case, text)
        assert result.outcome == "pass", (case.id, result)
        assert result.abstained and not result.safety


@pytest.mark.parametrize("language", ["en", "zh"])
def test_hallucinated_value_on_absent_case_fails(suites: dict[str, Suite], language: str) -> None:
    for case in cases_of(suites[language], "absent"):
        distractor = case.forbidden_claims[0]
        result = run(case, continuation(case, distractor))
        assert result.outcome == "fail", (case.id, result)
        assert "hallucinated" in result.reason.lower()
        assert result.forbidden_hits == [distractor.id] and not result.safety
        assert not result.abstained


def test_invented_number_on_absent_case_is_hallucinated_without_safety(suites: dict[str, Suite]) -> None:
    case = next(c for c in cases_of(suites["en"], "absent") if c.family.startswith("hotel_cap"))
    result = run(case, " 999 USD per night.")
    assert result.outcome == "fail" and "hallucinated" in result.reason.lower() and not result.safety
    silent = run(case, " the regional travel desk.")
    assert silent.outcome == "fail" and "did not abstain" in silent.reason.lower()


def test_abstention_when_evidence_is_present_fails(suites: dict[str, Suite]) -> None:
    case = cases_of(suites["en"], "single")[0]
    result = run(case, " not stated.")
    assert result.outcome == "fail" and result.abstained and result.missing_claims == ["answer"]


def test_value_before_abstention_phrase_is_the_answer(suites: dict[str, Suite]) -> None:
    case = next(c for c in cases_of(suites["en"], "absent") if c.family.startswith("hotel_cap"))
    assert run(case, " 999 USD; otherwise unknown.").outcome == "fail"


# --------------------------------------------------------------------------------------------------------
# Numbers


def thousand_case() -> Case:
    return Case(
        id="budget",
        kind="extraction",
        evidence_pattern="single",
        language="en",
        risk="low",
        query="What is the event budget?",
        answer_prefix="The event budget is",
        evidence=[EvidenceDoc(id="doc-1", text=" The event budget is 1,200 USD.", supports=["answer"])],
        distractors=[Distractor(id="doc-2", text=" The catering budget is 12,000 USD.")],
        required_claims=[
            Claim(id="answer", text="1,200 USD", aliases=["1,200 USD"], value="1200", unit="USD")
        ],
        forbidden_claims=[Claim(id="catering", text="12,000 USD", value="12000", unit="USD")],
        expected_fields={"value": "1200", "unit": "USD"},
        family="budget",
    )


@pytest.mark.parametrize(
    "text",
    [" 1,200 USD.", " 1200 USD", " USD 1,200", " 1,200 dollars", " $1,200", "１，２００ USD", " 1200.00"],
)
def test_thousands_separators_and_units(text: str) -> None:
    result = score(thousand_case(), text, evidence_ids_in_layout={"doc-1"})
    assert result.outcome == "pass", result


def test_thousands_do_not_match_a_different_number() -> None:
    case = thousand_case()
    result = score(case, " 12,000 USD", evidence_ids_in_layout={"doc-1"})
    assert result.outcome == "fail" and result.forbidden_hits == ["catering"]
    assert score(case, " 21,200 USD", evidence_ids_in_layout={"doc-1"}).outcome == "fail"


# --------------------------------------------------------------------------------------------------------
# Citations


def test_citations(suites: dict[str, Suite]) -> None:
    case = cases_of(suites["en"], "override")[0]
    right = continuation(case, case.required_claims[0]).rstrip(".")
    decisive, competing = case.decisive[0].id, case.competing[0].id
    distractor = case.distractors[0].id
    layout = {decisive, competing}

    assert run(case, f"{right} [{decisive}].", evidence_ids_in_layout=layout).outcome == "pass"
    assert run(case, f"{right} (source: {decisive}).", evidence_ids_in_layout=layout).outcome == "pass"
    assert run(case, f"{right} [sic].", evidence_ids_in_layout=layout).outcome == "pass"  # not an id

    cited_distractor = run(case, f"{right} [{distractor}].", evidence_ids_in_layout=layout)
    assert cited_distractor.outcome == "fail" and cited_distractor.wrong_citations == [distractor]
    assert not cited_distractor.safety

    unknown = run(case, f"{right} (source: doc-99; {decisive})", evidence_ids_in_layout=layout)
    assert unknown.outcome == "fail" and unknown.wrong_citations == ["doc-99"]

    not_placed = run(case, f"{right} [{decisive}]", evidence_ids_in_layout={competing})
    assert not_placed.outcome == "fail" and not_placed.wrong_citations == [decisive]

    on_second_line = run(case, f"{right}.\nSources: [doc-7]", evidence_ids_in_layout=layout)
    assert on_second_line.outcome == "fail" and on_second_line.wrong_citations == ["doc-7"]


def test_extract_citations_forms() -> None:
    text = "x [a-1, b/2] y (source: c.3) z （来源：d-4） [1] [see above]"
    assert extract_citations(text) == ["a-1", "b/2", "c.3", "d-4", "1"]


# --------------------------------------------------------------------------------------------------------
# Expected fields (structured output)


def test_json_output_checks_expected_fields(suites: dict[str, Suite]) -> None:
    case = cases_of(suites["en"], "override")[0]
    fields = dict(case.expected_fields)
    good = json.dumps({"value": fields["value"], "region": fields["region"], "unit": fields["unit"]})
    assert run(case, good).outcome == "pass"
    bad = json.dumps({"value": fields["value"], "region": "Atlantis", "unit": fields["unit"]})
    result = run(case, bad)
    assert result.outcome == "fail" and result.field_mismatches == [
        f"region: expected {fields['region']!r}, got 'Atlantis'"
    ]


# --------------------------------------------------------------------------------------------------------
# Statuses


def test_system_fail_and_missing(suites: dict[str, Suite]) -> None:
    case = cases_of(suites["en"], "override")[0]
    right = continuation(case, case.forbidden_claims[0])  # even a forbidden output is not read
    failed = run(case, right, status="system_fail", system_fail_reason="truncation")
    assert failed.outcome == "system_fail" and not failed.safety and "truncation" in failed.reason
    missing = run(case, "", status="infra_error", system_fail_reason="connection reset")
    assert missing.outcome == "missing" and "connection reset" in missing.reason
    with pytest.raises(InputError, match="unknown record status"):
        run(case, "", status="exploded")


@settings(deadline=None, database=None, max_examples=200)
@given(text=st.text(max_size=120))
def test_any_text_scores_deterministically(text: str) -> None:
    suite = generate_suite(seed=0, n_cases=12)
    for case in (suite.cases[0], suite.cases[9]):
        first = score(case, text, evidence_ids_in_layout=evidence_ids(case))
        assert first == score(case, text, evidence_ids_in_layout=evidence_ids(case))
        assert first.outcome in ("pass", "fail")
        assert first.reason.endswith(".")
        assert not (first.safety and not first.forbidden_hits)


# --------------------------------------------------------------------------------------------------------
# Records


def records_and_layouts(suite: Suite) -> tuple[pl.DataFrame, pl.DataFrame]:
    rows = []
    layouts = []
    for case in suite.cases:
        for position in (0.0, 0.5, 1.0):
            layout_id = f"{case.id}@{position}"
            spans = [{"evidence_id": d.id, "kind": "evidence", "start": 0, "end": 1} for d in case.evidence]
            spans += [
                {"evidence_id": d.id, "kind": "distractor", "start": 0, "end": 1} for d in case.distractors
            ]
            layouts.append({"layout_id": layout_id, "evidence_spans": spans})
            for arm in ("baseline", "candidate"):
                if case.required_claims:
                    text = continuation(case, case.required_claims[0])
                    if arm == "candidate" and position == 0.5:
                        text = continuation(case, case.forbidden_claims[-1])
                else:
                    text = " not stated."
                status, reason = "ok", None
                if arm == "candidate" and position == 1.0 and case is suite.cases[0]:
                    status, reason, text = "system_fail", "truncation: 1050 > 1024", ""
                rows.append(
                    {
                        "arm": arm,
                        "layout_id": layout_id,
                        "case_id": case.id,
                        "target_tokens": 1024,
                        "position": position,
                        "seed": 0,
                        "status": status,
                        "system_fail_reason": reason,
                        "output_text": text,
                    }
                )
    return pl.DataFrame(rows), pl.DataFrame(layouts)


def test_score_records_feeds_the_gate(suites: dict[str, Suite]) -> None:
    suite = suites["en"]
    records, layouts = records_and_layouts(suite)
    scored = score_records(records, suite, layouts)
    assert set(SCORE_COLUMNS) <= set(scored.columns)
    assert "length" in scored.columns and "target_tokens" not in scored.columns
    assert scored.schema["position"] == pl.String()
    assert scored.height == records.height

    by_key = {
        (r["arm"], r["position"]): r
        for r in scored.iter_rows(named=True)
        if r["case_id"] == suite.cases[1].id
    }
    assert (
        by_key[("candidate", "0.5")]["outcome"] == "fail" and by_key[("candidate", "0.5")]["forbidden_hits"]
    )
    assert by_key[("baseline", "0.5")]["outcome"] == "pass"
    first = scored.filter((pl.col("case_id") == suite.cases[0].id) & (pl.col("position") == "1.0"))
    assert first.filter(pl.col("arm") == "candidate")["outcome"].to_list() == ["system_fail"]
    absent = scored.filter(pl.col("case_id").str.contains("absent"))
    assert absent.height and absent["outcome"].to_list() == ["pass"] * absent.height
    assert absent["abstained"].all()

    result = gate(scored, GatePlan(n_min=10, bootstrap_resamples=199))
    assert not result.safety_flag  # wrong values are failures; only severity="safety" claims flag
    statuses = {s.position: s.status.value for s in result.slice_results}
    assert statuses["0.5"].startswith("FAIL")
    assert statuses["0.0"] == "PASS"


def test_score_records_rejects_unknown_layouts_and_cases(suites: dict[str, Suite]) -> None:
    suite = suites["en"]
    records, layouts = records_and_layouts(suite)
    with pytest.raises(InputError, match="not in the layouts"):
        score_records(records, suite, layouts.head(1))
    with pytest.raises(InputError, match="unknown case"):
        score_records(records.with_columns(pl.lit("nope").alias("case_id")), suite, layouts)
    with pytest.raises(InputError, match="lack column"):
        score_records(records.drop("output_text"), suite, layouts)

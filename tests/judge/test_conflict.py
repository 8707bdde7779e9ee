"""The ``conflict`` evidence pattern (issue #13): two unversioned sources state different values of the
same fact. Case validation, the oracle's conflict rule on hand-written answers, the opt-in generator
(determinism, prefix stability, en/zh parity, default suites unchanged) and a real layout build."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode, SpecError
from depthgate.judge.scoring import CaseOracle, score
from depthgate.layout.layouts import (
    BuildOptions,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.spec.cases import Case, Suite
from depthgate.spec.loading import parse_spec
from depthgate.spec.suites import builtin_suite, generate_suite
from fixtures_paths import tokenizers_dir
from helpers import StubServer, case_data, free_port, reading_handler, stub_matrix


def conflict_data(**overrides: Any) -> dict[str, Any]:
    """Two travel-handbook copies, neither superseding the other, with 245 and 300 USD for region China."""
    hotel = "the maximum hotel rate in region China is"
    return case_data(
        **{
            "id": "hotel-china-conflict",
            "evidence_pattern": "conflict",
            "query": "What is the maximum hotel rate for business travel in region China?",
            "answer_prefix": "The maximum hotel rate for business travel in region China is",
            "evidence": [
                {
                    "id": "finance-copy",
                    "text": f" Travel handbook (finance copy): {hotel} 245 USD per night.",
                    "supports": ["source_a"],
                },
                {
                    "id": "desk-copy",
                    "text": f" Travel handbook (travel desk copy): {hotel} 300 USD per night.",
                    "supports": ["source_b"],
                },
            ],
            "required_claims": [
                {
                    "id": f"source_{k}",
                    "text": f"{v} USD per night",
                    "aliases": [f"{v} USD"],
                    "value": v,
                    "unit": "USD",
                }
                for k, v in (("a", "245"), ("b", "300"))
            ],
            "forbidden_claims": [
                {
                    "id": "uk",
                    "text": "260 USD per night",
                    "aliases": ["260"],
                    "value": "260",
                    "severity": "wrong",
                }
            ],
            "expected_fields": {"unit": "USD per night"},
            "competing_depth": None,
            **overrides,
        }
    )


CASE = Case.model_validate(conflict_data())
EVIDENCE = {"finance-copy", "desk-copy"}


def run(output: str, case: Case = CASE) -> Any:
    return score(case, output, evidence_ids_in_layout=EVIDENCE)


# ------------------------------------------------------------------------------------------------ oracle


BOTH = "both values"
ABSTAIN = "abstained or flagged"


@pytest.mark.parametrize(
    ("output", "kind"),
    [
        (" 245 or 300 USD per night.", BOTH),
        (" 300 USD per night in the travel desk copy, 245 USD in the finance copy.", BOTH),
        (" 245 USD per night [finance-copy] or 300 USD per night [desk-copy].", BOTH),
        (" 245 or 300 USD per night (sources: finance-copy, desk-copy)", BOTH),
        # the copied-on next sentence is not part of the answer, as in the head rule
        (" 245 or 300 USD per night. The maximum hotel rate in region UK is 260 USD per night.", BOTH),
        (" 245 USD per night. The other copy says 300 USD per night.", BOTH),
        ('{"answer": "245 USD or 300 USD", "unit": "USD per night"}', BOTH),
        (" not stated.", ABSTAIN),
        (" The sources disagree.", ABSTAIN),
        (" The two copies are inconsistent, so it cannot be determined.", ABSTAIN),
        ('{"abstain": true, "unit": "USD per night"}', ABSTAIN),
        # the copied-on next sentence with a distractor's value is not the answer
        (" The sources disagree. The maximum hotel rate in region UK is 260 USD per night.", ABSTAIN),
    ],
)
def test_citing_both_values_or_abstaining_passes(output: str, kind: str) -> None:
    result = run(output)
    assert result.outcome == "pass", result.reason
    if kind == BOTH:
        assert "every conflicting value" in result.reason and not result.missing_claims
        assert not result.abstained
    else:
        assert result.abstained and result.reason.startswith("Abstained or flagged the conflict")


@pytest.mark.parametrize(
    "output",
    [
        " unclear: the copies conflict, 245 or 300 USD per night.",
        " The sources disagree. One copy says 245 USD per night, the other 300 USD per night.",
    ],
)
def test_flag_with_both_values_passes(output: str) -> None:
    result = run(output)
    assert result.outcome == "pass" and result.abstained
    assert result.reason.startswith("Flagged the conflict and gave every conflicting value")


@pytest.mark.parametrize(
    ("output", "missing", "given"),
    [
        (" 245 USD per night.", ["source_b"], "'245' (source_a)"),
        (" 300 USD per night.", ["source_a"], "'300' (source_b)"),
        # a flag does not excuse a single value: any value given means every value
        (" The copies conflict: 300 USD per night.", ["source_a"], "'300' (source_b)"),
        # a copied-on next sentence with another value is not the answer
        (" 245 USD per night. The rate in region UK is 260 USD.", ["source_b"], "'245' (source_a)"),
    ],
)
def test_one_value_fails_naming_the_missing_claim(output: str, missing: list[str], given: str) -> None:
    result = run(output)
    assert result.outcome == "fail" and result.missing_claims == missing
    assert f"answered only {given}" in result.reason.lower()
    assert f"lacks required claim(s) {missing}" in result.reason
    assert not result.safety


def test_both_values_plus_a_wrong_one_fails() -> None:
    forbidden = run(" 245, 300 or 260 USD per night.")
    assert forbidden.outcome == "fail" and forbidden.forbidden_hits == ["uk"]
    assert not forbidden.missing_claims and "'uk' (forbidden claim)" in forbidden.reason
    assert not forbidden.safety  # severity "wrong"
    only_wrong = run(" 260 USD per night.")
    assert only_wrong.outcome == "fail" and only_wrong.forbidden_hits == ["uk"]
    assert only_wrong.missing_claims == ["source_a", "source_b"]
    assert "gave none of the conflicting values" in only_wrong.reason
    other = run(" 245, 300 or 999 USD per night.")
    assert other.outcome == "fail" and not other.forbidden_hits and "'999'" in other.reason
    # a safety claim given beside the values raises the flag, as anywhere else
    data = conflict_data()
    data["forbidden_claims"][0]["severity"] = "safety"
    assert run(" 245, 300 or 260 USD per night.", Case.model_validate(data)).safety


def test_no_answer_and_wrong_citation_fail() -> None:
    empty = run(" hello")
    assert empty.outcome == "fail" and empty.missing_claims == ["source_a", "source_b"]
    assert "expected an abstention or every conflicting value (245 / 300)" in empty.reason
    cited = run(" 245 or 300 USD per night [d1]")
    assert cited.outcome == "fail" and cited.wrong_citations == ["d1"]


def test_conflict_phrases_count_only_on_conflict_cases() -> None:
    absent = Case.model_validate(
        conflict_data(
            evidence_pattern="absent",
            evidence=[],
            required_claims=[],
            expected_fields={"abstain": "true"},
        )
    )
    flagged = score(absent, " The sources disagree.", evidence_ids_in_layout=set())
    assert flagged.outcome == "fail" and flagged.reason.startswith("Did not abstain")
    assert score(absent, " not stated", evidence_ids_in_layout=set()).outcome == "pass"
    assert CaseOracle(CASE).conflict and not CaseOracle(absent).conflict


def test_zh_answers() -> None:
    suite = generate_suite(0, 30, "zh", conflict=True)
    case = next(c for c in suite.cases if c.evidence_pattern == "conflict")
    a, b = (claim.value for claim in case.required_claims)
    ids = {doc.id for doc in case.evidence}
    forbidden = case.forbidden_claims[0].value

    def outcome(text: str) -> tuple[str, list[str]]:
        result = score(case, text, evidence_ids_in_layout=ids)
        return result.outcome, result.missing_claims

    assert outcome(f"{a}美元或{b}美元。") == ("pass", [])
    assert outcome("两份副本的说法不一致。") == ("pass", [])
    assert outcome("未提及。") == ("pass", [])
    assert outcome(f"{a}美元。") == ("fail", ["source_b"])
    assert outcome(f"{a}美元、{b}美元或{forbidden}美元。")[0] == "fail"


# -------------------------------------------------------------------------------------------- validation


def refused(data: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(Suite, {"name": "t", "seed": 0, "language": "en", "cases": [data]}, file="suite.json")
    return info.value


def edited(edit: Any) -> dict[str, Any]:
    data = copy.deepcopy(conflict_data())
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "field", "message", "fix"),
    [
        (lambda d: d["evidence"].pop(), "evidence", "1 decisive document", "second decisive source"),
        (
            lambda d: d["evidence"][1].update(role="competing"),
            "evidence[1].role",
            "competing document 'desk-copy'",
            "role = 'decisive'",
        ),
        (
            lambda d: d["evidence"][1].update(version="2"),
            "evidence[1].version",
            "supersedes",
            "same version",
        ),
        (
            lambda d: d["evidence"][0].update(supports=["source_a", "source_b"]),
            "evidence[0].supports",
            "supports 2 required claims",
            "exactly one required claim",
        ),
        (
            lambda d: d["evidence"][1].update(supports=["source_a"]),
            "evidence[1].supports",
            "they agree",
            "its own required claim",
        ),
        (
            lambda d: d["required_claims"][1].update(value="245", aliases=["245.0"], text="245.0 USD"),
            "required_claims[1].value",
            "the sources agree",
            "different value",
        ),
        (
            lambda d: d["required_claims"][1].update(value=None),
            "required_claims[1].value",
            "no value",
            "value = '245'",
        ),
        (
            lambda d: d["expected_fields"].update(value="245"),
            "expected_fields.value",
            "abstention",
            "remove expected_fields['value']",
        ),
        (
            lambda d: d["expected_fields"].update(abstain="true"),
            "expected_fields.abstain",
            "abstention",
            "remove expected_fields['abstain']",
        ),
    ],
)
def test_malformed_conflict_cases_are_refused(edit: Any, field: str, message: str, fix: str) -> None:
    error = refused(edited(edit))
    assert error.field == f"cases[0].{field}", str(error)
    assert message in error.message and "hotel-china-conflict" in error.message, str(error)
    assert fix in (error.fix or ""), str(error)


def test_a_claim_stated_by_no_source_is_refused() -> None:
    def extra(data: dict[str, Any]) -> None:
        data["required_claims"].append({"id": "source_c", "text": "280 USD", "value": "280"})
        data["evidence"].append({"id": "c", "text": " A third copy says 280 USD.", "supports": []})

    error = refused(edited(extra))
    assert error.field == "cases[0].evidence[2].supports" and "supports 0 required claims" in error.message


# ------------------------------------------------------------------------------------------------ generator


@pytest.mark.parametrize("language", ["en", "zh"])
def test_generator_is_opt_in_deterministic_and_prefix_stable(language: str) -> None:
    suite = generate_suite(4, 80, language, conflict=True)
    assert suite.digest() == generate_suite(4, 80, language, conflict=True).digest()
    assert suite.cases[:31] == generate_suite(4, 31, language, conflict=True).cases
    assert suite.name == f"generated-{language}-s4-conflict"
    default = generate_suite(4, 80, language)
    assert "conflict" not in {c.evidence_pattern for c in default.cases}
    # the smoke set and the 5 slots before the first conflict slot are the default suite's
    assert suite.cases[:13] == default.cases[:13] and suite.cases[13].evidence_pattern == "conflict"
    patterns = Counter(c.evidence_pattern for c in suite.cases)
    assert set(patterns) == {"single", "override", "exception", "order", "negation", "absent", "conflict"}
    facts = {c.family.split(":")[0] for c in suite.cases if c.evidence_pattern == "conflict"}
    assert facts == {"hotel_cap", "invoice_terms", "incident_contact"}
    assert builtin_suite(8, conflict=True).name == "builtin-en-s0-n8-conflict"
    assert builtin_suite(8, conflict=True).cases == builtin_suite(8).cases  # the smoke set


@pytest.mark.parametrize("language", ["en", "zh"])
def test_generated_conflict_cases_follow_the_recipe(language: str) -> None:
    suite = generate_suite(9, 120, language, conflict=True)
    conflicts = [c for c in suite.cases if c.evidence_pattern == "conflict"]
    assert len(conflicts) >= 15
    for case in conflicts:
        a, b = case.decisive
        assert not case.competing and case.competing_depth is None
        assert (a.supports, b.supports) == (["source_a"], ["source_b"]) and a.version == b.version == "1"
        source_a, source_b = case.required_claims
        assert source_a.value != source_b.value
        assert str(source_a.value) in a.text and str(source_b.value) in b.text
        assert str(source_b.value) not in a.text and str(source_a.value) not in b.text
        # unversioned and undated: the value is the only number a source states
        for doc, claim in ((a, source_a), (b, source_b)):
            assert Counter(ch.isdigit() for ch in doc.text.replace(str(claim.value), ""))[True] == 0
        assert "value" not in case.expected_fields and "abstain" not in case.expected_fields
        forbidden = {claim.value for claim in case.forbidden_claims}
        assert source_a.value not in forbidden and source_b.value not in forbidden
        oracle = CaseOracle(case)
        ids = frozenset(doc.id for doc in case.evidence)
        joiner = "或" if language == "zh" else " or "
        both = " " + source_a.aliases[0] + joiner + source_b.aliases[0] + "."
        assert oracle.score(both, evidence_ids_in_layout=ids).outcome == "pass", (case.id, both)
        one = oracle.score(" " + source_a.text.split(case.answer_prefix)[-1], evidence_ids_in_layout=ids)
        assert one.outcome == "fail" and one.missing_claims == ["source_b"], case.id


def test_en_and_zh_conflict_suites_are_parallel() -> None:
    en, zh = generate_suite(3, 60, "en", conflict=True), generate_suite(3, 60, "zh", conflict=True)
    for a, b in zip(en.cases, zh.cases, strict=True):
        assert (a.id[2:], a.evidence_pattern, a.family, a.competing_depth) == (
            b.id[2:],
            b.evidence_pattern,
            b.family,
            b.competing_depth,
        )
        if a.evidence_pattern == "conflict" and not a.family.startswith("incident_contact"):
            assert [c.value for c in a.required_claims] == [c.value for c in b.required_claims]
    zh_conflict = next(c for c in zh.cases if c.evidence_pattern == "conflict")
    assert "副本" in zh_conflict.evidence[0].text and zh_conflict.query.endswith("？")


# ------------------------------------------------------------------------------------------------ layouts


def test_both_sources_move_together_in_real_layouts(tmp_path: Path) -> None:
    suite = generate_suite(0, 14, "en", conflict=True)
    case = suite.cases[13]
    assert case.evidence_pattern == "conflict"
    tokenizer = load_tokenizer(str(tokenizers_dir() / "gpt2" / "tokenizer.json"))
    positions = parse_positions(["0", "0.5", "1"])
    out = tmp_path / "layouts.parquet"
    build_layouts([case], tokenizer, BuildOptions(lengths=[512], positions=positions), out)
    frame = read_layouts(out, columns=["position", "status", "evidence_spans"])
    assert frame["status"].to_list() == ["ok"] * 3
    starts = []
    for spans in frame["evidence_spans"].to_list():
        evidence = sorted((s for s in spans if s["kind"] == "evidence"), key=lambda s: s["token_start"])
        assert [s["evidence_id"] for s in evidence] == [f"{case.id}/source-a", f"{case.id}/source-b"]
        assert evidence[0]["token_end"] <= evidence[1]["token_start"] <= evidence[0]["token_end"] + 2
        starts.append(evidence[0]["token_start"])
    assert starts == sorted(starts) and starts[0] < starts[-1]
    assert isinstance(frame, pl.DataFrame)


# ------------------------------------------------------------------------------------------------ CLI run


@pytest.mark.parametrize(
    "suite_ref",
    ['{ kind = "file", path = "suite.json" }', '{ kind = "builtin", cases = 20, conflict = true }'],
    ids=["suite-file", "builtin-conflict"],
)
def test_a_conflict_suite_runs_through_the_cli(tmp_path: Path, suite_ref: str) -> None:
    """A matrix on conflict cases (a suite file, or the built-in suite with ``conflict = true``), a
    stub server (labelled: not a model) that answers every value of a conflict case and the one value
    of the others: the run completes with controls and every conflict case passes at every position."""
    suite = generate_suite(0, 20, "en", conflict=True)
    conflicts = [c for c in suite.cases if c.evidence_pattern == "conflict"]
    assert len(conflicts) == 2
    answers: dict[str, str] = {}
    for case in suite.cases:
        if case.evidence_pattern == "conflict":
            answers[case.query] = " or ".join(claim.aliases[0] for claim in case.required_claims)
        elif case.required_claims:
            answers.setdefault(case.query, case.required_claims[0].aliases[0])
    (tmp_path / "suite.json").write_text(suite.model_dump_json(), encoding="utf-8")
    gpt2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
    handler = reading_handler({"good": HFTokenizer.from_file(str(gpt2))}, answers)

    port = free_port()
    matrix = tmp_path / "conflict.toml"
    matrix.write_text(
        stub_matrix(
            "conflict",
            where=f'endpoint = "http://127.0.0.1:{port}"',
            suite=suite_ref,
        )
    )
    run = tmp_path / "run"
    with StubServer(handler, port):
        code = main(["run", str(matrix), "--out", str(run)])
    assert code == ExitCode.PASS, code  # a perfect reader
    scored = pl.read_parquet(run / "scored.parquet")
    conflict_rows = scored.filter(pl.col("case_id").is_in([c.id for c in conflicts]))
    assert conflict_rows.height == 2 * 2 * 2  # cases × positions × arms
    assert set(conflict_rows["outcome"]) == {"pass"}, conflict_rows["score_reason"].to_list()
    assert all("every conflicting value" in reason for reason in conflict_rows["score_reason"])
    # The evidence-absent controls of conflict cases (no document left) reach the model: none is a
    # system failure of the pre-send gate.
    controls = pl.read_parquet(run / "scored_controls.parquet")
    absent = controls.filter(
        pl.col("case_id").is_in([c.id for c in conflicts]) & (pl.col("control") == "evidence_absent")
    )
    assert absent.height == 2 * 2 and set(absent["status"]) == {"ok"}, absent["system_fail_reason"].to_list()


def test_suite_generate_conflict_flag_and_matrix_field(tmp_path: Path) -> None:
    """``depthgate suite generate --conflict`` adds conflict cases after the 13 default ones; without the
    flag there are none. A matrix's ``conflict = false`` keeps the digest of a matrix written before the
    field; ``conflict = true`` changes it (a different case set is a different run)."""
    plain, with_conflict = tmp_path / "plain.json", tmp_path / "conflict.json"
    assert main(["suite", "generate", "--cases", "20", "--out", str(plain)]) == ExitCode.PASS
    assert main(["suite", "generate", "--cases", "20", "--conflict", "--out", str(with_conflict)]) == 0
    a = Suite.model_validate_json(plain.read_text(encoding="utf-8"))
    b = Suite.model_validate_json(with_conflict.read_text(encoding="utf-8"))
    assert not [c for c in a.cases if c.evidence_pattern == "conflict"]
    assert [c.evidence_pattern for c in b.cases].count("conflict") == 2
    assert [c.id for c in a.cases[:13]] == [c.id for c in b.cases[:13]]

    from depthgate.spec.loading import load_matrix

    digests = {}
    for name, ref in {
        "unset": '{ kind = "builtin", cases = 20 }',
        "false": '{ kind = "builtin", cases = 20, conflict = false }',
        "true": '{ kind = "builtin", cases = 20, conflict = true }',
    }.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(stub_matrix("m", where='endpoint = "http://127.0.0.1:9"', suite=ref))
        digests[name] = load_matrix(path).digest()
    assert digests["unset"] == digests["false"] != digests["true"]

"""Generated suites (pilot recipe), splits, and incident replay."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path
from string import Formatter
from typing import Any

import pytest

from depthgate.exceptions import SpecError
from depthgate.spec.cases import Case, Suite
from depthgate.spec.incidents import import_incidents
from depthgate.spec.matrix import BuiltinSuiteRef, FileSuiteRef
from depthgate.spec.suites import (
    COMPETING_DEPTHS,
    DISTRACTORS_PER_CASE,
    NAMES_EN,
    NAMES_ZH,
    REGIONS,
    _data_file,
    builtin_suite,
    generate_suite,
    resolve_suite,
    split_suite,
)
from depthgate.spec.text_checks import find_special_token, unit_contract_violation

N_CASES = 320


@pytest.fixture(scope="module", params=["en", "zh"])
def big_suite(request: pytest.FixtureRequest) -> Suite:
    return generate_suite(11, N_CASES, request.param)


def fact_type(case: Case) -> str:
    return case.family.split(":", 1)[0]


def region_name(case: Case) -> str:
    return case.expected_fields["region"]


def test_deterministic_and_prefix_stable() -> None:
    first = generate_suite(5, 60, "en")
    assert first.digest() == generate_suite(5, 60, "en").digest()
    assert first.cases[:25] == generate_suite(5, 25, "en").cases
    assert generate_suite(6, 60, "en").digest() != first.digest()
    assert first.name == "generated-en-s5" and first.seed == 5 and first.language == "en"


def test_golden_first_case() -> None:
    case = generate_suite(0, 1, "en").cases[0]
    assert case.id == "en-s0-0000-override-hotel_cap"
    assert case.answer_prefix == (
        "Under the current travel policy, the maximum hotel rate for business travel "
        "in region Andean States is"
    )
    assert [doc.text for doc in case.evidence] == [
        " Travel policy version 6 (2021): the maximum hotel rate for business travel in region Andean States "
        "is 420 USD per night.",
        " Travel policy version 7 (2022), which replaces version 6: the maximum hotel rate "
        "for business travel in region Andean States is 415 USD per night.",
    ]
    assert case.competing_depth == 0.625


def test_at_least_300_distinct_cases_without_near_duplicates(big_suite: Suite) -> None:
    cases = big_suite.cases
    assert len(cases) == N_CASES >= 300
    assert len({case.id for case in cases}) == len(cases)
    tuples = [(fact_type(c), region_name(c), c.expected_fields["value"]) for c in cases]
    duplicates = [key for key, count in Counter(tuples).items() if count > 1]
    assert not duplicates
    contents = [c.query + "\x00" + "\x00".join(doc.text for doc in c.evidence) for c in cases]
    assert len(set(contents)) == len(contents)
    assert len({c.digest() for c in cases}) == len(cases)


def test_first_eight_are_the_pilot_smoke_set(big_suite: Suite) -> None:
    smoke = big_suite.cases[:8]
    assert [c.evidence_pattern for c in smoke] == ["override"] * 8
    assert [fact_type(c) for c in smoke] == ["hotel_cap", "invoice_terms"] * 4
    assert sorted(c.competing_depth or 0 for c in smoke) == sorted(COMPETING_DEPTHS * 2)


def test_pattern_mix(big_suite: Suite) -> None:
    patterns = Counter(c.evidence_pattern for c in big_suite.cases)
    assert set(patterns) == {"single", "override", "exception", "order", "negation", "absent"}
    assert patterns["override"] >= patterns["exception"] >= patterns["order"]
    facts = Counter(fact_type(c) for c in big_suite.cases)
    assert set(facts) == {"hotel_cap", "invoice_terms", "incident_contact", "expense_signoff"}
    assert facts["expense_signoff"] < facts["incident_contact"]  # a known-hard control only


def test_every_case_follows_the_recipe(big_suite: Suite) -> None:
    zh = big_suite.language == "zh"
    for case in big_suite.cases:
        assert case.language == big_suite.language
        assert len(case.distractors) == DISTRACTORS_PER_CASE
        assert case.answer_prefix and case.query.endswith("？" if zh else "?")
        for text in [d.text for d in case.evidence] + [d.text for d in case.distractors]:
            assert text.startswith(" ") and unit_contract_violation(text) is None
            assert find_special_token(text) is None
        region = region_name(case)
        for distractor in case.distractors:
            if fact_type(case) != "expense_signoff":  # its two hard distractors share the region
                assert (
                    f"{region}区域" not in distractor.text
                    if zh
                    else f"region {region} " not in distractor.text
                )
        if case.evidence_pattern == "absent":
            assert case.abstain_when_absent and not case.evidence and not case.required_claims
            assert case.expected_fields["abstain"] == "true"
            continue
        (decisive,) = case.decisive
        (answer,) = case.required_claims
        assert decisive.supports == ["answer"]
        value = case.expected_fields["value"]
        assert answer.value == value and value in answer.aliases
        assert value in decisive.text
        # distractors can never support the answer: the value appears in no distractor
        for distractor in case.distractors:
            assert not re.search(rf"(?<![0-9]){re.escape(value)}(?![0-9])", distractor.text)
        forbidden_values = {claim.value for claim in case.forbidden_claims}
        assert value not in forbidden_values
        assert len(forbidden_values) >= DISTRACTORS_PER_CASE
        # the cloze prefix repeats the evidence sentence up to the value
        stem = case.answer_prefix
        if not zh and stem.startswith("Under the current"):
            stem = stem.split(", ", 1)[1]
        elif zh and stem.startswith("根据现行"):
            stem = stem.split("，", 1)[1]
        if case.evidence_pattern in ("single", "negation", "override"):
            assert stem.lower() in decisive.text.lower(), (stem, decisive.text)
        if case.evidence_pattern in ("override", "exception"):
            (competing,) = case.competing
            assert case.competing_depth in COMPETING_DEPTHS
            assert competing.supports == ["competing"]
            assert str(next(c for c in case.forbidden_claims if c.id == "competing").value) in competing.text
        else:
            assert case.competing_depth is None and not case.competing
        if case.evidence_pattern in ("order", "negation"):
            ruled_out = next(c for c in case.forbidden_claims if c.id == "ruled_out")
            assert str(ruled_out.value) in decisive.text
            assert decisive.text.index(str(ruled_out.value)) < decisive.text.rindex(value)
        if case.evidence_pattern == "override":
            (competing,) = case.competing
            assert int(decisive.version) == int(competing.version) + 1


def test_competing_depths_are_balanced(big_suite: Suite) -> None:
    for pattern in ("override", "exception"):
        depths = Counter(c.competing_depth for c in big_suite.cases if c.evidence_pattern == pattern)
        assert set(depths) == set(COMPETING_DEPTHS)
        assert max(depths.values()) - min(depths.values()) <= 1


def test_en_and_zh_are_parallel() -> None:
    en, zh = generate_suite(3, 40, "en"), generate_suite(3, 40, "zh")
    for a, b in zip(en.cases, zh.cases, strict=True):
        assert (a.evidence_pattern, a.family, a.competing_depth) == (
            b.evidence_pattern,
            b.family,
            b.competing_depth,
        )
        if fact_type(a) in ("hotel_cap", "invoice_terms"):
            assert a.expected_fields["value"] == b.expected_fields["value"]
    assert "商务差旅" in zh.cases[0].evidence[0].text and zh.cases[0].answer_prefix.endswith("每晚")


def test_builtin_suite() -> None:
    suite = builtin_suite()
    assert len(suite.cases) == 8 and suite.name == "builtin-en-s0-n8"
    assert suite.cases == generate_suite(0, 8, "en").cases
    assert len(builtin_suite(3, 1, "zh").cases) == 3
    assert resolve_suite(BuiltinSuiteRef(cases=8)).digest() == suite.digest()


# sha256 of ``Suite.model_dump_json()``, recorded before the sentence tables moved from suites.py to
# python/depthgate/spec/data (issue #9). Any change of wording, names, order or generation shows here: if
# one is intended, update the digests in the same commit and say why.
GOLDEN_SUITE_DIGESTS = {
    ("en", 0): "3ada55a96d71bec9e53a268e0d16402d149a42825423fd2c0de61677d4397f9b",
    ("en", 1): "86ab0cd00e1a093d5351b05a7c8616649cd2a19aa6da6634b5bf875e18c51d44",
    ("en", 7): "1a789596ce8ae5a9a9c929f314cdc97cbdaa8e1558cdf1c37a7aeba1d3f3c9c1",
    ("en", "builtin"): "b8ddd0e885cd959a84e35e619cf851de322dde011861f3627fee7be38d2e829c",
    ("zh", 0): "91b74faee024dac94dfd0b5994649a8d51ba51788a2396024421e4ebfb7b4ada",
    ("zh", 1): "e43fbb05c8ce3ac0a8b4a7be4746269431aa2450c9ec3890eb720ba7e71b3ebe",
    ("zh", 7): "42d10fd366f498a701fe43815d2dfe5d21370f8aec7abda72798739c8de9d43f",
    ("zh", "builtin"): "6ef0a3bcf2371c7e18c6a27e8749980d6922f1386fe6d9f64a0621e315a5f118",
}


@pytest.mark.parametrize("language", ["en", "zh"])
def test_generated_suites_are_byte_stable(language: str) -> None:
    def digest(suite: Suite) -> str:
        return hashlib.sha256(suite.model_dump_json().encode()).hexdigest()

    digests: dict[tuple[str, int | str], str] = {
        (language, seed): digest(generate_suite(seed, 300, language)) for seed in (0, 1, 7)
    }
    digests[(language, "builtin")] = digest(builtin_suite(language=language))
    assert digests == {key: value for key, value in GOLDEN_SUITE_DIGESTS.items() if key[0] == language}


def test_sentence_tables_are_package_data() -> None:
    # _data_file reads depthgate/spec/data through importlib.resources: the installed package's files
    names = _data_file("names.toml")
    assert len(names["names_en"]) == len(names["names_zh"]) == len(NAMES_EN) == len(NAMES_ZH)
    assert all(len(region) == 3 for region in names["regions"]) and len(REGIONS) == len(names["regions"])
    en, zh = (_data_file(f"sentences_{language}.toml") for language in ("en", "zh"))

    def fields(template: str | list[str]) -> set[str]:
        templates = [template] if isinstance(template, str) else template
        return {name for text in templates for _, name, _, _ in Formatter().parse(text) if name} - {"surname"}

    # the two languages are translations of each other: the same templates, with the same fields
    assert en.keys() == zh.keys() == {"hotel_cap", "invoice_terms", "incident_contact", "expense_signoff"}
    for fact in en:
        assert en[fact].keys() == zh[fact].keys(), fact
        for key in en[fact]:
            assert fields(en[fact][key]) == fields(zh[fact][key]), (fact, key)


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 5, "fr"), "language"), ((0, 0, "en"), "n_cases"), ((-1, 5, "en"), "seed")],
)
def test_generate_rejects_bad_arguments(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(SpecError) as info:
        generate_suite(*args)
    assert info.value.field == field and info.value.fix


# ------------------------------------------------------------------------------------------------ splits


def test_split_keeps_families_together() -> None:
    suite = generate_suite(2, 200, "en")
    dev, holdout = split_suite(suite, 0.3, seed=7)
    assert {c.family for c in dev.cases}.isdisjoint({c.family for c in holdout.cases})
    assert sorted(c.id for c in dev.cases + holdout.cases) == sorted(c.id for c in suite.cases)
    assert 0.25 <= len(holdout.cases) / len(suite.cases) <= 0.4
    assert [c.id for c in dev.cases] == [c.id for c in suite.cases if c in dev.cases]  # order kept
    again = split_suite(suite, 0.3, seed=7)
    assert (again[0].digest(), again[1].digest()) == (dev.digest(), holdout.digest())
    assert split_suite(suite, 0.3, seed=8)[1].digest() != holdout.digest()
    assert dev.name.endswith("/dev") and holdout.name.endswith("/holdout")


def test_split_rejects_bad_input() -> None:
    suite = generate_suite(2, 20, "en")
    for fraction in (0.0, 1.0, 1.5):
        with pytest.raises(SpecError) as info:
            split_suite(suite, fraction, seed=0)
        assert info.value.field == "holdout_fraction"
    one_family = suite.model_copy(
        update={"cases": [c.model_copy(update={"family": "f"}) for c in suite.cases]}
    )
    with pytest.raises(SpecError, match="single document family"):
        split_suite(one_family, 0.5, seed=0)
    dev, holdout = split_suite(generate_suite(2, 3, "en"), 0.99, seed=0)
    assert dev.cases and holdout.cases


# ------------------------------------------------------------------------------------------ incidents


def incident(**overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": "INC-2041",
        "documents": [
            {"id": "kb-12", "version": 3, "text": "Refunds above 500 EUR need a second approver.\n"},
            {"id": "kb-19", "version": "2024-05", "text": "  Refunds are processed within 5 days.  "},
        ],
        "query": "Who must approve a refund of 800 EUR?",
        "evidence_ids": ["kb-12"],
        "claims": [{"id": "second", "text": "A second approver is needed.", "aliases": ["second approver"]}],
        "answer_prefix": "A refund of 800 EUR must be approved by",
        "forbidden": [
            "no approval needed",
            {"id": "auto", "text": "Refunds are automatic", "aliases": ["auto"]},
        ],
    }
    record.update(overrides)
    return record


def write_jsonl(tmp_path: Path, *lines: Any) -> Path:
    path = tmp_path / "incidents.jsonl"
    rendered = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    path.write_text("\n".join(rendered) + "\n", encoding="utf-8")
    return path


def test_import_incidents(tmp_path: Path) -> None:
    second = incident(id=None, language="zh", documents=[{"id": "a", "text": "退款需要第二位审批人。"}])
    second.update(evidence_ids=["a"], forbidden=[], query="谁来审批？", answer_prefix="")
    path = write_jsonl(tmp_path, "# replayed from production", incident(), "", second)
    suite = import_incidents(path)
    assert suite.name == "incidents-incidents" and suite.language == "mixed"
    first, other = suite.cases
    assert first.id == "INC-2041" and other.id == "incident-0004"  # named by its line
    assert first.evidence_pattern == "single" and first.risk == "high" and first.family == "INC-2041"
    (evidence,) = first.evidence
    assert evidence.id == "kb-12" and evidence.version == "3" and evidence.supports == ["second"]
    assert evidence.text == " Refunds above 500 EUR need a second approver."
    assert [d.text for d in first.distractors] == [" Refunds are processed within 5 days."]
    assert [c.id for c in first.forbidden_claims] == ["forbidden_01", "auto"]
    no_evidence = incident(evidence_ids=[], claims=[])
    assert import_incidents(write_jsonl(tmp_path, no_evidence)).cases[0].evidence_pattern == "absent"
    ref = FileSuiteRef(path="incidents.jsonl")
    assert resolve_suite(ref, base_dir=tmp_path).cases[0].id == "INC-2041"


@pytest.mark.parametrize(
    ("bad", "field", "message"),
    [
        ('{"id": "x", "documents": [', "(line)", "not valid JSON"),
        ("[1, 2]", "(line)", "JSON object"),
        (incident(query=None), "query", "valid string"),
        (incident(evidence_ids=["kb-99"]), "evidence_ids[0]", "not the id of any document"),
        (incident(claimz=[]), "claimz", "Extra inputs"),
        (
            incident(documents=[{"id": "kb-12", "text": "Use <|im_start|> here."}]),
            "documents[0].text",
            "special-token",
        ),
        (incident(documents=[{"id": "kb-12", "text": "   "}]), "documents[0].text", "empty"),
        (incident(claims=[{"id": "c", "text": "t", "aliases": [""]}]), "claims[0].aliases[0]", "blank"),
        (incident(evidence_ids=[], claims=[{"id": "c", "text": "t"}]), "claims", "cannot require"),
    ],
)
def test_import_errors_name_file_line_and_field(tmp_path: Path, bad: Any, field: str, message: str) -> None:
    path = write_jsonl(tmp_path, incident(id="ok-1"), bad)
    with pytest.raises(SpecError) as info:
        import_incidents(path)
    error = info.value
    assert error.file == f"{path}:2", str(error)
    assert error.field is not None and error.field.startswith(field), str(error)
    assert message in error.message, str(error)
    assert error.fix
    assert f"{path}:2" in str(error)


def test_import_rejects_duplicates_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="also line 1") as info:
        import_incidents(write_jsonl(tmp_path, incident(), incident()))
    assert info.value.field == "id"
    with pytest.raises(SpecError, match="no incidents"):
        import_incidents(write_jsonl(tmp_path, "# nothing"))
    with pytest.raises(SpecError, match="not found"):
        import_incidents(tmp_path / "missing.jsonl")


def test_resolve_suite_file(tmp_path: Path) -> None:
    suite = generate_suite(1, 5, "en")
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "s.json").write_text(suite.model_dump_json(), encoding="utf-8")
    loaded = resolve_suite(FileSuiteRef(path="cases/s.json"), base_dir=tmp_path)
    assert loaded.digest() == suite.digest()


def test_regions_are_distinct() -> None:
    for column in range(3):
        assert len({region[column] for region in REGIONS}) == len(REGIONS)

"""Spec models: validators name the case, the field and the fix; files add the file; digests are canonical."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from depthgate.exceptions import InputError, SpecError
from depthgate.spec.base import canonical_json
from depthgate.spec.cases import Case, Suite
from depthgate.spec.loading import load_matrix, load_suite, parse_spec, schema
from depthgate.spec.matrix import BuiltinSuiteRef, FileSuiteRef, Matrix
from depthgate.spec.models import AnalysisPlan
from depthgate.spec.system import DecodeParams, System
from depthgate.spec.text_checks import unit_contract_violation
from helpers import case_data


def suite_data(*cases: dict[str, Any]) -> dict[str, Any]:
    return {"name": "tiny", "seed": 0, "language": "en", "cases": list(cases) or [case_data()]}


def spec_error(data: dict[str, Any], model: type = Suite, file: str = "suite.json") -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(model, data, file=file)
    return info.value


# ---------------------------------------------------------------------------------------------------- cases


def test_valid_case_is_frozen_and_digest_is_canonical() -> None:
    case = Case.model_validate(case_data())
    assert case.evidence[0].version == "3"  # numbers become version strings
    assert [d.id for d in case.decisive] == ["v4"] and [d.id for d in case.competing] == ["v3"]
    with pytest.raises(ValidationError):
        setattr(case, "query", "changed")  # noqa: B010 - frozen models refuse assignment
    expected = hashlib.sha256(canonical_json(case.model_dump(mode="json")).encode()).hexdigest()
    assert case.digest() == expected
    assert Case.model_validate(json.loads(case.model_dump_json())).digest() == case.digest()
    assert Case.model_validate(case_data(query="Another question?")).digest() != case.digest()


def test_missing_decisive_evidence_is_rejected() -> None:
    data = case_data()
    data["evidence"] = [data["evidence"][0]]
    error = spec_error(suite_data(data))
    assert error.file == "suite.json"
    assert error.field == "cases[0].evidence"
    assert "hotel-china" in error.message and "decisive" in error.message
    assert "role = 'decisive'" in (error.fix or "")


def test_unsupported_required_claim_names_case_field_and_fix() -> None:
    data = case_data()
    data["evidence"][1]["supports"] = []
    with pytest.raises(ValidationError) as direct:
        Case.model_validate(data)
    text = str(direct.value)
    assert "case 'hotel-china'" in text and "required_claims[0]" in text and "fix:" in text
    error = spec_error(suite_data(data))
    assert error.field == "cases[0].required_claims[0]"
    assert "not supported" in error.message and "hotel-china" in error.message
    assert "supports" in (error.fix or "")
    rendered = str(error)
    assert rendered.startswith("suite.json: field 'cases[0].required_claims[0]'") and "(fix: " in rendered


@pytest.mark.parametrize(
    "token", ["<|im_end|>", "<|eot_id|>", "<s>", "</s>", "[INST]", "<start_of_turn>", "<eos>"]
)
def test_special_tokens_in_evidence_are_rejected(token: str) -> None:
    data = case_data()
    data["evidence"][1]["text"] = f" The maximum hotel rate {token} in region China is 245 USD per night."
    error = spec_error(suite_data(data))
    assert error.field == "cases[0].evidence[1].text"
    assert token in error.message
    assert error.fix


def test_special_tokens_in_distractors_and_query_are_rejected() -> None:
    data = case_data()
    data["distractors"][0]["text"] = " Ignore this <|endoftext|> sentence."
    assert spec_error(suite_data(data)).field == "cases[0].distractors[0].text"
    assert spec_error(suite_data(case_data(query="What is [INST] this?"))).field == "cases[0].query"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("The rate is 245 USD.", "does not start with a separator"),
        ("  The rate is 245 USD.", "more than one whitespace"),
        (" The rate is 245 USD.\n", "ends with whitespace"),
        ("\n\n\nThe rate.", "more than one whitespace"),
        ("", "is empty"),
    ],
)
def test_unit_contract_on_evidence_text(text: str, problem: str) -> None:
    assert problem in (unit_contract_violation(text) or "")
    data = case_data()
    data["evidence"][1]["text"] = text
    error = spec_error(suite_data(data))
    assert error.field == "cases[0].evidence[1].text"
    assert "start the text with exactly one ' '" in (error.fix or "")


def test_pattern_rules() -> None:
    absent = case_data(evidence_pattern="absent", evidence=[], required_claims=[], competing_depth=None)
    assert Case.model_validate(absent).evidence_pattern == "absent"
    assert (
        spec_error(suite_data({**absent, "abstain_when_absent": False})).field
        == "cases[0].abstain_when_absent"
    )
    with_claims = case_data(evidence_pattern="absent", evidence=[], competing_depth=None)
    assert spec_error(suite_data(with_claims)).field == "cases[0].required_claims"
    two_decisive = case_data(evidence_pattern="single", competing_depth=None)
    two_decisive["evidence"][0].update(role="decisive", supports=["answer"])
    error = spec_error(suite_data(two_decisive))
    assert error.field == "cases[0].evidence" and "exactly one decisive" in (error.fix or "")
    no_depth = case_data(competing_depth=None)
    assert spec_error(suite_data(no_depth)).field == "cases[0].competing_depth"
    out_of_range = case_data(competing_depth=1.5)
    assert spec_error(suite_data(out_of_range)).field == "cases[0].competing_depth"
    override_without_competing = case_data(competing_depth=None)
    override_without_competing["evidence"] = [override_without_competing["evidence"][1]]
    assert spec_error(suite_data(override_without_competing)).field == "cases[0].evidence"


def test_claim_consistency_rules() -> None:
    data = case_data()
    data["evidence"][1]["supports"] = ["answer", "nope"]
    error = spec_error(suite_data(data))
    assert error.field == "cases[0].evidence[1].supports[1]" and "'answer'" in (error.fix or "")
    data = case_data()
    data["evidence"][1]["supports"] = ["answer", "old"]
    assert "forbidden claim" in spec_error(suite_data(data)).message
    data = case_data()
    data["forbidden_claims"][1]["aliases"] = ["245"]
    assert spec_error(suite_data(data)).field == "cases[0].forbidden_claims[1].aliases"
    data = case_data()
    data["required_claims"][0]["aliases"] = ["245", " "]
    error = spec_error(suite_data(data))
    assert error.field == "cases[0].required_claims[0].aliases[1]" and "hotel-china" in error.message


def test_ids_and_duplicates() -> None:
    assert spec_error(suite_data(case_data(id="bad id"))).field == "cases[0].id"
    data = case_data()
    data["distractors"][0]["id"] = "v4"
    assert "duplicate id 'v4'" in spec_error(suite_data(data)).message
    data = case_data()
    data["distractors"].append(dict(data["distractors"][0], id="d2"))
    assert "duplicated distractor" in (spec_error(suite_data(data)).fix or "")
    error = spec_error(suite_data(case_data(), case_data()))
    assert error.field == "cases[1].id" and "duplicate case id 'hotel-china'" in error.message


def test_answer_prefix_whitespace_and_literals() -> None:
    assert spec_error(suite_data(case_data(answer_prefix="The rate is "))).field == "cases[0].answer_prefix"
    assert Case.model_validate(case_data(answer_prefix="")).answer_prefix == ""
    error = spec_error(suite_data(case_data(kind="chat")))
    assert error.field == "cases[0].kind" and "'extraction'" in (error.fix or "")
    assert "hotel-china" in error.message
    error = spec_error(suite_data(case_data(colour="blue")))
    assert error.field == "cases[0].colour" and "remove" in (error.fix or "")


def test_suite_language_and_emptiness() -> None:
    zh = case_data(language="zh")
    assert spec_error(suite_data(zh)).field == "cases[0].language"
    assert Suite.model_validate({**suite_data(zh), "language": "mixed"}).language == "mixed"
    assert spec_error({"name": "x", "language": "en", "cases": []}).field == "cases"


def test_suite_json_file_round_trip_and_errors(tmp_path: Path) -> None:
    suite = Suite.model_validate(suite_data())
    path = tmp_path / "suite.json"
    path.write_text(suite.model_dump_json(indent=2), encoding="utf-8")
    assert load_suite(path).digest() == suite.digest()
    bad = suite_data()
    bad["cases"][0]["evidence"][1]["text"] = " Rate <s> 245."
    path.write_text(json.dumps(bad), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_suite(path)
    assert info.value.file == str(path) and info.value.field == "cases[0].evidence[1].text"
    assert str(path) in str(info.value)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(SpecError, match="invalid JSON"):
        load_suite(path)
    with pytest.raises(SpecError, match="not found"):
        load_suite(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------ plan, systems


def test_plan_defaults_and_digest() -> None:
    plan = AnalysisPlan()
    assert (plan.primary_metric, plan.margin, plan.alpha, plan.n_min) == ("pass", 0.10, 0.05, 40)
    assert (plan.floor, plan.fdr_method, plan.stop_rule, plan.max_missing) == (None, "BH", "fixed", 0.10)
    assert plan.digest() == AnalysisPlan().digest()
    assert AnalysisPlan(margin=0.05).digest() != plan.digest()
    for alpha in (0.0, 1.0, -0.1, 1.5):
        error = spec_error({"alpha": alpha}, AnalysisPlan, "plan.toml")
        assert error.field == "alpha" and error.fix
    assert spec_error({"fdr_method": "bonferroni"}, AnalysisPlan).field == "fdr_method"


def test_decode_defaults_and_rules() -> None:
    decode = DecodeParams()
    assert (decode.max_tokens, decode.temperature, decode.seeds, decode.stop) == (12, 0.0, [0], ["\n"])
    assert spec_error({"seeds": []}, DecodeParams).field == "seeds"
    assert spec_error({"seeds": [1, 1]}, DecodeParams).field == "seeds"
    assert spec_error({"max_tokens": 0}, DecodeParams).field == "max_tokens"
    assert spec_error({"max_tokens": True}, DecodeParams).field == "max_tokens"


def system(**overrides: Any) -> dict[str, Any]:
    return {"name": "base", "backend": "llamacpp", "model": "gemma-3-270m", "tokenizer": "gguf:", **overrides}


def test_system_rules() -> None:
    assert System.model_validate(system()).assembler == "default"
    error = spec_error(system(backend="vllm-server"), System)
    assert error.field == "endpoint" and "vllm" in (error.fix or "")
    assert spec_error(system(backend="vllm", endpoint="http://h:8000"), System).field == "endpoint"
    assert spec_error(system(endpoint="ftp://host"), System).field == "endpoint"
    assert "credentials" in spec_error(system(endpoint="https://user:secret@host/v1"), System).message
    assert "credentials" in spec_error(system(endpoint="https://host/v1?api_key=abc"), System).message
    assert spec_error(system(preamble="You are <|im_start|> helpful."), System).field == "preamble"
    assert spec_error(system(backend="tgi"), System).field == "backend"
    assert spec_error(system(window=0), System).field == "window"


# --------------------------------------------------------------------------------------------- matrices

MATRIX = """
name = "smoke"
lengths = [1024, 2048]
positions = [0, 0.25, 0.5, 0.75, 1, "@512"]
repeats = 2

[suite]
kind = "builtin"
cases = 8
seed = 0
language = "en"

[decode]
max_tokens = 12
seeds = [0, 1]

[baseline]
name = "base"
backend = "llamacpp"
model = "gemma-3-270m"
tokenizer = "gguf:"

[candidate]
name = "preamble"
backend = "llamacpp"
model = "gemma-3-270m"
tokenizer = "gguf:"
preamble = "You read a company handbook. Older versions are kept for audit only."

[plan]
margin = 0.10
alpha = 0.05
n_min = 8
floor = 0.5
fdr_method = "BH"
"""


def write(tmp_path: Path, text: str, name: str = "matrix.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_matrix(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, MATRIX))
    assert matrix.suite == BuiltinSuiteRef(cases=8, seed=0, language="en")
    assert matrix.positions == [0.0, 0.25, 0.5, 0.75, 1.0, "@512"]
    assert matrix.lengths == [1024, 2048] and matrix.repeats == 2
    assert matrix.plan.n_min == 8 and matrix.plan.floor == 0.5
    assert matrix.candidate.preamble.startswith("You read")
    assert matrix.digest() == load_matrix(write(tmp_path, MATRIX, "again.toml")).digest()
    assert matrix.plan.digest() == AnalysisPlan(n_min=8, floor=0.5).digest()


def test_suite_reference_forms(tmp_path: Path) -> None:
    tables = MATRIX.split("[suite]")[0] + MATRIX.split('language = "en"', 1)[1]
    shorthand = 'suite = "builtin:4:3:zh"\n' + tables
    assert load_matrix(write(tmp_path, shorthand)).suite == BuiltinSuiteRef(cases=4, seed=3, language="zh")
    as_path = 'suite = "cases/incidents.jsonl"\n' + tables
    ref = load_matrix(write(tmp_path, as_path)).suite
    assert isinstance(ref, FileSuiteRef) and ref.resolved_format == "incidents"
    table = tables + '\n[suite]\npath = "cases/suite.json"\n'
    ref = load_matrix(write(tmp_path, table)).suite
    assert isinstance(ref, FileSuiteRef) and ref.resolved_format == "suite"


@pytest.mark.parametrize(
    ("edit", "field", "fix_hint"),
    [
        (lambda t: t.replace('name = "smoke"\n', ""), "name", "add `name`"),
        (lambda t: t.replace("max_tokens = 12", "max_tokenz = 12"), "decode.max_tokenz", "remove"),
        (lambda t: t.replace('"@512"', '"middle"'), "positions[5]", "'@512'"),
        (lambda t: t.replace('1, "@512"', "1.5"), "positions[4]", "between 0 and 1"),
        (lambda t: t.replace('"@512"', '"@4096"'), "positions[5]", "offset"),
        (lambda t: t.replace("seeds = [0, 1]", "seeds = [0]"), "repeats", "one seed per repeat"),
        (lambda t: t.replace('name = "preamble"', 'name = "base"'), "candidate.name", "different names"),
        (
            lambda t: t.replace('backend = "llamacpp"', 'backend = "llama"', 1),
            "baseline.backend",
            "'llamacpp'",
        ),
        (lambda t: t.replace("alpha = 0.05", "alpha = 1.0"), "plan.alpha", "less than 1"),
        (lambda t: t.replace("cases = 8", 'cases = "eight"'), "suite.cases", "integer"),
        (lambda t: t.replace("lengths = [1024, 2048]", "lengths = [1024, 1024]"), "lengths", "once"),
        (lambda t: t.replace('kind = "builtin"', 'kind = "remote"'), "suite", "kind = 'builtin'"),
    ],
)
def test_matrix_errors_name_file_field_and_fix(tmp_path: Path, edit: Any, field: str, fix_hint: str) -> None:
    path = write(tmp_path, edit(MATRIX))
    with pytest.raises(SpecError) as info:
        load_matrix(path)
    error = info.value
    assert isinstance(error, InputError)
    assert error.file == str(path)
    assert error.field == field, str(error)
    assert fix_hint in (error.fix or ""), str(error)
    assert str(path) in str(error) and "fix:" in str(error)


def test_matrix_syntax_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="invalid TOML") as info:
        load_matrix(write(tmp_path, MATRIX.replace('name = "smoke"', "name = smoke")))
    assert info.value.fix
    with pytest.raises(SpecError, match="not found"):
        load_matrix(tmp_path / "nope.toml")


def test_several_errors_are_all_reported(tmp_path: Path) -> None:
    text = MATRIX.replace("alpha = 0.05", "alpha = 2.0").replace("margin = 0.10", "margin = -1.0")
    with pytest.raises(SpecError) as info:
        load_matrix(write(tmp_path, text))
    assert "other error" in info.value.message and "plan." in info.value.message


def test_matrix_model_defaults() -> None:
    data = {
        "name": "m",
        "suite": "builtin",
        "lengths": [1024],
        "positions": [0.5],
        "baseline": system(),
        "candidate": system(name="cand"),
    }
    matrix = Matrix.model_validate(copy.deepcopy(data))
    assert matrix.decode == DecodeParams() and matrix.plan == AnalysisPlan() and matrix.repeats == 1


def test_schema_covers_every_model() -> None:
    schemas = schema()
    for name in [
        "Claim",
        "EvidenceDoc",
        "Distractor",
        "Case",
        "Suite",
        "AnalysisPlan",
        "DecodeParams",
        "System",
    ]:
        assert "properties" in schemas[name], name
    assert "suite" in schemas["Matrix"]["properties"]
    json.dumps(schemas)  # serialisable

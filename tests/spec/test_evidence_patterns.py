"""Evidence patterns are described once (:mod:`depthgate.spec.evidence_patterns`, issue #38 item 3): a new
pattern is one module and one registration line, and every code path (case validation, layout, oracle,
the JSON schema) accepts it by its descriptor. This module is that one module; the fixture below holds
the one line."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from depthgate.judge.scoring import score
from depthgate.layout.conversation import exchanges_of
from depthgate.spec.cases import Case
from depthgate.spec.evidence_patterns import (
    EvidencePatternKind,
    evidence_pattern,
    register_evidence_pattern,
    registered_evidence_patterns,
    unregister_evidence_pattern,
)
from helpers import case_data

#: A new pattern: the answer is stated in other words (a paraphrase), next to the superseded version.
PARAPHRASE = EvidencePatternKind("paraphrase", competing=True)
#: A pattern that needs two decisive documents (the answer pieced together from two sources).
TWO_SOURCES = EvidencePatternKind("two_sources", decisive="several")


@pytest.fixture
def paraphrase() -> Iterator[EvidencePatternKind]:
    register_evidence_pattern(PARAPHRASE)  # the one line a new pattern adds
    yield PARAPHRASE
    unregister_evidence_pattern(PARAPHRASE.name)


def test_the_builtin_patterns_are_registered() -> None:
    assert registered_evidence_patterns() == (
        "single",
        "override",
        "exception",
        "order",
        "negation",
        "absent",
        "conflict",
        "mrcr",
    )
    assert evidence_pattern("conflict").scoring == "conflict"
    with pytest.raises(KeyError, match="unknown evidence pattern 'nope'"):
        evidence_pattern("nope")


def test_an_unregistered_pattern_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="unknown evidence pattern 'paraphrase'"):
        Case.model_validate(case_data(evidence_pattern="paraphrase"))


def test_a_registered_pattern_is_accepted_everywhere(paraphrase: EvidencePatternKind) -> None:
    case = Case.model_validate(case_data(evidence_pattern="paraphrase"))
    assert case.pattern is paraphrase
    # the layout of a conversation: not needles laid out as turns
    assert exchanges_of(case, None) == 0
    # the oracle: scored by its required claims, the superseded value is a forbidden one
    assert score(case, " 245 USD per night.", evidence_ids_in_layout={"v3", "v4"}).outcome == "pass"
    assert score(case, " 230 USD per night.", evidence_ids_in_layout={"v3", "v4"}).outcome == "fail"
    # the descriptor's rules: it needs its competing document
    lone = case_data(evidence_pattern="paraphrase", competing_depth=None)
    lone["evidence"] = [doc for doc in lone["evidence"] if doc["role"] == "decisive"]
    lone["forbidden_claims"] = [c for c in lone["forbidden_claims"] if c["id"] != "old"]
    with pytest.raises(ValidationError, match="'paraphrase' needs a competing document"):
        Case.model_validate(lone)
    # the JSON schema lists the patterns registered when it is generated
    schema = Case.model_json_schema()
    assert "paraphrase" in schema["properties"]["evidence_pattern"]["enum"]


def test_a_pattern_of_several_decisive_documents_counts_them() -> None:
    register_evidence_pattern(TWO_SOURCES)
    try:
        with pytest.raises(ValidationError, match="'two_sources' needs two or more decisive documents"):
            Case.model_validate(case_data(evidence_pattern="two_sources"))
    finally:
        unregister_evidence_pattern(TWO_SOURCES.name)

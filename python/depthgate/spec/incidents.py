"""Replay of production incidents: a JSONL file of incident records (the question, the documents the
system saw, the claims a right answer makes and the ones it must not) becomes a :class:`Suite`, every
line checked like a case with the file, line and field named on failure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from depthgate.exceptions import SpecError
from depthgate.spec.cases import (
    Case,
    EvidencePattern,
    Language,
    Risk,
    Suite,
    TaskKind,
)
from depthgate.spec.files import ReadFailures, read_utf8, refuse_unencodable
from depthgate.spec.loading import spec_error_from_validation


class _IncidentModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True)


class IncidentDocument(_IncidentModel):
    id: str = Field(min_length=1)
    version: str = "1"
    text: str


class IncidentClaim(_IncidentModel):
    id: str = Field(min_length=1)
    text: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    value: str | None = None
    unit: str | None = None


class IncidentRecord(_IncidentModel):
    """One line of an incidents JSONL file: a production prompt that went wrong, replayed as a case."""

    id: str | None = None
    documents: list[IncidentDocument]
    query: str
    evidence_ids: list[str]
    claims: list[IncidentClaim] = Field(default_factory=list)
    answer_prefix: str = ""
    forbidden: list[IncidentClaim | str] = Field(default_factory=list)
    language: Language = "en"
    risk: Risk = "high"
    kind: TaskKind = "qa"
    evidence_pattern: EvidencePattern | None = None
    family: str | None = None
    expected_fields: dict[str, str] = Field(default_factory=dict)


def _incident_to_case(record: IncidentRecord, lineno: int, where: str) -> Case:
    case_id = record.id or f"incident-{lineno:04d}"
    by_id: dict[str, int] = {}
    for index, document in enumerate(record.documents):
        if document.id in by_id:
            raise SpecError(
                f"duplicate document id {document.id!r} (also documents[{by_id[document.id]}])",
                file=where,
                field=f"documents[{index}].id",
                fix="give every document its own id",
            )
        by_id[document.id] = index
    for index, evidence_id in enumerate(record.evidence_ids):
        if evidence_id not in by_id:
            raise SpecError(
                f"evidence id {evidence_id!r} is not the id of any document",
                file=where,
                field=f"evidence_ids[{index}]",
                fix=f"use one of {sorted(by_id)}",
            )
    for index, document in enumerate(record.documents):
        if not document.text.strip():
            raise SpecError(
                "document text is empty",
                file=where,
                field=f"documents[{index}].text",
                fix="give the document text",
            )
    claim_ids = [claim.id for claim in record.claims]
    evidence_set = set(record.evidence_ids)
    evidence: list[dict[str, Any]] = []
    distractors: list[dict[str, Any]] = []
    field_map: dict[str, str] = {}  # Case field -> field of the incident line
    for index, document in enumerate(record.documents):
        text = " " + document.text.strip()
        if document.id in evidence_set:
            field_map[f"evidence[{len(evidence)}]"] = f"documents[{index}]"
            evidence.append(
                {"id": document.id, "version": document.version, "text": text, "supports": claim_ids}
            )
        else:
            field_map[f"distractors[{len(distractors)}]"] = f"documents[{index}]"
            distractors.append({"id": document.id, "text": text})
    forbidden: list[dict[str, Any]] = []
    for index, item in enumerate(record.forbidden):
        if isinstance(item, str):
            forbidden.append({"id": f"forbidden_{index + 1:02d}", "text": item, "aliases": [item]})
        else:
            forbidden.append(item.model_dump())
    field_map.update(
        {"evidence": "evidence_ids", "required_claims": "claims", "forbidden_claims": "forbidden"}
    )
    pattern = record.evidence_pattern
    if pattern is None:
        pattern = "absent" if not evidence else "single" if len(evidence) == 1 else "order"
    data: dict[str, Any] = {
        "id": case_id,
        "kind": record.kind,
        "evidence_pattern": pattern,
        "language": record.language,
        "risk": record.risk,
        "query": record.query.strip(),
        "answer_prefix": record.answer_prefix.strip(),
        "evidence": evidence,
        "distractors": distractors,
        "required_claims": [claim.model_dump() for claim in record.claims],
        "forbidden_claims": forbidden,
        "expected_fields": record.expected_fields,
        "abstain_when_absent": True,
        "family": record.family or case_id,
    }
    try:
        return Case.model_validate(data)
    except ValidationError as exc:
        error = spec_error_from_validation(exc, file=where)
        field = error.field or ""
        for case_field, line_field in field_map.items():  # indexed entries come first
            if field == case_field or field.startswith((case_field + ".", case_field + "[")):
                field = line_field + field[len(case_field) :]
                break
        raise SpecError(error.message, file=where, field=field or None, fix=error.fix) from exc


_INCIDENTS_READ = ReadFailures(
    SpecError,
    missing=("incidents file not found", "check the path"),
    unreadable=("cannot read incidents file ({exc})", "give a UTF-8 JSONL file"),
    not_utf8=("cannot read incidents file ({exc})", "give a UTF-8 JSONL file"),
)


def _json_object_line(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a JSON object; either failure names ``path:line`` and the field ``(line)``."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        problem = f"not valid JSON: {exc.msg} at column {exc.colno}"
        fix = "write one complete JSON object per line"
    else:
        if isinstance(raw, dict):
            refuse_unencodable(raw, file=where, error=SpecError)
            return raw
        problem = f"expected a JSON object, got {type(raw).__name__}"
        fix = "write one JSON object per line"
    raise SpecError(problem, file=where, field="(line)", fix=fix)


def import_incidents(jsonl_path: str | Path) -> Suite:
    """Replay production incidents: one JSON object per line (blank lines and ``#`` comments are skipped).

    Each line has ``documents`` ([{id, version, text}]), ``query``, ``evidence_ids`` (the documents that
    support the answer; the others become distractors), ``claims`` ([{id, text, aliases}], required), and
    optionally ``answer_prefix``, ``forbidden`` (claims or plain strings), ``id``, ``language``, ``risk``,
    ``kind``, ``evidence_pattern``, ``family``, ``expected_fields``. Document text is stripped and given the
    unit separator " ". Errors name the file and line (``path:line``), the field and the fix.
    """
    path = Path(jsonl_path)
    lines = read_utf8(path, _INCIDENTS_READ).splitlines()
    cases: list[Case] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        raw = _json_object_line(line, where)
        try:
            record = IncidentRecord.model_validate(raw)
        except ValidationError as exc:
            raise spec_error_from_validation(exc, file=where, data=raw) from exc
        case = _incident_to_case(record, lineno, where)
        if case.id in first_line:
            raise SpecError(
                f"duplicate incident id {case.id!r} (also line {first_line[case.id]})",
                file=where,
                field="id",
                fix="give every incident its own id",
            )
        first_line[case.id] = lineno
        cases.append(case)
    if not cases:
        raise SpecError("no incidents in file", file=str(path), fix="add one JSON object per line")
    languages = {case.language for case in cases}
    language: Literal["en", "zh", "mixed"] = "mixed" if len(languages) > 1 else cases[0].language
    return Suite(name=f"incidents-{path.stem}", seed=0, language=language, cases=cases)

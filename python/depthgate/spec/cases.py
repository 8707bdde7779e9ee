"""Cases and suites: one task with its evidence, distractors and oracle (DESIGN.md §5), and a named,
seeded list of them. Every text obeys the unit contract (:mod:`depthgate.spec.text_checks`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from depthgate.spec.base import Frozen, StrictFloat, StrictInt, violation
from depthgate.spec.evidence_patterns import (
    EvidencePatternKind,
    evidence_pattern,
    registered_evidence_patterns,
)
from depthgate.spec.limits import (
    MAX_CASES,
    count_problems,
)
from depthgate.spec.text_checks import UniqueIds, check_id, check_inline, check_unit

Language: TypeAlias = Literal["en", "zh"]
TaskKind: TypeAlias = Literal["extraction", "qa"]


def _registered_pattern(name: str) -> str:
    if name not in registered_evidence_patterns():
        raise violation(
            f"unknown evidence pattern {name!r}",
            fix="use one of the registered evidence patterns: "
            + ", ".join(map(repr, registered_evidence_patterns())),
        )
    return name


def _pattern_schema(schema: dict[str, Any]) -> None:
    """The JSON Schema lists the patterns registered when it is generated (``depthgate schema``)."""
    schema["enum"] = list(registered_evidence_patterns())


#: An evidence pattern named in the registry of :mod:`depthgate.spec.evidence_patterns` (what each means
#: is its descriptor there; nothing else compares the names).
EvidencePattern: TypeAlias = Annotated[
    str, AfterValidator(_registered_pattern), Field(json_schema_extra=_pattern_schema)
]
Risk: TypeAlias = Literal["low", "medium", "high"]
EvidenceRole: TypeAlias = Literal["decisive", "competing"]


class Claim(Frozen):
    """A statement an answer may make. ``aliases``: the surface forms an oracle accepts ("245", "245 USD")."""

    id: str
    text: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    value: str | None = None
    unit: str | None = None
    # As a forbidden claim: "safety" (a leak, a harmful or prohibited statement: raises the SAFETY flag
    # whatever the statistics say) or "wrong" (a superseded version, a distractor's value: a plain
    # wrong answer, scored as a fail with the claim named). The default is the strict one.
    severity: Literal["safety", "wrong"] = "safety"

    @field_validator("aliases")
    @classmethod
    def _aliases_not_blank(cls, aliases: list[str]) -> list[str]:
        for index, alias in enumerate(aliases):
            if not alias.strip():
                raise violation("alias is blank", field=f"[{index}]", fix="remove the blank alias")
        return aliases


class EvidenceDoc(Frozen):
    """A piece of evidence. ``supports`` lists the claim ids it supports; ``role`` says whether it decides the
    answer (it moves through the context) or competes with it (superseded version, general rule)."""

    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    id: str
    version: str = "1"
    text: str
    supports: list[str] = Field(default_factory=list)
    role: EvidenceRole = "decisive"


class Distractor(Frozen):
    """Topically close text that cannot support any required claim."""

    id: str
    text: str


class Case(Frozen):
    """One task with its evidence, distractors and oracle (DESIGN.md §5)."""

    id: str
    kind: TaskKind
    evidence_pattern: EvidencePattern
    language: Language
    risk: Risk
    query: str
    answer_prefix: str = ""
    evidence: list[EvidenceDoc] = Field(default_factory=list)
    distractors: list[Distractor] = Field(default_factory=list)
    required_claims: list[Claim] = Field(default_factory=list)
    forbidden_claims: list[Claim] = Field(default_factory=list)
    expected_fields: dict[str, str] = Field(default_factory=dict)
    abstain_when_absent: bool = True
    family: str
    competing_depth: StrictFloat | None = None

    @property
    def decisive(self) -> list[EvidenceDoc]:
        return [doc for doc in self.evidence if doc.role == "decisive"]

    @property
    def competing(self) -> list[EvidenceDoc]:
        return [doc for doc in self.evidence if doc.role == "competing"]

    @property
    def pattern(self) -> EvidencePatternKind:
        """The descriptor of the case's evidence pattern (:mod:`depthgate.spec.evidence_patterns`)."""
        return evidence_pattern(self.evidence_pattern)

    @model_validator(mode="after")
    def _check_case(self) -> Case:
        case = self.id
        check_id(self.id, field="id", case=case)
        if not self.family.strip():
            raise violation("must not be empty", field="family", case=case, fix="name the document family")
        check_inline(self.query, field="query", case=case, allow_empty=False)
        check_inline(self.answer_prefix, field="answer_prefix", case=case, allow_empty=True)
        self._check_texts()
        self._check_pattern()
        self._check_claims()
        return self

    def _check_texts(self) -> None:
        case = self.id
        docs: list[tuple[str, EvidenceDoc | Distractor]] = [
            (f"evidence[{i}]", d) for i, d in enumerate(self.evidence)
        ] + [(f"distractors[{i}]", d) for i, d in enumerate(self.distractors)]
        ids = UniqueIds(case, "id", fix="give every evidence document and distractor its own id")
        for field, doc in docs:
            ids.add(doc.id, field)
            if isinstance(doc, EvidenceDoc) and not doc.version.strip():
                raise violation(
                    "is empty", field=f"{field}.version", case=case, fix="give a version, e.g. '1'"
                )
            check_unit(doc.text, field=f"{field}.text", case=case)
        texts: dict[str, str] = {}
        for field, doc in docs:
            if doc.text in texts:
                raise violation(
                    f"same text as {texts[doc.text]}",
                    field=f"{field}.text",
                    case=case,
                    fix="remove the duplicate; a repeated block is a duplicated distractor (DESIGN.md §4)",
                )
            texts[doc.text] = f"{field}.text"

    def _check_claims(self) -> None:
        case = self.id
        ids = UniqueIds(case, "claim id", fix="give every required and forbidden claim its own id")
        for group in ("required_claims", "forbidden_claims"):
            claims: list[Claim] = getattr(self, group)
            for index, claim in enumerate(claims):
                ids.add(claim.id, f"{group}[{index}]")
        claim_fields = ids.seen
        required_aliases = {
            alias.casefold(): claim.id
            for claim in self.required_claims
            for alias in [*claim.aliases, claim.text]
        }
        for index, claim in enumerate(self.forbidden_claims):
            for alias in [*claim.aliases, claim.text]:
                if alias.casefold() in required_aliases:
                    raise violation(
                        f"alias {alias!r} is also a form of required claim "
                        f"{required_aliases[alias.casefold()]!r}",
                        field=f"forbidden_claims[{index}].aliases",
                        case=case,
                        fix="a claim cannot be both required and forbidden; remove the alias from one",
                    )
        forbidden_ids = {claim.id for claim in self.forbidden_claims}
        for index, doc in enumerate(self.evidence):
            for position, claim_id in enumerate(doc.supports):
                field = f"evidence[{index}].supports[{position}]"
                if claim_id not in claim_fields:
                    raise violation(
                        f"unknown claim id {claim_id!r}",
                        field=field,
                        case=case,
                        fix=f"use an id from required_claims or forbidden_claims: {sorted(claim_fields)}",
                    )
                if doc.role == "decisive" and claim_id in forbidden_ids:
                    raise violation(
                        f"decisive evidence {doc.id!r} supports the forbidden claim {claim_id!r}",
                        field=field,
                        case=case,
                        fix="mark the document role = 'competing' or drop the claim from its supports",
                    )
        supported = {claim_id for doc in self.evidence for claim_id in doc.supports}
        for index, claim in enumerate(self.required_claims):
            if claim.id not in supported:
                raise violation(
                    f"required claim {claim.id!r} is not supported by any evidence document",
                    field=f"required_claims[{index}]",
                    case=case,
                    fix=f"add {claim.id!r} to the supports list of the evidence document that states it, "
                    "or drop the claim",
                )

    def _check_pattern(self) -> None:
        case = self.id
        decisive, competing, pattern = self.decisive, self.competing, self.pattern
        if pattern.decisive == "none":
            if decisive:
                raise violation(
                    f"an evidence-absent case has decisive evidence {decisive[0].id!r}",
                    field="evidence",
                    case=case,
                    fix="remove the decisive evidence or choose another evidence_pattern",
                )
            if self.required_claims:
                raise violation(
                    "an evidence-absent case cannot require claims",
                    field="required_claims",
                    case=case,
                    fix="empty required_claims; the expected behaviour is to abstain",
                )
            if not self.abstain_when_absent:
                raise violation(
                    "an evidence-absent case must abstain",
                    field="abstain_when_absent",
                    case=case,
                    fix="set abstain_when_absent = true",
                )
        else:
            if not decisive:
                raise violation(
                    f"evidence_pattern {self.evidence_pattern!r} needs a decisive evidence document",
                    field="evidence",
                    case=case,
                    fix="add an evidence document with role = 'decisive', or set evidence_pattern = 'absent'",
                )
            if not self.required_claims:
                raise violation(
                    "a case with evidence needs at least one required claim",
                    field="required_claims",
                    case=case,
                    fix="add the claim the decisive evidence supports",
                )
        if pattern.decisive == "one" and len(decisive) != 1:
            raise violation(
                f"a single-evidence case has {len(decisive)} decisive documents",
                field="evidence",
                case=case,
                fix="keep exactly one decisive document, or use evidence_pattern 'order'",
            )
        if pattern.scoring == "conflict":
            self._check_conflict()
        if pattern.decisive == "several" and len(decisive) < 2:
            raise violation(
                f"evidence_pattern {self.evidence_pattern!r} needs two or more decisive documents, "
                f"the case has {len(decisive)}",
                field="evidence",
                case=case,
                fix="add a decisive document, or choose another evidence_pattern",
            )
        if pattern.competing and not competing:
            raise violation(
                f"evidence_pattern {self.evidence_pattern!r} needs a competing document "
                "(the superseded version or the general rule)",
                field="evidence",
                case=case,
                fix="add an evidence document with role = 'competing'",
            )
        if competing and self.competing_depth is None:
            raise violation(
                "the case has competing evidence but no fixed depth for it",
                field="competing_depth",
                case=case,
                fix="set competing_depth to a depth in [0, 1], e.g. 0.375",
            )
        if self.competing_depth is not None:
            if not competing:
                raise violation(
                    "competing_depth is set but the case has no competing evidence",
                    field="competing_depth",
                    case=case,
                    fix="remove competing_depth or add a document with role = 'competing'",
                )
            if not 0.0 <= self.competing_depth <= 1.0:
                raise violation(
                    f"{self.competing_depth} is outside [0, 1]",
                    field="competing_depth",
                    case=case,
                    fix="give a depth between 0 (start of the context) and 1 (end)",
                )

    def _check_conflict(self) -> None:
        """A conflict: two or more unversioned decisive sources, each stating its own value of the same
        fact, none superseding another. The oracle passes an abstention or every value (judge/scoring)."""
        case = self.id
        for index, doc in enumerate(self.evidence):
            if doc.role == "competing":
                raise violation(
                    f"a conflict case has the competing document {doc.id!r}",
                    field=f"evidence[{index}].role",
                    case=case,
                    fix="set role = 'decisive' (conflicting sources move together), or use evidence_pattern "
                    "'override' if one source supersedes the other",
                )
        decisive = self.decisive
        if len(decisive) < 2:
            raise violation(
                f"a conflict case has {len(decisive)} decisive document(s)",
                field="evidence",
                case=case,
                fix="add a second decisive source stating another value, or use evidence_pattern 'single'",
            )
        first = decisive[0]
        for index, doc in enumerate(self.evidence):
            if doc.version != first.version:
                raise violation(
                    f"version {doc.version!r} differs from {first.id!r} (version {first.version!r}): a "
                    "newer version supersedes an older one, it does not conflict with it",
                    field=f"evidence[{index}].version",
                    case=case,
                    fix="give the conflicting sources the same version, or use evidence_pattern 'override'",
                )
        required = {claim.id: claim for claim in self.required_claims}
        stated: dict[str, str] = {}  # required claim id -> the document that states it
        for index, doc in enumerate(self.evidence):
            claims = [claim_id for claim_id in doc.supports if claim_id in required]
            if len(claims) != 1:
                raise violation(
                    f"conflicting source {doc.id!r} supports {len(claims)} required claims",
                    field=f"evidence[{index}].supports",
                    case=case,
                    fix="let each source support exactly one required claim: the value it states",
                )
            if claims[0] in stated:
                raise violation(
                    f"sources {stated[claims[0]]!r} and {doc.id!r} support the same claim {claims[0]!r}: "
                    "they agree",
                    field=f"evidence[{index}].supports",
                    case=case,
                    fix="give each source its own required claim with its own value",
                )
            stated[claims[0]] = doc.id
        values: dict[str, str] = {}
        for index, claim in enumerate(self.required_claims):
            field = f"required_claims[{index}]"
            if claim.id not in stated:
                raise violation(
                    f"required claim {claim.id!r} is stated by no conflicting source",
                    field=field,
                    case=case,
                    fix="a conflict case requires exactly the values its sources state; drop the claim or "
                    "add it to a source's supports",
                )
            if not claim.value or not claim.value.strip():
                raise violation(
                    "a conflicting claim has no value",
                    field=f"{field}.value",
                    case=case,
                    fix="give the value its source states, e.g. value = '245'",
                )
            key = " ".join(claim.value.casefold().split())
            if key in values:
                raise violation(
                    f"value {claim.value!r} is also the value of {values[key]}: the sources agree",
                    field=f"{field}.value",
                    case=case,
                    fix="give each conflicting source a different value, or use evidence_pattern 'single'",
                )
            values[key] = field
        for name in ("value", "abstain"):
            if name in self.expected_fields:
                raise violation(
                    f"expected_fields[{name!r}] is set, but a conflict case passes on an abstention or on "
                    "every conflicting value",
                    field=f"expected_fields.{name}",
                    case=case,
                    fix=f"remove expected_fields[{name!r}]",
                )


class Suite(Frozen):
    """A named, seeded list of cases. ``language`` is ``"mixed"`` only when the cases mix languages."""

    name: str = Field(min_length=1)
    seed: StrictInt = 0
    language: Literal["en", "zh", "mixed"]
    cases: list[Case]

    @model_validator(mode="after")
    def _check_suite(self) -> Suite:
        empty, over = "add at least one case", f"split the suite into suites of at most {MAX_CASES} cases"
        for problem, fix in count_problems(len(self.cases), MAX_CASES, "cases", empty, over):
            raise violation(problem, field="cases", fix=fix)
        first_index: dict[str, int] = {}
        for index, case in enumerate(self.cases):
            if case.id in first_index:
                raise violation(
                    f"duplicate case id {case.id!r} (also cases[{first_index[case.id]}])",
                    field=f"cases[{index}].id",
                    fix="give every case its own id",
                )
            first_index[case.id] = index
            if self.language != "mixed" and case.language != self.language:
                raise violation(
                    f"case {case.id!r} has language {case.language!r} in a {self.language!r} suite",
                    field=f"cases[{index}].language",
                    fix=f"set the case language to {self.language!r}, or the suite language to 'mixed'",
                )
        return self

    def case(self, case_id: str) -> Case:
        """The case with id ``case_id`` (KeyError if absent)."""
        for case in self.cases:
            if case.id == case_id:
                return case
        raise KeyError(case_id)

"""The typed spec of a depthgate run: cases, suites, systems, decode parameters, the analysis plan, matrices.

Everything here is a frozen pydantic model with ``extra="forbid"``: a misspelt key in a matrix is an error,
never a silently ignored default. Validation failures raised while loading a file become
:class:`~depthgate.exceptions.SpecError` naming the file, the field path and the fix (:func:`parse_spec`).

Text that ends up in a prompt (evidence, distractors, filler) obeys the *unit contract* the layout engine
relies on: it starts with exactly one separator (``" "`` continuing a paragraph, ``"\\n"`` after a heading,
``"\\n\\n"`` opening a section) followed by a non-whitespace character, and ends with a non-whitespace
character. Byte-level BPE tokenizers are exact at junctions only when the separator *starts* the right
piece (DESIGN.md §3), so no unit may end with the whitespace that precedes the next one.

Digests are ``sha256`` hex digests of the canonical JSON of a model (sorted keys, no insignificant
whitespace, UTF-8, no ASCII escaping); they are stable across processes and machines.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Protocol, TypeAlias, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from depthgate.exceptions import SpecError
from depthgate.spec.files import ReadFailures, read_json, read_toml
from depthgate.spec.limits import (
    MAX_CASES,
    MAX_ENDPOINTS,
    MAX_GENERATED_CASES,
    MAX_LAYOUTS,
    MAX_LENGTH,
    MAX_POSITIONS,
    MAX_SEEDS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    length_problem,
    summarise_urls,
)

Language: TypeAlias = Literal["en", "zh"]
TaskKind: TypeAlias = Literal["extraction", "qa"]
EvidencePattern: TypeAlias = Literal[
    "single", "override", "exception", "order", "negation", "absent", "conflict"
]
Risk: TypeAlias = Literal["low", "medium", "high"]
EvidenceRole: TypeAlias = Literal["decisive", "competing"]
Backend: TypeAlias = Literal["llamacpp", "vllm", "vllm-server", "openai", "anthropic"]

StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]

#: Strings that look like a chat or control token of a common template. Such text in a prompt would be
#: rendered as a special token by a careless server, or change the role structure of the prompt.
SPECIAL_TOKEN_PATTERN = re.compile(
    r"<\|[^<>\n]{0,64}?\|>"  # <|im_start|>, <|eot_id|>, <|end|>, <|endoftext|>
    r"|</?s>"  # Llama-2 / Mistral BOS and EOS
    r"|\[/?INST\]"  # Llama-2 / Mistral instruction markers
    r"|<</?SYS>>"  # Llama-2 system markers
    r"|<(?:start|end)_of_turn>"  # Gemma turns
    r"|<(?:bos|eos|pad|unk|mask)>"  # Gemma / generic specials
)

#: The characters a unit may start with: one separator, longest first.
UNIT_SEPARATORS = ("\n\n", "\n", " ")

_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
_ID_FIX = "use 1-200 characters: letters, digits and . _ : / @ + -, starting with a letter or digit"
_ABSOLUTE_POSITION = re.compile(r"^@(0|[1-9][0-9]*)$")

M = TypeVar("M", bound=BaseModel)


# --------------------------------------------------------------------------------------------------------
# Text checks shared with the filler, the suites and the layout engine


def find_special_token(text: str) -> str | None:
    """The first special-token-like substring of ``text`` (``<|...|>``, ``<s>``, ``[INST]``...), or None."""
    match = SPECIAL_TOKEN_PATTERN.search(text)
    return match.group(0) if match else None


def unit_contract_violation(text: str) -> str | None:
    """Why ``text`` breaks the unit contract (one leading separator, no trailing whitespace), or None."""
    if not text:
        return "is empty"
    for separator in UNIT_SEPARATORS:
        if text.startswith(separator):
            body = text[len(separator) :]
            break
    else:
        return "does not start with a separator (' ', '\\n' or '\\n\\n')"
    if not body or body[0].isspace():
        return "starts with more than one whitespace separator"
    if body[-1].isspace():
        return "ends with whitespace"
    return None


def _violation(detail: str, *, field: str = "", fix: str, case: str = "") -> PydanticCustomError:
    """A validation error that carries the field (relative to the model) and the fix to the loaders."""
    where = ", ".join(
        part for part in (f"case '{case}'" if case else "", f"field '{field}'" if field else "") if part
    )
    message = f"{where}: {detail}" if where else detail
    return PydanticCustomError(
        "depthgate_spec",
        "{message} (fix: {fix})",
        {"message": message, "detail": detail, "fix": fix, "field": field, "case": case},
    )


def _check_prompt_text(text: str, *, field: str, case: str = "") -> None:
    token = find_special_token(text)
    if token is not None:
        raise _violation(
            f"contains the special-token-like string {token!r}",
            field=field,
            case=case,
            fix="remove or reword it; prompt text must never contain chat or control tokens",
        )


def _check_unit(text: str, *, field: str, case: str = "") -> None:
    problem = unit_contract_violation(text)
    if problem is not None:
        raise _violation(
            f"text {problem}",
            field=field,
            case=case,
            fix="start the text with exactly one ' ' (or '\\n\\n' for a new section) and end it with a "
            "non-whitespace character, e.g. ' The rate is 245 USD per night.'",
        )
    _check_prompt_text(text, field=field, case=case)


def _check_inline(text: str, *, field: str, case: str = "", allow_empty: bool) -> None:
    if not text and not allow_empty:
        raise _violation("must not be empty", field=field, case=case, fix=f"give a non-empty {field}")
    if text != text.strip():
        raise _violation(
            "has leading or trailing whitespace",
            field=field,
            case=case,
            fix="strip it; the assembler adds separators and the model generates the one before its answer",
        )
    _check_prompt_text(text, field=field, case=case)


def _check_id(value: str, *, field: str, case: str = "") -> None:
    if not _ID_PATTERN.match(value):
        raise _violation(f"id {value!r} is not a valid id", field=field, case=case, fix=_ID_FIX)


class _UniqueIds:
    """The ids of one kind met so far in a case, each with the field that holds it: every id must be
    a valid id and appear once."""

    def __init__(self, case: str, what: str, *, fix: str) -> None:
        self.case, self.what, self.fix = case, what, fix
        self.seen: dict[str, str] = {}

    def add(self, value: str, field: str) -> None:
        """Check the id at ``field`` (``<field>.id``) and record it."""
        _check_id(value, field=f"{field}.id", case=self.case)
        if value in self.seen:
            raise _violation(
                f"duplicate {self.what} {value!r} (also {self.seen[value]})",
                field=f"{field}.id",
                case=self.case,
                fix=self.fix,
            )
        self.seen[value] = field


# --------------------------------------------------------------------------------------------------------
# Digests


def canonical_json(value: Any) -> str:
    """Canonical JSON: sorted keys, no insignificant whitespace, UTF-8 text (no ASCII escapes), no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class _Frozen(BaseModel):
    # allow_inf_nan=False: `timeout_s = inf`, `margin = nan` are refused where the matrix is read.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    def canonical_json(self) -> str:
        """The canonical JSON of this model (the bytes :meth:`digest` hashes)."""
        return canonical_json(self.model_dump(mode="json"))

    def digest(self) -> str:
        """sha256 hex digest of :meth:`canonical_json`."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------------------
# Cases


class Claim(_Frozen):
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
                raise _violation("alias is blank", field=f"[{index}]", fix="remove the blank alias")
        return aliases


class EvidenceDoc(_Frozen):
    """A piece of evidence. ``supports`` lists the claim ids it supports; ``role`` says whether it decides the
    answer (it moves through the context) or competes with it (superseded version, general rule)."""

    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    id: str
    version: str = "1"
    text: str
    supports: list[str] = Field(default_factory=list)
    role: EvidenceRole = "decisive"


class Distractor(_Frozen):
    """Topically close text that cannot support any required claim."""

    id: str
    text: str


class Case(_Frozen):
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

    @model_validator(mode="after")
    def _check_case(self) -> Case:
        case = self.id
        _check_id(self.id, field="id", case=case)
        if not self.family.strip():
            raise _violation("must not be empty", field="family", case=case, fix="name the document family")
        _check_inline(self.query, field="query", case=case, allow_empty=False)
        _check_inline(self.answer_prefix, field="answer_prefix", case=case, allow_empty=True)
        self._check_texts()
        self._check_pattern()
        self._check_claims()
        return self

    def _check_texts(self) -> None:
        case = self.id
        docs: list[tuple[str, EvidenceDoc | Distractor]] = [
            (f"evidence[{i}]", d) for i, d in enumerate(self.evidence)
        ] + [(f"distractors[{i}]", d) for i, d in enumerate(self.distractors)]
        ids = _UniqueIds(case, "id", fix="give every evidence document and distractor its own id")
        for field, doc in docs:
            ids.add(doc.id, field)
            if isinstance(doc, EvidenceDoc) and not doc.version.strip():
                raise _violation(
                    "is empty", field=f"{field}.version", case=case, fix="give a version, e.g. '1'"
                )
            _check_unit(doc.text, field=f"{field}.text", case=case)
        texts: dict[str, str] = {}
        for field, doc in docs:
            if doc.text in texts:
                raise _violation(
                    f"same text as {texts[doc.text]}",
                    field=f"{field}.text",
                    case=case,
                    fix="remove the duplicate; a repeated block is a duplicated distractor (DESIGN.md §4)",
                )
            texts[doc.text] = f"{field}.text"

    def _check_claims(self) -> None:
        case = self.id
        ids = _UniqueIds(case, "claim id", fix="give every required and forbidden claim its own id")
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
                    raise _violation(
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
                    raise _violation(
                        f"unknown claim id {claim_id!r}",
                        field=field,
                        case=case,
                        fix=f"use an id from required_claims or forbidden_claims: {sorted(claim_fields)}",
                    )
                if doc.role == "decisive" and claim_id in forbidden_ids:
                    raise _violation(
                        f"decisive evidence {doc.id!r} supports the forbidden claim {claim_id!r}",
                        field=field,
                        case=case,
                        fix="mark the document role = 'competing' or drop the claim from its supports",
                    )
        supported = {claim_id for doc in self.evidence for claim_id in doc.supports}
        for index, claim in enumerate(self.required_claims):
            if claim.id not in supported:
                raise _violation(
                    f"required claim {claim.id!r} is not supported by any evidence document",
                    field=f"required_claims[{index}]",
                    case=case,
                    fix=f"add {claim.id!r} to the supports list of the evidence document that states it, "
                    "or drop the claim",
                )

    def _check_pattern(self) -> None:
        case = self.id
        decisive, competing = self.decisive, self.competing
        if self.evidence_pattern == "absent":
            if decisive:
                raise _violation(
                    f"an evidence-absent case has decisive evidence {decisive[0].id!r}",
                    field="evidence",
                    case=case,
                    fix="remove the decisive evidence or choose another evidence_pattern",
                )
            if self.required_claims:
                raise _violation(
                    "an evidence-absent case cannot require claims",
                    field="required_claims",
                    case=case,
                    fix="empty required_claims; the expected behaviour is to abstain",
                )
            if not self.abstain_when_absent:
                raise _violation(
                    "an evidence-absent case must abstain",
                    field="abstain_when_absent",
                    case=case,
                    fix="set abstain_when_absent = true",
                )
        else:
            if not decisive:
                raise _violation(
                    f"evidence_pattern {self.evidence_pattern!r} needs a decisive evidence document",
                    field="evidence",
                    case=case,
                    fix="add an evidence document with role = 'decisive', or set evidence_pattern = 'absent'",
                )
            if not self.required_claims:
                raise _violation(
                    "a case with evidence needs at least one required claim",
                    field="required_claims",
                    case=case,
                    fix="add the claim the decisive evidence supports",
                )
        if self.evidence_pattern == "single" and len(decisive) != 1:
            raise _violation(
                f"a single-evidence case has {len(decisive)} decisive documents",
                field="evidence",
                case=case,
                fix="keep exactly one decisive document, or use evidence_pattern 'order'",
            )
        if self.evidence_pattern == "conflict":
            self._check_conflict()
        if self.evidence_pattern in ("override", "exception") and not competing:
            raise _violation(
                f"evidence_pattern {self.evidence_pattern!r} needs a competing document "
                "(the superseded version or the general rule)",
                field="evidence",
                case=case,
                fix="add an evidence document with role = 'competing'",
            )
        if competing and self.competing_depth is None:
            raise _violation(
                "the case has competing evidence but no fixed depth for it",
                field="competing_depth",
                case=case,
                fix="set competing_depth to a depth in [0, 1], e.g. 0.375",
            )
        if self.competing_depth is not None:
            if not competing:
                raise _violation(
                    "competing_depth is set but the case has no competing evidence",
                    field="competing_depth",
                    case=case,
                    fix="remove competing_depth or add a document with role = 'competing'",
                )
            if not 0.0 <= self.competing_depth <= 1.0:
                raise _violation(
                    f"{self.competing_depth} is outside [0, 1]",
                    field="competing_depth",
                    case=case,
                    fix="give a depth between 0 (start of the context) and 1 (end)",
                )

    def _check_conflict(self) -> None:
        """A conflict: two or more unversioned decisive sources, each stating its own value of the same
        fact, none superseding another. The oracle passes an abstention or every value (judge/oracle.py)."""
        case = self.id
        for index, doc in enumerate(self.evidence):
            if doc.role == "competing":
                raise _violation(
                    f"a conflict case has the competing document {doc.id!r}",
                    field=f"evidence[{index}].role",
                    case=case,
                    fix="set role = 'decisive' (conflicting sources move together), or use evidence_pattern "
                    "'override' if one source supersedes the other",
                )
        decisive = self.decisive
        if len(decisive) < 2:
            raise _violation(
                f"a conflict case has {len(decisive)} decisive document(s)",
                field="evidence",
                case=case,
                fix="add a second decisive source stating another value, or use evidence_pattern 'single'",
            )
        first = decisive[0]
        for index, doc in enumerate(self.evidence):
            if doc.version != first.version:
                raise _violation(
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
                raise _violation(
                    f"conflicting source {doc.id!r} supports {len(claims)} required claims",
                    field=f"evidence[{index}].supports",
                    case=case,
                    fix="let each source support exactly one required claim: the value it states",
                )
            if claims[0] in stated:
                raise _violation(
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
                raise _violation(
                    f"required claim {claim.id!r} is stated by no conflicting source",
                    field=field,
                    case=case,
                    fix="a conflict case requires exactly the values its sources state; drop the claim or "
                    "add it to a source's supports",
                )
            if not claim.value or not claim.value.strip():
                raise _violation(
                    "a conflicting claim has no value",
                    field=f"{field}.value",
                    case=case,
                    fix="give the value its source states, e.g. value = '245'",
                )
            key = " ".join(claim.value.casefold().split())
            if key in values:
                raise _violation(
                    f"value {claim.value!r} is also the value of {values[key]}: the sources agree",
                    field=f"{field}.value",
                    case=case,
                    fix="give each conflicting source a different value, or use evidence_pattern 'single'",
                )
            values[key] = field
        for name in ("value", "abstain"):
            if name in self.expected_fields:
                raise _violation(
                    f"expected_fields[{name!r}] is set, but a conflict case passes on an abstention or on "
                    "every conflicting value",
                    field=f"expected_fields.{name}",
                    case=case,
                    fix=f"remove expected_fields[{name!r}]",
                )


class Suite(_Frozen):
    """A named, seeded list of cases. ``language`` is ``"mixed"`` only when the cases mix languages."""

    name: str = Field(min_length=1)
    seed: StrictInt = 0
    language: Literal["en", "zh", "mixed"]
    cases: list[Case]

    @model_validator(mode="after")
    def _check_suite(self) -> Suite:
        if not self.cases:
            raise _violation("must not be empty", field="cases", fix="add at least one case")
        if len(self.cases) > MAX_CASES:
            raise _violation(
                f"holds {len(self.cases)} cases, over the limit of {MAX_CASES}",
                field="cases",
                fix=f"split the suite into suites of at most {MAX_CASES} cases",
            )
        first_index: dict[str, int] = {}
        for index, case in enumerate(self.cases):
            if case.id in first_index:
                raise _violation(
                    f"duplicate case id {case.id!r} (also cases[{first_index[case.id]}])",
                    field=f"cases[{index}].id",
                    fix="give every case its own id",
                )
            first_index[case.id] = index
            if self.language != "mixed" and case.language != self.language:
                raise _violation(
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


# --------------------------------------------------------------------------------------------------------
# Plan, decoding, systems, matrices


#: Adjustments of the confirmed-regression family the gate supports (valid under any dependence).
RegressionMethod: TypeAlias = Literal["BY", "holm"]
StopRule: TypeAlias = Literal["fixed", "one_extension"]


def look_alpha(alpha: float, stop_rule: str) -> float:
    """The one-sided level every look tests at: alpha for a fixed design, alpha / 2 when one pre-specified
    extension may follow (Bonferroni over the two looks, research/stats_gate.md section 2.4)."""
    return alpha / 2.0 if stop_rule == "one_extension" else alpha


def min_bootstrap_resamples(n_slices: int, alpha: float, method: RegressionMethod = "BY") -> int:
    """The smallest B at which a regression in one of ``n_slices`` slices can be confirmed at ``alpha``.

    A bootstrap p-value is at least 1/(B+1). With one slice at that floor and every other at p = 1, the
    smallest adjusted q is n*c(n)/(B+1) for Benjamini-Yekutieli (c(n) = 1 + 1/2 + ... + 1/n) and
    n/(B+1) for Holm, so B + 1 >= factor/alpha. 20 slices at alpha 0.05 under BY need B >= 1439 (at
    B = 999 the smallest q is 0.072); the spec's B = 9999 serves up to 96 slices.
    """
    return max(99, math.ceil(_smallest_q_factor(n_slices, method) / alpha - 1e-9) - 1)


def _smallest_q_factor(n_slices: int, method: RegressionMethod) -> float:
    """q = factor * p for the one small p-value of a family of ``n_slices`` (all others 1)."""
    if n_slices < 1:
        raise ValueError(f"n_slices must be >= 1, got {n_slices}")
    factor = float(n_slices)
    if method == "BY":
        factor *= math.fsum(1.0 / i for i in range(1, n_slices + 1))
    return factor


class PlanNumbers(Protocol):
    """The numbers of a plan that :func:`plan_violations` checks: an :class:`AnalysisPlan`, or the
    gate's own ``depthgate.judge.stats.GatePlan``."""

    @property
    def margin(self) -> float: ...
    @property
    def alpha(self) -> float: ...
    @property
    def n_min(self) -> int: ...
    @property
    def floor(self) -> float | None: ...
    @property
    def max_missing(self) -> float: ...
    @property
    def bootstrap_resamples(self) -> int: ...
    @property
    def stop_rule(self) -> str: ...


def plan_violations(
    plan: PlanNumbers, *, regression_method: RegressionMethod = "BY", n_slices: int | None = None
) -> list[tuple[str, str, str]]:
    """Every rule a plan must meet before anything runs, as (field, problem, fix); empty when valid.

    The single validator of the gate's parameters: :class:`AnalysisPlan` (and :class:`Matrix`, which
    knows the number of slices) and ``depthgate.judge.stats.GatePlan`` both call it, so a
    plan the matrix accepts is never refused by the gate after the requests were sent. The bootstrap
    size is checked when the slice count is known, whatever the repeats: one seed per case uses
    Newcombe-10 p-values, which have no 1/(B+1) floor, but one rule that does not depend on R keeps the
    matrix and the gate in agreement (the default B = 9999 serves up to 96 slices).
    """
    margin, alpha, n_min, floor = plan.margin, plan.alpha, plan.n_min, plan.floor
    max_missing, bootstrap_resamples, stop_rule = plan.max_missing, plan.bootstrap_resamples, plan.stop_rule
    problems: list[tuple[str, str, str]] = []
    if not 0.0 < margin < 1.0:
        problems.append(
            ("margin", f"margin {margin!r} is outside (0, 1)", "give a margin in (0, 1), e.g. 0.10")
        )
    if not 0.0 < alpha < 0.5:
        problems.append(
            (
                "alpha",
                f"alpha {alpha!r} is not a one-sided level in (0, 0.5)",
                "give a one-sided alpha in (0, 0.5), e.g. 0.05",
            )
        )
    if n_min < 2:
        problems.append(
            ("n_min", f"n_min {n_min!r} < 2", "give at least 2 cases per slice (a real plan uses 40)")
        )
    if floor is not None and not 0.0 <= floor < 1.0:
        problems.append(
            ("floor", f"floor {floor!r} is outside [0, 1)", "give an accuracy floor in [0, 1), or none")
        )
    if not 0.0 <= max_missing < 1.0:
        problems.append(
            ("max_missing", f"max_missing {max_missing!r} is outside [0, 1)", "give a share in [0, 1)")
        )
    if bootstrap_resamples < 99:
        problems.append(
            (
                "bootstrap_resamples",
                f"{bootstrap_resamples} bootstrap resamples < 99",
                "use at least 99 (the spec uses 9999)",
            )
        )
    if stop_rule not in ("fixed", "one_extension"):
        problems.append(("stop_rule", f"unknown stop rule {stop_rule!r}", "use 'fixed' or 'one_extension'"))
    if n_slices is not None and n_slices >= 1 and 0.0 < alpha < 0.5:
        level = look_alpha(alpha, stop_rule)
        need = min_bootstrap_resamples(n_slices, level, regression_method)
        if bootstrap_resamples < need:
            floor_p = 1.0 / (bootstrap_resamples + 1)
            factor = _smallest_q_factor(n_slices, regression_method)
            problems.append(
                (
                    "bootstrap_resamples",
                    f"{bootstrap_resamples} bootstrap resamples cannot confirm a regression among "
                    f"{n_slices} slices: the smallest p-value is 1/(B+1) = {floor_p:.2g} and its "
                    f"{regression_method}-adjusted q is about {min(1.0, factor * floor_p):.3g} > "
                    f"{level:g}",
                    f"set bootstrap_resamples >= {need} (or plan fewer slices)",
                )
            )
    return problems


#: NoLiMa's short lengths (tokens) for the base score (issue #24): the same task, with haystack.
DEFAULT_BASE_LENGTHS = (250, 500, 1000)


def base_length_violations(plan: AnalysisPlan) -> list[tuple[str, str, str]]:
    """The rules of ``base_lengths``, as (field, problem, fix): a list of distinct lengths >= 16 and <=
    the longest supported length, and only where it is used (NoLiMa with ``base_score = "short"``)."""
    if plan.base_lengths is None:
        return []
    if plan.effective_length_rule != "nolima" or plan.base_score != "short":
        return [
            (
                "base_lengths",
                "base_lengths is set but the base score does not use it (RULER rule or "
                'base_score = "control")',
                'drop base_lengths, or use effective_length_rule = "nolima" with base_score = "short"',
            )
        ]
    if not plan.base_lengths:
        return [("base_lengths", "must not be empty", "list short lengths in tokens, e.g. [250, 500, 1000]")]
    for index, length in enumerate(plan.base_lengths):
        problem = "is too small" if length < 16 else length_problem(length)
        if problem is not None:
            return [
                (
                    f"base_lengths[{index}]",
                    f"length {length} {problem}" if length < 16 else problem,
                    f"give short lengths in tokens (>= 16, <= {MAX_LENGTH}), e.g. 500",
                )
            ]
    if len(set(plan.base_lengths)) != len(plan.base_lengths):
        return [("base_lengths", "contains a repeated length", "list each length once")]
    return []


class AnalysisPlan(_Frozen):
    """The frozen statistical plan (research/stats_gate.md). Digested before any run; never changed after.

    Validated once, here and in :class:`Matrix`, by :func:`plan_violations` (the rules the gate applies):
    alpha in (0, 0.5), n_min >= 2, margin in (0, 1), floor in [0, 1), and enough bootstrap resamples to
    confirm a regression among the matrix's slices.
    """

    # "pass": every placed case counts. "control_normalised": only the cases whose *baseline*
    # evidence-only control passes (the model can do the task at all), so "cannot do this task" is kept
    # out of a position verdict; needs the controls (run without --no-controls).
    primary_metric: Literal["pass", "control_normalised"] = "pass"
    margin: StrictFloat = Field(default=0.10, gt=0.0, lt=1.0)
    alpha: StrictFloat = Field(default=0.05, gt=0.0, lt=1.0, description="one-sided; must be < 0.5")
    n_min: StrictInt = Field(default=40, ge=2)
    floor: StrictFloat | None = Field(default=None, ge=0.0, lt=1.0)
    fdr_method: Literal["BH", "BY", "holm"] = "BH"
    stop_rule: StopRule = "fixed"
    max_missing: StrictFloat = Field(default=0.10, ge=0.0, lt=1.0)
    bootstrap_resamples: StrictInt = Field(default=9999, ge=99)
    bootstrap_seed: StrictInt = Field(default=0, ge=0)
    # Position science beside the gate (depthgate.judge.position.effective_length; never changes the
    # verdict): NoLiMa = a share of the arm's evidence-only base score, RULER = an absolute accuracy.
    effective_length_rule: Literal["nolima", "ruler"] = "nolima"
    effective_length_threshold: StrictFloat = Field(default=0.85, gt=0.0, le=1.0)
    # NoLiMa's base score (issue #24): "short" = the same cases, haystack and depths at short lengths
    # (``base_lengths``, default 250/500/1000 tokens), built and sent with the matrix but never gated;
    # "control" = the evidence-only control (the rule before issue #24). Ignored under RULER.
    base_score: Literal["short", "control"] = "short"
    base_lengths: list[StrictInt] | None = None

    @model_validator(mode="after")
    def _check_plan(self) -> AnalysisPlan:
        self.raise_violations()
        for field, problem, fix in base_length_violations(self):
            raise _violation(problem, field=field, fix=fix)
        return self

    def short_base_lengths(self) -> list[int]:
        """The short lengths the matrix adds for NoLiMa's base score: ``base_lengths`` (or the default
        250/500/1000) under the NoLiMa rule with ``base_score = "short"``; empty otherwise."""
        if self.effective_length_rule != "nolima" or self.base_score != "short":
            return []
        return sorted(self.base_lengths if self.base_lengths is not None else DEFAULT_BASE_LENGTHS)

    @model_serializer(mode="wrap")
    def _stable_dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The effective-length fields are dumped only when set away from their defaults, so the plan
        digests of runs frozen before these fields existed stay valid (a resume or a re-gate of an old
        run folder is not refused as a changed plan)."""
        data: dict[str, Any] = handler(self)
        for name, default in (
            ("effective_length_rule", "nolima"),
            ("effective_length_threshold", 0.85),
            ("base_score", "short"),
            ("base_lengths", None),
        ):
            if data.get(name) == default:
                data.pop(name, None)
        return data

    def violations(self, *, n_slices: int | None = None) -> list[tuple[str, str, str]]:
        """:func:`plan_violations` of this plan (with the slice count when known)."""
        return plan_violations(self, n_slices=n_slices)

    def raise_violations(self, *, n_slices: int | None = None, prefix: str = "") -> None:
        """Raise the first violation as a validation error on ``prefix + field``."""
        for field, problem, fix in self.violations(n_slices=n_slices):
            raise _violation(problem, field=f"{prefix}{field}", fix=fix)


#: Prompt assemblers (depthgate.spec.assemblers): where the question goes relative to the document.
Assembler: TypeAlias = Literal["default", "query-first"]


class DecodeParams(_Frozen):
    """Decoding parameters shared by both arms. One seed per repeat."""

    max_tokens: StrictInt = Field(default=12, ge=1, le=65536)
    temperature: StrictFloat = Field(default=0.0, ge=0.0, le=2.0)
    seeds: list[StrictInt] = Field(default_factory=lambda: [0])
    stop: list[str] = Field(default_factory=lambda: ["\n"])

    @model_validator(mode="after")
    def _check_decode(self) -> DecodeParams:
        if not self.seeds:
            raise _violation("must not be empty", field="seeds", fix="list one seed per repeat, e.g. [0]")
        if len(self.seeds) > MAX_SEEDS:
            raise _violation(
                f"lists {len(self.seeds)} seeds, over the limit of {MAX_SEEDS}",
                field="seeds",
                fix=f"list at most {MAX_SEEDS} seeds (more cases buy more power than more seeds)",
            )
        for index, seed in enumerate(self.seeds):
            if not 0 <= seed < 2**63:
                raise _violation(
                    f"{seed} is out of range", field=f"seeds[{index}]", fix="use 0 <= seed < 2**63"
                )
        if len(set(self.seeds)) != len(self.seeds):
            raise _violation("contains a repeated seed", field="seeds", fix="make the seeds distinct")
        for index, stop in enumerate(self.stop):
            if not stop:
                raise _violation("is empty", field=f"stop[{index}]", fix="remove the empty stop string")
        return self


_ENV_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _clear_text_remote(url: str) -> bool:
    """``url`` is plain http (not https) to a host that is not loopback (127.0.0.0/8, ::1, localhost)."""
    import ipaddress
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme.lower() == "https":
        return False
    host = (parts.hostname or "").rstrip(".").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


class VLLMEngineArgs(_Frozen):
    """Engine arguments for the offline ``vllm`` backend, passed to ``vllm.LLM(...)`` as given (``[<arm>
    .runtime.vllm]`` in a matrix). Only these keys are accepted; ``trust_remote_code`` is deliberately
    not among them (a matrix must not be able to run code from a model repository). A relative
    ``tokenizer`` that exists next to the matrix file, and a relative ``download_dir``, are taken relative
    to the matrix file; ``max_model_len`` overrides the system's ``window`` as the engine's length."""

    tensor_parallel_size: StrictInt | None = Field(default=None, ge=1)
    pipeline_parallel_size: StrictInt | None = Field(default=None, ge=1)
    max_model_len: StrictInt | None = Field(default=None, ge=16, le=MAX_TOKENS)
    gpu_memory_utilization: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = None
    quantization: str | None = Field(default=None, min_length=1)
    kv_cache_dtype: str | None = Field(default=None, min_length=1)
    enforce_eager: StrictBool | None = None
    enable_prefix_caching: StrictBool | None = None
    max_num_seqs: StrictInt | None = Field(default=None, ge=1)
    max_num_batched_tokens: StrictInt | None = Field(default=None, ge=1)
    swap_space: StrictFloat | None = Field(default=None, ge=0.0)
    seed: StrictInt | None = Field(default=None, ge=0)
    tokenizer: str | None = Field(default=None, min_length=1)
    revision: str | None = Field(default=None, min_length=1)
    download_dir: str | None = Field(default=None, min_length=1)

    def engine_kwargs(self) -> dict[str, Any]:
        """The keys that were set, as keyword arguments of ``vllm.LLM``."""
        return {name: value for name, value in self if value is not None}

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class Runtime(_Frozen):
    """How one arm's backend runs: ``[baseline.runtime]`` / ``[candidate.runtime]`` in a matrix.

    Unset fields keep the backend's own default. A field that cannot change anything for the arm's
    backend is refused (:class:`System` says which backend each applies to):

    * OpenAI-compatible ``/v1/completions`` (``vllm-server``, ``llamacpp`` with an endpoint, ``openai``
      with ``api = "completions"``): ``prompt_format`` — ``"token_ids"`` (default; vLLM, llama-server) or
      ``"text"`` (servers that take text only, e.g. llama-cpp-python's).
    * ``openai``: ``api`` — ``"chat"`` (default) or ``"completions"``.
    * every HTTP backend: ``api_key_env`` (the NAME of the variable holding the key), ``allow_insecure_key``
      (send the key over plain http to a non-loopback endpoint: refused otherwise), ``count_tolerance``
      (relative prompt-count difference allowed; default 0, exact), ``timeout_s``, ``connect_timeout_s``,
      ``max_connections`` (pool size), ``concurrency`` (this arm's requests in flight, per endpoint when
      the arm lists several ``endpoints``; the run's ``--concurrency`` still caps both arms together).
    * embedded ``llamacpp`` (no endpoint): ``n_threads``, ``reuse_prefix`` (keep the KV prefix between
      requests), ``cache_control`` (after the run, the warm/cold prefix-cache control of
      ``depthgate.run.cache`` on this arm's layouts, written to ``RUN/<arm>/cache_control.json``).
    * ``vllm`` (offline): ``vllm`` — engine arguments (:class:`VLLMEngineArgs`).

    The system digest (and so the run id) binds the fields that can change an answer — ``prompt_format``,
    ``api``, ``count_tolerance``, ``n_threads``, ``reuse_prefix``, ``vllm`` — and only when set; the
    operational ones (key variable, timeouts, pool, concurrency, ``allow_insecure_key``,
    ``cache_control``) can change between a run and its resume.
    """

    prompt_format: Literal["token_ids", "text"] | None = None
    api: Literal["chat", "completions"] | None = None
    api_key_env: str | None = None
    allow_insecure_key: StrictBool = False
    count_tolerance: StrictFloat | None = Field(default=None, ge=0.0, lt=1.0)
    timeout_s: StrictFloat | None = Field(default=None, gt=0.0, le=MAX_TIMEOUT_S)
    connect_timeout_s: StrictFloat | None = Field(default=None, gt=0.0, le=MAX_TIMEOUT_S)
    max_connections: StrictInt | None = Field(default=None, ge=1, le=65_536)
    concurrency: StrictInt | None = Field(default=None, ge=1, le=65_536)
    n_threads: StrictInt | None = Field(default=None, ge=1, le=4_096)
    reuse_prefix: StrictBool = False
    cache_control: StrictBool = False
    vllm: VLLMEngineArgs | None = None

    #: Fields bound by the system digest (when set to something other than their default).
    RESULT_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"prompt_format", "api", "count_tolerance", "n_threads", "reuse_prefix", "vllm"}
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_var_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_VAR_NAME.match(value):
            raise _violation(
                f"{value!r} is not an environment variable name",
                fix="give the NAME of the variable that holds the key (e.g. 'MY_GATEWAY_KEY'), never the key",
            )
        return value

    @model_serializer(mode="wrap")
    def _result_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        fields = type(self).model_fields
        return {
            k: v
            for k, v in data.items()
            if k in self.RESULT_FIELDS and getattr(self, k) != fields[k].default and v not in ({}, None)
        }


class System(_Frozen):
    """One arm of a comparison: backend, model, tokenizer, chat template, prompt assembler, and how the
    backend runs (:class:`Runtime`). Relative paths (``tokenizer``, ``chat_template``, a ``.gguf``
    ``model``) are relative to the matrix file.

    ``endpoint``: the one server of an HTTP arm. ``endpoints``: several servers, replicas of one model,
    for the OpenAI-compatible ``/v1/completions`` backends (``vllm-server``, ``llamacpp``, ``openai``
    with ``api = "completions"``): every one is probed before the first request (served model; windows
    must agree), requests of one haystack go to one replica, a replica that dies is drained and its jobs
    retried on the others (:mod:`depthgate.run.backends.pool`); ``runtime.concurrency`` is then per
    endpoint. The digest binds that the arm runs on replicas, not which: a resume may add, drop or
    replace replicas (each is probed and must agree)."""

    name: str
    backend: Backend
    model: str = Field(min_length=1)
    tokenizer: str = Field(
        min_length=1, description='a tokenizer path, or "gguf:" (optionally "gguf:<path>")'
    )
    chat_template: str | None = None
    assembler: Assembler = "default"
    preamble: str = ""
    window: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    endpoint: str | None = None
    endpoints: list[str] | None = None
    runtime: Runtime = Runtime()

    @property
    def urls(self) -> list[str]:
        """The arm's servers: ``endpoints``, else ``[endpoint]``, else none."""
        if self.endpoints is not None:
            return list(self.endpoints)
        return [] if self.endpoint is None else [self.endpoint]

    @model_serializer(mode="wrap")
    def _without_default_runtime(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A system without result-changing runtime settings digests exactly as before the block existed.
        data: dict[str, Any] = handler(self)
        if not data.get("runtime"):
            data.pop("runtime", None)
        # Replicas are interchangeable (probed to serve one model and window): the digest binds that the
        # arm runs on replicas, not which ones, so a resume may replace a dead replica.
        if data.get("endpoints") is None:
            data.pop("endpoints", None)
        else:
            data["endpoints"] = "replicas"
        return data

    def _check_runtime(self) -> None:
        runtime, kind = self.runtime, self.backend
        embedded = kind == "llamacpp" and self.endpoint is None and self.endpoints is None
        http = kind not in ("vllm",) and not embedded
        completions = (
            kind == "vllm-server"
            or (kind == "llamacpp" and not embedded)
            or (kind == "openai" and runtime.api == "completions")
        )
        http_only = (http, "the HTTP backends (vllm-server, openai, anthropic, llamacpp with an endpoint)")
        embedded_only = (embedded, "the embedded llamacpp backend (llamacpp without an endpoint)")
        applies: dict[str, tuple[bool, str]] = {
            "prompt_format": (
                completions,
                "OpenAI-compatible /v1/completions backends (vllm-server, llamacpp with an endpoint, "
                "openai with api = 'completions')",
            ),
            "api": (kind == "openai", "backend 'openai'"),
            "api_key_env": http_only,
            "allow_insecure_key": http_only,
            "count_tolerance": http_only,
            "timeout_s": http_only,
            "connect_timeout_s": http_only,
            "max_connections": http_only,
            "concurrency": http_only,
            "n_threads": embedded_only,
            "reuse_prefix": embedded_only,
            "cache_control": embedded_only,
            "vllm": (kind == "vllm", "backend 'vllm' (offline)"),
        }
        where = f"backend {kind!r}" + (" with an endpoint" if kind == "llamacpp" and not embedded else "")
        for name in sorted(runtime.model_fields_set):
            ok, scope = applies[name]
            if not ok:
                raise _violation(
                    f"has no effect on {where}",
                    field=f"runtime.{name}",
                    fix=f"remove it; it applies only to {scope}",
                )
        names_key = runtime.api_key_env is not None or kind == "anthropic"
        clear = [url for url in self.urls if _clear_text_remote(url)]
        url_field = "endpoints" if self.endpoints is not None else "endpoint"
        if names_key and clear and not runtime.allow_insecure_key:
            raise _violation(
                f"would send the API key in clear text: {clear[0]} is plain http to a host that is not "
                "loopback",
                field=url_field,
                fix="use an https:// endpoint; on a trusted network only, set allow_insecure_key = true in "
                "this arm's runtime block",
            )
        if runtime.allow_insecure_key:
            url = ", ".join(self.urls) or None
            if not clear:
                raise _violation(
                    f"has no effect: the endpoint {url or '(the provider default)'} is https or loopback",
                    field="runtime.allow_insecure_key",
                    fix="remove it; keys are always sent over https and to loopback hosts",
                )
            if kind in ("vllm-server", "llamacpp") and runtime.api_key_env is None:
                raise _violation(
                    f"has no effect: backend {kind!r} sends no key without api_key_env",
                    field="runtime.allow_insecure_key",
                    fix="remove it, or name the key's variable in runtime.api_key_env",
                )

    @model_validator(mode="after")
    def _check_system(self) -> System:
        self._check_runtime()
        _check_id(self.name, field="name")
        _check_prompt_text(self.preamble, field="preamble")
        if self.endpoint is not None:
            _check_url(self.endpoint, field="endpoint")
        if self.endpoints is not None:
            self._check_endpoints()
        if self.backend == "vllm-server" and not self.urls:
            raise _violation(
                "backend 'vllm-server' needs an endpoint",
                field="endpoint",
                fix="set endpoint = 'http://host:port' (or endpoints = [...] for replicas), or use backend "
                "'vllm' for offline inference",
            )
        if self.backend == "vllm" and self.urls:
            raise _violation(
                "backend 'vllm' runs offline and takes no endpoint",
                field="endpoints" if self.endpoints is not None else "endpoint",
                fix="remove it, or use backend 'vllm-server'",
            )
        return self

    def _check_endpoints(self) -> None:
        endpoints = self.endpoints or []
        if self.endpoint is not None:
            raise _violation(
                "endpoint and endpoints are both set",
                field="endpoints",
                fix="list every server in endpoints (one server: endpoint alone)",
            )
        if not endpoints:
            raise _violation(
                "is empty", field="endpoints", fix="list at least one server, e.g. ['http://127.0.0.1:8000']"
            )
        if len(endpoints) > MAX_ENDPOINTS:
            raise _violation(
                f"lists {len(endpoints)} endpoints ({summarise_urls(endpoints)}), over the limit of "
                f"{MAX_ENDPOINTS} per arm",
                field="endpoints",
                fix=f"list at most {MAX_ENDPOINTS} replicas (put a load balancer in front of more), or split "
                "the run with --shard i/N",
            )
        for i, url in enumerate(endpoints):
            _check_url(url, field=f"endpoints[{i}]")
        seen: dict[str, int] = {}
        for i, url in enumerate(endpoints):
            norm = _url_identity(url)
            if norm in seen:
                raise _violation(
                    f"{url!r} is the same server as endpoints[{seen[norm]}]",
                    field=f"endpoints[{i}]",
                    fix="list each server once",
                )
            seen[norm] = i
        completions = self.backend in ("vllm-server", "llamacpp") or (
            self.backend == "openai" and self.runtime.api == "completions"
        )
        if not completions and self.backend != "vllm":  # offline vLLM: refused below, as for endpoint
            raise _violation(
                f"several endpoints need an OpenAI-compatible /v1/completions backend, not {self.backend!r}"
                + (" with the chat API" if self.backend == "openai" else ""),
                field="endpoints",
                fix="use backend 'vllm-server' or 'llamacpp' (or 'openai' with runtime.api = 'completions'), "
                "or one endpoint (a load balancer in front of the replicas)",
            )


def _check_url(url: str, *, field: str) -> None:
    if not re.match(r"^https?://[^\s/]+", url, re.IGNORECASE):  # HTTP://host is http://host
        raise _violation(
            f"{url!r} is not an http(s) URL",
            field=field,
            fix="give a URL such as 'http://127.0.0.1:8000'",
        )
    if re.match(r"^https?://[^/\s]*@", url) or re.search(r"[?&](api[-_]?key|key|token)=", url, re.IGNORECASE):
        raise _violation(
            "contains credentials",
            field=field,
            fix="remove them; API keys are read from the environment and never written to a spec",
        )


def _url_identity(url: str) -> str:
    """A server URL without the differences that name the same server (case of scheme and host, a
    trailing ``/`` or ``/v1``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{path}"


class BuiltinSuiteRef(_Frozen):
    """The built-in generated suite (:func:`depthgate.spec.suites.builtin_suite`)."""

    kind: Literal["builtin"] = "builtin"
    cases: StrictInt = Field(default=8, ge=1, le=MAX_GENERATED_CASES)
    seed: StrictInt = Field(default=0, ge=0, lt=2**63)
    language: Language = "en"
    # With the `conflict` pattern (two unversioned sources disagree); the first 13 cases are the default
    # suite's, conflict cases come after them. Left out of the matrix digest when false.
    conflict: StrictBool = False


class FileSuiteRef(_Frozen):
    """A suite file: ``format = "suite"`` (JSON of :class:`Suite`) or ``"incidents"`` (JSONL replay).
    When ``format`` is omitted it follows the extension: ``.jsonl`` is incidents, anything else a suite.
    Relative paths are relative to the matrix file."""

    kind: Literal["file"] = "file"
    path: str = Field(min_length=1)
    format: Literal["suite", "incidents"] | None = None

    @property
    def resolved_format(self) -> Literal["suite", "incidents"]:
        if self.format is not None:
            return self.format
        return "incidents" if self.path.endswith(".jsonl") else "suite"


def _suite_ref_tag(value: Any) -> str:
    if isinstance(value, BaseModel):
        return str(getattr(value, "kind", "builtin"))
    if isinstance(value, Mapping):
        if "kind" in value:
            return str(value["kind"])
        return "file" if "path" in value else "builtin"
    return "builtin"


def _parse_suite_shorthand(value: Any) -> Any:
    """``"builtin"``, ``"builtin:8"``, ``"builtin:8:0:en"`` (cases:seed:language) or a path."""
    if isinstance(value, BaseModel | Mapping):
        return value
    if not isinstance(value, str):
        raise _violation(
            f"{value!r} is not a suite reference",
            fix="write a table (kind = 'builtin' with cases, seed, language; or kind = 'file' with path), "
            "'builtin:<cases>:<seed>:<language>' or a path",
        )
    if value == "builtin" or value.startswith("builtin:"):
        parts = value.split(":")[1:]
        if len(parts) > 3 or any(not part for part in parts):
            raise _violation(
                f"cannot parse {value!r}",
                fix="write 'builtin:<cases>:<seed>:<language>', e.g. 'builtin:8:0:en', or a table",
            )
        ref: dict[str, Any] = {"kind": "builtin"}
        for key, part in zip(("cases", "seed", "language"), parts, strict=False):
            if key == "language":
                ref[key] = part
            elif part.isdigit():
                ref[key] = int(part)
            else:
                raise _violation(
                    f"{key} {part!r} in {value!r} is not a number",
                    fix="write 'builtin:<cases>:<seed>:<language>', e.g. 'builtin:8:0:en'",
                )
        return ref
    return {"kind": "file", "path": value}


SuiteRef: TypeAlias = Annotated[
    Annotated[BuiltinSuiteRef, Tag("builtin")] | Annotated[FileSuiteRef, Tag("file")],
    Discriminator(
        _suite_ref_tag,
        custom_error_type="depthgate_suite_ref",
        custom_error_message="suite must be a builtin reference or a file reference",
        custom_error_context={"fix": "use kind = 'builtin' (cases, seed, language) or kind = 'file' (path)"},
    ),
    BeforeValidator(_parse_suite_shorthand),
]


def _parse_position(value: Any) -> Any:
    if isinstance(value, bool):
        raise _violation(f"{value!r} is not a position", fix="give a depth in [0, 1] or '@<token offset>'")
    if isinstance(value, int | float):
        depth = float(value)
        if not 0.0 <= depth <= 1.0:
            raise _violation(
                f"depth {value} is outside [0, 1]",
                fix="give a depth between 0 and 1, or an absolute token offset as '@<int>'",
            )
        return depth
    if isinstance(value, str):
        if not _ABSOLUTE_POSITION.match(value):
            raise _violation(
                f"{value!r} is not a position",
                fix="give a depth in [0, 1] such as 0.5, or an absolute token offset such as '@512'",
            )
        return value
    raise _violation(f"{value!r} is not a position", fix="give a depth in [0, 1] or '@<token offset>'")


Position: TypeAlias = Annotated[float | str, BeforeValidator(_parse_position)]


# Evidence spacing (issue #13 item 5): the token distance between the decisive documents of a
# multi-evidence case. "adjacent" is the block as it always was; the others put filler between the
# decisive documents inside the one moving block (depthgate.layout.layouts; docs/position.md).
SPACING_NAMES: tuple[str, ...] = ("adjacent", "near", "far")
#: "near": a fixed gap of this many tokens between consecutive decisive documents.
NEAR_GAP_TOKENS = 64
#: "far": a gap of this fraction of the layout's total length (rounded), e.g. 410 tokens at 1024.
FAR_GAP_FRACTION = 0.4
#: Joins a position and a non-adjacent spacing in a position label: "0.5~far", "@1200~near", "1~300tok".
SPACING_SEP = "~"
_GAP_LABEL = re.compile(r"^([1-9][0-9]*)tok$")


def _parse_spacing(value: Any) -> Any:
    fix = 'give "adjacent", "near" (64 tokens), "far" (0.4 of the length) or a gap in tokens such as 300'
    if isinstance(value, bool):
        raise _violation(f"{value!r} is not a spacing", fix=fix)
    if isinstance(value, int):
        if value < 1:
            raise _violation(
                f"gap {value} is not a positive number of tokens",
                fix='use "adjacent" for no gap, or a gap of at least 1 token',
            )
        return value
    if isinstance(value, str) and value in SPACING_NAMES:
        return value
    raise _violation(f"{value!r} is not a spacing", fix=fix)


Spacing: TypeAlias = Annotated[str | int, BeforeValidator(_parse_spacing)]


def spacing_label(spacing: str | int) -> str:
    """The label of a spacing in position labels and reports: the name, or ``"<N>tok"`` for a gap."""
    return f"{spacing}tok" if isinstance(spacing, int) else spacing


def spacing_gap(spacing: str | int, length: int) -> int:
    """The nominal gap in tokens between consecutive decisive documents at total ``length`` (a
    spacing value or its label); the gap a layout records is measured (``evidence_gap_tokens``)."""
    label = spacing_label(spacing)
    if label == "adjacent":
        return 0
    if label == "near":
        return NEAR_GAP_TOKENS
    if label == "far":
        return round(FAR_GAP_FRACTION * length)
    match = _GAP_LABEL.match(label)
    if match is None:
        raise ValueError(f"{spacing!r} is not a spacing")
    return int(match.group(1))


def split_position_label(label: str) -> tuple[str, str]:
    """``"0.5~far"`` → ``("0.5", "far")``; ``"0.5"`` → ``("0.5", "adjacent")``. The one place a position
    label is split into its depth/offset part and its evidence spacing."""
    base, sep, spacing = str(label).partition(SPACING_SEP)
    return (base, spacing) if sep else (base, "adjacent")


def is_spacing_label(label: str) -> bool:
    return label in SPACING_NAMES or _GAP_LABEL.match(label) is not None


def spacing_rank(label: str) -> int:
    """Order of spacings in reports: adjacent, near, far, then explicit gaps by size."""
    if label in SPACING_NAMES:
        return SPACING_NAMES.index(label)
    match = _GAP_LABEL.match(label)
    return len(SPACING_NAMES) + (int(match.group(1)) if match else 0)


#: The most canaries per arm, length and kind a matrix may ask for (each is a full-length request).
MAX_CANARIES = 8


class Matrix(_Frozen):
    """A declarative run matrix (``matrices/*.toml``): suite × lengths × positions × repeats, two systems."""

    name: str
    suite: SuiteRef
    lengths: list[StrictInt]
    positions: list[Position]
    # Evidence spacing of multi-evidence cases (issue #13 item 5); the default leaves every layout, id
    # and digest as before (canonical_json leaves it out).
    spacings: list[Spacing] = Field(default_factory=lambda: list[str | int](["adjacent"]))
    repeats: StrictInt = Field(default=1, ge=1, le=MAX_SEEDS)
    # The order requests are sent in: "shuffled" (pairs in a seeded random order) or "haystack" (the
    # pairs of one haystack — case × length × seed — sent together, the haystacks and the pairs inside
    # each shuffled): a server's prefix cache then reuses the shared haystack prefix (docs/nightly.md
    # measures it on vLLM). Left out of the digest when "shuffled", so older run ids stay.
    order: Literal["shuffled", "haystack"] = "shuffled"
    # Full-length canaries (issue #21): per arm, length and kind (head, tail), this many requests whose
    # answer is fixed text at the very start / end of a prompt of the tested length
    # (depthgate.run.canary). 0 (the default) sends none and leaves digests and run ids as before.
    canaries: StrictInt = Field(default=0, ge=0, le=MAX_CANARIES)
    decode: DecodeParams = DecodeParams()
    baseline: System
    candidate: System
    plan: AnalysisPlan = AnalysisPlan()

    @model_validator(mode="after")
    def _check_matrix(self) -> Matrix:
        _check_id(self.name, field="name")
        if not self.lengths:
            raise _violation(
                "must not be empty", field="lengths", fix="list total lengths in tokens, e.g. [1024]"
            )
        for index, length in enumerate(self.lengths):
            if length < 16:
                raise _violation(
                    f"length {length} is too small",
                    field=f"lengths[{index}]",
                    fix="give total prompt lengths in tokens (>= 16), e.g. 1024",
                )
            problem = length_problem(length)
            if problem is not None:
                raise _violation(
                    problem, field=f"lengths[{index}]", fix=f"give lengths of at most {MAX_LENGTH} tokens"
                )
        if len(self.positions) > MAX_POSITIONS:
            raise _violation(
                f"lists {len(self.positions)} positions, over the limit of {MAX_POSITIONS}",
                field="positions",
                fix=f"list at most {MAX_POSITIONS} positions (split the study into several matrices)",
            )
        if len(set(self.lengths)) != len(self.lengths):
            raise _violation("contains a repeated length", field="lengths", fix="list each length once")
        if not self.positions:
            raise _violation(
                "must not be empty", field="positions", fix="list depths, e.g. [0.0, 0.25, 0.5, 0.75, 1.0]"
            )
        if len(set(self.positions)) != len(self.positions):
            raise _violation("contains a repeated position", field="positions", fix="list each position once")
        longest = max(self.lengths)
        for index, position in enumerate(self.positions):
            if isinstance(position, str) and int(position[1:]) >= longest:
                raise _violation(
                    f"offset {position} is beyond the longest length {longest}",
                    field=f"positions[{index}]",
                    fix="use an offset smaller than the lengths, or a depth in [0, 1]",
                )
        if self.repeats != len(self.decode.seeds):
            raise _violation(
                f"repeats = {self.repeats} but decode.seeds has {len(self.decode.seeds)} seed(s)",
                field="repeats",
                fix=f"list one seed per repeat, e.g. decode.seeds = {list(range(self.repeats))}",
            )
        if self.baseline.name == self.candidate.name:
            raise _violation(
                f"baseline and candidate are both named {self.baseline.name!r}",
                field="candidate.name",
                fix="give the two systems different names (an A/A run may otherwise use identical settings)",
            )
        # The slice count is known here: refuse a bootstrap too small to confirm a regression before
        # the plan is frozen and any request is sent.
        self._check_spacings()
        if isinstance(self.suite, BuiltinSuiteRef):
            n_lengths = len(self.built_lengths())
            layouts = self.suite.cases * n_lengths * len(self.position_values())
            if layouts > MAX_LAYOUTS:
                raise _violation(
                    f"{self.suite.cases} cases × {n_lengths} lengths × {len(self.position_values())} "
                    f"positions are {layouts} layouts per arm, over the limit of {MAX_LAYOUTS}",
                    field="lengths",
                    fix="build fewer cases, lengths or positions per matrix (split the study into several)",
                )
        self.plan.raise_violations(n_slices=len(self.lengths) * len(self.position_values()), prefix="plan.")
        return self

    def _check_spacings(self) -> None:
        if not self.spacings:
            raise _violation(
                "must not be empty", field="spacings", fix='list at least one spacing, e.g. ["adjacent"]'
            )
        labels = [spacing_label(s) for s in self.spacings]
        if len(set(labels)) != len(labels):
            raise _violation("contains a repeated spacing", field="spacings", fix="list each spacing once")
        shortest = min(self.lengths)
        for index, spacing in enumerate(self.spacings):
            gap = spacing_gap(spacing, shortest)
            if gap > shortest // 2:
                raise _violation(
                    f"a gap of {gap} tokens cannot fit the length {shortest} (at most half of it, "
                    f"{shortest // 2} tokens)",
                    field=f"spacings[{index}]",
                    fix=f'use a gap of at most {shortest // 2} tokens, "far" (0.4 of the length), or longer '
                    "lengths",
                )
        # An absolute offset puts the start of the evidence block there; the gap must still fit after it
        # at every length (else every such layout would be refused at build, offset_outside_region).
        for p_index, position in enumerate(self.positions):
            if not isinstance(position, str):
                continue
            offset = int(position[1:])
            for index, spacing in enumerate(self.spacings):
                for length in self.lengths:
                    gap = spacing_gap(spacing, length)
                    if gap and offset + gap >= length:
                        raise _violation(
                            f"offset {position} plus the {spacing_label(spacing)} gap of {gap} tokens is "
                            f"beyond the length {length}",
                            field=f"spacings[{index}]",
                            fix=f"move positions[{p_index}] to an offset below {length - gap}, use a "
                            "smaller spacing, or longer lengths",
                        )

    def built_lengths(self) -> list[int]:
        """Every length the run builds and sends: the matrix lengths (the gated grid) and the short
        lengths of NoLiMa's base score (:meth:`AnalysisPlan.short_base_lengths`, never gated)."""
        return sorted(set(self.lengths) | set(self.plan.short_base_lengths()))

    def position_values(self) -> list[str]:
        """The position list the run is built, frozen and gated on: every position at every spacing,
        spacing-major; a non-adjacent spacing joins the position as ``"0.5~far"``. With the default
        spacing this is exactly ``[str(p) for p in positions]``."""
        return [
            str(p) if spacing_label(s) == "adjacent" else f"{p}{SPACING_SEP}{spacing_label(s)}"
            for s in self.spacings
            for p in self.positions
        ]

    def canonical_json(self) -> str:
        """As :meth:`_Frozen.canonical_json`, without ``spacings``, ``order``, ``canaries`` and the
        suite's ``conflict`` when they are the defaults, so matrices written before those fields keep
        their digest (and run ids)."""
        data = self.model_dump(mode="json")
        if data.get("spacings") == ["adjacent"]:
            del data["spacings"]
        if data.get("order") == "shuffled":
            del data["order"]
        if data.get("canaries") == 0:
            del data["canaries"]
        if data["suite"].get("conflict") is False:
            del data["suite"]["conflict"]
        return canonical_json(data)


class SystemRecord(_Frozen):
    """What the manifest binds for one arm."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    name: str
    backend: Backend
    model: str
    system_digest: str
    tokenizer_digest: str
    template_digest: str
    pinned_date: str
    assembler: str
    assembler_version: str
    snapshots: dict[str, dict[str, Any]] | None = None
    """Model folders / ``hf:`` snapshots the tokenizer and template came from (revision, file digests)."""


class RunManifest(_Frozen):
    """Written once, before the first request of a run; every record carries its digest. Binds the
    matrix, the frozen plan, the case set, both systems (model, tokenizer, template, assembler), the
    seed set, the pinned template date and library versions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    manifest_digest: str
    created_at: str
    matrix: str
    matrix_file: str
    matrix_digest: str
    plan_digest: str
    suite_digest: str
    suite: dict[str, Any]
    seeds: list[int]
    decode: dict[str, Any]
    lengths: list[int]
    positions: list[str]
    systems: dict[str, SystemRecord]
    versions: dict[str, str]
    # The analysis plan itself (its digest, with the slice list, is plan_digest); absent in manifests
    # written before the plan was frozen into the run folder.
    plan: dict[str, Any] | None = None
    # Per arm, what decides whether a request is answered the same way twice (engine, version, threads,
    # batch invariance, seeds; depthgate.run.backends.determinism_settings). Not digested.
    determinism: dict[str, dict[str, Any]] | None = None
    # The short lengths built for NoLiMa's base score (issue #24), beside ``lengths`` (the gated grid);
    # absent in manifests of runs that built none (then the base is the evidence-only control).
    base_lengths: list[int] | None = None


# --------------------------------------------------------------------------------------------------------
# Loading: every validation error becomes a SpecError naming the file, the field path and the fix


def _field_path(parts: Sequence[str | int]) -> str:
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith("["):
            path += part
        elif part:
            path += f".{part}" if path else part
    return path


def _default_fix(error: Mapping[str, Any], field: str) -> str:
    kind = str(error["type"])
    last = field.rsplit(".", 1)[-1] if field else "the value"
    ctx = error.get("ctx") or {}
    if "fix" in ctx:
        return str(ctx["fix"])
    if kind == "missing":
        return f"add `{last}`"
    if kind == "extra_forbidden":
        return f"remove `{last}` or correct its spelling (`depthgate schema` lists the allowed fields)"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected', 'the allowed values')}"
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        return f"change `{last}`: {str(error['msg']).lower()}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"change `{last}`: {str(error['msg']).lower()}"
    return f"change `{last}`"


def _case_id_at(data: Any, loc: Sequence[str | int]) -> str:
    """The raw id of the case an error location points into (``cases[i]...``), if it can be read."""
    if len(loc) >= 2 and loc[0] == "cases" and isinstance(loc[1], int) and isinstance(data, Mapping):
        cases = data.get("cases")
        if isinstance(cases, list) and 0 <= loc[1] < len(cases) and isinstance(cases[loc[1]], Mapping):
            return str(cases[loc[1]].get("id", ""))
    return ""


def spec_error_from_validation(
    exc: ValidationError, *, file: str | None, data: Any = None, prefix: Sequence[str | int] = ()
) -> SpecError:
    """Turn a pydantic ValidationError into one SpecError (file, field path, fix; further errors listed)."""
    described: list[tuple[str, str, str]] = []
    for error in exc.errors(include_url=False):
        loc: list[str | int] = [*prefix]
        raw_loc = list(error["loc"])
        for index, part in enumerate(raw_loc):
            # drop the tag a discriminated union adds (suite.builtin.cases -> suite.cases)
            if index > 0 and raw_loc[index - 1] == "suite" and part in ("builtin", "file"):
                continue
            loc.append(part)
        ctx = error.get("ctx") or {}
        if error["type"] == "depthgate_spec":
            field = _field_path([*loc, str(ctx.get("field", ""))])
            case = str(ctx.get("case") or _case_id_at(data, list(error["loc"])))
            message = (f"case '{case}': " if case else "") + str(ctx["detail"])
            described.append((field, message, str(ctx["fix"])))
        else:
            field = _field_path(loc)
            case = _case_id_at(data, list(error["loc"]))
            message = (f"case '{case}': " if case else "") + str(error["msg"])
            described.append((field, message, _default_fix(error, field)))
    field, message, fix = described[0]
    if len(described) > 1:
        others = "; ".join(f"{f or '(root)'}: {m}" for f, m, _ in described[1:6])
        more = f" and {len(described) - 6} more" if len(described) > 6 else ""
        message = f"{message} [also {len(described) - 1} other error(s): {others}{more}]"
    return SpecError(message, file=file, field=field or None, fix=fix)


def parse_spec(model: type[M], data: Any, *, file: str | None = None) -> M:
    """Validate ``data`` as ``model``; any failure is raised as a SpecError naming ``file``, field and fix."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from_validation(exc, file=file, data=data) from exc


def _read_failures(what: str) -> ReadFailures:
    return ReadFailures(
        SpecError,
        missing=(f"{what} file not found", "check the path"),
        unreadable=(f"cannot read {what} file ({{strerror}})", "check the path"),
    )


def load_matrix(path: str | Path) -> Matrix:
    """Read and validate a matrix TOML file. Every error is a SpecError naming the file, field and fix."""
    path = Path(path)
    data = read_toml(path, _read_failures("matrix"))
    return parse_spec(Matrix, data, file=str(path))


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite JSON file (the JSON of :class:`Suite`)."""
    path = Path(path)
    data = read_json(path, _read_failures("suite"))
    return parse_spec(Suite, data, file=str(path))


def schema() -> dict[str, dict[str, Any]]:
    """JSON Schemas of every spec model, by model name."""
    models: list[type[BaseModel]] = [
        Claim,
        EvidenceDoc,
        Distractor,
        Case,
        Suite,
        AnalysisPlan,
        DecodeParams,
        System,
        BuiltinSuiteRef,
        FileSuiteRef,
        Matrix,
        RunManifest,
    ]
    return {model.__name__: model.model_json_schema() for model in models}


__all__ = [
    "FAR_GAP_FRACTION",
    "NEAR_GAP_TOKENS",
    "SPACING_NAMES",
    "SPACING_SEP",
    "SPECIAL_TOKEN_PATTERN",
    "UNIT_SEPARATORS",
    "AnalysisPlan",
    "Backend",
    "BuiltinSuiteRef",
    "Case",
    "Claim",
    "DecodeParams",
    "Distractor",
    "EvidenceDoc",
    "EvidencePattern",
    "EvidenceRole",
    "FileSuiteRef",
    "Language",
    "Matrix",
    "Position",
    "RegressionMethod",
    "Risk",
    "RunManifest",
    "Spacing",
    "StopRule",
    "Suite",
    "SuiteRef",
    "System",
    "SystemRecord",
    "TaskKind",
    "canonical_json",
    "find_special_token",
    "is_spacing_label",
    "load_matrix",
    "load_suite",
    "look_alpha",
    "min_bootstrap_resamples",
    "parse_spec",
    "plan_violations",
    "schema",
    "spacing_gap",
    "spacing_label",
    "spacing_rank",
    "spec_error_from_validation",
    "split_position_label",
    "unit_contract_violation",
]

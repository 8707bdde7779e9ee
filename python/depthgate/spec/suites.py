"""Case suites: the built-in generator, dev/holdout splits, and replay of production incidents.

The generator follows the recipe of research/gemma_position_pilot.md, the one that produced a real
lost-in-the-middle effect on the embedded Gemma-3-270M base model: facts of a fictional company operations
handbook, parameterised by region and value; a *cloze* answer prefix (the answer line repeats the evidence
sentence up to the value); ten distractors with the same sentence template for other regions and values;
the competing evidence (superseded version, general rule) at a fixed per-case depth balanced over
{0.125, 0.375, 0.625, 0.875}; only the decisive evidence moves.

Evidence patterns and fact types:

* ``override``  old policy version + newer version that replaces it; the question asks for the current value
  (hotel_cap, invoice_terms). The strongest position effect in the pilot.
* ``exception`` general rule for all regions + a regional exception (incident_contact, hotel_cap,
  invoice_terms).
* ``single``    one fact: a number with its unit, or a name (hotel_cap, invoice_terms, incident_contact, and
  expense_signoff — at the floor in the pilot, kept as a known-hard control).
* ``order``     one evidence block whose two statements must be read in order (first set to X, later changed
  to Y); the block moves as a whole, so document order never changes meaning.
* ``negation``  one evidence block that rules out a value before stating the right one.
* ``absent``    the asked-for fact is not in the context (only distractors): the system must abstain.
* ``conflict``  two unversioned, undated copies of the handbook state different values of the same fact
  (hotel_cap, invoice_terms, incident_contact); both move together as the evidence block. The system must
  abstain (or flag the disagreement) or give both values (judge/scoring/oracle.py, the conflict rule). Opt-in:
  ``generate_suite(..., conflict=True)``, so the default suites stay byte-identical.

Generation is deterministic (:class:`~depthgate.spec.filler.SplitMix64`, no :mod:`random`) and prefix-stable:
``generate_suite(s, n)`` is the first ``n`` cases of ``generate_suite(s, n + k)``. The ``en`` and ``zh``
suites of one seed are translations of each other, case by case. The first 8 cases are the pilot's smoke set:
override, alternating hotel_cap and invoice_terms.

``conflict=True`` cycles through :data:`_CONFLICT_SCHEDULE` instead of :data:`_SCHEDULE`: the same 20 slots
with 4 conflict slots added (one after every fifth slot). Its first 13 cases (the smoke set and 5 slots) are
those of the default suite. Adding the slots to ``_SCHEDULE`` itself would change every default suite past
case 8 (tests/test_suites.py pins 300-case digests), and an entry past the current cycle would first appear
after several hundred cases.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeAlias

from depthgate.exceptions import SpecError
from depthgate.spec._compat import tomllib
from depthgate.spec.cases import (
    Case,
    Claim,
    Distractor,
    EvidenceDoc,
    EvidencePattern,
    Language,
    Risk,
    Suite,
)
from depthgate.spec.evidence_patterns import evidence_pattern
from depthgate.spec.filler import SplitMix64
from depthgate.spec.incidents import import_incidents
from depthgate.spec.limits import MAX_GENERATED_CASES
from depthgate.spec.loading import load_suite
from depthgate.spec.matrix import BuiltinSuiteRef, FileSuiteRef
from depthgate.spec.mrcr import mrcr_suite

FactType: TypeAlias = Literal["hotel_cap", "invoice_terms", "incident_contact", "expense_signoff"]

#: Depths of the non-moving competing evidence, balanced across the cases of each pattern.
COMPETING_DEPTHS = (0.125, 0.375, 0.625, 0.875)
DISTRACTORS_PER_CASE = 10
SMOKE_CASES = 8


def _data_file(name: str) -> dict[str, Any]:
    """A TOML file of ``depthgate/spec/data``, shipped in the package."""
    return tomllib.loads((resources.files("depthgate.spec") / "data" / name).read_text(encoding="utf-8"))


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"depthgate/spec/data: {where} must be a list of strings")
    return tuple(value)


_NAMES = _data_file("names.toml")
#: (English, Chinese, family slug), from ``data/names.toml``. The en and zh suites of a seed pick the
#: same indices.
REGIONS: tuple[tuple[str, str, str], ...] = tuple(
    (english, chinese, slug)
    for english, chinese, slug in (_strings(row, "regions[]") for row in _NAMES["regions"])
)
NAMES_EN: tuple[str, ...] = _strings(_NAMES["names_en"], "names_en")
NAMES_ZH: tuple[str, ...] = _strings(_NAMES["names_zh"], "names_zh")

HOTEL_RATES = tuple(range(120, 481, 5))  # USD per night
PAYMENT_TERMS = tuple(range(10, 121, 5))  # days
EXPENSE_THRESHOLDS = ("2,000", "5,000", "10,000", "25,000")  # USD

_RISK: dict[str, Risk] = {
    "hotel_cap": "low",
    "invoice_terms": "medium",
    "incident_contact": "high",
    "expense_signoff": "high",
}

# After the smoke set, the generator cycles through these 20 slots: 4 override, 4 exception, 5 single,
# 2 order, 2 negation, 3 evidence-absent. A slot whose (fact type, region, value) space is exhausted is
# skipped.
_SCHEDULE: tuple[tuple[EvidencePattern, FactType], ...] = (
    ("override", "hotel_cap"),
    ("exception", "incident_contact"),
    ("single", "hotel_cap"),
    ("override", "invoice_terms"),
    ("single", "invoice_terms"),
    ("order", "hotel_cap"),
    ("negation", "invoice_terms"),
    ("single", "incident_contact"),
    ("absent", "hotel_cap"),
    ("exception", "hotel_cap"),
    ("override", "hotel_cap"),
    ("exception", "incident_contact"),
    ("single", "invoice_terms"),
    ("override", "invoice_terms"),
    ("order", "invoice_terms"),
    ("negation", "hotel_cap"),
    ("single", "expense_signoff"),
    ("absent", "invoice_terms"),
    ("exception", "invoice_terms"),
    ("absent", "incident_contact"),
)

_CONFLICT_SLOTS: tuple[tuple[EvidencePattern, FactType], ...] = (
    ("conflict", "hotel_cap"),
    ("conflict", "invoice_terms"),
    ("conflict", "incident_contact"),
    ("conflict", "hotel_cap"),
)
#: The schedule of ``generate_suite(..., conflict=True)``: ``_SCHEDULE`` with a conflict slot after every
#: fifth slot (24 slots: 4 of them conflict).
_CONFLICT_SCHEDULE: tuple[tuple[EvidencePattern, FactType], ...] = tuple(
    slot
    for block in range(len(_CONFLICT_SLOTS))
    for slot in (*_SCHEDULE[5 * block : 5 * block + 5], _CONFLICT_SLOTS[block])
)


def _slot(index: int, conflict: bool = False) -> tuple[EvidencePattern, FactType]:
    if index < SMOKE_CASES:
        return ("override", "hotel_cap" if index % 2 == 0 else "invoice_terms")
    schedule = _CONFLICT_SCHEDULE if conflict else _SCHEDULE
    return schedule[(index - SMOKE_CASES) % len(schedule)]


# --------------------------------------------------------------------------------------------------------
# Sentences: the templates of data/sentences_en.toml and data/sentences_zh.toml, one table per fact type.
# Each fact type has a stem that ends right before the value (the cloze), in both languages.


@dataclass(frozen=True)
class _Value:
    """A value in language-neutral form: a number, or an index into the name pools."""

    number: int | None = None
    name: int | None = None

    def key(self) -> str:
        return f"n{self.number}" if self.number is not None else f"p{self.name}"


_Templates: TypeAlias = dict[str, dict[str, str | tuple[str, ...]]]


@functools.cache
def _sentence_templates(language: Language) -> _Templates:
    """Fact type -> template name -> template (a list of templates for ``aliases``)."""
    return {
        fact: {
            key: template if isinstance(template, str) else _strings(template, f"{fact}.{key}")
            for key, template in table.items()
        }
        for fact, table in _data_file(f"sentences_{language}.toml").items()
    }


class _Writer:
    """Renders the sentences of one language: templates looked up by (fact type, template name), filled in
    with :meth:`str.format`."""

    def __init__(self, language: Language) -> None:
        self.language = language
        self.templates = _sentence_templates(language)
        self.column = 1 if language == "zh" else 0
        self.names = NAMES_ZH if language == "zh" else NAMES_EN

    def region(self, index: int) -> str:
        return REGIONS[index][self.column]

    def value(self, value: _Value) -> str:
        return self.names[value.name] if value.name is not None else str(value.number)

    def _template(self, fact: FactType, key: str) -> str:
        template = self.templates[fact][key]
        if not isinstance(template, str):
            raise TypeError(f"sentences_{self.language}.toml: {fact}.{key} must be a string")
        return template

    def sentence(
        self,
        fact: FactType,
        key: str,
        *,
        region: int | None = None,
        value: _Value | None = None,
        old: _Value | None = None,
        new: _Value | None = None,
        threshold: str = "",
        **numbers: int,
    ) -> str:
        """The template ``key`` of ``fact`` with its fields filled in (unused fields are ignored)."""
        fields: dict[str, object] = {"threshold": threshold, **numbers}
        if region is not None:
            fields["region"] = self.region(region)
        for field, item in (("value", value), ("old", old), ("new", new)):
            if item is not None:
                fields[field] = self.value(item)
        return self._template(fact, key).format(**fields)

    def unit(self, fact: FactType) -> str | None:
        return self._template(fact, "unit") if "unit" in self.templates[fact] else None

    def aliases(self, fact: FactType, value: _Value) -> list[str]:
        templates = self.templates[fact]["aliases"]
        if isinstance(templates, str):
            raise TypeError(f"sentences_{self.language}.toml: {fact}.aliases must be a list")
        text = self.value(value)
        surname = text.split(" ", 1)[-1]  # surnames ("de Vries") are unique within the name pool
        return [template.format(value=text, surname=surname) for template in templates]

    def question(self, fact: FactType, region: int, threshold: str = "", current: bool = False) -> str:
        """The question; ``current``: its current-policy form, if the fact type has one."""
        key = "current_question" if current and "current_question" in self.templates[fact] else "question"
        return self.sentence(fact, key, region=region, threshold=threshold)

    def answer_prefix(self, fact: FactType, region: int, threshold: str = "", current: bool = False) -> str:
        """The cloze: the plain sentence up to the value, or its current-policy form."""
        key = (
            "current_answer_prefix" if current and "current_answer_prefix" in self.templates[fact] else "stem"
        )
        return self.sentence(fact, key, region=region, threshold=threshold)

    def claim_text(self, prefix: str, fact: FactType, value: _Value) -> str:
        """A cloze completed with ``value``."""
        return prefix + self.sentence(fact, "completion", value=value)

    def fact(self, fact: FactType, region: int, value: _Value, threshold: str = "") -> str:
        """The plain fact sentence (no leading separator): the stem completed with ``value``."""
        return self.claim_text(self.sentence(fact, "stem", region=region, threshold=threshold), fact, value)


# --------------------------------------------------------------------------------------------------------
# The generator


def _values(fact: FactType) -> list[_Value]:
    if fact == "hotel_cap":
        return [_Value(number=n) for n in HOTEL_RATES]
    if fact == "invoice_terms":
        return [_Value(number=n) for n in PAYMENT_TERMS]
    return [_Value(name=i) for i in range(len(NAMES_EN))]


class _Generator:
    """Sequential, prefix-stable case generation. Everything it decides depends on earlier cases only."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.used: set[tuple[str, int, str]] = set()  # (fact type, region, value key); "" for absent
        self.region_orders: dict[str, list[int]] = {}
        self.region_pointer: dict[str, int] = {}
        self.competing_count: dict[str, int] = {}

    def _region_cycle(self, fact: str) -> Iterator[int]:
        """Regions in a per-(seed, fact) shuffled cycle, starting where the last case of this fact stopped."""
        if fact not in self.region_orders:
            order = list(range(len(REGIONS)))
            SplitMix64("depthgate/suite/regions/v1", self.seed, fact).shuffle(order)
            self.region_orders[fact] = order
            self.region_pointer[fact] = 0
        order = self.region_orders[fact]
        start = self.region_pointer[fact]
        for step in range(len(order)):
            self.region_pointer[fact] = (start + step + 1) % len(order)
            yield order[(start + step) % len(order)]

    def competing_depth(self, pattern: str) -> float:
        count = self.competing_count.get(pattern, 0)
        self.competing_count[pattern] = count + 1
        block = list(COMPETING_DEPTHS)
        SplitMix64("depthgate/suite/competing/v1", self.seed, pattern, count // len(block)).shuffle(block)
        return block[count % len(block)]

    def draw(self, index: int, pattern: EvidencePattern, fact: FactType) -> _Draw | None:
        """Region, values and distractors of case ``index``, or None if this slot's space is exhausted."""
        rng = SplitMix64("depthgate/suite/case/v1", self.seed, index)
        values = _values(fact)
        kind = evidence_pattern(pattern)
        for region in self._region_cycle(fact):
            if kind.decisive == "none":
                if (fact, region, "") in self.used:
                    continue
                answer = None
            else:
                free = [v for v in values if (fact, region, v.key()) not in self.used]
                if not free:
                    continue
                answer = rng.choice(free)
            others = [v for v in values if answer is None or v.key() != answer.key()]
            # the superseded, general or ruled-out value; for a conflict, the second source's value
            picked = rng.sample(others, DISTRACTORS_PER_CASE + (1 if kind.second_value else 0))
            old = picked.pop() if kind.second_value else None
            other_regions = [r for r in range(len(REGIONS)) if r != region]
            threshold_index = rng.below(len(EXPENSE_THRESHOLDS))
            if fact == "expense_signoff":
                # two hard distractors: same region, another threshold (pilot §3)
                hard = [t for t in range(len(EXPENSE_THRESHOLDS)) if t != threshold_index]
                hard_thresholds = rng.sample(hard, 2)
                distractor_regions = [region, region, *rng.sample(other_regions, DISTRACTORS_PER_CASE - 2)]
                distractor_thresholds = [*hard_thresholds, *[threshold_index] * (DISTRACTORS_PER_CASE - 2)]
                order = list(range(DISTRACTORS_PER_CASE))
                rng.shuffle(order)
                distractor_regions = [distractor_regions[i] for i in order]
                distractor_thresholds = [distractor_thresholds[i] for i in order]
            else:
                distractor_regions = rng.sample(other_regions, DISTRACTORS_PER_CASE)
                distractor_thresholds = [threshold_index] * DISTRACTORS_PER_CASE
            self.used.add((fact, region, answer.key() if answer is not None else ""))
            version = 2 + rng.below(5)
            year = 2019 + rng.below(5)
            return _Draw(
                region=region,
                answer=answer,
                old=old,
                distractor_values=picked,
                distractor_regions=distractor_regions,
                distractor_thresholds=distractor_thresholds,
                threshold=threshold_index,
                version=version,
                year_old=year,
                year_new=year + 1 + rng.below(2),
                competing_depth=self.competing_depth(pattern) if kind.competing else None,
            )
        return None


@dataclass(frozen=True)
class _Draw:
    region: int
    answer: _Value | None
    old: _Value | None
    distractor_values: list[_Value]
    distractor_regions: list[int]
    distractor_thresholds: list[int]
    threshold: int
    version: int
    year_old: int
    year_new: int
    competing_depth: float | None


def _claim(writer: _Writer, claim_id: str, prefix: str, fact: FactType, value: _Value, **extra: Any) -> Claim:
    return Claim(
        id=claim_id,
        text=writer.claim_text(prefix, fact, value),
        aliases=writer.aliases(fact, value),
        value=writer.value(value),
        unit=writer.unit(fact),
        **extra,
    )


def _claims(
    pattern: EvidencePattern, fact: FactType, draw: _Draw, writer: _Writer, prefix: str
) -> tuple[list[Claim], list[Claim]]:
    """The required and forbidden claims of a case (before its distractors' forbidden claims)."""
    answer, old = draw.answer, draw.old
    required: list[Claim] = []
    forbidden: list[Claim] = []
    if answer is not None:
        required.append(_claim(writer, "answer", prefix, fact, answer))
    kind = evidence_pattern(pattern)
    if kind.scoring == "conflict" and answer is not None and old is not None:
        # two required claims, one per source; the oracle passes both values or an abstention
        required = [
            _claim(writer, f"source_{letter}", prefix, fact, value)
            for letter, value in (("a", answer), ("b", old))
        ]
    elif old is not None:
        claim_id = "competing" if kind.competing else "ruled_out"
        forbidden.append(_claim(writer, claim_id, prefix, fact, old, severity="wrong"))
    return required, forbidden


def _override_evidence(case_id: str, fact: FactType, draw: _Draw, writer: _Writer) -> list[EvidenceDoc]:
    assert draw.answer is not None and draw.old is not None
    region, version = draw.region, draw.version
    old_text = writer.sentence(
        fact, "override", region=region, value=draw.old, version=version, year=draw.year_old
    )
    new_text = writer.sentence(
        fact,
        "override_replacing",
        region=region,
        value=draw.answer,
        version=version + 1,
        previous_version=version,
        year=draw.year_new,
    )
    return [
        EvidenceDoc(
            id=f"{case_id}/v{version}",
            version=str(version),
            text=" " + old_text,
            supports=["competing"],
            role="competing",
        ),
        EvidenceDoc(
            id=f"{case_id}/v{version + 1}", version=str(version + 1), text=" " + new_text, supports=["answer"]
        ),
    ]


def _evidence(
    case_id: str, pattern: EvidencePattern, fact: FactType, draw: _Draw, writer: _Writer, threshold: str
) -> list[EvidenceDoc]:
    """The evidence documents of a case, by its evidence pattern (none for ``absent``): the built-in
    suite's own wording of each pattern it schedules. A pattern registered elsewhere
    (:mod:`depthgate.spec.evidence_patterns`) comes in suites of its own and never reaches here."""
    region, answer, old = draw.region, draw.answer, draw.old
    if answer is None:
        return []
    if pattern == "single":
        text = writer.fact(fact, region, answer, threshold)
        return [EvidenceDoc(id=f"{case_id}/evidence", text=" " + text, supports=["answer"])]
    if old is None:
        return []
    if pattern == "override":
        return _override_evidence(case_id, fact, draw, writer)
    if pattern == "exception":
        return [
            EvidenceDoc(
                id=f"{case_id}/general",
                text=" " + writer.sentence(fact, "general_rule", value=old),
                supports=["competing"],
                role="competing",
            ),
            EvidenceDoc(
                id=f"{case_id}/exception",
                text=" " + writer.sentence(fact, "exception", region=region, value=answer),
                supports=["answer"],
            ),
        ]
    if pattern == "order":
        year = min(draw.year_new, 2025)
        text = writer.sentence(fact, "order", region=region, old=old, new=answer, year=year)
        return [EvidenceDoc(id=f"{case_id}/history", text=" " + text, supports=["answer"])]
    if pattern == "conflict":
        return [
            EvidenceDoc(
                id=f"{case_id}/source-{letter}",
                text=" " + writer.sentence(fact, f"conflict_{letter}", region=region, value=value),
                supports=[f"source_{letter}"],
            )
            for letter, value in (("a", answer), ("b", old))
        ]
    if pattern == "negation":
        text = writer.sentence(fact, "negation", region=region, old=old, new=answer)
        return [EvidenceDoc(id=f"{case_id}/evidence", text=" " + text, supports=["answer"])]
    return []


def _distractors(
    case_id: str, fact: FactType, draw: _Draw, writer: _Writer
) -> tuple[list[Distractor], list[Claim]]:
    """The distractors of a case and the forbidden claim of each (its value is a wrong answer)."""
    distractors: list[Distractor] = []
    forbidden: list[Claim] = []
    for number, (value, d_region, d_threshold) in enumerate(
        zip(draw.distractor_values, draw.distractor_regions, draw.distractor_thresholds, strict=True), start=1
    ):
        d_threshold_text = EXPENSE_THRESHOLDS[d_threshold]
        sentence = writer.fact(fact, d_region, value, d_threshold_text)
        distractors.append(Distractor(id=f"{case_id}/d{number:02d}", text=" " + sentence))
        forbidden.append(
            Claim(
                id=f"distractor_{number:02d}",
                text=sentence,
                aliases=writer.aliases(fact, value),
                value=writer.value(value),
                unit=writer.unit(fact),
                severity="wrong",
            )
        )
    return distractors, forbidden


def _expected(
    pattern: EvidencePattern, fact: FactType, draw: _Draw, writer: _Writer, threshold: str
) -> dict[str, str]:
    expected: dict[str, str] = {"region": writer.region(draw.region)}
    unit = writer.unit(fact)
    if evidence_pattern(pattern).scoring == "conflict":  # an abstention or every value passes: no one value
        if unit is not None:
            expected["unit"] = unit
    elif draw.answer is not None:
        expected["value"] = writer.value(draw.answer)
        if unit is not None:
            expected["unit"] = unit
    else:
        expected["value"] = ""
        expected["abstain"] = "true"
    if fact == "expense_signoff":
        expected["threshold"] = writer.sentence(fact, "threshold", threshold=threshold)
    return expected


def _build_case(case_id: str, pattern: EvidencePattern, fact: FactType, draw: _Draw, writer: _Writer) -> Case:
    threshold = EXPENSE_THRESHOLDS[draw.threshold]
    kind = evidence_pattern(pattern)
    current = kind.asks_current
    query = writer.question(fact, draw.region, threshold, current=current)
    prefix = writer.answer_prefix(fact, draw.region, threshold, current=current)
    required, forbidden = _claims(pattern, fact, draw, writer, prefix)
    distractors, distractor_claims = _distractors(case_id, fact, draw, writer)
    return Case(
        id=case_id,
        kind=kind.task,
        evidence_pattern=pattern,
        language=writer.language,
        risk=_RISK[fact],
        query=query,
        answer_prefix=prefix,
        evidence=_evidence(case_id, pattern, fact, draw, writer, threshold),
        distractors=distractors,
        required_claims=required,
        forbidden_claims=forbidden + distractor_claims,
        expected_fields=_expected(pattern, fact, draw, writer, threshold),
        abstain_when_absent=True,
        family=f"{fact}:{REGIONS[draw.region][2]}",
        competing_depth=draw.competing_depth,
    )


def _check_language(language: str) -> Language:
    if language == "en":
        return "en"
    if language == "zh":
        return "zh"
    raise SpecError(f"unknown suite language {language!r}", field="language", fix="use 'en' or 'zh'")


def _check_non_negative(value: int, field: str, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{value!r} is not a valid {field}", field=field, fix=f"give an integer >= {minimum}")


def generate_suite(
    seed: int, n_cases: int, language: Language | str = "en", *, conflict: bool = False
) -> Suite:
    """``n_cases`` generated cases (see the module docstring). Deterministic and prefix-stable.
    ``conflict``: add conflict cases (two sources disagree) to the schedule; the suite is named
    ``generated-<lang>-s<seed>-conflict``."""
    _check_non_negative(seed, "seed")
    _check_non_negative(n_cases, "n_cases", minimum=1)
    if n_cases > MAX_GENERATED_CASES:
        raise SpecError(
            f"{n_cases} cases is over the limit of {MAX_GENERATED_CASES} distinct cases one seed generates",
            field="n_cases",
            fix=f"ask for at most {MAX_GENERATED_CASES} cases, or combine the suites of several seeds",
        )
    lang = _check_language(language)
    writer = _Writer(lang)
    generator = _Generator(seed)
    cases: list[Case] = []
    slot = 0
    misses = 0
    while len(cases) < n_cases:
        pattern, fact = _slot(slot, conflict)
        slot += 1
        index = len(cases)
        draw = generator.draw(index, pattern, fact)
        if draw is None:
            misses += 1
            if misses > len(_CONFLICT_SCHEDULE if conflict else _SCHEDULE) + SMOKE_CASES:
                raise SpecError(
                    f"cannot generate {n_cases} distinct cases from one seed (stopped at {len(cases)})",
                    field="n_cases",
                    fix="ask for fewer cases, or combine the suites of several seeds",
                )
            continue
        misses = 0
        case_id = f"{lang}-s{seed}-{index:04d}-{pattern}-{fact}"
        cases.append(_build_case(case_id, pattern, fact, draw, writer))
    name = f"generated-{lang}-s{seed}" + ("-conflict" if conflict else "")
    return Suite(name=name, seed=seed, language=lang, cases=cases)


def builtin_suite(
    n_cases: int = SMOKE_CASES, seed: int = 0, language: Language | str = "en", *, conflict: bool = False
) -> Suite:
    """The built-in suite: the first ``n_cases`` generated cases (the default 8 are the pilot's smoke set);
    ``conflict``: with conflict cases (:func:`generate_suite`)."""
    suite = generate_suite(seed, n_cases, language, conflict=conflict)
    name = f"builtin-{suite.language}-s{seed}-n{n_cases}" + ("-conflict" if conflict else "")
    return suite.model_copy(update={"name": name})


# --------------------------------------------------------------------------------------------------------
# Splits


def split_suite(suite: Suite, holdout_fraction: float, seed: int) -> tuple[Suite, Suite]:
    """Split into (dev, holdout) by document family, so a family never spans both splits.

    Families are taken in the order of ``sha256(seed, family)`` into the holdout until it holds at least
    ``round(holdout_fraction * len(cases))`` cases (at least one family). Case order is preserved.
    """
    if isinstance(holdout_fraction, bool) or not isinstance(holdout_fraction, int | float):
        raise SpecError(
            f"{holdout_fraction!r} is not a fraction", field="holdout_fraction", fix="give 0 < f < 1"
        )
    if not 0.0 < holdout_fraction < 1.0:
        raise SpecError(
            f"holdout fraction {holdout_fraction} is outside (0, 1)",
            field="holdout_fraction",
            fix="give a fraction strictly between 0 and 1, e.g. 0.3",
        )
    _check_non_negative(seed, "seed")
    sizes: dict[str, int] = {}
    for case in suite.cases:
        sizes[case.family] = sizes.get(case.family, 0) + 1
    if len(sizes) < 2:
        raise SpecError(
            f"suite {suite.name!r} has a single document family; it cannot be split",
            field="family",
            fix="give the cases more than one family",
        )

    def rank(family: str) -> str:
        return hashlib.sha256(f"depthgate/split/v1\x1f{seed}\x1f{family}".encode()).hexdigest()

    target = max(1, round(holdout_fraction * len(suite.cases)))
    holdout_families: set[str] = set()
    taken = 0
    for family in sorted(sizes, key=rank):
        if taken >= target or len(holdout_families) == len(sizes) - 1:
            break
        holdout_families.add(family)
        taken += sizes[family]
    dev = [case for case in suite.cases if case.family not in holdout_families]
    holdout = [case for case in suite.cases if case.family in holdout_families]
    return (
        suite.model_copy(update={"name": f"{suite.name}/dev", "cases": dev}),
        suite.model_copy(update={"name": f"{suite.name}/holdout", "cases": holdout}),
    )


def resolve_suite(ref: BuiltinSuiteRef | FileSuiteRef, *, base_dir: str | Path | None = None) -> Suite:
    """The suite a matrix refers to; relative paths resolve against ``base_dir``, the matrix dir."""
    if isinstance(ref, BuiltinSuiteRef) and ref.pattern == "mrcr":
        assert ref.needles is not None and ref.k is not None  # BuiltinSuiteRef's validation
        return mrcr_suite(ref.cases, ref.seed, needles=ref.needles, k=ref.k, language=ref.language)
    if isinstance(ref, BuiltinSuiteRef):
        return builtin_suite(ref.cases, ref.seed, ref.language, conflict=ref.conflict)
    path = Path(ref.path)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if ref.resolved_format == "incidents":
        return import_incidents(path)
    return load_suite(path)


__all__ = [
    "COMPETING_DEPTHS",
    "DISTRACTORS_PER_CASE",
    "REGIONS",
    "SMOKE_CASES",
    "FactType",
    "builtin_suite",
    "generate_suite",
    "resolve_suite",
    "split_suite",
]

"""Deterministic scoring of model outputs against their cases (DESIGN.md §5, §7).

One output is scored by :func:`score`, a frame of records by :func:`score_records`. Nothing here calls a
model or a network: the same output and case always give the same :class:`Score`.

The answer rule
===============

The embedded default is a *base* model prompted with a cloze answer prefix ("... in region China is"), so
its output is a continuation such as ``" 245 USD per night."``, and a base model often keeps copying the
document after its answer (``" 245 USD per night. The maximum hotel rate ... is 300 USD per night."``).
The oracle therefore reads the output the way the pilot did (research/gemma_position_pilot.md §3):

1. Only the **answer line** is scored: the first non-blank line of the output. (With the default stop
   string ``"\\n"`` this is the whole output; leading blank lines carry no answer and are skipped.)
2. The line is normalised: Unicode NFKC, casefold, typographic apostrophes to ``'``, thousands separators
   dropped inside numbers (``"1,200"`` → ``"1200"``, also the full-width ``"１，２００"``), whitespace
   collapsed, punctuation stripped at the edges. Claim surface forms (aliases, text, value) get the same
   normalisation.
3. **The first value-like token decides.** The oracle finds, in order of appearance, every *event* of the
   line: a number (when the case has numeric claims: every number is an event, e.g. ``245`` in
   ``"USD 245"``, ``"245 dollars"`` or ``"$245"``, compared by value with each claim's ``value``), a surface
   form of a required or forbidden claim (its aliases, text and value; this is how names are found: the
   pilot's "earliest candidate name"), or an abstention phrase (``"not stated"``, ``"未提及"`` ...). The
   earliest event is *the answer*; a longer match wins a tie at the same start.

   * the answer is a required claim → that claim is matched (a case with several required claims needs
     every one of them somewhere in the line, and none of its forbidden claims before the first of them);
   * the answer is a forbidden claim (a superseded version, a general rule overridden by an exception, a
     ruled-out value, a distractor's value) → fail, the claim named in ``forbidden_hits``; **and safety**
     when the claim's ``severity`` is "safety" (a leak or prohibited statement). The built-in suite marks
     superseded and distractor values "wrong": answering them is a position failure, not a safety event;
   * the answer is another number, or a number whose adjacent unit contradicts the claim's unit
     (``"245 days"`` for a rate in USD) → fail, no safety;
   * the answer is an abstention → ``abstained``; a pass on an evidence-absent case, a fail otherwise.

   A forbidden value *after* the answer in the same line (the model copying the next sentence on) is
   **not** a safety hit: only what the model gave as its answer counts. A forbidden value given as the
   answer always is.
4. On an evidence-absent case (no required claims, ``abstain_when_absent``), an abstention passes; a value
   fails with the reason "hallucinated"; anything else fails as "did not abstain".
5. On a **conflict** case (``evidence_pattern = "conflict"``: two or more unversioned sources state
   different values of the same fact, none supersedes another; one required claim per source) every value
   given as the answer counts, not only the first: the values of the line up to the end of the sentence
   that holds the last required claim (without one, the sentence of the first event; what follows is the
   copied-on continuation). The answer passes when it gives **every** conflicting value and no other
   (``"245 or 300 USD per night"``), or **no value** and an abstention or a flag of the disagreement
   (:data:`CONFLICT_PHRASES`: ``"the sources disagree"``, ``"不一致"`` ...; they count on conflict cases
   only). One value fails with the other source's claim in ``missing_claims``; a further value fails with
   it named (``forbidden_hits`` for a forbidden claim). The rule follows from the pattern: no other case
   field is involved, and case validation refuses conflict cases that set ``expected_fields`` ``value``
   or ``abstain``.
   On an **MRCR** case (``evidence_pattern = "mrcr"``, spec/mrcr.py) the answer line passes when it holds
   the asked (k-th) reply's code and no other reply's code anywhere (judge/scoring/mrcr.py).
6. **Citations** anywhere in the output (``[doc-id]``, ``[a, b]``, ``(source: doc-id)``, ``（来源：doc-id）``)
   are checked against the evidence in the layout: citing an id that is not evidence in the layout, or a
   distractor's id, is a wrong citation and fails the run (no safety). Bracketed text counts as a citation
   when it is a known document id, or looks like one (an id with a digit or one of ``- _ / . : @``), so
   ``"[sic]"`` is not a citation while ``"[1]"`` and ``"[doc-7]"`` are.
7. **Expected fields** match exactly after normalisation. A JSON object output (``{"value": ..., ...}``) is
   compared field by field, and its ``answer`` (or ``value``) string is the answer line. In free text only
   ``value`` (the decided answer) and ``abstain`` are observable; fields that a cloze continuation cannot
   contain (``region``, ``threshold``) are not checked.

Statuses: ``"ok"`` is scored as above; ``"system_fail"`` (context overflow, template error, truncation,
timeout, refusal by the serving stack) is outcome ``"system_fail"``, a fail in the gate, never missing;
``"infra_error"`` (or ``"missing"``) is outcome ``"missing"``. A system failure's output is not read, so
it never sets the safety flag.

Known limits: numbers are digits (no number words, no Chinese numerals); a chat-style answer that repeats a
version number or year before the value is decided by that earlier number, exactly as the pilot scored it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, TypeAlias

import polars as pl

from depthgate.exceptions import InputError
from depthgate.judge.scoring.answer_text import (
    CITATION_BRACKET,
    CITATION_SOURCE,
    CITATION_SPLIT,
    ID_LIKE,
    ID_MARK,
    NUMBER_PATTERN,
    SENTENCE_END,
    answer_line,
    describe_line,
    extract_citations,
    find_word,
    join_sentence,
    json_object,
    normalize,
    parse_number,
    same_value,
    unit_after,
    unit_family,
)
from depthgate.judge.scoring.mrcr import judge_mrcr
from depthgate.judge.tables import require_columns
from depthgate.spec.cases import Case, Claim, Suite

Outcome: TypeAlias = Literal["pass", "fail", "system_fail", "missing"]

STATUS_OK = "ok"
STATUS_SYSTEM_FAIL = "system_fail"
STATUS_INFRA_ERROR = "infra_error"
_MISSING_STATUSES = frozenset({STATUS_INFRA_ERROR, "missing"})

#: Columns :func:`score_records` reads from the records frame.
RECORD_COLUMNS = (
    "arm",
    "layout_id",
    "case_id",
    "target_tokens",
    "position",
    "seed",
    "status",
    "system_fail_reason",
    "output_text",
)
#: Columns :func:`score_records` adds.
SCORE_COLUMNS = (
    "outcome",
    "safety",
    "missing_claims",
    "forbidden_hits",
    "wrong_citations",
    "abstained",
    "field_mismatches",
    "score_reason",
)

# Phrases that mean "the context does not say". Normalised form (casefolded); CJK phrases match anywhere,
# the others at word boundaries. "没有" is broad on purpose: as the *first* event of an answer line it is an
# abstention ("没有提及", "没有规定"); after a value it is never reached.
ABSTAIN_PHRASES: tuple[str, ...] = (
    "not stated",
    "not mentioned",
    "not specified",
    "not provided",
    "not given",
    "not listed",
    "not found",
    "not available",
    "not known",
    "not in the context",
    "not in the document",
    "not in the documents",
    "not in the handbook",
    "no information",
    "no info",
    "no data",
    "no mention",
    "no answer",
    "cannot be determined",
    "can not be determined",
    "can't be determined",
    "cannot determine",
    "can't determine",
    "unable to determine",
    "cannot be answered",
    "cannot answer",
    "can't answer",
    "cannot say",
    "can't say",
    "does not say",
    "doesn't say",
    "does not state",
    "doesn't state",
    "does not specify",
    "doesn't specify",
    "does not mention",
    "doesn't mention",
    "i don't know",
    "i do not know",
    "don't know",
    "unknown",
    "unclear",
    "unspecified",
    "n/a",
    "none",
    "未提及",
    "未提到",
    "没有提及",
    "没有提到",
    "未说明",
    "没有说明",
    "未规定",
    "没有规定",
    "未注明",
    "未列出",
    "未给出",
    "没有给出",
    "未知",
    "不详",
    "不知道",
    "不清楚",
    "无法确定",
    "不能确定",
    "无法得知",
    "无从得知",
    "无法回答",
    "无相关",
    "无信息",
    "没有相关",
    "文中未",
    "没有",
)

# On a conflict case (two sources disagree) these flag the disagreement; they count as an abstention there
# and nowhere else.
CONFLICT_PHRASES: tuple[str, ...] = (
    "the sources disagree",
    "sources disagree",
    "sources differ",
    "disagree",
    "disagreement",
    "conflict",
    "conflicts",
    "conflicting",
    "contradict",
    "contradicts",
    "contradictory",
    "inconsistent",
    "discrepancy",
    "不一致",
    "相互矛盾",
    "矛盾",
    "冲突",
    "说法不一",
)

# --------------------------------------------------------------------------------------------------------
# Score


@dataclass(frozen=True)
class Score:
    """The oracle's verdict on one output.

    ``outcome``: "pass", "fail", "system_fail" (a fail caused by the system, never missing) or "missing"
    (infrastructure error). ``safety``: a forbidden claim was given as the answer. ``missing_claims``:
    required claim ids not matched. ``forbidden_hits``: forbidden claim ids given as the answer.
    ``wrong_citations``: cited ids that are not evidence in the layout, or are distractors.
    ``field_mismatches``: ``"field: expected 'x', got 'y'"`` per mismatching expected field. ``reason``:
    one sentence saying why. ``answer``: the decisive token as read (normalised), or None.
    """

    outcome: Outcome
    safety: bool = False
    missing_claims: list[str] = field(default_factory=list)
    forbidden_hits: list[str] = field(default_factory=list)
    wrong_citations: list[str] = field(default_factory=list)
    abstained: bool = False
    field_mismatches: list[str] = field(default_factory=list)
    reason: str = ""
    answer: str | None = None


EventKind: TypeAlias = Literal["required", "forbidden", "abstain", "other"]
_KIND_ORDER: dict[str, int] = {"required": 0, "forbidden": 1, "abstain": 2, "other": 3}


@dataclass(frozen=True)
class _Event:
    start: int
    end: int
    kind: EventKind
    claim_id: str | None
    token: str
    note: str = ""
    unit: str | None = None  # unit family of the word after a number ("currency", "days")


@dataclass(frozen=True)
class _ClaimForms:
    claim_id: str
    kind: EventKind
    display: str  # the claim's value (or first alias, or text) for reasons
    forms: tuple[str, ...]  # normalised surface forms, longest first
    number: Decimal | None
    unit: str | None
    unit_family: str | None


def _claim_forms(claim: Claim, kind: EventKind) -> _ClaimForms:
    raw: list[str] = [*claim.aliases, claim.text]
    if claim.value:
        raw.append(claim.value)
        if claim.unit:
            raw += [f"{claim.value} {claim.unit}", f"{claim.unit} {claim.value}"]
    forms = sorted({normalize(text) for text in raw} - {""}, key=lambda s: (-len(s), s))
    number = parse_number(normalize(claim.value)) if claim.value else None
    display = claim.value or (claim.aliases[0] if claim.aliases else claim.text)
    return _ClaimForms(claim.id, kind, display, tuple(forms), number, claim.unit, unit_family(claim.unit))


def _status_score(status: str, system_fail_reason: str | None) -> Score | None:
    """The score of a run whose output is not scored (a system failure, an infrastructure error), None
    for an ok run; refuses an unknown status."""
    if status == STATUS_SYSTEM_FAIL:
        why = system_fail_reason or "unspecified"
        return Score(
            outcome="system_fail",
            reason=f"system failure ({why}): the run counts as a fail, its output is not scored.",
        )
    if status in _MISSING_STATUSES:
        why = f" ({system_fail_reason})" if system_fail_reason else ""
        return Score(
            outcome="missing",
            reason=f"infrastructure error{why}: no usable output, the run is missing.",
        )
    if status != STATUS_OK:
        raise InputError(
            f"unknown record status {status!r}",
            field="status",
            fix=f"use {STATUS_OK!r}, {STATUS_SYSTEM_FAIL!r} or {STATUS_INFRA_ERROR!r}",
        )
    return None


def _judge_abstention(head: _Event | None, abstained: bool, raw_line: str, problems: list[str]) -> str:
    """An evidence-absent case: the note of a correct abstention, else the problem added to ``problems``."""
    if abstained:
        token = f" ({head.token!r})" if head is not None and head.kind == "abstain" else ""
        return f"abstained{token} as required: the context does not state the answer"
    elif head is not None and head.kind == "forbidden":
        problems.append(
            f"hallucinated: answered {head.token!r} (forbidden claim {head.claim_id!r}) although the "
            "context does not state the answer"
        )
    elif head is not None and head.kind in ("other", "required"):
        problems.append(
            f"hallucinated: answered {head.token!r} although the context does not state the answer"
        )
    else:
        problems.append(f"did not abstain: {describe_line(raw_line)} on an evidence-absent case")
    return ""


class CaseOracle:
    """The compiled oracle of one case: normalised surface forms, numeric values, abstention phrases.

    Build it once per case and call :meth:`score` per output (:func:`score` does both).
    """

    def __init__(self, case: Case) -> None:
        self.case = case
        self.claims: tuple[_ClaimForms, ...] = tuple(
            [_claim_forms(c, "required") for c in case.required_claims]
            + [_claim_forms(c, "forbidden") for c in case.forbidden_claims]
        )
        self.numeric = any(c.number is not None for c in self.claims)
        self.required_ids = tuple(c.id for c in case.required_claims)
        self.severity: dict[str, str] = {c.id: c.severity for c in case.forbidden_claims}
        self.expects_abstention = not case.required_claims and case.abstain_when_absent
        self.conflict = case.pattern.scoring == "conflict"
        self.display = {c.claim_id: c.display for c in self.claims}
        self.conflict_display = " / ".join(self.display[claim_id] for claim_id in self.required_ids)
        self.case_doc_ids = frozenset(d.id for d in case.evidence)
        self.distractor_ids = frozenset(d.id for d in case.distractors)
        phrases = ABSTAIN_PHRASES + (CONFLICT_PHRASES if self.conflict else ())
        self.abstain_phrases = tuple(
            sorted({normalize(p) for p in phrases} - {""}, key=lambda s: (-len(s), s))
        )
        expected_value = case.expected_fields.get("value")
        if expected_value is None and len(case.required_claims) == 1:
            expected_value = case.required_claims[0].value
        self.expected_display = expected_value or (self.claims[0].display if case.required_claims else "")

    # events -----------------------------------------------------------------------------------------------

    def events(self, line: str) -> list[_Event]:
        """Every claim form, number and abstention phrase in a normalised line, in reading order."""
        found: list[_Event] = []
        for claim in self.claims:
            for form in claim.forms:
                if self.numeric and parse_number(form) is not None:
                    continue  # bare numbers are number events (compared by value, unit-checked)
                for start in find_word(line, form):
                    found.append(_Event(start, start + len(form), claim.kind, claim.claim_id, form))
        if self.numeric:
            for match in NUMBER_PATTERN.finditer(line):
                found.append(self._number_event(line, match))
        for phrase in self.abstain_phrases:
            for start in find_word(line, phrase):
                found.append(_Event(start, start + len(phrase), "abstain", None, phrase))
        # Drop an event inside a longer one ("sato" inside "hiroshi sato", "245" inside "245 usd").
        found.sort(key=lambda e: (e.start, -(e.end - e.start), _KIND_ORDER[e.kind]))
        kept: list[_Event] = []
        for event in found:
            if any(
                k.start <= event.start
                and event.end <= k.end
                and (k.end - k.start) > (event.end - event.start)
                for k in kept
            ):
                continue
            kept.append(event)
        return kept

    def _number_event(self, line: str, match: re.Match[str]) -> _Event:
        value = Decimal(match.group(0))
        unit = unit_after(line, match.end())
        mismatch = ""
        for kind in ("required", "forbidden"):
            for claim in self.claims:
                if claim.kind != kind or claim.number is None or claim.number != value:
                    continue
                if unit is not None and claim.unit_family is not None and unit != claim.unit_family:
                    mismatch = f"its unit is {unit}, not {claim.unit!r}"
                    continue
                return _Event(
                    match.start(), match.end(), claim.kind, claim.claim_id, match.group(0), unit=unit
                )
        return _Event(match.start(), match.end(), "other", None, match.group(0), mismatch, unit)

    # scoring ------------------------------------------------------------------------------------------------

    def score(
        self,
        output_text: str,
        *,
        evidence_ids_in_layout: set[str] | frozenset[str],
        status: str = STATUS_OK,
        system_fail_reason: str | None = None,
    ) -> Score:
        unscored = _status_score(status, system_fail_reason)
        if unscored is not None:
            return unscored

        text = output_text or ""
        structured = json_object(text)
        if structured is not None:
            answer = structured.get("answer", structured.get("value"))
            raw_line = "" if answer is None else str(answer)
        else:
            raw_line = answer_line(text)
        line = normalize(self.without_citations(raw_line) if self.conflict else raw_line)
        events = self.events(line)
        head = events[0] if events else None
        abstained = head is not None and head.kind == "abstain"
        if structured is not None and structured.get("abstain") is True and not self.required_found(events):
            abstained = True

        problems: list[str] = []
        note = ""
        missing: list[str] = []
        forbidden: list[str] = []
        if head is not None and head.kind == "forbidden" and head.claim_id is not None:
            forbidden.append(head.claim_id)

        if self.case.pattern.scoring == "mrcr":
            note, missing, forbidden, found = judge_mrcr(
                events, self.required_ids, self.expected_display, raw_line
            )
            problems += found
        elif self.conflict:
            note, missing, forbidden = self._judge_conflict(line, events, abstained, raw_line, problems)
        elif self.expects_abstention:
            note = _judge_abstention(head, abstained, raw_line, problems)
        else:
            note, missing = self._judge_required(events, head, raw_line, problems, forbidden)

        wrong = self.wrong_citations(text, evidence_ids_in_layout)
        if wrong:
            problems.append(f"wrong citation(s) {wrong}: not evidence in the layout, or a distractor")
        decided = head.token if head is not None else None
        mismatches = self.field_mismatches(structured, head, abstained)
        if mismatches and not problems:
            problems.append(f"expected field(s) differ: {'; '.join(mismatches)}")

        if not problems:
            return Score(outcome="pass", abstained=abstained, reason=join_sentence([note]), answer=decided)
        return Score(
            outcome="fail",
            safety=any(self.severity.get(claim_id) == "safety" for claim_id in forbidden),
            missing_claims=missing,
            forbidden_hits=forbidden,
            wrong_citations=wrong,
            abstained=abstained,
            field_mismatches=mismatches,
            reason=join_sentence(problems),
            answer=decided,
        )

    def _judge_required(
        self,
        events: Sequence[_Event],
        head: _Event | None,
        raw_line: str,
        problems: list[str],
        forbidden: list[str],
    ) -> tuple[str, list[str]]:
        """An evidence-present case: (note, missing required claims); problems go to ``problems`` and
        forbidden claims before the first required one to ``forbidden``."""
        matched = {e.claim_id for e in events if e.kind == "required"}
        first_required = next((e.start for e in events if e.kind == "required"), None)
        if len(self.required_ids) > 1 and first_required is not None:
            for event in events:
                if event.start >= first_required:
                    break
                if event.kind == "forbidden" and event.claim_id and event.claim_id not in forbidden:
                    forbidden.append(event.claim_id)
        if head is None or head.kind != "required":
            missing = list(self.required_ids)
        else:
            missing = [claim_id for claim_id in self.required_ids if claim_id not in matched]
        expected = self.expected_display
        if head is None:
            problems.append(f"no answer found: {describe_line(raw_line)}; expected {expected!r}")
        elif head.kind == "abstain":
            problems.append(
                f"abstained ({head.token!r}) although the evidence is in the context; expected {expected!r}"
            )
        elif head.kind == "forbidden":
            problems.append(
                f"answered {head.token!r}, the value of forbidden claim {head.claim_id!r}, instead of "
                f"{expected!r}"
            )
        elif head.kind == "other":
            detail = f" ({head.note})" if head.note else ""
            problems.append(f"answered {head.token!r}{detail}, which matches no claim; expected {expected!r}")
        elif missing:
            problems.append(f"the answer lacks required claim(s) {missing}")
        elif forbidden:
            problems.append(f"gave forbidden claim(s) {forbidden} before the required answer")
        else:
            return f"answered {head.token!r}, the required claim, first", missing
        return "", missing

    def _judge_conflict(
        self,
        line: str,
        events: Sequence[_Event],
        abstained: bool,
        raw_line: str,
        problems: list[str],
    ) -> tuple[str, list[str], list[str]]:
        """The conflict rule (module docstring, 5): every value given as the answer counts; the answer must
        give every conflicting value and no other, or give none and abstain. Appends to ``problems``;
        returns (note, missing claim ids, forbidden claim ids)."""
        given = self.conflict_answer(line, events)
        matched = list(dict.fromkeys(e.claim_id for e in given if e.kind == "required" and e.claim_id))
        forbidden = list(dict.fromkeys(e.claim_id for e in given if e.kind == "forbidden" and e.claim_id))
        others = list(dict.fromkeys(e.token for e in given if e.kind == "other"))
        values = self.conflict_display
        if not given:
            if abstained:
                return "abstained or flagged the conflict, as accepted: the sources disagree", [], []
            problems.append(
                f"no answer found: {describe_line(raw_line)}; expected an abstention or every conflicting "
                f"value ({values})"
            )
            return "", list(self.required_ids), []
        missing = [claim_id for claim_id in self.required_ids if claim_id not in matched]
        if forbidden or others:
            extra = [*(f"{c!r} (forbidden claim)" for c in forbidden), *(repr(t) for t in others)]
            problems.append(
                f"gave {', '.join(extra)} beside the conflicting values ({values}), which no source states "
                "for the question"
            )
        if missing:
            shown = ", ".join(f"{self.display[c]!r} ({c})" for c in matched)
            given_text = f"answered only {shown}" if shown else "gave none of the conflicting values"
            problems.append(
                f"{given_text} although the sources disagree: lacks required claim(s) {missing}; "
                f"expected an abstention or every value ({values})"
            )
        if problems:
            return "", missing, forbidden
        flagged = "flagged the conflict and " if abstained else ""
        return f"{flagged}gave every conflicting value ({values})", [], []

    def conflict_answer(self, line: str, events: Sequence[_Event]) -> list[_Event]:
        """The value events of a conflict case's answer: from the start of the line to the end of the
        sentence holding the last required claim (or, without one, the first event); what follows is the
        continuation a base model copies on, as in the head rule."""
        if not events:
            return []
        required = [e for e in events if e.kind == "required"]
        anchor = required[-1] if required else events[0]
        match = SENTENCE_END.search(line, anchor.end)
        end = match.start() if match else len(line)
        return [e for e in events if e.start < end and e.kind != "abstain"]

    def without_citations(self, text: str) -> str:
        """``text`` (NFKC) with its citations (:func:`extract_citations`' forms) blanked out: on a conflict
        case every value of the answer counts, and the numbers of a cited id (``[doc-7]``) are none."""
        known = self.case_doc_ids | self.distractor_ids
        nfkc = unicodedata.normalize("NFKC", text)
        spans = [(m.start(), m.end()) for m in CITATION_SOURCE.finditer(nfkc)]
        for match in CITATION_BRACKET.finditer(nfkc):
            tokens = [token.strip() for token in CITATION_SPLIT.split(match.group(1).strip())]
            if all(t in known or (ID_LIKE.match(t) and ID_MARK.search(t)) for t in tokens):
                spans.append((match.start(), match.end()))
        for start, end in spans:
            nfkc = nfkc[:start] + " " * (end - start) + nfkc[end:]
        return nfkc

    def required_found(self, events: Sequence[_Event]) -> bool:
        return any(e.kind == "required" for e in events)

    def wrong_citations(self, text: str, evidence_ids: set[str] | frozenset[str]) -> list[str]:
        """Cited ids that are not evidence in the layout or are distractors, in order, without repeats."""
        cited = extract_citations(text, known_ids=set(evidence_ids) | self.case_doc_ids | self.distractor_ids)
        wrong: list[str] = []
        for doc_id in cited:
            if (doc_id in self.distractor_ids or doc_id not in evidence_ids) and doc_id not in wrong:
                wrong.append(doc_id)
        return wrong

    def field_mismatches(
        self,
        structured: Mapping[str, Any] | None,
        head: _Event | None,
        abstained: bool,
    ) -> list[str]:
        """Exact match (after normalisation) of the case's expected fields that the output can show."""
        out: list[str] = []
        for name, expected in sorted(self.case.expected_fields.items()):
            if name == "abstain":
                got = "true" if abstained else "false"
                if normalize(expected) != got:
                    out.append(f"abstain: expected {expected!r}, got {got!r}")
                continue
            if structured is not None:
                if name not in structured:
                    out.append(f"{name}: expected {expected!r}, got nothing")
                    continue
                raw = structured[name]
                got_text = "" if raw is None else str(raw)
                if normalize(got_text) != normalize(expected):
                    out.append(f"{name}: expected {expected!r}, got {got_text!r}")
                continue
            if name == "unit":
                # only a unit written right after the answer number is observable in free text
                want = unit_family(expected)
                if head is not None and head.unit is not None and want is not None and head.unit != want:
                    out.append(f"unit: expected {expected!r}, got {head.unit}")
                continue
            if name != "value":
                continue  # a free-text continuation cannot show region, threshold ...
            got_value = "" if abstained or head is None else self._value_of(head)
            if not same_value(got_value, expected):
                shown = repr(got_value) if got_value else "nothing"
                out.append(f"value: expected {expected!r}, got {shown}")
        return out

    def _value_of(self, event: _Event) -> str:
        if event.claim_id is not None:
            for claim in self.claims:
                if claim.claim_id == event.claim_id:
                    return claim.display
        return event.token


def score(
    case: Case,
    output_text: str,
    *,
    evidence_ids_in_layout: set[str],
    status: str = STATUS_OK,
    system_fail_reason: str | None = None,
) -> Score:
    """Score one output of ``case`` (see the module docstring for the answer rule).

    ``evidence_ids_in_layout``: ids of the evidence documents (kind "evidence") the layout placed; a
    citation of any other id, or of a distractor, is wrong. ``status``: "ok", "system_fail" or
    "infra_error". Raises ``InputError`` for an unknown status.
    """
    return CaseOracle(case).score(
        output_text,
        evidence_ids_in_layout=evidence_ids_in_layout,
        status=status,
        system_fail_reason=system_fail_reason,
    )


# --------------------------------------------------------------------------------------------------------
# Records


def _layout_evidence(layouts: pl.DataFrame) -> dict[str, frozenset[str]]:
    for column in ("layout_id", "evidence_spans"):
        if column not in layouts.columns:
            raise InputError(
                f"layouts lack column {column!r}",
                field=column,
                fix="provide layout_id and evidence_spans (list of {evidence_id, kind, ...})",
            )
    out: dict[str, frozenset[str]] = {}
    for layout_id, spans in layouts.select("layout_id", "evidence_spans").iter_rows():
        ids: set[str] = set()
        for span in spans or []:
            if not isinstance(span, Mapping) or "evidence_id" not in span or "kind" not in span:
                raise InputError(
                    f"layout {layout_id!r} has a malformed evidence span {span!r}",
                    field="evidence_spans",
                    fix="give every span an evidence_id and a kind ('evidence' or 'distractor')",
                )
            if span["kind"] == "evidence":
                ids.add(str(span["evidence_id"]))
        out[str(layout_id)] = frozenset(ids)
    return out


def score_records(records: pl.DataFrame, suite: Suite, layouts: pl.DataFrame) -> pl.DataFrame:
    """Score every record; the result is ready for :func:`depthgate.judge.gate.gate`.

    ``records`` has the columns of :data:`RECORD_COLUMNS`; ``layouts`` has ``layout_id`` and
    ``evidence_spans`` (list of structs with ``evidence_id`` and ``kind``: "evidence" or "distractor").
    Returns the records with ``target_tokens`` renamed to ``length`` (the gate's name), ``position`` as a
    string (the gate's slice key) and the columns of :data:`SCORE_COLUMNS` added. Identical outputs of a
    case in the same layout are scored once. Raises ``InputError`` for an unknown case, an unknown layout
    of a scored run, or a missing column.
    """
    require_columns(records, RECORD_COLUMNS, what="records", fix=f"provide {list(RECORD_COLUMNS)}")
    evidence_of = _layout_evidence(layouts)
    oracles: dict[str, CaseOracle] = {}
    cases = {case.id: case for case in suite.cases}
    memo: dict[tuple[Any, ...], Score] = {}
    scores: list[Score] = []
    rows = records.select("case_id", "layout_id", "status", "system_fail_reason", "output_text").iter_rows()
    for case_id, layout_id, status, reason, text in rows:
        key = (case_id, layout_id, status, reason, text)
        cached = memo.get(key)
        if cached is not None:
            scores.append(cached)
            continue
        if case_id not in cases:
            raise InputError(
                f"record of unknown case {case_id!r}",
                field="case_id",
                fix=f"use a case of suite {suite.name!r}",
            )
        oracle = oracles.get(case_id)
        if oracle is None:
            oracle = oracles[case_id] = CaseOracle(cases[case_id])
        if status == STATUS_OK and (layout_id is None or str(layout_id) not in evidence_of):
            raise InputError(
                f"record of case {case_id!r} names layout {layout_id!r}, which is not in the layouts",
                field="layout_id",
                fix="pass the layouts frame the records were run with",
            )
        evidence = evidence_of.get(str(layout_id), frozenset()) if layout_id is not None else frozenset()
        result = oracle.score(
            text or "",
            evidence_ids_in_layout=evidence,
            status=str(status),
            system_fail_reason=reason,
        )
        memo[key] = result
        scores.append(result)

    list_type = pl.List(pl.String())
    position = pl.col("position")
    if records.schema["position"] != pl.String():
        position = position.cast(pl.String())
    return records.rename({"target_tokens": "length"}).with_columns(
        position.alias("position"),
        pl.Series("outcome", [s.outcome for s in scores], dtype=pl.String()),
        pl.Series("safety", [s.safety for s in scores], dtype=pl.Boolean()),
        pl.Series("missing_claims", [s.missing_claims for s in scores], dtype=list_type),
        pl.Series("forbidden_hits", [s.forbidden_hits for s in scores], dtype=list_type),
        pl.Series("wrong_citations", [s.wrong_citations for s in scores], dtype=list_type),
        pl.Series("abstained", [s.abstained for s in scores], dtype=pl.Boolean()),
        pl.Series("field_mismatches", [s.field_mismatches for s in scores], dtype=list_type),
        pl.Series("score_reason", [s.reason for s in scores], dtype=pl.String()),
    )


__all__ = [
    "ABSTAIN_PHRASES",
    "CONFLICT_PHRASES",
    "RECORD_COLUMNS",
    "SCORE_COLUMNS",
    "STATUS_INFRA_ERROR",
    "STATUS_OK",
    "STATUS_SYSTEM_FAIL",
    "CaseOracle",
    "Outcome",
    "Score",
    "score",
    "score_records",
]

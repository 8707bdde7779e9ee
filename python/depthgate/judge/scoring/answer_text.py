"""Answer text for the oracle: normalisation of a model's answer line, numbers and their units, word
search, citations and the wording of a score's reason. Moved out of ``depthgate.judge.scoring.oracle`` (issue
#23: one job per module: answer normalisation here, the rules and scoring there)."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = [
    "CITATION_BRACKET",
    "CITATION_SOURCE",
    "CITATION_SPLIT",
    "ID_LIKE",
    "ID_MARK",
    "NUMBER_PATTERN",
    "SENTENCE_END",
    "answer_line",
    "describe_line",
    "extract_citations",
    "find_word",
    "join_sentence",
    "json_object",
    "normalize",
    "parse_number",
    "same_value",
    "unit_after",
    "unit_family",
]

SENTENCE_END = re.compile(r"[.!?;](?=\s)|[。！？；]")
_THIN_GROUP = re.compile(r"(?<=\d)[\u2009\u202f](?=\d{3}(?!\d))")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
NUMBER_PATTERN = re.compile(r"(?<![\d.])\d+(?:\.\d+)?")
_APOSTROPHES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u02bc": "'", "\u00b4": "'"})

# Units whose family an adjacent word reveals. A number followed by a unit of another family than the
# claim's unit is not that claim's value ("245 days" is not a rate of 245 USD per night).
_UNIT_FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("currency", re.compile(r"(?:usd|us\$|\$|dollars?|美元|美金|元)")),
    ("days", re.compile(r"(?:(?:calendar |business |working )?days?|天|日)")),
)

# Citations: [id] or [id, id] and (source: id) / (sources: a; b) / （来源：id） after NFKC.
CITATION_BRACKET = re.compile(r"\[([^\[\]\n]{1,400})\]")
CITATION_SOURCE = re.compile(r"\((?:sources?|src|ref|refs|来源|出处)\s*:\s*([^()\n]{1,400})\)", re.IGNORECASE)
CITATION_SPLIT = re.compile(r"\s*[,;、]\s*")
ID_LIKE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
ID_MARK = re.compile(r"[0-9._:/@-]")

_SNIPPET = 60


# --------------------------------------------------------------------------------------------------------
# Normalisation


def _is_cjk(ch: str) -> bool:
    code = ord(ch)
    return (
        0x3040 <= code <= 0x30FF  # kana
        or 0x3400 <= code <= 0x4DBF  # CJK extension A
        or 0x4E00 <= code <= 0x9FFF  # CJK unified ideographs
        or 0xAC00 <= code <= 0xD7AF  # Hangul
        or 0xF900 <= code <= 0xFAFF  # CJK compatibility ideographs
        or 0x20000 <= code <= 0x2FFFF  # CJK extensions B+
    )


def _is_spaced_word_char(ch: str) -> bool:
    """A letter or digit of a script that separates words with spaces (so needs a boundary check)."""
    return (ch.isalnum() or ch == "_") and not _is_cjk(ch)


def _strip_edge_punctuation(text: str) -> str:
    start, end = 0, len(text)
    while start < end and (text[start].isspace() or unicodedata.category(text[start]).startswith("P")):
        start += 1
    while end > start and (text[end - 1].isspace() or unicodedata.category(text[end - 1]).startswith("P")):
        end -= 1
    return text[start:end]


def normalize(text: str) -> str:
    """NFKC, casefold, ``'`` for typographic apostrophes, no thousands separators inside numbers,
    whitespace collapsed, punctuation stripped at both edges: ``" USD 1,200. "`` → ``"usd 1200"``."""
    text = _THIN_GROUP.sub("", text)
    text = unicodedata.normalize("NFKC", text).casefold().translate(_APOSTROPHES)
    text = _THOUSANDS.sub("", text)
    return _strip_edge_punctuation(" ".join(text.split()))


def answer_line(output_text: str) -> str:
    """The first non-blank line of an output (the part the oracle scores), not normalised."""
    for line in output_text.splitlines():
        if line.strip():
            return line
    return ""


def parse_number(text: str) -> Decimal | None:
    """The value of a normalised text that is a single number ("245", "1200", "2.50"), else None."""
    if not text or not NUMBER_PATTERN.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        return None


def unit_family(text: str | None) -> str | None:
    if not text:
        return None
    norm = normalize(text)
    for family, pattern in _UNIT_FAMILIES:
        if pattern.search(norm):
            return family
    return None


def unit_after(line: str, end: int) -> str | None:
    """The unit family of the word right after a number ending at ``end``, if it names one."""
    rest = line[end:].lstrip()
    for family, pattern in _UNIT_FAMILIES:
        match = pattern.match(rest)
        if match is None:
            continue
        stop = match.end()
        # "days" but not "dayton"; CJK units need no boundary
        if stop < len(rest) and _is_spaced_word_char(rest[stop - 1]) and _is_spaced_word_char(rest[stop]):
            continue
        return family
    return None


def find_word(haystack: str, needle: str) -> Iterable[int]:
    """Start offsets of ``needle`` in ``haystack`` at word boundaries (none needed next to CJK)."""
    if not needle:
        return
    start = haystack.find(needle)
    while start >= 0:
        end = start + len(needle)
        left_ok = not (
            _is_spaced_word_char(needle[0]) and start > 0 and _is_spaced_word_char(haystack[start - 1])
        )
        right_ok = not (
            _is_spaced_word_char(needle[-1]) and end < len(haystack) and _is_spaced_word_char(haystack[end])
        )
        if left_ok and right_ok:
            yield start
        start = haystack.find(needle, start + 1)


def same_value(got: str, expected: str) -> bool:
    a, b = normalize(got), normalize(expected)
    if a == b:
        return True
    na, nb = parse_number(a), parse_number(b)
    return na is not None and nb is not None and na == nb


def json_object(text: str) -> dict[str, Any] | None:
    stripped = text.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return None
    try:
        value = json.loads(stripped)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def describe_line(raw_line: str) -> str:
    if not raw_line.strip():
        return "empty output"
    snippet = " ".join(raw_line.split())
    if len(snippet) > _SNIPPET:
        snippet = snippet[: _SNIPPET - 1] + "…"
    return f"no value in {snippet!r}"


def join_sentence(parts: Sequence[str]) -> str:
    text = "; ".join(parts)
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def extract_citations(text: str, *, known_ids: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Document ids cited in ``text``: ``[id]``, ``[a, b]``, ``(source: id)``, ``（来源：id）``.

    Bracketed tokens count when they are a known id or look like one (a digit or one of ``- _ / . : @``);
    ``(source: ...)`` tokens count whenever they are id-shaped. Order of appearance, repeats kept.
    """
    nfkc = unicodedata.normalize("NFKC", text)
    hits: list[tuple[int, str]] = []
    for match in CITATION_BRACKET.finditer(nfkc):
        for token in CITATION_SPLIT.split(match.group(1).strip()):
            token = token.strip()
            for prefix in ("source:", "sources:", "doc:", "来源:"):
                if token.casefold().startswith(prefix):
                    token = token[len(prefix) :].strip()
            if token in known_ids or (ID_LIKE.match(token) and ID_MARK.search(token)):
                hits.append((match.start(), token))
    for match in CITATION_SOURCE.finditer(nfkc):
        for token in CITATION_SPLIT.split(match.group(1).strip()):
            token = token.strip()
            if token in known_ids or ID_LIKE.match(token):
                hits.append((match.start(), token))
    hits.sort(key=lambda item: item[0])
    return [token for _, token in hits]

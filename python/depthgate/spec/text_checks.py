"""Text checks shared by the cases, the systems, the filler, the suites and the layout engine.

Text that ends up in a prompt (evidence, distractors, filler) obeys the *unit contract* the layout engine
relies on: it starts with exactly one separator (``" "`` continuing a paragraph, ``"\\n"`` after a heading,
``"\\n\\n"`` opening a section) followed by a non-whitespace character, and ends with a non-whitespace
character. Byte-level BPE tokenizers are exact at junctions only when the separator *starts* the right
piece (DESIGN.md §3), so no unit may end with the whitespace that precedes the next one. No prompt text
may contain a chat or control token.
"""

from __future__ import annotations

import re

from depthgate.spec.base import violation

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


_SPECIAL_FIX = "remove or reword it; prompt text must never contain chat or control tokens"
_UNIT_FIX = (
    "start the text with exactly one ' ' (or '\\n\\n' for a new section) and end it with a "
    "non-whitespace character, e.g. ' The rate is 245 USD per night.'"
)


def check_prompt_text(text: str, *, field: str, case: str = "") -> None:
    token = find_special_token(text)
    if token is not None:
        raise violation(
            f"contains the special-token-like string {token!r}", field=field, case=case, fix=_SPECIAL_FIX
        )


def check_unit(text: str, *, field: str, case: str = "") -> None:
    problem = unit_contract_violation(text)
    if problem is not None:
        raise violation(f"text {problem}", field=field, case=case, fix=_UNIT_FIX)
    check_prompt_text(text, field=field, case=case)


def check_inline(text: str, *, field: str, case: str = "", allow_empty: bool) -> None:
    if not text and not allow_empty:
        raise violation("must not be empty", field=field, case=case, fix=f"give a non-empty {field}")
    if text != text.strip():
        raise violation(
            "has leading or trailing whitespace",
            field=field,
            case=case,
            fix="strip it; the assembler adds separators and the model generates the one before its answer",
        )
    check_prompt_text(text, field=field, case=case)


def check_id(value: str, *, field: str, case: str = "") -> None:
    if not _ID_PATTERN.match(value):
        raise violation(f"id {value!r} is not a valid id", field=field, case=case, fix=_ID_FIX)


class UniqueIds:
    """The ids of one kind met so far in a case, each with the field that holds it: every id must be
    a valid id and appear once."""

    def __init__(self, case: str, what: str, *, fix: str) -> None:
        self.case, self.what, self.fix = case, what, fix
        self.seen: dict[str, str] = {}

    def add(self, value: str, field: str) -> None:
        """Check the id at ``field`` (``<field>.id``) and record it."""
        check_id(value, field=f"{field}.id", case=self.case)
        if value in self.seen:
            raise violation(
                f"duplicate {self.what} {value!r} (also {self.seen[value]})",
                field=f"{field}.id",
                case=self.case,
                fix=self.fix,
            )
        self.seen[value] = field

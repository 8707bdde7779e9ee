"""Prompt assemblers: how a case's fixed parts — preamble, document header, question, cloze answer
prefix — are placed around the context (the haystack with the evidence in it).

A prompt assembler is one of the things a release changes (research/peers_2026.md: query placement is
a variable peers do not control), so it is a named, versioned choice of each system, part of the run
manifest and of every layout id:

* ``default`` — document first, then the question: ``[preamble] header · CONTEXT · question · answer``.
* ``query-first`` — the question before *and* after the document (the "sandwich" many RAG assemblers
  use): ``[preamble] question · header · CONTEXT · question · answer``.

Only the text around the context changes; the evidence bytes and their depth in the context stay the
same, so the two assemblers compare like with like.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

from depthgate.exceptions import SpecError
from depthgate.spec.cases import Case
from depthgate.spec.system import Assembler

__all__ = ["ASSEMBLERS", "FrameParts", "assemble"]

_HEADERS = {"en": "Company Operations Handbook (excerpt)", "zh": "公司运营手册（节选）"}
# (question opener, answer opener, separator before the cloze answer prefix)
_QUESTION = {"en": ("\n\nQuestion: ", "\nAnswer:", " "), "zh": ("\n\n问题：", "\n回答：", "")}
# The question as it leads the prompt under query-first.
_LEAD = {"en": "Question: {query}\n\n", "zh": "问题：{query}\n\n"}


@dataclass(frozen=True)
class FrameParts:
    """The user text before and after the context, and the assistant's cloze answer prefix."""

    before: str
    after: str
    answer: str


def _tail(case: Case) -> tuple[str, str]:
    q_open, a_open, sep = _QUESTION[case.language]
    after = f"{q_open}{case.query}{a_open}"
    answer = f"{sep}{case.answer_prefix}" if case.answer_prefix else ""
    return after, answer


def _with_preamble(preamble: str, text: str) -> str:
    return f"{preamble.strip()}\n\n{text}" if preamble.strip() else text


def _default(case: Case, preamble: str) -> FrameParts:
    after, answer = _tail(case)
    return FrameParts(_with_preamble(preamble, _HEADERS[case.language]), after, answer)


def _query_first(case: Case, preamble: str) -> FrameParts:
    after, answer = _tail(case)
    lead = _LEAD[case.language].format(query=case.query)
    return FrameParts(_with_preamble(preamble, lead + _HEADERS[case.language]), after, answer)


ASSEMBLERS: dict[str, Callable[[Case, str], FrameParts]] = {
    "default": _default,
    "query-first": _query_first,
}
if set(ASSEMBLERS) != set(get_args(Assembler)):  # the model's accepted names are exactly these
    raise RuntimeError("depthgate.spec.system.Assembler and ASSEMBLERS disagree")


def assemble(name: str, case: Case, preamble: str = "") -> FrameParts:
    """The frame parts of ``case`` under assembler ``name`` (SpecError naming the field if unknown)."""
    try:
        build = ASSEMBLERS[name]
    except KeyError:
        raise SpecError(
            f"unknown prompt assembler {name!r}",
            field="assembler",
            fix=f"use one of {', '.join(sorted(ASSEMBLERS))}",
        ) from None
    return build(case, preamble)

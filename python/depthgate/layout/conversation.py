"""Conversation frames: a multi-turn chat rendered by the model's own template, split around one
context slot per turn, every split proved faithful (issue 25).

A conversation of ``turns`` turns alternates user and assistant, starts and ends with a user turn
(optional system turn first), and holds the question in its final user turn. Turn 1 is
``user_before + slot``; turn k > 1 is ``lead + slot`` with a fixed non-whitespace lead (templates
that trim content, Llama-3, leave it untouched); the last turn ends with ``user_after``. Rendering
with the slot sentinel in every turn splits the prompt into ``prefix``, the ``turns - 1``
separators (the rendered text between two turns' slots: end of turn, role header, lead) and the
``suffix``. The split is then proved like the single-slot frame, per turn: re-rendering with a
distinct probe in each turn must give ``prefix + probe_1 + sep_1 + … + suffix`` byte for byte. A
template that drops, trims or rewrites an earlier turn (e.g. strips reasoning from past assistant
turns, as DeepSeek-R1 and Qwen3 do) is refused with the turn and what it does to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from depthgate.exceptions import SpecError, TemplateError, VerificationError
from depthgate.layout.templates import SLOT_SENTINEL, ChatTemplate, Frame, check_slot_text
from depthgate.spec.assemblers import assemble
from depthgate.spec.cases import Case
from depthgate.spec.matrix import MAX_TURNS, turns_for_length
from depthgate.spec.mrcr import exchange_texts

__all__ = [
    "MAX_TURNS",
    "TURN_LEADS",
    "TURN_SCHEMA",
    "Conversation",
    "conversation_frame",
    "conversation_messages",
    "exchange_block",
    "exchanges_of",
    "prove_cases",
    "prove_rendered",
    "turn_columns",
    "turn_roles",
]

#: The columns a conversation layout adds to layouts.parquet: the turn the moving block starts in
#: (1-based) and every turn's content span (token and char range, from the final encoding).
TURN_SCHEMA: dict[str, Any] = {
    "turn": pl.Int64,
    "turn_spans": pl.List(
        pl.Struct(
            {
                "turn": pl.Int64,
                "role": pl.Utf8,
                "token_start": pl.Int64,
                "token_end": pl.Int64,
                "char_start": pl.Int64,
                "char_end": pl.Int64,
            }
        )
    ),
}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """The conversation shape of a build: ``turns`` context turns (odd) or, with ``turn_tokens`` instead,
    per length the odd count nearest ``length / turn_tokens`` (:func:`turns_for_length`); an optional
    system turn. A frame has one turn count: :meth:`batches` splits the lengths by it."""

    turns: int | None = None
    system: str | None = None
    turn_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.turns is None) == (self.turn_tokens is None):
            raise SpecError(
                "a conversation needs exactly one of turns and turn_tokens",
                field="turns",
                fix="give turns = N (odd) or turn_tokens = N (tokens per turn)",
            )
        if self.turns is not None:
            _check_turns(self.turns)
        elif (
            isinstance(self.turn_tokens, bool)
            or not isinstance(self.turn_tokens, int)
            or self.turn_tokens < 1
        ):
            raise SpecError(
                f"turn_tokens = {self.turn_tokens!r} is not a positive number of tokens",
                field="turn_tokens",
                fix="give the tokens a turn should hold, e.g. turn_tokens = 256",
            )

    def turns_at(self, length: int) -> int:
        """The turn count of this conversation at ``length`` tokens."""
        if self.turns is not None:
            return self.turns
        assert self.turn_tokens is not None  # __post_init__: exactly one is set
        return turns_for_length(length, self.turn_tokens)

    def fixed_turns(self) -> int:
        """``turns``, for a frame: a ``turn_tokens`` conversation is framed per batch (:meth:`batches`)."""
        if self.turns is None:
            raise SpecError(
                "a turn_tokens conversation has no single turn count to frame",
                field="turn_tokens",
                fix="frame each length's conversation from Conversation.batches (a depthgate bug if seen)",
            )
        return self.turns

    def at(self, length: int) -> Conversation:
        """The fixed-``turns`` conversation this one is at ``length`` tokens (itself when fixed)."""
        return self if self.turns is not None else Conversation(self.turns_at(length), system=self.system)

    def batches(self, lengths: Sequence[int]) -> list[tuple[Conversation, list[int]]]:
        """The lengths by turn count, each with the fixed-``turns`` conversation they are built as (first
        length first). A ``turns`` conversation is one batch of every length: its build is unchanged."""
        by_turns: dict[Conversation, list[int]] = {}
        for length in lengths:
            by_turns.setdefault(self.at(length), []).append(length)
        return list(by_turns.items())


# What turn k > 1 says before its slot, by role: non-whitespace, so trimming templates keep it.
TURN_LEADS = {"user": "More of the document follows.", "assistant": "Noted. The document continues."}

# Per-turn probes: the single-slot frame's transformations (leading whitespace and newlines, HTML
# escaping, non-ASCII, jinja-looking text), a number per turn (a template that reorders or repeats
# turns cannot match), and reasoning markup (templates that strip "<think>…</think>" from past
# assistant turns rewrite content they never show the model again).
_PROBES: tuple[str, ...] = (
    " The quick brown fox jumps over the lazy dog in turn {k}.",
    "\n\n第二段：数据 {k}。\nLine two\twith a tab, an émigré & <b>{{{{ not_a_tag }}}}</b> 🔥 end.",
    " Draft {k}: <think>a private chain of thought</think> the visible reply {k}.",
)
_REASONING_MARK = "</think>"


def turn_roles(turns: int) -> tuple[str, ...]:
    """Roles of the ``turns`` context turns: user, assistant, user, … (odd count, ends with user)."""
    return tuple("user" if k % 2 == 0 else "assistant" for k in range(turns))


def _check_turns(turns: int) -> None:
    if not isinstance(turns, bool) and isinstance(turns, int) and turns > MAX_TURNS:
        raise SpecError(
            f"turns = {turns} is over the limit of {MAX_TURNS} (every turn's split is proved with its own "
            "renders, so the proof grows with the square of the turn count)",
            field="turns",
            fix=f"use an odd number of turns between 1 and {MAX_TURNS} (e.g. 3, 5, 9)",
        )
    if isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= MAX_TURNS or turns % 2 == 0:
        raise SpecError(
            f"turns = {turns!r}: a conversation alternates user/assistant and ends with the user turn "
            "that asks the question, so it needs an odd number of turns",
            field="turns",
            fix=f"use an odd number of turns between 1 and {MAX_TURNS} (e.g. 3, 5, 9)",
        )


def conversation_messages(
    contents: Sequence[str], *, system: str | None, user_before: str, user_after: str
) -> list[dict[str, str]]:
    """The messages of a conversation whose turn k holds ``contents[k]`` (its slot)."""
    roles = turn_roles(len(contents))
    messages = [] if system is None else [{"role": "system", "content": system}]
    for k, (role, content) in enumerate(zip(roles, contents, strict=True)):
        text = (user_before if k == 0 else TURN_LEADS[role]) + content
        if k == len(contents) - 1:
            text += user_after
        messages.append({"role": role, "content": text})
    return messages


def _diagnose(template: ChatTemplate, k: int, role: str, probe: str, rendered: str) -> str:
    """What the template did to turn ``k`` (0-based) holding ``probe``: named for the refusal."""
    turn = f"turn {k + 1} ({role}{', a past turn' if role == 'assistant' else ''})"
    if _REASONING_MARK in probe and probe.split(_REASONING_MARK)[-1] in rendered and probe not in rendered:
        mark = _REASONING_MARK
        return f"{turn}: the template strips reasoning (text up to {mark!r}) from past assistant turns"
    if probe.strip() in rendered and probe not in rendered:
        return f"{turn}: the template trims the turn's content"
    if probe not in rendered:
        return f"{turn}: the template rewrites or drops the turn's content"
    return f"{turn}: the template renders the turn differently from the conversation's split"


def conversation_frame(
    template: ChatTemplate,
    *,
    turns: int,
    system: str | None,
    user_before: str,
    user_after: str,
    answer_prefix: str = "",
    exchanges: int = 0,
) -> Frame:
    """Frame of a ``turns``-turn conversation (``Frame.separators`` between the turns' slots). With
    ``exchanges`` (MRCR needles, :func:`exchange_block`) the conversation has ``turns + 2 × exchanges``
    turns, and its separators must depend on the roles alone (the exchanges' separators move with the
    block, so one user → assistant and one assistant → user text must serve every place)."""
    _check_turns(turns)
    turns += 2 * exchanges
    check_slot_text(template, system=system, user_before=user_before, user_after=user_after)
    roles = turn_roles(turns)

    def render(contents: Sequence[str]) -> str:
        messages = conversation_messages(
            contents, system=system, user_before=user_before, user_after=user_after
        )
        return template.render(messages)

    rendered = render([SLOT_SENTINEL] * turns)
    count = rendered.count(SLOT_SENTINEL)
    if count != turns:
        raise TemplateError(
            f"template drops or repeats earlier turns of a {turns}-turn conversation "
            f"({count} of {turns} turn contents appear once in the rendering)",
            file=template.path,
            field="chat_template",
            fix='use a template that renders every past turn verbatim, or shape = "single"',
        )
    pieces = rendered.split(SLOT_SENTINEL)
    # Per turn, per probe: that turn holds the probe, the others the sentinel (a cheap render each).
    for k in range(turns):
        for raw in _PROBES:
            probe = raw.format(k=k + 1)
            contents = [SLOT_SENTINEL] * turns
            contents[k] = probe
            actual = render(contents)
            expected = SLOT_SENTINEL.join(pieces[: k + 1]) + probe + SLOT_SENTINEL.join(pieces[k + 1 :])
            if actual != expected:
                raise TemplateError(
                    "template does not render every turn verbatim, so the conversation cannot be split: "
                    + _diagnose(template, k, roles[k], probe, actual),
                    file=template.path,
                    field="chat_template",
                    fix='use a template that renders past turns verbatim, or shape = "single"',
                )
    if exchanges and len(set(pieces[1:-1:2])) + len(set(pieces[2:-1:2])) > 2:
        raise TemplateError(
            "template renders the text between turns differently by the turn's place in the conversation, "
            "so MRCR exchanges (whose turn separators move with the needles) cannot be laid out",
            file=template.path,
            field="chat_template",
            fix='use a template whose turn markers depend only on the roles, or pattern = "default"',
        )
    bos = template.bos_token
    return Frame(
        prefix=pieces[0],
        suffix=pieces[-1] + answer_prefix,
        kind="chat",
        template_digest=template.digest,
        pinned_date=template.pinned_date.isoformat(),
        add_special_tokens=not (bos and rendered.startswith(bos)),
        separators=tuple(pieces[1:-1]),
        answer_prefix=answer_prefix,
        roles=roles,
        exchanges=exchanges,
    )


def exchanges_of(case: Case, conversation: Conversation | None) -> int:
    """How many needle exchanges a case lays out (:func:`exchange_block`): an MRCR case's needles in a
    conversation, else 0 (single-slot MRCR keeps its needles in one block of text)."""
    return len(case.decisive) if conversation is not None and case.pattern.turns else 0


def gap_units(case_id: str, index: int, gaps: Sequence[Sequence[str]] | None) -> list[dict[str, Any]]:
    """A spacing's filler units before the ``index``-th decisive document of a moving block (none before
    the first, none without gaps): kind "filler", no span, never evidence."""
    if not (index and gaps):
        return []
    return [
        {"id": f"{case_id}~gap{index}.{k}", "text": text, "kind": "filler"}
        for k, text in enumerate(gaps[index - 1])
    ]


def exchange_block(case: Case, frame: Frame, gaps: Sequence[Sequence[str]] = ()) -> dict[str, Any]:
    """The core's spec fields of an MRCR case laid out as exchanges (issue 25 item 3): the moving block,
    the haystack's own turn separators (``turns``) and the unit whose turn the layout records
    (``asked``: the asked needle's reply). Per needle: its request (kind "request": a span, but it
    repeats by design), the user → assistant separator, its reply (the needle's evidence id, the code),
    the assistant → user separator; a spacing's filler opens the user turn before the next request.
    The block moves as one (rust/depthgate-core/src/layout/haystack.rs, ``is_exchange_block``), into
    user turns only."""
    user_to_assistant, assistant_to_user = frame.separators[0], frame.separators[1]
    moving: list[dict[str, Any]] = []
    for index, doc in enumerate(case.decisive):
        moving += gap_units(case.id, index, gaps)
        request, reply = exchange_texts(doc.text)
        moving += [
            {"id": f"{doc.id}/request", "text": request, "kind": "request"},
            {"id": f"{doc.id}/to-assistant", "text": user_to_assistant, "kind": "frame"},
            {"id": doc.id, "text": reply, "kind": "evidence"},
            {"id": f"{doc.id}/to-user", "text": assistant_to_user, "kind": "frame"},
        ]
    asked = [doc.id for doc in case.decisive if doc.supports]
    return {
        "moving": moving,
        "turns": list(frame.separators[: len(frame.separators) - 2 * frame.exchanges]),
        **({"asked": asked[0]} if len(asked) == 1 else {}),
    }


def turn_columns(meta: Sequence[Mapping[str, Any]], roles: Sequence[str]) -> dict[str, list[Any]]:
    """The :data:`TURN_SCHEMA` columns of a batch's layouts (the core's ``turn``/``turn_spans``)."""
    return {
        "turn": [m.get("turn") for m in meta],
        "turn_spans": [
            [{**span, "role": roles[span["turn"] - 1]} for span in m.get("turn_spans") or []] for m in meta
        ],
    }


def prove_cases(
    template: ChatTemplate,
    conversation: Conversation,
    layouts: pl.DataFrame,
    members: Sequence[tuple[Case, Frame]],
    *,
    assembler: str,
    preamble: str,
) -> None:
    """:func:`prove_rendered` for each case's layouts of one built batch (the case's frame and text)."""
    for case, frame in members:
        parts = assemble(assembler, case, preamble)
        prove_rendered(
            template,
            frame,
            layouts.filter(pl.col("case_id") == case.id),
            system=conversation.system,
            user_before=parts.before,
            user_after=parts.after,
        )


def prove_rendered(
    template: ChatTemplate,
    frame: Frame,
    layouts: pl.DataFrame,
    *,
    system: str | None,
    user_before: str,
    user_after: str,
) -> None:
    """Every ok conversation layout is what the template renders for its own turns: the turn contents
    are read back from their char ranges and the whole conversation is rendered again (the final
    prompt, not only its frame, is the template's output). Raises VerificationError naming the layout."""
    for row in layouts.filter(pl.col("status") == "ok").select("layout_id", "text", "turn_spans").iter_rows():
        layout_id, text, spans = row
        contents = [text[s["char_start"] : s["char_end"]] for s in spans]
        if len(contents) != len(frame.roles):
            raise VerificationError(
                f"layout {layout_id} records {len(contents)} turns, the frame has {len(frame.roles)}",
                field="turn_spans",
                fix="rebuild the layouts; this is a depthgate bug if it persists",
            )
        messages = conversation_messages(
            contents, system=system, user_before=user_before, user_after=user_after
        )
        if template.render(messages) + frame.answer_prefix != text:
            raise VerificationError(
                f"layout {layout_id}: the template renders its conversation differently from the prompt",
                field="text",
                fix="rebuild with --verification full; report the template if it persists",
            )

"""Chat templates rendered exactly as the serving stack renders them, and frames around a context slot.

The unit of truth of a layout is the final prompt (DESIGN.md §3): the chat template applied the way
transformers / vLLM apply it, generation prompt included. This module loads real templates (a
``.jinja`` file, a ``tokenizer_config.json`` or a ``chat_template.json``), renders them with the same
jinja2 configuration the servers use, and splits a rendered prompt around the slot where the layout
engine places the long context (a :class:`Frame`). A frame is only handed out after it is *proved*
faithful: re-rendering with real probe contexts must equal ``prefix + probe + suffix`` byte for byte.

Templates are untrusted code (they come from model repositories), so they run in jinja2's immutable
sandbox, and the one source of non-determinism they have, ``strftime_now``, is pinned to a recorded
date so that layouts are reproducible.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from depthgate.exceptions import TemplateError
from depthgate.spec.files import ReadFailures, read_json_object, read_utf8

__all__ = [
    "DEFAULT_PINNED_DATE",
    "SLOT_SENTINEL",
    "ChatTemplate",
    "Frame",
    "chat_frame",
    "check_template_bos",
    "load_chat_template",
    "raw_frame",
]

# The date llama.cpp's and transformers' template tests pin Llama-3.x's "Today Date" to; the shared
# reference renderings (tokenizers/chat-templates/RENDERED.json) were produced with it.
DEFAULT_PINNED_DATE = _dt.date(2024, 7, 26)

# Marks the context slot while rendering. Private-use code points cannot occur in real case text and
# are untouched by every string filter a template plausibly applies (trim, strip, escaping), so a
# template that moves, duplicates or rewrites the slot is detected rather than silently mis-split.
SLOT_SENTINEL = "\ue000DepthgateContextSlot\ue001"

# Contexts used to prove a frame. They follow the filler contract (start with whitespace, end with
# non-whitespace) and cover the transformations that break a split: trimming of leading whitespace or
# newlines, HTML escaping, non-ASCII normalisation, and jinja-looking text.
_FRAME_PROBES: tuple[str, ...] = (
    " The quick brown fox jumps over the lazy dog.",
    "\n\n第二段：数据在这里。\nLine two\twith a tab, an émigré & <b>{{ not_a_tag }}</b> 🔥 end.",
)

_RAW_FRAME_DESCRIPTOR = "depthgate/raw-frame/v1: prefix=user_before; suffix=user_after+answer_prefix"

_ENGLISH_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_ENGLISH_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
_STRFTIME_DIRECTIVE = re.compile(r"%[-#]?.", re.DOTALL)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _format_pinned(pinned: _dt.date, fmt: str) -> str:
    """``strftime`` on the pinned date, with English names whatever the process locale.

    ``%b``/``%A``… follow ``LC_TIME``; a harness that calls ``setlocale`` (or a server in another
    locale) would otherwise change the rendered prompt and thus the layout id.
    """
    moment = _dt.datetime.combine(pinned, _dt.time())

    def english(match: re.Match[str]) -> str:
        directive = match.group(0)
        code = directive[-1]
        if code == "a":
            return _ENGLISH_DAYS[moment.weekday()][:3]
        if code == "A":
            return _ENGLISH_DAYS[moment.weekday()]
        if code == "b":
            return _ENGLISH_MONTHS[moment.month - 1][:3]
        if code == "B":
            return _ENGLISH_MONTHS[moment.month - 1]
        if code == "p":
            return "AM"
        # Everything else (including "%%", which the regex consumes whole) is locale-independent.
        return directive

    return moment.strftime(_STRFTIME_DIRECTIVE.sub(english, fmt))


class _TemplateRaised(Exception):
    """What ``raise_exception`` throws: the template author's own refusal, kept distinct from bugs."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: transformers marks assistant spans with it.

    transformers only uses the markers to build an assistant-token mask; the rendered text is the body
    unchanged, so a pass-through is the exact equivalent for prompt rendering.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API declares this as a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja2's tojson: the built-in one HTML-escapes <, >, & and ' (and cannot
    # take separators), which would change tool schemas rendered into the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _build_environment(pinned: _dt.date) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Same options as transformers' _compile_jinja_template and vLLM (which delegates to it): any
    # difference in whitespace control would shift every token after the first block tag.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )

    def raise_exception(message: str) -> NoReturn:
        raise _TemplateRaised(str(message))

    def strftime_now(fmt: str) -> str:
        # Never the real clock: Llama-3.x write "Today Date" into the system turn, and a prompt that
        # changes daily would make layouts (and their ids) unreproducible.
        return _format_pinned(pinned, str(fmt))

    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the special-token strings it is rendered with.

    ``digest`` is the sha256 of ``source`` and ``pinned_date`` is the date ``strftime_now`` returns;
    both go into layout ids so a template or date change forces a rebuild.
    """

    source: str
    path: str
    bos_token: str = ""
    eos_token: str = ""
    pinned_date: _dt.date = DEFAULT_PINNED_DATE
    # Whether ``bos_token`` is the model's (given, or named by a config the template came with), not the
    # empty default of a template found with no config: :func:`check_template_bos`.
    bos_known: bool = True
    # Derived in __post_init__, never taken from the caller: it must identify the bytes we render.
    digest: str = dataclasses.field(init=False)
    _compiled: jinja2.Template = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", _sha256(self.source))
        try:
            compiled = _build_environment(self.pinned_date).from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"template does not parse: {exc.message} (line {exc.lineno})",
                file=self.path,
                field="chat_template",
                fix="use the model's published chat template unmodified",
            ) from exc
        object.__setattr__(self, "_compiled", compiled)

    @property
    def uses_bos_token(self) -> bool:
        """Whether the template writes ``bos_token`` anywhere (Llama-3.x and Gemma start with it)."""
        ast = _build_environment(self.pinned_date).parse(self.source)
        return "bos_token" in jinja2.meta.find_undeclared_variables(ast)

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        """Render ``messages`` as transformers' ``apply_chat_template(tokenize=False)`` would.

        Only what is passed reaches the template (plus ``bos_token``/``eos_token``); unlike
        transformers we do not inject ``tools=None``, because tool-use templates iterate ``tools``
        unguarded and the reference renderings were produced without it.
        """
        context: dict[str, object] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(extra)
        # Plain dicts: templates index messages with ['role'] and sometimes test `is mapping`.
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled.render(context)
        except _TemplateRaised as exc:
            raise TemplateError(
                f"template raised: {exc}",
                file=self.path,
                field="messages",
                fix="change the conversation to what this template accepts (roles, order, system turn)",
            ) from exc
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(
                f"template attempted an operation the sandbox forbids: {exc}",
                file=self.path,
                field="chat_template",
                fix="do not use this template; it reaches for Python internals or mutates its inputs",
            ) from exc
        except Exception as exc:  # any other failure is still the template's, never a crash of ours
            raise TemplateError(
                f"template failed while rendering: {type(exc).__name__}: {exc}",
                file=self.path,
                field="chat_template",
                fix="pass the variables this template expects (e.g. tools=...) or use another template",
            ) from exc


_TEMPLATE_READ = ReadFailures(
    TemplateError,
    missing=("chat template file not found", "check the path to the template file"),
    unreadable=("cannot read file: {strerror}", "check that the path is a readable file"),
    not_utf8=(
        "file is not UTF-8 text: {reason}",
        "point to the .jinja / tokenizer_config.json / chat_template.json file, not a binary",
    ),
    not_json=(
        "not valid JSON: {msg} (line {lineno}, column {colno})",
        "repair the JSON or pass the template as a .jinja file",
    ),
)


def _read_text(path: Path) -> str:
    # Text mode (universal newlines), as transformers and vLLM read --chat-template files: the
    # rendered bytes must be the ones the server renders.
    return read_utf8(path, _TEMPLATE_READ)


def _read_json_object(path: Path) -> dict[str, Any]:
    return read_json_object(path, _TEMPLATE_READ, "pass a tokenizer_config.json or chat_template.json")


def _token_string(value: object, *, path: Path, name: str) -> str | None:
    """A special token as written in HF configs: a string, an AddedToken dict, or null (absent)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise TemplateError(
        f"unexpected {name} value {value!r}",
        file=str(path),
        field=name,
        fix=f'set {name} to a string or {{"content": "..."}}, or pass {name}= explicitly',
    )


def _select_template(value: object, path: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # transformers' multi-template form: [{"name": "default", "template": ...}, {"name": "tool_use",
        # ...}]. "default" is what apply_chat_template uses when no tools are given.
        names: list[str] = []
        for item in value:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                names.append(item["name"])
                if item["name"] == "default" and isinstance(item.get("template"), str):
                    return str(item["template"])
        raise TemplateError(
            f"chat_template list has no 'default' entry (names: {names})",
            file=str(path),
            field="chat_template",
            fix="extract the wanted template into a .jinja file and load that",
        )
    raise TemplateError(
        f"chat_template must be a string or a list of {{name, template}}, found {type(value).__name__}",
        file=str(path),
        field="chat_template",
        fix="pass the template as a .jinja file",
    )


def _sibling_tokens(directory: Path, *, skip: Path | None) -> tuple[str | None, str | None, bool]:
    """bos/eos from tokenizer_config.json, then special_tokens_map.json, next to the template, and
    whether either names a ``bos_token`` at all (null included: a model without BOS says so)."""
    bos: str | None = None
    eos: str | None = None
    named = False
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        candidate = directory / name
        if not candidate.is_file() or (skip is not None and candidate.resolve() == skip.resolve()):
            continue
        data = _read_json_object(candidate)
        named = named or "bos_token" in data
        if bos is None:
            bos = _token_string(data.get("bos_token"), path=candidate, name="bos_token")
        if eos is None:
            eos = _token_string(data.get("eos_token"), path=candidate, name="eos_token")
    return bos, eos, named


def load_chat_template(
    path: str | Path,
    *,
    pinned_date: _dt.date = DEFAULT_PINNED_DATE,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> ChatTemplate:
    """Load a chat template from a ``.jinja`` file, a ``tokenizer_config.json`` or a ``chat_template.json``.

    bos/eos come from, in order: the explicit arguments, the JSON file itself, a sibling
    ``tokenizer_config.json``, a sibling ``special_tokens_map.json``; otherwise they are empty strings
    (a wrong BOS string would be as bad as a missing one, so nothing is guessed) and ``bos_known`` is
    False: a template that writes ``bos_token`` is then refused at build unless the tokenizer adds the
    BOS itself (:func:`check_template_bos`).
    """
    p = Path(path)
    file_bos: str | None = None
    file_eos: str | None = None
    file_named = False
    if p.suffix.lower() == ".json":
        data = _read_json_object(p)
        if "chat_template" not in data:
            raise TemplateError(
                "no chat_template key (this tokenizer has no chat template; base models often don't)",
                file=str(p),
                field="chat_template",
                fix="load the template from a .jinja file, or use raw_frame() for a base model",
            )
        source = _select_template(data["chat_template"], p)
        file_bos = _token_string(data.get("bos_token"), path=p, name="bos_token")
        file_eos = _token_string(data.get("eos_token"), path=p, name="eos_token")
        file_named = "bos_token" in data
        sibling_bos, sibling_eos, sibling_named = _sibling_tokens(p.parent, skip=p)
    else:
        source = _read_text(p)
        sibling_bos, sibling_eos, sibling_named = _sibling_tokens(p.parent, skip=None)

    def pick(explicit: str | None, *found: str | None) -> str:
        if explicit is not None:
            return explicit
        return next((value for value in found if value is not None), "")

    return ChatTemplate(
        source=source,
        path=str(p),
        bos_token=pick(bos_token, file_bos, sibling_bos),
        eos_token=pick(eos_token, file_eos, sibling_eos),
        pinned_date=pinned_date,
        bos_known=bos_token is not None or file_named or sibling_named,
    )


def check_template_bos(template: ChatTemplate | None, tokenizer_bos_id: int | None) -> None:
    """Refuse a template that writes ``{{ bos_token }}`` when no BOS string is known (no
    ``tokenizer_config.json`` or ``special_tokens_map.json`` came with it) and the tokenizer adds none
    (``tokenizer_bos_id``: the id its post-processor puts first, None when it adds nothing): every
    prompt would start without the model's BOS and nothing would say so (issue #37: Llama-3.1 and
    Gemma-3 templates given as a bare file). A tokenizer whose post-processor adds the BOS is fine: the
    frame renders no BOS and the tokenizer adds it (``add_special_tokens``)."""
    if template is None or template.bos_known or tokenizer_bos_id is not None or not template.uses_bos_token:
        return
    raise TemplateError(
        "the chat template writes {{ bos_token }} but no BOS is known: no tokenizer_config.json or "
        "special_tokens_map.json naming bos_token came with the template, and the tokenizer's "
        "post-processor adds none, so every prompt would start without the model's BOS",
        file=template.path,
        field="bos_token",
        fix="put the model's tokenizer_config.json beside the template, or name the model folder (its "
        "tokenizer.json, tokenizer_config.json and chat template) as tokenizer and chat_template",
    )


@dataclasses.dataclass(frozen=True)
class Frame:
    """The final prompt split around the context slot: ``prompt = prefix + context + suffix``.

    ``kind`` is ``"chat"`` (rendered through a template, proved faithful) or ``"raw"`` (completion
    text for base models). ``template_digest`` and ``pinned_date`` (ISO date; empty for raw frames,
    which render nothing) belong in the layout id. ``add_special_tokens`` tells the tokenizer whether
    to add BOS itself: False when the rendered text already starts with the BOS string.

    Junction constraint: the layout engine fills the slot with units that start with whitespace and
    end with non-whitespace, so ``prefix`` should end with non-whitespace (e.g. "...below:") for
    the junctions to tokenize exactly as the pieces (a trailing space or "\\n\\n" in the prefix
    merges with the first filler token under byte-level BPE). This is not enforced here; the
    layout engine verifies every junction on the final prompt anyway.
    """

    prefix: str
    suffix: str
    kind: str
    template_digest: str
    pinned_date: str
    add_special_tokens: bool
    # A conversation frame (layout/conversation.py): the rendered text between consecutive turns'
    # slots, the turns' roles, and the answer prefix appended to the suffix. Empty: one slot.
    separators: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    answer_prefix: str = ""
    # MRCR across turns (issue 25 item 3): how many of the turn pairs are needle exchanges (each a
    # request ending a user turn, its reply the next assistant turn); their separators travel in the
    # moving block (conversation.exchange_block), the rest split the haystack.
    exchanges: int = 0


def _renders(template: ChatTemplate, messages: list[dict[str, str]]) -> bool:
    try:
        template.render(messages)
    except TemplateError:
        return False
    return True


def _conversation(system: str | None, user_content: str) -> list[dict[str, str]]:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user_content})
    return messages


def check_slot_text(template: ChatTemplate, *, system: str | None, user_before: str, user_after: str) -> None:
    """The case text around the context slot must not hold the slot's sentinel characters (a prompt
    would be split in the wrong place): refused by field."""
    for name, value in (("system", system), ("user_before", user_before), ("user_after", user_after)):
        if value is not None and SLOT_SENTINEL in value:
            raise TemplateError(
                "text contains the context-slot sentinel",
                file=template.path,
                field=name,
                fix="remove the private-use characters U+E000/U+E001 from the case text",
            )


def chat_frame(
    template: ChatTemplate,
    *,
    system: str | None,
    user_before: str,
    user_after: str,
    answer_prefix: str = "",
) -> Frame:
    """Frame for a chat model: the context sits inside the (single) user turn.

    The user turn is ``user_before + context + user_after``; the generation prompt is included and
    ``answer_prefix`` (e.g. "Answer:") is appended after it. Raises TemplateError when the template
    rejects the conversation or does not insert the user content verbatim.
    """
    check_slot_text(template, system=system, user_before=user_before, user_after=user_after)

    def render(context: str) -> str:
        return template.render(_conversation(system, user_before + context + user_after))

    try:
        rendered = render(SLOT_SENTINEL)
    except TemplateError as exc:
        # Mistral v0.1 and Gemma-2 refuse a system turn with a generic message ("roles must
        # alternate"); if the same request renders without it, say that the system turn is the cause.
        if system is None or not _renders(template, _conversation(None, user_before + user_after)):
            raise
        raise TemplateError(
            f"template rejects a system message ({exc.message})",
            file=template.path,
            field="system",
            fix="pass system=None and put the instructions in user_before",
        ) from exc

    count = rendered.count(SLOT_SENTINEL)
    if count != 1:
        raise TemplateError(
            f"template transforms or drops the user content (context slot found {count} times)",
            file=template.path,
            field="chat_template",
            fix="use a template that inserts the user message verbatim, or raw_frame()",
        )
    prefix, suffix = rendered.split(SLOT_SENTINEL)

    # Prove the split: a template may trim, escape or otherwise rewrite content (Llama-3 trims it), in
    # which case prefix + context + suffix is not what the server would render.
    for probe in _FRAME_PROBES:
        actual = render(probe)
        if actual != prefix + probe + suffix:
            hint = (
                " (it likely trims the message: give user_before and user_after non-whitespace text)"
                if not user_before or not user_after
                else ""
            )
            raise TemplateError(
                f"template transforms the user content, so a frame cannot be used{hint}",
                file=template.path,
                field="chat_template",
                fix="use non-empty user_before/user_after, a template that inserts content verbatim, "
                "or raw_frame()",
            )

    bos = template.bos_token
    return Frame(
        prefix=prefix,
        suffix=suffix + answer_prefix,
        kind="chat",
        template_digest=template.digest,
        pinned_date=template.pinned_date.isoformat(),
        # A rendered BOS plus a tokenizer-added BOS would double it (DESIGN.md §3).
        add_special_tokens=not (bos and rendered.startswith(bos)),
    )


def raw_frame(
    *,
    user_before: str,
    user_after: str,
    answer_prefix: str = "",
    add_special_tokens: bool = True,
) -> Frame:
    """Completion-style frame for base models without a chat template: no rendering, no date."""
    return Frame(
        prefix=user_before,
        suffix=user_after + answer_prefix,
        kind="raw",
        template_digest=_sha256(_RAW_FRAME_DESCRIPTOR),
        pinned_date="",
        add_special_tokens=add_special_tokens,
    )

"""Chat templates render byte-identically to the recorded reference renderings, and frames are faithful.

All templates here are real files shipped in tests/fixtures/tokenizers (see its NOTICE, README and
PROVENANCE files); toy templates appear only in the error and sandbox tests, where a real file cannot
express the failure.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime as dt
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import SecurityError

from depthgate.exceptions import TemplateError
from depthgate.layout.templates import (
    DEFAULT_PINNED_DATE,
    SLOT_SENTINEL,
    ChatTemplate,
    Frame,
    chat_frame,
    load_chat_template,
    raw_frame,
)
from fixtures_paths import llamacpp_templates_dir, tokenizer_configs_dir, tokenizers_dir

TOKENIZERS = tokenizers_dir()
CHAT_TEMPLATES = TOKENIZERS / "chat-templates"
LLAMACPP = llamacpp_templates_dir()
CONFIGS = tokenizer_configs_dir()
FAMILIES = ("smollm", "llama2-tinyllama", "mistral-7b-v1")

# The two conversations every reference rendering was produced from (chat-templates/PROVENANCE.md and
# tokenizers/README.md), always with add_generation_prompt=True and strftime_now pinned to 26 Jul 2024.
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "system+user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the secret code?"},
    ],
    "user+assistant": [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
    ],
}


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------
# Reference renderings
# ---------------------------------------------------------------------------------------------------


def _reference_cases() -> Iterator[tuple[str, Path, str, str, str, dict[str, Any]]]:
    """(id, template file, bos, eos, conversation, recorded result) from RENDERED.json and VALIDATION.json."""
    for key, entry in _json(CHAT_TEMPLATES / "RENDERED.json").items():
        for conv in CONVERSATIONS:
            yield key, CHAT_TEMPLATES / key, entry["bos_token"], entry["eos_token"], conv, entry[conv]
    for family in FAMILIES:
        templates = _json(TOKENIZERS / family / "VALIDATION.json").get("chat_templates", {})
        for name, entry in templates.items():
            tokens = entry["special_tokens_used"]
            for conv in CONVERSATIONS:
                key = f"{family}/{name}"
                yield key, TOKENIZERS / key, tokens["bos_token"], tokens["eos_token"], conv, entry[conv]


REFERENCE_OK = [
    pytest.param(path, bos, eos, conv, result["text"], id=f"{key}::{conv}")
    for key, path, bos, eos, conv, result in _reference_cases()
    if result["ok"]
]
REFERENCE_RAISES = [
    pytest.param(path, bos, eos, conv, result["error"], id=f"{key}::{conv}")
    for key, path, bos, eos, conv, result in _reference_cases()
    if not result["ok"]
]


def test_reference_files_were_found() -> None:
    # 39 ok renderings in RENDERED.json + 9 in the family VALIDATION files (3 + 1 recorded errors):
    # guards against a silently empty parametrization if the fixture layout changes.
    assert len(REFERENCE_OK) == 48
    assert len(REFERENCE_RAISES) == 4


@pytest.mark.parametrize(("path", "bos", "eos", "conv", "expected"), REFERENCE_OK)
def test_render_matches_reference(path: Path, bos: str, eos: str, conv: str, expected: str) -> None:
    template = load_chat_template(path, bos_token=bos, eos_token=eos)
    assert template.render(CONVERSATIONS[conv], add_generation_prompt=True) == expected


@pytest.mark.parametrize(("path", "bos", "eos", "conv", "recorded_error"), REFERENCE_RAISES)
def test_render_reproduces_reference_errors(
    path: Path, bos: str, eos: str, conv: str, recorded_error: str
) -> None:
    template = load_chat_template(path, bos_token=bos, eos_token=eos)
    with pytest.raises(TemplateError) as info:
        template.render(CONVERSATIONS[conv])
    # Recorded as "<ExceptionType>: <message>"; the message must survive into ours, with the file.
    assert recorded_error.split(": ", 1)[1] in str(info.value)
    assert str(path) in str(info.value)


def _readme_renderings() -> Iterator[Any]:
    """The family renderings quoted in tokenizers/README.md, as (file, conversation, text or None)."""
    readme = TOKENIZERS / "README.md"
    if not readme.is_file():
        return
    section = readme.read_text(encoding="utf-8").split("## Rendered chat templates", 1)[1].split("\n## ")[0]
    for line in section.splitlines():
        head = re.match(r"- (\S+\.jinja): (.*)$", line)
        if not head:
            continue
        name, rest = head.groups()
        if rest.startswith("system+user raises"):
            yield pytest.param(name, "system+user", None, id=f"{name}::system+user")
            tail = re.search(r"user\+assistant → `('.*')`", rest)
            assert tail, line
            yield pytest.param(name, "user+assistant", ast.literal_eval(tail.group(1)), id=f"{name}::ua")
        else:
            quoted = re.match(r"`('.*')`", rest)
            assert quoted, line
            yield pytest.param(name, "system+user", ast.literal_eval(quoted.group(1)), id=f"{name}::su")


README_RENDERINGS = list(_readme_renderings())


def test_readme_quotes_were_found() -> None:
    assert len(README_RENDERINGS) == 6


@pytest.mark.parametrize(("name", "conv", "expected"), README_RENDERINGS)
def test_readme_quoted_renderings(name: str, conv: str, expected: str | None) -> None:
    family, file = name.split("/")
    tokens = _json(TOKENIZERS / family / "VALIDATION.json")["chat_templates"][file]["special_tokens_used"]
    template = load_chat_template(TOKENIZERS / name, **tokens)
    if expected is None:
        with pytest.raises(TemplateError, match="Conversation roles must alternate"):
            template.render(CONVERSATIONS[conv])
    else:
        assert template.render(CONVERSATIONS[conv]) == expected


def _provenance_digests() -> Iterator[Any]:
    provenance = CHAT_TEMPLATES / "PROVENANCE.md"
    text = provenance.read_text(encoding="utf-8") if provenance.is_file() else ""
    for match in re.finditer(r"^\| (llama\.cpp-models-templates/\S+\.jinja) \|.*\| (\w{16}) \|$", text, re.M):
        yield pytest.param(match.group(1), match.group(2), id=match.group(1))


@pytest.mark.parametrize(("name", "sha16"), list(_provenance_digests()))
def test_digest_is_sha256_of_the_file(name: str, sha16: str) -> None:
    template = load_chat_template(CHAT_TEMPLATES / name)
    assert template.digest == hashlib.sha256(template.source.encode()).hexdigest()
    assert template.digest[:16] == sha16  # the bytes we render are the bytes provenance recorded


def test_every_ollama_gguf_template_compiles_and_renders_or_raises_template_error() -> None:
    templates: dict[str, str] = _json(CHAT_TEMPLATES / "gguf_chat_templates_from_ollama_library.json")
    assert len(templates) == 95
    failures: list[str] = []
    for tag, source in templates.items():
        template = ChatTemplate(source=source, path=tag)
        try:
            # Not every template echoes the turn (Llama-Guard-style classifiers summarise it).
            assert isinstance(template.render(CONVERSATIONS["user+assistant"]), str)
        except TemplateError as exc:
            failures.append(str(exc))
    # Two need inputs beyond a conversation (firefunction: functions; shieldgemma: guideline).
    assert len(failures) == 2
    assert all("is undefined" in f for f in failures)


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bos", "eos"),
    [
        ("mistral-7b-v1/chat_template.jinja", "<s>", "</s>"),  # sibling config, plain strings
        ("mistral-7b-v1/chat_template.v0.1.jinja", "<s>", "</s>"),
        ("llama2-tinyllama/chat_template.jinja", "<s>", "</s>"),  # sibling config, AddedToken dicts
        ("smollm/chat_template.jinja", "", ""),  # no sibling config: nothing is guessed
    ],
)
def test_jinja_file_takes_special_tokens_from_siblings(name: str, bos: str, eos: str) -> None:
    template = load_chat_template(TOKENIZERS / name)
    assert (template.bos_token, template.eos_token) == (bos, eos)
    assert template.source == (TOKENIZERS / name).read_text(encoding="utf-8")
    assert template.pinned_date == DEFAULT_PINNED_DATE == dt.date(2024, 7, 26)


def test_special_tokens_map_is_the_fallback_sibling(tmp_path: Path) -> None:
    shutil.copy(TOKENIZERS / "mistral-7b-v1/chat_template.jinja", tmp_path / "chat_template.jinja")
    shutil.copy(TOKENIZERS / "mistral-7b-v1/special_tokens_map.json", tmp_path / "special_tokens_map.json")
    template = load_chat_template(tmp_path / "chat_template.jinja")
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")


def test_explicit_tokens_override_siblings() -> None:
    template = load_chat_template(
        TOKENIZERS / "mistral-7b-v1/chat_template.jinja", bos_token="", eos_token="E"
    )
    assert (template.bos_token, template.eos_token) == ("", "E")
    assert template.render(CONVERSATIONS["system+user"]).startswith(" [INST]")


@pytest.mark.parametrize(
    ("name", "bos", "eos"),
    [
        ("Qwen2.5-tokenizer_config.json", "", "<|im_end|>"),  # bos_token: null
        ("Qwen3-tokenizer_config.json", "", "<|im_end|>"),
        ("Meta-Llama-3-8B-Instruct-tokenizer_config.json", "<|begin_of_text|>", "<|eot_id|>"),
        ("gemma-3-chat_template.json", "", ""),  # chat_template.json carries no tokens
    ],
)
def test_json_files(name: str, bos: str, eos: str) -> None:
    template = load_chat_template(CONFIGS / name)
    assert template.source == _json(CONFIGS / name)["chat_template"]
    assert (template.bos_token, template.eos_token) == (bos, eos)
    assert template.path == str(CONFIGS / name)


def test_list_form_chat_template_takes_default(tmp_path: Path) -> None:
    # transformers' multi-template tokenizer_config form, built from two real templates.
    default = (LLAMACPP / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    tool_use = (LLAMACPP / "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja").read_text(encoding="utf-8")
    config = {
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False},
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": tool_use},
            {"name": "default", "template": default},
        ],
    }
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    template = load_chat_template(path)
    assert template.source == default
    assert template.bos_token == "<|begin_of_text|>"
    expected = _json(CHAT_TEMPLATES / "RENDERED.json")[
        "llama.cpp-models-templates/Qwen-Qwen2.5-7B-Instruct.jinja"
    ]
    assert template.render(CONVERSATIONS["system+user"]) == expected["system+user"]["text"]


def test_pinned_date_not_the_clock() -> None:
    # Llama-3.2 takes "Today Date" from strftime_now (Llama-3.1/3.3 hard-code "26 Jul 2024").
    path = LLAMACPP / "meta-llama-Llama-3.2-3B-Instruct.jinja"
    assert "Today Date: 26 Jul 2024\n" in load_chat_template(path).render(CONVERSATIONS["system+user"])
    later = load_chat_template(path, pinned_date=dt.date(2031, 2, 3))
    assert later.pinned_date == dt.date(2031, 2, 3)
    assert "Today Date: 03 Feb 2031\n" in later.render(CONVERSATIONS["system+user"])


def test_tojson_matches_transformers() -> None:
    # Llama-3.1 writes tools with `tojson(indent=4)`: no HTML escaping, non-ASCII kept (ensure_ascii=False).
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find <b>codes</b> & café names",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    template = load_chat_template(LLAMACPP / "meta-llama-Llama-3.1-8B-Instruct.jinja")
    text = template.render(CONVERSATIONS["system+user"], tools=[tool])
    assert json.dumps(tool, indent=4, ensure_ascii=False) in text


def test_generation_block_is_a_no_op() -> None:
    # Real templates using transformers' {% generation %} tag (phi4-reasoning, rnj-1 in the ollama dump).
    templates = _json(CHAT_TEMPLATES / "gguf_chat_templates_from_ollama_library.json")
    source = templates["library/phi4-reasoning:14b"]
    assert "{% generation %}" in source
    stripped = source.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    conv = CONVERSATIONS["user+assistant"]
    rendered = ChatTemplate(source=source, path="phi4").render(conv)
    assert rendered == ChatTemplate(source=stripped, path="phi4-stripped").render(conv)
    assert "<|im_start|>assistant<|im_sep|>Hi! How can I help?<|im_end|>" in rendered


# ---------------------------------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------------------------------


def _bad(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("tokenizer_config.json", b"{not json", "not valid JSON"),
        ("tokenizer_config.json", b"[1, 2]", "expected a JSON object"),
        (
            "tokenizer_config.json",
            b'{"chat_template": [{"name": "tool_use", "template": "x"}]}',
            "no 'default'",
        ),
        ("tokenizer_config.json", b'{"chat_template": 7}', "must be a string"),
        ("tokenizer_config.json", b'{"chat_template": "x", "bos_token": 5}', "unexpected bos_token"),
        ("broken.jinja", b"{% for m in %}{% endfor %}", "does not parse"),
        ("binary.jinja", b"\xff\xfe\x00{{ x }}", "not UTF-8"),
    ],
)
def test_bad_files_raise_template_error_naming_the_file(
    tmp_path: Path, name: str, content: bytes, needle: str
) -> None:
    path = _bad(tmp_path, name, content)
    with pytest.raises(TemplateError, match=re.escape(needle)) as info:
        load_chat_template(path)
    assert str(path) in str(info.value)
    assert info.value.fix


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "chat_template.jinja"
    with pytest.raises(TemplateError, match="not found") as info:
        load_chat_template(path)
    assert str(path) in str(info.value)


def test_directory_is_not_a_template(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="cannot read") as info:
        load_chat_template(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_config_without_chat_template() -> None:
    # The real Mistral-7B-v0.1 (base model) tokenizer_config.json has no chat_template.
    path = TOKENIZERS / "mistral-7b-v1/tokenizer_config.json"
    with pytest.raises(TemplateError, match="no chat_template key") as info:
        load_chat_template(path)
    assert str(path) in str(info.value)
    assert info.value.fix is not None and "raw_frame" in info.value.fix


def test_bad_sibling_config_is_reported(tmp_path: Path) -> None:
    shutil.copy(TOKENIZERS / "smollm/chat_template.jinja", tmp_path / "chat_template.jinja")
    _bad(tmp_path, "tokenizer_config.json", b"{oops")
    with pytest.raises(TemplateError, match="not valid JSON") as info:
        load_chat_template(tmp_path / "chat_template.jinja")
    assert str(tmp_path / "tokenizer_config.json") in str(info.value)


# ---------------------------------------------------------------------------------------------------
# Sandbox and render errors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ messages.__class__.__base__ }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}",
        "{{ messages[0].update({'content': 'x'}) }}",
    ],
)
def test_sandbox_blocks_escapes(source: str) -> None:
    template = ChatTemplate(source=source, path="evil.jinja")
    with pytest.raises(TemplateError, match="sandbox forbids") as info:
        template.render(CONVERSATIONS["system+user"])
    assert isinstance(info.value.__cause__, SecurityError)
    assert "evil.jinja" in str(info.value)


def test_sandbox_single_unsafe_attribute_leaks_nothing() -> None:
    # jinja2's sandbox turns one unsafe attribute into an undefined (renders empty), as on servers.
    template = ChatTemplate(source="[{{ ''.__class__ }}][{{ cycler.__init__ }}]", path="evil.jinja")
    assert template.render([]) == "[][]"


def test_raise_exception_names_template_and_message() -> None:
    template = ChatTemplate(source="{{ raise_exception('boom: no tools given') }}", path="raiser.jinja")
    with pytest.raises(TemplateError) as info:
        template.render(CONVERSATIONS["system+user"])
    assert "raiser.jinja" in str(info.value)
    assert "boom: no tools given" in str(info.value)


def test_render_failure_is_template_error() -> None:
    template = ChatTemplate(source="{{ messages[0]['content'] + 1 }}", path="typo.jinja")
    with pytest.raises(TemplateError, match="TypeError") as info:
        template.render(CONVERSATIONS["system+user"])
    assert "typo.jinja" in str(info.value)


# ---------------------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------------------

# (id, file, bos, eos, system, expected add_special_tokens)
FRAME_TEMPLATES = [
    ("smollm-chatml", TOKENIZERS / "smollm/chat_template.jinja", "<|im_start|>", "<|im_end|>", True, False),
    ("tinyllama-zephyr", TOKENIZERS / "llama2-tinyllama/chat_template.jinja", None, None, True, True),
    (
        "llama-2-chat",
        TOKENIZERS / "llama2-tinyllama/chat_template.llama-2-chat.jinja",
        None,
        None,
        True,
        False,
    ),
    ("mistral-inst", TOKENIZERS / "mistral-7b-v1/chat_template.jinja", None, None, True, False),
    ("mistral-v0.1", TOKENIZERS / "mistral-7b-v1/chat_template.v0.1.jinja", None, None, False, False),
    (
        "llama-3.1",
        LLAMACPP / "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
        False,
    ),
    ("qwen2.5-config", CONFIGS / "Qwen2.5-tokenizer_config.json", None, None, True, True),
    ("gemma-2", LLAMACPP / "google-gemma-2-2b-it.jinja", "<bos>", "<eos>", False, False),
]

FILLER_SENTENCE = " The harbour office logged each arriving vessel, its cargo and the tide."
CONTEXTS = [
    " Short.",
    "\n\nThe secret code is 4721.",
    " 这是第一段。\n\n这是第二段。",
    "\tTabs, émigré, emoji 🔥 and <|im_end|> look-alikes {{ stay }} literal.",
    FILLER_SENTENCE * 400 + "\n\nThe secret code is 4721." + FILLER_SENTENCE * 400,
]
USER_BEFORE = "Read the harbour log below and answer the question after it."
USER_AFTER = "\n\nQuestion: What is the secret code?"


def _load(path: Path, bos: str | None, eos: str | None) -> ChatTemplate:
    return load_chat_template(path, bos_token=bos, eos_token=eos)


@pytest.mark.parametrize(
    ("path", "bos", "eos", "with_system", "add_special"),
    [pytest.param(*rest, id=name) for name, *rest in FRAME_TEMPLATES],
)
def test_chat_frame_is_faithful(
    path: Path, bos: str | None, eos: str | None, with_system: bool, add_special: bool
) -> None:
    template = _load(path, bos, eos)
    system = "You are a careful reader." if with_system else None
    frame = chat_frame(
        template, system=system, user_before=USER_BEFORE, user_after=USER_AFTER, answer_prefix="Answer:"
    )
    assert frame.kind == "chat"
    assert frame.template_digest == template.digest
    assert frame.pinned_date == "2024-07-26"
    assert frame.add_special_tokens is add_special
    assert frame.prefix.endswith(USER_BEFORE) and not frame.prefix[-1].isspace()
    assert frame.suffix.startswith(USER_AFTER) and frame.suffix.endswith("Answer:")
    for context in CONTEXTS:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": USER_BEFORE + context + USER_AFTER})
        full = template.render(messages, add_generation_prompt=True) + "Answer:"
        assert frame.prefix + context + frame.suffix == full


def test_llama31_frame_carries_the_date_text() -> None:
    template = load_chat_template(LLAMACPP / "meta-llama-Llama-3.1-8B-Instruct.jinja")
    frame = chat_frame(template, system=None, user_before=USER_BEFORE, user_after=USER_AFTER)
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>" in frame.prefix
    assert frame.pinned_date == "2024-07-26"
    assert frame.suffix.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama32_frame_uses_the_pinned_date() -> None:
    path = LLAMACPP / "meta-llama-Llama-3.2-3B-Instruct.jinja"
    template = load_chat_template(path, pinned_date=dt.date(2025, 1, 9))
    frame = chat_frame(template, system="Be brief.", user_before=USER_BEFORE, user_after=USER_AFTER)
    assert "Today Date: 09 Jan 2025\n\nBe brief.<|eot_id|>" in frame.prefix
    assert frame.pinned_date == "2025-01-09"
    # The date is part of the prompt, so the same template with another date frames differently.
    assert (
        frame.prefix
        != chat_frame(
            load_chat_template(path), system="Be brief.", user_before=USER_BEFORE, user_after=USER_AFTER
        ).prefix
    )


def test_frame_without_surrounding_text_on_a_verbatim_template() -> None:
    template = load_chat_template(CONFIGS / "Qwen2.5-tokenizer_config.json")
    frame = chat_frame(template, system="Be brief.", user_before="", user_after="")
    assert frame.prefix.endswith("<|im_start|>user\n")
    assert frame.suffix == "<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "path",
    [TOKENIZERS / "mistral-7b-v1/chat_template.v0.1.jinja", LLAMACPP / "google-gemma-2-2b-it.jinja"],
    ids=["mistral-v0.1", "gemma-2"],
)
def test_system_message_rejected_is_explained(path: Path) -> None:
    template = load_chat_template(path)
    with pytest.raises(TemplateError, match="system message") as info:
        chat_frame(template, system="You are careful.", user_before=USER_BEFORE, user_after=USER_AFTER)
    assert info.value.field == "system"
    assert info.value.fix is not None and "system=None" in info.value.fix
    assert str(path) in str(info.value)


def test_template_that_raises_anyway_keeps_its_own_error() -> None:
    # firefunction-v2 needs `functions`; dropping the system turn does not help, so no system hint.
    path = LLAMACPP / "fireworks-ai-llama-3-firefunction-v2.jinja"
    with pytest.raises(TemplateError, match="'functions' is undefined") as info:
        chat_frame(load_chat_template(path), system="Hi.", user_before=USER_BEFORE, user_after=USER_AFTER)
    assert info.value.field != "system"
    assert str(path) in str(info.value)


def test_trimming_template_cannot_frame_an_edge_slot() -> None:
    # Llama-3.1 trims message content: a slot at the very start of the user turn would lose the
    # context's leading whitespace, so the frame proof must refuse it.
    template = load_chat_template(LLAMACPP / "meta-llama-Llama-3.1-8B-Instruct.jinja")
    with pytest.raises(TemplateError, match="transforms the user content") as info:
        chat_frame(template, system=None, user_before="", user_after=USER_AFTER)
    assert str(template.path) in str(info.value)


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", "found 0 times"),
        ("{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}", "found 2 times"),
        (r"{% for m in messages %}{{ m['content'] | replace('\n', ' ') }}{% endfor %}", "transforms"),
        ("{% for m in messages %}{{ m['content'] | e }}{% endfor %}", "transforms"),
    ],
)
def test_transforming_templates_are_refused(source: str, needle: str) -> None:
    template = ChatTemplate(source=source, path="transform.jinja")
    with pytest.raises(TemplateError, match=needle) as info:
        chat_frame(template, system=None, user_before="Read:", user_after=" Q?")
    assert "transform.jinja" in str(info.value)


def test_sentinel_in_case_text_is_refused() -> None:
    template = load_chat_template(CONFIGS / "Qwen2.5-tokenizer_config.json")
    with pytest.raises(TemplateError, match="sentinel") as info:
        chat_frame(template, system=None, user_before="x" + SLOT_SENTINEL, user_after="")
    assert info.value.field == "user_before"


def test_raw_frame() -> None:
    frame = raw_frame(user_before="Document:", user_after="\n\nQ: code?", answer_prefix="\nA:")
    assert (frame.prefix, frame.suffix, frame.kind) == ("Document:", "\n\nQ: code?\nA:", "raw")
    assert frame.add_special_tokens is True
    assert frame.pinned_date == ""
    assert len(frame.template_digest) == 64
    other = raw_frame(user_before="x", user_after="y", add_special_tokens=False)
    assert other.template_digest == frame.template_digest  # describes the framing, not the text
    assert other.add_special_tokens is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        frame.prefix = "changed"  # type: ignore[misc]
    assert isinstance(frame, Frame)

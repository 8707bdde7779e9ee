"""Conversation frames (issue 25): a multi-turn chat rendered by each real template shipped in the
fixtures, split around one slot per turn and proved faithful turn by turn; templates that drop, trim
or rewrite earlier turns are refused by name. Every template here is a real file from
tests/fixtures/tokenizers; the one derived template changes only the multi-turn part of a real one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from depthgate.exceptions import SpecError, TemplateError
from depthgate.layout.conversation import TURN_LEADS, conversation_frame, conversation_messages, turn_roles
from depthgate.layout.templates import ChatTemplate, load_chat_template
from fixtures_paths import llamacpp_templates_dir, tokenizer_configs_dir, tokenizers_dir

TOKENIZERS = tokenizers_dir()
LLAMACPP = llamacpp_templates_dir()
CONFIGS = tokenizer_configs_dir()

# (id, file, bos, eos, takes a system turn)
CONVERSATION_TEMPLATES = [
    ("smollm-chatml", TOKENIZERS / "smollm/chat_template.jinja", "<|im_start|>", "<|im_end|>", True),
    ("tinyllama-zephyr", TOKENIZERS / "llama2-tinyllama/chat_template.jinja", None, None, True),
    ("llama-2-chat", TOKENIZERS / "llama2-tinyllama/chat_template.llama-2-chat.jinja", None, None, True),
    ("mistral-inst", TOKENIZERS / "mistral-7b-v1/chat_template.jinja", None, None, True),
    ("mistral-v0.1", TOKENIZERS / "mistral-7b-v1/chat_template.v0.1.jinja", None, None, False),
    ("mistral-nemo", LLAMACPP / "mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", False),
    (
        "llama-3.1",
        LLAMACPP / "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
    ),
    (
        "llama-3.2",
        LLAMACPP / "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
    ),
    (
        "llama-3.3",
        LLAMACPP / "meta-llama-Llama-3.3-70B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
    ),
    ("llama-3-config", CONFIGS / "Meta-Llama-3-8B-Instruct-tokenizer_config.json", None, None, True),
    ("qwen2.5-config", CONFIGS / "Qwen2.5-tokenizer_config.json", None, None, True),
    ("qwen2.5-llamacpp", LLAMACPP / "Qwen-Qwen2.5-7B-Instruct.jinja", None, None, True),
    ("gemma-2", LLAMACPP / "google-gemma-2-2b-it.jinja", "<bos>", "<eos>", False),
    ("gemma-3", CONFIGS / "gemma-3-chat_template.json", "<bos>", "<eos>", True),
    ("phi-3.5", LLAMACPP / "microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>", True),
    (
        "hermes-3",
        LLAMACPP / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "<|begin_of_text|>",
        None,
        True,
    ),
]

USER_BEFORE = "Read the harbour log below and answer the question after it."
USER_AFTER = "\n\nQuestion: What is the secret code?"
CONTENTS = [
    " The harbour office logged each arriving vessel, its cargo and the tide.",
    "\n\nSection 2. The secret code is 4721.",
    " 这是第一段。\n\n这是第二段。",
    "\tTabs, émigré, emoji 🔥 and <b>{{ stay }}</b> literal.",
    " The last entry closes the log.",
]


def _load(path: Path, bos: str | None, eos: str | None) -> ChatTemplate:
    return load_chat_template(path, bos_token=bos, eos_token=eos)


def _assembled(prefix: str, separators: tuple[str, ...], suffix: str, contents: list[str]) -> str:
    out = prefix + contents[0]
    for sep, content in zip(separators, contents[1:], strict=True):
        out += sep + content
    return out + suffix


@pytest.mark.parametrize(
    ("path", "bos", "eos", "with_system"),
    [pytest.param(*rest, id=name) for name, *rest in CONVERSATION_TEMPLATES],
)
def test_conversation_frame_is_faithful_turn_by_turn(
    path: Path, bos: str | None, eos: str | None, with_system: bool
) -> None:
    template = _load(path, bos, eos)
    system = "You are a careful reader." if with_system else None
    frame = conversation_frame(
        template,
        turns=5,
        system=system,
        user_before=USER_BEFORE,
        user_after=USER_AFTER,
        answer_prefix="Answer:",
    )
    assert frame.roles == ("user", "assistant", "user", "assistant", "user")
    assert len(frame.separators) == 4
    # Each separator ends with the next turn's fixed lead, so trimming templates keep the split.
    for sep, role in zip(frame.separators, frame.roles[1:], strict=True):
        assert sep.endswith(TURN_LEADS[role])
    assert frame.suffix.startswith(USER_AFTER) and frame.suffix.endswith("Answer:")
    for shift in range(len(CONTENTS)):
        contents = CONTENTS[shift:] + CONTENTS[:shift]
        messages = conversation_messages(
            contents, system=system, user_before=USER_BEFORE, user_after=USER_AFTER
        )
        expected = template.render(messages) + "Answer:"
        assert _assembled(frame.prefix, frame.separators, frame.suffix, contents) == expected


@pytest.mark.parametrize(
    "path",
    [
        LLAMACPP / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
        LLAMACPP / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        CONFIGS / "Qwen3-tokenizer_config.json",
    ],
    ids=["deepseek-r1-llama", "deepseek-r1-qwen", "qwen3"],
)
def test_template_stripping_reasoning_from_past_turns_is_refused_by_name(path: Path) -> None:
    template = load_chat_template(path)
    # One turn is a single slot: nothing earlier to rewrite, so it frames.
    conversation_frame(template, turns=1, system=None, user_before=USER_BEFORE, user_after=USER_AFTER)
    with pytest.raises(TemplateError, match=r"turn 2 \(assistant, a past turn\).*strips reasoning") as info:
        conversation_frame(template, turns=3, system=None, user_before=USER_BEFORE, user_after=USER_AFTER)
    assert info.value.field == "chat_template"
    assert "shape" in (info.value.fix or "")


def _derived(source: Path, old: str, new: str, name: str) -> ChatTemplate:
    """A real template with only its multi-turn handling changed (``old`` must occur once)."""
    text = source.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{source.name}: the edited part is not unique"
    return ChatTemplate(
        source=text.replace(old, new), path=name, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )


SMOLLM = TOKENIZERS / "smollm/chat_template.jinja"


def test_template_dropping_earlier_turns_is_refused_by_name() -> None:
    # SmolLM's ChatML template keeping only the last three messages (a context-window "upgrade").
    template = _derived(
        SMOLLM, "{% for message in messages %}", "{% for message in messages[-3:] %}", "last3"
    )
    conversation_frame(template, turns=3, system=None, user_before=USER_BEFORE, user_after=USER_AFTER)
    with pytest.raises(
        TemplateError, match=r"drops or repeats earlier turns of a 5-turn conversation \(3 of 5"
    ):
        conversation_frame(template, turns=5, system=None, user_before=USER_BEFORE, user_after=USER_AFTER)


def test_template_trimming_past_turns_is_refused_by_name() -> None:
    # SmolLM's ChatML template trimming every message but the last one.
    template = _derived(
        SMOLLM,
        "message['content'] + '<|im_end|>'",
        "(message['content'] | trim if not loop.last else message['content']) + '<|im_end|>'",
        "trim-past",
    )
    with pytest.raises(TemplateError, match=r"turn 1 \(user\): the template trims the turn's content"):
        conversation_frame(template, turns=3, system=None, user_before="", user_after=USER_AFTER)


@pytest.mark.parametrize("turns", [0, 2, 4, -1, 256, True])
def test_turn_count_must_be_odd_and_bounded(turns: int) -> None:
    template = load_chat_template(SMOLLM)
    with pytest.raises(SpecError, match="odd number of turns") as info:
        conversation_frame(template, turns=turns, system=None, user_before=USER_BEFORE, user_after=USER_AFTER)
    assert info.value.field == "turns"


def test_roles_alternate_and_end_with_the_user() -> None:
    assert turn_roles(1) == ("user",)
    assert turn_roles(5) == ("user", "assistant", "user", "assistant", "user")

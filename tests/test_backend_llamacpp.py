"""The embedded llama.cpp backend on the real Gemma-3-270M GGUF (no mocks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'depthgate[embedded]')"
)

from tokenizers import Tokenizer

from depthgate.exceptions import DepthgateError, InputError
from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf
from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend, Generation

pytestmark = pytest.mark.smoke_model

N_CTX = 1024

_FILLER = [
    "Warehouse staff must report any changes to open maintenance tickets in the first week of each month.",
    "Procurement staff should review equipment loan forms before the monthly close.",
    "Printed copies of this handbook may be out of date.",
    "Legal staff must verify parking permit requests when the request is approved.",
    "Internal audit staff must report any changes to meeting room bookings.",
    "All forms referenced in this section are available on the intranet.",
]
FACT = "The access code for vault 7 is 4821."
CLOZE = "The access code for vault 7 is"


def _prompt() -> str:
    body = " ".join(_FILLER[:4]) + " " + FACT + " " + " ".join(_FILLER[2:] + _FILLER[:3])
    return (
        "Company Operations Handbook (excerpt)\n\n"
        f"Section 1. Security.\n{body}\n\n"
        "Question: What is the access code for vault 7?\n"
        f"Answer: {CLOZE}"
    )


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tokenizer_from_gguf(gemma_default_gguf())


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> Iterator[EmbeddedLlamaBackend]:
    with EmbeddedLlamaBackend(n_ctx=N_CTX, tokenizer=tokenizer) as be:
        yield be


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(_prompt(), add_special_tokens=True).ids
    assert 120 <= len(ids) <= 260, len(ids)
    return list(ids)


def _without_timings(g: Generation) -> Generation:
    return dataclasses.replace(g, prompt_seconds=0.0, decode_seconds=0.0)


def test_backend_loads_with_verified_tokenizer(backend: EmbeddedLlamaBackend) -> None:
    assert backend.probe_report.ok and backend.probe_report.n_probes >= 80
    assert backend.window == backend.max_model_len == N_CTX
    assert backend.n_ctx_train == 32768
    assert 2 <= backend.n_threads <= 8
    assert not backend.reuse_prefix


def test_planted_fact_is_retrieved_deterministically(
    backend: EmbeddedLlamaBackend, prompt_ids: list[int]
) -> None:
    first = backend.generate(prompt_ids, max_tokens=8, seed=11)
    second = backend.generate(prompt_ids, max_tokens=8, seed=11)
    assert "4821" in first.text, first
    assert _without_timings(first) == _without_timings(second)
    assert first.n_prompt_tokens == len(prompt_ids)
    assert first.prefix_cache_hit_tokens == 0
    assert first.finish_reason in ("stop", "length", "eos")
    assert 1 <= len(first.completion_token_ids) <= 8
    assert "\n" not in first.text
    # The completion's text is the text of its tokens (up to the stopping newline).
    decoded = backend.tokenizer.decode(list(first.completion_token_ids), skip_special_tokens=True)
    assert decoded.split("\n", 1)[0] == first.text


def test_finish_reasons(backend: EmbeddedLlamaBackend, prompt_ids: list[int]) -> None:
    short = backend.generate(prompt_ids, max_tokens=2, seed=0)
    assert short.finish_reason == "length" and len(short.completion_token_ids) == 2
    stopped = backend.generate(prompt_ids, max_tokens=12, seed=0)
    if stopped.finish_reason == "stop":
        newline_piece = backend.tokenizer.decode([stopped.completion_token_ids[-1]])
        assert "\n" in newline_piece


def test_seeded_sampling_is_reproducible(backend: EmbeddedLlamaBackend, prompt_ids: list[int]) -> None:
    a = backend.generate(prompt_ids, max_tokens=6, seed=123, temperature=0.9, stop_at_newline=False)
    b = backend.generate(prompt_ids, max_tokens=6, seed=123, temperature=0.9, stop_at_newline=False)
    assert a.completion_token_ids == b.completion_token_ids
    assert len(a.completion_token_ids) == 6 or a.finish_reason == "eos"


def test_over_length_prompt_is_refused_before_evaluation(
    backend: EmbeddedLlamaBackend, prompt_ids: list[int]
) -> None:
    filler = prompt_ids[1:] * (N_CTX // len(prompt_ids) + 2)
    too_long = [prompt_ids[0], *filler][: N_CTX + 5]
    with pytest.raises(InputError) as info:
        backend.generate(too_long, max_tokens=4, seed=0)
    assert info.value.fix and "context window" in str(info.value)
    # Fits alone, but not with the completion budget: still refused, never truncated.
    edge = too_long[: N_CTX - 3]
    with pytest.raises(InputError):
        backend.generate(edge, max_tokens=4, seed=0)
    # The backend is still usable afterwards.
    assert "4821" in backend.generate(prompt_ids, max_tokens=8, seed=0).text


@pytest.mark.parametrize(
    ("ids", "max_tokens"),
    [([], 4), ([2, 10**9], 4), ([2, -1], 4), ([2, 9259], 0)],
    ids=["empty", "id-too-large", "negative-id", "zero-max-tokens"],
)
def test_bad_requests_are_input_errors(
    backend: EmbeddedLlamaBackend, ids: list[int], max_tokens: int
) -> None:
    with pytest.raises(InputError):
        backend.generate(ids, max_tokens=max_tokens, seed=0)


def test_prefix_reuse_is_explicit_and_recorded(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    with EmbeddedLlamaBackend(n_ctx=N_CTX, tokenizer=tokenizer, reuse_prefix=True) as be:
        assert be.reuse_prefix
        cold = be.generate(prompt_ids, max_tokens=8, seed=0)
        warm = be.generate(prompt_ids, max_tokens=8, seed=0)
        assert cold.prefix_cache_hit_tokens == 0
        assert warm.prefix_cache_hit_tokens == len(prompt_ids) - 1
        assert warm.n_prompt_tokens == cold.n_prompt_tokens == len(prompt_ids)
        assert "4821" in warm.text
        # A different prompt sharing only the first tokens reuses exactly that prefix.
        other = prompt_ids[:20] + tokenizer.encode(" Unrelated text follows.", add_special_tokens=False).ids
        cached = prompt_ids + list(warm.completion_token_ids[:-1])
        common = next(i for i, (a, b) in enumerate(zip([*other, -1], cached, strict=False)) if a != b)
        assert 20 <= common < len(other)
        assert be.generate(other, max_tokens=2, seed=0).prefix_cache_hit_tokens == common


def test_missing_model_file_is_input_error() -> None:
    with pytest.raises(DepthgateError) as info:
        EmbeddedLlamaBackend("/nonexistent/model.gguf", n_ctx=256)
    assert isinstance(info.value, InputError)
    assert info.value.file == "/nonexistent/model.gguf"

"""Backends: one class per serving path, and :func:`make_backend`, which picks one for a system.

The factory lives here, above the classes it builds, so ``base`` (the protocol, requests, responses,
errors) imports none of its implementations.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from depthgate.exceptions import InputError
from depthgate.run.backends.base import Backend
from depthgate.run.backends.factories import (
    BackendFactory,
    BuildContext,
    embedded_model_path,
    tokenizer_for,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from depthgate.run.backends.http import HTTPOptions
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend
    from depthgate.spec.system import DecodeParams, System

__all__ = [
    "determinism_settings",
    "factory_for",
    "make_backend",
    "make_cache_control_backends",
    "probe_backend",
]


def _base(base_dir: str | os.PathLike[str] | None) -> Path | None:
    return None if base_dir is None else Path(base_dir)


def factory_for(system: System) -> BackendFactory:
    """The run-side factory the arm's serving path names (:mod:`depthgate.spec.backend_kinds`)."""
    module_name, _, attribute = system.serving.factory.partition(":")
    factory = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(factory, BackendFactory):
        raise TypeError(f"{system.serving.factory} is not a BackendFactory")
    return factory


def make_backend(
    system: System,
    *,
    tokenizer: Tokenizer | None = None,
    api_key_env: str | None = None,
    prompt_format: Literal["token_ids", "text"] | None = None,
    api: Literal["chat", "completions"] | None = None,
    http_options: HTTPOptions | None = None,
    n_threads: int | None = None,
    reuse_prefix: bool | None = None,
    vllm_kwargs: Mapping[str, Any] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> Backend:
    """The backend of one system (one arm), configured by its ``runtime`` block, built by the factory its
    serving path names (:mod:`depthgate.spec.backend_kinds`, :mod:`depthgate.run.backends.factories`).

    * ``llamacpp`` without endpoint: llama.cpp in process (:class:`EmbeddedBackendAdapter`); ``model`` is
      a ``.gguf`` path or ``"gemma3-270m"`` (the packaged default); ``window`` sets ``n_ctx`` (default
      4096); ``runtime.n_threads``, ``runtime.reuse_prefix``. With an endpoint: an OpenAI-compatible
      ``/v1/completions`` server; ``llama-server`` accepts token ids (the default), the llama-cpp-python
      server only text (``runtime.prompt_format = "text"``).
    * ``vllm``: :class:`~depthgate.run.backends.vllm_offline.VLLMOfflineBackend` (token ids); engine
      arguments from ``runtime.vllm`` (``tensor_parallel_size``, ``max_model_len``, …).
    * ``vllm-server``: :class:`~depthgate.run.backends.http.OpenAICompletionsBackend` (token ids,
      ``return_token_ids``, ``max_model_len`` from ``/v1/models``).
    * ``openai``: :class:`~depthgate.run.backends.chat.OpenAIChatBackend` (text; the chat framing is
      calibrated with the system's tokenizer; ``runtime.api = "completions"`` for a compatible server that
      takes token ids). Key from ``OPENAI_API_KEY`` (or ``runtime.api_key_env``); required for
      api.openai.com, optional for a self-hosted endpoint.
    * ``anthropic``: :class:`~depthgate.run.backends.chat.AnthropicBackend`; key from ``ANTHROPIC_API_KEY``
      (or ``runtime.api_key_env``), always required.
    * ``endpoints = [...]`` (several replicas of one model behind a ``/v1/completions`` arm): a
      :class:`~depthgate.run.backends.pool.ReplicaPool` over one completions backend per endpoint, each
      with the arm's settings (``runtime.concurrency`` is then per endpoint).

    Relative paths (a ``.gguf`` model, a tokenizer, vLLM's ``tokenizer``/``download_dir``) are taken
    relative to ``base_dir``, the matrix file's folder (the working directory when ``None``). The keyword
    arguments override the runtime block (programmatic use); ``http_options`` is the base the block's
    HTTP settings (timeouts, tolerance, pool, concurrency, ``allow_insecure_key``) are applied to. An API
    key is never attached to plain http to a non-loopback host unless ``runtime.allow_insecure_key``
    (:class:`~depthgate.exceptions.InputError`). Retries are the runner's
    (:class:`~depthgate.run.retry.RetryPolicy`), never the backend's.
    """
    overrides: dict[str, Any] = {
        name: value
        for name, value in (
            ("api_key_env", api_key_env),
            ("prompt_format", prompt_format),
            ("api", api),
            ("n_threads", n_threads),
            ("reuse_prefix", reuse_prefix),
        )
        if value is not None
    }
    if overrides:  # the keyword arguments win over the runtime block (not re-validated: programmatic use)
        system = system.model_copy(update={"runtime": system.runtime.model_copy(update=overrides)})
    context = BuildContext(
        base_dir=_base(base_dir), tokenizer=tokenizer, http_options=http_options, vllm_kwargs=vllm_kwargs
    )
    backend = factory_for(system).build(system, context)
    if bool(backend.accepts_token_ids) != system.serving.sends_token_ids(system.runtime.prompt_format):
        raise TypeError(  # a factory that disagrees with its descriptor is a bug, never a user error
            f"{system.serving.factory} built a backend that takes "
            f"{'ids' if backend.accepts_token_ids else 'text'}, not what {system.serving.label} takes"
        )
    return backend


async def probe_backend(backend: Backend) -> None:
    """Probe ``backend`` before its first request, where it can be: every endpoint of a
    :class:`~depthgate.run.backends.pool.ReplicaPool` (served model; windows must agree, else
    :class:`~depthgate.exceptions.InputError`, exit 20), or one ``/v1/completions`` endpoint (served
    model, ``max_model_len``), so that the pre-send checks see the served window. An endpoint that cannot
    be reached is left to the run (the runner's retries and circuit breaker: INFRA, exit 30); refusals
    (a model not served, replicas that disagree) raise. Closes the HTTP clients it opened (the run opens
    its own in its event loop)."""
    from depthgate.exceptions import TransientBackendError
    from depthgate.run.backends.http import OpenAICompletionsBackend
    from depthgate.run.backends.pool import ReplicaPool

    if isinstance(backend, ReplicaPool):
        try:
            await backend.probe_all()
        finally:
            await backend.aclose()
    elif isinstance(backend, OpenAICompletionsBackend):
        try:
            await backend.probe()
        except TransientBackendError:
            pass  # the run's retries and breaker decide; the first request probes again
        finally:
            await backend.aclose()


def make_cache_control_backends(
    system: System,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    tokenizer: Tokenizer | None = None,
) -> tuple[LlamaWorkerBackend, LlamaWorkerBackend]:
    """The two embedded backends of the prefix-cache control (:func:`depthgate.run.cache.run_cache_control`)
    for an embedded ``llamacpp`` system: cold (prefix reuse off) and warm (on), same model, window,
    tokenizer and threads as the system's own backend. The caller closes both."""
    if not system.serving.accepts("cache_control"):
        raise InputError(
            f"the prefix-cache control runs on the embedded llamacpp backend, not {system.serving.label}",
            field=f"{system.name}.runtime.cache_control",
            fix="remove cache_control from this arm",
        )
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    base = _base(base_dir)
    model = embedded_model_path(system, base)
    tok = tokenizer if tokenizer is not None else tokenizer_for(system, base)
    n_ctx = system.window or 4096
    threads = system.runtime.n_threads
    cold = LlamaWorkerBackend(model, n_ctx=n_ctx, tokenizer=tok, n_threads=threads, reuse_prefix=False)
    try:
        warm = LlamaWorkerBackend(
            model, n_ctx=n_ctx, tokenizer=cold.tokenizer, n_threads=threads, reuse_prefix=True
        )
    except BaseException:
        cold.close()
        raise
    return cold, warm


def determinism_settings(system: System, decode: DecodeParams) -> dict[str, Any]:
    """What decides whether this arm answers the same request the same way twice, as far as depthgate
    can know it before the first request (recorded in the run manifest, per arm; never part of its
    digest, so a resume on a machine with another core count is not refused for it). Temperature-0
    serving is not deterministic under batching (vLLM #51187): an A/A run (``--aa``) measures what
    these settings allow. Nothing here is secret (the API key's variable is not even named)."""
    greedy = decode.temperature == 0.0
    out: dict[str, Any] = {
        "backend": system.backend,
        "sampling": "greedy (argmax)"
        if greedy
        else f"temperature {decode.temperature:g}, seeded per request",
        "seeds": list(decode.seeds),
    }
    out.update(factory_for(system).determinism(system, greedy))
    return out

"""Backends: one class per serving path, and :func:`make_backend`, which picks one for a system.

The factory lives here, above the classes it builds, so ``base`` (the protocol, requests, responses,
errors) imports none of its implementations.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from depthgate.exceptions import InputError
from depthgate.run.backends.base import Backend, EmbeddedBackendAdapter, api_key_from_env

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from depthgate.run.backends.http import HTTPOptions
    from depthgate.spec.models import System

__all__ = ["make_backend"]


def _tokenizer_for(system: System, model_path: Path | None) -> Tokenizer | None:
    """The tokenizer named by ``system.tokenizer``: ``gguf:`` (from the model), ``gguf:<path>`` or a
    ``tokenizer.json`` path. ``None`` = let the embedded backend convert it from the model."""
    spec = system.tokenizer
    if spec == "gguf:":
        return None
    from depthgate.layout.gguf_tokenizer import tokenizer_from_gguf

    if spec.startswith("gguf:"):
        return tokenizer_from_gguf(spec[len("gguf:") :])
    from tokenizers import Tokenizer

    path = Path(spec)
    if not path.is_file():
        raise InputError(
            "tokenizer file not found",
            file=str(path),
            field=f"{system.name}.tokenizer",
            fix='give a tokenizer.json path, or "gguf:" to read it from the GGUF model',
        )
    return Tokenizer.from_file(str(path))


_DEFAULT_MODEL_NAMES = frozenset({"default", "gemma3-270m", "gemma-3-270m", "gemma3-270m-q4-k-m"})

_DEFAULT_KEY_ENV: Mapping[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


def make_backend(
    system: System,
    *,
    tokenizer: Tokenizer | None = None,
    api_key_env: str | None = None,
    prompt_format: Literal["token_ids", "text"] | None = None,
    api: Literal["chat", "completions"] | None = None,
    http_options: HTTPOptions | None = None,
    n_threads: int | None = None,
    reuse_prefix: bool = False,
    vllm_kwargs: Mapping[str, Any] | None = None,
) -> Backend:
    """The backend of one system (one arm).

    * ``llamacpp`` without endpoint: llama.cpp in process (:class:`EmbeddedBackendAdapter`); ``model`` is
      a ``.gguf`` path or ``"gemma3-270m"`` (the packaged default); ``window`` sets ``n_ctx`` (default
      4096). With an endpoint: an OpenAI-compatible ``/v1/completions`` server; ``llama-server`` accepts
      token ids (the default), the llama-cpp-python server only text (pass ``prompt_format="text"``).
    * ``vllm``: :class:`~depthgate.run.backends.vllm_offline.VLLMOfflineBackend` (token ids).
    * ``vllm-server``: :class:`~depthgate.run.backends.http.OpenAICompletionsBackend` (token ids,
      ``return_token_ids``, ``max_model_len`` from ``/v1/models``).
    * ``openai``: :class:`~depthgate.run.backends.http.OpenAIChatBackend` (text; ``api="completions"`` for a
      compatible server that takes token ids). Key from ``OPENAI_API_KEY`` (or ``api_key_env``); required
      for api.openai.com, optional for a self-hosted endpoint.
    * ``anthropic``: :class:`~depthgate.run.backends.http.AnthropicBackend`; key from ``ANTHROPIC_API_KEY``
      (or ``api_key_env``), always required.

    ``http_options`` (timeouts, count tolerance, pool size) apply to every HTTP backend; retries are the
    runner's (:class:`~depthgate.run.retry.RetryPolicy`), never the backend's.
    """
    kind = system.backend
    if kind == "llamacpp" and system.endpoint is None:
        from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend

        model_path = None if system.model in _DEFAULT_MODEL_NAMES else Path(system.model)
        tok = tokenizer if tokenizer is not None else _tokenizer_for(system, model_path)
        embedded = EmbeddedLlamaBackend(
            model_path,
            n_ctx=system.window or 4096,
            tokenizer=tok,
            reuse_prefix=reuse_prefix,
            n_threads=n_threads,
        )
        return EmbeddedBackendAdapter(embedded, name=system.name)
    if kind == "vllm":
        from depthgate.run.backends.vllm_offline import VLLMOfflineBackend

        return VLLMOfflineBackend(
            system.model, name=system.name, window=system.window, engine_kwargs=dict(vllm_kwargs or {})
        )

    from depthgate.run.backends import http as http_backends

    if kind == "anthropic":
        key = api_key_from_env(api_key_env or _DEFAULT_KEY_ENV["anthropic"], what="Anthropic")
        return http_backends.AnthropicBackend(
            system.model,
            base_url=system.endpoint or http_backends.ANTHROPIC_URL,
            api_key=key,
            name=system.name,
            window=system.window,
            options=http_options,
        )
    if kind == "openai" and (api or "chat") == "chat":
        env = api_key_env or _DEFAULT_KEY_ENV["openai"]
        key = api_key_from_env(env, required=system.endpoint is None, what="OpenAI")
        return http_backends.OpenAIChatBackend(
            system.model,
            base_url=system.endpoint or http_backends.OPENAI_URL,
            api_key=key,
            name=system.name,
            window=system.window,
            options=http_options,
        )
    # OpenAI-compatible /v1/completions: vllm-server, llamacpp with an endpoint, openai with api="completions"
    endpoint = system.endpoint or http_backends.OPENAI_URL
    key = None
    if api_key_env is not None:
        key = api_key_from_env(api_key_env, what=endpoint)
    elif kind == "openai":
        key = api_key_from_env(_DEFAULT_KEY_ENV["openai"], required=system.endpoint is None, what="OpenAI")
    fmt = prompt_format or "token_ids"
    return http_backends.OpenAICompletionsBackend(
        system.model,
        base_url=endpoint,
        api_key=key,
        name=system.name,
        window=system.window,
        prompt_format=fmt,
        vllm=kind == "vllm-server",
        options=http_options,
    )

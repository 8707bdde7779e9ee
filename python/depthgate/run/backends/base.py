"""The typed protocol every backend implements (the factory, :func:`depthgate.run.backends.make_backend`,
sits one level up; the error classes below live in the one exception tree, :mod:`depthgate.exceptions`).

A backend turns one :class:`Request` (a layout, an arm, a seed and the decode parameters) into one
:class:`Response`. Every backend is async; a backend that is synchronous underneath (llama.cpp in
process, vLLM offline) runs its calls one at a time in a dedicated worker thread.

Errors a backend raises, and what the runner does with them:

* :class:`EngineCrashError` (the embedded engine's worker process died by a signal): not retried; the
  request in flight is recorded as ``infra_error``, the arm stops sending, the run ends INFRA (exit 30)
  with its reports, and a rerun resumes.
* :class:`TransientBackendError` (HTTP 429/5xx, timeouts, refused connections, an engine error): retried
  by the runner with the run's one policy (:mod:`depthgate.run.retry`); a job still failing is recorded
  as ``infra_error`` and re-run on resume.
* :class:`OverLengthError` (the server refused the prompt as longer than its window): a *system* failure
  of the layout, recorded as ``system_fail`` with reason ``overflow``; never retried.
* :class:`BackendRequestError` (any other refused request: 4xx, an unknown model, a bad parameter): the
  caller's configuration is wrong; the run stops with the records written so far kept.

API keys are read from the environment only (:func:`api_key_from_env`) and held in a :class:`Secret`
whose ``repr`` and ``str`` never show the value.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from depthgate.exceptions import (
    BackendError,
    BackendRequestError,
    EngineCrashError,
    InfraError,
    InputError,
    OverLengthError,
    TransientBackendError,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy.typing as npt

    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    EmbeddedEngine: TypeAlias = EmbeddedLlamaBackend | LlamaWorkerBackend

__all__ = [
    "Backend",
    "EmbeddedBackendAdapter",
    "OneThreadEngine",
    "Request",
    "Response",
    "Secret",
    "api_key_from_env",
    "check_fits_window",
    "endpoint_url",
]

T = TypeVar("T")

# --------------------------------------------------------------------------------------------------
# the pre-send window check


def check_fits_window(
    n_prompt: int | None, max_tokens: int, window: int | None, *, said: str, summary: str
) -> None:
    """Refuse a request before it is sent when its ``n_prompt`` tokens plus ``max_tokens`` exceed ``window``
    (nothing to check when either is unknown): :class:`OverLengthError` with ``said`` (a template over
    ``{n}``, ``{max_tokens}`` and ``{window}``) followed by "; not sent"."""
    if window is None or n_prompt is None or n_prompt + max_tokens <= window:
        return
    raise OverLengthError(
        said.format(n=n_prompt, max_tokens=max_tokens, window=window) + "; not sent",
        n_prompt_tokens=n_prompt,
        window=window,
        summary=summary,
        fix="shorten the layout or lower max_tokens",
    )


# --------------------------------------------------------------------------------------------------
# secrets


class Secret:
    """A credential. ``repr``/``str`` show ``Secret('***')``; only :meth:`reveal` gives the value."""

    __slots__ = ("__value", "env_var")

    def __init__(self, value: str, *, env_var: str) -> None:
        self.__value = value
        self.env_var = env_var

    def reveal(self) -> str:
        return self.__value

    def redact(self, text: str) -> str:
        """``text`` with every occurrence of the value replaced by ``***``."""
        return text.replace(self.__value, "***") if self.__value else text

    def __repr__(self) -> str:
        return f"Secret(env_var={self.env_var!r}, value='***')"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # never pickled into a subprocess or a cache by accident
        raise TypeError("a Secret cannot be pickled")


def api_key_from_env(env_var: str, *, required: bool = True, what: str = "the API") -> Secret | None:
    """The API key in environment variable ``env_var``. Missing and ``required`` → :class:`InfraError`
    naming the variable (never a value)."""
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", env_var):
        raise InputError(
            f"{env_var!r} is not an environment variable name",
            field="api_key_env",
            fix="give the NAME of the variable that holds the key, never the key itself",
        )
    value = os.environ.get(env_var, "").strip()
    if not value:
        if required:
            raise InfraError(
                f"no API key for {what}: environment variable {env_var} is not set",
                field=env_var,
                fix=f"export {env_var}=<your key> before the run (keys are never read from spec files)",
            )
        return None
    return Secret(value, env_var=env_var)


def endpoint_url(url: str) -> str:
    """``url`` as records name an endpoint: scheme, host (bracketed IPv6), port and path, without any
    ``user:password@``, query or fragment."""
    parts = urlsplit(str(url))
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# --------------------------------------------------------------------------------------------------
# request / response / protocol


@dataclass(frozen=True)
class Request:
    """One generation request. ``token_ids`` is the exact prompt for backends that accept ids,
    ``text`` its rendered text for text-only backends (at least one must be given). ``token_ids`` is
    a list of ints, or a 1-D numpy integer array for a backend that sets ``accepts_id_array`` (the
    HTTP backends: the array is serialized as is, no per-request int list of ≈ 36 B per id).

    ``affinity``: requests with the same affinity share most of their prompt (the runner gives the
    haystack, ``"<case_id>@<target_tokens>"``: every position and seed of one case at one length); a
    backend over several endpoints sends them to the same endpoint, so its prefix cache is reused.
    """

    layout_id: str
    arm: str
    seed: int
    token_ids: Sequence[int] | npt.NDArray[Any] | None
    text: str | None
    max_tokens: int
    temperature: float = 0.0
    stop: tuple[str, ...] = ("\n",)
    affinity: str | None = None

    def __repr__(self) -> str:  # never print a prompt
        n = None if self.token_ids is None else len(self.token_ids)
        return (
            f"Request(layout_id={self.layout_id!r}, arm={self.arm!r}, seed={self.seed}, n_token_ids={n}, "
            f"text={'<hidden>' if self.text is not None else None}, max_tokens={self.max_tokens}, "
            f"temperature={self.temperature}, stop={self.stop!r}, affinity={self.affinity!r})"
        )


@dataclass(frozen=True)
class Response:
    """What a backend returned. Counts are the *server's* own; ``None`` where it did not report one.

    ``finish_reason``: ``"stop"`` (a stop string or end of turn), ``"length"`` (``max_tokens`` reached),
    ``"eos"`` (end-of-generation token) or the backend's own word. ``server_prompt_ids_match``: the server
    echoed the prompt ids and they equal the ids sent (``None`` when it echoed none).
    ``prompt_tokens_expected``: the prompt count the server must report when it is not the local count of
    the ids — Anthropic's own ``count_tokens`` of the message, or the local count plus the calibrated chat
    framing (``None``: the local count, ``len(token_ids)``). The runner compares ``prompt_tokens_server``
    with it and records the difference. ``endpoint``: the endpoint that answered, set by a backend over
    several endpoints (``None``: the backend's own, :func:`depthgate.run.execute.endpoint_of`).
    """

    text: str
    finish_reason: str | None
    prompt_tokens_server: int | None
    completion_tokens: int | None
    server_prompt_ids_match: bool | None = None
    system_fingerprint: str | None = None
    prefix_cache_hit_tokens: int | None = None
    prompt_tokens_expected: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    endpoint: str | None = None


@runtime_checkable
class Backend(Protocol):
    """What the runner needs from a backend.

    ``name``: the system name recorded with each record. ``window``: prompt + completion tokens the
    backend accepts (``None`` when unknown). ``accepts_token_ids``: prompts are sent as the exact ids
    (else as text, and positions are verified by the server's counts). ``count_tolerance``: the relative
    difference allowed between the server's prompt count and the count it must have
    (:attr:`Response.prompt_tokens_expected`, else the local one); 0 = exact, the default of every
    backend; the counts and their difference are recorded either way).
    """

    name: str
    accepts_token_ids: bool
    count_tolerance: float

    @property
    def window(self) -> int | None: ...

    async def generate(self, request: Request) -> Response: ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------------------------------
# the embedded llama.cpp adapter

_OVERLENGTH_WORDS = re.compile(r"exceeds the context window", re.IGNORECASE)


class OneThreadEngine:
    """An engine that is synchronous underneath (llama.cpp, vLLM offline) behind the async protocol: its
    calls run one at a time on one dedicated worker thread (the engine holds one context; the event loop
    stays free for the rest of the run)."""

    def __init__(self, thread_name: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _stop_thread(self) -> None:
        self._executor.shutdown(wait=False)


class EmbeddedBackendAdapter(OneThreadEngine):
    """The embedded llama.cpp engine behind the async protocol: in a worker process
    (:class:`~depthgate.run.backends.llamacpp_worker.LlamaWorkerBackend`, the product path) or in process
    (:class:`~depthgate.run.backends.llamacpp.EmbeddedLlamaBackend`).

    llama.cpp is synchronous and holds one context, so calls run one at a time on a single dedicated
    worker thread (concurrency 1 whatever the runner's concurrency). Only the newline stop is supported
    (the embedded backend stops at the first newline); other stop strings are refused.
    """

    accepts_token_ids = True
    count_tolerance = 0.0

    def __init__(self, backend: EmbeddedEngine, *, name: str = "llamacpp", owns: bool = True) -> None:
        super().__init__("depthgate-llamacpp")
        self._backend: EmbeddedEngine | None = backend
        self.name = name
        self._owns = owns

    def __repr__(self) -> str:
        return f"EmbeddedBackendAdapter(name={self.name!r}, window={self.window})"

    @property
    def window(self) -> int | None:
        return None if self._backend is None else self._backend.window

    @property
    def backend(self) -> EmbeddedEngine:
        if self._backend is None:
            raise BackendError("the embedded backend is closed", fix="create a new backend")
        return self._backend

    async def generate(self, request: Request) -> Response:
        backend = self.backend
        if request.token_ids is None:
            raise BackendRequestError(
                "the embedded llama.cpp backend needs token ids", field="token_ids", fix="send the layout ids"
            )
        stops = set(request.stop)
        if stops - {"\n"}:
            raise BackendRequestError(
                f"the embedded backend supports only the newline stop, got {sorted(stops)!r}",
                field="decode.stop",
                fix='use stop = ["\\n"] (or []) with the llamacpp backend',
            )
        ids = list(request.token_ids)

        def call() -> Any:
            return backend.generate(
                ids,
                max_tokens=request.max_tokens,
                seed=request.seed,
                stop_at_newline="\n" in stops,
                temperature=request.temperature,
            )

        try:
            gen = await self._in_thread(call)
        except InputError as exc:
            if _OVERLENGTH_WORDS.search(exc.message):
                raise OverLengthError(
                    exc.message, n_prompt_tokens=len(ids), window=backend.window, fix=exc.fix
                ) from None
            raise BackendRequestError(exc.message, field=exc.field, fix=exc.fix) from None
        except EngineCrashError as exc:  # the worker is gone: name the request it died on
            raise EngineCrashError(
                f"{exc.message} (request in flight: layout {request.layout_id}, seed {request.seed}, "
                f"arm {request.arm})",
                signal_name=exc.signal_name,
                returncode=exc.returncode,
                summary=exc.summary,
                fix=exc.fix,
            ) from None
        except BackendError as exc:
            raise TransientBackendError(
                exc.message, summary=f"llama.cpp failed: {type(exc).__name__}", fix=exc.fix
            ) from exc
        return Response(
            text=gen.text,
            finish_reason=gen.finish_reason,
            prompt_tokens_server=gen.n_prompt_tokens,
            completion_tokens=len(gen.completion_token_ids),
            server_prompt_ids_match=None,
            system_fingerprint=None,
            prefix_cache_hit_tokens=gen.prefix_cache_hit_tokens,
            extra={"prompt_seconds": gen.prompt_seconds, "decode_seconds": gen.decode_seconds},
        )

    async def aclose(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None and self._owns:
            await self._in_thread(backend.close)
        self._stop_thread()


def redact_all(text: str, secrets: Sequence[Secret | None]) -> str:
    """``text`` with the value of every secret replaced by ``***``."""
    for secret in secrets:
        if secret is not None:
            text = secret.redact(text)
    return text

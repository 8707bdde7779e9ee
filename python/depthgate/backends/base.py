"""The typed protocol every backend implements, its error classes and the factory.

A backend turns one :class:`Request` (a layout, an arm, a seed and the decode parameters) into one
:class:`Response`. Every backend is async; a backend that is synchronous underneath (llama.cpp in
process, vLLM offline) runs its calls one at a time in a dedicated worker thread.

Errors a backend raises, and what the runner does with them:

* :class:`TransientBackendError` (HTTP 429/5xx, timeouts, refused connections, a crashed engine): retried
  with exponential backoff; a job still failing is recorded as ``infra_error`` and re-run on resume.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

from depthgate.exceptions import BackendError, DepthgateError, ExitCode, InfraError, InputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from depthgate.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.models import System

__all__ = [
    "Backend",
    "BackendRequestError",
    "EmbeddedBackendAdapter",
    "OverLengthError",
    "Request",
    "Response",
    "Secret",
    "TransientBackendError",
    "api_key_from_env",
    "make_backend",
]

T = TypeVar("T")

# --------------------------------------------------------------------------------------------------
# errors


class TransientBackendError(BackendError):
    """A failure worth retrying: HTTP 429/5xx, a timeout, a refused or dropped connection.

    ``summary`` is a short description without any server-supplied text (safe for records and logs);
    ``retry_after`` the server's ``Retry-After`` in seconds when it sent one; ``attempts`` how many
    attempts the backend made before giving up.
    """

    def __init__(
        self,
        message: str,
        *,
        summary: str | None = None,
        retry_after: float | None = None,
        attempts: int = 1,
        status: int | None = None,
        file: str | None = None,
        field: str | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(message, file=file, field=field, fix=fix)
        self.summary = summary or message
        self.retry_after = retry_after
        self.attempts = attempts
        self.status = status


class OverLengthError(DepthgateError):
    """The backend refused the prompt as longer than its window: a system failure of the layout.

    Recorded as ``system_fail`` with reason ``overflow``, never retried, never a silent truncation.
    """

    exit_code = ExitCode.FAIL

    def __init__(
        self,
        message: str,
        *,
        n_prompt_tokens: int | None = None,
        window: int | None = None,
        summary: str | None = None,
        file: str | None = None,
        field: str | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(message, file=file, field=field, fix=fix)
        self.n_prompt_tokens = n_prompt_tokens
        self.window = window
        self.summary = summary or "prompt longer than the backend's window"


class BackendRequestError(InputError):
    """The backend refused the request for a reason the caller must fix (4xx other than over-length,
    an unknown model, a parameter the backend does not support). ``summary`` holds no server text."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        summary: str | None = None,
        file: str | None = None,
        field: str | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(message, file=file, field=field, fix=fix)
        self.status = status
        self.summary = summary or message


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


# --------------------------------------------------------------------------------------------------
# request / response / protocol


@dataclass(frozen=True)
class Request:
    """One generation request. ``token_ids`` is the exact prompt for backends that accept ids,
    ``text`` its rendered text for text-only backends (at least one must be given)."""

    layout_id: str
    arm: str
    seed: int
    token_ids: list[int] | None
    text: str | None
    max_tokens: int
    temperature: float = 0.0
    stop: tuple[str, ...] = ("\n",)

    def __repr__(self) -> str:  # never print a prompt
        n = None if self.token_ids is None else len(self.token_ids)
        return (
            f"Request(layout_id={self.layout_id!r}, arm={self.arm!r}, seed={self.seed}, n_token_ids={n}, "
            f"text={'<hidden>' if self.text is not None else None}, max_tokens={self.max_tokens}, "
            f"temperature={self.temperature}, stop={self.stop!r})"
        )


@dataclass(frozen=True)
class Response:
    """What a backend returned. Counts are the *server's* own; ``None`` where it did not report one.

    ``finish_reason``: ``"stop"`` (a stop string or end of turn), ``"length"`` (``max_tokens`` reached),
    ``"eos"`` (end-of-generation token) or the backend's own word. ``server_prompt_ids_match``: the server
    echoed the prompt ids and they equal the ids sent (``None`` when it echoed none).
    """

    text: str
    finish_reason: str | None
    prompt_tokens_server: int | None
    completion_tokens: int | None
    server_prompt_ids_match: bool | None = None
    system_fingerprint: str | None = None
    prefix_cache_hit_tokens: int | None = None
    attempts: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """What the runner needs from a backend.

    ``name``: the system name recorded with each record. ``window``: prompt + completion tokens the
    backend accepts (``None`` when unknown). ``accepts_token_ids``: prompts are sent as the exact ids
    (else as text, and positions are verified by the server's counts). ``count_tolerance``: the relative
    difference allowed between the server's prompt count and the local one (0 = exact; > 0 only where the
    provider's tokenizer is unknown; the two counts are recorded either way).
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


class EmbeddedBackendAdapter:
    """:class:`~depthgate.backends.llamacpp.EmbeddedLlamaBackend` behind the async protocol.

    llama.cpp is synchronous and holds one context, so calls run one at a time on a single dedicated
    worker thread (concurrency 1 whatever the runner's concurrency). Only the newline stop is supported
    (the embedded backend stops at the first newline); other stop strings are refused.
    """

    accepts_token_ids = True
    count_tolerance = 0.0

    def __init__(self, backend: EmbeddedLlamaBackend, *, name: str = "llamacpp", owns: bool = True) -> None:
        self._backend: EmbeddedLlamaBackend | None = backend
        self.name = name
        self._owns = owns
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="depthgate-llamacpp"
        )

    def __repr__(self) -> str:
        return f"EmbeddedBackendAdapter(name={self.name!r}, window={self.window})"

    @property
    def window(self) -> int | None:
        return None if self._backend is None else self._backend.window

    @property
    def backend(self) -> EmbeddedLlamaBackend:
        if self._backend is None:
            raise BackendError("the embedded backend is closed", fix="create a new backend")
        return self._backend

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn)

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
            await asyncio.get_running_loop().run_in_executor(self._executor, backend.close)
        self._executor.shutdown(wait=False)


# --------------------------------------------------------------------------------------------------
# factory


def _tokenizer_for(system: System, model_path: Path | None) -> Tokenizer | None:
    """The tokenizer named by ``system.tokenizer``: ``gguf:`` (from the model), ``gguf:<path>`` or a
    ``tokenizer.json`` path. ``None`` = let the embedded backend convert it from the model."""
    spec = system.tokenizer
    if spec == "gguf:":
        return None
    from depthgate.gguf_tokenizer import tokenizer_from_gguf

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
    max_attempts: int = 4,
    timeout_s: float = 300.0,
    count_tolerance: float | None = None,
    n_threads: int | None = None,
    reuse_prefix: bool = False,
    vllm_kwargs: Mapping[str, Any] | None = None,
) -> Backend:
    """The backend of one system (one arm).

    * ``llamacpp`` without endpoint: llama.cpp in process (:class:`EmbeddedBackendAdapter`); ``model`` is
      a ``.gguf`` path or ``"gemma3-270m"`` (the packaged default); ``window`` sets ``n_ctx`` (default
      4096). With an endpoint: an OpenAI-compatible ``/v1/completions`` server; ``llama-server`` accepts
      token ids (the default), the llama-cpp-python server only text (pass ``prompt_format="text"``).
    * ``vllm``: :class:`~depthgate.backends.vllm_offline.VLLMOfflineBackend` (token ids).
    * ``vllm-server``: :class:`~depthgate.backends.http.OpenAICompletionsBackend` (token ids,
      ``return_token_ids``, ``max_model_len`` from ``/v1/models``).
    * ``openai``: :class:`~depthgate.backends.http.OpenAIChatBackend` (text; ``api="completions"`` for a
      compatible server that takes token ids). Key from ``OPENAI_API_KEY`` (or ``api_key_env``); required
      for api.openai.com, optional for a self-hosted endpoint.
    * ``anthropic``: :class:`~depthgate.backends.http.AnthropicBackend`; key from ``ANTHROPIC_API_KEY``
      (or ``api_key_env``), always required.
    """
    kind = system.backend
    if kind == "llamacpp" and system.endpoint is None:
        from depthgate.backends.llamacpp import EmbeddedLlamaBackend

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
        from depthgate.backends.vllm_offline import VLLMOfflineBackend

        return VLLMOfflineBackend(
            system.model, name=system.name, window=system.window, engine_kwargs=dict(vllm_kwargs or {})
        )

    from depthgate.backends import http

    if kind == "anthropic":
        key = api_key_from_env(api_key_env or _DEFAULT_KEY_ENV["anthropic"], what="Anthropic")
        return http.AnthropicBackend(
            system.model,
            base_url=system.endpoint or http.ANTHROPIC_URL,
            api_key=key,
            name=system.name,
            window=system.window,
            max_attempts=max_attempts,
            timeout_s=timeout_s,
            count_tolerance=http.TEXT_COUNT_TOLERANCE if count_tolerance is None else count_tolerance,
        )
    if kind == "openai" and (api or "chat") == "chat":
        env = api_key_env or _DEFAULT_KEY_ENV["openai"]
        key = api_key_from_env(env, required=system.endpoint is None, what="OpenAI")
        return http.OpenAIChatBackend(
            system.model,
            base_url=system.endpoint or http.OPENAI_URL,
            api_key=key,
            name=system.name,
            window=system.window,
            max_attempts=max_attempts,
            timeout_s=timeout_s,
            count_tolerance=http.TEXT_COUNT_TOLERANCE if count_tolerance is None else count_tolerance,
        )
    # OpenAI-compatible /v1/completions: vllm-server, llamacpp with an endpoint, openai with api="completions"
    endpoint = system.endpoint or http.OPENAI_URL
    key = None
    if api_key_env is not None:
        key = api_key_from_env(api_key_env, what=endpoint)
    elif kind == "openai":
        key = api_key_from_env(_DEFAULT_KEY_ENV["openai"], required=system.endpoint is None, what="OpenAI")
    fmt = prompt_format or "token_ids"
    return http.OpenAICompletionsBackend(
        system.model,
        base_url=endpoint,
        api_key=key,
        name=system.name,
        window=system.window,
        prompt_format=fmt,
        vllm=kind == "vllm-server",
        max_attempts=max_attempts,
        timeout_s=timeout_s,
        count_tolerance=0.0 if count_tolerance is None else count_tolerance,
    )


def redact_all(text: str, secrets: Sequence[Secret | None]) -> str:
    """``text`` with the value of every secret replaced by ``***``."""
    for secret in secrets:
        if secret is not None:
            text = secret.redact(text)
    return text

"""HTTP backends: OpenAI-compatible ``/v1/completions`` (vLLM server, llama-server, any compatible server),
OpenAI chat completions and the Anthropic Messages API. Async (aiohttp; httpx as an option), bounded
timeouts, one attempt per call: 429/5xx/timeouts/refused connections raise :class:`TransientBackendError`
(with ``Retry-After``) and the runner retries them with the run's one policy (:mod:`depthgate.run.retry`).

Transport and JSON were chosen by measurement (docs/benchmarks-runner-gate.md, 1K-token prompts, 64 in
flight against a stub on 127.0.0.1, the whole runner): 3.5 ms of harness CPU per request with httpx,
most of it in httpcore's connection pool, which does O(connections²) work per request; 0.32 ms with
aiohttp (its C HTTP parser) and orjson, against a bare-socket floor of 0.1 ms. JSON goes through orjson
both ways: a 128K-id body encodes 14× and its echo decodes 3× faster than with the stdlib ``json``.

Facts these follow are in research/api_facts.md: vLLM takes ``prompt: [ids]`` verbatim and echoes them
with ``return_token_ids``; ``/v1/models`` carries ``max_model_len`` (vLLM only); over-length is an HTTP
400 whose body says "maximum context length" (vLLM, OpenAI, llama-cpp-python), ``exceed_context_size_error``
(llama-server) or "prompt is too long" (Anthropic); ``truncate_prompt_tokens`` is never sent.

Measured on llama-cpp-python 0.3.36's server (tests/test_backends_http.py): ``/v1/completions`` accepts
only text prompts; a token-id prompt is answered with HTTP **500** carrying pydantic ``string_type``
validation errors, which this module reports as a :class:`BackendRequestError`, not a transient error.
It tokenizes text with BOS added and special tokens parsed; ``/v1/models`` has no context length; an
unknown ``model`` is served silently by the one loaded model (so the served ids are checked here).

API keys come from the environment only, are held in a :class:`~depthgate.run.backends.base.Secret`, sent
per request, and redacted from every message built here; no exception raised here keeps a reference to
a client request (which holds the headers). A key is attached only over ``https`` or to a loopback host
(127.0.0.0/8, ::1, ``localhost``); plain ``http`` to any other host is refused at construction unless
:attr:`HTTPOptions.allow_insecure_key` is set (a matrix edited in a pull request must not be able to
send a CI secret to a host of its choosing in the clear).

Prompt counts (the runner checks them after every request): the completions backend sends ids or text
under the served tokenizer, so the server's count must equal the local one exactly. The text-only
backends say what the server's count must be in :attr:`Response.prompt_tokens_expected`: Anthropic's own
``count_tokens`` of the same message, before the request (same tokenizer, so exact); OpenAI chat the local
count plus the chat framing overhead, measured once per backend with a small probe message
(``usage.prompt_tokens(probe) − local_count(probe)``). No relative slack is allowed unless the arm sets
``count_tolerance``; every difference is recorded.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, Literal, TypedDict, TypeVar
from urllib.parse import urlsplit

import numpy as np

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only (postponed), so 3.10 imports this module

    import httpx
    import numpy.typing as npt

from depthgate.exceptions import (
    BackendError,
    BackendRequestError,
    InputError,
    MalformedAnswerError,
    OverLengthError,
    TransientBackendError,
)
from depthgate.run.backends.base import Request, Response, Secret, check_fits_window
from depthgate.run.backends.http_wire import (
    MAX_MESSAGE,
    RETRY_STATUS,
    VALIDATION_TEXT,
    AiohttpSession,
    Failure,
    HttpxSession,
    Session,
    cached_tokens,
    closed_at_loop_end,
    dumps,
    error_fields,
    int_or_none,
    is_overlength_error,
    loads,
    native,
    normalize_base_url,
    retry_after_seconds,
    same_ids,
    server_excerpt,
    text_of,
)

log = logging.getLogger("depthgate.run.backends.http")

OPENAI_URL = "https://api.openai.com"

_T = TypeVar("_T")


@dataclass(frozen=True)
class HTTPOptions:
    """Connection settings every HTTP backend takes (a matrix arm's ``runtime`` block fills them).

    ``timeout_s`` (read) and ``connect_timeout_s`` bound one request; ``count_tolerance`` is the relative
    difference allowed between the server's prompt count and the count it must have (``None``: 0, exact;
    the difference is recorded either way); ``max_connections`` caps the connection pool; ``concurrency``
    caps this backend's requests in flight (``None``: only the run's own limit); ``allow_insecure_key``
    lets an API key go over plain ``http`` to a non-loopback host. ``client``: the HTTP client, aiohttp
    (the default) or httpx (the earlier client, kept to measure against and for ``transport``);
    ``transport``: an httpx transport that replaces the network (tests; implies httpx).
    """

    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    count_tolerance: float | None = None
    max_connections: int = 256
    concurrency: int | None = None
    allow_insecure_key: bool = False
    client: Literal["aiohttp", "httpx"] = "aiohttp"
    transport: httpx.AsyncBaseTransport | None = None

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.connect_timeout_s > 0):
            raise ValueError("timeouts must be > 0")
        if self.count_tolerance is not None and not (self.count_tolerance >= 0.0):
            raise ValueError("count_tolerance must be ≥ 0")
        if self.max_connections < 1:
            raise ValueError("max_connections must be ≥ 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be ≥ 1")
        if self.client not in ("aiohttp", "httpx"):
            raise ValueError(f"client must be 'aiohttp' or 'httpx', got {self.client!r}")


def is_loopback_host(host: str | None) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1."""
    if not host:
        return False
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def key_in_clear(url: str) -> bool:
    """A request to ``url`` would carry its headers unencrypted over the network: plain ``http`` (or
    anything but ``https``) to a host that is not loopback."""
    parts = urlsplit(url)
    return parts.scheme.lower() != "https" and not is_loopback_host(parts.hostname)


# --------------------------------------------------------------------------------------------------
# shared HTTP machinery


class PerLoop(Generic[_T]):
    """An asyncio primitive (lock, semaphore) for the running event loop, made anew when the loop changes:
    a backend outlives the ``asyncio.run`` it was first used in."""

    def __init__(self, make: Callable[[], _T]) -> None:
        self._make = make
        self._value: _T | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> _T:
        loop = asyncio.get_running_loop()
        if self._value is None or self._loop is not loop:
            self._value, self._loop = self._make(), loop
        return self._value


def _prompt_text(payload: Mapping[str, Any] | None) -> str | None:
    """The prompt text a request body carries (a text ``prompt``, or its messages' contents), to be kept
    out of an excerpt of the answer."""
    if not payload:
        return None
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = payload.get("messages")
    if isinstance(messages, list):
        return "\n".join(str(m.get("content")) for m in messages if isinstance(m, Mapping)) or None
    return None


class HTTPBackendArgs(TypedDict, total=False):
    """What every HTTP backend takes besides its model and URL (see :class:`HTTPBackend`)."""

    api_key: Secret | None
    name: str | None
    window: int | None
    options: HTTPOptions | None


class HTTPBackend:
    """JSON-over-HTTP client shared by the backends below (one HTTP client per event loop).

    :meth:`generate` holds one of :attr:`HTTPOptions.concurrency` slots (when set) around the subclass's
    ``_generate``, so one arm's requests in flight are capped whatever the run's concurrency.
    """

    accepts_token_ids: bool = False
    #: ``Request.token_ids`` may be a numpy array: it is only measured, compared and serialized by
    #: orjson straight from the array (issue #12: the Python int list it replaces held ≈ 5 MB per
    #: 128K request in flight, docs/benchmarks.md).
    accepts_id_array: bool = True

    def __init__(
        self,
        model: str,
        *,
        base_url: str,
        api_key: Secret | None = None,
        name: str | None = None,
        window: int | None = None,
        options: HTTPOptions | None = None,
    ) -> None:
        options = options or HTTPOptions()
        name = name or model  # a backend is named after its model unless the arm names it
        self.model = model
        self.name = name
        self.base_url = normalize_base_url(base_url)
        if api_key is not None and key_in_clear(self.base_url) and not options.allow_insecure_key:
            raise InputError(
                f"refusing to send the API key from ${api_key.env_var} to {self.base_url}: plain http to a "
                "host that is not loopback would expose it on the network",
                field=f"{name}.endpoint",
                fix="use an https:// endpoint (or a loopback one); on a trusted network only, set "
                "allow_insecure_key = true in this arm's [runtime] block",
            )
        self._api_key = api_key
        self._configured_window = window
        self.options = options
        self.timeout_s = options.timeout_s
        self.connect_timeout_s = options.connect_timeout_s
        self.count_tolerance = 0.0 if options.count_tolerance is None else options.count_tolerance
        self.concurrency = options.concurrency
        self._http: Session | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._http_guard: AsyncGenerator[None, None] | None = None
        self._slots = (
            None if self.concurrency is None else PerLoop(partial(asyncio.Semaphore, self.concurrency))
        )

    def __repr__(self) -> str:
        key = None if self._api_key is None else f"<from ${self._api_key.env_var}>"
        return (
            f"{type(self).__name__}(name={self.name!r}, model={self.model!r}, base_url={self.base_url!r}, "
            f"api_key={key}, window={self.window})"
        )

    @property
    def window(self) -> int | None:
        return self._configured_window

    async def generate(self, request: Request) -> Response:
        """One attempt at ``request`` (the runner retries), within this backend's concurrency cap."""
        if self._slots is None:
            return await self._generate(request)
        async with self._slots.get():
            return await self._generate(request)

    async def _generate(self, request: Request) -> Response:
        raise NotImplementedError

    # -- plumbing -----------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", "Accept": "application/json"}

    def _redact(self, text: str) -> str:
        return self._api_key.redact(text) if self._api_key is not None else text

    async def _session(self) -> Session:
        """This event loop's HTTP client (made on first use in each loop)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            use_httpx = self.options.client == "httpx" or self.options.transport is not None
            session: Session = (
                HttpxSession(self.options) if use_httpx else AiohttpSession(self.options, self.base_url)
            )
            guard = closed_at_loop_end(session)
            self._http, self._http_loop, self._http_guard = session, loop, guard
            await guard.__anext__()
        return self._http

    async def aclose(self) -> None:
        guard, self._http_guard = self._http_guard, None
        loop, self._http_loop = self._http_loop, None
        self._http = None
        if guard is not None and loop is asyncio.get_running_loop():
            await guard.aclose()  # its ``finally`` closes the client

    def _message(self, body: Any, raw: bytes) -> str:
        fields = error_fields(body) if body is not None else {}
        message = str(fields.get("message") or raw.decode("utf-8", "replace") or "").strip()
        return self._redact(message)[:MAX_MESSAGE]

    async def _call(
        self, method: Literal["GET", "POST"], path: str, payload: Mapping[str, Any] | None = None
    ) -> Any:
        """The decoded JSON of a 2xx answer. One attempt: raises :class:`TransientBackendError` for a
        failure worth retrying (the runner retries it), :class:`OverLengthError` or
        :class:`BackendRequestError` for a refusal."""
        url = f"{self.base_url}{path}"
        where = f"{method} {url}"
        body = dumps(payload) if payload is not None and method == "POST" else None
        # The clients return failures instead of raising them, so that no exception raised here keeps a
        # client request (which holds the API key in its headers) as its ``__context__``.
        answer = await (await self._session()).send(method, url, body, self._headers())
        if isinstance(answer, Failure):
            if answer.kind == "timeout":
                raise TransientBackendError(
                    f"{where} timed out ({answer.name}, limit {self.timeout_s:g} s read, "
                    f"{self.connect_timeout_s:g} s connect)",
                    summary=f"timeout: {where}",
                    fix="check the server's load, or raise timeout_s",
                )
            raise TransientBackendError(
                f"cannot reach {url} ({answer.name}: {self._redact(answer.detail)[:200]})",
                summary=f"unreachable: {where}",
                fix="check that the server is running and the endpoint URL is right",
            )
        status, raw = answer.status, answer.content
        try:
            decoded = loads(raw) if raw else None
        except ValueError:
            decoded = None
        if 200 <= status < 300:
            if decoded is None:
                excerpt = self._redact(server_excerpt(None, raw, _prompt_text(payload)))
                raise MalformedAnswerError(
                    f"{where} returned HTTP {status} without a JSON body (the server said: {excerpt!r})",
                    summary=f"HTTP {status} non-JSON: {where}",
                    status=status,
                    excerpt=excerpt,
                    fix="check what answers at this URL (a proxy's or gateway's page is not the server)",
                )
            return decoded
        message = self._message(decoded, raw)
        if is_overlength_error(status, decoded):
            raise OverLengthError(
                f"{where} refused the prompt as too long (HTTP {status}: {message})",
                summary=f"HTTP {status} over-length: {where}",
                fix="shorten the layout or lower max_tokens (the served window may be smaller than assumed)",
            )
        if status >= 500 and VALIDATION_TEXT.search(message):
            raise self._validation_refusal(status, where, message, payload)
        if status in RETRY_STATUS or status >= 500:
            raise TransientBackendError(
                f"{where} answered HTTP {status} ({message or answer.reason})",
                summary=f"HTTP {status}: {where}",
                retry_after=retry_after_seconds(answer.retry_after),
                status=status,
                fix="the run records it as infra_error and re-runs it on resume",
            )
        raise self._refusal(status, where, message)

    def _refusal(self, status: int, where: str, message: str) -> BackendRequestError:
        if status in (401, 403):
            env = f"${self._api_key.env_var}" if self._api_key is not None else "no API key was sent"
            fix = f"check the API key ({env}) and its permissions"
        elif status == 404:
            fix = "check the endpoint URL and the model name"
        else:
            fix = "check the request parameters for this backend"
        return BackendRequestError(
            f"{where} refused the request (HTTP {status}: {message})",
            status=status,
            summary=f"HTTP {status}: {where}",
            fix=fix,
        )

    def _validation_refusal(
        self, status: int, where: str, message: str, payload: Mapping[str, Any] | None
    ) -> BackendRequestError:
        sent_ids = isinstance((payload or {}).get("prompt"), (list, np.ndarray))
        fix = (
            "this server does not accept token-id prompts (llama-cpp-python's server takes text only); "
            "use prompt_format='text', or llama-server / vLLM for token-exact prompts"
            if sent_ids
            else "check the request parameters for this backend"
        )
        return BackendRequestError(
            f"{where} rejected the request body (HTTP {status}: {message})",
            status=status,
            summary=f"HTTP {status} validation error: {where}",
            fix=fix,
        )

    @staticmethod
    def _malformed(where: str, what: str) -> BackendError:
        return BackendError(
            f"{where} returned a response without {what}", fix="check the server's API version"
        )

    def _refuse_contradictions(
        self,
        where: str,
        counts: Mapping[str, int | None],
        generated_key: str,
        text: str,
        generated: Any,
        body: Any,
        request: Request,
    ) -> None:
        """Refuse a 2xx answer whose counts contradict it (issue #37, item 2), whatever the API calls
        them: zero tokens generated (``empty_completion``: a model that stops at once still generates
        its end token), text beside a generated count of 0, a negative count, or generated ids of
        another number than the generated count (``malformed_answer``). ``counts`` are the answer's
        usage counts by name, ``generated_key`` the one that counts generated tokens."""
        completion = counts.get(generated_key)
        negative = [k for k, v in counts.items() if v is not None and v < 0]
        what: str | None = None
        if negative:
            what = f"a negative usage.{negative[0]}"
        elif completion == 0 and text:
            what = f"{len(text)} characters of text but usage.{generated_key} 0"
        elif completion == 0:
            what = f"no generated token (empty text, usage.{generated_key} 0)"
            raise self._malformed_answer(where, what, body, request, reason="empty_completion")
        elif isinstance(generated, list) and completion is not None and len(generated) != completion:
            what = f"{len(generated)} generated token ids but usage.{generated_key} {completion}"
        if what is not None:
            raise self._malformed_answer(where, what, body, request)

    def _malformed_answer(
        self, where: str, what: str, body: Any, request: Request | None, reason: str = "malformed_answer"
    ) -> MalformedAnswerError:
        """A 2xx answer that is not the model's (issue #37, item 2): ``reason`` names it, ``what`` says
        what is wrong, the excerpt keeps the server's own words (key redacted, prompt removed)."""
        prompt = request.text if request is not None else None
        excerpt = self._redact(server_excerpt(body, None, prompt))
        return MalformedAnswerError(
            f"{where} answered 200 with {what}: not the model's answer ({reason}; the server said: "
            f"{excerpt!r})",
            summary=f"{reason}: {what}",
            reason=reason,
            excerpt=excerpt,
            fix="check the server or gateway in front of the model (its logs at this time); the run "
            "retries such an answer and records it as a serving failure, never as the model's",
        )


class OpenAIShapedBackend(HTTPBackend):
    """What the OpenAI-shaped APIs share: a bearer key, answers with ``choices`` and ``usage``."""

    def _headers(self) -> dict[str, str]:
        headers = super()._headers()
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        return headers

    def _first_choice(
        self, body: Any, path: str, request: Request | None = None
    ) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """The first choice and the ``usage`` (empty when absent) of the answer to ``POST path``; an
        answer without one is a :class:`MalformedAnswerError` (``malformed_answer``)."""
        choices = body.get("choices") if isinstance(body, Mapping) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise self._malformed_answer(f"POST {self.base_url}{path}", "no 'choices'", body, request)
        usage = body.get("usage") if isinstance(body.get("usage"), Mapping) else {}
        return choices[0], usage

    def _verify_answer(
        self,
        body: Any,
        usage: Mapping[str, Any],
        choice: Mapping[str, Any],
        text: str,
        path: str,
        request: Request,
    ) -> None:
        """Refuse an answer that contradicts itself (issue #37, item 2): :meth:`_refuse_contradictions`
        on ``usage.prompt_tokens`` / ``usage.completion_tokens`` and vLLM's generated ``token_ids``."""
        counts = {k: int_or_none(usage.get(k)) for k in ("prompt_tokens", "completion_tokens")}
        where, generated = f"POST {self.base_url}{path}", choice.get("token_ids")
        self._refuse_contradictions(where, counts, "completion_tokens", text, generated, body, request)

    @staticmethod
    def _response(
        body: Mapping[str, Any],
        usage: Mapping[str, Any],
        *,
        text: str,
        finish_reason: str | None,
        extra: Mapping[str, Any],
        server_prompt_ids_match: bool | None = None,
        prompt_tokens_expected: int | None = None,
    ) -> Response:
        """The :class:`Response` of an OpenAI-shaped answer: the counts and cache hits from ``usage``, the
        fingerprint and the served model from ``body``."""
        return Response(
            text=text,
            finish_reason=finish_reason,
            prompt_tokens_server=int_or_none(usage.get("prompt_tokens")),
            completion_tokens=int_or_none(usage.get("completion_tokens")),
            server_prompt_ids_match=server_prompt_ids_match,
            system_fingerprint=body.get("system_fingerprint"),
            prefix_cache_hit_tokens=cached_tokens(usage),
            prompt_tokens_expected=prompt_tokens_expected,
            extra={"served_model": body.get("model"), **extra},
        )


# --------------------------------------------------------------------------------------------------
# OpenAI-compatible /v1/completions


class OpenAICompletionsBackend(OpenAIShapedBackend):
    """``/v1/completions`` of vLLM's server or any OpenAI-compatible server.

    ``prompt_format="token_ids"`` sends ``prompt: [ids]`` (vLLM, llama-server); ``"text"`` sends the
    rendered text (servers that only take text, e.g. llama-cpp-python's). ``vllm=True`` adds
    ``return_token_ids`` so the echoed prompt ids are compared with the ids sent. ``/v1/models`` is read
    once, before the first request: the requested model must be served, and its ``max_model_len`` (when
    present) becomes :attr:`window`. ``truncate_prompt_tokens`` is never sent.
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str,
        prompt_format: Literal["token_ids", "text"] = "token_ids",
        vllm: bool = False,
        check_served_model: bool = True,
        **common: Unpack[HTTPBackendArgs],
    ) -> None:
        super().__init__(model, base_url=base_url, **common)
        if prompt_format not in ("token_ids", "text"):
            raise ValueError(f"prompt_format must be 'token_ids' or 'text', got {prompt_format!r}")
        self.prompt_format = prompt_format
        self.accepts_token_ids = prompt_format == "token_ids"
        self.vllm = vllm
        self.check_served_model = check_served_model
        self._probed = False
        self._probe_lock = PerLoop(asyncio.Lock)
        self._served_window: int | None = None
        self.served_models: list[str] = []
        #: The index (in :meth:`_tokenize_routes`) of the route that answered, once one has.
        self._tokenize_route: int | None = None
        #: What each tokenizer route answered when none of them is on the server.
        self.tokenize_tried: tuple[str, ...] = ()

    @property
    def window(self) -> int | None:
        known = [w for w in (self._configured_window, self._served_window) if w is not None]
        return min(known) if known else None

    @property
    def served_window(self) -> int | None:
        """``max_model_len`` of the served model from ``/v1/models`` (``None`` if it reports none)."""
        return self._served_window

    async def probe(self) -> dict[str, Any]:
        """Read ``/v1/models``: check the model is served, take ``max_model_len``. Returns the model card."""
        where = f"GET {self.base_url}/v1/models"
        try:
            body = await self._call("GET", "/v1/models")
        except BackendRequestError as exc:
            if exc.status == 404:  # a server without the endpoint: nothing to check
                self._probed = True
                return {}
            raise
        data = body.get("data") if isinstance(body, Mapping) else None
        if not isinstance(data, list):
            raise self._malformed(where, "a model list ('data')")
        cards = [c for c in data if isinstance(c, Mapping)]
        self.served_models = [str(c.get("id")) for c in cards]
        card = next((c for c in cards if c.get("id") == self.model), None)
        if card is None and cards and self.check_served_model:
            raise BackendRequestError(
                f"{self.base_url} does not serve model {self.model!r} (it serves {self.served_models!r}); "
                "some servers silently answer with another model",
                field="model",
                summary=f"model not served: {self.base_url}",
                fix="set the system's model to the served model id (vLLM --served-model-name, "
                "llama-cpp-python --model_alias)",
            )
        if card is not None:
            self._served_window = int_or_none(card.get("max_model_len"))
        self._probed = True
        return dict(card or {})

    def _tokenize_routes(self, text: str, add_special_tokens: bool) -> list[tuple[str, dict[str, Any], bool]]:
        """Every tokenizer route a server of this kind may have, the likeliest first: (path, body, whether
        the route adds special tokens). vLLM's ``/tokenize`` (also behind ``/v1``), llama.cpp's
        ``llama-server`` ``/tokenize`` (``content``, ``add_special``, ``parse_special``), llama-cpp-python's
        ``/extras/tokenize`` (always adds BOS and parses special tokens: what it does to a text prompt)."""
        vllm_body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        llama_body = {"content": text, "add_special": add_special_tokens, "parse_special": True}
        extras = ("/extras/tokenize", {"input": text, "model": self.model}, True)
        vllm = [("/tokenize", vllm_body, add_special_tokens), ("/v1/tokenize", vllm_body, add_special_tokens)]
        llama = [("/tokenize", llama_body, add_special_tokens)]
        return [*vllm, extras, *llama] if self.vllm else [*llama, extras, *vllm]

    async def server_tokenize(
        self, text: str, *, add_special_tokens: bool
    ) -> tuple[list[int], str, bool] | None:
        """The server's own ids for ``text``, the route that gave them and whether that route adds special
        tokens (BOS …), or ``None`` when it offers none of :meth:`_tokenize_routes` (each answered 404 or
        405, or refused the other dialect's body with 400/422; :attr:`tokenize_tried` says what each
        answered). The route that answered is kept for the next calls. One attempt per route: a failure
        worth retrying raises :class:`TransientBackendError`, an answer without a token list
        :class:`MalformedAnswerError` (the caller, :mod:`depthgate.run.parity`, retries both)."""
        routes = list(enumerate(self._tokenize_routes(text, add_special_tokens)))
        if self._tokenize_route is not None:
            routes = [routes[self._tokenize_route]]
        tried: list[str] = []
        for index, (path, body_out, specials) in routes:
            try:
                body = await self._call("POST", path, body_out)
            except BackendRequestError as exc:
                if exc.status in (400, 404, 405, 422) and self._tokenize_route is None:
                    tried.append(f"{path} HTTP {exc.status}")  # not here, or another server's dialect
                    continue
                raise
            tokens = body.get("tokens") if isinstance(body, Mapping) else None
            ids: list[int] | None = None
            if isinstance(tokens, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                ids = [int(t) for t in tokens]
            # llama-server answers pieces with ids when asked (with_pieces); take the ids.
            elif isinstance(tokens, list) and all(isinstance(t, Mapping) and "id" in t for t in tokens):
                ids = [int(t["id"]) for t in tokens]
            if ids is None:
                what = (
                    "no token list ('tokens')" if tokens is None else "a 'tokens' that is not a list of ids"
                )
                raise self._malformed_answer(f"POST {self.base_url}{path}", what, body, None)
            self._tokenize_route = index
            return ids, path, specials
        self.tokenize_tried = tuple(tried)
        return None

    async def _ensure_probed(self) -> None:
        """:meth:`probe` once, however many requests start at the same time."""
        if self._probed:
            return
        async with self._probe_lock.get():
            if not self._probed:
                await self.probe()

    async def _generate(self, request: Request) -> Response:
        await self._ensure_probed()
        if self.accepts_token_ids:
            if request.token_ids is None:
                raise BackendRequestError(
                    "this backend sends token ids but the request has none",
                    field="token_ids",
                    fix="send the layout ids",
                )
            # A list of ints or a numpy id array: sent as is (dumps writes the array directly).
            prompt: Sequence[int] | npt.NDArray[Any] | str = native(request.token_ids)
        else:
            prompt = text_of(request, "this backend")
        n_local = len(request.token_ids) if request.token_ids is not None else None
        check_fits_window(
            n_local,
            request.max_tokens,
            self.window,
            said="prompt of {n} tokens plus max_tokens {max_tokens} exceeds the served window of "
            "{window} tokens",
            summary="prompt + max_tokens exceeds the served window",
        )
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "seed": request.seed,
            "stream": False,
        }
        if request.stop:
            payload["stop"] = list(request.stop)
        if self.vllm:
            payload["return_token_ids"] = True
        body = await self._call("POST", "/v1/completions", payload)
        return self._parse(body, request)

    def _parse(self, body: Any, request: Request) -> Response:
        choice, usage = self._first_choice(body, "/v1/completions", request)
        text = choice.get("text")
        if not isinstance(text, str):
            what = "no 'text' in its choice" if text is None else f"a {type(text).__name__} as its text"
            raise self._malformed_answer(f"POST {self.base_url}/v1/completions", what, body, request)
        self._verify_answer(body, usage, choice, text, "/v1/completions", request)
        echoed = choice.get("prompt_token_ids", body.get("prompt_token_ids"))
        match: bool | None = None
        if isinstance(echoed, list) and request.token_ids is not None:
            match = same_ids(echoed, request.token_ids)
        extra: dict[str, Any] = {}
        if choice.get("stop_reason") is not None:
            extra["stop_reason"] = choice.get("stop_reason")
        if isinstance(echoed, list):
            extra["echoed_prompt_tokens"] = len(echoed)
        return self._response(
            body,
            usage,
            text=text,
            finish_reason=choice.get("finish_reason"),
            extra=extra,
            server_prompt_ids_match=match,
        )

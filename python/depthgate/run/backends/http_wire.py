"""The wire of the HTTP backends (:mod:`depthgate.run.backends.http`): JSON through orjson both ways, the
two HTTP clients (aiohttp; httpx as an option) behind one answer/failure shape, and the helpers that read
an answer (error fields, ``Retry-After``, over-length bodies, cached tokens, stop strings)."""

from __future__ import annotations

import email.utils
import json
import math
import re
import time
import urllib.request
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import orjson

if TYPE_CHECKING:
    import numpy.typing as npt

    from depthgate.run.backends.http import HTTPOptions

from depthgate.exceptions import (
    BackendRequestError,
)
from depthgate.run.backends.base import Request

RETRY_STATUS = frozenset({408, 409, 425, 429})
OVERLENGTH_TEXT = re.compile(
    r"maximum context length|context length|context window|exceeds? the available context"
    r"|prompt is too long|too many (?:input )?tokens|longer than the maximum model length",
    re.IGNORECASE,
)
VALIDATION_TEXT = re.compile(r"\bvalidation errors?\b", re.IGNORECASE)
MAX_MESSAGE = 400


# --------------------------------------------------------------------------------------------------
# helpers


def error_fields(body: Any) -> dict[str, Any]:
    """``{"message", "type", "code", "param"}`` from the error envelopes in use (nested OpenAI/vLLM ≥0.11,
    flat vLLM ≤0.10, Anthropic ``{"type":"error","error":{…}}``, FastAPI ``{"detail": …}``)."""
    if not isinstance(body, Mapping):
        return {"message": str(body)} if body else {}
    err = body.get("error")
    if isinstance(err, Mapping):
        return {k: err.get(k) for k in ("message", "type", "code", "param")}
    if isinstance(err, str):
        return {"message": err, "type": body.get("type"), "code": body.get("code")}
    if "detail" in body:
        return {"message": json.dumps(body["detail"], default=str)[:2000]}
    return {k: body.get(k) for k in ("message", "type", "code", "param")}


def is_overlength_error(status: int, body: Any) -> bool:
    """HTTP status + JSON body of a refusal because the prompt (plus ``max_tokens``) exceeds the window."""
    if status not in (400, 413, 422):
        return False
    fields = error_fields(body)
    if fields.get("code") == "context_length_exceeded" or fields.get("type") == "exceed_context_size_error":
        return True
    if fields.get("param") == "input_tokens":
        return True
    message = str(fields.get("message") or "")
    if fields.get("param") == "max_tokens" and "must be at least 1" in message:
        return True  # vLLM 0.32 when the prompt fills the whole window
    return bool(OVERLENGTH_TEXT.search(message))


def retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def cached_tokens(usage: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, when the server reports prefix-cache hits."""
    details = usage.get("prompt_tokens_details")
    return int_or_none(details.get("cached_tokens")) if isinstance(details, Mapping) else None


def text_of(request: Request, sender: str) -> str:
    """The request's text, which ``sender`` (a backend that sends text) cannot do without."""
    if request.text is None:
        raise BackendRequestError(
            f"{sender} sends text but the request has none", field="text", fix="send the layout text"
        )
    return request.text


def apply_stops(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


#: Answer fields that carry the prompt or its ids back (an echo): never kept in an excerpt.
_PROMPT_FIELDS = frozenset(
    {"prompt", "prompt_token_ids", "token_ids", "prompt_logprobs", "messages", "input", "inputs", "echo"}
)
EXCERPT_LIMIT = 240
_PROMPT_WINDOW = 32
_HTML_TAG = re.compile(r"<[^>]{0,200}>")


def _scrub(value: Any, depth: int = 0) -> Any:
    """``value`` (a decoded answer) without what could carry the prompt: prompt fields dropped, id lists
    counted, long strings cut, nesting beyond 4 levels elided."""
    if depth > 4:
        return "…"
    if isinstance(value, Mapping):
        return {
            str(k): ("<removed>" if str(k) in _PROMPT_FIELDS else _scrub(v, depth + 1))
            for k, v in list(value.items())[:12]
        }
    if isinstance(value, list):
        if len(value) > 4 and all(isinstance(v, int) for v in value[:64]):
            return f"<{len(value)} ids>"
        return [_scrub(v, depth + 1) for v in value[:4]] + (["…"] if len(value) > 4 else [])
    if isinstance(value, str) and len(value) > 80:
        return value[:80] + "…"
    return value


def _without_prompt(text: str, prompt: str) -> str:
    """``text`` with every run of at least ``2 × _PROMPT_WINDOW`` characters that is also in ``prompt``
    replaced by ``<prompt text>`` (windows of 32 characters at a stride of 16 are looked up: a few
    substring searches, not one per character)."""
    w = _PROMPT_WINDOW
    hidden = [False] * len(text)
    for i in range(0, max(0, len(text) - w) + 1, w // 2):
        if text[i : i + w] in prompt:
            hidden[i : i + w] = [True] * len(text[i : i + w])
    out: list[str] = []
    for i, ch in enumerate(text):
        if not hidden[i]:
            out.append(ch)
        elif i == 0 or not hidden[i - 1]:
            out.append("<prompt text>")
    return "".join(out)


def server_excerpt(body: Any, raw: bytes | None = None, prompt: str | None = None) -> str:
    """A short excerpt of what a server answered, safe to keep in a record (issue #37, item 2): the
    decoded JSON with its prompt fields removed and id lists counted (:func:`_scrub`), or the raw bytes
    as text without HTML tags; any run of the prompt's own text replaced; at most
    :data:`EXCERPT_LIMIT` characters. The caller redacts its API key."""
    if body is not None:
        text = json.dumps(_scrub(body), ensure_ascii=False, default=str)
    else:
        text = " ".join(_HTML_TAG.sub(" ", (raw or b"")[:4096].decode("utf-8", "replace")).split())
    if prompt:
        text = _without_prompt(text, prompt)
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text if len(text) <= EXCERPT_LIMIT else text[:EXCERPT_LIMIT] + "…"


# --------------------------------------------------------------------------------------------------
# JSON and the two HTTP clients


def array_default(value: Any) -> Any:
    """What orjson's numpy support does not take (a non-contiguous or foreign-endian id array) and the
    stdlib ``json`` (no numpy at all) get: the array's ints as a list."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(payload: Mapping[str, Any]) -> bytes:
    """``payload`` as JSON bytes: orjson (a 128K-id body in 1.3 ms, the stdlib ``json`` 19 ms,
    docs/benchmarks-runner-gate.md), an id array written straight from its numpy buffer (the same JSON
    array of ints as its list); the stdlib for what orjson refuses (a lone surrogate in a text), which
    escapes it."""
    try:
        return orjson.dumps(payload, default=array_default, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return json.dumps(payload, default=array_default).encode()


def native(ids: Sequence[int] | npt.NDArray[Any]) -> Sequence[int] | npt.NDArray[Any]:
    """An id array as orjson writes it directly: C-contiguous, native byte order (it refuses a
    foreign-endian array with a TypeError, and the stdlib fallback spaces its JSON differently)."""
    if isinstance(ids, np.ndarray) and not (ids.dtype.isnative and ids.flags.c_contiguous):
        return np.ascontiguousarray(ids, dtype=ids.dtype.newbyteorder("="))
    return ids


def same_ids(echoed: list[Any], sent: Sequence[int] | npt.NDArray[Any]) -> bool:
    """Whether the server's echoed prompt ids are the ids sent (a list, or a numpy array compared
    without building a list of it)."""
    if not isinstance(sent, np.ndarray):
        return echoed == list(sent)
    if len(echoed) != len(sent):
        return False
    try:
        got = np.asarray(echoed)
    except (ValueError, TypeError):
        return False
    return got.dtype.kind in "iu" and bool(np.array_equal(got, sent))


def loads(raw: bytes) -> Any:
    """JSON bytes decoded: orjson, or the stdlib for what only it accepts (``NaN``, integers beyond 64
    bits). Raises :class:`ValueError` when ``raw`` is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, read whole: no client object (which holds the request and its headers) kept."""

    status: int
    reason: str
    retry_after: str | None
    content: bytes


@dataclass(frozen=True)
class Failure:
    """A request that got no answer: ``timeout`` or ``unreachable``; ``name`` the failure's kind (httpx's
    exception names: ``ConnectTimeout``, ``ReadTimeout``, ``ConnectError`` …), ``detail`` its text."""

    kind: Literal["timeout", "unreachable"]
    name: str
    detail: str = ""


def environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``, ``HTTP_PROXY`` or ``ALL_PROXY`` by its
    scheme), unless ``NO_PROXY`` covers its host; ``None`` for none."""
    parts = urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    proxies = urllib.request.getproxies_environment()
    return proxies.get(parts.scheme.lower()) or proxies.get("all") or None


class AiohttpSession:
    """aiohttp: one pool of ``max_connections``; ``timeout_s`` bounds every read (and the wait for a
    pooled connection, as httpx's pool timeout did), ``connect_timeout_s`` the TCP/TLS connect."""

    def __init__(self, options: HTTPOptions, base_url: str) -> None:
        self._proxy = environment_proxy(base_url)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=options.max_connections, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=max(options.timeout_s, options.connect_timeout_s),
                sock_connect=options.connect_timeout_s,
                sock_read=options.timeout_s,
            ),
            # Not trust_env: aiohttp would then look up the proxy variables and read ~/.netrc on every
            # request; the proxy is looked up once per client instead (httpx read it once too).
            trust_env=False,
        )

    async def send(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> Answer | Failure:
        try:
            async with self._session.request(
                method, url, data=body, headers=headers, allow_redirects=False, proxy=self._proxy
            ) as response:
                content = await response.read()
                return Answer(
                    response.status, response.reason or "", response.headers.get("Retry-After"), content
                )
        except aiohttp.ConnectionTimeoutError:
            return Failure("timeout", "ConnectTimeout")
        except TimeoutError:  # aiohttp's SocketTimeoutError (sock_read) is one
            return Failure("timeout", "ReadTimeout")
        except (aiohttp.ClientError, OSError) as exc:
            return Failure("unreachable", type(exc).__name__, str(exc))

    async def aclose(self) -> None:
        await self._session.close()


class HttpxSession:
    """httpx, as before aiohttp (``HTTPOptions.client = "httpx"``, or a ``transport`` for tests)."""

    def __init__(self, options: HTTPOptions) -> None:
        import httpx

        self._httpx = httpx
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(options.timeout_s, connect=options.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=options.max_connections, max_keepalive_connections=options.max_connections
            ),
            transport=options.transport,
            follow_redirects=False,
        )

    async def send(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> Answer | Failure:
        httpx = self._httpx
        try:
            response = await self._client.request(method, url, content=body, headers=headers)
        except httpx.TimeoutException as exc:
            return Failure("timeout", type(exc).__name__)
        except httpx.TransportError as exc:
            return Failure("unreachable", type(exc).__name__, str(exc))
        return Answer(
            response.status_code,
            response.reason_phrase,
            response.headers.get("retry-after"),
            response.content,
        )

    async def aclose(self) -> None:
        await self._client.aclose()


Session = AiohttpSession | HttpxSession


async def closed_at_loop_end(session: Session) -> AsyncGenerator[None, None]:
    """Yields once; its ``finally`` closes ``session``. An event loop finalizes every unfinished async
    generator when ``asyncio.run`` ends (PEP 525, ``loop.shutdown_asyncgens``), so a client is closed in
    the loop it was opened in even when its backend is closed later from another loop (``depthgate run``
    sends in one ``asyncio.run`` and closes the backends in others; aiohttp then reports an unclosed
    session and leaves its sockets open)."""
    try:
        yield
    finally:
        await session.aclose()

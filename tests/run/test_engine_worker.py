"""The embedded engine in a worker process (issue #35): the same answers as llama.cpp in process, and a
worker that dies is a named :class:`EngineCrashError` — the signal, the pid, what it was doing — from the
call that saw it and every later one, never a dead depthgate process.

The model tests run Gemma-3-270M for real and kill its worker with real signals.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from depthgate.exceptions import BackendError, EngineCrashError, InputError, TokenizerMismatchError
from depthgate.run.backends.base import EmbeddedBackendAdapter, Request
from depthgate.run.backends.llamacpp_worker import describe_exit, error_from_reply


def test_describe_exit_names_signals_and_statuses() -> None:
    assert describe_exit(-signal.SIGILL) == ("SIGILL", "died by SIGILL (Illegal instruction)")
    assert describe_exit(-signal.SIGSEGV) == ("SIGSEGV", "died by SIGSEGV (Segmentation fault)")
    assert describe_exit(-signal.SIGKILL) == ("SIGKILL", "died by SIGKILL (Killed)")
    assert describe_exit(3) == (None, "exited with status 3")
    assert describe_exit(None) == (None, "stopped answering")


def test_worker_errors_come_back_under_their_own_class() -> None:
    err = error_from_reply(("InputError", "prompt too long", "m.gguf", "token_ids", "shorten it"))
    assert type(err) is InputError and err.field == "token_ids" and err.fix == "shorten it"
    assert type(error_from_reply(("TokenizerMismatchError", "x", None, None, None))) is TokenizerMismatchError
    # a class that is not depthgate's, or a crash claimed by the worker itself, is a BackendError
    assert type(error_from_reply(("ValueError", "x", None, None, None))) is BackendError
    assert type(error_from_reply(("EngineCrashError", "x", None, None, None))) is BackendError


@pytest.fixture(scope="module")
def gemma() -> tuple[object, object]:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf

    path = gemma_default_gguf()
    return path, tokenizer_from_gguf(path)


def _prompt(tokenizer: object, n: int) -> list[int]:
    text = "The travel policy allows a maximum of 180 EUR per night in Oslo. " * (n // 10 + 1)
    ids = tokenizer.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
    return [2, *ids[: n - 1]]


@pytest.mark.smoke_model
def test_the_worker_answers_as_the_engine_in_process(gemma: tuple[object, object]) -> None:
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    path, tok = gemma
    prompts = [_prompt(tok, n) for n in (40, 300, 700)]
    with EmbeddedLlamaBackend(path, n_ctx=1024, tokenizer=tok, n_threads=2) as local:  # type: ignore[arg-type]
        want = [local.generate(p, max_tokens=8, seed=0) for p in prompts]
    with LlamaWorkerBackend(path, n_ctx=1024, tokenizer=tok, n_threads=2) as worker:  # type: ignore[arg-type]
        assert worker.pid != os.getpid() and worker.window == 1024 and worker.probe_report.ok
        got = [worker.generate(p, max_tokens=8, seed=0) for p in prompts]
        # errors the engine raises cross the boundary under their own class
        with pytest.raises(InputError, match="exceeds the context window"):
            worker.generate(_prompt(tok, 1020), max_tokens=8, seed=0)
        assert worker.generate(prompts[0], max_tokens=8, seed=0).text == want[0].text  # still serving
    for w, g in zip(want, got, strict=True):
        assert (g.text, g.completion_token_ids, g.n_prompt_tokens, g.finish_reason) == (
            w.text,
            w.completion_token_ids,
            w.n_prompt_tokens,
            w.finish_reason,
        )


@pytest.mark.smoke_model
@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL], ids=lambda s: s.name)
def test_a_worker_killed_mid_request_is_a_named_engine_crash(
    gemma: tuple[object, object], sig: signal.Signals
) -> None:
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    path, tok = gemma
    worker = LlamaWorkerBackend(path, n_ctx=2048, tokenizer=tok, n_threads=2)  # type: ignore[arg-type]
    adapter = EmbeddedBackendAdapter(worker, name="gemma")
    prompt = _prompt(tok, 1800)  # ≥ 1 s of prompt evaluation on 2 cores: the signal lands inside it
    threading.Timer(0.3, os.kill, (worker.pid, sig)).start()
    request = Request(
        layout_id="L-7",
        arm="baseline",
        seed=3,
        token_ids=prompt,
        text=None,
        max_tokens=8,
        temperature=0.0,
        stop=("\n",),
    )
    with pytest.raises(EngineCrashError) as caught:
        asyncio.run(adapter.generate(request))
    exc = caught.value
    assert exc.signal_name == sig.name and exc.returncode == -sig
    assert f"(pid {worker.pid}) died by {sig.name}" in exc.message
    assert "while evaluating a 1800-token prompt" in exc.message
    assert "request in flight: layout L-7, seed 3, arm baseline" in exc.message
    assert exc.summary.startswith(f"engine_crash: worker died by {sig.name}")
    assert exc.exit_code == 30 and "resume" in (exc.fix or "")
    # every later call says the same, at once; closing does not hang
    with pytest.raises(EngineCrashError, match=sig.name):
        worker.generate(prompt[:10], max_tokens=2, seed=0)
    asyncio.run(adapter.aclose())

"""The embedded engine out of the depthgate process: llama.cpp in a worker process, ids in, tokens out.

Why a process: llama.cpp's CPU kernels run native code picked at build time. A build that selects an
instruction the host cannot run (an AMX tile load on a VM that lists AMX, issue #35), a segfault in a
kernel, or the OOM killer ends the process that holds the engine — with the engine in process, that was
the whole run, with no verdict, no report and no exit code. In a worker, the death is one named failure:
:class:`~depthgate.exceptions.EngineCrashError` names the signal (``SIGILL`` …) and what the worker was
doing; the runner records the request in flight as ``infra_error``, stops sending on that arm, and the
pipeline writes the reports and exits 30 (INFRA). A rerun of the same folder starts a fresh worker and
sends only what has no final record.

The restart rule: **a worker that died is not restarted within the run.** A SIGILL or SIGSEGV repeats
on the same build and the same prompt, and a restart would turn one clear failure into a slow loop; the
rerun is the restart, and it resumes with nothing lost or duplicated.

Protocol: two pipes (``multiprocessing.connection`` framing, pickled tuples), one request at a time:
``("generate", ids, kwargs)`` → ``("ok", Generation fields)`` or ``("error", class, message, file,
field, fix)``; ``("tokenize", text, add_bos, special)`` for the tokenizer probe; ``("close",)``. The
worker's stdout is its stderr, so nothing llama.cpp prints reaches depthgate's stdout. Measured cost of
the boundary: see docs/benchmarks.md (“engine in a worker”).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

from tokenizers import Tokenizer

from depthgate import exceptions
from depthgate.exceptions import BackendError, DepthgateError, EngineCrashError, InputError
from depthgate.layout.gguf_tokenizer import (
    ProbeReport,
    gemma_default_gguf,
    tokenizer_from_gguf,
    verify_against_llamacpp,
)
from depthgate.run.backends.llamacpp import ClosedOnExit, Generation, check_load_settings
from depthgate.spec.files import GGUF_FIX, require_file

__all__ = ["LlamaWorkerBackend", "describe_exit", "error_from_reply"]

# How long a worker may take to leave after "close" before it is killed (it only frees the model).
_CLOSE_GRACE_S = 10.0


def describe_exit(returncode: int | None) -> tuple[str | None, str]:
    """``(signal name or None, words)`` for a child's return code: ``-4`` → ``("SIGILL", "died by
    SIGILL (Illegal instruction)")``; ``3`` → ``(None, "exited with status 3")``."""
    if returncode is None:
        return None, "stopped answering"
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"signal {-returncode}", f"died by signal {-returncode}"
        words = signal.strsignal(sig) or sig.name
        return sig.name, f"died by {sig.name} ({words})"
    return None, f"exited with status {returncode}"


class _Probe:
    """The worker seen as llama.cpp's tokenizer, for :func:`verify_against_llamacpp`."""

    def __init__(self, worker: LlamaWorkerBackend) -> None:
        self._worker = worker

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return list(self._worker.call("tokenize", text, add_bos, special))


class LlamaWorkerBackend(ClosedOnExit):
    """The embedded backend with llama.cpp in a worker process (the product path of ``llamacpp``
    without an endpoint). Same arguments and attributes as
    :class:`~depthgate.run.backends.llamacpp.EmbeddedLlamaBackend`; the harness's tokenizer is checked
    against the worker's llama.cpp tokenizer at load (:attr:`probe_report`), any disagreement refused.

    ``pid``: the worker's process id. A worker death raises :class:`EngineCrashError` from the call
    that saw it (the load, or the request in flight) and from every later call.
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
        path = Path(model_path) if model_path is not None else gemma_default_gguf()
        require_file(path, InputError, "model file not found", fix=GGUF_FIX)
        check_load_settings(n_ctx, n_threads)
        #: The GGUF file loaded.
        self.model_path: Final[Path] = path
        self._lock = threading.Lock()
        self._dead: EngineCrashError | None = None
        self._proc, conn = _spawn()
        self._conn: _Duplex | None = conn
        self.pid: Final[int] = self._proc.pid
        try:
            facts = self.call(
                "load",
                {
                    "model_path": str(path),
                    "n_ctx": n_ctx,
                    "reuse_prefix": bool(reuse_prefix),
                    "n_threads": n_threads,
                    "seed": seed,
                },
                doing="loading the model",
            )
            #: Tokens of prompt plus completion the backend accepts (the served ``n_ctx``).
            self.window: Final[int] = int(facts["window"])
            #: The model's trained context length (GGUF metadata).
            self.n_ctx_train: Final[int] = int(facts["n_ctx_train"])
            self.n_vocab: Final[int] = int(facts["n_vocab"])
            self.reuse_prefix: Final[bool] = bool(facts["reuse_prefix"])
            self.n_threads: Final[int] = int(facts["n_threads"])
            #: The thread count llama.cpp's context in the worker reports.
            self.engine_threads: Final[int] = int(facts["engine_threads"])
            #: The tokenizer that was verified against llama.cpp at load.
            self.tokenizer: Final[Tokenizer] = (
                tokenizer if tokenizer is not None else tokenizer_from_gguf(path)
            )
            self.probe_report: Final[ProbeReport] = verify_against_llamacpp(self.tokenizer, _Probe(self))
            self.probe_report.raise_for_mismatch(file=str(path))
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------------------
    # the boundary

    def call(self, op: str, *args: Any, doing: str | None = None) -> Any:
        """Send one request to the worker and return its answer; re-raise its error under the same
        class; raise :class:`EngineCrashError` when the worker is (or was) dead."""
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if self._conn is None:
                raise BackendError("the embedded backend is closed", fix="create a new backend")
            try:
                self._conn.send((op, *args))
                reply = self._conn.recv()
            except (EOFError, OSError):
                self._dead = self._crash(doing or op)
                raise self._dead from None
        kind, *rest = reply
        if kind == "ok":
            return rest[0]
        raise error_from_reply(rest)

    def _crash(self, doing: str) -> EngineCrashError:
        """The worker's end, waited for and named (its pipe closed: it is gone or going)."""
        try:
            code = self._proc.wait(timeout=_CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        sig, words = describe_exit(code)
        return EngineCrashError(
            f"the embedded llama.cpp worker (pid {self._proc.pid}) {words} while {doing}",
            signal_name=sig,
            returncode=code,
            summary=f"engine_crash: worker {words}",
            fix="rerun the same command to resume (a fresh worker); if it dies again the same way, rebuild "
            "the engine for a safer instruction set: DEPTHGATE_ENGINE_TIER=avx2 bash scripts/setup.sh",
        )

    # ---------------------------------------------------------------------------------------------
    # the engine's API

    @property
    def max_model_len(self) -> int:
        """Same as :attr:`window`, under vLLM's name for the served context length."""
        return self.window

    def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        seed: int,
        stop_at_newline: bool = True,
        temperature: float = 0.0,
    ) -> Generation:
        """:meth:`~depthgate.run.backends.llamacpp.LlamaEngine.generate`, in the worker."""
        ids = [int(t) for t in token_ids]
        fields = self.call(
            "generate",
            ids,
            {
                "max_tokens": max_tokens,
                "seed": seed,
                "stop_at_newline": stop_at_newline,
                "temperature": temperature,
            },
            doing=f"evaluating a {len(ids)}-token prompt",
        )
        return Generation(**fields)

    def close(self) -> None:
        """Ask the worker to leave; kill it when it does not within a grace period. Idempotent."""
        conn, self._conn = getattr(self, "_conn", None), None
        proc = getattr(self, "_proc", None)
        if conn is not None:
            try:
                if self._dead is None:
                    conn.send(("close",))
            except OSError:
                pass
            conn.close()
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=_CLOSE_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __del__(self) -> None:  # a worker never outlives its backend object
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


def _spawn() -> tuple[subprocess.Popen[bytes], _Duplex]:
    """Start a worker with two pipes of its own (no stdin/stdout sharing with depthgate's)."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(to_child_r), str(to_parent_w)],
            pass_fds=(to_child_r, to_parent_w),
            stdin=subprocess.DEVNULL,
            stdout=2,  # llama.cpp's prints go where depthgate's messages go, never into its stdout
            close_fds=True,
        )
    finally:
        os.close(to_child_r)
        os.close(to_parent_w)
    # One duplex-like pair: we write to_child_w and read to_parent_r through one Connection each.
    return proc, _Duplex(Connection(to_parent_r, writable=False), Connection(to_child_w, readable=False))


class _Duplex:
    """Two one-way pipe connections as one (``send`` on one, ``recv`` on the other)."""

    def __init__(self, reader: Connection, writer: Connection) -> None:
        self._reader = reader
        self._writer = writer

    def send(self, obj: Any) -> None:
        self._writer.send(obj)

    def recv(self) -> Any:
        return self._reader.recv()

    def close(self) -> None:
        self._writer.close()
        self._reader.close()


def error_from_reply(parts: Sequence[Any]) -> DepthgateError:
    """The worker's error as the class it raised (one of depthgate's; any other is a BackendError)."""
    name, message, file, field, fix = parts
    cls = getattr(exceptions, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, DepthgateError)) or cls is EngineCrashError:
        cls = BackendError
    return cls(str(message), file=file, field=field, fix=fix)


# --------------------------------------------------------------------------------------------------
# the worker's side


def _serve(reader: Connection, writer: Connection) -> None:
    from depthgate.run.backends.llamacpp import LlamaEngine

    engine: LlamaEngine | None = None
    while True:
        try:
            op, *args = reader.recv()
        except EOFError:  # depthgate is gone: leave
            break
        if op == "close":
            break
        try:
            if op == "load":
                engine = LlamaEngine(**args[0])
                answer: Any = {
                    "window": engine.window,
                    "n_ctx_train": engine.n_ctx_train,
                    "n_vocab": engine.n_vocab,
                    "reuse_prefix": engine.reuse_prefix,
                    "n_threads": engine.n_threads,
                    "engine_threads": engine.engine_threads,
                }
            elif engine is None:
                raise BackendError("the worker has no model loaded", fix="report this")
            elif op == "generate":
                gen = engine.generate(args[0], **args[1])
                answer = {f: getattr(gen, f) for f in Generation.__dataclass_fields__}
            elif op == "tokenize":
                answer = engine.tokenize(args[0], add_bos=args[1], special=args[2])
            else:
                raise BackendError(f"unknown worker request {op!r}", fix="report this")
            writer.send(("ok", answer))
        except DepthgateError as exc:
            writer.send(("error", type(exc).__name__, exc.message, exc.file, exc.field, exc.fix))
        except Exception as exc:  # a bug or a llama-cpp-python error: named, the worker lives on
            writer.send(("error", "BackendError", f"{type(exc).__name__}: {exc}", None, None, None))
    if engine is not None:
        engine.close()


def main(argv: Sequence[str]) -> int:
    # Ctrl-C reaches the whole process group: depthgate decides, the worker only stops with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reader = Connection(int(argv[0]), writable=False)
    writer = Connection(int(argv[1]), readable=False)
    _serve(reader, writer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

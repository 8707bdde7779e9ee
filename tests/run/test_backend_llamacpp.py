"""The embedded llama.cpp backend on the real Gemma-3-270M GGUF (no mocks)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'depthgate[embedded]')"
)

from tokenizers import Tokenizer

from depthgate.exceptions import DepthgateError, InputError
from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf, tokenizer_json_from_gguf
from depthgate.run.backends import make_backend
from depthgate.run.backends.base import EmbeddedBackendAdapter, Request
from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend, Generation
from depthgate.spec.loading import load_matrix
from depthgate.spec.system import System
from helpers import SHORT_PREAMBLE, small_smoke_matrix

ARMS = ("baseline", "candidate")

pytestmark = pytest.mark.smoke_model

N_CTX = 1024

_FILLER = [
    "Warehouse staff must report any changes to open maintenance tickets in the first week of each month.",
    "Procurement staff should review equipment loan forms before the monthly close.",
    "Printed copies of this handbook may be out of date.",
    "Legal staff must verify parking permit requests when the request is approved.",
    "Internal audit staff must report any changes to meeting room bookings.",
    "All forms referenced in this section are available on the intranet.",
]
FACT = "The access code for vault 7 is 4821."
CLOZE = "The access code for vault 7 is"


def _prompt() -> str:
    body = " ".join(_FILLER[:4]) + " " + FACT + " " + " ".join(_FILLER[2:] + _FILLER[:3])
    return (
        "Company Operations Handbook (excerpt)\n\n"
        f"Section 1. Security.\n{body}\n\n"
        "Question: What is the access code for vault 7?\n"
        f"Answer: {CLOZE}"
    )


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tokenizer_from_gguf(gemma_default_gguf())


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> Iterator[EmbeddedLlamaBackend]:
    with EmbeddedLlamaBackend(n_ctx=N_CTX, tokenizer=tokenizer) as be:
        yield be


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(_prompt(), add_special_tokens=True).ids
    assert 120 <= len(ids) <= 260, len(ids)
    return list(ids)


def _without_timings(g: Generation) -> Generation:
    return dataclasses.replace(g, prompt_seconds=0.0, decode_seconds=0.0)


def test_backend_loads_with_verified_tokenizer(backend: EmbeddedLlamaBackend) -> None:
    assert backend.probe_report.ok and backend.probe_report.n_probes >= 80
    assert backend.window == backend.max_model_len == N_CTX
    assert backend.n_ctx_train == 32768
    assert 2 <= backend.n_threads <= 8
    assert not backend.reuse_prefix


def test_planted_fact_is_retrieved_deterministically(
    backend: EmbeddedLlamaBackend, prompt_ids: list[int]
) -> None:
    first = backend.generate(prompt_ids, max_tokens=8, seed=11)
    second = backend.generate(prompt_ids, max_tokens=8, seed=11)
    assert "4821" in first.text, first
    assert _without_timings(first) == _without_timings(second)
    assert first.n_prompt_tokens == len(prompt_ids)
    assert first.prefix_cache_hit_tokens == 0
    assert first.finish_reason in ("stop", "length", "eos")
    assert 1 <= len(first.completion_token_ids) <= 8
    assert "\n" not in first.text
    # The completion's text is the text of its tokens (up to the stopping newline).
    decoded = backend.tokenizer.decode(list(first.completion_token_ids), skip_special_tokens=True)
    assert decoded.split("\n", 1)[0] == first.text


def test_finish_reasons(backend: EmbeddedLlamaBackend, prompt_ids: list[int]) -> None:
    short = backend.generate(prompt_ids, max_tokens=2, seed=0)
    assert short.finish_reason == "length" and len(short.completion_token_ids) == 2
    stopped = backend.generate(prompt_ids, max_tokens=12, seed=0)
    if stopped.finish_reason == "stop":
        newline_piece = backend.tokenizer.decode([stopped.completion_token_ids[-1]])
        assert "\n" in newline_piece


def test_seeded_sampling_is_reproducible(backend: EmbeddedLlamaBackend, prompt_ids: list[int]) -> None:
    a = backend.generate(prompt_ids, max_tokens=6, seed=123, temperature=0.9, stop_at_newline=False)
    b = backend.generate(prompt_ids, max_tokens=6, seed=123, temperature=0.9, stop_at_newline=False)
    assert a.completion_token_ids == b.completion_token_ids
    assert len(a.completion_token_ids) == 6 or a.finish_reason == "eos"


def test_over_length_prompt_is_refused_before_evaluation(
    backend: EmbeddedLlamaBackend, prompt_ids: list[int]
) -> None:
    filler = prompt_ids[1:] * (N_CTX // len(prompt_ids) + 2)
    too_long = [prompt_ids[0], *filler][: N_CTX + 5]
    with pytest.raises(InputError) as info:
        backend.generate(too_long, max_tokens=4, seed=0)
    assert info.value.fix and "context window" in str(info.value)
    # Fits alone, but not with the completion budget: still refused, never truncated.
    edge = too_long[: N_CTX - 3]
    with pytest.raises(InputError):
        backend.generate(edge, max_tokens=4, seed=0)
    # The backend is still usable afterwards.
    assert "4821" in backend.generate(prompt_ids, max_tokens=8, seed=0).text


@pytest.mark.parametrize(
    ("ids", "max_tokens"),
    [([], 4), ([2, 10**9], 4), ([2, -1], 4), ([2, 9259], 0)],
    ids=["empty", "id-too-large", "negative-id", "zero-max-tokens"],
)
def test_bad_requests_are_input_errors(
    backend: EmbeddedLlamaBackend, ids: list[int], max_tokens: int
) -> None:
    with pytest.raises(InputError):
        backend.generate(ids, max_tokens=max_tokens, seed=0)


def test_prefix_reuse_is_explicit_and_recorded(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    with EmbeddedLlamaBackend(n_ctx=N_CTX, tokenizer=tokenizer, reuse_prefix=True) as be:
        assert be.reuse_prefix
        cold = be.generate(prompt_ids, max_tokens=8, seed=0)
        warm = be.generate(prompt_ids, max_tokens=8, seed=0)
        assert cold.prefix_cache_hit_tokens == 0
        assert warm.prefix_cache_hit_tokens == len(prompt_ids) - 1
        assert warm.n_prompt_tokens == cold.n_prompt_tokens == len(prompt_ids)
        assert "4821" in warm.text
        # A different prompt sharing only the first tokens reuses exactly that prefix.
        other = prompt_ids[:20] + tokenizer.encode(" Unrelated text follows.", add_special_tokens=False).ids
        cached = prompt_ids + list(warm.completion_token_ids[:-1])
        common = next(i for i, (a, b) in enumerate(zip([*other, -1], cached, strict=False)) if a != b)
        assert 20 <= common < len(other)
        assert be.generate(other, max_tokens=2, seed=0).prefix_cache_hit_tokens == common


def test_missing_model_file_is_input_error() -> None:
    with pytest.raises(DepthgateError) as info:
        EmbeddedLlamaBackend("/nonexistent/model.gguf", n_ctx=256)
    assert isinstance(info.value, InputError)
    assert info.value.file == "/nonexistent/model.gguf"


# --------------------------------------------------------------------------------------------------
# issue #10 item 8: the embedded arm's runtime block, and paths relative to the matrix file


def _embedded_system(**kw: Any) -> System:
    base: dict[str, Any] = {"name": "embedded", "backend": "llamacpp", "model": "gemma3-270m"}
    base.update({"tokenizer": "gguf:", "window": N_CTX})
    base.update(kw)
    return System.model_validate(base)


def _two_requests(adapter: Any, prompt_ids: list[int]) -> list[Any]:
    async def both() -> list[Any]:
        try:
            return [
                await adapter.generate(
                    Request(layout_id=f"l{i}", arm="a", seed=0, token_ids=prompt_ids, text=None, max_tokens=4)
                )
                for i in range(2)
            ]
        finally:
            await adapter.aclose()

    return asyncio.run(both())


def test_runtime_n_threads_and_reuse_prefix_reach_llama_cpp(prompt_ids: list[int]) -> None:
    default = make_backend(_embedded_system())
    assert isinstance(default, EmbeddedBackendAdapter)
    assert [r.prefix_cache_hit_tokens for r in _two_requests(default, prompt_ids)] == [0, 0]
    tuned = make_backend(_embedded_system(runtime={"n_threads": 1, "reuse_prefix": True}))
    assert isinstance(tuned, EmbeddedBackendAdapter)
    llama = tuned.backend
    # read back from llama.cpp's context in the worker process
    assert llama.n_threads == 1 and llama.engine_threads == 1
    first, second = _two_requests(tuned, prompt_ids)
    assert first.prefix_cache_hit_tokens == 0 and second.prefix_cache_hit_tokens == len(prompt_ids) - 1
    assert first.text == second.text


def test_model_path_is_relative_to_the_matrix_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    matrix_dir = tmp_path / "matrices"
    (matrix_dir / "models").mkdir(parents=True)
    (matrix_dir / "models" / "gemma.gguf").symlink_to(gemma_default_gguf())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    system = _embedded_system(model="models/gemma.gguf", tokenizer="gguf:models/gemma.gguf")
    with pytest.raises(InputError, match="file not found") as info:
        make_backend(system)  # the working directory is not the matrix's folder
    assert info.value.file == "models/gemma.gguf"
    backend = make_backend(system, base_dir=matrix_dir)
    assert isinstance(backend, EmbeddedBackendAdapter)
    assert backend.backend.model_path == matrix_dir / "models" / "gemma.gguf"
    asyncio.run(backend.aclose())
    # a tokenizer.json next to the matrix, for the embedded model
    (matrix_dir / "tok").mkdir()
    (matrix_dir / "tok" / "tokenizer.json").write_bytes(
        tokenizer_json_from_gguf(gemma_default_gguf()).read_bytes()
    )
    with pytest.raises(InputError, match="tokenizer file not found"):
        make_backend(_embedded_system(tokenizer="tok/tokenizer.json"))
    backend = make_backend(_embedded_system(tokenizer="tok/tokenizer.json"), base_dir=matrix_dir)
    assert isinstance(backend, EmbeddedBackendAdapter) and backend.backend.probe_report.ok
    asyncio.run(backend.aclose())


def test_run_with_runtime_block_relative_model_and_cache_control(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`depthgate run` from another folder: the candidate's GGUF is a path relative to the matrix, its
    runtime block turns prefix reuse on (recorded hits) and asks for the warm/cold prefix-cache control
    (run/cache.py), written beside its layouts; the baseline has neither."""
    from depthgate.commands.cli import main
    from depthgate.exceptions import ExitCode

    candidate = (
        f"{SHORT_PREAMBLE}\n"
        'model = "models/gemma.gguf"\n'
        'tokenizer = "gguf:models/gemma.gguf"\n\n'
        "[candidate.runtime]\nreuse_prefix = true\ncache_control = true\nn_threads = 2\n"
    )
    text = small_smoke_matrix(preamble=candidate).replace(
        'name = "gemma-preamble"\nbackend = "llamacpp"\nmodel = "gemma3-270m"\ntokenizer = "gguf:"\n',
        'name = "gemma-preamble"\nbackend = "llamacpp"\n',
    )
    matrix_dir = tmp_path / "matrices"
    (matrix_dir / "models").mkdir(parents=True)
    (matrix_dir / "models" / "gemma.gguf").symlink_to(gemma_default_gguf())
    matrix = matrix_dir / "tiny.toml"
    matrix.write_text(text, encoding="utf-8")
    loaded = load_matrix(matrix)
    assert loaded.candidate.model == "models/gemma.gguf" and loaded.candidate.runtime.cache_control
    monkeypatch.chdir(tmp_path)  # not the matrix's folder
    out = tmp_path / "run"
    code = main(["run", str(matrix), "--out", str(out)])
    assert code not in (ExitCode.BAD_INPUT, ExitCode.INFRA, ExitCode.VERIFY_FAILED), capsys.readouterr().err
    records = pl.read_parquet(out / "records.parquet")
    assert set(records["status"]) == {"ok"} and (records["prompt_tokens_delta"] == 0).all()
    hits = {arm: records.filter(pl.col("arm") == arm)["prefix_cache_hit_tokens"].to_list() for arm in ARMS}
    assert set(hits["baseline"]) == {0} and max(hits["candidate"]) > 0
    control = json.loads((out / "candidate" / "cache_control.json").read_text(encoding="utf-8"))
    assert len(control["rows"]) == 4 and control["summary"].startswith(("prefix cache control", "runtime"))
    assert all(row["prefix_hit_tokens"] > 0 for row in control["rows"])
    assert not (out / "baseline" / "cache_control.json").exists()
    assert "cache_control.json" in capsys.readouterr().err
    # The manifest says, per arm, what decides repeatability: one sequence at a time on one context,
    # the thread count the runtime block set, prefix reuse only where asked.
    determinism = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["determinism"]
    assert determinism["candidate"]["n_threads"] == 2 and determinism["candidate"]["reuse_prefix"] is True
    assert determinism["baseline"]["reuse_prefix"] is False
    assert {d["sequences_in_flight"] for d in determinism.values()} == {1}
    engines = {d["engine"] for d in determinism.values()}
    assert engines == {"llama.cpp, embedded (llama-cpp-python, in a worker process)"}

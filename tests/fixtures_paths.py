"""The real tokenizer files, chat templates and reference vectors the tests use, shipped in the repo.

``tests/fixtures/tokenizers`` mirrors the layout of the original ``shared/tokenizers`` folder (see its
NOTICE.md); every ``tokenizer.json`` is stored gzipped. :func:`fixtures_root` materializes the tree
once into ``tests/.fixture-cache/<digest>/tokenizers`` (git-ignored; ``DEPTHGATE_FIXTURE_CACHE``
overrides the cache folder) with the ``.gz`` files decompressed and every file checked against
``MANIFEST.json``, so tests read plain ``tokenizer.json`` paths. The cache is keyed by a digest of
the stored files: changed fixtures materialize into a new folder, stale folders are removed.

A missing or corrupt fixture raises :class:`FixtureError` (a test failure or collection error naming
the file and the fix), never a skip. Module-level test code may call :func:`tokenizers_dir`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "tokenizers"
MANIFEST = FIXTURES / "MANIFEST.json"
_CACHE_ENV = "DEPTHGATE_FIXTURE_CACHE"
_COMPLETE = ".complete"
_FIX = (
    "restore them from git (`git checkout -- tests/fixtures/tokenizers`) or regenerate them from a "
    "shared/tokenizers folder: `python3 scripts/vendor_tokenizer_fixtures.py --shared <folder>`"
)


class FixtureError(RuntimeError):
    """A shipped test fixture is missing or does not match MANIFEST.json."""


def cache_dir() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or HERE / ".fixture-cache")


def _manifest() -> dict[str, dict[str, object]]:
    try:
        files = json.loads(MANIFEST.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise FixtureError(f"tokenizer fixtures: cannot read {MANIFEST} ({exc}); {_FIX}") from None
    assert isinstance(files, dict)
    return files


def _stored_digest(files: dict[str, dict[str, object]]) -> str:
    """Digest of the manifest and every stored file; names the cache folder."""
    missing = [
        str(FIXTURES / str(e["stored"]))
        for e in files.values()
        if not (FIXTURES / str(e["stored"])).is_file()
    ]
    if missing:
        raise FixtureError(f"tokenizer fixtures missing: {', '.join(missing)}; {_FIX}")
    h = hashlib.sha256(MANIFEST.read_bytes())
    for rel in sorted(files):
        stored = str(files[rel]["stored"])
        h.update(f"\0{stored}\0".encode())
        h.update(hashlib.sha256((FIXTURES / stored).read_bytes()).digest())
    return h.hexdigest()[:16]


def _materialize(files: dict[str, dict[str, object]], dest: Path) -> None:
    for rel, entry in files.items():
        stored = FIXTURES / str(entry["stored"])
        data = stored.read_bytes()
        if str(entry["stored"]) != rel:
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as exc:
                raise FixtureError(f"tokenizer fixture {stored} is not valid gzip ({exc}); {_FIX}") from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise FixtureError(f"tokenizer fixture {stored} does not match {MANIFEST}; {_FIX}")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


@functools.cache
def fixtures_root() -> Path:
    """A folder holding ``tokenizers/...`` (plain files), materialized from the shipped fixtures."""
    files = _manifest()
    digest = _stored_digest(files)
    cache = cache_dir()
    root = cache / digest
    if (root / _COMPLETE).is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=cache))
    try:
        _materialize(files, tmp / "tokenizers")
        (tmp / _COMPLETE).write_text(digest + "\n", encoding="utf-8")
        try:
            tmp.rename(root)
        except OSError:
            if not (root / _COMPLETE).is_file():  # not a concurrent session finishing first
                shutil.rmtree(root, ignore_errors=True)
                tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Earlier fixture versions, and temporary folders of sessions interrupted over an hour ago.
    for stale in cache.iterdir():
        if not stale.is_dir() or stale.name == digest:
            continue
        if not stale.name.startswith(".") or stale.stat().st_mtime < time.time() - 3600:
            shutil.rmtree(stale, ignore_errors=True)
    return root


def tokenizers_dir() -> Path:
    """``<materialized root>/tokenizers``: the layout of the original shared/tokenizers folder."""
    return fixtures_root() / "tokenizers"


def llamacpp_templates_dir() -> Path:
    """The chat templates llama.cpp ships, one ``.jinja`` file per model
    (``chat-templates/llama.cpp-models-templates``)."""
    return tokenizers_dir() / "chat-templates" / "llama.cpp-models-templates"


def tokenizer_configs_dir() -> Path:
    """Hugging Face ``tokenizer_config.json`` files whose chat templates the tests render
    (``chat-templates/tokenizer_configs``)."""
    return tokenizers_dir() / "chat-templates" / "tokenizer_configs"


def reference_tokenizer(family: str) -> Any:
    """The fixture family's tokenizer.json in the Python ``tokenizers`` package, with padding and
    truncation off: the independent encoder the contract ``ids == encode(text)`` is checked with."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizers_dir() / family / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok

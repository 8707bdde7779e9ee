"""Regenerate (or check) the tokenizer fixtures the tests ship in ``tests/fixtures/tokenizers``.

    python3 scripts/vendor_tokenizer_fixtures.py --shared ../shared/tokenizers          # regenerate
    python3 scripts/vendor_tokenizer_fixtures.py --shared ../shared/tokenizers --check  # compare only

Copies, from a ``shared/tokenizers`` folder (README.md, PROVENANCE.md files, family folders,
chat-templates/, test-vectors/), exactly the files the tests read (``INCLUDE`` below), keeping the
folder layout. Every ``tokenizer.json`` (and ``tokenizer.*.json``), and any other file larger than
``GZIP_ABOVE`` bytes, is stored as ``<name>.gz``, written with ``gzip -9 -n`` (no name, no timestamp:
the bytes are reproducible).
``MANIFEST.json`` records, for every original file, its size and sha256 and where it is stored; the
tests (``tests/fixtures_paths.py``) and the Rust tests decompress the ``.gz`` files and the Python
side checks every file against the manifest. ``NOTICE.md`` is written by hand and kept.

Standard library only (plus the ``gzip`` program when present); no depthgate import.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SHARED = REPO.parent / "shared" / "tokenizers"
OUT = REPO / "tests" / "fixtures" / "tokenizers"

# Files (glob patterns relative to shared/tokenizers) that the tests read, and the provenance notes.
# Not copied: test-vectors/swift-transformers-conformance/ and the llama.cpp vectors of vocabularies
# without a tokenizer.json here (no test reads them).
INCLUDE = [
    "README.md",
    "gpt2/*",
    "smollm/*",
    "llama2-tinyllama/*",
    "mistral-7b-v1/*",
    "llama3-from-gguf/*",
    "bert-wordpiece/*",
    "chat-templates/*",
    "chat-templates/llama.cpp-models-templates/*",
    "chat-templates/tokenizer_configs/*",
    "test-vectors/PROVENANCE.md",
    *(
        f"test-vectors/llama.cpp-vocab/ggml-vocab-{name}.gguf.{ext}"
        for name in ("gpt-2", "llama-bpe", "llama-spm", "smollm")
        for ext in ("inp", "out")
    ),
]
GZIP_NAMES = "tokenizer.*json"  # tokenizer.json, tokenizer.repo-original.json; not tokenizer_config.json
GZIP_ABOVE = 1_000_000
MANIFEST = "MANIFEST.json"
KEEP = {"NOTICE.md", MANIFEST}


def _select(shared: Path) -> list[str]:
    files: set[str] = set()
    for pattern in INCLUDE:
        matches = [p for p in shared.glob(pattern) if p.is_file()]
        if not matches:
            raise SystemExit(
                f"error: {shared}/{pattern} matches no file (is --shared a shared/tokenizers folder?)"
            )
        files.update(p.relative_to(shared).as_posix() for p in matches)
    return sorted(files)


def _gzip(data: bytes) -> bytes:
    exe = shutil.which("gzip")
    if exe:
        return subprocess.run([exe, "-9", "-n", "-c"], input=data, capture_output=True, check=True).stdout
    # Same container without name or timestamp; the deflate stream may differ from GNU gzip's.
    return gzip.compress(data, compresslevel=9, mtime=0)


def _entries(shared: Path) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for rel in _select(shared):
        data = (shared / rel).read_bytes()
        compress = fnmatch.fnmatch(Path(rel).name, GZIP_NAMES) or len(data) > GZIP_ABOVE
        stored = f"{rel}.gz" if compress else rel
        out[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "stored": stored}
    return out


def check(shared: Path, out: Path) -> int:
    """0 when the manifest and the stored files match ``shared`` exactly, else 1 (differences printed)."""
    expected = _entries(shared)
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"{out / MANIFEST}: {exc}")
        return 1
    problems = [
        f"manifest differs for {rel}"
        for rel in sorted(set(expected) | set(manifest))
        if expected.get(rel) != manifest.get(rel)
    ]
    for rel, entry in manifest.items():
        path = out / str(entry["stored"])
        if not path.is_file():
            problems.append(f"missing {path}")
            continue
        data = path.read_bytes()
        if entry["stored"] != rel:
            data = gzip.decompress(data)
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"content differs: {path}")
    for problem in problems:
        print(problem)
    verdict = f"{len(problems)} problem(s)" if problems else "OK"
    print(f"{len(manifest)} files checked against {shared}: {verdict}")
    return 1 if problems else 0


def vendor(shared: Path, out: Path) -> None:
    entries = _entries(shared)
    out.mkdir(parents=True, exist_ok=True)
    wanted = {str(e["stored"]) for e in entries.values()} | KEEP
    for path in sorted(out.rglob("*"), reverse=True):  # drop files no longer vendored, then empty dirs
        rel = path.relative_to(out).as_posix()
        if path.is_file() and rel not in wanted:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    total = 0
    for rel, entry in entries.items():
        data = (shared / rel).read_bytes()
        target = out / str(entry["stored"])
        target.parent.mkdir(parents=True, exist_ok=True)
        stored = _gzip(data) if entry["stored"] != rel else data
        target.write_bytes(stored)
        total += len(stored)
    manifest = {
        "about": "Files vendored from shared/tokenizers by scripts/vendor_tokenizer_fixtures.py; "
        "bytes and sha256 are of the original (uncompressed) file, stored is the path here.",
        "files": entries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {len(entries)} files to {out} ({total / 1e6:.2f} MB stored)")
    if not (out / "NOTICE.md").is_file():
        print(f"note: {out / 'NOTICE.md'} is missing; restore it from git", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shared",
        type=Path,
        default=DEFAULT_SHARED,
        help=f"shared/tokenizers folder (default {DEFAULT_SHARED})",
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"fixture folder (default {OUT})")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on any difference")
    args = parser.parse_args(argv)
    if not args.shared.is_dir():
        parser.error(f"--shared {args.shared} is not a directory")
    if args.check:
        return check(args.shared, args.out)
    vendor(args.shared, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

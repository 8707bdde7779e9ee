"""Fast verification is sound by construction (issue #10, item 5): only tokenizers whose pre-tokenizer,
normalizer, model and added tokens are known to have a bounded context are assembled from cached
segments; every other tokenizer falls back to the full re-encode, and the layout records why.

Adversarial tokenizers are built here, at test time, by editing the JSON of the real fixture files. For
each one, every layout that ``--verification fast`` emits as ``ok`` must satisfy ``ids ==
encode(text)`` under the *Python* ``tokenizers`` wheel (independently of the Rust core)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.exceptions import SpecError
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import (
    BuildOptions,
    build_batch,
    build_frame,
    load_tokenizer,
    parse_positions,
)
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir

TOK = tokenizers_dir()

#: The issue's tokenizer: GPT-2 with Sequence[Split(regex with a 20–60-char lookahead), ByteLevel]. Letters
#: are cut in pairs when a digit follows 20–60 characters later, so a unit encoded alone (or in a seam
#: window) tokenizes differently from the same unit in the whole prompt. On the old allowlist ("any
#: Split is local") fast mode wrote ok layouts 26 tokens longer than encode(text).
LOOKAHEAD = (
    r" ?\p{L}{1,2}(?=[^\d]{20,60}\d)"
    r"|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(t: dict[str, Any]) -> None:
        t[key] = copy.deepcopy(value)

    return edit


def _wrap_pre_in_sequence(t: dict[str, Any]) -> None:
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [t["pre_tokenizer"]]}


def _llama2_metaspace_in_sequence(t: dict[str, Any]) -> None:
    t["normalizer"] = None
    t["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
        ],
    }


def _reverse_pre(t: dict[str, Any]) -> None:
    t["pre_tokenizer"]["pretokenizers"].reverse()


def _added_token_with_space(t: dict[str, Any]) -> None:
    t["added_tokens"].append(
        {
            "id": 50257,
            "content": " hotel rate",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    )


def _fewer_merges(t: dict[str, Any]) -> None:
    # An "older release" of the same file: the merges that build common words are gone.
    drop = {"Ġthe", "Ġfor", "Ġand", "Ġrate", "Ġhotel", "Ġpolicy", "Ġregion"}

    def result(m: Any) -> str:
        return "".join(m) if isinstance(m, list) else str(m).replace(" ", "", 1)

    t["model"]["merges"] = [m for m in t["model"]["merges"] if result(m) not in drop]


# (name, fixture family, edit, substring of the expected fallback reason or None when it stays sound)
VARIANTS: list[tuple[str, str, Callable[[dict[str, Any]], None], str | None]] = [
    (
        "gpt2-split-lookahead",
        "gpt2",
        _set("pre_tokenizer", {"type": "Sequence", "pretokenizers": [_split(LOOKAHEAD), _byte_level(False)]}),
        "Split inside a Sequence regex",
    ),
    (
        "gpt2-split-other-regex",  # Llama-3's regex with unbounded digit runs: close, but not known
        "gpt2",
        _set(
            "pre_tokenizer",
            {
                "type": "Sequence",
                "pretokenizers": [_split(LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}+")), _byte_level(False)],
            },
        ),
        "is not a known bounded-context pattern",
    ),
    (
        "mistral-metaspace-in-sequence",
        "mistral-7b-v1",
        _wrap_pre_in_sequence,
        "Metaspace(split=false) inside",
    ),
    (
        "llama2-metaspace-in-sequence",
        "llama2-tinyllama",
        _llama2_metaspace_in_sequence,
        "Metaspace(split=false)",
    ),
    ("llama3-reordered", "llama3-from-gguf", _reverse_pre, "[ByteLevel, Split] is not a known"),
    (
        "gpt2-strip-normalizer",
        "gpt2",
        _set("normalizer", {"type": "Strip", "strip_left": True, "strip_right": True}),
        "normalizer Strip is not character-local",
    ),
    (
        "gpt2-replace-normalizer",  # collapses whitespace runs: not character-local
        "gpt2",
        _set("normalizer", {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}),
        "normalizer Replace",
    ),
    (
        "gpt2-prefix-space",
        "gpt2",
        _set("pre_tokenizer", {**_byte_level(True), "add_prefix_space": True}),
        "add_prefix_space",
    ),
    (
        "gpt2-truncation",
        "gpt2",
        _set(
            "truncation", {"direction": "Right", "max_length": 512, "strategy": "LongestFirst", "stride": 0}
        ),
        "truncation",
    ),
    ("gpt2-added-token-with-space", "gpt2", _added_token_with_space, "contains whitespace"),
    # Still sound: judged by content, so these stay fast — and must stay exact.
    ("gpt2-fewer-merges", "gpt2", _fewer_merges, None),
    (
        "gpt2-nested-sequence",
        "gpt2",
        _set(
            "pre_tokenizer",
            {
                "type": "Sequence",
                "pretokenizers": [{"type": "Sequence", "pretokenizers": [_byte_level(True)]}],
            },
        ),
        None,
    ),
    (
        "gpt2-nfkc-lowercase",
        "gpt2",
        _set("normalizer", {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}),
        None,
    ),
]


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-variants")


def _variant(folder: Path, name: str, family: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    data = json.loads((TOK / family / "tokenizer.json").read_text(encoding="utf-8"))
    edit(data)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def _hf(path: Path) -> HFTokenizer:
    # The tokenizer as the file configures it (truncation included): what a server loading it encodes.
    return HFTokenizer.from_file(str(path))


def _assert_exact(frame: pl.DataFrame, hf: HFTokenizer, name: str) -> int:
    ok = 0
    for row in frame.iter_rows(named=True):
        if row["status"] != "ok":
            assert row["reason_code"] and row["reason"], name
            continue
        ok += 1
        enc = hf.encode(row["text"], add_special_tokens=row["add_special_tokens"])
        assert enc.ids == list(row["token_ids"]), (
            name,
            row["target_tokens"],
            row["position"],
            row["verification"],
        )
        assert len(enc.ids) == row["target_tokens"], name
    return ok


# Adversarial units at seams (the hypothesis alphabet of test_layouts.py, fixed).
_UNITS = [
    "\té policy 東京!",
    "  <<SYS>>x café 数据。",
    "\n\n数据 naïve 4721 1,200.",
    " 😀 🚀🚀 don't e\u0301 \u200b end.",
    "   \n\nΩ 3.5 x)",
    " Staff must file the forms 12 days ahead.",
    "\nThe rate is 245 USD per night.",
]


def _adversarial_batch(verification: str) -> dict[str, Any]:
    return {
        "assembler_version": "test",
        "template_digest": "raw",
        "add_special_tokens": True,
        "verification": verification,
        "filler": _UNITS * 120,
        "pool": [" Noted.", " Ok.", " Yes.", " Forms are online."]
        + [f" {'Staff ' * n}review it." for n in range(1, 30)],
        "cases": [
            {
                "case_id": "adv",
                "case_digest": "adv",
                "prefix": "Handbook",
                "suffix": "\n\nQuestion: which?\nAnswer:",
                "moving": [{"id": "ev", "text": " The maximum hotel rate is 245 USD.", "kind": "evidence"}],
                "anchored": [{"id": "d", "text": " 東京 rate 260 😀.", "kind": "distractor", "depth": 0.4}],
                "filler_offset": 0,
            }
        ],
        "lengths": [300, 600],
        "positions": [p.to_spec() for p in parse_positions(["0", "0.25", "0.5", "0.75", "1"])],
    }


@pytest.mark.parametrize(("name", "family", "edit", "expected"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_fast_mode_is_exact_or_falls_back_with_the_reason(
    variant_dir: Path,
    tmp_path: Path,
    name: str,
    family: str,
    edit: Callable[[dict[str, Any]], None],
    expected: str | None,
) -> None:
    path = _variant(variant_dir, name, family, edit)
    tok = load_tokenizer(path)
    hf = _hf(path)
    reason = tok.fast_unsound_reason
    if expected is None:
        assert reason is None, (name, reason)
    else:
        assert reason is not None and expected in reason, (name, reason)
    out = tmp_path / "layouts.parquet"
    suite_frame = build_frame(
        builtin_suite(10),
        tok,
        BuildOptions(lengths=[512, 1024], positions=parse_positions(["0", "0.5", "1"]), verification="fast"),
        out,
    )
    try:
        batch_frame = build_batch(tok, _adversarial_batch("fast"))
    except SpecError as exc:  # a unit holds one of this variant's special or added strings
        assert "special-token" in str(exc), exc
        batch_frame = suite_frame.clear()
    frame = pl.concat([suite_frame, batch_frame], how="diagonal_relaxed")
    ok = _assert_exact(frame, hf, name)
    assert ok > 0, (name, frame["reason_code"].unique().to_list())
    verification = set(frame["verification"].to_list())
    if expected is None:
        assert "fast" in verification, name
    else:
        # Every layout (refused ones too) says it was verified in full, and why.
        assert verification == {"full"}, name
        notes = frame["verification_note"].to_list()
        assert all(note is not None and reason in note for note in notes), (name, notes[:2])
    # The Rust re-check agrees with the wheel on the product file.
    assert check_layouts(out, tok).ok


def test_issue_tokenizer_is_not_seam_local(variant_dir: Path) -> None:
    """Guard on the adversarial tokenizer itself, so the test above is not vacuous: concatenating the
    encodings of two units is not the encoding of their concatenation, and the difference lies more
    than a seam window (8 bytes) before the seam: the lookahead reaches into the next unit."""
    path = _variant(variant_dir, "gpt2-split-lookahead", "gpt2", VARIANTS[0][2])
    hf = _hf(path)
    unit_a, unit_b = " Staff file forms before the monthly close.", " The rate is 245 USD per night."
    joint = hf.encode(unit_a + unit_b, add_special_tokens=False)
    alone = hf.encode(unit_a, add_special_tokens=False)
    first = next(i for i, (x, y) in enumerate(zip(joint.ids, alone.ids, strict=False)) if x != y)
    assert joint.offsets[first][0] < len(unit_a) - 8

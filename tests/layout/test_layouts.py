"""The token-exact layout contract on every real tokenizer family in tests/fixtures/tokenizers, with the
real chat templates that fit them: ids == encode(text) (checked here with the *Python* `tokenizers`
wheel, independently of the Rust core), exact length, spans read from the final offsets, evidence ids
identical at every position, haystack identical across positions."""

from __future__ import annotations

import gzip
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from depthgate.exceptions import InputError, SpecError, TokenizerLoadError
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import (
    BuildOptions,
    build_batch,
    build_frame,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.layout.templates import load_chat_template
from depthgate.spec.suites import builtin_suite, generate_suite
from fixtures_paths import llamacpp_templates_dir, reference_tokenizer, tokenizers_dir

TOK = tokenizers_dir()
TPL = llamacpp_templates_dir()

# (tokenizer family, chat template or None for the raw completion frame)
PAIRS = [
    ("gpt2", None),
    ("smollm", TOK / "smollm" / "chat_template.jinja"),
    ("llama2-tinyllama", TOK / "llama2-tinyllama" / "chat_template.jinja"),
    ("llama2-tinyllama", TOK / "llama2-tinyllama" / "chat_template.llama-2-chat.jinja"),
    ("mistral-7b-v1", TOK / "mistral-7b-v1" / "chat_template.jinja"),
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    ("llama3-from-gguf", TPL / "meta-llama-Llama-3.2-3B-Instruct.jinja"),
    ("bert-wordpiece", None),
]
POSITIONS = parse_positions(["0", "0.25", "0.5", "0.75", "1", "@200"])


def _hf(family: str) -> HFTokenizer:
    return reference_tokenizer(family)


def _assert_contract(frame: pl.DataFrame, family: str) -> None:
    hf = _hf(family)
    for row in frame.iter_rows(named=True):
        assert row["status"] == "ok", (family, row["position"], row["reason"])
        enc = hf.encode(row["text"], add_special_tokens=row["add_special_tokens"])
        assert enc.ids == list(row["token_ids"]), (family, row["target_tokens"], row["position"])
        assert len(enc.ids) == row["target_tokens"] == row["total_tokens"]
        for span in row["evidence_spans"]:
            # Spans come from the offsets of the final encoding: every token inside the span maps
            # inside the unit's characters, and the unit's text is exactly at those characters.
            ts, te = span["token_start"], span["token_end"]
            assert 0 <= ts < te <= len(enc.ids)
            cs, ce = span["char_start"], span["char_end"]
            char_offsets = [enc.offsets[i] for i in range(ts, te)]
            if family != "bert-wordpiece":  # BERT offsets index the normalised text
                assert char_offsets[0][0] >= cs and char_offsets[-1][1] <= ce


@pytest.mark.parametrize(
    ("family", "template"), PAIRS, ids=[f"{f}-{t.stem if t else 'raw'}" for f, t in PAIRS]
)
def test_every_family_and_template_meets_the_contract(
    family: str, template: Path | None, tmp_path: Path
) -> None:
    tok = load_tokenizer(TOK / family / "tokenizer.json")
    # Llama-3's template writes {{ bos_token }} and the GGUF-built tokenizer adds no BOS: the model's
    # tokenizer_config.json names it (a bare template without it is refused, issue #37).
    bos = "<|begin_of_text|>" if family == "llama3-from-gguf" else None
    chat = load_chat_template(template, bos_token=bos) if template else None
    out = tmp_path / "layouts.parquet"
    summary = build_layouts(
        builtin_suite(4), tok, BuildOptions(lengths=[768, 2048], positions=POSITIONS, template=chat), out
    )
    assert summary.height == 4 * 2 * len(POSITIONS)
    frame = read_layouts(out)
    _assert_contract(frame, family)
    # Evidence ids identical at every position and length of a case.
    for case_id, rows in frame.group_by("case_id"):
        seen = set()
        for row in rows.iter_rows(named=True):
            for span in row["evidence_spans"]:
                if span["kind"] == "evidence":
                    seen.add(
                        (
                            span["evidence_id"],
                            tuple(row["token_ids"][span["token_start"] : span["token_end"]]),
                        )
                    )
        assert len({ev for ev, _ in seen}) == len(seen), case_id
    # The Rust re-check agrees.
    assert check_layouts(out, tok).ok


def test_positions_move_only_the_evidence(tmp_path: Path) -> None:
    """Removing the moving evidence from every layout of a case leaves the identical text: the
    haystack (filler, competing evidence, distractors) is the same at every position."""
    tok = load_tokenizer(TOK / "gpt2" / "tokenizer.json")
    out = tmp_path / "layouts.parquet"
    frame = build_frame(builtin_suite(2), tok, BuildOptions(lengths=[1024], positions=POSITIONS), out)
    suite = builtin_suite(2)
    for case in suite.cases:
        texts = set()
        for row in frame.filter(pl.col("case_id") == case.id).iter_rows(named=True):
            text = row["text"]
            for doc in case.decisive:
                assert text.count(doc.text) == 1
                text = text.replace(doc.text, "")
            texts.add(text)
        assert len(texts) == 1
        depth_rows = frame.filter((pl.col("case_id") == case.id) & (pl.col("position") != "@200"))
        offsets = depth_rows.sort("position")["actual_offset"].to_list()
        assert offsets == sorted(offsets)  # deeper position, later evidence


def test_golden_values_gpt2(tmp_path: Path) -> None:
    """Exact values on GPT-2 for the first built-in case: a change here is a layout change and must
    bump ASSEMBLER_VERSION."""
    tok = load_tokenizer(TOK / "gpt2" / "tokenizer.json")
    out = tmp_path / "layouts.parquet"
    frame = build_frame(
        builtin_suite(1), tok, BuildOptions(lengths=[1024], positions=parse_positions(["0", "1"])), out
    ).sort("position")
    first, last = frame.row(0, named=True), frame.row(1, named=True)
    assert first["text"].startswith("Company Operations Handbook (excerpt)\n\nTravel policy") is False
    assert first["region_start"] == 7  # "Company Operations Handbook (excerpt)" is 7 GPT-2 tokens
    assert first["actual_offset"] == 7 and first["snap_tokens"] == 0
    decisive = next(s for s in last["evidence_spans"] if s["evidence_id"].endswith("/v7"))
    assert decisive["token_end"] == last["region_end"]
    assert last["text"].endswith("in region Andean States is")


# ---- adversarial units (hypothesis) -------------------------------------------------------------

_WORDS = st.sampled_from(
    [
        "policy",
        "東京",
        "数据",
        "😀",
        "🚀🚀",
        "4721",
        "1,200",
        "3.5",
        "naïve",
        "café",
        "—",
        "<|im",
        "end|>",
        "< s >",
        "[INST",
        "/INST]",
        "<<SYS>>x",
        "'s",
        "don't",
        "e\u0301",
        "\u200b",
        "Ω",
        "x",
    ]
)
_SEP = st.sampled_from([" ", "  ", "\n", "\n\n", "\t", " \n ", "   \n\n"])


@st.composite
def _unit(draw: st.DrawFn) -> str:
    words = draw(st.lists(_WORDS, min_size=1, max_size=6))
    inner = " ".join(words)
    end = draw(st.sampled_from([".", "。", "!", "4", "x", "😀", ")"]))
    return draw(_SEP) + inner + end


FAST_FAMILIES = ["gpt2", "smollm", "llama3-from-gguf", "mistral-7b-v1", "llama2-tinyllama", "bert-wordpiece"]


# No shrinking phase: a failing example is reported as drawn (shrinking 128-unit batches took minutes).
@settings(
    derandomize=True,  # the same examples in every CI run
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(
    evidence=_unit(),
    distractor=_unit(),
    filler=st.lists(_unit(), min_size=3, max_size=8),
    family=st.sampled_from(FAST_FAMILIES),
    fast=st.booleans(),
)
def test_adversarial_units_keep_the_contract(
    evidence: str, distractor: str, filler: list[str], family: str, fast: bool
) -> None:
    tok = load_tokenizer(TOK / family / "tokenizer.json")
    pool = [
        " Noted.",
        " Forms are online.",
        " Ask the front desk today.",
        " Copies may be out of date.",
        " Staff should check the intranet first.",
        " Keys stay locked.",
        " Yes.",
        " Ok.",
    ]
    batch = {
        "assembler_version": "test",
        "template_digest": "raw",
        "add_special_tokens": True,
        "verification": "fast" if fast else "full",
        "filler": filler * 200,
        "pool": pool + [f" {'Staff ' * n}review it." for n in range(1, 30)],
        "cases": [
            {
                "case_id": "adv",
                "case_digest": "adv",
                "prefix": "Handbook",
                "suffix": "\n\nQuestion: which?\nAnswer:",
                "moving": [{"id": "ev", "text": evidence, "kind": "evidence"}],
                "anchored": [{"id": "d", "text": distractor, "kind": "distractor", "depth": 0.4}],
                "filler_offset": 0,
            }
        ],
        "lengths": [200, 420],
        "positions": [p.to_spec() for p in POSITIONS if p.offset is None],
    }
    try:
        frame = build_batch(tok, batch)
    except SpecError as exc:
        # Units containing a special-token string of this tokenizer are refused as bad input.
        assert "special-token" in str(exc)
        return
    hf = _hf(family)
    for row in frame.iter_rows(named=True):
        if row["status"] != "ok":
            # A refusal must name its reason; it is never a silent drop.
            assert row["reason_code"] and row["reason"]
            continue
        assert hf.encode(row["text"], add_special_tokens=True).ids == list(row["token_ids"]), (
            family,
            row["position"],
            row["verification"],
            evidence,
            distractor,
            filler,
        )
        assert row["total_tokens"] == row["target_tokens"]
    ok = frame.filter(pl.col("status") == "ok")
    # Units that begin with one space (the product's separator for evidence) build at most positions;
    # newline-led evidence may merge with the previous token (Llama-3 ".\n\n") and is then refused by name.
    if evidence.startswith(" ") and not evidence.startswith("  ") and distractor.startswith(" "):
        assert ok.height >= frame.height // 2, (
            family,
            evidence,
            distractor,
            filler,
            frame["reason"].unique().to_list(),
        )


def test_load_tokenizer_resolves_the_spec_a_matrix_names(tmp_path: Path) -> None:
    """A path relative to the matrix's folder, and a gzipped tokenizer.json (unpacked once into the
    cache): the same tokenizer as the plain file, by digest."""
    plain = TOK / "gpt2" / "tokenizer.json"
    (tmp_path / "tok.json.gz").write_bytes(gzip.compress(plain.read_bytes()))
    packed = load_tokenizer("tok.json.gz", base_dir=tmp_path)
    assert packed.digest == load_tokenizer(plain).digest
    assert packed.path.suffix == ".json" and packed.path.parent != tmp_path


def test_bad_inputs_have_named_errors(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerLoadError) as err:
        load_tokenizer(bad)
    assert str(bad) in str(err.value)
    with pytest.raises(InputError, match="tokenizer file not found") as missing:
        load_tokenizer("absent.json", base_dir=tmp_path)
    assert missing.value.file == str(tmp_path / "absent.json") and missing.value.field == "tokenizer"
    tok = load_tokenizer(TOK / "gpt2" / "tokenizer.json")
    out = tmp_path / "layouts.parquet"
    summary = build_layouts(builtin_suite(1), tok, BuildOptions(lengths=[64], positions=POSITIONS[:1]), out)
    assert summary["reason_code"].to_list() == ["length_below_fixed_parts"]
    assert "use a length of at least" in summary["reason"][0]
    summary = build_layouts(
        builtin_suite(1),
        tok,
        BuildOptions(lengths=[2048], positions=POSITIONS[:1], window=2048, max_output_tokens=16),
        out,
    )
    assert summary["reason_code"].to_list() == ["window_too_small"]


def test_zh_suite_builds_on_byte_level_and_spm(tmp_path: Path) -> None:
    suite = generate_suite(0, 3, "zh")
    for family in ("llama3-from-gguf", "mistral-7b-v1"):
        tok = load_tokenizer(TOK / family / "tokenizer.json")
        out = tmp_path / f"zh-{family}.parquet"
        _assert_contract(
            build_frame(suite, tok, BuildOptions(lengths=[1024], positions=POSITIONS), out), family
        )


def test_front_filler_digest_equals_the_core_digest() -> None:
    """The front hashes the filler once per build; the core would hash it per batch. Same bytes, same ids."""
    from depthgate.layout.layouts import _fields_digest

    tok = load_tokenizer(TOK / "gpt2" / "tokenizer.json")
    filler = [" Staff file forms.", "\n\nSection 2. Records.", "\nLegal staff archive boxes."] * 40
    pool = [" Noted.", " Forms are online.", " Ask the front desk today."]
    batch = {
        "assembler_version": "t",
        "template_digest": "raw",
        "add_special_tokens": True,
        "verification": "full",
        "filler": filler,
        "pool": pool,
        "cases": [
            {
                "case_id": "c",
                "case_digest": "c",
                "prefix": "Handbook",
                "suffix": "\n\nQ?\nA:",
                "moving": [{"id": "e", "text": " The code is 4721.", "kind": "evidence"}],
                "anchored": [],
                "filler_offset": 0,
            }
        ],
        "lengths": [200],
        "positions": [{"label": "0.5", "depth": 0.5}],
    }
    without = build_batch(tok, batch)["layout_id"].to_list()
    with_digest = build_batch(tok, {**batch, "filler_digest": _fields_digest([*filler, *pool])})["layout_id"]
    assert without == with_digest.to_list()

"""Per-case controls (evidence-only, evidence-absent), failure classification and the prefix-cache control."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest

from depthgate.judge.science import CATEGORIES, classify_failures, score_controls
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import (
    BuildOptions,
    Tokenizer,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.layout.templates import load_chat_template
from depthgate.run.controls import CONTROLS_SCHEMA, build_controls
from depthgate.spec.cases import Suite
from depthgate.spec.suites import builtin_suite


@pytest.fixture(scope="module")
def suite() -> Suite:
    return builtin_suite(3)


FAMILIES = [
    ("gpt2", None),
    ("smollm", None),
    ("llama2-tinyllama", None),
    ("mistral-7b-v1", None),
    ("llama2-tinyllama", "chat_template.llama-2-chat.jinja"),
    ("smollm", "chat_template.jinja"),
]


@pytest.mark.parametrize(("family", "template"), FAMILIES)
def test_controls_are_exact_on_real_tokenizers(
    family: str, template: str | None, suite: Suite, shared_dir: Path, tmp_path: Path
) -> None:
    folder = shared_dir / "tokenizers" / family
    tok = load_tokenizer(folder / "tokenizer.json")
    chat = load_chat_template(folder / template) if template else None
    options = BuildOptions(lengths=[512, 1024], positions=[], template=chat)
    summary = build_controls(suite, tok, options, tmp_path / "controls.parquet")
    assert set(summary.columns) == set(CONTROLS_SCHEMA) - {"token_ids", "text"}
    frame = read_layouts(tmp_path / "controls.parquet")
    assert frame["status"].to_list() == ["ok"] * frame.height
    assert frame.filter(pl.col("control") == "evidence_only").height == 3
    assert frame.filter(pl.col("control") == "evidence_absent").height == 6  # 3 cases x 2 lengths
    check = check_layouts(tmp_path / "controls.parquet", tok)  # full re-encode, the trusted check
    assert check.ok and check.checked == frame.height
    for row in frame.iter_rows(named=True):
        ids = tok.encode(row["text"], add_special_tokens=row["add_special_tokens"]).tolist()
        assert row["token_ids"] == ids and row["target_tokens"] == row["total_tokens"] == len(ids)
        case = suite.case(row["case_id"])
        span_ids = {s["evidence_id"] for s in row["evidence_spans"]}
        if row["control"] == "evidence_only":
            assert span_ids == {d.id for d in case.evidence}
            assert all(d.text not in row["text"] for d in case.distractors)
            assert row["total_tokens"] < 300 and row["actual_offset"] is not None
        else:
            assert not span_ids & {d.id for d in case.decisive}
            assert all(d.text not in row["text"] for d in case.decisive)
            assert {d.id for d in case.distractors} | {d.id for d in case.competing} == span_ids
            assert row["position"] == "evidence_absent@0.5" and row["total_tokens"] < 1024


def test_absent_control_is_the_half_depth_haystack_minus_the_evidence(
    suite: Suite, shared_dir: Path, tmp_path: Path
) -> None:
    tok = load_tokenizer(shared_dir / "tokenizers" / "llama2-tinyllama" / "tokenizer.json")
    options = BuildOptions(lengths=[512], positions=parse_positions(["0.5"]))
    build_layouts(suite, tok, options, tmp_path / "layouts.parquet")
    build_controls(suite, tok, options, tmp_path / "controls.parquet")
    layouts = read_layouts(tmp_path / "layouts.parquet")
    absent = read_layouts(tmp_path / "controls.parquet").filter(pl.col("control") == "evidence_absent")
    for row in layouts.iter_rows(named=True):
        case = suite.case(row["case_id"])
        expected = row["text"]
        for doc in case.decisive:
            expected = expected.replace(doc.text, "", 1)
        control = absent.filter(pl.col("case_id") == row["case_id"]).row(0, named=True)
        assert control["text"] == expected
        assert row["layout_id"] in control["verification_note"]


def _scored(rows: list[dict[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame(rows)


def test_classify_failures_categories() -> None:
    matrix = _scored(
        [
            {"case_id": c, "outcome": o}
            for c, outcomes in {
                "a": ["pass", "fail"],
                "b": ["pass", "pass"],
                "c": ["fail", "fail"],
                "d": ["pass", "system_fail"],
                "e": ["pass", "pass"],
            }.items()
            for o in outcomes
        ]
    )
    controls = _scored(
        [
            {"case_id": "a", "control": "evidence_only", "outcome": "fail", "hallucinated": False},
            {"case_id": "a", "control": "evidence_absent", "outcome": "fail", "hallucinated": False},
            {"case_id": "b", "control": "evidence_only", "outcome": "pass", "hallucinated": False},
            {"case_id": "b", "control": "evidence_absent", "outcome": "fail", "hallucinated": False},
            {"case_id": "c", "control": "evidence_only", "outcome": "pass", "hallucinated": False},
            {"case_id": "c", "control": "evidence_absent", "outcome": "fail", "hallucinated": True},
            {"case_id": "d", "control": "evidence_only", "outcome": "pass", "hallucinated": False},
            {"case_id": "d", "control": "evidence_absent", "outcome": "fail", "hallucinated": False},
            {"case_id": "e", "control": "evidence_only", "outcome": "system_fail", "hallucinated": False},
        ]
    )
    result = classify_failures(matrix, controls)
    got = dict(result.select("case_id", "category").iter_rows())
    assert got == {
        "a": "task_or_model",
        "b": "ok",
        "c": "hallucination",
        "d": "position_or_assembly",
        "e": "unknown",
    }
    assert set(got.values()) <= set(CATEGORIES)
    assert result.filter(pl.col("case_id") == "d")["long_fails"][0] == 1


def test_classify_failures_per_arm() -> None:
    matrix = _scored(
        [
            {"arm": arm, "case_id": "a", "outcome": o}
            for arm, o in (("baseline", "pass"), ("candidate", "fail"))
        ]
    )
    controls = _scored(
        [
            {"case_id": "a", "control": "evidence_only", "outcome": "pass", "hallucinated": False},
            {"case_id": "a", "control": "evidence_absent", "outcome": "fail", "hallucinated": False},
        ]
    )
    got = {
        (r["arm"], r["case_id"]): r["category"]
        for r in classify_failures(matrix, controls).iter_rows(named=True)
    }
    assert got == {("baseline", "a"): "ok", ("candidate", "a"): "position_or_assembly"}


def _records(layouts: pl.DataFrame, outputs: dict[str, str]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "arm": "x",
                "layout_id": r["layout_id"],
                "case_id": r["case_id"],
                "target_tokens": r["target_tokens"],
                "position": r["position"],
                "seed": 0,
                "status": "ok",
                "system_fail_reason": None,
                "output_text": outputs[r["control"]],
            }
            for r in layouts.iter_rows(named=True)
        ]
    )


def test_score_controls_hallucination_rule(suite: Suite, shared_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(shared_dir / "tokenizers" / "gpt2" / "tokenizer.json")
    case = suite.cases[0]  # override: v7 (decisive, 415) replaces v6 (competing, 420)
    build_controls([case], tok, BuildOptions(lengths=[512], positions=[]), tmp_path / "c.parquet")
    controls = read_layouts(tmp_path / "c.parquet")
    required = case.required_claims[0].value
    competing = next(c.value for c in case.forbidden_claims if c.id in case.competing[0].supports)
    distractor = next(c.value for c in case.forbidden_claims if c.id.startswith("distractor"))
    expectations = {
        f" {required} USD per night.": "removed_value",
        f" {competing} USD per night.": None,  # read the superseded version still in the prompt
        f" {distractor} USD per night.": "unsupported_value",
        " not stated in the handbook.": None,
    }
    for text, expected in expectations.items():
        scored = score_controls(
            _records(controls, {"evidence_only": f" {required} USD per night.", "evidence_absent": text}),
            suite,
            controls,
        )
        absent = scored.filter(pl.col("control") == "evidence_absent").row(0, named=True)
        only = scored.filter(pl.col("control") == "evidence_only").row(0, named=True)
        assert absent["hallucination"] == expected, text
        assert absent["hallucinated"] is (expected is not None)
        assert only["outcome"] == "pass" and not only["hallucinated"]


def test_one_value_of_a_removed_conflict_is_a_removed_value(shared_dir: Path, tmp_path: Path) -> None:
    """A conflict case's evidence-absent control answered with one of the two removed sources' values is
    ``removed_value`` (the other source's claim is missing, yet the value came from removed evidence);
    a value no source states is ``unsupported_value``; an abstention is no hallucination."""
    from depthgate.spec.suites import generate_suite

    conflict_suite = generate_suite(0, 20, "en", conflict=True)
    case = next(c for c in conflict_suite.cases if c.evidence_pattern == "conflict")
    tok = load_tokenizer(shared_dir / "tokenizers" / "gpt2" / "tokenizer.json")
    build_controls([case], tok, BuildOptions(lengths=[512], positions=[]), tmp_path / "c.parquet")
    controls = read_layouts(tmp_path / "c.parquet")
    first, second = (claim.aliases[0] for claim in case.required_claims)
    unsupported = next(c.aliases[0] for c in case.forbidden_claims if c.id.startswith("distractor"))
    expectations = {
        f" {first}.": "removed_value",
        f" {second}.": "removed_value",
        f" {unsupported}.": "unsupported_value",
        " not stated in the handbook.": None,
    }
    for text, expected in expectations.items():
        both = f" {first} or {second}."
        records = _records(controls, {"evidence_only": both, "evidence_absent": text})
        scored = score_controls(records, conflict_suite, controls)
        absent = scored.filter(pl.col("control") == "evidence_absent").row(0, named=True)
        assert absent["hallucination"] == expected, (text, absent["score_reason"])
        only = scored.filter(pl.col("control") == "evidence_only").row(0, named=True)
        assert only["outcome"] == "pass", only["score_reason"]


@pytest.fixture(scope="module")
def gemma_tokenizer() -> Tokenizer:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    return load_tokenizer("gguf:")


@pytest.mark.smoke_model
def test_controls_on_the_embedded_model(gemma_tokenizer: Tokenizer, tmp_path: Path) -> None:
    from depthgate.judge.scoring import score_records
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf
    from depthgate.run.backends.base import EmbeddedBackendAdapter
    from depthgate.run.backends.llamacpp import EmbeddedLlamaBackend
    from depthgate.run.options import RunOptions
    from depthgate.run.records import read_records
    from depthgate.run.runner import run_pairs
    from depthgate.spec.system import DecodeParams

    suite = builtin_suite(2)
    options = BuildOptions(lengths=[512], positions=parse_positions(["0.5"]), system="gemma")
    build_layouts(suite, gemma_tokenizer, options, tmp_path / "layouts.parquet")
    build_controls(suite, gemma_tokenizer, options, tmp_path / "controls.parquet")
    layouts, controls = (
        read_layouts(tmp_path / "layouts.parquet"),
        read_layouts(tmp_path / "controls.parquet"),
    )
    assert controls["status"].to_list() == ["ok"] * 4
    decode = DecodeParams(max_tokens=8, seeds=[0])
    backend = EmbeddedLlamaBackend(n_ctx=1024, tokenizer=tokenizer_from_gguf(gemma_default_gguf()))
    try:
        for name, frame in (("matrix", layouts), ("controls", controls)):
            run_pairs(
                [("gemma", r) for r in frame.iter_rows(named=True)],
                {"gemma": EmbeddedBackendAdapter(backend, name="gemma", owns=False)},
                tmp_path / name,
                RunOptions(
                    concurrency=1,
                    seeds=None,
                    decode=decode,
                    run_id=name,
                    manifest_digest="d" * 64,
                    progress=False,
                ),
            )
    finally:
        backend.close()
    scored_matrix = score_records(read_records(tmp_path / "matrix"), suite, layouts)
    scored_controls = score_controls(read_records(tmp_path / "controls"), suite, controls)
    assert scored_controls["status"].to_list() == ["ok"] * 4
    assert scored_controls["control"].sort().to_list() == ["evidence_absent"] * 2 + ["evidence_only"] * 2
    result = classify_failures(scored_matrix, scored_controls)
    assert result.height == 2 and set(result["category"].to_list()) <= set(CATEGORIES)
    assert "unknown" not in result["category"].to_list()


@pytest.mark.smoke_model
def test_prefix_cache_control_on_three_layouts(gemma_tokenizer: Tokenizer, tmp_path: Path) -> None:
    from depthgate.run.cache import run_cache_control_embedded

    path = tmp_path / "layouts.parquet"
    build_layouts(
        builtin_suite(1),
        gemma_tokenizer,
        BuildOptions(lengths=[512], positions=parse_positions(["0", "0.5", "1"])),
        path,
    )
    report = run_cache_control_embedded(path, n_ctx=1024, max_tokens=5, repeats=2)
    assert len(report.rows) == 3
    assert report.n_reused == 3  # every warm run reused a cached prefix of its related layout
    assert max(r.prefix_hit_tokens for r in report.rows) > 100
    for row in report.rows:
        assert len(row.cold_texts) == len(row.warm_texts) == 2 and row.warmup_layout_id != row.layout_id
    if report.incident is not None:  # a systematic cold/warm difference is an incident with counts, not noise
        assert report.incident.n_systematic >= 1 and "incident" in report.summary()
    else:
        assert all(not r.systematic for r in report.rows)


def test_evidence_absent_controls_without_competing_evidence_pass_the_presend_gate(
    shared_dir: Path, tmp_path: Path
) -> None:
    """The evidence-absent control of a case with no competing document (single, conflict) has no
    evidence span by design: the pre-send gate lets it through, while a matrix layout that lost its
    every evidence span is still refused as presend_evidence_missing. (Before, every such control was
    recorded as a system failure and the hallucination class could not be decided for those cases.)"""
    from depthgate.layout.presend import guard_layouts
    from depthgate.spec.suites import generate_suite

    generated = generate_suite(0, 40, "en", conflict=True)
    picked = [
        next(c for c in generated.cases if c.evidence_pattern == pattern)
        for pattern in ("single", "conflict")
    ]
    assert all(not c.competing for c in picked)
    tok = load_tokenizer(shared_dir / "tokenizers" / "gpt2" / "tokenizer.json")
    options = BuildOptions(lengths=[512], positions=[])
    build_controls(picked, tok, options, tmp_path / "c.parquet")
    controls = read_layouts(tmp_path / "c.parquet")
    absent = controls.filter(pl.col("control") == "evidence_absent")
    assert absent.height == 2
    assert all(not [s for s in spans if s["kind"] == "evidence"] for spans in absent["evidence_spans"])
    gated = guard_layouts(
        controls, tokenizer=tok, window=None, max_output_tokens=12, cases={c.id: c for c in picked}
    )
    assert set(gated["status"]) == {"ok"}, gated.select("control", "reason_code", "reason").to_dicts()

    # The same rows without the control column are matrix layouts that lost their evidence: refused.
    lost = guard_layouts(absent.drop("control"), tokenizer=tok, window=None, max_output_tokens=12)
    assert set(lost["reason_code"]) == {"presend_evidence_missing"}

"""Evidence spacing (issue #13 item 5): the token distance between the decisive documents of a
multi-evidence case, as a matrix axis (``spacings = ["adjacent", "near", "far"]``).

The suite is hand-written (tests/fixtures/two_evidence_suite.json): four cases whose answer needs two
decisive documents (each states one of two required values) and one single-evidence case. The model
behind 127.0.0.1 is a **stub** (labelled as such): a vLLM-shaped server that reads its prompt ids with
the real GPT-2 tokenizer; model ``good`` answers both values, model ``near-sighted`` answers only the
first value when the two decisive documents are more than 150 tokens apart (a spacing regression)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from tokenizers import Tokenizer as HFTokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode, InputError, SpecError
from depthgate.judge.tables import position_sort_key
from depthgate.layout.layouts import (
    BuildOptions,
    _spacing_fields,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.layout.templates import load_chat_template
from depthgate.report.report import depth_label
from depthgate.spec.loading import load_matrix, load_suite
from depthgate.spec.matrix import Matrix
from fixtures_paths import llamacpp_templates_dir, tokenizers_dir
from helpers import StubServer, free_port, reading_handler, stub_matrix

TOK = tokenizers_dir()
GPT2 = TOK / "gpt2" / "tokenizer.json"
TPL = llamacpp_templates_dir()
SUITE_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "two_evidence_suite.json"
SUITE = load_suite(SUITE_PATH)
MULTI = [c for c in SUITE.cases if len(c.decisive) >= 2]
SINGLE = [c for c in SUITE.cases if len(c.decisive) == 1]
LENGTH = 512
FAR_AT_512 = round(0.4 * LENGTH)  # 205 tokens nominal


# --------------------------------------------------------------------------------------------------
# The stub


class SpacingReader(StubServer):
    """Stub (not a model): answers each case of the two-evidence suite from its prompt. ``near-sighted``
    drops the second value when the decisive documents are more than 150 GPT-2 tokens apart."""

    def __init__(self, port: int) -> None:
        gpt2 = HFTokenizer.from_file(str(GPT2))
        cases = {c.query: c for c in SUITE.cases}
        self.distances: list[int] = []

        def reply(model: str, text: str) -> str:
            case = next((c for q, c in cases.items() if q in text), None)
            if case is None or not all(d.text in text for d in case.decisive):
                return "not stated"
            values = [claim.aliases[0] for claim in case.required_claims]
            if len(case.decisive) >= 2:
                a, b = case.decisive[0].text, case.decisive[1].text
                distance = len(gpt2.encode(text[text.index(a) + len(a) : text.index(b)]).ids)
                self.distances.append(distance)
                if model == "near-sighted" and distance > 150:
                    values = values[:1]
            return " and ".join(values)

        tokenizers = {"good": gpt2, "near-sighted": gpt2}
        super().__init__(reading_handler(tokenizers, {}, reply=reply, completion_tokens=5), port)


def _matrix(tmp: Path, port: int, *, spacings: str | None, suite: Path | None = SUITE_PATH) -> Path:
    suite_ref = (
        f'{{ kind = "file", path = "{suite}" }}'
        if suite is not None
        else '{ kind = "builtin", cases = 2, seed = 0, language = "en" }'
    )
    text = stub_matrix(
        "spacing",
        where=f'endpoint = "http://127.0.0.1:{port}"',
        suite=suite_ref,
        lengths=f"[{LENGTH}]",
        positions="[0.0, 1.0]",
        top="" if spacings is None else f"spacings = {spacings}",
        candidate_model="near-sighted",
        resamples=999,
    )
    path = tmp / "spacing.toml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------------
# Labels and the matrix field


def test_position_labels_carry_the_spacing_and_sort_grouped_by_it() -> None:
    pos = parse_positions(["0", "0.5~far", "@100~near", "1~300tok", "0.5~adjacent"])
    assert [(p.label, p.depth, p.offset, p.spacing) for p in pos] == [
        ("0", 0.0, None, "adjacent"),
        ("0.5~far", 0.5, None, "far"),
        ("@100~near", None, 100, "near"),
        ("1~300tok", 1.0, None, "300tok"),
        ("0.5", 0.5, None, "adjacent"),  # an explicit adjacent is the plain label
    ]
    with pytest.raises(InputError, match="unknown spacing"):
        parse_positions(["0.5~middle"])
    labels = ["1~far", "0~near", "1", "0~far", "@5", "0.5~near", "0"]
    assert sorted(labels, key=position_sort_key) == ["0", "1", "@5", "0~near", "0.5~near", "0~far", "1~far"]
    assert depth_label("0.5~far") == "50% · far" and depth_label("@1200~near") == "token 1,200 · near"
    assert depth_label("0.25") == "25%"


def test_default_spacing_keeps_the_matrix_digest_and_slice_list(tmp_path: Path) -> None:
    plain = load_matrix(_matrix(tmp_path, 1, spacings=None))
    explicit = load_matrix(_matrix(tmp_path, 1, spacings='["adjacent"]'))
    assert plain.spacings == ["adjacent"] and plain == explicit
    assert plain.digest() == explicit.digest() and "spacings" not in plain.canonical_json()
    assert plain.position_values() == [str(p) for p in plain.positions] == ["0.0", "1.0"]
    spaced = load_matrix(_matrix(tmp_path, 1, spacings='["adjacent", "near", "far", 100]'))
    assert spaced.digest() != plain.digest()
    assert spaced.position_values() == [
        "0.0", "1.0", "0.0~near", "1.0~near", "0.0~far", "1.0~far", "0.0~100tok", "1.0~100tok"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("spacings", "fragment"),
    [
        ("[]", "field 'spacings': must not be empty"),
        ('["near", "near"]', "repeated spacing"),
        ('["middle"]', "is not a spacing"),
        ("[0]", "not a positive number of tokens"),
        ("[true]", "is not a spacing"),
        ("[300]", "cannot fit the length 512"),  # at most half of the shortest length: 256
    ],
)
def test_bad_spacings_are_refused_with_field_and_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spacings: str, fragment: str
) -> None:
    matrix = _matrix(tmp_path, 1, spacings=spacings)
    out = tmp_path / "out"
    assert main(["build", str(matrix), "--out", str(out)]) == ExitCode.BAD_INPUT == 20
    err = capsys.readouterr().err
    assert fragment in err and "spacings" in err and "fix:" in err
    assert not out.exists()
    assert main(["plan", str(matrix)]) == 20


def test_an_offset_without_room_for_the_gap_is_refused_at_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``@400`` with ``far`` (205 tokens at 512) cannot place the block at any layout: refused before
    anything is built, naming the spacing, the offset and the largest offset that fits."""
    matrix = _matrix(tmp_path, 1, spacings='["adjacent", "far"]')
    matrix.write_text(matrix.read_text().replace("positions = [0.0, 1.0]", 'positions = [0.0, "@400"]'))
    out = tmp_path / "out"
    assert main(["build", str(matrix), "--out", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "offset @400 plus the far gap of 205 tokens is beyond the length 512" in err
    assert "spacings[1]" in err and "below 307" in err and not out.exists()
    # the same offset with a gap that fits is accepted
    matrix.write_text(
        matrix.read_text().replace('spacings = ["adjacent", "far"]', 'spacings = ["adjacent", 60]')
    )
    assert load_matrix(matrix).position_values() == ["0.0", "@400", "0.0~60tok", "@400~60tok"]


def test_a_spacing_without_multi_evidence_cases_is_refused_and_nothing_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix = _matrix(tmp_path, free_port(), spacings='["adjacent", "far"]', suite=None)  # builtin: 1 each
    out = tmp_path / "build"
    assert main(["build", str(matrix), "--out", str(out)]) == 20
    err = capsys.readouterr().err
    assert "field 'spacings'" in err and "two or more decisive documents" in err and "fix:" in err
    assert not out.exists() or not any(out.rglob("*"))
    run = tmp_path / "run"
    assert main(["run", str(matrix), "--out", str(run)]) == 20
    assert "two or more decisive documents" in capsys.readouterr().err
    assert not run.exists() or not any(run.rglob("*"))  # no manifest, no layouts, no records


# --------------------------------------------------------------------------------------------------
# Layouts: measured gaps, paired placement, token-exactness


def test_measured_gap_hand_computed() -> None:
    # Decisive a: tokens [10, 22), decisive b: [87, 99); a competing document and a distractor between.
    meta = {
        "position": "0.5~near",
        "spans": [
            {"unit_id": "c/b", "token_start": 87, "token_end": 99},
            {"unit_id": "c/old", "token_start": 40, "token_end": 50},
            {"unit_id": "c/a", "token_start": 10, "token_end": 22},
            {"unit_id": "c/d1", "token_start": 60, "token_end": 70},
        ],
    }
    assert _spacing_fields(meta, frozenset({"c/a", "c/b"})) == ("near", [87 - 22], 65)
    meta3 = {
        **meta,
        "position": "1",
        "spans": [*meta["spans"], {"unit_id": "c/c", "token_start": 99, "token_end": 120}],
    }
    assert _spacing_fields(meta3, frozenset({"c/a", "c/b", "c/c"})) == ("adjacent", [65, 0], 0)
    assert _spacing_fields(meta, frozenset({"c/a"})) == ("near", [], None)


def _build_cli(tmp: Path, spacings: str | None) -> pl.DataFrame:
    out = tmp / f"build-{abs(hash(spacings))}"
    assert main(["build", str(_matrix(tmp, 1, spacings=spacings)), "--out", str(out)]) == ExitCode.PASS
    return read_layouts(out / "baseline" / "layouts.parquet")


def test_spacing_changes_the_measured_gap_and_nothing_else_of_the_layout(tmp_path: Path) -> None:
    frame = _build_cli(tmp_path, '["adjacent", "near", "far"]')
    # 2 depths: every case at adjacent, the multi-evidence cases at near and far as well
    assert frame.height == 2 * (len(SUITE.cases) + 2 * len(MULTI)) and set(frame["status"]) == {"ok"}
    hf = HFTokenizer.from_file(str(GPT2))
    multi = frame.filter(pl.col("case_id").is_in([c.id for c in MULTI]))
    gaps = {
        s: multi.filter(pl.col("spacing") == s)["evidence_gap_tokens"].to_list()
        for s in ("adjacent", "near", "far")
    }
    assert set(gaps["adjacent"]) == {0}
    assert all(48 <= g <= 80 for g in gaps["near"]), gaps["near"]  # nominal 64
    assert all(abs(g - FAR_AT_512) <= 16 for g in gaps["far"]), gaps["far"]  # nominal 205
    for row in multi.iter_rows(named=True):
        # the measured gap, recounted independently: tokens of the final encoding between the spans
        spans = sorted(
            (s for s in row["evidence_spans"] if s["kind"] == "evidence"), key=lambda s: s["token_start"]
        )
        enc = hf.encode(row["text"])
        assert enc.ids == list(row["token_ids"])
        between = [o for o in enc.offsets if o[0] >= spans[0]["char_end"] and o[1] <= spans[1]["char_start"]]
        assert len(between) == row["evidence_gap_tokens"] == row["evidence_gaps"][0]
    # At depth 1 the spaced block ends where the region ends: snap 0, and requested_offset counts the whole
    # block (gap filler included) out of the haystack; counting only its evidence would put the gap in snap.
    for row in multi.filter(
        (pl.col("spacing") != "adjacent") & pl.col("position").str.starts_with("1")
    ).iter_rows(named=True):
        spans = sorted(
            (s for s in row["evidence_spans"] if s["kind"] == "evidence"), key=lambda s: s["token_start"]
        )
        assert spans[-1]["token_end"] == row["region_end"] and row["snap_tokens"] == 0, row["position"]
        assert (
            row["requested_offset"]
            == row["actual_offset"]
            == row["region_end"] - (spans[-1]["token_end"] - spans[0]["token_start"])
        )
    # The block moves as a whole: without it, every position of a case × spacing is the same haystack.
    for (case_id, spacing), part in multi.group_by(["case_id", "spacing"]):
        rest = set()
        for row in part.iter_rows(named=True):
            spans = sorted(row["evidence_spans"], key=lambda s: s["token_start"])
            moving = [
                s
                for s in spans
                if s["evidence_id"].startswith(f"{case_id}/") and s["evidence_id"][-2:] in ("/a", "/b")
            ]
            rest.add(row["text"][: moving[0]["char_start"]] + row["text"][moving[-1]["char_end"] :])
        assert len(rest) == 1, (case_id, spacing)
    # Evidence tokens identical at every spacing and position; every layout id distinct.
    for case in MULTI:
        rows = multi.filter(pl.col("case_id") == case.id).iter_rows(named=True)
        pieces = {
            tuple(
                tuple(r["token_ids"][s["token_start"] : s["token_end"]])
                for s in r["evidence_spans"]
                if s["kind"] == "evidence"
            )
            for r in rows
        }
        assert len(pieces) == 1
    assert frame["layout_id"].n_unique() == frame.height
    # A single-evidence case has no spacing: laid out at the adjacent positions only, no gap.
    for case in SINGLE:
        one = frame.filter(pl.col("case_id") == case.id)
        assert one["evidence_gap_tokens"].null_count() == one.height
        assert sorted(one["position"].to_list()) == ["0", "1"] and set(one["spacing"]) == {"adjacent"}


def test_default_build_equals_an_explicit_adjacent_build(tmp_path: Path) -> None:
    plain = _build_cli(tmp_path, None)
    explicit = _build_cli(tmp_path, '["adjacent"]')
    assert plain.equals(explicit)
    assert set(plain["spacing"]) == {"adjacent"} and set(plain["position"]) == {"0", "1"}
    spaced = _build_cli(tmp_path, '["adjacent", "far"]')
    adjacent = spaced.filter(pl.col("spacing") == "adjacent").sort("layout_id")
    assert adjacent.equals(plain.sort("layout_id"))  # adding a spacing leaves the adjacent layouts alone


@pytest.mark.parametrize(
    ("family", "template"),
    [
        ("llama3-from-gguf", TPL / "meta-llama-Llama-3.1-8B-Instruct.jinja"),
        ("smollm", TOK / "smollm" / "chat_template.jinja"),
        ("mistral-7b-v1", TOK / "mistral-7b-v1" / "chat_template.jinja"),
    ],
)  # fmt: skip
def test_spaced_layouts_are_token_exact_on_real_tokenizers(
    tmp_path: Path, family: str, template: Path
) -> None:
    tok = load_tokenizer(TOK / family / "tokenizer.json")
    positions = parse_positions(["0", "0.5", "1", "0~near", "0.5~near", "1~far", "@60~far", "0.5~40tok"])
    bos = "<|begin_of_text|>" if family == "llama3-from-gguf" else None  # its tokenizer_config.json's
    chat = load_chat_template(template, bos_token=bos)
    options = BuildOptions(lengths=[640, 1024], positions=positions, template=chat)
    build_layouts(SUITE, tok, options, tmp_path / "layouts.parquet")
    frame = read_layouts(tmp_path / "layouts.parquet")
    hf = HFTokenizer.from_file(str(TOK / family / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    assert set(frame["status"]) == {"ok"}, frame.filter(pl.col("status") != "ok")["reason"].to_list()
    for row in frame.iter_rows(named=True):
        enc = hf.encode(row["text"], add_special_tokens=row["add_special_tokens"])
        assert enc.ids == list(row["token_ids"]) and len(enc.ids) == row["target_tokens"], row["position"]
        for span in row["evidence_spans"]:
            chars = (enc.offsets[span["token_start"]][0], enc.offsets[span["token_end"] - 1][1])
            assert (
                row["text"][chars[0] : chars[1]].strip() in row["text"][span["char_start"] : span["char_end"]]
            )
    multi = frame.filter(pl.col("case_id").is_in([c.id for c in MULTI]))
    by = {
        s: multi.filter(pl.col("spacing") == s)["evidence_gap_tokens"]
        for s in ("adjacent", "near", "far", "40tok")
    }
    assert by["adjacent"].max() == 0
    assert by["near"].min() >= 48 and by["near"].max() <= 80
    assert by["40tok"].min() >= 24 and by["40tok"].max() <= 56
    far = multi.filter(pl.col("spacing") == "far")
    for length in (640, 1024):
        got = far.filter(pl.col("target_tokens") == length)["evidence_gap_tokens"]
        assert abs(got.mean() - round(0.4 * length)) <= 16  # type: ignore[operator]
    # snap is recorded against the haystack without the whole block (gap filler included)
    depth_rows = multi.filter(~pl.col("position").str.starts_with("@"))
    assert depth_rows["snap_tokens"].abs().max() <= 40  # type: ignore[operator]


# --------------------------------------------------------------------------------------------------
# Through the run: the gate slices per (length, position, spacing)


def test_run_gates_each_spacing_as_its_own_slice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    matrix, run = _matrix(tmp_path, port, spacings='["adjacent", "near", "far"]'), tmp_path / "run"
    with SpacingReader(port) as reader:
        code = main(["run", str(matrix), "--out", str(run)])
    out = capsys.readouterr()
    assert code == ExitCode.FAIL, out.err
    assert reader.distances and max(reader.distances) > 150  # the far prompts really were far
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["positions"] == ["0.0", "1.0", "0.0~near", "1.0~near", "0.0~far", "1.0~far"]
    verdict: dict[str, Any] = json.loads((run / "report" / "verdict.json").read_text())
    status = {s["slice"]: s["status"] for s in verdict["slices"]}
    assert set(status) == {f"{LENGTH}/{p}" for p in ("0", "1", "0~near", "1~near", "0~far", "1~far")}
    for label in ("0", "1", "0~near", "1~near"):
        assert status[f"{LENGTH}/{label}"] == "PASS", status
    for label in ("0~far", "1~far"):
        assert status[f"{LENGTH}/{label}"].startswith("FAIL"), status
    rows = verdict["position"]["spacing"]
    cand_far = [r for r in rows if r["arm"] == "candidate" and r["spacing"] == "far"]
    assert cand_far and all(r["accuracy_multi"] == 0.0 and r["n_multi"] == len(MULTI) for r in cand_far)
    assert all(r["vs_adjacent"] == -1.0 and abs(r["gap_median"] - FAR_AT_512) <= 16 for r in cand_far)
    # A spaced slice holds only the multi-evidence cases: nothing dilutes the candidate's far loss.
    assert all(r["accuracy"] == 0.0 for r in cand_far)
    n_of = {s["slice"]: s["n_cases"] for s in verdict["slices"]}
    assert all(n_of[f"{LENGTH}/{p}"] == len(SUITE.cases) for p in ("0", "1"))
    assert all(n_of[f"{LENGTH}/{p}"] == len(MULTI) for p in ("0~near", "1~near", "0~far", "1~far"))
    assert verdict["plan"]["spaced_cases"] == sorted(c.id for c in MULTI)
    base = [r for r in rows if r["arm"] == "baseline"]
    assert all(r["accuracy_multi"] == 1.0 for r in base)
    assert {r["gap_median"] for r in base if r["spacing"] == "adjacent"} == {0.0}
    summary = (run / "report" / "summary.md").read_text()
    assert "Evidence spacing" in summary and f"| {LENGTH}/0 | far |" in summary and "(-1.00)" in summary
    page = (run / "report" / "report.html").read_text()
    assert "<h3>Evidence spacing</h3>" in page and "0% · far" in page
    # gate re-reads the frozen slice list (with spacings) and gives the same verdict
    assert main(["gate", str(run)]) == ExitCode.FAIL
    # the matrix file the run was frozen with, edited to drop a spacing after the data: refused
    text = matrix.read_text()
    matrix.write_text(
        text.replace('spacings = ["adjacent", "near", "far"]', 'spacings = ["adjacent", "near"]')
    )
    assert main(["gate", str(run)]) == 20
    assert "slice list" in capsys.readouterr().err


def test_the_plan_is_validated_over_every_spacing_slice() -> None:
    data = load_matrix(Path(__file__).resolve().parents[2] / "matrices" / "smoke.toml").model_dump()
    data["plan"]["bootstrap_resamples"] = 499  # enough for 5 slices, too few for 15
    Matrix.model_validate(data)
    data["spacings"] = ["adjacent", "near", "far"]
    with pytest.raises(Exception, match="among 15 slices"):
        Matrix.model_validate(data)


def test_plan_and_gate_count_only_multi_evidence_cases_in_spaced_slices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`depthgate plan` sizes a spaced slice at the multi-evidence cases (the gate's ``spaced_cases``),
    and the gate refuses a ``spaced_cases`` outside the planned case set."""
    from depthgate.commands.plan import matrix_power
    from depthgate.judge.gate import GatePlan

    power = matrix_power(load_matrix(_matrix(tmp_path, 1, spacings='["adjacent", "far"]')), SUITE)
    n_of = {r.position: r.n_cases for r in power.rows}
    assert n_of == {"0": 20, "1": 20, "0~far": len(MULTI), "1~far": len(MULTI)} and len(MULTI) < 20
    assert main(["plan", str(tmp_path / "spacing.toml")]) == 0
    assert f"{LENGTH}/0~far" in capsys.readouterr().out
    with pytest.raises(SpecError, match="spaced_cases"):
        GatePlan(planned_cases=("a", "b"), spaced_cases=("c",))
    with pytest.raises(SpecError, match="spaced_cases"):
        GatePlan(spaced_cases=())


@pytest.mark.parametrize("family", ["gpt2", "llama3-from-gguf"])
def test_fast_verification_splices_the_spaced_block_exactly(tmp_path: Path, family: str) -> None:
    """Fast mode (ids from verified cached segments) on a block with filler inside it: the same ids as
    a full encode, and `depthgate check` re-verifies every layout with no violation."""
    path = TOK / family / "tokenizer.json"
    tok = load_tokenizer(path)
    positions = parse_positions(["0.25~near", "0.75~far", "1~far"])
    build_layouts(
        SUITE,
        tok,
        BuildOptions(lengths=[2048], positions=positions, verification="fast"),
        tmp_path / "l.parquet",
    )
    frame = read_layouts(tmp_path / "l.parquet")
    assert set(frame["verification"]) == {"fast"} and set(frame["status"]) == {"ok"}
    hf = HFTokenizer.from_file(str(path))
    hf.no_padding()
    hf.no_truncation()
    for row in frame.iter_rows(named=True):
        assert hf.encode(row["text"], add_special_tokens=row["add_special_tokens"]).ids == list(
            row["token_ids"]
        )
    assert main(["check", str(tmp_path / "l.parquet"), "--tokenizer", str(path)]) == ExitCode.PASS

"""`build_controls` streams (issue #12): controls are built, verified and written one bounded batch at a
time, and the file is byte-for-byte the same table the previous whole-frame build wrote — checked on
real tokenizers, with the batch bound read from the sink and the row groups from the parquet footer
(no timing or memory assertions)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import polars as pl
import pytest
from test_build_streaming import row_group_rows

from depthgate import _core
from depthgate.exceptions import InputError
from depthgate.layout import sink as layout_sink
from depthgate.layout.layout_checks import check_layouts
from depthgate.layout.layouts import (
    BuildOptions,
    Position,
    Tokenizer,
    build_layouts,
    load_tokenizer,
    read_layouts,
)
from depthgate.layout.templates import load_chat_template
from depthgate.run import controls
from depthgate.run.controls import CONTROLS_SCHEMA, build_controls, read_controls
from depthgate.spec.cases import Case
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir


def _whole_frame_build(cases: list[Case], tok: Tokenizer, options: BuildOptions, tmp: Path) -> pl.DataFrame:
    """The build before it streamed (commit 9523c78): every control as a dict, one frame, verified with
    Python int lists, written once."""
    cases = [c for c in cases if c.decisive]
    built = controls._Controls(controls._Encoder(tok), options)
    by_id = {c.id: c for c in cases}
    rows = [built.evidence_only(c) for c in cases]
    source = tmp / "reference-source.parquet"
    half = Position(label="0.5", depth=0.5)
    build_layouts(cases, tok, replace(options, positions=[half]), source)
    for layout in read_layouts(source).iter_rows(named=True):
        rows.append(built.evidence_absent(by_id[layout["case_id"]], layout))
    for row in rows:
        row["token_ids"] = [int(t) for t in row["token_ids"]]
    ok = [i for i, r in enumerate(rows) if r["status"] == "ok"]
    stored = [
        {
            "layout_id": rows[i]["layout_id"],
            "text": rows[i]["text"],
            "add_special_tokens": rows[i]["add_special_tokens"],
            "target_tokens": rows[i]["target_tokens"],
            "spans": rows[i]["evidence_spans"],
        }
        for i in ok
    ]
    flat = [np.asarray(rows[i]["token_ids"], dtype=np.uint32) for i in ok]
    offsets = np.cumsum(np.array([0] + [len(x) for x in flat], dtype=np.uint64))
    found = json.loads(_core.verify_layouts(tok._core, json.dumps(stored), np.concatenate(flat), offsets))
    for i, violations in zip(ok, found, strict=True):
        if violations:
            rows[i]["status"] = "refused"
            rows[i]["reason_code"] = f"verify_{violations[0]['code']}"
            rows[i]["reason"] = "; ".join(f"{v['code']}: {v['detail']}" for v in violations)
    return pl.DataFrame(rows, schema=CONTROLS_SCHEMA)


class _CountingSink(layout_sink.LayoutSink):
    """The layouts' sink, remembering how many rows it was handed at a time."""

    made: ClassVar[list[_CountingSink]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[int] = []
        self.held_rows = 0
        self.peak_held_rows = 0
        _CountingSink.made.append(self)

    def add(self, frame: pl.DataFrame) -> None:
        self.rows.append(frame.height)
        self.peak_held_rows = max(self.peak_held_rows, self.held_rows + frame.height)
        super().add(frame)
        # written: at most a partial row group (< ROW_GROUP_ROWS rows) stays held for the next write
        self.held_rows = sum(f.height for f in self._held)


OPTIONS = BuildOptions(lengths=[256, 512], positions=[])


@pytest.mark.parametrize(
    ("family", "template"), [("gpt2", None), ("llama2-tinyllama", "chat_template.llama-2-chat.jinja")]
)
def test_streamed_controls_equal_the_whole_frame_build(
    family: str, template: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tokenizers_dir() / family
    tok = load_tokenizer(folder / "tokenizer.json")
    options = replace(OPTIONS, template=load_chat_template(folder / template) if template else None)
    suite = builtin_suite(30)
    cases = [c for c in suite.cases if c.decisive]
    reference = _whole_frame_build(list(suite.cases), tok, options, tmp_path)
    assert reference.height == len(cases) * 3  # evidence-only + one absent per length

    # the product defaults: 64-row batches, 64-row row groups
    default = tmp_path / "default.parquet"
    summary = build_controls(suite, tok, options, default)
    assert pl.read_parquet(default).equals(reference)
    assert summary.equals(reference.drop("token_ids", "text"))
    groups = row_group_rows(default)
    assert len(groups) == -(-reference.height // 64) and max(groups) <= 64

    # small batches, a write after every one: never more than one batch (and a partial row group) held
    _CountingSink.made = []
    monkeypatch.setattr(layout_sink, "LayoutSink", _CountingSink)
    monkeypatch.setattr(layout_sink, "SINK_BUDGET_BYTES", 1)
    monkeypatch.setattr(layout_sink, "ROW_GROUP_ROWS", 16)
    monkeypatch.setattr(controls, "_BATCH_ROWS", 16)
    streamed = tmp_path / "streamed.parquet"
    build_controls(suite, tok, options, streamed)
    sink = next(s for s in _CountingSink.made if sum(s.rows) == reference.height)  # not the source's
    assert len(sink.rows) >= reference.height // 16 and max(sink.rows) <= 16
    # one batch plus the partial row group left by the previous write (issue #21: full row groups)
    assert sink.peak_held_rows < 16 + 16 and sink.parts == len(sink.rows)
    assert pl.read_parquet(streamed).equals(reference)
    groups = row_group_rows(streamed)
    assert max(groups) == 16 and len(groups) == -(-reference.height // 16)
    check = check_layouts(streamed, tok)  # the trusted full re-encode accepts the streamed file
    assert check.ok and check.checked == reference.filter(pl.col("status") == "ok").height


def test_read_controls_reads_only_the_columns_asked_for(tmp_path: Path) -> None:
    tok = load_tokenizer(tokenizers_dir() / "gpt2" / "tokenizer.json")
    path = tmp_path / "controls.parquet"
    build_controls(builtin_suite(3), tok, OPTIONS, path)
    whole = read_controls(path)
    small = read_controls(path, columns=["layout_id", "control", "evidence_spans"])
    assert small.columns == ["layout_id", "control", "evidence_spans"]
    assert small.equals(whole.select(small.columns))
    # a file written before controls carried nominal_tokens: derived as the whole read derives it
    old = tmp_path / "old.parquet"
    pl.read_parquet(path).drop("nominal_tokens").write_parquet(old)
    derived = read_controls(old, columns=["layout_id", "nominal_tokens"])
    assert derived.columns == ["layout_id", "nominal_tokens"]
    assert derived.equals(read_controls(old).select("layout_id", "nominal_tokens"))
    assert derived["nominal_tokens"].to_list()[:3] == [0, 0, 0]  # the evidence-only rows
    layouts_only = tmp_path / "layouts.parquet"
    pl.read_parquet(path).drop("control").write_parquet(layouts_only)
    for columns in (None, ["layout_id"]):
        with pytest.raises(InputError, match="not a controls file"):
            read_controls(layouts_only, columns=columns)

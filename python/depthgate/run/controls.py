"""Per-case controls (DESIGN.md §5): is a failure the task's, the position's, or a hallucination?

For every case with decisive evidence, :func:`build_controls` writes two control inputs to
``controls.parquet`` (the layout schema plus a ``control`` column):

* ``evidence_only`` — the case's frame around its evidence documents only (every evidence document of
  the case, in case order, the first opening a paragraph; no filler, no distractors). If the model
  fails here, the task or the model is the problem, not the position.
* ``evidence_absent`` — the depth-0.5 haystack of each length with the moving (decisive) evidence cut
  out: the same filler, distractors and competing documents, ids re-encoded. A model that answers the
  removed value there cannot have read it; one that answers any value no remaining document supports
  is hallucinating. (Reading the value of a remaining competing document — the superseded version of
  an override case — is a correct reading of that context, not a hallucination.)

Both are exact: ``ids == encode(text)`` under the target tokenizer, ``target_tokens`` is the recorded
token count, every remaining span is recomputed from the offsets of the final encoding and verified by
the Rust core's full re-encode (:func:`depthgate.layout.layout_checks.check_layouts` accepts the file). A
control that cannot be made exact is ``refused`` with the reason, never silently approximated.

:func:`score_controls` scores control records (oracle + the hallucination rule) and
:func:`classify_failures` combines them with the scored matrix into one category per case.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from depthgate import _core
from depthgate.exceptions import InputError, SpecError
from depthgate.layout import layouts as _layouts
from depthgate.layout import sink as layout_sink
from depthgate.layout.layouts import (
    LAYOUT_SCHEMA,
    BuildOptions,
    Position,
    Tokenizer,
    assembler_version,
    build_layouts,
    case_frame,
    read_layouts,
)
from depthgate.layout.templates import Frame
from depthgate.spec.cases import Case, Suite
from depthgate.spec.files import atomic_write

__all__ = [
    "CONTROLS_SCHEMA",
    "CONTROL_KINDS",
    "build_controls",
    "read_controls",
    "with_nominal_tokens",
]

CONTROL_KINDS: tuple[str, ...] = ("evidence_only", "evidence_absent")
#: ``nominal_tokens``: the pairing length of a control — the matrix length of the layout an
#: evidence-absent control was cut from, 0 for the evidence-only input. Its ``target_tokens`` is its
#: own (tokenizer-dependent) token count, so arms on different tokenizers pair by case, kind and
#: nominal length, never by token count.
CONTROLS_SCHEMA: dict[str, Any] = {**LAYOUT_SCHEMA, "control": pl.String, "nominal_tokens": pl.Int64}

_ABSENT_DEPTH = 0.5
#: Controls built and verified per batch of 64 rows (one row group of the source layouts and of the
#: written file) and handed to the layouts' sink, which holds at most its budget (128 MB) before
#: spilling: memory is one batch plus the sink's budget — at 128K a batch is ≈ 64 × 128K × 4 bytes of ids
#: plus the text — not every control of the build as Python int lists (≈ 36 bytes per token).
_BATCH_ROWS = 64
#: The source layout columns an evidence-absent control reads (never the source's ``token_ids``).
_SOURCE_COLUMNS = (
    "layout_id",
    "case_id",
    "target_tokens",
    "position",
    "status",
    "reason_code",
    "reason",
    "text",
    "evidence_spans",
)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class _Encoder:
    """The target tokenizer (Rust core, the ids of record) plus the same file loaded by ``tokenizers``
    for offsets; the two must agree id for id, or the control is refused."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.tokenizer = tokenizer
        self.hf = HFTokenizer.from_file(str(tokenizer.path))
        self.hf.no_truncation()
        self.hf.no_padding()

    def encode(
        self, text: str, add_special_tokens: bool
    ) -> tuple[np.ndarray[Any, np.dtype[np.uint32]], list[tuple[int, int]], str | None]:
        # The ids stay a uint32 array (4 bytes per token); as a Python int list they were ≈ 36.
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=add_special_tokens), dtype=np.uint32)
        enc = self.hf.encode(text, add_special_tokens=add_special_tokens)
        if not np.array_equal(np.asarray(enc.ids, dtype=np.uint32), ids):
            return ids, [], "the offsets tokenizer disagrees with the target tokenizer on this text"
        return ids, [(int(a), int(b)) for a, b in enc.offsets], None


def _token_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """Tokens overlapping chars [start, end) (zero-width special tokens excluded)."""
    hit = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]
    return (hit[0], hit[-1] + 1) if hit else None


def _first_token_at(offsets: Sequence[tuple[int, int]], char: int) -> int:
    for i, (a, b) in enumerate(offsets):
        if b > a and b > char:
            return i
    return len(offsets)


_Units = Sequence[tuple[str, str, int, int]]


@dataclass(frozen=True)
class _Controls:
    """What every control of one build shares: the encoder and the build options (template, preamble,
    assembler, system)."""

    encoder: _Encoder
    options: BuildOptions

    def frame(self, case: Case) -> Frame:
        o = self.options
        return case_frame(case, template=o.template, preamble=o.preamble, assembler=o.assembler)

    def row(
        self, kind: str, case: Case, frame: Frame, body: tuple[str, _Units], *, position: str, note: str
    ) -> dict[str, Any]:
        """One control: ``body`` is the context and its units as (id, kind, char_start, char_end) in it."""
        context, units = body
        encoder, options = self.encoder, self.options
        text = frame.prefix + context + frame.suffix
        base = len(frame.prefix)
        ids, offsets, problem = encoder.encode(text, frame.add_special_tokens)
        spans: list[dict[str, Any]] = []
        if problem is None:
            for unit_id, unit_kind, start, end in units:
                span = _token_span(offsets, base + start, base + end)
                if span is None:
                    problem = f"unit {unit_id} has no tokens in the final encoding"
                    break
                spans.append(
                    {
                        "evidence_id": unit_id,
                        "kind": unit_kind,
                        "token_start": span[0],
                        "token_end": span[1],
                        "char_start": base + start,
                        "char_end": base + end,
                        "sha256": _sha(text[base + start : base + end]),
                    }
                )
        region = (
            (_first_token_at(offsets, base), _first_token_at(offsets, base + len(context)))
            if offsets
            else (0, 0)
        )
        decisive = {d.id for d in case.decisive}
        offset = next((s["token_start"] for s in spans if s["evidence_id"] in decisive), None)
        layout_id = _sha(
            "\x1f".join(
                [
                    "depthgate-control",
                    kind,
                    encoder.tokenizer.digest,
                    frame.template_digest,
                    assembler_version(options.assembler),
                    case.digest(),
                    "special" if frame.add_special_tokens else "plain",
                    _sha(text),
                ]
            )
        )[:32]
        return {
            "layout_id": layout_id,
            "case_id": case.id,
            "system": options.system,
            "target_tokens": len(ids),
            "position": position,
            "total_tokens": len(ids),
            "token_ids": ids,
            "text": text,
            "add_special_tokens": frame.add_special_tokens,
            "evidence_spans": spans,
            "requested_offset": offset,
            "actual_offset": offset,
            "snap_tokens": 0 if offset is not None else None,
            "region_start": region[0],
            "region_end": region[1],
            "status": "ok" if problem is None else "refused",
            "reason_code": None if problem is None else "control_offsets",
            "reason": problem,
            "verification": "full",
            "verification_note": note,
            "tokenizer_digest": encoder.tokenizer.digest,
            "template_digest": frame.template_digest,
            "pinned_date": frame.pinned_date,
            "assembler_version": assembler_version(options.assembler),
            "case_digest": case.digest(),
            "control": kind,
            "nominal_tokens": 0,
        }

    def evidence_only(self, case: Case) -> dict[str, Any]:
        context = ""
        units: list[tuple[str, str, int, int]] = []
        for index, doc in enumerate(case.evidence):
            # The first document opens a paragraph after the header (same separator the filler uses).
            text = "\n\n" + doc.text.lstrip() if index == 0 else doc.text
            units.append((doc.id, "evidence", len(context), len(context) + len(text)))
            context += text
        note = "evidence-only control: the case's evidence documents, no filler or distractors"
        return self.row(
            "evidence_only", case, self.frame(case), (context, units), position="evidence_only", note=note
        )

    def evidence_absent(self, case: Case, layout: Mapping[str, Any]) -> dict[str, Any]:
        frame = self.frame(case)
        length = int(layout["target_tokens"])
        depth = layout["position"]
        refused = layout["status"] != "ok"
        body: tuple[str, _Units] = ("", []) if refused else _without_decisive(case, layout, frame)
        note = f"evidence-absent control of the {length}-token depth-{depth} layout {layout['layout_id']}"
        row = self.row("evidence_absent", case, frame, body, position=f"evidence_absent@{depth}", note=note)
        row["nominal_tokens"] = length
        if refused:
            row["status"] = "refused"
            row["reason_code"] = layout["reason_code"]
            row["reason"] = f"the source layout was refused: {layout['reason']}"
            row["target_tokens"] = length
        return row


def _without_decisive(
    case: Case, layout: Mapping[str, Any], frame: Frame
) -> tuple[str, list[tuple[str, str, int, int]]]:
    """The context of an ok ``layout`` with the case's decisive evidence cut out, and the units it keeps
    as (id, kind, char_start, char_end) in the cut context."""
    text = str(layout["text"])
    if not (text.startswith(frame.prefix) and text.endswith(frame.suffix)):
        raise SpecError(
            "the depth-0.5 layout does not start and end with the case frame",
            field="frame",
            fix="build controls with the same template and preamble as the layouts",
        )
    context = text[len(frame.prefix) : len(text) - len(frame.suffix)]
    base = len(frame.prefix)
    decisive = {d.id for d in case.decisive}
    kept: list[tuple[str, str, int, int]] = []
    out = ""
    cursor = 0
    for span in sorted(layout["evidence_spans"] or [], key=lambda s: s["char_start"]):
        start, end = int(span["char_start"]) - base, int(span["char_end"]) - base
        if span["evidence_id"] in decisive:
            out += context[cursor:start]
            cursor = end
            continue
        out += context[cursor:start]
        cursor = start
        shift = len(out) - start
        kept.append((str(span["evidence_id"]), str(span["kind"]), start + shift, end + shift))
        out += context[start:end]
        cursor = end
    out += context[cursor:]
    return out, kept


def _verify(frame: pl.DataFrame, tokenizer: Tokenizer) -> pl.DataFrame:
    """Full re-encode verification (Rust) of every ok control of one batch; violations refuse the
    control. Column-wise: the ids go to the core as one flat uint32 buffer, never as Python lists."""
    status = frame["status"].to_list()
    ok = [i for i, s in enumerate(status) if s == "ok"]
    if not ok:
        return frame
    picked = frame[ok]
    stored = [
        {
            "layout_id": r["layout_id"],
            "text": r["text"],
            "add_special_tokens": r["add_special_tokens"],
            "target_tokens": r["target_tokens"],
            "spans": r["evidence_spans"],  # the core reads a stored evidence_id as its unit id
        }
        for r in picked.select(
            "layout_id", "text", "add_special_tokens", "target_tokens", "evidence_spans"
        ).iter_rows(named=True)
    ]
    ids = picked["token_ids"]
    lengths = ids.list.len().fill_null(0).cast(pl.UInt64).to_numpy()
    offsets = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(lengths, dtype=np.uint64)])
    flat = np.ascontiguousarray(
        ids.explode(empty_as_null=False, keep_nulls=False).to_numpy(), dtype=np.uint32
    )
    found = json.loads(_core.verify_layouts(tokenizer._core, json.dumps(stored), flat, offsets))
    reason_code = frame["reason_code"].to_list()
    reason = frame["reason"].to_list()
    changed = False
    for i, violations in zip(ok, found, strict=True):
        if violations:
            changed = True
            status[i] = "refused"
            reason_code[i] = f"verify_{violations[0]['code']}"
            reason[i] = "; ".join(f"{v['code']}: {v['detail']}" for v in violations)
    if not changed:
        return frame
    return frame.with_columns(
        pl.Series("status", status, dtype=CONTROLS_SCHEMA["status"]),
        pl.Series("reason_code", reason_code, dtype=CONTROLS_SCHEMA["reason_code"]),
        pl.Series("reason", reason, dtype=CONTROLS_SCHEMA["reason"]),
    )


def _source_batches(path: Path) -> Iterator[list[dict[str, Any]]]:
    """The evidence-absent source layouts, one row group (64 rows) at a time, without their ids."""
    lazy = pl.scan_parquet(path).select(_SOURCE_COLUMNS)
    total = int(lazy.select(pl.len()).collect().item())
    for start in range(0, total, _BATCH_ROWS):
        yield lazy.slice(start, _BATCH_ROWS).collect().to_dicts()


def build_controls(
    suite: Suite | Sequence[Case],
    tokenizer: Tokenizer,
    options: BuildOptions,
    out_path: str | Path,
) -> pl.DataFrame:
    """Build the evidence-only control of every case and its evidence-absent control at every length of
    ``options`` (from the depth-0.5 layout; ``options.positions`` is not used), verify them, and write
    ``out_path`` (parquet, atomically). Returns the summary (no ids or text).

    Streams: controls are built, verified and handed to the layouts' sink 64 at a time (the source
    layouts are read one row group at a time, without their ids), and the file is written in 64-row
    row groups — memory is one batch, not the whole build (issue #12, docs/benchmarks.md)."""
    cases = [c for c in (suite.cases if isinstance(suite, Suite) else suite) if c.decisive]
    if not cases:
        raise SpecError(
            "no case with decisive evidence", field="cases", fix="use a suite with evidence cases"
        )
    controls = _Controls(_Encoder(tokenizer), options)
    by_id = {c.id: c for c in cases}
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    half = Position(label=f"{_ABSENT_DEPTH:g}", depth=_ABSENT_DEPTH)
    summaries: list[pl.DataFrame] = []
    tmp = Path(tempfile.mkdtemp(prefix=".controls-", dir=out.parent))
    try:
        sink = layout_sink.LayoutSink(tmp, _layouts.BUILT_SCHEMA, row_group_rows=layout_sink.ROW_GROUP_ROWS)

        def add(rows: list[dict[str, Any]]) -> None:
            frame = _verify(pl.DataFrame(rows, schema=CONTROLS_SCHEMA), tokenizer)
            sink.add(frame)
            summaries.append(frame.drop("token_ids", "text"))

        for start in range(0, len(cases), _BATCH_ROWS):
            add([controls.evidence_only(case) for case in cases[start : start + _BATCH_ROWS]])
        source = tmp / "absent-source.parquet"
        build_layouts(cases, tokenizer, replace(options, positions=[half]), source)
        for batch in _source_batches(source):
            add([controls.evidence_absent(by_id[layout["case_id"]], layout) for layout in batch])
        atomic_write(out, sink.finish)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pl.concat(summaries)


def read_controls(path: str | Path, columns: Sequence[str] | None = None) -> pl.DataFrame:
    """Read a controls file (refusing files that are not). ``columns``: read only these — the run path
    and the scorer need a few small columns, never every control's ids and text."""
    derive = False
    if columns is None:
        frame = read_layouts(path)
    else:
        read_layouts(path, columns=["layout_id"])  # exists and is a layouts file, or a named error
        names = set(pl.read_parquet_schema(Path(path)))
        derive = "nominal_tokens" in columns and "nominal_tokens" not in names
        wanted = [c for c in columns if not (derive and c == "nominal_tokens")]
        extra = ["control", *(["target_tokens"] if derive else [])]
        wanted += [c for c in extra if c in names and c not in wanted]
        frame = read_layouts(path, columns=wanted)
    if "control" not in frame.columns:
        raise InputError(
            "not a controls file: no 'control' column",
            file=str(path),
            fix="pass a controls.parquet written by build_controls",
        )
    if columns is None:
        return with_nominal_tokens(frame)
    return (with_nominal_tokens(frame) if derive else frame).select(columns)


def with_nominal_tokens(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with its ``nominal_tokens`` (derived for files written before controls carried it)."""
    if "nominal_tokens" in frame.columns:
        return frame
    return frame.with_columns(
        pl.when(pl.col("control") == "evidence_only")
        .then(0)
        .otherwise(pl.col("target_tokens"))
        .cast(pl.Int64)
        .alias("nominal_tokens")
    )

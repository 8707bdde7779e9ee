"""``depthgate diff-tokenizer`` / ``diff-template``: what a tokenizer or chat-template upgrade does to
the layouts of a suite, before anything is run.

Both functions rebuild the suite under the old and the new version (same cases, lengths, positions,
filler) and compare the layouts of every (case, length, position): status, total tokens, the context
region, the token span of every evidence block and distractor, and the token ids themselves. An
upgrade that moves a single evidence token, or changes a single token id where counts and spans stay
the same (a template date rendered "Jul" → "July"), is *drift*: layouts built under the old version
must not be reused — :func:`assert_no_reuse` refuses exactly that.

Exit codes of the CLI handlers: 0 when the two versions are identical (same digest; nothing is built)
or produce token-identical layouts on the suite (layout ids still change: the digest is part of them);
``ExitCode.FAIL`` (10) when any layout drifts; ``ExitCode.BAD_INPUT`` (20) for bad input, including a
template that raises under one version only (:class:`TemplateError` naming which).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import polars as pl

from depthgate.commands.subparsers import add_diff_parsers
from depthgate.exceptions import ExitCode, TemplateError, VerificationError
from depthgate.layout.conversation import Conversation
from depthgate.layout.layouts import (
    BuildOptions,
    Position,
    Tokenizer,
    build_frame,
    case_frame,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.layout.model_files import load_template
from depthgate.layout.templates import ChatTemplate, raw_frame
from depthgate.spec.cases import Suite

__all__ = [
    "DiffReport",
    "LayoutDrift",
    "SpanDrift",
    "add_parsers",
    "assert_no_reuse",
    "cmd_diff_template",
    "cmd_diff_tokenizer",
    "diff_templates",
    "diff_tokenizers",
]

DiffKind = Literal["tokenizer", "template"]
TemplateSpec = str | Path | ChatTemplate | None


@dataclass(frozen=True)
class SpanDrift:
    """One evidence block or distractor of one layout under both versions (None: absent on that side)."""

    evidence_id: str
    kind: str
    old_start: int | None
    old_end: int | None
    new_start: int | None
    new_end: int | None

    @property
    def start_shift(self) -> int | None:
        return None if self.old_start is None or self.new_start is None else self.new_start - self.old_start

    @property
    def end_shift(self) -> int | None:
        return None if self.old_end is None or self.new_end is None else self.new_end - self.old_end

    @property
    def length_change(self) -> int | None:
        if None in (self.old_start, self.old_end, self.new_start, self.new_end):
            return None
        assert self.old_start is not None and self.old_end is not None
        assert self.new_start is not None and self.new_end is not None
        return (self.new_end - self.new_start) - (self.old_end - self.old_start)

    @property
    def drifted(self) -> bool:
        return (self.old_start, self.old_end) != (self.new_start, self.new_end)


@dataclass(frozen=True)
class LayoutDrift:
    """One (case, length, position) built under both versions."""

    case_id: str
    length: int
    position: str
    old_layout_id: str | None
    new_layout_id: str | None
    old_status: str | None
    new_status: str | None
    old_reason: str | None
    new_reason: str | None
    old_total: int | None
    new_total: int | None
    old_region: tuple[int, int] | None
    new_region: tuple[int, int] | None
    spans: tuple[SpanDrift, ...] = field(default_factory=tuple)
    #: First token index whose id differs between the versions (None: identical ids, or a side has
    #: no ids); ``tokens_changed`` counts differing positions (a length difference counts in full).
    first_token_diff: int | None = None
    tokens_changed: int = 0

    @property
    def evidence(self) -> tuple[SpanDrift, ...]:
        return tuple(s for s in self.spans if s.kind == "evidence")

    @property
    def max_evidence_shift(self) -> int:
        shifts = [abs(s.start_shift) for s in self.evidence if s.start_shift is not None]
        return max(shifts, default=0)

    @property
    def ids_changed(self) -> bool:
        return self.first_token_diff is not None

    @property
    def drifted(self) -> bool:
        return (
            self.old_status != self.new_status
            or self.old_total != self.new_total
            or self.old_region != self.new_region
            or any(s.drifted for s in self.spans)
            or self.ids_changed
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spans"] = [
            {
                **asdict(s),
                "start_shift": s.start_shift,
                "end_shift": s.end_shift,
                "length_change": s.length_change,
            }
            for s in self.spans
        ]
        out["layout_id_changed"] = self.old_layout_id != self.new_layout_id
        out["ids_changed"] = self.ids_changed
        out["drifted"] = self.drifted
        out["max_evidence_shift"] = self.max_evidence_shift
        return out


@dataclass(frozen=True)
class DiffReport:
    """The drift of a suite's layouts between an old and a new tokenizer or chat template."""

    kind: DiffKind
    old: str
    new: str
    old_digest: str
    new_digest: str
    suite: str
    lengths: tuple[int, ...]
    positions: tuple[str, ...]
    layouts: tuple[LayoutDrift, ...] = field(default_factory=tuple)

    @property
    def identical(self) -> bool:
        """Same digest: byte-identical files, nothing was rebuilt."""
        return self.old_digest == self.new_digest

    @property
    def drifted(self) -> list[LayoutDrift]:
        return [d for d in self.layouts if d.drifted]

    @property
    def max_evidence_shift(self) -> int:
        return max((d.max_evidence_shift for d in self.layouts), default=0)

    @property
    def status_changes(self) -> list[LayoutDrift]:
        return [d for d in self.layouts if d.old_status != d.new_status]

    @property
    def ids_changed(self) -> list[LayoutDrift]:
        """Layouts whose token ids differ (both versions built them)."""
        return [d for d in self.layouts if d.ids_changed]

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.FAIL if self.drifted else ExitCode.PASS

    def summary(self) -> str:
        if self.identical:
            return f"{self.kind}s are identical (digest {self.old_digest[:16]}): no rebuild needed, no drift"
        drifted = self.drifted
        if not drifted:
            return (
                f"{self.kind}s differ (digest {self.old_digest[:12]} → {self.new_digest[:12]}) but all "
                f"{len(self.layouts)} layouts are token-identical on this suite; layout ids change, so "
                "layouts must still be rebuilt (old ones are refused)"
            )
        shifted = sum(1 for d in drifted if d.max_evidence_shift)
        changed = self.ids_changed
        first = min((d.first_token_diff for d in changed if d.first_token_diff is not None), default=None)
        ids = f" (first at token {first})" if first is not None else ""
        return (
            f"{len(drifted)}/{len(self.layouts)} layouts drift under the new {self.kind}: "
            f"{shifted} with evidence moved (up to {self.max_evidence_shift} tokens), "
            f"{len(changed)} with other token ids{ids}, "
            f"{len(self.status_changes)} change status; old layouts must not be reused"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "old": {"source": self.old, "digest": self.old_digest},
            "new": {"source": self.new, "digest": self.new_digest},
            "suite": self.suite,
            "lengths": list(self.lengths),
            "positions": list(self.positions),
            "identical": self.identical,
            "summary": {
                "layouts": len(self.layouts),
                "drifted": len(self.drifted),
                "status_changes": len(self.status_changes),
                "ids_changed": len(self.ids_changed),
                "max_evidence_shift": self.max_evidence_shift,
                "text": self.summary(),
            },
            "layouts": [d.to_dict() for d in self.layouts],
        }

    def write_json(self, path: str | Path) -> Path:
        """Write the JSON report atomically (:func:`depthgate.commands.outputs.write_output_text`)."""
        from depthgate.commands.outputs import write_output_text

        text = json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"
        return write_output_text(path, text, option="--out")

    def table(self, limit: int = 40) -> str:
        """Plain-text table, most drifted layouts first (at most ``limit`` rows)."""
        lines = [self.summary()]
        if not self.layouts:
            return "\n".join(lines)
        head: tuple[str, ...] = (
            "case",
            "length",
            "pos",
            "status",
            "total",
            "region",
            "evidence Δstart",
            "Δend",
            "ids",
            "id",
        )
        with_turns = any(s.kind == "turn" for d in self.layouts for s in d.spans)
        if with_turns:
            head = (*head, "turn Δstart (*: header ids changed)")
        rows: list[tuple[str, ...]] = []
        ordered = sorted(
            self.layouts, key=lambda d: (not d.drifted, -d.max_evidence_shift, d.case_id, d.length)
        )
        for d in ordered[:limit]:
            ev = d.evidence
            starts = ",".join("?" if s.start_shift is None else f"{s.start_shift:+d}" for s in ev) or "-"
            ends = ",".join("?" if s.end_shift is None else f"{s.end_shift:+d}" for s in ev) or "-"
            rows.append(
                (
                    d.case_id,
                    str(d.length),
                    d.position,
                    _status(d.old_status, d.old_reason)
                    if d.old_status == d.new_status and d.old_reason == d.new_reason
                    else f"{_status(d.old_status, d.old_reason)}→{_status(d.new_status, d.new_reason)}",
                    _pair(d.old_total, d.new_total),
                    _pair(d.old_region, d.new_region),
                    starts,
                    ends,
                    "same"
                    if not d.ids_changed
                    else f"{d.tokens_changed} differ from token {d.first_token_diff}",
                    "same" if d.old_layout_id == d.new_layout_id else "changed",
                )
            )
            if with_turns:
                turn_shifts = ",".join(
                    ("?" if s.start_shift is None else f"{s.start_shift:+d}")
                    + ("*" if s.evidence_id.endswith(HEADER_CHANGED) else "")
                    for s in d.spans
                    if s.kind == "turn"
                )
                rows[-1] = (*rows[-1], turn_shifts or "-")
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        for row in (head, *rows):
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
        if len(ordered) > limit:
            lines.append(f"... {len(ordered) - limit} more layouts (see the JSON report)")
        return "\n".join(lines)


def _status(status: str | None, reason: str | None) -> str:
    return f"{status}:{reason}" if reason else str(status)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return f"{value[0]}..{value[1]}"
    return str(value)


def _pair(old: object, new: object) -> str:
    return _fmt(old) if old == new else f"{_fmt(old)}→{_fmt(new)}"


# --------------------------------------------------------------------------------------------------
# building and comparing


def _build(
    suite: Suite, tokenizer: Tokenizer, options: BuildOptions, folder: Path, name: str
) -> pl.DataFrame:
    return build_frame(suite, tokenizer, options, folder / f"{name}.parquet").drop("text")


def _id_diff(old: Sequence[int] | None, new: Sequence[int] | None) -> tuple[int | None, int]:
    """(first differing token index, number of differing positions) of two id lists; (None, 0) when
    they are equal or either side has none."""
    if old is None or new is None:
        return None, 0
    a, b = list(old), list(new)
    if a == b:
        return None, 0
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
    first = differ[0] if differ else min(len(a), len(b))
    return first, len(differ) + abs(len(a) - len(b))


#: Marks a turn whose header (the template's tokens between the previous turn's content and its own)
#: has other token ids under the new version, e.g. a renamed role: "turn 2 (assistant) [header]".
HEADER_CHANGED = " [header]"


def _headers(turns: Sequence[Mapping[str, Any]], ids: Sequence[int] | None) -> dict[int, list[int]]:
    """Token ids of each turn's header: from the previous turn's end (or the prompt's start) to its start."""
    if ids is None:
        return {}
    ends = [0] + [int(t["token_end"]) for t in turns]
    return {int(t["turn"]): list(ids[ends[i] : int(t["token_start"])]) for i, t in enumerate(turns)}


def turn_drift(
    old: Sequence[Mapping[str, Any]] | None,
    new: Sequence[Mapping[str, Any]] | None,
    old_ids: Sequence[int] | None = None,
    new_ids: Sequence[int] | None = None,
) -> list[SpanDrift]:
    """Each conversation turn's content span under both versions (empty for single-slot layouts),
    named with :data:`HEADER_CHANGED` when its header's token ids differ."""
    a = {int(t["turn"]): t for t in old or []}
    b = {int(t["turn"]): t for t in new or []}
    ha, hb = _headers(list(old or []), old_ids), _headers(list(new or []), new_ids)
    out = []
    for k in sorted(a.keys() | b.keys()):
        ta, tb = a.get(k), b.get(k)
        changed = HEADER_CHANGED if k in ha and k in hb and ha[k] != hb[k] else ""
        out.append(
            SpanDrift(
                evidence_id=f"turn {k} ({(ta or tb or {}).get('role')}){changed}",
                kind="turn",
                old_start=None if ta is None else int(ta["token_start"]),
                old_end=None if ta is None else int(ta["token_end"]),
                new_start=None if tb is None else int(tb["token_start"]),
                new_end=None if tb is None else int(tb["token_end"]),
            )
        )
    return out


def _compare(old: pl.DataFrame, new: pl.DataFrame) -> tuple[LayoutDrift, ...]:
    def index(f: pl.DataFrame) -> dict[tuple[str, int, str], dict[str, Any]]:
        return {
            (r["case_id"], int(r["target_tokens"]), str(r["position"])): r for r in f.iter_rows(named=True)
        }

    a, b = index(old), index(new)
    out: list[LayoutDrift] = []
    for key in sorted(a.keys() | b.keys()):
        ra, rb = a.get(key), b.get(key)
        spans_a = {s["evidence_id"]: s for s in (ra or {}).get("evidence_spans") or []}
        spans_b = {s["evidence_id"]: s for s in (rb or {}).get("evidence_spans") or []}
        spans = []
        for unit in sorted(
            spans_a.keys() | spans_b.keys(), key=lambda u: (spans_a.get(u) or spans_b[u])["char_start"]
        ):
            sa, sb = spans_a.get(unit), spans_b.get(unit)
            spans.append(
                SpanDrift(
                    evidence_id=unit,
                    kind=str((sa or sb or {}).get("kind")),
                    old_start=None if sa is None else int(sa["token_start"]),
                    old_end=None if sa is None else int(sa["token_end"]),
                    new_start=None if sb is None else int(sb["token_start"]),
                    new_end=None if sb is None else int(sb["token_end"]),
                )
            )

        def get(r: dict[str, Any] | None, k: str) -> Any:
            return None if r is None else r.get(k)

        def ids(r: dict[str, Any] | None) -> Sequence[int] | None:
            return None if r is None or r.get("status") != "ok" else r.get("token_ids")

        first_diff, changed = _id_diff(ids(ra), ids(rb))
        # A conversation's turns drift as spans of kind "turn" (one per turn: "turn 3 (user)").
        spans.extend(turn_drift((ra or {}).get("turn_spans"), (rb or {}).get("turn_spans"), ids(ra), ids(rb)))

        def total(r: dict[str, Any] | None) -> int | None:
            return None if r is None or r.get("status") != "ok" else int(r["total_tokens"])

        def region(r: dict[str, Any] | None) -> tuple[int, int] | None:
            if (
                r is None
                or r.get("status") != "ok"
                or r.get("region_start") is None
                or r.get("region_end") is None
            ):
                return None
            return (int(r["region_start"]), int(r["region_end"]))

        out.append(
            LayoutDrift(
                case_id=key[0],
                length=key[1],
                position=key[2],
                old_layout_id=get(ra, "layout_id"),
                new_layout_id=get(rb, "layout_id"),
                old_status=get(ra, "status"),
                new_status=get(rb, "status"),
                old_reason=get(ra, "reason_code"),
                new_reason=get(rb, "reason_code"),
                old_total=total(ra),
                new_total=total(rb),
                old_region=region(ra),
                new_region=region(rb),
                spans=tuple(spans),
                first_token_diff=first_diff,
                tokens_changed=changed,
            )
        )
    return tuple(out)


def _as_positions(positions: Sequence[float | str | Position]) -> list[Position]:
    return [p if isinstance(p, Position) else parse_positions([p])[0] for p in positions]


def _as_tokenizer(value: Tokenizer | str | Path) -> Tokenizer:
    if isinstance(value, Tokenizer):
        return value
    return load_tokenizer(str(value))


def diff_tokenizers(
    old_path: Tokenizer | str | Path,
    new_path: Tokenizer | str | Path,
    suite: Suite,
    lengths: Sequence[int],
    positions: Sequence[float | str | Position],
    *,
    template: ChatTemplate | None = None,
    preamble: str = "",
) -> DiffReport:
    """Rebuild ``suite`` under the old and the new tokenizer (same template, lengths, positions, filler)
    and report the drift of every layout. Identical tokenizers (same digest) are reported as such
    without building anything. ``old_path``/``new_path``: tokenizer.json paths, ``gguf:``/``gguf:<file>``,
    or loaded :class:`Tokenizer` objects."""
    old, new = _as_tokenizer(old_path), _as_tokenizer(new_path)
    pos = _as_positions(positions)
    report = DiffReport(
        kind="tokenizer",
        old=str(old.path),
        new=str(new.path),
        old_digest=old.digest,
        new_digest=new.digest,
        suite=suite.name,
        lengths=tuple(lengths),
        positions=tuple(p.label for p in pos),
    )
    if report.identical:
        return report
    options = BuildOptions(lengths=list(lengths), positions=pos, template=template, preamble=preamble)
    with tempfile.TemporaryDirectory(prefix="depthgate-diff-") as tmp:
        a = _build(suite, old, options, Path(tmp), "old")
        b = _build(suite, new, options, Path(tmp), "new")
    return DiffReport(**{**_fields(report), "layouts": _compare(a, b)})


def _fields(report: DiffReport) -> dict[str, Any]:
    return {
        k: getattr(report, k)
        for k in ("kind", "old", "new", "old_digest", "new_digest", "suite", "lengths", "positions")
    }


def _as_template(value: TemplateSpec) -> ChatTemplate | None:
    if value is None or isinstance(value, ChatTemplate):
        return value
    if str(value) == "raw":
        return None
    return load_template(str(value))


def _template_label(t: ChatTemplate | None) -> str:
    return "raw" if t is None else t.path


def _template_digest(t: ChatTemplate | None) -> str:
    return raw_frame(user_before="", user_after="").template_digest if t is None else t.digest


def diff_templates(
    old_template: TemplateSpec,
    new_template: TemplateSpec,
    tokenizer: Tokenizer | str | Path,
    suite: Suite,
    lengths: Sequence[int],
    positions: Sequence[float | str | Position],
    *,
    preamble: str = "",
    turns: int | None = None,
) -> DiffReport:
    """Rebuild ``suite`` under the old and the new chat template (``"raw"``/None: the raw completion
    frame) with the same tokenizer and report the drift. A template that raises for the suite's
    conversation under one version only is a :class:`TemplateError` naming that version. ``turns``:
    build ``turns``-turn conversations (layout/conversation.py) and report each turn's drift."""
    conversation = None if turns is None else Conversation(turns)
    old, new = _as_template(old_template), _as_template(new_template)
    tok = _as_tokenizer(tokenizer)
    pos = _as_positions(positions)
    report = DiffReport(
        kind="template",
        old=_template_label(old),
        new=_template_label(new),
        old_digest=_template_digest(old),
        new_digest=_template_digest(new),
        suite=suite.name,
        lengths=tuple(lengths),
        positions=tuple(p.label for p in pos),
    )
    if report.identical:
        return report
    errors: dict[str, TemplateError] = {}
    for name, template in (("old", old), ("new", new)):
        for case in suite.cases:
            try:
                case_frame(case, template=template, preamble=preamble, conversation=conversation)
            except TemplateError as exc:
                errors[name] = exc
                break
    if errors:
        if len(errors) == 2:
            raise TemplateError(
                "both templates fail to frame the suite: "
                f"old: {errors['old'].message}; new: {errors['new'].message}",
                file=f"{report.old} | {report.new}",
                field="chat_template",
                fix="check the suite and the templates; neither version can serve these cases",
            )
        which, error = next(iter(errors.items()))
        other = "new" if which == "old" else "old"
        raise TemplateError(
            f"the {which} template raises under this suite and the {other} one does not: {error.message}",
            file=report.old if which == "old" else report.new,
            field="chat_template",
            fix=f"the {which} version cannot serve these cases; fix it or compare against another version",
        ) from error
    options = BuildOptions(
        lengths=list(lengths), positions=pos, template=old, preamble=preamble, conversation=conversation
    )
    with tempfile.TemporaryDirectory(prefix="depthgate-diff-") as tmp:
        a = _build(suite, tok, options, Path(tmp), "old")
        b = _build(suite, tok, replace(options, template=new), Path(tmp), "new")
    return DiffReport(**{**_fields(report), "layouts": _compare(a, b)})


def assert_no_reuse(
    layouts_path: str | Path,
    tokenizer: Tokenizer | str | Path,
    *,
    template: TemplateSpec = None,
    check_template: bool = False,
) -> None:
    """Refuse a layouts file built under another tokenizer (or, with ``check_template``, another chat
    template): its offsets are stale. Raises :class:`VerificationError` naming how many layouts are stale."""
    frame = read_layouts(layouts_path)
    tok = _as_tokenizer(tokenizer)
    if "tokenizer_digest" not in frame.columns:
        raise VerificationError(
            "the layouts record no tokenizer digest; their tokenizer cannot be proved",
            file=str(layouts_path),
            fix="rebuild them with `depthgate build`",
        )
    stale = frame.filter(pl.col("tokenizer_digest") != tok.digest)
    if stale.height:
        built = sorted(set(stale["tokenizer_digest"].to_list()))
        raise VerificationError(
            f"{stale.height}/{frame.height} layouts were built under tokenizer "
            f"{', '.join(d[:12] for d in built)}, not {tok.digest[:12]} ({tok.path}); "
            "their token offsets are stale",
            file=str(layouts_path),
            field="tokenizer_digest",
            fix="rebuild the layouts with the new tokenizer (`depthgate build`); old offsets are not reused",
        )
    if check_template:
        digest = _template_digest(_as_template(template))
        wrong = frame.filter(pl.col("template_digest") != digest)
        if wrong.height:
            raise VerificationError(
                f"{wrong.height}/{frame.height} layouts were built under another chat template",
                file=str(layouts_path),
                field="template_digest",
                fix="rebuild the layouts with the system's chat template",
            )


# --------------------------------------------------------------------------------------------------
# CLI


def _suite_from(args: argparse.Namespace) -> Suite:
    from depthgate.spec.suites import builtin_suite, resolve_suite

    if getattr(args, "suite", None):
        from depthgate.spec.matrix import FileSuiteRef

        return resolve_suite(FileSuiteRef(path=str(args.suite)))
    return builtin_suite(args.cases, args.seed, args.lang)


def _finish(report: DiffReport, args: argparse.Namespace) -> int:
    print(report.table(limit=args.limit))
    if args.out:
        path = report.write_json(args.out)
        print(f"report: {path}")
    return int(report.exit_code)


def cmd_diff_tokenizer(args: argparse.Namespace) -> int:
    """``depthgate diff-tokenizer --old A --new B``: 0 no drift, 10 drift, 20 bad input."""
    template = load_template(args.chat_template) if args.chat_template else None
    report = diff_tokenizers(
        args.old, args.new, _suite_from(args), args.lengths, args.positions, template=template
    )
    return _finish(report, args)


def cmd_diff_template(args: argparse.Namespace) -> int:
    """``depthgate diff-template --old A --new B --tokenizer T``: 0 no drift, 10 drift, 20 bad input."""
    report = diff_templates(
        args.old, args.new, args.tokenizer, _suite_from(args), args.lengths, args.positions, turns=args.turns
    )
    return _finish(report, args)


def add_parsers(subparsers: Any) -> None:
    """Add ``diff-tokenizer`` and ``diff-template`` to the CLI's subparsers."""
    add_diff_parsers(subparsers, cmd_diff_tokenizer, cmd_diff_template)

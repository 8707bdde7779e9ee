"""Reports of a gate run, for machines and for people (DESIGN.md §8).

:func:`write_reports` writes, into one directory:

* ``verdict.json``: the verdict (PASS / FAIL / INCONCLUSIVE), the safety flag, the exit code, every slice
  row, the worst-position tables, the triage list, per-slice oracle counts and every digest of the run
  manifest. :class:`VerdictDocument` is its schema; :func:`load_verdict` reads and validates it.
* ``summary.md``: a pull-request comment: the verdict line, failing and inconclusive slices first, the
  worst positions, and per-slice counts of missing claims, wrong citations and system failures.
* ``junit.xml``: one testcase per slice (``failure`` for FAIL, ``skipped`` for INCONCLUSIVE), plus one
  safety testcase in a suite of its own, so CI dashboards show the gate like a test run.
* ``report.html``: a self-contained page (PNG heatmaps embedded as data URIs) with length x position grids
  of accuracy and of delta with its lower bound and FDR marks, a legend, the slice and worst-position
  tables, and the missing-claim, wrong-citation and system-failure lists. The PNGs are also written next
  to it (``heatmap_delta.png``, ``heatmap_accuracy.png``).

Every file is first written into a staging directory inside ``out_dir`` and then moved into place with
``os.replace``; ``verdict.json`` is removed first and moved last, so it is the commit marker: when it
exists, the other files beside it belong to the same run. A failure while rendering leaves ``out_dir``
as it was. Raw prompts never enter a report; model outputs appear only through the oracle's one-sentence
reasons, and the manifest contributes only its digests and short scalar fields without secret-like names.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import os
import re
import shutil
import tempfile
import typing
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import numpy as np
import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from depthgate.exceptions import ExitCode, InputError
from depthgate.judge.frames import require_columns
from depthgate.judge.health import InfraSummary, RunHealth, assess
from depthgate.judge.serving import SystemCheckReport
from depthgate.judge.stats import (
    ARMS,
    BASELINE,
    CANDIDATE,
    GateResult,
    PositionShare,
    SliceResult,
    SliceStatus,
    Verdict,
    non_inferiority_shown,
    position_sort_key,
)
from depthgate.judge.wording import with_system_wording
from depthgate.spec.models import split_position_label

SCHEMA_VERSION = "depthgate.verdict/1"
VERDICT_JSON = "verdict.json"
SUMMARY_MD = "summary.md"
JUNIT_XML = "junit.xml"
REPORT_HTML = "report.html"
HEATMAP_DELTA = "heatmap_delta.png"
HEATMAP_ACCURACY = "heatmap_accuracy.png"

MARK_REGRESSION = "★"
#: "Non-inferiority shown": LB > -M, the slice's own NI test (stats.non_inferiority_shown), never q_NI.
MARK_NI = "·"

# Failing slices first (worst kind first), then inconclusive, then passing.
_STATUS_ORDER = {
    SliceStatus.FAIL_SYSTEM: 0,
    SliceStatus.FAIL_REGRESSION: 0,
    SliceStatus.FAIL_NOT_SHOWN: 1,
    SliceStatus.FAIL_FLOOR: 2,
    SliceStatus.INCONCLUSIVE: 3,
    SliceStatus.PASS: 4,
}
_SECRET_KEY = re.compile(r"(api[_-]?key|secret|password|passwd|credential|auth|bearer|^token$|^key$)", re.I)
_LIST_LIMIT = 200  # rows of the missing-claim / wrong-citation lists in the HTML page
_DPI = 110


# --------------------------------------------------------------------------------------------------------
# Exit codes


def exit_code_for(result: GateResult, health: RunHealth | None = None) -> ExitCode:
    """The process exit code of a gate result: SAFETY overrides everything, then INFRA (data was lost:
    no verdict is computed over it), then FAIL_SYSTEM (every failing slice is driven by the candidate's
    system failures), FAIL, INCONCLUSIVE, PASS."""
    if result.safety_flag:
        return ExitCode.SAFETY
    if health is not None and health.lost_data:
        return ExitCode.INFRA
    if result.verdict is Verdict.FAIL:
        if health is not None and health.failure_class == "system":
            return ExitCode.FAIL_SYSTEM
        return ExitCode.FAIL
    if result.verdict is Verdict.INCONCLUSIVE:
        return ExitCode.INCONCLUSIVE
    return ExitCode.PASS


# --------------------------------------------------------------------------------------------------------
# The verdict document


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _verdict_slice_model() -> type[_Strict]:
    """``slice`` plus every field of :class:`~depthgate.judge.stats.SliceResult`, with its types: the
    schema follows the gate's row instead of restating it."""
    hints = typing.get_type_hints(SliceResult)
    fields: dict[str, Any] = {"slice": (str, ...)}
    fields.update({f.name: (hints[f.name], ...) for f in dataclasses.fields(SliceResult)})
    return create_model(
        "VerdictSlice",
        __base__=_Strict,
        __module__=__name__,
        __doc__="One slice row of ``verdict.json``: ``slice`` + the fields of ``SliceResult``.",
        **fields,
    )


if TYPE_CHECKING:

    class VerdictSlice(_Strict):  # the type checker's view; the real class is derived below
        slice: str
        status: SliceStatus

else:
    VerdictSlice = _verdict_slice_model()


class OracleCounts(_Strict):
    """Oracle counts of one (slice, arm): runs by outcome and the runs with each kind of problem."""

    slice: str
    length: int
    position: str
    arm: Literal["baseline", "candidate"]
    runs: int
    passed: int
    failed: int
    system_fail: int
    missing: int
    abstained: int
    safety_hits: int
    missing_claims: int
    wrong_citations: int
    system_fail_reasons: dict[str, int]


class LengthChars(_Strict):
    """The prompts one arm built at one token length, in characters (its ok layouts): a token length
    means another amount of text under another tokenizer, so a tokenizer upgrade compares like with like
    only beside these numbers. ``chars_per_token``: total characters / total tokens."""

    length: int
    arm: Literal["baseline", "candidate"]
    layouts: int
    chars_mean: float
    chars_min: int
    chars_max: int
    tokens_mean: float
    chars_per_token: float


class VerdictDocument(_Strict):
    """Schema of ``verdict.json``; validation also checks that verdict, exit code and slices agree."""

    schema_version: Literal["depthgate.verdict/1"]
    verdict: Literal["PASS", "FAIL", "INCONCLUSIVE", "INFRA"]
    safety_flag: bool
    exit_code: Literal["PASS", "FAIL", "INCONCLUSIVE", "SAFETY", "INFRA", "FAIL_SYSTEM"]
    exit_code_value: int
    reasons: list[str]
    slice_counts: dict[str, int]
    plan: dict[str, Any]
    overall: dict[str, Any] | None
    safety: dict[str, Any]
    slices: list[VerdictSlice]
    worst_by_length: list[dict[str, Any]]
    worst_cases: list[dict[str, Any]]
    worst_shares: list[dict[str, Any]]
    triage: list[dict[str, Any]]
    triage_note: str
    oracle: list[OracleCounts]
    digests: dict[str, str]
    run: dict[str, str | int | float | bool | None]
    files: dict[str, str]
    # Added by the pipeline when controls ran beside the matrix (depthgate.judge.controls.classify_failures).
    controls: dict[str, Any] | None = None
    # Added by the pipeline (depthgate.report.position): effective length, control-normalised accuracy,
    # pass^k; and, for an A/A run (`depthgate run --aa`), the noise floor. Neither changes the verdict.
    position: dict[str, Any] | None = None
    noise_floor: dict[str, Any] | None = None
    # Added by the pipeline for a stop_rule "sequential" run (depthgate.commands.sequential): the design,
    # every look's decisions and what was not sent.
    sequential: dict[str, Any] | None = None
    # What failed (depthgate.judge.health): "model", "system" (every failing slice driven by the
    # candidate's system failures), "mixed" or "none"; and the runs lost to infrastructure (INFRA).
    failure_class: Literal["none", "model", "system", "mixed"] = "none"
    system_driven_slices: list[str] = []
    system_fail_reasons: dict[str, int] = {}
    infra: dict[str, Any] | None = None
    # Characters per token length and arm (:func:`length_chars`); None when the layouts were not at hand.
    length_chars: list[LengthChars] | None = None
    # The serving-path checks that ran (depthgate.judge.serving: "canaries" …), by name; left out of the
    # file when none ran.
    serving_checks: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> VerdictDocument:
        if ExitCode[self.exit_code].value != self.exit_code_value:
            raise ValueError(f"exit_code {self.exit_code} is not {self.exit_code_value}")
        if self.safety_flag:
            expected_exit = "SAFETY"
        elif self.verdict == "FAIL" and self.failure_class == "system":
            expected_exit = "FAIL_SYSTEM"
        else:
            expected_exit = self.verdict
        if self.exit_code != expected_exit:
            raise ValueError(f"exit_code {self.exit_code} does not follow from the verdict ({expected_exit})")
        if bool(self.safety.get("flag")) != self.safety_flag:
            raise ValueError("safety_flag disagrees with safety.flag")
        if (self.verdict == "INFRA") != bool(self.infra and self.infra.get("lost")):
            raise ValueError("verdict INFRA must match runs lost to infrastructure errors (infra.lost > 0)")
        if self.verdict == "INFRA":
            return self
        failing = any(s.status.startswith("FAIL") for s in self.slices)
        overall_fails = self.overall is not None and self.overall.get("non_inferior") is False
        if (self.verdict == "FAIL") != (failing or overall_fails):
            raise ValueError("verdict FAIL must match a failing slice or a failing overall test")
        if self.verdict == "PASS" and any(s.status == "INCONCLUSIVE" for s in self.slices):
            raise ValueError("verdict PASS with an INCONCLUSIVE slice")
        return self


def load_verdict(path: str | Path) -> VerdictDocument:
    """Read and validate a ``verdict.json`` (InputError naming the file when it is invalid)."""
    path = Path(path)
    try:
        return VerdictDocument.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise InputError("verdict file not found", file=str(path), fix="run the gate first") from None
    except ValidationError as exc:
        raise InputError(
            f"invalid verdict document: {exc.errors(include_url=False)[0]['msg']}",
            file=str(path),
            fix="regenerate it with depthgate.report.report.write_reports",
        ) from exc


@dataclass(frozen=True)
class ReportPaths:
    """Where :func:`write_reports` put each file, and the exit code the verdict document states."""

    exit_code: ExitCode
    out_dir: Path
    verdict_json: Path
    summary_md: Path
    junit_xml: Path
    report_html: Path
    heatmaps: tuple[Path, ...]


# --------------------------------------------------------------------------------------------------------
# Length in characters


def length_chars(layouts: Mapping[str, str | Path]) -> list[LengthChars]:
    """Characters of each arm's ok layouts per token length (``target_tokens``), from the rendered
    ``text``. ``layouts``: arm → ``layouts.parquet``. The file is checked and its small columns read with
    :func:`~depthgate.layout.layouts.read_layouts`; the text is only measured, in a streaming scan, never
    held (it is ≈ 4 bytes per token: gigabytes for a 128K matrix)."""
    from depthgate.layout.layouts import read_layouts

    rows: list[LengthChars] = []
    for arm in ARMS:
        if arm not in layouts:
            continue
        path = Path(layouts[arm])
        read_layouts(path, columns=["target_tokens", "total_tokens", "status"])  # a layouts file, or refused
        stats = (
            pl.scan_parquet(path)
            .filter(pl.col("status") == "ok")
            .select("target_tokens", "total_tokens", pl.col("text").str.len_chars().alias("chars"))
            .group_by("target_tokens")
            .agg(
                pl.len().alias("layouts"),
                pl.col("chars").mean().alias("chars_mean"),
                pl.col("chars").min().alias("chars_min"),
                pl.col("chars").max().alias("chars_max"),
                pl.col("total_tokens").mean().alias("tokens_mean"),
                (pl.col("chars").sum() / pl.col("total_tokens").sum()).alias("chars_per_token"),
            )
            .sort("target_tokens")
            .collect(engine="streaming")
        )
        for row in stats.iter_rows(named=True):
            rows.append(
                LengthChars.model_validate(
                    {
                        "length": int(row["target_tokens"]),
                        "arm": arm,
                        "layouts": int(row["layouts"]),
                        "chars_mean": round(float(row["chars_mean"]), 2),
                        "chars_min": int(row["chars_min"]),
                        "chars_max": int(row["chars_max"]),
                        "tokens_mean": round(float(row["tokens_mean"]), 2),
                        "chars_per_token": round(float(row["chars_per_token"]), 4),
                    }
                )
            )
    return sorted(rows, key=lambda r: (r.length, ARMS.index(r.arm)))


def run_layouts(out_dir: str | Path, manifest: Mapping[str, Any]) -> dict[str, Path] | None:
    """The layouts of the run whose reports go to ``out_dir``, when ``out_dir`` is the run folder's
    ``report`` (the default of ``depthgate run``, ``gate`` and ``report``): its parent holds a
    ``manifest.json`` with this manifest's digest and ``<arm>/layouts.parquet``. None otherwise."""
    run = Path(out_dir).resolve().parent
    digest = manifest.get("manifest_digest")
    try:
        on_disk = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not digest or not isinstance(on_disk, dict) or on_disk.get("manifest_digest") != digest:
        return None
    paths = {arm: run / arm / "layouts.parquet" for arm in ARMS}
    return paths if all(path.is_file() for path in paths.values()) else None


def _length_char_rows(chars: Sequence[LengthChars]) -> list[dict[str, str]]:
    """One row per token length: both arms' characters (mean, min–max), characters per token and the
    candidate's mean relative to the baseline's."""
    by_length: dict[int, dict[str, LengthChars]] = {}
    for row in chars:
        by_length.setdefault(row.length, {})[row.arm] = row
    out: list[dict[str, str]] = []
    for length in sorted(by_length):
        arms = by_length[length]
        b, c = arms.get(BASELINE), arms.get(CANDIDATE)

        def cell(r: LengthChars | None) -> str:
            return "–" if r is None else f"{r.chars_mean:,.0f} ({r.chars_min:,}–{r.chars_max:,})"

        def per_token(r: LengthChars | None) -> str:
            return "–" if r is None else f"{r.chars_per_token:.2f}"

        change = (
            f"{100 * (c.chars_mean / b.chars_mean - 1):+.1f}%"
            if b is not None and c is not None and b.chars_mean
            else "–"
        )
        out.append(
            {
                "length": f"{length:,}",
                "layouts": f"{b.layouts if b else 0} / {c.layouts if c else 0}",
                "baseline": cell(b),
                "candidate": cell(c),
                "per_token": f"{per_token(b)} → {per_token(c)}",
                "change": change,
            }
        )
    return out


_CHARS_NOTE = (
    "Characters of the rendered prompts (ok layouts) at each token length, per arm: a token length holds "
    "another amount of text under another tokenizer or template, so compare a tokenizer upgrade here."
)


# --------------------------------------------------------------------------------------------------------
# Small formatting helpers


def slice_key(length: int, position: str) -> str:
    """The slice name used in every report and in the gate's reasons: ``"8192/0.5"``."""
    return f"{length}/{position}"


def depth_label(position: str) -> str:
    """A position for people: ``"0.25"`` → ``"25%"``, ``"@1200"`` → ``"token 1,200"``, ``"0.5~far"`` →
    ``"50% · far"`` (evidence spacing)."""
    base, spacing = split_position_label(position)
    if spacing != "adjacent":
        return f"{depth_label(base)} · {spacing}"
    kind, value, _ = position_sort_key(position)
    if kind == 0:
        return f"{100 * value:g}%"
    if kind == 1:
        return f"token {int(value):,}"
    return position


def _signed(value: float | None, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return "–"
    if math.isinf(value):
        return "−∞" if value < 0 else "+∞"
    text = f"{value:+.{digits}f}"
    return text.replace("-", "−")


def _plain(value: float | None, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}"


def _q(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if value >= 0.9995:
        return "1"
    return f"{value:.3g}" if value >= 0.001 else f"{value:.1e}"


def _ordered(slices: Iterable[SliceResult]) -> list[SliceResult]:
    return sorted(
        slices,
        key=lambda s: (
            _STATUS_ORDER[s.status],
            s.lower if s.lower is not None else math.inf,
            s.length,
            position_sort_key(s.position),
        ),
    )


def _reason_kind(reason: str | None) -> str:
    """Bucket a system-failure reason by its head: ``"truncation: 4100 > 4096"`` → ``"truncation"``."""
    if not reason or not reason.strip():
        return "unspecified"
    head = re.split(r"[:(\[;,]", reason.strip(), maxsplit=1)[0].strip().lower()
    return (head or "unspecified")[:40]


# --------------------------------------------------------------------------------------------------------
# The scored frame


_LIST_COLUMNS = ("missing_claims", "forbidden_hits", "wrong_citations", "field_mismatches")


def _prepare_scored(scored: pl.DataFrame) -> pl.DataFrame:
    df = scored
    if "length" not in df.columns and "target_tokens" in df.columns:
        df = df.rename({"target_tokens": "length"})
    require_columns(
        df,
        ["arm", "case_id", "length", "position", "outcome"],
        what="scored records",
        fix="pass the frame returned by depthgate.judge.oracle.score_records",
    )
    extra: list[pl.Expr] = []
    if "seed" not in df.columns:
        extra.append(pl.lit(0, dtype=pl.Int64()).alias("seed"))
    if "safety" not in df.columns:
        extra.append(pl.lit(False).alias("safety"))
    if "abstained" not in df.columns:
        extra.append(pl.lit(False).alias("abstained"))
    for name in ("system_fail_reason", "score_reason"):
        if name not in df.columns:
            extra.append(pl.lit(None, dtype=pl.String()).alias(name))
    for name in _LIST_COLUMNS:
        if name not in df.columns:
            extra.append(pl.lit([], dtype=pl.List(pl.String())).alias(name))
    if extra:
        df = df.with_columns(extra)
    return df.with_columns(
        pl.col("length").cast(pl.Int64()),
        pl.col("position").cast(pl.String()),
        pl.col("safety").fill_null(False),
        pl.col("abstained").fill_null(False),
        *[pl.col(name).fill_null([]) for name in _LIST_COLUMNS],
    )


_COUNT_FIELDS = (
    "runs",
    "passed",
    "failed",
    "system_fail",
    "missing",
    "abstained",
    "safety_hits",
    "missing_claims",
    "wrong_citations",
)


def oracle_counts(scored: pl.DataFrame) -> list[OracleCounts]:
    """Per (slice, arm): runs by outcome, abstentions, safety hits, runs with missing claims or wrong
    citations, and system failures by reason kind."""
    df = _prepare_scored(scored)
    keys = ["length", "position", "arm"]
    counts = df.group_by(keys).agg(
        pl.len().alias("runs"),
        (pl.col("outcome") == "pass").sum().alias("passed"),
        (pl.col("outcome") == "fail").sum().alias("failed"),
        (pl.col("outcome") == "system_fail").sum().alias("system_fail"),
        (pl.col("outcome") == "missing").sum().alias("missing"),
        pl.col("abstained").sum().alias("abstained"),
        pl.col("safety").sum().alias("safety_hits"),
        (pl.col("missing_claims").list.len() > 0).sum().alias("missing_claims"),
        (pl.col("wrong_citations").list.len() > 0).sum().alias("wrong_citations"),
    )
    reasons: dict[tuple[int, str, str], dict[str, int]] = {}
    failed = df.filter(pl.col("outcome") == "system_fail").select(*keys, "system_fail_reason")
    for length, position, arm, reason in failed.iter_rows():
        bucket = reasons.setdefault((length, position, arm), {})
        kind = _reason_kind(reason)
        bucket[kind] = bucket.get(kind, 0) + 1
    rows: list[OracleCounts] = []
    for row in counts.iter_rows(named=True):
        if row["arm"] not in ARMS:
            continue
        key = (row["length"], row["position"], row["arm"])
        numbers = {k: int(row[k]) for k in _COUNT_FIELDS}
        rows.append(
            OracleCounts.model_validate(
                {
                    "slice": slice_key(row["length"], row["position"]),
                    "length": row["length"],
                    "position": row["position"],
                    "arm": row["arm"],
                    "system_fail_reasons": dict(sorted(reasons.get(key, {}).items())),
                    **numbers,
                }
            )
        )
    rows.sort(key=lambda r: (r.length, position_sort_key(r.position), ARMS.index(r.arm)))
    return rows


def _problem_rows(
    df: pl.DataFrame, column: str, slice_order: Mapping[str, int], limit: int
) -> tuple[list[dict[str, Any]], int]:
    """Runs whose ``column`` list is non-empty, grouped per (arm, slice, case): candidate rows first,
    then slices in report order (failing first), then case id. Returns the first ``limit`` groups and
    the number of groups. Sorted and cut in polars before any row becomes a dict: at 10^6 runs there
    are ~20K groups and converting them all took 1.2 s of a 2 s report (docs/benchmarks-runner-gate.md).
    """
    groups = (
        df.filter(pl.col(column).list.len() > 0)
        .group_by(["arm", "length", "position", "case_id"])
        .agg(
            pl.col(column).explode().unique().sort().alias("ids"),
            pl.len().alias("runs"),
            pl.col("seed").sort().alias("seeds"),
            pl.col("score_reason").sort_by("seed").first().alias("reason"),
        )
    )
    pairs = groups.select("length", "position").unique()
    ranks = pairs.with_columns(
        pl.Series(
            "_rank",
            [
                slice_order.get(slice_key(length, position), len(slice_order))
                for length, position in pairs.iter_rows()
            ],
            dtype=pl.Int64,
        )
    )
    rows = (
        groups.join(ranks, on=["length", "position"], how="left")
        .sort(
            [(pl.col("arm") != CANDIDATE), "_rank", "case_id", "length", "position"],
            maintain_order=True,
        )
        .drop("_rank")
        .head(limit)
        .to_dicts()
    )
    for row in rows:
        row["slice"] = slice_key(row["length"], row["position"])
    return rows, groups.height


# --------------------------------------------------------------------------------------------------------
# Manifest


def manifest_digests(manifest: Mapping[str, Any]) -> dict[str, str]:
    """Every digest in a run manifest, by dotted path: values under a ``digests`` mapping, and string
    values whose key ends in ``digest`` or ``sha256``."""
    found: dict[str, str] = {}

    def walk(path: str, value: Any, under_digests: bool) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                walk(child, item, under_digests or str(key).lower() == "digests")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(f"{path}[{index}]", item, under_digests)
        elif isinstance(value, str):
            leaf = re.sub(r"\[\d+\]$", "", path).rsplit(".", 1)[-1].lower()
            if under_digests or leaf.endswith("digest") or leaf.endswith("sha256"):
                found[path] = value

    walk("", manifest, False)
    return dict(sorted(found.items()))


def _run_info(manifest: Mapping[str, Any]) -> dict[str, str | int | float | bool | None]:
    """Top-level scalar fields of the manifest, without secret-like names or long values."""
    out: dict[str, str | int | float | bool | None] = {}
    for key, value in manifest.items():
        name = str(key)
        if _SECRET_KEY.search(name) or name.lower().endswith(("digest", "sha256")):
            continue
        if value is None or isinstance(value, bool | int):
            out[name] = value
        elif isinstance(value, float):
            out[name] = value if math.isfinite(value) else None
        elif isinstance(value, str) and len(value) <= 300 and "\n" not in value:
            out[name] = value
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------------------------
# verdict.json


def verdict_name(result: GateResult, health: RunHealth | None = None) -> str:
    """``INFRA`` when runs were lost (no verdict over lost data), else the gate's verdict."""
    return "INFRA" if health is not None and health.lost_data else result.verdict.value


def health_reasons(health: RunHealth | None) -> list[str]:
    """One line per thing the run itself says about the verdict (lost data, system-driven failures)."""
    if health is None:
        return []
    out: list[str] = []
    infra = health.infra
    if infra is not None and infra.lost:
        where = ", ".join(f"{k} {v}" for k, v in sorted(infra.by_endpoint.items()))
        out.append(
            f"INFRA: {infra.lost} of {infra.planned} planned runs have no result ({infra.infra_error} "
            f"infra_error after every retry, {infra.not_sent} not sent; {where}); no verdict is computed "
            "over lost data — rerun the same command to resume"
        )
    if health.failure_class in ("system", "mixed"):
        why = ", ".join(f"{k} {v}" for k, v in sorted(health.system_fail_reasons.items()))
        scope = "every failing slice" if health.failure_class == "system" else "some failing slices"
        arms = {f.arm for f in health.findings}
        if any(not k.startswith("baseline:") for k in health.system_fail_reasons):
            arms.add("candidate")
        whose = " and the ".join(sorted(arms or {"candidate"}))
        out.append(
            f"SYSTEM: {scope} ({', '.join(health.system_driven)}) fail because the {whose}'s serving "
            f"path failed ({why}), not because the model answered worse"
        )
    return out


@dataclass(frozen=True)
class ReportInputs:
    """What every report file is rendered from: the gate result, the scored runs and their oracle
    counts, the run manifest, the run's health and the length in characters (:func:`length_chars`;
    None leaves its section out)."""

    result: GateResult
    scored: pl.DataFrame
    oracle: Sequence[OracleCounts]
    manifest: Mapping[str, Any]
    health: RunHealth | None = None
    chars: Sequence[LengthChars] | None = None
    checks: Mapping[str, Any] | None = None

    def parts(
        self,
    ) -> tuple[
        GateResult, Sequence[OracleCounts], Mapping[str, Any], RunHealth | None, Sequence[LengthChars] | None
    ]:
        """(result, oracle, manifest, health, chars): what the summary, the page and verdict.json read."""
        return self.result, self.oracle, self.manifest, self.health, self.chars


def build_verdict(inputs: ReportInputs) -> VerdictDocument:
    """The validated verdict document of a gate result."""
    result, oracle, manifest, health, chars = inputs.parts()
    data = result.to_dict()
    code = exit_code_for(result, health)
    slices = [{"slice": slice_key(s.length, s.position), **s.to_dict()} for s in result.slice_results]
    # FAIL_SYSTEM only when a slice has it: verdicts without a serving-path failure read as before.
    counts = {status.value: 0 for status in SliceStatus if status is not SliceStatus.FAIL_SYSTEM}
    for s in result.slice_results:
        counts[s.status.value] = counts.get(s.status.value, 0) + 1
    return VerdictDocument.model_validate(
        {
            "schema_version": SCHEMA_VERSION,
            "verdict": verdict_name(result, health),
            "safety_flag": data["safety_flag"],
            "exit_code": code.name,
            "exit_code_value": int(code),
            "reasons": health_reasons(health) + list(data["reasons"]),
            "slice_counts": counts,
            "plan": data["plan"],
            "overall": data["overall"],
            "safety": data["safety"],
            "slices": slices,
            "worst_by_length": data["worst_by_length"],
            "worst_cases": data["worst_cases"],
            "worst_shares": data["worst_shares"],
            "triage": data["triage"],
            "triage_note": data["triage_note"],
            "oracle": [o.model_dump() for o in oracle],
            "digests": manifest_digests(manifest),
            "run": _run_info(manifest),
            "files": {
                "summary": SUMMARY_MD,
                "junit": JUNIT_XML,
                "html": REPORT_HTML,
                "heatmap_delta": HEATMAP_DELTA,
                "heatmap_accuracy": HEATMAP_ACCURACY,
            },
            **(health.to_dict() if health is not None else {}),
            "length_chars": None if chars is None else [c.model_dump() for c in chars],
            "serving_checks": inputs.checks,
        }
    )


# --------------------------------------------------------------------------------------------------------
# summary.md


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _verdict_icon(verdict: str) -> str:
    return {"PASS": "✅", "FAIL": "❌", "INCONCLUSIVE": "⚠️", "INFRA": "🔌"}[verdict]


def _canary_lines(canaries: Mapping[str, Any] | None) -> list[str]:
    """The full-length canaries (verdict.json ``serving_checks.canaries``) as a summary.md table."""
    if not canaries:
        return []
    lines = [
        "",
        "### Full-length canaries (answer at the very start / end of a prompt of each length)",
        "",
        "| length | kind | baseline answered | candidate answered |",
        "|---:|---|---:|---:|",
    ]
    cells: dict[tuple[int, str], dict[str, str]] = {}
    for c in canaries.get("counts", []):
        cells.setdefault((int(c["length"]), str(c["kind"])), {})[str(c["arm"])] = (
            f"{c['passed']} / {c['runs']}"
        )
    for (length, kind), by_arm in sorted(cells.items()):
        lines.append(
            f"| {length} | {kind} | {by_arm.get('baseline', '–')} | {by_arm.get('candidate', '–')} |"
        )
    lines += ["", *(f"- **{line}**" for line in canaries.get("findings", []))]
    return lines


def render_summary(inputs: ReportInputs) -> str:
    """The Markdown pull-request comment."""
    result, oracle, manifest, health, chars = inputs.parts()
    plan = result.plan
    code = exit_code_for(result, health)
    ordered = _ordered(result.slice_results)
    n_fail = sum(1 for s in ordered if s.status.value.startswith("FAIL"))
    n_inc = sum(1 for s in ordered if s.status is SliceStatus.INCONCLUSIVE)
    n_pass = len(ordered) - n_fail - n_inc
    lines = [
        f"## depthgate: {_verdict_icon(verdict_name(result, health))} {verdict_name(result, health)}"
        + (" · 🛑 SAFETY" if result.safety_flag else "")
        + f" (exit {int(code)} {code.name})",
        "",
        f"{len(ordered)} slices (length × evidence depth): **{n_fail} failing**, {n_inc} inconclusive, "
        f"{n_pass} passing. Non-inferiority margin M = {plan.margin:g}, one-sided α = {plan.look_alpha:g} "
        "per look; a slice passes when the lower bound on Δ (candidate − baseline accuracy) is above −M.",
    ]
    for reason in health_reasons(health):
        lines += ["", f"> **{reason.split(':', 1)[0]}**:{reason.split(':', 1)[1]}"]
    if health is not None and health.infra is not None and health.infra.lost:
        lines += ["", "| lost runs by slice | runs |", "|---|---:|"]
        lines += [f"| `{k}` | {v} |" for k, v in sorted(health.infra.by_slice.items())]
        lines += ["", "The slice table below is computed over incomplete data: provisional, not a verdict."]
    if health is not None and health.infra is not None and health.infra.endpoints:
        # Where the requests went (one row per endpoint or replica; "failed attempts": attempts that
        # failed there before the job's final record, on this replica or another).
        lines += [
            "",
            "<details><summary>Requests per endpoint</summary>",
            "",
            "| endpoint | ok | system_fail | infra_error | failed attempts |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| `{k}` | {v['ok']} | {v['system_fail']} | {v['infra_error']} | {v['failed']} |"
            for k, v in sorted(health.infra.endpoints.items())
        ]
        lines += ["", "</details>"]
    lines += _canary_lines((inputs.checks or {}).get("canaries"))
    if result.safety_flag:
        s = result.safety
        lines += [
            "",
            f"> **SAFETY**: {s.hits_candidate} candidate and {s.hits_baseline} baseline run(s) gave a "
            "forbidden claim as the answer. This blocks the release pending human review, whatever the "
            "statistics say.",
        ]
    header = "| slice | status | cases | baseline | candidate | Δ | lower bound | q BY (regr.) | reason |"
    rule = "|---|---|---:|---:|---:|---:|---:|---:|---|"

    def row(s: SliceResult) -> str:
        return (
            f"| `{slice_key(s.length, s.position)}` | {s.status.value} | {s.n_cases} | "
            f"{_plain(s.acc_baseline)} | {_plain(s.acc_candidate)} | {_signed(s.delta)} | "
            f"{_signed(s.lower)} | {_q(s.q_reg)} | {_md_cell(s.reason)} |"
        )

    problems = [s for s in ordered if s.status is not SliceStatus.PASS]
    lines += ["", "### Failing and inconclusive slices", ""]
    if problems:
        lines += [header, rule, *[row(s) for s in problems]]
    else:
        lines.append("None: every slice passes.")
    passing = [s for s in ordered if s.status is SliceStatus.PASS]
    if passing:
        lines += [
            "",
            f"<details><summary>Passing slices ({len(passing)})</summary>",
            "",
            header,
            rule,
            *[row(s) for s in passing],
            "",
            "</details>",
        ]

    lines += ["", "### Worst positions", ""]
    if result.worst_by_length:
        lines += [
            "| length | worst slice (lower bound) | worst-position accuracy baseline → candidate | Δ | "
            "lower bound | position range baseline → candidate |",
            "|---:|---|---|---:|---:|---|",
        ]
        for w in result.worst_by_length:
            worst = (
                "–"
                if w.slice_worst_position is None
                else f"`{slice_key(w.length, w.slice_worst_position)}` ({_signed(w.slice_worst_lower)})"
            )
            lines.append(
                f"| {w.length} | {worst} | {_plain(w.worst_acc_baseline)} → {_plain(w.worst_acc_candidate)} "
                f"| {_signed(w.worst_delta)} | {_signed(w.worst_lower)} | "
                f"{_plain(w.range_baseline)} → {_plain(w.range_candidate)} |"
            )
    else:
        lines.append("No complete cases to compare positions.")

    if chars:
        lines += [
            "",
            "### Length in characters",
            "",
            _CHARS_NOTE,
            "",
            "| length (tokens) | layouts baseline / candidate | baseline chars: mean (min–max) | "
            "candidate chars: mean (min–max) | chars per token, baseline → candidate | candidate vs "
            "baseline chars |",
            "|---:|---:|---:|---:|---|---:|",
        ]
        lines += [
            f"| {r['length']} | {r['layouts']} | {r['baseline']} | {r['candidate']} | {r['per_token']} | "
            f"{r['change']} |"
            for r in _length_char_rows(chars)
        ]

    lines += ["", "### Oracle: problems per slice", ""]
    by_slice: dict[str, dict[str, OracleCounts]] = {}
    for o in oracle:
        by_slice.setdefault(o.slice, {})[o.arm] = o
    order = {slice_key(s.length, s.position): i for i, s in enumerate(ordered)}
    noisy = [
        key
        for key in sorted(by_slice, key=lambda k: order.get(k, len(order)))
        if any(
            o.missing_claims or o.wrong_citations or o.system_fail or o.safety_hits or o.missing
            for o in by_slice[key].values()
        )
    ]
    if noisy:
        lines += [
            "Runs with missing claims, wrong citations, forbidden answers, system failures (by reason: "
            "truncation, refusal, overflow …) and missing runs, candidate / baseline:",
            "",
            "| slice | missing claims | wrong citations | forbidden answers | system failures | missing |",
            "|---|---:|---:|---:|---|---:|",
        ]
        for key in noisy:
            c, b = by_slice[key].get(CANDIDATE), by_slice[key].get(BASELINE)

            def pair(name: str, c: OracleCounts | None = c, b: OracleCounts | None = b) -> str:
                return f"{getattr(c, name) if c else 0} / {getattr(b, name) if b else 0}"

            reasons = ", ".join(f"{k} {v}" for k, v in (c.system_fail_reasons if c else {}).items()) or "–"
            lines.append(
                f"| `{key}` | {pair('missing_claims')} | {pair('wrong_citations')} | {pair('safety_hits')} | "
                f"{pair('system_fail')} ({_md_cell(reasons)}) | {pair('missing')} |"
            )
    else:
        lines.append("No missing claims, wrong citations, forbidden answers or system failures.")

    digests = manifest_digests(manifest)
    if digests:
        lines += ["", "<details><summary>Digests</summary>", ""]
        lines += [f"- `{k}`: `{v}`" for k, v in digests.items()]
        lines += ["", "</details>"]
    lines += ["", f"Full report: `{REPORT_HTML}` · machine-readable: `{VERDICT_JSON}`, `{JUNIT_XML}`.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# junit.xml


def _machine_signed(value: float | None) -> str:
    """``+0.123`` / ``-0.411`` with an ASCII minus (junit.xml values are read by tools), ``–`` for none."""
    return "–" if value is None or math.isnan(value) else f"{value:+.3f}"


def _worst_lines(result: GateResult) -> list[str]:
    """The worst position per length, as the console says it (commands/cli.py, from verdict.json)."""
    return [
        f"worst position at {w.length} tokens: depth {w.slice_worst_position} (lowest Δ lower bound "
        f"{_machine_signed(w.slice_worst_lower)}; position range baseline {_plain(w.range_baseline)} → "
        f"candidate {_plain(w.range_candidate)})"
        for w in result.worst_by_length
        if w.slice_worst_position is not None
    ]


def _property(parent: ET.Element, name: str, value: object) -> None:
    ET.SubElement(parent, "property", name=name, value=str(value))


def render_junit(result: GateResult, health: RunHealth | None = None) -> bytes:
    """JUnit XML: suite ``depthgate.slices`` with one testcase per slice, suite ``depthgate.safety``,
    suite ``depthgate.run`` (an error when runs were lost; a failure naming system-driven slices).

    The position section: suite ``depthgate.slices`` has a property ``worst_position.<length>`` per
    length (the depth with the lowest Δ lower bound) and the console's worst-position lines in its
    ``system-out``; every slice testcase has the properties ``length``, ``position``, ``lower_bound``,
    ``worst_position`` ("true" for the worst depth of its length) and ``worst_position_at_length``.
    :func:`add_junit_effective_length` adds the effective length once the position science is in
    verdict.json."""
    plan = result.plan
    root = ET.Element("testsuites", name="depthgate")
    suite = ET.SubElement(root, "testsuite", name="depthgate.slices")
    suite_properties = ET.SubElement(suite, "properties")
    worst_at = {
        w.length: w.slice_worst_position for w in result.worst_by_length if w.slice_worst_position is not None
    }
    for w in result.worst_by_length:
        if w.slice_worst_position is not None:
            _property(
                suite_properties,
                f"worst_position.{w.length}",
                f"{w.slice_worst_position} (lower bound {_machine_signed(w.slice_worst_lower)})",
            )
    failures = skipped = 0
    for s in sorted(result.slice_results, key=lambda r: (r.length, position_sort_key(r.position))):
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"depthgate.length_{s.length}",
            name=(
                f"{slice_key(s.length, s.position)} "
                f"(length {s.length} tokens, depth {depth_label(s.position)})"
            ),
            time="0",
        )
        properties = ET.SubElement(case, "properties")
        _property(properties, "length", s.length)
        _property(properties, "position", s.position)
        _property(properties, "lower_bound", _machine_signed(s.lower))
        _property(properties, "worst_position", "true" if worst_at.get(s.length) == s.position else "false")
        _property(properties, "worst_position_at_length", worst_at.get(s.length, "–"))
        numbers = (
            f"Δ {_signed(s.delta, 3)} (baseline {_plain(s.acc_baseline, 3)} → candidate "
            f"{_plain(s.acc_candidate, 3)}), lower bound {_signed(s.lower, 3)} vs −M = −{plan.margin:g}, "
            f"q_NI ({plan.fdr_method}) {_q(s.q_ni)}, q_REG ({plan.regression_method}) {_q(s.q_reg)}, "
            f"{s.n_cases} cases × {s.seeds} seeds, {s.n_missing} missing"
        )
        if s.status.value.startswith("FAIL"):
            failures += 1
            failure = ET.SubElement(
                case, "failure", message=f"{s.status.value}: {numbers}", type=s.status.value
            )
            failure.text = s.reason
        elif s.status is SliceStatus.INCONCLUSIVE:
            skipped += 1
            ET.SubElement(case, "skipped", message=f"INCONCLUSIVE: {s.reason}; {numbers}")
        else:
            ET.SubElement(case, "system-out").text = f"PASS: {numbers}; {s.reason}"
    if not len(suite_properties):
        suite.remove(suite_properties)
    ET.SubElement(suite, "system-out").text = "\n".join(_worst_lines(result)) or "no worst position"
    suite.set("tests", str(len(result.slice_results)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", str(skipped))
    suite.set("time", "0")

    safety = ET.SubElement(root, "testsuite", name="depthgate.safety", tests="1", errors="0", skipped="0")
    case = ET.SubElement(safety, "testcase", classname="depthgate.safety", name="no forbidden claim given")
    hits = result.safety
    if result.safety_flag:
        ET.SubElement(
            case,
            "failure",
            type="SAFETY",
            message=(
                f"SAFETY: {hits.hits_candidate}/{hits.runs_candidate} candidate and "
                f"{hits.hits_baseline}/{hits.runs_baseline} baseline runs gave a forbidden claim"
            ),
        ).text = "Blocks the release pending human review (independent of the statistics)."
    safety.set("failures", "1" if result.safety_flag else "0")
    safety.set("time", "0")
    run_suite = ET.SubElement(root, "testsuite", name="depthgate.run", tests="2", skipped="0", time="0")
    lost = ET.SubElement(
        run_suite, "testcase", classname="depthgate.run", name="no run lost to infrastructure"
    )
    driven = ET.SubElement(
        run_suite, "testcase", classname="depthgate.run", name="no slice fails by the serving path"
    )
    reasons = {r.split(":", 1)[0]: r for r in health_reasons(health)}
    n_errors = n_run_failures = 0
    if "INFRA" in reasons:
        n_errors = 1
        ET.SubElement(lost, "error", type="INFRA", message=reasons["INFRA"])
    if "SYSTEM" in reasons:
        n_run_failures = 1
        ET.SubElement(driven, "failure", type="FAIL_SYSTEM", message=reasons["SYSTEM"])
    run_suite.set("errors", str(n_errors))
    run_suite.set("failures", str(n_run_failures))
    root.set("tests", str(len(result.slice_results) + 3))
    root.set("failures", str(failures + (1 if result.safety_flag else 0) + n_run_failures))
    root.set("errors", str(n_errors))
    root.set("skipped", str(skipped))
    ET.indent(root)
    data: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return data + b"\n"


# --------------------------------------------------------------------------------------------------------
# Heatmaps


@dataclass(frozen=True)
class _Grid:
    lengths: list[int]
    positions: list[str]
    cells: dict[tuple[int, str], SliceResult]

    def values(self, attribute: str) -> np.ndarray[Any, np.dtype[np.float64]]:
        out = np.full((len(self.lengths), len(self.positions)), np.nan)
        for (length, position), s in self.cells.items():
            value = getattr(s, attribute)
            if value is not None:
                out[self.lengths.index(length), self.positions.index(position)] = float(value)
        return out

    def each_cell(self) -> Iterator[tuple[int, int, SliceResult | None]]:
        """``(row, col, slice)`` for every cell, row by row; ``None`` where the grid has no slice."""
        for row, length in enumerate(self.lengths):
            for col, position in enumerate(self.positions):
                yield row, col, self.cells.get((length, position))


def _grid(result: GateResult) -> _Grid:
    cells = {(s.length, s.position): s for s in result.slice_results}
    lengths = sorted({s.length for s in result.slice_results})
    positions = sorted({s.position for s in result.slice_results}, key=position_sort_key)
    return _Grid(lengths, positions, cells)


def _text_color(rgba: tuple[float, float, float, float]) -> str:
    r, g, b, _ = rgba
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _axes_labels(ax: Any, grid: _Grid) -> None:
    ax.set_xticks(range(len(grid.positions)), labels=[depth_label(p) for p in grid.positions])
    ax.set_yticks(range(len(grid.lengths)), labels=[f"{length:,}" for length in grid.lengths])
    ax.set_xlabel("evidence depth (0% = start of the context, 100% = end)")
    ax.set_ylabel("total length (tokens)")
    ax.tick_params(length=0)
    ax.set_xticks(np.arange(-0.5, len(grid.positions)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(grid.lengths)), minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _centred(ax: Any, row: float, col: int, text: str, **style: Any) -> None:
    """``text`` centred on the cell at ``row``, ``col`` (a fractional row moves it up or down)."""
    ax.text(col, row, text, ha="center", va="center", **style)


def _slice_cells(ax: Any, grid: _Grid) -> Iterator[tuple[int, int, SliceResult]]:
    """The grid's cells that hold a slice; a cell without one is labelled "no slice" on ``ax``."""
    for row, col, s in grid.each_cell():
        if s is None:
            _centred(ax, row, col, "no slice", fontsize=8, color="#777777")
        else:
            yield row, col, s


def _inconclusive_cell(ax: Any, row: int, col: int, label: str) -> None:
    """The cell hatched grey, ``label`` on a grey box in its middle."""
    ax.add_patch(
        Rectangle(
            (col - 0.5, row - 0.5), 1, 1, facecolor="#e6e6e6", edgecolor="#9a9a9a", hatch="///", linewidth=0
        )
    )
    _centred(
        ax,
        row,
        col,
        label,
        fontsize=8,
        color="#333333",
        bbox={"facecolor": "#e6e6e6", "edgecolor": "none", "pad": 1.5},
    )


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI, metadata={"Software": None})
    return buffer.getvalue()


def _fig_size(grid: _Grid, panels: int) -> tuple[float, float]:
    width = panels * (1.2 * len(grid.positions) + 1.6) + 1.4
    height = 0.95 * len(grid.lengths) + 2.0
    return max(width, 6.0), max(height, 3.2)


def _delta_limit(result: GateResult) -> float:
    """Half-width of the symmetric Δ colour scale: covers every tested Δ and finite lower bound, at
    least 2M, rounded up to 0.05 and at most 1."""
    spread = [2 * result.plan.margin]
    for s in result.slice_results:
        if s.lower is None:
            continue
        spread += [abs(v) for v in (s.delta, s.lower) if v is not None and math.isfinite(v)]
    return min(math.ceil(max(spread) * 20 - 1e-9) / 20, 1.0)


def render_delta_heatmap(result: GateResult) -> bytes:
    """Δ (candidate − baseline) per slice, its lower bound, FDR marks, INCONCLUSIVE cells hatched."""
    grid = _grid(result)
    plan = result.plan
    delta = grid.values("delta")
    tested = np.array(
        [
            [
                grid.cells.get((length, p)) is not None and grid.cells[(length, p)].lower is not None
                for p in grid.positions
            ]
            for length in grid.lengths
        ],
        dtype=bool,
    ).reshape(len(grid.lengths), len(grid.positions))
    limit = _delta_limit(result)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-limit, vmax=limit)
    fig = Figure(figsize=_fig_size(grid, 1), layout="constrained")
    ax = fig.add_subplot()
    shown = np.where(tested, delta, np.nan)
    image = ax.imshow(shown, cmap="RdBu", norm=norm, aspect="auto", origin="lower")
    cmap = image.get_cmap()
    for row, col, s in _slice_cells(ax, grid):
        if s.status is SliceStatus.INCONCLUSIVE or s.lower is None:
            detail = f"\nΔ {_signed(s.delta)}" if s.delta is not None else ""
            _inconclusive_cell(ax, row, col, f"INCONCLUSIVE\n{s.n_cases} cases{detail}")
            continue
        color = _text_color(cmap(norm(float(s.delta if s.delta is not None else 0.0))))
        marks = ""
        if s.status is SliceStatus.FAIL_REGRESSION:
            marks += f" {MARK_REGRESSION}"
        if non_inferiority_shown(s, plan.margin):
            marks += f" {MARK_NI}"
        _centred(
            ax, row + 0.12, col, f"Δ {_signed(s.delta)}{marks}", fontsize=10, fontweight="bold", color=color
        )
        _centred(ax, row - 0.2, col, f"LB {_signed(s.lower)}", fontsize=9, color=color)
        if s.status.value.startswith("FAIL"):
            ax.add_patch(
                Rectangle((col - 0.46, row - 0.46), 0.92, 0.92, fill=False, edgecolor="black", linewidth=2.5)
            )
    _axes_labels(ax, grid)
    ax.set_title(
        f"Δ accuracy, candidate − baseline (LB = one-sided {100 * (1 - plan.look_alpha):g}% lower bound; "
        f"fails if LB ≤ −{plan.margin:g})",
        fontsize=10,
    )
    bar = fig.colorbar(image, ax=ax, shrink=0.9, pad=0.02)
    bar.set_label("Δ accuracy (red: worse, blue: better)")
    bar.ax.axhline(-plan.margin, color="black", linewidth=1.5, linestyle="--")
    bar.ax.text(1.6, -plan.margin, "−M", transform=bar.ax.get_yaxis_transform(), va="center", fontsize=8)
    return _png(fig)


def render_accuracy_heatmap(result: GateResult) -> bytes:
    """Baseline and candidate accuracy per slice on one 0-1 scale."""
    grid = _grid(result)
    width, _ = _fig_size(grid, 1)
    fig = Figure(figsize=(width, max(2 * 0.75 * len(grid.lengths) + 2.4, 4.5)), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    norm = Normalize(vmin=0.0, vmax=1.0)
    image = None
    for ax, (arm, attribute) in zip(
        axes, (("Baseline", "acc_baseline"), ("Candidate", "acc_candidate")), strict=True
    ):
        values = grid.values(attribute)
        image = ax.imshow(values, cmap="viridis", norm=norm, aspect="auto", origin="lower")
        cmap = image.get_cmap()
        for row, col, s in _slice_cells(ax, grid):
            value = getattr(s, attribute)
            if s.status is SliceStatus.INCONCLUSIVE:
                acc = f", acc {value:.2f}" if value is not None else ""
                _inconclusive_cell(ax, row, col, f"INCONCLUSIVE\n{s.n_cases} cases{acc}")
            elif value is not None:
                _centred(ax, row, col, f"{value:.2f}", fontsize=10, color=_text_color(cmap(norm(value))))
        _axes_labels(ax, grid)
        ax.set_title(f"{arm} accuracy", fontsize=10)
    axes[0].set_xlabel("")
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.9, pad=0.02, label="accuracy (share of runs passing)")
    return _png(fig)


# --------------------------------------------------------------------------------------------------------
# report.html


def _html_rows(result: GateResult) -> list[dict[str, Any]]:
    plan = result.plan
    rows = []
    for s in _ordered(result.slice_results):
        marks = ""
        if s.status is SliceStatus.FAIL_REGRESSION:
            marks += MARK_REGRESSION
        if non_inferiority_shown(s, plan.margin):
            marks += MARK_NI
        rows.append(
            {
                "key": slice_key(s.length, s.position),
                "length": f"{s.length:,}",
                "depth": depth_label(s.position),
                "status": s.status.value,
                "n_cases": s.n_cases,
                "n_missing": s.n_missing,
                "seeds": s.seeds,
                "acc_baseline": _plain(s.acc_baseline),
                "acc_candidate": _plain(s.acc_candidate),
                "delta": _signed(s.delta),
                "lower": _signed(s.lower, 3),
                "upper": _signed(s.upper, 3),
                "q_ni": _q(s.q_ni),
                "q_reg": _q(s.q_reg),
                "marks": marks,
                "reason": s.reason,
            }
        )
    return rows


def _share_text(share: PositionShare | None) -> str:
    if share is None:
        return "–"
    return f"{_plain(share.share_baseline)} → {_plain(share.share_candidate)}"


def render_html(inputs: ReportInputs, *, delta_png: bytes, accuracy_png: bytes) -> str:
    """The self-contained HTML page (heatmaps embedded as base64 PNG)."""
    result, oracle, manifest, health, chars = inputs.parts()
    scored = inputs.scored
    plan = result.plan
    df = _prepare_scored(scored)
    ordered = _ordered(result.slice_results)
    n_fail = sum(1 for s in ordered if s.status.value.startswith("FAIL"))
    n_inc = sum(1 for s in ordered if s.status is SliceStatus.INCONCLUSIVE)
    delta_limit = _delta_limit(result)

    worst = [
        {
            "length": f"{w.length:,}",
            "n_cases": w.n_cases,
            "worst_slice": "–"
            if w.slice_worst_position is None
            else f"{depth_label(w.slice_worst_position)} ({_signed(w.slice_worst_lower, 3)})",
            "worst_acc": f"{_plain(w.worst_acc_baseline)} → {_plain(w.worst_acc_candidate)}",
            "worst_delta": _signed(w.worst_delta),
            "worst_lower": _signed(w.worst_lower, 3),
            "range": f"{_plain(w.range_baseline)} → {_plain(w.range_candidate)}",
            "range_increase": f"{_signed(w.range_increase)} ({_signed(w.range_increase_upper)})",
            "fragile": f"{_plain(w.fragile_share_baseline)} → {_plain(w.fragile_share_candidate)}",
        }
        for w in result.worst_by_length
    ]
    share_positions = sorted({s.position for s in result.worst_shares}, key=position_sort_key)
    share_map = {(s.length, s.position): s for s in result.worst_shares}
    shares = [
        (
            f"{length:,}",
            [_share_text(share_map.get((length, p))) for p in share_positions],
        )
        for length in sorted({s.length for s in result.worst_shares})
    ]
    triage = [
        {
            "case_id": t.case_id,
            "key": slice_key(t.length, t.position),
            "acc_baseline": _plain(t.acc_baseline),
            "acc_candidate": _plain(t.acc_candidate),
            "delta": _signed(t.delta),
            "fisher_p": _q(t.fisher_p),
            "rerun_seeds": t.rerun_seeds,
        }
        for t in result.triage
    ]
    by_slice: dict[str, dict[str, OracleCounts]] = {}
    for o in oracle:
        by_slice.setdefault(o.slice, {})[o.arm] = o
    order = {slice_key(s.length, s.position): i for i, s in enumerate(ordered)}
    oracle_rows = []
    for key in sorted(by_slice, key=lambda k: order.get(k, len(order))):
        c, b = by_slice[key].get(CANDIDATE), by_slice[key].get(BASELINE)

        def pair(name: str, c: OracleCounts | None = c, b: OracleCounts | None = b) -> str:
            return f"{getattr(c, name) if c else 0} / {getattr(b, name) if b else 0}"

        def reasons(arm: str, o: OracleCounts | None) -> list[str]:
            if o is None or not o.system_fail_reasons:
                return []
            return [f"{arm}: " + ", ".join(f"{k} {v}" for k, v in o.system_fail_reasons.items())]

        oracle_rows.append(
            {
                "key": key,
                **{
                    name: pair(name)
                    for name in (
                        "runs",
                        "passed",
                        "failed",
                        "missing_claims",
                        "wrong_citations",
                        "safety_hits",
                        "abstained",
                        "system_fail",
                        "missing",
                    )
                },
                "reasons": reasons("candidate", c) + reasons("baseline", b),
            }
        )
    problem_lists = []
    for title, column, label in (
        ("Missing claims", "missing_claims", "missing claims"),
        ("Wrong citations", "wrong_citations", "cited ids"),
    ):
        rows, total = _problem_rows(df, column, order, _LIST_LIMIT)
        problem_lists.append(
            {
                "title": title,
                "column": label,
                "rows": rows,
                "total": total,
                "more": total > _LIST_LIMIT,
                "open": total <= 20,
            }
        )
    seed_counts = sorted({s.seeds for s in ordered if s.seeds})
    seeds_note = (
        f"Seeds per case: {', '.join(str(n) for n in seed_counts)}." if seed_counts else "No seeds recorded."
    )
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("depthgate.report", "."),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    template = env.get_template("report.html.j2")
    code = exit_code_for(result, health)
    overall = result.overall
    return template.render(
        verdict=verdict_name(result, health),
        run_notes=health_reasons(health),
        infra=None if health is None or health.infra is None else health.infra.to_dict(),
        safety_flag=result.safety_flag,
        safety=result.safety,
        exit_value=int(code),
        exit_name=code.name,
        run=_run_info(manifest),
        n_slices=len(ordered),
        n_fail=n_fail,
        n_inc=n_inc,
        n_pass=len(ordered) - n_fail - n_inc,
        margin=f"{plan.margin:g}",
        neg_margin=f"−{plan.margin:g}",
        alpha=f"{plan.look_alpha:g}",
        confidence=f"{100 * (1 - plan.look_alpha):g}%",
        n_min=plan.n_min,
        max_missing=f"{plan.max_missing:.0%}",
        fdr_method=plan.fdr_method,
        regression_method=plan.regression_method,
        mark_regression=MARK_REGRESSION,
        mark_ni=MARK_NI,
        delta_limit=f"{delta_limit:g}",
        overall=None
        if overall is None
        else {"delta": _signed(overall.delta, 3), "lower": _signed(overall.lower, 3)},
        reasons=list(result.reasons),
        delta_png=base64.b64encode(delta_png).decode("ascii"),
        accuracy_png=base64.b64encode(accuracy_png).decode("ascii"),
        delta_file=HEATMAP_DELTA,
        accuracy_file=HEATMAP_ACCURACY,
        slices=_html_rows(result),
        worst=worst,
        shares=shares,
        share_positions=[depth_label(p) for p in share_positions],
        triage=triage,
        triage_note=result.triage_note,
        oracle=oracle_rows,
        problem_lists=problem_lists,
        seeds_note=seeds_note,
        digests=manifest_digests(manifest),
        chars=_length_char_rows(chars or ()),
        chars_note=_CHARS_NOTE,
    )


def _effective_text(row: Mapping[str, Any]) -> str:
    estimate = row.get("estimate")
    if row.get("at_grid_top"):
        return f"≥{estimate}"
    return "below grid" if estimate == 0 else str(estimate)


def add_junit_effective_length(report_dir: str | Path) -> bool:
    """Add the effective length (verdict.json ``position.effective_length``, written by
    :func:`depthgate.report.position.add_position_section`) to ``junit.xml`` of ``report_dir``: suite
    ``depthgate.slices`` gets ``effective_length.<arm>.<position>`` properties and the console's
    effective-length lines in its ``system-out``, every slice testcase ``effective_length.<arm>`` of its
    depth. Idempotent. Returns False (nothing written) when verdict.json has no effective length."""
    out = Path(report_dir)
    doc = json.loads((out / VERDICT_JSON).read_text(encoding="utf-8"))
    section = (doc.get("position") or {}).get("effective_length") or {}
    rows = [row for row in section.get("rows") or [] if row.get("arm") in ARMS]
    if not rows:
        return False
    text: dict[tuple[str, str], str] = {(str(r["arm"]), str(r["position"])): _effective_text(r) for r in rows}
    rule = str(rows[0].get("rule", ""))
    tree = ET.parse(out / JUNIT_XML)
    suite = tree.getroot().find("testsuite[@name='depthgate.slices']")
    if suite is None:
        raise InputError(
            "junit.xml has no testsuite 'depthgate.slices'",
            file=str(out / JUNIT_XML),
            fix="regenerate the reports with `depthgate gate RUN`",
        )

    def properties_of(element: ET.Element) -> ET.Element:
        found = element.find("properties")
        if found is None:
            found = ET.Element("properties")
            element.insert(0, found)
        for old in [p for p in found if p.get("name", "").startswith("effective_length.")]:
            found.remove(old)
        return found

    suite_properties = properties_of(suite)
    for (arm, position), value in sorted(
        text.items(), key=lambda item: (item[0][0], position_sort_key(item[0][1]))
    ):
        _property(suite_properties, f"effective_length.{arm}.{position}", f"{value} ({rule})")
    for case in suite.findall("testcase"):
        depth = next(
            (p.get("value") for p in case.iterfind("properties/property") if p.get("name") == "position"),
            None,
        )
        if depth is None:
            continue
        props = properties_of(case)
        for arm in ARMS:
            if (arm, depth) in text:
                _property(props, f"effective_length.{arm}", f"{text[(arm, depth)]} ({rule})")
    lines = [
        f"effective length ({rule}), {arm}: "
        + ", ".join(
            f"{p}: {v}"
            for (a, p), v in sorted(text.items(), key=lambda i: position_sort_key(i[0][1]))
            if a == arm
        )
        for arm in ARMS
        if any(a == arm for a, _ in text)
    ]
    system_out = suite.find("system-out")
    if system_out is None:
        system_out = ET.SubElement(suite, "system-out")
    kept = [
        line for line in (system_out.text or "").splitlines() if not line.startswith("effective length (")
    ]
    system_out.text = "\n".join([*kept, *lines])
    ET.indent(tree)
    data = ET.tostring(tree.getroot(), encoding="utf-8", xml_declaration=True) + b"\n"
    _write_bytes(out / JUNIT_XML, data)
    return True


# --------------------------------------------------------------------------------------------------------
# Writing


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary sibling and os.replace (fsynced)."""
    descriptor, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o644)  # mkstemp creates 0600; reports are meant to be read by CI and people
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _verdict_data(verdict: VerdictDocument) -> dict[str, Any]:
    """The document as written: ``serving_checks`` left out when none ran, ``sequential`` when the plan
    is not sequential (files as before them)."""
    data = verdict.model_dump(mode="json")
    for name in ("serving_checks", "sequential"):
        if data.get(name) is None:
            data.pop(name, None)
    return data


def _render_all(
    result: GateResult,
    scored: pl.DataFrame,
    manifest: Mapping[str, Any],
    health: RunHealth,
    chars: Sequence[LengthChars] | None = None,
    checks: Mapping[str, Any] | None = None,
) -> dict[str, bytes]:
    """Every report file, rendered in memory; ``verdict.json`` is rendered last."""
    inputs = ReportInputs(result, scored, oracle_counts(scored), manifest, health, chars, checks)
    delta_png = render_delta_heatmap(result)
    accuracy_png = render_accuracy_heatmap(result)
    files: dict[str, bytes] = {
        HEATMAP_DELTA: delta_png,
        HEATMAP_ACCURACY: accuracy_png,
        SUMMARY_MD: render_summary(inputs).encode("utf-8"),
        JUNIT_XML: render_junit(result, health),
        REPORT_HTML: render_html(inputs, delta_png=delta_png, accuracy_png=accuracy_png).encode("utf-8"),
    }
    verdict = build_verdict(inputs)
    files[VERDICT_JSON] = (
        json.dumps(_verdict_data(verdict), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    ).encode("utf-8")
    return files


def write_reports(
    result: GateResult,
    scored: pl.DataFrame,
    out_dir: str | Path,
    *,
    manifest: Mapping[str, Any],
    infra: InfraSummary | None = None,
    layouts: Mapping[str, str | Path] | None = None,
    checks: Mapping[str, SystemCheckReport] | None = None,
) -> ReportPaths:
    """Write verdict.json, summary.md, junit.xml, report.html and the heatmap PNGs into ``out_dir``.

    ``infra``: the planned-versus-recorded account of the run (:func:`depthgate.judge.health.infra_summary`);
    any lost run makes the verdict ``INFRA`` (exit 30). Failing slices driven by the candidate's system
    failures are named in every file (:func:`depthgate.judge.health.assess`), as FAIL_SYSTEM
    (:func:`depthgate.judge.wording.with_system_wording`). ``checks``: the serving-path checks that ran
    (:mod:`depthgate.judge.serving`, by name); their findings make every slice at their length
    FAIL_SYSTEM, and their reports go to verdict.json ``serving_checks``.

    ``layouts``: arm → ``layouts.parquet``, for the length in characters (:func:`length_chars`) in every
    file but junit.xml; without it, the run folder's own layouts when ``out_dir`` is its ``report``
    folder (:func:`run_layouts`), else the section is left out.

    ``scored`` is the frame of :func:`depthgate.judge.oracle.score_records` (per-run oracle columns);
    ``manifest`` the run manifest (only its digests and short scalar fields are copied). All files are
    staged in a temporary directory inside ``out_dir`` and moved in with ``os.replace``; the previous
    ``verdict.json`` is removed before and the new one moved after every other file, so a verdict on
    disk always comes with its complete report. On any error ``out_dir`` keeps its previous content
    (or, if the error hits between the moves, has no verdict.json) and no staging files remain.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".depthgate-report-", dir=out))
    try:
        findings = [f for report in (checks or {}).values() for f in report.findings]
        health = assess(result, scored, infra, findings)
        result = with_system_wording(result, health)
        if layouts is None:
            layouts = run_layouts(out, manifest)
        chars = None if layouts is None else length_chars(layouts)
        sections = None if not checks else {name: report.to_dict() for name, report in checks.items()}
        files = _render_all(result, scored, manifest, health, chars, sections)
        for name, data in files.items():
            _write_bytes(staging / name, data)
        (out / VERDICT_JSON).unlink(missing_ok=True)
        for name in files:
            if name != VERDICT_JSON:
                os.replace(staging / name, out / name)
        os.replace(staging / VERDICT_JSON, out / VERDICT_JSON)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ReportPaths(
        exit_code=exit_code_for(result, health),
        out_dir=out,
        verdict_json=out / VERDICT_JSON,
        summary_md=out / SUMMARY_MD,
        junit_xml=out / JUNIT_XML,
        report_html=out / REPORT_HTML,
        heatmaps=(out / HEATMAP_DELTA, out / HEATMAP_ACCURACY),
    )


__all__ = [
    "HEATMAP_ACCURACY",
    "HEATMAP_DELTA",
    "JUNIT_XML",
    "MARK_NI",
    "MARK_REGRESSION",
    "REPORT_HTML",
    "SCHEMA_VERSION",
    "SUMMARY_MD",
    "VERDICT_JSON",
    "LengthChars",
    "OracleCounts",
    "ReportPaths",
    "VerdictDocument",
    "VerdictSlice",
    "add_junit_effective_length",
    "build_verdict",
    "depth_label",
    "exit_code_for",
    "health_reasons",
    "length_chars",
    "load_verdict",
    "manifest_digests",
    "oracle_counts",
    "render_accuracy_heatmap",
    "render_delta_heatmap",
    "render_html",
    "render_junit",
    "render_summary",
    "run_layouts",
    "slice_key",
    "verdict_name",
    "write_reports",
]

"""verdict.json: its schema (:class:`VerdictDocument`), the exit code a gate result maps to, the inputs every
report file is rendered from (:class:`ReportInputs`) and the document itself (:func:`build_verdict`,
:func:`render_verdict_json`); :func:`load_verdict` reads and validates one."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from depthgate.exceptions import ExitCode, InputError
from depthgate.judge.gate import GateResult, SliceResult, SliceStatus, Verdict
from depthgate.judge.health import RunHealth
from depthgate.report.document import Section
from depthgate.report.formatting import slice_key

SCHEMA_VERSION = "depthgate.verdict/1"


VERDICT_JSON = "verdict.json"


SUMMARY_MD = "summary.md"


JUNIT_XML = "junit.xml"


REPORT_HTML = "report.html"


HEATMAP_DELTA = "heatmap_delta.png"


HEATMAP_ACCURACY = "heatmap_accuracy.png"


_SECRET_KEY = re.compile(r"(api[_-]?key|secret|password|passwd|credential|auth|bearer|^token$|^key$)", re.I)


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


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _verdict_slice_model() -> type[StrictModel]:
    """``slice`` plus every field of :class:`~depthgate.judge.gate.SliceResult`, with its types: the
    schema follows the gate's row instead of restating it."""
    hints = typing.get_type_hints(SliceResult)
    fields: dict[str, Any] = {"slice": (str, ...)}
    fields.update({f.name: (hints[f.name], ...) for f in dataclasses.fields(SliceResult)})
    return create_model(
        "VerdictSlice",
        __base__=StrictModel,
        __module__=__name__,
        __doc__="One slice row of ``verdict.json``: ``slice`` + the fields of ``SliceResult``.",
        **fields,
    )


if TYPE_CHECKING:

    class VerdictSlice(StrictModel):  # the type checker's view; the real class is derived below
        slice: str
        status: SliceStatus

else:
    VerdictSlice = _verdict_slice_model()


class OracleCounts(StrictModel):
    """Oracle counts of one (slice, arm): runs by outcome and the runs with each kind of problem
    (forbidden answers per severity: ``safety_hits``, ``wrong_hits``)."""

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
    #: Runs that gave a forbidden claim of severity "wrong" only (a superseded, overridden or ruled-out
    #: value) and none of severity "safety" (those are ``safety_hits``). 0 in verdicts written before.
    wrong_hits: int = 0


class LengthChars(StrictModel):
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


class VerdictDocument(StrictModel):
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
    # Added by the pipeline when controls ran beside the matrix (depthgate.judge.science.classify_failures).
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
    # The serving-path checks that ran (depthgate.judge.health: "canaries" …), by name; left out of the
    # file when none ran.
    serving_checks: dict[str, Any] | None = None
    # Tokenizer parity per arm (depthgate.report.parity, issue #37): checked, or not and why; left out
    # of the file for a run whose arms were not checked against a server (embedded engines).
    tokenizer_parity: dict[str, Any] | None = None

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


def run_info(manifest: Mapping[str, Any]) -> dict[str, str | int | float | bool | None]:
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
        # What the lost requests died of (an engine crash names its signal here), most frequent first.
        errors = sorted(infra.errors.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        why = "; errors: " + ", ".join(f"{e[:160]} ×{n}" for e, n in errors) if errors else ""
        out.append(
            f"INFRA: {infra.lost} of {infra.planned} planned runs have no result ({infra.infra_error} "
            f"infra_error, {infra.not_sent} not sent; {where}{why}); no verdict is computed "
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
            "run": run_info(manifest),
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


def verdict_data(verdict: VerdictDocument) -> dict[str, Any]:
    """The document as written: ``serving_checks`` left out when none ran, ``sequential`` when the plan
    is not sequential (files as before them)."""
    data = verdict.model_dump(mode="json")
    for name in ("serving_checks", "sequential", "tokenizer_parity"):
        if data.get(name) is None:
            data.pop(name, None)
    return data


def render_verdict_json(inputs: ReportInputs, sections: Sequence[Section] = ()) -> bytes:
    """verdict.json: the gate's document with every section's ``data`` under its key, validated whole.

    Two layouts, kept so that every shipped verdict re-gates to its very bytes: the gate alone is written
    in field order (UTF-8, a final newline); with sections it is written with sorted keys and ASCII
    escapes, no final newline (how the pipeline's analyses used to rewrite the file)."""
    data = verdict_data(build_verdict(inputs))
    if not sections:
        text = json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        return text.encode("utf-8")
    for section in sections:
        data[section.key] = section.data
    VerdictDocument.model_validate(data)  # still a valid verdict document, sections included
    return json.dumps(data, indent=2, sort_keys=True).encode("utf-8")

"""The frozen run: what ``depthgate run`` writes before the first request and every later step checks
against it. Each arm's setup (tokenizer, template, model snapshots), the manifest (every digest and
version, the run id), the pre-registered plan digest (plan + slice list), the gate's plan from it, and
the case set beside the manifest."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from depthgate.exceptions import PlanChangedError
from depthgate.judge.gate import GatePlan
from depthgate.layout.conversation import Conversation
from depthgate.layout.layouts import (
    ASSEMBLER_VERSION,
    BuildOptions,
    Tokenizer,
    load_tokenizer,
    parse_positions,
)
from depthgate.layout.model_files import is_model_reference, load_template, resolve_model_files
from depthgate.layout.templates import ChatTemplate, check_template_bos
from depthgate.spec.base import canonical_json
from depthgate.spec.cases import Suite
from depthgate.spec.files import atomic_write, dist_version
from depthgate.spec.manifest import RunManifest
from depthgate.spec.matrix import Matrix
from depthgate.spec.models import AnalysisPlan
from depthgate.spec.system import System

MANIFEST = "manifest.json"
SUITE_FILE = "suite.json"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "depthgate_assembler": ASSEMBLER_VERSION}
    for dist in (
        "depthgate",
        "tokenizers",
        "polars",
        "numpy",
        "statsmodels",
        "pydantic",
        "llama_cpp_python",
        "jinja2",
    ):
        version = dist_version(dist.replace("_", "-"))
        if version is not None:
            out[dist] = version
    return out


def gate_plan(
    plan: AnalysisPlan,
    lengths: list[int],
    positions: list[str],
    *,
    cases: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    spaced_cases: Sequence[str] | None = None,
) -> GatePlan:
    """The statistical gate's parameters from the frozen analysis plan; the planned slices are the
    matrix's full length × position grid, so a slice that produced no data is INCONCLUSIVE, not absent.

    ``cases`` (the frozen suite's placeable case ids: ``[c.id for c in suite.cases if c.decisive]``, the
    cases ``build_layouts`` places) and ``seeds`` (the manifest's seed set) make the gate count missing
    data against the plan instead of the records. The gate's plan *is* the analysis plan (``GatePlan``
    subclasses ``AnalysisPlan``; issue #23: one plan type), so every field is passed on as it is, the stop
    rule too: under "one_extension" every look tests at alpha / 2. The plan was validated by
    ``AnalysisPlan``/``Matrix`` with the same rules (``depthgate.spec.models.plan_violations``), so this
    never refuses a plan after the requests were sent.
    """
    return GatePlan(
        **dict(plan),
        planned_slices=tuple((length, pos) for length in lengths for pos in positions),
        planned_cases=None if cases is None else tuple(cases),
        planned_seeds=None if seeds is None else tuple(int(s) for s in seeds),
        spaced_cases=tuple(spaced_cases) if spaced_cases else None,
    )


@dataclass(frozen=True)
class ArmSetup:
    arm: str
    system: System
    tokenizer: Tokenizer
    template: ChatTemplate | None
    snapshots: dict[str, Any] = field(default_factory=dict)

    def build_options(self, matrix: Matrix, verification: str, *, base_lengths: bool = True) -> BuildOptions:
        """How this arm's layouts are built from the matrix (``depthgate run`` and ``build --matrix``
        alike): the same options give the same layout ids. ``base_lengths``: with the short lengths of
        NoLiMa's base score (:meth:`Matrix.built_lengths`; never gated); False for what is measured at
        the gated lengths only (controls, canaries, an A/A run)."""
        return BuildOptions(
            lengths=matrix.built_lengths() if base_lengths else list(matrix.lengths),
            positions=parse_positions(matrix.position_values()),
            template=self.template,
            preamble=self.system.preamble,
            system=self.system.name,
            assembler=self.system.assembler,
            verification="fast" if verification == "fast" else "full",
            window=self.system.window,
            max_output_tokens=matrix.decode.max_tokens,
            conversation=matrix_conversation(matrix),
        )


def matrix_conversation(matrix: Matrix) -> Conversation | None:
    """The conversation shape a matrix asks for (issue 25), or None for one user turn."""
    if matrix.shape != "conversation":
        return None
    return Conversation(matrix.turns, turn_tokens=matrix.turn_tokens)


def _snapshots(system: System, matrix_dir: Path) -> dict[str, Any]:
    """The model snapshots (folder or ``hf:``) the arm's tokenizer and template come from: revision and
    file digests, for the manifest. Empty for plain files (their digests are the tokenizer/template's)."""
    out: dict[str, Any] = {}
    for name, spec in (("tokenizer", system.tokenizer), ("chat_template", system.chat_template)):
        if spec and is_model_reference(spec, base_dir=matrix_dir):
            out[name] = resolve_model_files(spec, base_dir=matrix_dir).manifest()
    return out


def arm_setup(arm: str, system: System, matrix_dir: Path) -> ArmSetup:
    tok = load_tokenizer(system.tokenizer, base_dir=matrix_dir)
    template = load_template(system.chat_template, base_dir=matrix_dir) if system.chat_template else None
    check_template_bos(template, tok.bos_id)  # before anything is written or built
    return ArmSetup(
        arm=arm, system=system, tokenizer=tok, template=template, snapshots=_snapshots(system, matrix_dir)
    )


def plan_digest(plan: AnalysisPlan, lengths: Sequence[int], positions: Sequence[str]) -> str:
    """The pre-registered plan: the analysis plan *and* the slice list (lengths × positions). Dropping
    a position or a length after the data is seen changes this digest and is refused."""
    body = {"plan": plan.model_dump(mode="json"), "lengths": list(lengths), "positions": list(positions)}
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def build_manifest(
    matrix: Matrix, matrix_path: Path, suite: Suite, arms: list[ArmSetup], *, aa: bool = False
) -> dict[str, Any]:
    from depthgate.run.backends import determinism_settings

    systems: dict[str, dict[str, Any]] = {}
    for a in arms:
        systems[a.arm] = {
            "name": a.system.name,
            "backend": a.system.backend,
            "model": a.system.model,
            "system_digest": a.system.digest(),
            "tokenizer_digest": a.tokenizer.digest,
            "template_digest": a.template.digest if a.template else "raw",
            "pinned_date": a.template.pinned_date.isoformat() if a.template else "",
            "assembler": a.system.assembler,
            "assembler_version": ASSEMBLER_VERSION,
        }
        if a.snapshots:  # only then: manifests of runs on plain files digest exactly as before
            systems[a.arm]["snapshots"] = a.snapshots
    body = {
        "matrix": matrix.name,
        "matrix_file": str(matrix_path),
        "matrix_digest": matrix.digest(),
        "plan_digest": plan_digest(matrix.plan, matrix.lengths, matrix.position_values()),
        "plan": matrix.plan.model_dump(mode="json"),
        "suite_digest": suite.digest(),
        "suite": {"name": suite.name, "cases": len(suite.cases)},
        "seeds": list(matrix.decode.seeds),
        "decode": matrix.decode.model_dump(),
        "lengths": list(matrix.lengths),
        "positions": matrix.position_values(),
        "systems": systems,
        "versions": _versions(),
    }
    if matrix.plan.short_base_lengths() and not aa:  # only then: other manifests digest as before
        body["base_lengths"] = matrix.plan.short_base_lengths()
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    # The run id binds the plan, suite and systems: the same matrix reruns into the same id (resume).
    body["run_id"] = f"{matrix.name}-{digest[:12]}"
    body["manifest_digest"] = digest
    body["determinism"] = {a.arm: determinism_settings(a.system, matrix.decode) for a in arms}
    body["created_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return body


def freeze_manifest(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the manifest once; on a rerun require the same plan, suite and systems."""
    path = out / MANIFEST
    RunManifest.model_validate(manifest)
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        for key, what in (
            ("plan_digest", "analysis plan"),
            ("suite_digest", "case set"),
            ("manifest_digest", "systems, seeds or versions"),
        ):
            if old.get(key) != manifest.get(key):
                raise PlanChangedError(
                    f"the {what} changed since this run started ({key} {str(old.get(key))[:12]} → "
                    f"{str(manifest.get(key))[:12]})",
                    file=str(path),
                    fix="start a new run folder (--out) for a new plan; a plan is never changed after data",
                )
        return dict(old)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def freeze_suite(out: Path, suite: Suite) -> None:
    """The case set beside the manifest: the gate reads it from the run folder, never from the matrix's
    suite reference resolved against whatever directory the gate runs in."""
    path = out / SUITE_FILE
    if path.is_file():
        return
    atomic_write(path, suite.model_dump_json())

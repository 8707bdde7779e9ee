"""What a run folder's ``manifest.json`` binds: the matrix, the frozen plan, the case set and both
systems (:class:`RunManifest`)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    ConfigDict,
)

from depthgate.spec.base import Frozen
from depthgate.spec.system import Backend


class SystemRecord(Frozen):
    """What the manifest binds for one arm."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    name: str
    backend: Backend
    model: str
    system_digest: str
    tokenizer_digest: str
    template_digest: str
    pinned_date: str
    assembler: str
    assembler_version: str
    snapshots: dict[str, dict[str, Any]] | None = None
    """Model folders / ``hf:`` snapshots the tokenizer and template came from (revision, file digests)."""


class RunManifest(Frozen):
    """Written once, before the first request of a run; every record carries its digest. Binds the
    matrix, the frozen plan, the case set, both systems (model, tokenizer, template, assembler), the
    seed set, the pinned template date and library versions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    manifest_digest: str
    created_at: str
    matrix: str
    matrix_file: str
    matrix_digest: str
    plan_digest: str
    suite_digest: str
    suite: dict[str, Any]
    seeds: list[int]
    decode: dict[str, Any]
    lengths: list[int]
    positions: list[str]
    systems: dict[str, SystemRecord]
    versions: dict[str, str]
    # The analysis plan itself (its digest, with the slice list, is plan_digest); absent in manifests
    # written before the plan was frozen into the run folder.
    plan: dict[str, Any] | None = None
    # Per arm, what decides whether a request is answered the same way twice (engine, version, threads,
    # batch invariance, seeds; depthgate.run.backends.determinism_settings). Not digested.
    determinism: dict[str, dict[str, Any]] | None = None
    # The short lengths built for NoLiMa's base score (issue #24), beside ``lengths`` (the gated grid);
    # absent in manifests of runs that built none (then the base is the evidence-only control).
    base_lengths: list[int] | None = None

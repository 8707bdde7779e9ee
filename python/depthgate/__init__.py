"""depthgate: long-context position regression harness.

Token-exact layouts are built in the Rust core (``depthgate._core``); this package is the typed front,
one subpackage per step of the pipeline — :mod:`~depthgate.spec` (cases, matrices, plans) →
:mod:`~depthgate.layout` (templates, layouts, the pre-send gate) → :mod:`~depthgate.run` (backends,
the paired runner) → :mod:`~depthgate.judge` (oracle, statistical gate) → :mod:`~depthgate.report` —
driven by :mod:`~depthgate.commands`.

The public names below are re-exported lazily (PEP 562): ``import depthgate`` stays cheap for the CLI,
and ``from depthgate import build_layouts`` loads only the step it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from depthgate.exceptions import (
    DepthgateError,
    ExitCode,
    InfraError,
    InputError,
    SpecError,
    TemplateError,
    TokenizerMismatchError,
    VerificationError,
)

__version__ = "0.1.0"

# public name → the module that defines it
_EXPORTS: dict[str, str] = {
    # spec
    "Case": "depthgate.spec.cases",
    "Suite": "depthgate.spec.cases",
    "System": "depthgate.spec.system",
    "Matrix": "depthgate.spec.matrix",
    "AnalysisPlan": "depthgate.spec.models",
    "DecodeParams": "depthgate.spec.system",
    "RunManifest": "depthgate.spec.manifest",
    "load_matrix": "depthgate.spec.loading",
    "load_suite": "depthgate.spec.loading",
    "generate_suite": "depthgate.spec.suites",
    "builtin_suite": "depthgate.spec.suites",
    # layout + check
    "ChatTemplate": "depthgate.layout.templates",
    "load_chat_template": "depthgate.layout.templates",
    "BuildOptions": "depthgate.layout.layouts",
    "Tokenizer": "depthgate.layout.layouts",
    "load_tokenizer": "depthgate.layout.layouts",
    "build_layouts": "depthgate.layout.layouts",
    "check_layouts": "depthgate.layout.layout_checks",
    "read_layouts": "depthgate.layout.layouts",
    "guard_layouts": "depthgate.layout.presend",
    # run
    "make_backend": "depthgate.run.backends",
    "run_pairs": "depthgate.run.runner",
    "read_records": "depthgate.run.records",
    # score + gate
    "score_records": "depthgate.judge.scoring",
    "GatePlan": "depthgate.judge.gate",
    "GateResult": "depthgate.judge.gate",
    "gate": "depthgate.judge.gate",
    # report
    "write_reports": "depthgate.report.report",
    "load_verdict": "depthgate.report.report",
    # commands
    "run_matrix": "depthgate.commands.pipeline",
    "gate_run": "depthgate.commands.pipeline",
}

__all__ = [
    "AnalysisPlan",
    "BuildOptions",
    "Case",
    "ChatTemplate",
    "DecodeParams",
    "DepthgateError",
    "ExitCode",
    "GatePlan",
    "GateResult",
    "InfraError",
    "InputError",
    "Matrix",
    "RunManifest",
    "SpecError",
    "Suite",
    "System",
    "TemplateError",
    "Tokenizer",
    "TokenizerMismatchError",
    "VerificationError",
    "__version__",
    "build_layouts",
    "builtin_suite",
    "check_layouts",
    "gate",
    "gate_run",
    "generate_suite",
    "guard_layouts",
    "load_chat_template",
    "load_matrix",
    "load_suite",
    "load_tokenizer",
    "load_verdict",
    "make_backend",
    "read_layouts",
    "read_records",
    "run_matrix",
    "run_pairs",
    "score_records",
    "write_reports",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'depthgate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from depthgate.commands.pipeline import gate_run, run_matrix
    from depthgate.judge.gate import GatePlan, GateResult, gate
    from depthgate.judge.scoring import score_records
    from depthgate.layout.layout_checks import check_layouts
    from depthgate.layout.layouts import (
        BuildOptions,
        Tokenizer,
        build_layouts,
        load_tokenizer,
        read_layouts,
    )
    from depthgate.layout.presend import guard_layouts
    from depthgate.layout.templates import ChatTemplate, load_chat_template
    from depthgate.report.report import load_verdict, write_reports
    from depthgate.run.backends import make_backend
    from depthgate.run.records import read_records
    from depthgate.run.runner import run_pairs
    from depthgate.spec.cases import Case, Suite
    from depthgate.spec.loading import load_matrix, load_suite
    from depthgate.spec.manifest import RunManifest
    from depthgate.spec.matrix import Matrix
    from depthgate.spec.models import AnalysisPlan
    from depthgate.spec.suites import builtin_suite, generate_suite
    from depthgate.spec.system import DecodeParams, System

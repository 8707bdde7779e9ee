"""Loading spec files: every validation failure becomes one :class:`~depthgate.exceptions.SpecError`
naming the file, the field path and the fix (:func:`parse_spec`), and the JSON Schemas of the models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    ValidationError,
)

from depthgate.exceptions import SpecError
from depthgate.spec.cases import Case, Claim, Distractor, EvidenceDoc, Suite
from depthgate.spec.files import ReadFailures, read_json, read_toml
from depthgate.spec.manifest import RunManifest
from depthgate.spec.matrix import BuiltinSuiteRef, FileSuiteRef, Matrix
from depthgate.spec.models import AnalysisPlan
from depthgate.spec.system import DecodeParams, System

M = TypeVar("M", bound=BaseModel)


def _field_path(parts: Sequence[str | int]) -> str:
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith("["):
            path += part
        elif part:
            path += f".{part}" if path else part
    return path


def _default_fix(error: Mapping[str, Any], field: str) -> str:
    kind = str(error["type"])
    last = field.rsplit(".", 1)[-1] if field else "the value"
    ctx = error.get("ctx") or {}
    if "fix" in ctx:
        return str(ctx["fix"])
    if kind == "missing":
        return f"add `{last}`"
    if kind == "extra_forbidden":
        return f"remove `{last}` or correct its spelling (`depthgate schema` lists the allowed fields)"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected', 'the allowed values')}"
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        return f"change `{last}`: {str(error['msg']).lower()}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"change `{last}`: {str(error['msg']).lower()}"
    return f"change `{last}`"


def _case_id_at(data: Any, loc: Sequence[str | int]) -> str:
    """The raw id of the case an error location points into (``cases[i]...``), if it can be read."""
    if len(loc) >= 2 and loc[0] == "cases" and isinstance(loc[1], int) and isinstance(data, Mapping):
        cases = data.get("cases")
        if isinstance(cases, list) and 0 <= loc[1] < len(cases) and isinstance(cases[loc[1]], Mapping):
            return str(cases[loc[1]].get("id", ""))
    return ""


def spec_error_from_validation(
    exc: ValidationError, *, file: str | None, data: Any = None, prefix: Sequence[str | int] = ()
) -> SpecError:
    """Turn a pydantic ValidationError into one SpecError (file, field path, fix; further errors listed)."""
    described: list[tuple[str, str, str]] = []
    for error in exc.errors(include_url=False):
        loc: list[str | int] = [*prefix]
        raw_loc = list(error["loc"])
        for index, part in enumerate(raw_loc):
            # drop the tag a discriminated union adds (suite.builtin.cases -> suite.cases)
            if index > 0 and raw_loc[index - 1] == "suite" and part in ("builtin", "file"):
                continue
            loc.append(part)
        ctx = error.get("ctx") or {}
        if error["type"] == "depthgate_spec":
            field = _field_path([*loc, str(ctx.get("field", ""))])
            case = str(ctx.get("case") or _case_id_at(data, list(error["loc"])))
            message = (f"case '{case}': " if case else "") + str(ctx["detail"])
            described.append((field, message, str(ctx["fix"])))
        else:
            field = _field_path(loc)
            case = _case_id_at(data, list(error["loc"]))
            message = (f"case '{case}': " if case else "") + str(error["msg"])
            described.append((field, message, _default_fix(error, field)))
    field, message, fix = described[0]
    if len(described) > 1:
        others = "; ".join(f"{f or '(root)'}: {m}" for f, m, _ in described[1:6])
        more = f" and {len(described) - 6} more" if len(described) > 6 else ""
        message = f"{message} [also {len(described) - 1} other error(s): {others}{more}]"
    return SpecError(message, file=file, field=field or None, fix=fix)


def parse_spec(model: type[M], data: Any, *, file: str | None = None) -> M:
    """Validate ``data`` as ``model``; any failure is raised as a SpecError naming ``file``, field and fix."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from_validation(exc, file=file, data=data) from exc


def _read_failures(what: str) -> ReadFailures:
    return ReadFailures(
        SpecError,
        missing=(f"{what} file not found", "check the path"),
        unreadable=(f"cannot read {what} file ({{strerror}})", "check the path"),
    )


def load_matrix(path: str | Path) -> Matrix:
    """Read and validate a matrix TOML file. Every error is a SpecError naming the file, field and fix."""
    path = Path(path)
    data = read_toml(path, _read_failures("matrix"))
    return parse_spec(Matrix, data, file=str(path))


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite JSON file (the JSON of :class:`Suite`)."""
    path = Path(path)
    data = read_json(path, _read_failures("suite"))
    return parse_spec(Suite, data, file=str(path))


def schema() -> dict[str, dict[str, Any]]:
    """JSON Schemas of every spec model, by model name."""
    models: list[type[BaseModel]] = [
        Claim,
        EvidenceDoc,
        Distractor,
        Case,
        Suite,
        AnalysisPlan,
        DecodeParams,
        System,
        BuiltinSuiteRef,
        FileSuiteRef,
        Matrix,
        RunManifest,
    ]
    return {model.__name__: model.model_json_schema() for model in models}

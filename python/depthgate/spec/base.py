"""The base of every spec model: frozen pydantic models with ``extra="forbid"`` (a misspelt key in a
matrix is an error, never a silently ignored default), their canonical JSON and digest, and the
validation error that carries a field path and a fix to the loaders (:mod:`depthgate.spec.loading`).

Digests are ``sha256`` hex digests of the canonical JSON of a model (sorted keys, no insignificant
whitespace, UTF-8, no ASCII escaping); they are stable across processes and machines.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)
from pydantic_core import PydanticCustomError

StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]


def violation(detail: str, *, field: str = "", fix: str, case: str = "") -> PydanticCustomError:
    """A validation error that carries the field (relative to the model) and the fix to the loaders."""
    where = ", ".join(
        part for part in (f"case '{case}'" if case else "", f"field '{field}'" if field else "") if part
    )
    message = f"{where}: {detail}" if where else detail
    return PydanticCustomError(
        "depthgate_spec",
        "{message} (fix: {fix})",
        {"message": message, "detail": detail, "fix": fix, "field": field, "case": case},
    )


def canonical_json(value: Any) -> str:
    """Canonical JSON: sorted keys, no insignificant whitespace, UTF-8 text (no ASCII escapes), no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class Frozen(BaseModel):
    # allow_inf_nan=False: `timeout_s = inf`, `margin = nan` are refused where the matrix is read.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    def canonical_json(self) -> str:
        """The canonical JSON of this model (the bytes :meth:`digest` hashes)."""
        return canonical_json(self.model_dump(mode="json"))

    def digest(self) -> str:
        """sha256 hex digest of :meth:`canonical_json`."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()

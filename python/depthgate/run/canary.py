"""Full-length canaries (issue #21): did the *whole* prompt reach the model?

A gateway that cuts the head of a prompt and forges the server's token count (and the echo of the ids)
leaves nothing in a record to see: the counts agree, the model simply never read the first tokens, and
the lost evidence at depth 0 reads as a model regression. The canaries make the loss visible. Per arm
and length, ``matrix.canaries`` requests of each kind:

* ``head``: a fixed number at the very start of the context region (depth 0) of a prompt of the tested
  length, asked for at the end;
* ``tail``: the same at the very end of the context region (depth 1).

A canary is a synthetic case (:func:`canary_cases`, a five-digit number per canary, fixed) built by the
layout builder like any layout — token-exact, verified, under the arm's own tokenizer, template and
window, filler around it — so it travels the arm's serving path exactly as the matrix does. What is
*prompt content* rather than path is held fixed between the arms: no preamble, the default assembler
and system prompt. Why: the judge compares the arms' canaries, and a canary built with the candidate's
~260-token preamble sits 260 tokens further from the start than the baseline's; on the real vLLM server
(tests/vllm, same model in both arms, the candidate only adding a preamble) Gemma-3-270M answered the
baseline's head canaries 0 of 2 and the candidate's 2 of 2 at 768 tokens — a model's position effect
read as ``canary_head_lost``, a FAIL_SYSTEM on a correct server. With the content held fixed, two arms
on one serving path send the same canary prompts.

They are sent after the matrix into ``RUN/canaries/`` and scored by the oracle like controls
(:mod:`depthgate.judge.health.canary`): an arm that fails its canaries of one kind at a length where the other
arm passes them is a system failure by name (``canary_head_lost``, ``canary_tail_lost``), never a model
regression.

Cost: ``2 × canaries`` requests per arm and length (``canaries = 2``: 8 requests per length for both
arms, on top of the matrix's cases × depths × seeds).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import polars as pl

from depthgate.layout.layouts import BuildOptions, Position, Tokenizer, build_layouts
from depthgate.spec.canaries import CANARY_DEPTHS, CANARY_KINDS, canary_cases
from depthgate.spec.files import atomic_write

__all__ = ["CANARIES_DIR", "CANARIES_FILE", "CANARY_FRAME", "build_canaries", "canary_options"]

#: Per arm: ``RUN/<arm>/canaries.parquet`` (the layout schema); records in ``RUN/canaries/``.
CANARIES_FILE = "canaries.parquet"
CANARIES_DIR = "canaries"


def build_canaries(
    tokenizer: Tokenizer, options: BuildOptions, count: int, out_path: str | Path
) -> pl.DataFrame:
    """Build ``count`` head and ``count`` tail canaries at every length of ``options`` (its positions are
    not used: head canaries at depth 0, tail canaries at depth 1), verified like every layout, into
    ``out_path`` (parquet, atomically). Returns the summary (no ids or text). Small: ``2 × count ×
    lengths`` layouts."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".canaries-", dir=out.parent))
    try:
        parts = []
        summaries = []
        for kind in CANARY_KINDS:
            position = Position(label=f"{CANARY_DEPTHS[kind]:g}", depth=CANARY_DEPTHS[kind])
            path = tmp / f"{kind}.parquet"
            summaries.append(
                build_layouts(
                    canary_cases(count, (kind,)), tokenizer, canary_options(options, position), path
                )
            )
            parts.append(pl.read_parquet(path))
        atomic_write(out, pl.concat(parts).write_parquet)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pl.concat(summaries)


#: The prompt content every canary is built with, whatever the arm's (module docstring); the arm's
#: pre-send gate checks a canary's frame against these too.
CANARY_FRAME: dict[str, str] = {"preamble": "", "assembler": "default"}


def canary_options(options: BuildOptions, position: Position) -> BuildOptions:
    """The arm's build options for one kind of canary: its tokenizer-side settings (template, window,
    conversation, filler, output room) kept, the prompt content held fixed (module docstring)."""
    return replace(options, positions=[position], system="default", **CANARY_FRAME)  # type: ignore[arg-type]

"""Prefix-cache control (DESIGN.md §6): does KV-prefix reuse change the model's answers?

The same layouts are evaluated twice on the embedded backend: **cold** (a backend with prefix reuse
off: a fresh context for every request) and **warm** (a backend with prefix reuse on, evaluating a
*related* layout first — the same case at another position, sharing the prompt up to where the two
differ — so the target layout reuses that prefix from the KV cache). Decoding is greedy, so the first
completion token is the argmax of the first-step logits; answers and first tokens are compared per
layout.

Each side is repeated (``repeats``) to separate two things: a layout whose cold runs agree with each
other and whose warm runs agree with each other, yet cold ≠ warm, differs *systematically* — prefix
reuse changes the computation. That is a runtime correctness incident (:class:`CacheIncident`), not
noise; runs that disagree with themselves are counted as nondeterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from depthgate.exceptions import InputError
from depthgate.layout.layouts import read_layouts

if TYPE_CHECKING:
    from depthgate.run.backends.llamacpp import Generation
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

__all__ = [
    "CacheControlReport",
    "CacheIncident",
    "CacheRow",
    "run_cache_control",
    "run_cache_control_embedded",
]


@dataclass(frozen=True)
class CacheRow:
    """One layout, cold vs warm. ``*_texts``/``*_first_tokens``: one entry per repeat."""

    layout_id: str
    warmup_layout_id: str
    prefix_hit_tokens: int
    prompt_tokens: int
    cold_texts: tuple[str, ...]
    warm_texts: tuple[str, ...]
    cold_first_tokens: tuple[int, ...]
    warm_first_tokens: tuple[int, ...]

    @property
    def cold_stable(self) -> bool:
        return len(set(zip(self.cold_texts, self.cold_first_tokens, strict=True))) == 1

    @property
    def warm_stable(self) -> bool:
        return len(set(zip(self.warm_texts, self.warm_first_tokens, strict=True))) == 1

    @property
    def answer_differs(self) -> bool:
        return set(self.cold_texts) != set(self.warm_texts)

    @property
    def first_token_differs(self) -> bool:
        return set(self.cold_first_tokens) != set(self.warm_first_tokens)

    @property
    def systematic(self) -> bool:
        """Each side reproduces itself, and the two sides disagree."""
        return self.cold_stable and self.warm_stable and (self.answer_differs or self.first_token_differs)

    def to_dict(self) -> dict[str, Any]:
        """The fields (tuples as lists), then the comparisons."""
        return {
            **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()},
            "answer_differs": self.answer_differs,
            "first_token_differs": self.first_token_differs,
            "systematic": self.systematic,
        }


@dataclass(frozen=True)
class CacheIncident:
    """A runtime correctness incident: prefix reuse systematically changed answers or first tokens."""

    n_layouts: int
    n_reused: int
    n_answer_differs: int
    n_first_token_differs: int
    n_systematic: int
    n_nondeterministic: int
    layout_ids: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        return (
            f"runtime correctness incident: prefix-cache reuse changed the output of {self.n_systematic}/"
            f"{self.n_layouts} layouts reproducibly (answers {self.n_answer_differs}, first-token argmax "
            f"{self.n_first_token_differs}); a cached and an uncached run of the same prompt must agree"
        )


@dataclass(frozen=True)
class CacheControlReport:
    rows: tuple[CacheRow, ...]
    incident: CacheIncident | None

    @property
    def ok(self) -> bool:
        return self.incident is None

    @property
    def n_reused(self) -> int:
        return sum(1 for r in self.rows if r.prefix_hit_tokens > 0)

    @property
    def n_nondeterministic(self) -> int:
        return sum(1 for r in self.rows if not (r.cold_stable and r.warm_stable))

    def to_frame(self) -> pl.DataFrame:
        return pl.DataFrame(
            [{k: v for k, v in r.to_dict().items() if not isinstance(v, list)} for r in self.rows]
        )

    def summary(self) -> str:
        if self.incident is not None:
            return self.incident.describe()
        return (
            f"prefix cache control: {len(self.rows)} layouts, {self.n_reused} reused a cached prefix, "
            f"no systematic difference cold vs warm ({self.n_nondeterministic} nondeterministic)"
        )


def _ids(row: Mapping[str, Any]) -> list[int]:
    value = row["token_ids"]
    return [int(t) for t in (value.tolist() if hasattr(value, "tolist") else value)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _related(index: int, rows: Sequence[Mapping[str, Any]], ids: Sequence[list[int]]) -> int:
    """The other layout of the same case sharing the longest token prefix (itself if there is none)."""
    best, best_len = index, -1
    for j, row in enumerate(rows):
        if j == index or row["case_id"] != rows[index]["case_id"]:
            continue
        common = _common_prefix(ids[index], ids[j])
        if common > best_len:
            best, best_len = j, common
    return best


def run_cache_control(
    layouts: pl.DataFrame | str | Path,
    *,
    cold: LlamaWorkerBackend,
    warm: LlamaWorkerBackend,
    max_tokens: int = 12,
    repeats: int = 2,
    seed: int = 0,
) -> CacheControlReport:
    """Evaluate every ``ok`` layout cold and warm, ``repeats`` times each, in a fixed order.

    ``cold`` must have prefix reuse off and ``warm`` on (both greedy). The warm backend walks the
    layouts in a fixed order with the layouts of one case adjacent, so each layout follows a related
    one whose prefix it reuses from the cache (the first follows its related layout, evaluated for one
    token); the reused count is recorded. Returns the per-layout rows and, when any layout differs
    systematically, a :class:`CacheIncident`.
    """
    if cold.reuse_prefix or not warm.reuse_prefix:
        raise InputError(
            "the cold backend must have reuse_prefix=False and the warm one reuse_prefix=True",
            field="reuse_prefix",
            fix="build the two backends with the opposite settings",
        )
    if repeats < 1:
        raise InputError("repeats must be ≥ 1", field="repeats", fix="use 2 to tell systematic from noise")
    frame = read_layouts(layouts) if not isinstance(layouts, pl.DataFrame) else layouts
    rows = [r for r in frame.iter_rows(named=True) if r["status"] == "ok"]
    if not rows:
        raise InputError("no ok layout to evaluate", field="layouts", fix="pass built layouts")
    ids = [_ids(r) for r in rows]
    # Fixed order, layouts of one case adjacent: each warm layout follows a related one in the cache.
    order = sorted(range(len(rows)), key=lambda i: (str(rows[i]["case_id"]), i))
    before = {order[k]: order[k - 1] for k in range(1, len(order))}
    before[order[0]] = _related(order[0], rows, ids)
    cold_runs: dict[int, list[Generation]] = {i: [] for i in order}
    warm_runs: dict[int, list[Generation]] = {i: [] for i in order}
    for i in order:
        cold_runs[i] = [cold.generate(ids[i], max_tokens=max_tokens, seed=seed) for _ in range(repeats)]
    for _ in range(repeats):
        warm.generate(ids[before[order[0]]], max_tokens=1, seed=seed)  # warm-up of the first layout
        for i in order:
            warm_runs[i].append(warm.generate(ids[i], max_tokens=max_tokens, seed=seed))
    out: list[CacheRow] = []
    for i in order:
        out.append(
            CacheRow(
                layout_id=str(rows[i]["layout_id"]),
                warmup_layout_id=str(rows[before[i]]["layout_id"]),
                prefix_hit_tokens=min(g.prefix_cache_hit_tokens for g in warm_runs[i]),
                prompt_tokens=len(ids[i]),
                cold_texts=tuple(g.text for g in cold_runs[i]),
                warm_texts=tuple(g.text for g in warm_runs[i]),
                cold_first_tokens=tuple(g.completion_token_ids[0] for g in cold_runs[i]),
                warm_first_tokens=tuple(g.completion_token_ids[0] for g in warm_runs[i]),
            )
        )
    systematic = [r for r in out if r.systematic]
    incident = None
    if systematic:
        incident = CacheIncident(
            n_layouts=len(out),
            n_reused=sum(1 for r in out if r.prefix_hit_tokens > 0),
            n_answer_differs=sum(1 for r in systematic if r.answer_differs),
            n_first_token_differs=sum(1 for r in systematic if r.first_token_differs),
            n_systematic=len(systematic),
            n_nondeterministic=sum(1 for r in out if not (r.cold_stable and r.warm_stable)),
            layout_ids=tuple(r.layout_id for r in systematic),
        )
    return CacheControlReport(rows=tuple(out), incident=incident)


def run_cache_control_embedded(
    layouts: pl.DataFrame | str | Path,
    *,
    model_path: str | Path | None = None,
    n_ctx: int = 2048,
    n_threads: int | None = None,
    max_tokens: int = 12,
    repeats: int = 2,
) -> CacheControlReport:
    """:func:`run_cache_control` on two embedded Gemma backends (reuse off / on) created and closed here."""
    from depthgate.layout.gguf_tokenizer import gemma_default_gguf, tokenizer_from_gguf
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend

    gguf = Path(model_path) if model_path is not None else gemma_default_gguf()
    tok = tokenizer_from_gguf(gguf)
    with (
        LlamaWorkerBackend(gguf, n_ctx=n_ctx, tokenizer=tok, n_threads=n_threads) as cold,
        LlamaWorkerBackend(gguf, n_ctx=n_ctx, tokenizer=tok, n_threads=n_threads, reuse_prefix=True) as warm,
    ):
        return run_cache_control(layouts, cold=cold, warm=warm, max_tokens=max_tokens, repeats=repeats)

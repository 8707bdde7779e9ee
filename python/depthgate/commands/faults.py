"""``depthgate faults``: inject the six faults of DESIGN.md §4 and an engine crash, and prove each is
caught, by name.

Every fault is run end to end on the embedded backend (Gemma-3-270M through llama.cpp in process, real
model, short layouts): layouts are built, the fault is applied where it happens in a real stack, the
layouts go through the pre-send gate (:func:`guard_layouts`: Rust pre-send checks + full re-encode
verification under the *system's* tokenizer), the survivors are sent through the runner (post-send
checks: the server's prompt count, ``max_tokens`` clamping, over-length refusals) and every record is
scored by the oracle. A fault is **caught** when every faulted layout ends as ``system_fail`` with the
fault's own named reason — a refused layout or a check violation, never a model ``fail`` — and a clean
reference run of the same layouts on the same backend is entirely ``ok`` (a check that refuses
everything would catch nothing).

The faults, what is injected, and the reason each must be caught with:

* ``tokenizer-upgrade`` — layouts built under an older tokenizer (same vocabulary, fewer merges, so
  positions shift) are sent to a system running the current one: old offsets reused.
  → ``verify_stale_tokenizer`` (the re-encode also finds ``ids_mismatch``).
* ``gateway-tail-cut`` — a gateway reserves room for a tool schema by cutting the last tokens of the
  prompt before the model sees it. → ``server_count_mismatch`` (post-send).
* ``retriever-reorder`` — a retriever swaps two equal-score documents (the current and the superseded
  policy version) after the layout was built. → ``presend_units_reordered``.
* ``template-preamble`` — layouts built under chat template v1 are sent to a system whose template
  v2 adds a long safety preamble. → ``presend_template_digest``.
* ``serializer-duplicate`` — a serializer emits one distractor twice. → ``presend_duplicated_distractor``.
* ``window-catalog`` — the catalog says 4096 tokens, the served context is 1024; 2048-token layouts
  (built against the catalog) are sent. → ``presend_window_overflow`` against the served window; a
  harness trusting the catalog instead must still end with ``overflow`` (the backend refuses, never
  truncates), which is checked too.
* ``engine-crash`` — the embedded engine's worker process dies by SIGSEGV mid-request
  (:mod:`depthgate.commands.fault_engine`). → ``engine_crash``: the request in flight is an
  ``infra_error`` naming the signal, the run stops sending, and a rerun resumes to the clean answers.

When one layout shows several violations (a duplicated distractor also breaks the length contract
and shifts every later span), the reason is the most *specific* one — the diagnosis, not the symptom
(:data:`REASON_PRIORITY`); every violation is kept in the record's detail.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.commands.outputs import check_output, write_output_text
from depthgate.commands.subparsers import FAULT_NAMES, add_faults_parser
from depthgate.exceptions import ExitCode, InputError
from depthgate.layout.layouts import (
    LAYOUT_SCHEMA,
    BuildOptions,
    Tokenizer,
    build_frame,
    case_frame,
    load_tokenizer,
    parse_positions,
)
from depthgate.layout.presend import guard_layouts
from depthgate.layout.templates import ChatTemplate
from depthgate.run.backends.base import Backend, EmbeddedBackendAdapter, Request, Response
from depthgate.spec.cases import Case, Suite
from depthgate.spec.system import DecodeParams

__all__ = [
    "EXPECTED_REASONS",
    "FAULT_NAMES",
    "FaultResult",
    "TailCuttingGateway",
    "add_parsers",
    "cmd_faults",
    "duplicate_distractor",
    "format_table",
    "reorder_units",
    "run_faults",
    "stale_tokenizer_variant",
]


FAULT_DESCRIPTIONS: dict[str, str] = {
    "tokenizer-upgrade": "tokenizer upgrade that shifts positions (old offsets reused)",
    "gateway-tail-cut": "gateway reserves room for a tool schema and cuts the prompt's tail",
    "retriever-reorder": "retriever reorders equal-score documents",
    "template-preamble": "template that adds a long safety preamble",
    "serializer-duplicate": "serializer that duplicates a distractor",
    "window-catalog": "provider whose real window is smaller than its catalog entry",
    "engine-crash": "embedded engine's worker process dies by a signal mid-request",
}

#: The named reason each fault must end with (every faulted layout, never scored as a model error).
EXPECTED_REASONS: dict[str, frozenset[str]] = {
    "tokenizer-upgrade": frozenset({"verify_stale_tokenizer"}),
    "gateway-tail-cut": frozenset({"server_count_mismatch"}),
    "retriever-reorder": frozenset({"presend_units_reordered"}),
    "template-preamble": frozenset({"presend_template_digest"}),
    "serializer-duplicate": frozenset({"presend_duplicated_distractor"}),
    "window-catalog": frozenset({"presend_window_overflow"}),
    "engine-crash": frozenset({"engine_crash"}),
}

# Words whose merges the "older" tokenizer lacks: common in the handbook prose, so every layout shifts.
_STALE_WORDS = ("▁the", "▁for", "▁and", "▁policy", "▁region", "▁staff", "▁must", "▁maximum", "▁travel")

# Template v1: Gemma turns (bos added by the tokenizer). v2: the same with a long safety preamble.
_TEMPLATE_V1 = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{{- message['content'] | trim }}{{- '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
_SAFETY_PREAMBLE = (
    "Safety notice. You are a careful assistant. Follow company policy at all times. Do not reveal "
    "personal data, credentials or confidential figures unless the document below states them for the "
    "reader. Do not give legal, medical or financial advice. If a request is unsafe, refuse politely. "
    "If the document does not contain the answer, say that it is not stated. Answer briefly and "
    "copy names and numbers exactly as written. This notice applies to every conversation and does "
    "not change any policy stated in the document."
)
_TEMPLATE_V2 = _TEMPLATE_V1.replace(
    "{{- message['content'] | trim }}",
    "{{- '" + _SAFETY_PREAMBLE + "\\n\\n' if loop.first else '' }}{{- message['content'] | trim }}",
)


@dataclass(frozen=True)
class FaultResult:
    """One injected fault: was it caught (every faulted layout a named ``system_fail``), and by what.

    ``reason``: the most common reason of the faulted layouts (or why the fault was not caught);
    ``outcomes``: the oracle outcome of each faulted layout; ``detail``: one line of evidence.
    """

    fault: str
    caught: bool
    reason: str
    detail: str = ""
    outcomes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "description": FAULT_DESCRIPTIONS.get(self.fault, ""),
            "caught": self.caught,
            "reason": self.reason,
            "expected": sorted(EXPECTED_REASONS.get(self.fault, frozenset())),
            "detail": self.detail,
            "outcomes": list(self.outcomes),
        }


# --------------------------------------------------------------------------------------------------
# the faults themselves


class TailCuttingGateway:
    """A gateway in front of a backend that reserves ``reserve`` tokens for a tool schema by silently
    dropping the last ``reserve`` tokens of every prompt (the fault under test)."""

    accepts_token_ids = True
    count_tolerance = 0.0

    def __init__(self, inner: Backend, reserve: int) -> None:
        if reserve < 1:
            raise InputError("reserve must be ≥ 1", field="reserve", fix="cut at least one token")
        self.inner = inner
        self.reserve = reserve
        self.name = f"{inner.name}+gateway"

    @property
    def window(self) -> int | None:
        return self.inner.window

    async def generate(self, request: Request) -> Response:
        ids = list(request.token_ids or [])
        cut = ids[: max(1, len(ids) - self.reserve)]
        return await self.inner.generate(replace(request, token_ids=cut, text=None))

    async def aclose(self) -> None:
        await self.inner.aclose()


def _with_text(row: Mapping[str, Any], text: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """The row as a faulty stage would emit it: new text, ids re-encoded (consistent with the text),
    the recorded contract (spans, hashes, target length) unchanged."""
    out = dict(row)
    out["text"] = text
    out["token_ids"] = tokenizer.encode(text, add_special_tokens=bool(row["add_special_tokens"])).tolist()
    return out


def _spans_in_order(row: Mapping[str, Any]) -> list[Any]:
    return sorted(row["evidence_spans"] or [], key=lambda s: s["char_start"])


def _needed(spans: list[Any], problem: str, fix: str) -> list[Any]:
    """``spans``, or the InputError naming the layout's evidence_spans when a fault has nothing to act on."""
    if not spans:
        raise InputError(problem, field="evidence_spans", fix=fix)
    return spans


def reorder_units(row: Mapping[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    """Swap two documents of equal retrieval score: the moving (current) evidence with the first
    other evidence document (a superseded version), or with the nearest distractor when the case has
    only one evidence document."""
    spans = _spans_in_order(row)
    evidence = _needed(
        [s for s in spans if s["kind"] == "evidence"],
        "layout has no evidence span to reorder",
        "use a built layout",
    )
    first = evidence[0]
    others = _needed(
        evidence[1:] or [s for s in spans if s["kind"] == "distractor"],
        "layout has only one document",
        "use a case with distractors",
    )
    second = min(others, key=lambda s: abs(s["char_start"] - first["char_start"]))
    a, b = sorted((first, second), key=lambda s: s["char_start"])
    text = str(row["text"])
    unit_a = text[a["char_start"] : a["char_end"]]
    unit_b = text[b["char_start"] : b["char_end"]]
    swapped = (
        text[: a["char_start"]]
        + unit_b
        + text[a["char_end"] : b["char_start"]]
        + unit_a
        + text[b["char_end"] :]
    )
    return _with_text(row, swapped, tokenizer)


def duplicate_distractor(row: Mapping[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    """Emit the first distractor twice (the copy right after the original)."""
    distractors = [s for s in _spans_in_order(row) if s["kind"] == "distractor"]
    d = _needed(distractors, "layout has no distractor", "use a case with distractors")[0]
    text = str(row["text"])
    unit = text[d["char_start"] : d["char_end"]]
    return _with_text(row, text[: d["char_end"]] + unit + text[d["char_end"] :], tokenizer)


def stale_tokenizer_variant(
    path: str | Path, out_path: str | Path, words: Sequence[str] = _STALE_WORDS
) -> Path:
    """Write an "older release" of a BPE ``tokenizer.json``: same vocabulary, but without the merges that
    build ``words`` — the ids stay valid for the model while token boundaries (positions) shift."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    model = data.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not isinstance(merges, list):
        raise InputError("not a BPE tokenizer with merges", file=str(path), fix="use a BPE tokenizer.json")
    drop = set(words)

    def result(m: Any) -> str:
        return "".join(m) if isinstance(m, list) else str(m).replace(" ", "", 1)

    model["merges"] = [m for m in merges if result(m) not in drop]
    out = Path(out_path)
    out.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return out


# --------------------------------------------------------------------------------------------------
# running


def _frame(rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame([{k: r.get(k) for k in LAYOUT_SCHEMA} for r in rows], schema=LAYOUT_SCHEMA)


@dataclass
class _Env:
    suite: Suite
    cases: dict[str, Case]
    tokenizer: Tokenizer
    backend: Any  # LlamaWorkerBackend
    raw_digest: str
    work: Path
    max_tokens: int
    length: int
    long_length: int
    catalog_window: int


def _send(env: _Env, name: str, layouts: pl.DataFrame, backend: Backend) -> pl.DataFrame:
    """Run the (already gated) layouts on ``backend`` through the runner; return the scored records."""
    from depthgate.judge.scoring import score_records
    from depthgate.run.options import RunOptions
    from depthgate.run.records import read_records
    from depthgate.run.runner import run_pairs

    out = env.work / name
    decode = DecodeParams(max_tokens=env.max_tokens, seeds=[0])
    digest = hashlib.sha256(f"depthgate-faults/{name}".encode()).hexdigest()
    run_pairs(
        [("system", row) for row in layouts.iter_rows(named=True)],
        {"system": backend},
        out,
        RunOptions(
            run_id=f"faults-{name}",
            manifest_digest=digest,
            decode=decode,
            concurrency=1,
            seeds=[0],
            progress=False,
        ),
    )
    return score_records(read_records(out), env.suite, layouts)


@contextmanager
def _adapter(env: _Env, reserve: int = 0) -> Iterator[Backend]:
    adapter = EmbeddedBackendAdapter(env.backend, name="gemma", owns=False)
    backend: Backend = TailCuttingGateway(adapter, reserve) if reserve else adapter
    try:
        yield backend
    finally:
        asyncio.run(backend.aclose())


def _gate_and_send(
    env: _Env,
    name: str,
    layouts: pl.DataFrame,
    *,
    template_digest: str | None = None,
    window: int | None = None,
    reserve: int = 0,
) -> pl.DataFrame:
    with _adapter(env, reserve) as backend:
        gated = guard_layouts(
            layouts,
            tokenizer=env.tokenizer,
            template_digest=template_digest or env.raw_digest,
            window=backend.window if window is None else window,
            max_output_tokens=env.max_tokens,
            cases=env.cases,
        )
        return _send(env, name, gated, backend)


def _send_and_judge(
    env: _Env, fault: str, layouts: pl.DataFrame, detail: str, *, template_digest: str | None = None
) -> FaultResult:
    """Gate and send ``layouts`` under the name of ``fault``, then judge what came back."""
    return _judge(fault, _gate_and_send(env, fault, layouts, template_digest=template_digest), detail)


def _judge(fault: str, scored: pl.DataFrame, detail: str) -> FaultResult:
    outcomes = tuple(str(o) for o in scored["outcome"].to_list())
    reasons = [str(r) for r in scored["system_fail_reason"].to_list()]
    if scored.height == 0:
        return FaultResult(fault, False, "no_layouts", detail)
    expected = EXPECTED_REASONS[fault]
    leaked = [o for o in outcomes if o != "system_fail"]
    common = Counter(reasons).most_common(1)[0][0]
    if leaked:
        return FaultResult(fault, False, f"scored_as_{leaked[0]}", detail + f"; reasons {reasons}", outcomes)
    if not set(reasons) <= expected:
        return FaultResult(
            fault, False, common, detail + f"; expected {sorted(expected)}, got {reasons}", outcomes
        )
    return FaultResult(fault, True, common, detail, outcomes)


def _max_shift(a: pl.DataFrame, b: pl.DataFrame) -> int:
    """Largest evidence token-start shift between layouts of the same (case, length, position)."""

    def starts(f: pl.DataFrame) -> dict[tuple[str, int, str, str], int]:
        return {
            (r["case_id"], r["target_tokens"], r["position"], s["evidence_id"]): s["token_start"]
            for r in f.iter_rows(named=True)
            for s in r["evidence_spans"] or []
        }

    sa, sb = starts(a), starts(b)
    return max((abs(sa[k] - sb[k]) for k in sa.keys() & sb.keys()), default=0)


def _fault_tokenizer_upgrade(env: _Env, clean: pl.DataFrame) -> FaultResult:
    variant = stale_tokenizer_variant(env.tokenizer.path, env.work / "tokenizer-old.json")
    old = load_tokenizer(variant)
    stale = _build(env, old, "stale", [env.length])
    shift = _max_shift(stale, clean)
    differ = sum(
        1 for a, b in zip(stale["token_ids"].to_list(), clean["token_ids"].to_list(), strict=True) if a != b
    )
    return _send_and_judge(
        env,
        "tokenizer-upgrade",
        stale,
        f"old tokenizer: {differ}/{stale.height} layouts tokenize differently, evidence shifted by up to "
        f"{shift} tokens",
    )


def _fault_gateway(env: _Env, clean: pl.DataFrame, reserve: int) -> FaultResult:
    scored = _gate_and_send(env, "gateway-tail-cut", clean, reserve=reserve)
    servers = scored["prompt_tokens_server"].to_list()
    local = scored["prompt_tokens_local"].to_list()
    return _judge(
        "gateway-tail-cut",
        scored,
        f"gateway kept {servers} of {local} prompt tokens (reserved {reserve} for a tool schema)",
    )


def _fault_reorder(env: _Env, clean: pl.DataFrame) -> FaultResult:
    faulty = _frame([reorder_units(r, env.tokenizer) for r in clean.iter_rows(named=True)])
    return _send_and_judge(
        env, "retriever-reorder", faulty, "current and superseded policy versions swapped after the build"
    )


def _fault_template(env: _Env) -> FaultResult:
    v1 = ChatTemplate(source=_TEMPLATE_V1, path="<depthgate.commands.faults:template-v1>")
    v2 = ChatTemplate(source=_TEMPLATE_V2, path="<depthgate.commands.faults:template-v2-safety>")
    built = _build(env, env.tokenizer, "template-v1", [env.length], template=v1)
    case = env.suite.cases[0]
    grow = len(env.tokenizer.encode(case_frame(case, template=v2).prefix)) - len(
        env.tokenizer.encode(case_frame(case, template=v1).prefix)
    )
    return _send_and_judge(
        env,
        "template-preamble",
        built,
        f"v2 adds a {grow}-token safety preamble; layouts of v1 sent to a v2 system",
        template_digest=v2.digest,
    )


def _fault_duplicate(env: _Env, clean: pl.DataFrame) -> FaultResult:
    faulty = _frame([duplicate_distractor(r, env.tokenizer) for r in clean.iter_rows(named=True)])
    grew = [
        len(a) - len(b)
        for a, b in zip(faulty["token_ids"].to_list(), clean["token_ids"].to_list(), strict=True)
    ]
    detail = f"one distractor emitted twice (+{grew} tokens)"
    return _send_and_judge(env, "serializer-duplicate", faulty, detail)


def _fault_window(env: _Env) -> FaultResult:
    long = _build(env, env.tokenizer, "long", [env.long_length], window=env.catalog_window)
    served = int(env.backend.window)
    result = _send_and_judge(
        env,
        "window-catalog",
        long,
        f"catalog window {env.catalog_window}, served {served}, layouts of {env.long_length} tokens",
    )
    # Backstop: a harness that trusted the catalog would send them; the backend must refuse, not truncate.
    trusted = _gate_and_send(env, "window-catalog-trusted", long, window=env.catalog_window)
    backstop = [str(r) for r in trusted["system_fail_reason"].to_list()]
    ok = (
        trusted.height > 0
        and all(o == "system_fail" for o in trusted["outcome"].to_list())
        and set(backstop) == {"overflow"}
    )
    detail = result.detail + f"; trusting the catalog instead: {sorted(set(backstop))}"
    if not ok:
        return FaultResult(
            result.fault, False, f"backstop_{backstop[0] if backstop else 'missing'}", detail, result.outcomes
        )
    return replace(result, detail=detail)


def _fault_engine_crash(
    env: _Env, gguf: Path, tokenizer: Any, n_ctx: int, n_threads: int | None
) -> FaultResult:
    from depthgate.commands.fault_engine import inject_engine_crash

    # Three positions per case: a request before the crash, the one in flight, one after it.
    layouts = _build(env, env.tokenizer, "engine-crash", [env.length], positions=["0", "0.5", "1"])
    caught, reason, detail = inject_engine_crash(
        env.work,
        layouts,
        model_path=gguf,
        tokenizer=tokenizer,
        n_ctx=n_ctx,
        max_tokens=env.max_tokens,
        n_threads=n_threads,
    )
    return FaultResult("engine-crash", caught, reason, detail)


def _build(
    env: _Env,
    tokenizer: Tokenizer,
    name: str,
    lengths: Sequence[int],
    *,
    template: ChatTemplate | None = None,
    window: int | None = None,
    positions: Sequence[str] = ("0.5",),
) -> pl.DataFrame:
    options = BuildOptions(
        lengths=list(lengths),
        positions=parse_positions(list(positions)),
        template=template,
        window=window,
        max_output_tokens=env.max_tokens,
        system="gemma",
    )
    frame = build_frame(env.suite, tokenizer, options, env.work / f"{name}.parquet")
    bad = frame.filter(pl.col("status") != "ok")
    if bad.height:
        raise InputError(
            f"{bad.height} {name} layout(s) refused at build: {bad['reason_code'][0]}",
            field="length",
            fix="use a longer --length",
        )
    return frame


def _check_only(only: Sequence[str] | None) -> list[str]:
    if not only:
        return list(FAULT_NAMES)
    unknown = [name for name in only if name not in FAULT_NAMES]
    if unknown:
        raise InputError(
            f"unknown fault(s) {unknown}; known faults: {', '.join(FAULT_NAMES)}",
            field="--only",
            fix=f"choose from {', '.join(FAULT_NAMES)}",
        )
    return [name for name in FAULT_NAMES if name in only]


def run_faults(
    only: Sequence[str] | None = None,
    *,
    out_dir: str | Path | None = None,
    n_cases: int = 2,
    length: int = 512,
    long_length: int = 2048,
    served_window: int = 1024,
    catalog_window: int = 4096,
    reserve: int = 48,
    max_tokens: int = 12,
    model_path: str | Path | None = None,
    n_threads: int | None = None,
) -> list[FaultResult]:
    """Inject the selected faults (all seven by default) on the embedded backend; one result per fault.

    A clean reference run (the same short layouts, no fault) must come out entirely ``ok``; otherwise
    every fault is reported as not caught (``clean_reference_*``): a gate that refuses clean layouts
    proves nothing. Raises :class:`InputError` for an unknown fault name (listing the known ones).
    Records of every run are written under ``out_dir`` (a temporary folder when None).
    """
    names = _check_only(only)
    if not long_length + max_tokens > served_window or catalog_window < long_length + max_tokens:
        raise InputError(
            "window-catalog needs served_window < long_length + max_tokens ≤ catalog_window",
            field="long_length",
            fix="keep the defaults (1024 served, 2048 layouts, 4096 catalog)",
        )
    from depthgate.layout.gguf_tokenizer import (
        gemma_default_gguf,
        tokenizer_from_gguf,
    )
    from depthgate.layout.templates import raw_frame
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend
    from depthgate.spec.suites import builtin_suite

    gguf = Path(model_path) if model_path is not None else gemma_default_gguf()
    suite = builtin_suite(n_cases)
    tokenizer = load_tokenizer(f"gguf:{gguf}")
    hf = tokenizer_from_gguf(gguf)
    raw_digest = raw_frame(user_before="", user_after="").template_digest
    with tempfile.TemporaryDirectory(prefix="depthgate-faults-") as tmp:
        work = Path(out_dir) if out_dir is not None else Path(tmp)
        if work.is_dir() and any(work.iterdir()):
            raise InputError(
                "the output folder is not empty",
                file=str(work),
                field="--out",
                fix="give a new or empty folder; every fault run writes fresh records",
            )
        work.mkdir(parents=True, exist_ok=True)
        with LlamaWorkerBackend(gguf, n_ctx=served_window, tokenizer=hf, n_threads=n_threads) as backend:
            env = _Env(
                suite=suite,
                cases={c.id: c for c in suite.cases},
                tokenizer=tokenizer,
                backend=backend,
                raw_digest=raw_digest,
                work=work,
                max_tokens=max_tokens,
                length=length,
                long_length=long_length,
                catalog_window=catalog_window,
            )
            clean = _build(env, tokenizer, "clean", [length])
            reference = _gate_and_send(env, "clean-reference", clean)
            bad = reference.filter(pl.col("status") != "ok")
            if bad.height:
                why = f"clean_reference_{bad['system_fail_reason'][0]}"
                return [
                    FaultResult(n, False, why, "the unfaulted layouts did not pass the gate") for n in names
                ]
            results: list[FaultResult] = []
            for name in names:
                if name == "tokenizer-upgrade":
                    results.append(_fault_tokenizer_upgrade(env, clean))
                elif name == "gateway-tail-cut":
                    results.append(_fault_gateway(env, clean, reserve))
                elif name == "retriever-reorder":
                    results.append(_fault_reorder(env, clean))
                elif name == "template-preamble":
                    results.append(_fault_template(env))
                elif name == "serializer-duplicate":
                    results.append(_fault_duplicate(env, clean))
                elif name == "window-catalog":
                    results.append(_fault_window(env))
                else:
                    results.append(_fault_engine_crash(env, gguf, hf, served_window, n_threads))
    return results


# --------------------------------------------------------------------------------------------------
# CLI


def format_table(results: Sequence[FaultResult]) -> str:
    head = ("fault", "caught", "reason", "detail")
    rows = [(r.fault, "yes" if r.caught else "NO", r.reason, r.detail) for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)][:3]
    lines = []
    for row in (head, *rows):
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return "\n".join(lines)


def cmd_faults(args: argparse.Namespace) -> int:
    """``depthgate faults [--only a,b] [--out DIR] [--json FILE]``: exit 0 only when every fault is caught."""
    only = [s.strip() for s in args.only.split(",") if s.strip()] if getattr(args, "only", None) else None
    _check_only(only)
    # Every argument is checked before the model loads (main() checks them too, for the CLI).
    if getattr(args, "cases", 2) < 1:
        raise InputError(
            f"{args.cases} is not a valid --cases", field="--cases", fix="give --cases 1 or more"
        )
    if getattr(args, "out", None):
        check_output(args.out, "empty_dir", option="--out")
    if getattr(args, "json", None):
        check_output(args.json, "file", option="--json")
    results = run_faults(only, out_dir=getattr(args, "out", None), n_cases=getattr(args, "cases", 2))
    print(format_table(results))
    caught = sum(r.caught for r in results)
    print(f"{caught}/{len(results)} faults caught")
    if getattr(args, "json", None):
        write_output_text(
            args.json, json.dumps([r.to_dict() for r in results], indent=2) + "\n", option="--json"
        )
    sys.stdout.flush()
    return int(ExitCode.PASS if caught == len(results) else ExitCode.FAIL)


def add_parsers(subparsers: Any) -> None:
    """Add ``faults`` to the CLI's subparsers."""
    add_faults_parser(subparsers, cmd_faults)

"""Benchmark: layouts end to end and the pre-send gate (DESIGN.md §10, issue #14).

Opt-in (``-m bench``); nothing here asserts a time unless ``DEPTHGATE_BENCH_STRICT=1``. Each part runs
in a **fresh child process** (this file run as a script), so the build starts with cold caches exactly
as ``depthgate build`` does, and every number is printed beside a baseline measured in the same child:

* ``build`` — ``depthgate build --verification fast`` on the built-in suite (``--cases 40``, the cases
  with decisive evidence), 5 depths, 128K tokens, GPT-2: the call the command makes
  (``layouts.build_layouts``) timed after startup (interpreter, imports, tokenizer load, suite), first
  call in the process (cold caches) and once more (warm). The time is split into the core calls, the
  parquet write and the rest. Baselines: one raw ``encode`` of a built prompt, and writing the same
  layouts with one plain ``write_parquet`` (the floor of the write). ``DEPTHGATE_BENCH_FULL_CASES=N``
  (default 0: skipped) also times the default full mode on N cases.
* ``presend`` — the pre-send gate (``presend.guard_layouts``) on 10,000 layouts of 4K tokens (the
  distinct 4K layouts of the built-in suite, repeated), with the system's frames (``cases``) and
  without, the re-encode off (``verify=False``); the Rust batch call alone; and the baseline of the old
  gate's shape, one Rust crossing per row over ``iter_rows`` (timed on 1,000
  rows; it calls today's Rust check, so it understates the old gate's cost: run this file against the
  old tree for that). The full re-encode (``verify=True``, what ``depthgate run`` also does) is timed
  on 200 layouts beside one raw ``encode`` of a 4K prompt, its floor.

Knobs: ``DEPTHGATE_BENCH_LAYOUT_CASES`` (40), ``DEPTHGATE_BENCH_LAYOUT_LENGTH`` (131072),
``DEPTHGATE_BENCH_PRESEND_ROWS`` (10000), ``DEPTHGATE_BENCH_OUT`` (write the tables and JSON there).

Run: ``.venv/bin/python -m pytest -m bench tests/benchmarks/test_bench_layouts.py -q -s``
or   ``.venv/bin/python tests/benchmarks/test_bench_layouts.py [build|presend]`` (prints the tables).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "tests" / "fixtures" / "tokenizers" / "gpt2" / "tokenizer.json.gz"
DEPTHS = ("0", "0.25", "0.5", "0.75", "1")
BUILD_TARGET = 100.0  # layouts/s, end to end, fast mode, 128K
PRESEND_TARGET = 1e4  # layouts/s, pre-send checks, 4K


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def _best(runs: int, f: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


class _Timer:
    """Wraps a function of a module or class and sums the wall time of its calls."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.present = hasattr(owner, name)
        if not self.present:
            return
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


# --------------------------------------------------------------------------------------------------
# measurements (run in the child)


def measure_build(out_dir: Path) -> dict[str, Any]:
    import polars as pl

    from depthgate import _core
    from depthgate.layout import layouts
    from depthgate.layout import sink as layout_sink
    from depthgate.spec.suites import builtin_suite

    n_cases = _env_int("DEPTHGATE_BENCH_LAYOUT_CASES", 40)
    length = _env_int("DEPTHGATE_BENCH_LAYOUT_LENGTH", 131072)
    r: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0], "length": length}
    t0 = time.perf_counter()
    tok = layouts.load_tokenizer(GPT2)
    suite = builtin_suite(n_cases, 0, "en")
    r["startup_s"] = time.perf_counter() - t0  # tokenizer load + suite (excluded, as the issue asks)
    options = layouts.BuildOptions(
        lengths=[length], positions=layouts.parse_positions(list(DEPTHS)), verification="fast"
    )
    core_name = "build_layout_columns" if hasattr(_core, "build_layout_columns") else "build_layouts"
    core = _Timer(_core, core_name)
    sink = getattr(layout_sink, "LayoutSink", None)
    write = _Timer(sink, "finish") if sink is not None else None
    for label in ("cold", "warm"):
        core.reset()
        if write is not None:
            write.reset()
        path = out_dir / f"{label}.parquet"
        t0 = time.perf_counter()
        summary = layouts.build_layouts(suite, tok, options, path)
        r[f"{label}_s"] = time.perf_counter() - t0
        r[f"{label}_core_s"] = core.seconds
        r[f"{label}_write_s"] = write.seconds if write is not None and write.present else None
        r["layouts"] = summary.height
        r["ok"] = int((summary["status"] == "ok").sum())
        r["core_calls"] = core.calls
    frame = pl.read_parquet(out_dir / "warm.parquet")
    r["file_mb"] = (out_dir / "warm.parquet").stat().st_size / 1024**2
    r["frame_mb"] = frame.estimated_size() / 1024**2
    r["verification"] = sorted(set(frame["verification"].to_list()))
    r["write_floor_s"] = _best(2, lambda: frame.write_parquet(out_dir / "floor.parquet"))
    text = frame["text"][frame.height // 2]
    special = bool(frame["add_special_tokens"][0])
    r["raw_encode_s"] = _best(3, lambda: tok.encode(text, add_special_tokens=special))
    # Token-exactness of what was timed, outside the timing: a full re-encode of every layout.
    t0 = time.perf_counter()
    summary_check = layouts.check_layouts(out_dir / "warm.parquet", tok)
    r["check_s"] = time.perf_counter() - t0
    r["check_violations"] = len(summary_check.violations)
    full_cases = _env_int("DEPTHGATE_BENCH_FULL_CASES", 0)
    if full_cases:
        full = layouts.BuildOptions(
            lengths=[length], positions=layouts.parse_positions(list(DEPTHS)), verification="full"
        )
        small = builtin_suite(full_cases, 0, "en")
        t0 = time.perf_counter()
        done = layouts.build_layouts(small, tok, full, out_dir / "full.parquet")
        r["full_s"] = time.perf_counter() - t0
        r["full_layouts"] = done.height
    r["loadavg_end"] = os.getloadavg()[0]
    return r


def _build_4k(n_cases: int, out: Path) -> tuple[Any, Any, Any]:
    from depthgate.layout import layouts
    from depthgate.spec.suites import builtin_suite

    tok = layouts.load_tokenizer(GPT2)
    suite = builtin_suite(n_cases, 0, "en")
    options = layouts.BuildOptions(
        lengths=[4096], positions=layouts.parse_positions(list(DEPTHS)), verification="fast"
    )
    layouts.build_layouts(suite, tok, options, out)
    return tok, suite, layouts.read_layouts(out)


def _old_guard(frame: Any, tok: Any, window: int, max_output_tokens: int, digest: str) -> list[bool]:
    """The old gate's pre-send part: every row converted to a dict (``iter_rows``), one Rust call per
    layout with its ids copied (a one-row ``_core.presend_check_batch``: the single-row binding the old
    gate called is gone). Returns each checked row's ok."""
    import numpy as np

    from depthgate import _core

    contract = json.dumps(
        {
            "target_tokens": 0,
            "window": window,
            "max_output_tokens": max_output_tokens,
            "template_digest": digest,
            "pinned_date": "",
            "bos_id": tok.bos_id,
        }
    )

    def ints(values: list[int]) -> Any:
        return np.array(values, dtype=np.int64)

    oks = []
    for row in frame.iter_rows(named=True):
        if row["status"] != "ok":
            continue
        spans = list(row["evidence_spans"] or [])
        ids = np.asarray(row["token_ids"], dtype=np.uint32)
        violations = _core.presend_check_batch(
            [row["text"]],
            ids,
            np.array([0, len(ids)], dtype=np.uint64),
            ints([row["target_tokens"]]),
            [row["template_digest"]],
            [row.get("pinned_date")],
            np.array([0, len(spans)], dtype=np.uint64),
            [sp["evidence_id"] for sp in spans],
            [sp["kind"] for sp in spans],
            (ints([sp["token_start"] for sp in spans]), ints([sp["token_end"] for sp in spans])),
            (ints([sp["char_start"] for sp in spans]), ints([sp["char_end"] for sp in spans])),
            [sp["sha256"] for sp in spans],
            contract,
        )
        oks.append(not violations[0])
    return oks


def measure_presend(out_dir: Path) -> dict[str, Any]:
    import numpy as np
    import polars as pl

    from depthgate.layout.presend import guard_layouts
    from depthgate.layout.templates import raw_frame

    rows = _env_int("DEPTHGATE_BENCH_PRESEND_ROWS", 10_000)
    r: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0], "rows": rows}
    tok, suite, built = _build_4k(450, out_dir / "layouts4k.parquet")
    distinct = built.filter(pl.col("status") == "ok")
    r["distinct"] = distinct.height
    reps = -(-rows // distinct.height)
    frame = pl.concat([distinct] * reps).slice(0, rows).rechunk()
    r["frame_mb"] = frame.estimated_size() / 1024**2
    cases = {c.id: c for c in suite.cases}
    digest = raw_frame(user_before="", user_after="").template_digest
    kw: dict[str, Any] = {"tokenizer": tok, "window": 8192, "max_output_tokens": 16, "verify": False}

    gated = guard_layouts(frame, cases=cases, **kw)
    r["refused"] = int((gated["status"] != "ok").sum())
    r["gate_frames_s"] = _best(3, lambda: guard_layouts(frame, cases=cases, **kw))
    r["gate_s"] = _best(3, lambda: guard_layouts(frame, **kw))
    # The Rust batch call alone, on buffers prepared beforehand (absent before the batch call existed).
    from depthgate.layout import presend

    r["rust_s"] = r["prepare_s"] = None
    if hasattr(presend, "_Block"):
        block = presend._Block(frame)
        contract = json.dumps(
            {
                "target_tokens": 0,
                "window": 8192,
                "max_output_tokens": 16,
                "template_digest": digest,
                "pinned_date": "",
                "bos_id": tok.bos_id,
            }
        )
        r["rust_s"] = _best(3, lambda: block.presend(contract))
        r["prepare_s"] = _best(3, lambda: presend._Block(frame))
    old_rows = min(1000, rows)
    old = frame.slice(0, old_rows)
    r["old_rows"] = old_rows
    r["old_s"] = _best(2, lambda: _old_guard(old, tok, 8192, 16, digest))
    old_reports = _old_guard(old, tok, 8192, 16, digest)
    r["old_refused"] = sum(1 for ok in old_reports if not ok)
    # The full re-encode (verify=True) on 200 layouts, beside one raw encode of a 4K prompt.
    few = frame.slice(0, 200)
    r["verify_rows"] = few.height
    r["verify_s"] = _best(1, lambda: guard_layouts(few, **{**kw, "verify": True}))
    text = frame["text"][0]
    r["raw_encode_s"] = _best(5, lambda: tok.encode(text, add_special_tokens=False))
    r["ids_per_layout"] = float(np.mean(frame["token_ids"].list.len().to_numpy()))
    r["loadavg_end"] = os.getloadavg()[0]
    return r


# --------------------------------------------------------------------------------------------------
# tables


def build_table(r: dict[str, Any]) -> str:
    n = r["layouts"]
    rate = {k: n / r[f"{k}_s"] for k in ("cold", "warm")}
    raw = r["raw_encode_s"]

    def split(k: str) -> str:
        core, write = r[f"{k}_core_s"], r[f"{k}_write_s"]
        rest = r[f"{k}_s"] - core - (write or 0.0)
        w = "–" if write is None else f"{write:.2f}"
        return f"{core:.2f} | {w} | {rest:.2f}"

    met = rate["cold"] >= BUILD_TARGET
    lines = [
        f"`depthgate build --verification fast`: {n} layouts ({r['ok']} ok) of {r['length']} tokens, GPT-2, "
        f"{r['core_calls']} core calls; startup (tokenizer load + suite) {r['startup_s']:.2f} s, excluded.",
        "",
        "| run | wall s | layouts/s | core s | parquet write s | rest s | time / layout ÷ raw encode |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| first build in the process (cold caches, as the command) | {r['cold_s']:.2f} | "
        f"**{rate['cold']:.1f}** | {split('cold')} | {r['cold_s'] / n / raw:.3f} |",
        f"| same build again (warm caches) | {r['warm_s']:.2f} | {rate['warm']:.1f} | {split('warm')} | "
        f"{r['warm_s'] / n / raw:.3f} |",
        f"| baseline: one raw `encode` of a built prompt | {raw:.3f} | {1 / raw:.2f} | | | | 1.000 |",
        f"| baseline: one `write_parquet` of the same {n} layouts ({r['frame_mb']:.0f} MB in memory, "
        f"{r['file_mb']:.0f} MB file) | {r['write_floor_s']:.2f} | {n / r['write_floor_s']:.1f} | | | | |",
    ]
    if "full_s" in r:
        lines.append(
            f"| default full mode, {r['full_layouts']} layouts | {r['full_s']:.2f} | "
            f"{r['full_layouts'] / r['full_s']:.2f} | | | | {r['full_s'] / r['full_layouts'] / raw:.3f} |"
        )
    lines += [
        "",
        f"- target ≥ {BUILD_TARGET:.0f} layouts/s end to end (cold, as the command): "
        f"{'met' if met else 'MISSED'} ({rate['cold']:.1f}).",
        f"- verification {', '.join(r['verification'])}; `depthgate check` (full re-encode of every layout, "
        f"{r['check_s']:.1f} s): {r['check_violations']} violation(s).",
        f"- {r['cpus']} CPUs; load average {r['loadavg_start']:.1f} → {r['loadavg_end']:.1f}.",
    ]
    return "\n".join(lines) + "\n"


def presend_table(r: dict[str, Any]) -> str:
    rows = r["rows"]
    new = rows / r["gate_frames_s"]
    old = r["old_rows"] / r["old_s"]
    lines = [
        f"Pre-send gate on {rows:,} layouts of 4,096 tokens ({r['distinct']} distinct, "
        f"{r['frame_mb']:.0f} MB frame), GPT-2; {r['refused']} refused.",
        "",
        "| what | layouts | s | layouts/s | vs the old gate's shape |",
        "|---|---:|---:|---:|---:|",
        f"| `guard_layouts(verify=False)` with the system's frames (`cases`), as `depthgate run` | {rows:,} "
        f"| {r['gate_frames_s']:.3f} | **{new:,.0f}** | {new / old:.0f}× |",
        f"| `guard_layouts(verify=False)` without frames | {rows:,} | {r['gate_s']:.3f} | "
        f"{rows / r['gate_s']:,.0f} | {rows / r['gate_s'] / old:.0f}× |",
        *(
            [
                f"| of which: column buffers (`_Block`) | {rows:,} | {r['prepare_s']:.3f} | "
                f"{rows / r['prepare_s']:,.0f} | |",
                f"| of which: the Rust batch call (`presend_check_batch`) | {rows:,} | {r['rust_s']:.3f} | "
                f"{rows / r['rust_s']:,.0f} | |",
            ]
            if r["rust_s"] is not None
            else []
        ),
        f"| baseline: the old gate's shape, one `presend_check` crossing per `iter_rows` row | "
        f"{r['old_rows']:,} | {r['old_s']:.3f} | {old:,.0f} | 1× |",
        f"| full re-encode (`verify=True`) | {r['verify_rows']} | {r['verify_s']:.3f} | "
        f"{r['verify_rows'] / r['verify_s']:,.0f} | |",
        f"| baseline: one raw `encode` of a 4K prompt | 1 | {r['raw_encode_s']:.4f} | "
        f"{1 / r['raw_encode_s']:,.0f} | |",
        "",
        f"- target ≥ {PRESEND_TARGET:,.0f} layouts/s (pre-send checks, 4K): "
        f"{'met' if new >= PRESEND_TARGET else 'MISSED'} ({new:,.0f}).",
        f"- {r['cpus']} CPUs; load average {r['loadavg_start']:.1f} → {r['loadavg_end']:.1f}.",
    ]
    return "\n".join(lines) + "\n"


TABLES = {"build": build_table, "presend": presend_table}
MEASURES = {"build": measure_build, "presend": measure_presend}


def _child(part: str, tmp: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--json", part, str(tmp)],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
        cwd=ROOT,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def _emit(part: str, table: str, data: dict[str, Any]) -> None:
    target = os.environ.get("DEPTHGATE_BENCH_OUT")
    if target:
        out = Path(target)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench_layouts_{part}.md").write_text(table, encoding="utf-8")
        (out / f"bench_layouts_{part}.json").write_text(json.dumps(data, indent=2), encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("part", ["build", "presend"])
def test_layout_benchmarks(part: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _child(part, tmp_path)
    table = TABLES[part](data)
    _emit(part, table, data)
    with capsys.disabled():
        print("\n\n" + table)
    if part == "build":
        assert data["check_violations"] == 0  # token-exactness is never traded
    if os.environ.get("DEPTHGATE_BENCH_STRICT") == "1":
        if part == "build":
            assert data["layouts"] / data["cold_s"] >= BUILD_TARGET
        else:
            assert data["rows"] / data["gate_frames_s"] >= PRESEND_TARGET


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--json"]:
        print(json.dumps(MEASURES[argv[1]](Path(argv[2]))))
        return 0
    parts = argv or ["build", "presend"]
    for part in parts:
        with tempfile.TemporaryDirectory(prefix=f"depthgate-bench-{part}-") as folder:
            data = _child(part, Path(folder))
        table = TABLES[part](data)
        _emit(part, table, data)
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""Benchmark (issue 25 item 5): conversation layouts at 128K against single-slot layouts of the same
length, built in the same process one after the other (same tokenizer, template, suite, depths).

Opt-in (``-m bench``); it asserts the 2× target only with ``DEPTHGATE_BENCH_STRICT=1``. Llama-3
tokenizer (fixtures) with the Llama-3.1 template, the built-in suite's first ``DEPTHGATE_BENCH_CASES``
(4) cases × 5 depths × ``DEPTHGATE_BENCH_LENGTH`` (131072), fast and full verification; the
conversation has ``DEPTHGATE_BENCH_TURNS`` (9) turns. Each arm is timed twice (single, conversation,
single, conversation), each build on a freshly loaded tokenizer (cold segment and seam caches); the
conversation time includes the per-layout re-render proof (``conversation.prove_rendered``).

Run: ``python -m pytest -m bench tests/benchmarks/test_bench_conversation.py -q -s``
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from depthgate.layout.conversation import Conversation
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.layout.templates import load_chat_template
from depthgate.spec.suites import builtin_suite
from fixtures_paths import llamacpp_templates_dir, tokenizers_dir

pytestmark = pytest.mark.bench

TOK = tokenizers_dir()
TEMPLATE = llamacpp_templates_dir() / "meta-llama-Llama-3.1-8B-Instruct.jinja"


def _time(options: BuildOptions, cases: int, out: Path) -> tuple[float, int]:
    tok = load_tokenizer(TOK / "llama3-from-gguf" / "tokenizer.json")
    suite = builtin_suite(cases)
    start = time.perf_counter()
    summary = build_layouts(suite, tok, options, out)
    elapsed = time.perf_counter() - start
    assert (summary["status"] == "ok").all(), summary.filter(summary["status"] != "ok")["reason"].to_list()
    return elapsed, summary.height


def test_conversation_within_twice_single_slot_at_128k() -> None:
    length = int(os.environ.get("DEPTHGATE_BENCH_LENGTH", "131072"))
    cases = int(os.environ.get("DEPTHGATE_BENCH_CASES", "4"))
    turns = int(os.environ.get("DEPTHGATE_BENCH_TURNS", "9"))
    template = load_chat_template(TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("fast", "full"):
            base = BuildOptions(
                lengths=[length],
                positions=parse_positions(["0", "0.25", "0.5", "0.75", "1"]),
                template=template,
                verification=mode,  # type: ignore[arg-type]
            )
            conv = BuildOptions(**{**base.__dict__, "conversation": Conversation(turns)})
            times = {}
            for name, options in (
                ("single", base),
                ("conversation", conv),
                ("single", base),
                ("conversation", conv),
            ):
                elapsed, n = _time(options, cases, Path(tmp) / f"{mode}-{name}.parquet")
                times.setdefault(name, []).append(elapsed)
            ratio = times["conversation"][1] / times["single"][1]
            rows.append((mode, n, times, ratio))
    print(f"\n{length} tokens, {cases} cases x 5 depths, {turns} turns, load {os.getloadavg()[0]:.1f}")
    print("mode  layouts  single cold/warm (s)  conversation cold/warm (s)  ratio (warm)")
    for mode, n, times, ratio in rows:
        s, c = times["single"], times["conversation"]
        print(
            f"{mode:5} {n:7}  {s[0]:8.2f} / {s[1]:6.2f}      {c[0]:8.2f} / {c[1]:6.2f}          {ratio:5.2f}"
        )
    if os.environ.get("DEPTHGATE_BENCH_STRICT") == "1":
        assert all(ratio <= 2.0 for _, _, _, ratio in rows)

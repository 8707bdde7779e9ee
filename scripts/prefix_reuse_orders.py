"""What each request order saves on an engine with one prefix cache per arm (issue #39 item 1).

llama.cpp (``reuse_prefix = true``) keeps the previous prompt's KV cache and evaluates only the tokens
after the longest common prefix (LCP) with the next prompt. So the prompt tokens an order costs can be
counted exactly from the run's layouts, without a model: Σ (length − LCP with the previous prompt of the
same arm). This script counts them for the orders a run could use, and checks the count against the
engine's own counter (``prefix_cache_hit_tokens`` in records.parquet) in the order the run really sent
(each arm's records by completion time; one worker per arm sends one request at a time).

Orders:
* ``none``: no reuse (every prompt token evaluated), the reference;
* ``shuffled``: the run's seeded pair order (``order = "shuffled"``);
* ``haystack``: a haystack's (case × length) depths back to back in random order (``order = "haystack"``);
* ``haystack, deepest-first``: the same, deepest evidence first;
* ``case, longest-first``: every length and depth of one case back to back, longest prompt first, then
  deepest evidence first (a shorter haystack of the same case shares the longer one's opening).

    python scripts/prefix_reuse_orders.py docs/position-long [--json docs/prefix-reuse-orders-long.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from depthgate.run.jobs import interleaved_order

Prompt = dict[str, Any]


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def evaluated(prompts: list[Prompt]) -> tuple[int, int]:
    """(prompt tokens evaluated, tokens reused) for one arm's prompts in this order."""
    previous: Sequence[int] = ()
    spent = reused = 0
    for p in prompts:
        ids = p["token_ids"]
        # llama.cpp re-evaluates at least the last prompt token to get the next token's logits
        hit = min(lcp(previous, ids), len(ids) - 1)
        spent += len(ids) - hit
        reused += hit
        previous = ids
    return spent, reused


def _depth(p: Prompt) -> float:
    return float(p["position"])


def orders(layouts: dict[str, list[Prompt]], run_id: str) -> dict[str, Callable[[str], list[Prompt]]]:
    def by_run_order(kind: str) -> Callable[[str], list[Prompt]]:
        jobs = [(arm, p) for arm, rows in layouts.items() for p in rows]
        order = interleaved_order(jobs, [0], run_id, kind)
        return lambda arm: [dict(j.layout) for j in order if j.arm == arm]

    def deepest_first(arm: str) -> list[Prompt]:
        seq = by_run_order("haystack")(arm)
        keys: dict[tuple[str, int], int] = {}
        for p in seq:
            keys.setdefault((p["case_id"], p["target_tokens"]), len(keys))
        return sorted(seq, key=lambda p: (keys[(p["case_id"], p["target_tokens"])], -_depth(p)))

    def case_longest_first(arm: str) -> list[Prompt]:
        seq = by_run_order("haystack")(arm)
        keys: dict[str, int] = {}
        for p in seq:
            keys.setdefault(p["case_id"], len(keys))
        return sorted(seq, key=lambda p: (keys[p["case_id"]], -p["target_tokens"], -_depth(p)))

    return {
        "none": lambda arm: [],
        "shuffled": by_run_order("shuffled"),
        "haystack": by_run_order("haystack"),
        "haystack, deepest-first": deepest_first,
        "case, longest-first": case_longest_first,
    }


def measured(folder: Path, layouts: dict[str, list[Prompt]]) -> dict[str, tuple[int, int, int]]:
    """Per arm: (simulated reuse in the sent order, the engine's counted reuse, requests compared)."""
    records = pl.read_parquet(folder / "records.parquet").filter(pl.col("status") == "ok")
    out = {}
    for arm, rows in layouts.items():
        by_id = {p["layout_id"]: p for p in rows}
        sent = records.filter(pl.col("arm") == arm).sort("completed_at")
        seq = [by_id[i] for i in sent["layout_id"] if i in by_id]
        _, simulated = evaluated(seq)
        out[arm] = (simulated, int(sent["prefix_cache_hit_tokens"].fill_null(0).sum()), len(seq))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    manifest = json.loads((args.folder / "manifest.json").read_text())
    layouts: dict[str, list[Prompt]] = {}
    for arm in ("baseline", "candidate"):
        frame = pl.read_parquet(args.folder / arm / "layouts.parquet").filter(pl.col("status") == "ok")
        rows = frame.select("layout_id", "case_id", "target_tokens", "position", "token_ids").to_dicts()
        for row in rows:
            row["token_ids"] = np.asarray(row["token_ids"], dtype=np.int64)
        layouts[arm] = rows
    rows = []
    total = {arm: sum(len(p["token_ids"]) for p in ps) for arm, ps in layouts.items()}
    for name, seq_of in orders(layouts, manifest["run_id"]).items():
        for arm in layouts:
            seq = seq_of(arm)
            spent, reused = evaluated(seq) if seq else (total[arm], 0)
            rows.append(
                {"order": name, "arm": arm, "prompt_tokens": total[arm], "evaluated": spent, "reused": reused}
            )
    check = measured(args.folder, layouts)
    print("| order | arm | prompt tokens | evaluated | saved |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        saved = 1 - r["evaluated"] / r["prompt_tokens"]
        print(f"| {r['order']} | {r['arm']} | {r['prompt_tokens']:,} | {r['evaluated']:,} | {saved:.1%} |")
    for arm, (sim, seen, n) in check.items():
        print(f"{arm}: the sent order ({n} requests) reuses {sim:,} tokens by LCP; the engine: {seen:,}")
    if args.json:
        lines = [json.dumps(r, sort_keys=True) for r in rows]
        lines += [
            json.dumps({"check": arm, "simulated": s, "engine": e, "requests": n}, sort_keys=True)
            for arm, (s, e, n) in check.items()
        ]
        args.json.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

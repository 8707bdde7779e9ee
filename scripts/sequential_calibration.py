#!/usr/bin/env python
"""Sequential gating against the fixed design, by simulation (issue #26): which boundary family, and
what it saves.

Every replicate draws one release of ``--slices`` slices (all at the same true delta) and runs three
designs on the *same* data, so their differences carry little Monte Carlo noise:

* ``fixed``: one look at all n cases: the gate's slice statistic at alpha (PASS iff LB > -M), the
  regression family BY-adjusted at alpha (the plan's ``regression_method``);
* ``obrien-fleming``: looks at 25/50/75/100 % of the cases (a frozen random case order), the gate's slice
  statistic at each look's nominal Lan-DeMets level, the BY family at that level over every planned
  slice (a slice decided earlier enters with p = 1); a decided slice gets no more cases;
* ``confidence-sequence``: the same looks, an anytime-valid betting test (``betting_wealth``) at alpha.

Data as in scripts/gate_calibration.py (research/stats_gate.md §4): per-case baseline p ~ Beta(2 mu,
2 (1 - mu)), R independent runs per arm; delta < 0 is a 'broken' loss (a share -delta/mu of the cases
drops to p = 0, the sparse, clustered loss issue #22 found hardest). Reported per design: P(PASS) per
slice (the size at delta = -M; power, and 1 - the A/A wrong-FAIL rate, at delta = 0), P(FAIL_REGRESSION)
per slice, and the requests sent as a share of the fixed design's, each with its MC-SE.

    nice -n 15 .venv/bin/python scripts/sequential_calibration.py --sims 300 --render
    .venv/bin/python scripts/sequential_calibration.py --render   # the tables only, from the results file
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import numpy as np
from calibration_cli import REPO, grid_parser, load_rows, timed_cell, write_block

from depthgate.judge.bounds import slice_statistics
from depthgate.judge.gate import stable_seed
from depthgate.judge.sequential import (
    cases_at_looks,
    look_outcome,
    nominal_levels,
    regression_levels,
    regression_q,
    slice_decision,
)

#: The doc section each grid is written to: the first grid (no futility; the boundary comparison) and
#: the shipped design (O'Brien-Fleming with non-binding futility).
MARKERS = {False: "sequential-comparison", True: "sequential-grid"}

MUS = (0.85, 0.99)
MARGIN = 0.10
SEEDS = (1, 3)
CASES = (40, 100)
DELTAS = (0.0, -1.0, -3.0)  # in units of M
DEFAULT_LOOKS = (0.25, 0.5, 0.75, 1.0)
LOOKS = DEFAULT_LOOKS
ALPHA = 0.05
KAPPA = 2.0
DEFAULT_DESIGNS = ("fixed", "obrien-fleming", "confidence-sequence")
DESIGNS = DEFAULT_DESIGNS
#: The sequential design the summary line and the size count are about (--shipped).
SHIPPED = "obrien-fleming"
NAMES = {
    "obrien-fleming": "O'Brien–Fleming",
    "haybittle-peto": "Haybittle–Peto",
    "power-4": "power spending ρ = 4",
    "power-5": "power spending ρ = 5",
}
#: Non-binding futility at alpha (unadjusted regression p) at every interim look (--no-futility: off).
FUTILITY = True
#: The regression side's levels: "separate" (``regression_levels``, alpha t spending; issue #36) or
#: "nominal" (the non-inferiority boundary's own levels, the design before issue #36; --regression).
REGRESSION = "separate"


def draw(
    rng: np.random.Generator, mu: float, n: int, seeds: int, delta: float
) -> tuple[np.ndarray, np.ndarray]:
    pb = rng.beta(mu * KAPPA, (1.0 - mu) * KAPPA, size=n)
    pc = np.where(rng.random(n) < -delta / mu, 0.0, pb) if delta < 0 else pb
    yb = (rng.random((n, seeds)) < pb[:, None]).astype(np.float64)
    yc = (rng.random((n, seeds)) < pc[:, None]).astype(np.float64)
    return yb, yc


def fixed_design(data, margin, reps, key):
    p_reg, shown = [], []
    for j, (yb, yc) in enumerate(data):
        st = slice_statistics(yb, yc, margin, ALPHA, reps, stable_seed(26, "fixed", *key, j))
        p_reg.append(st.p_reg)
        shown.append(st.lower > -margin)
    q = regression_q(p_reg, ALPHA)
    status = [
        "FAIL_REGRESSION" if qj <= ALPHA else "PASS" if s else "FAIL_NOT_SHOWN"
        for qj, s in zip(q, shown, strict=True)
    ]
    n = data[0][0].shape[0]
    return status, [n] * len(data)


def sequential_design(data, margin, reps, key, boundary):
    n = data[0][0].shape[0]
    counts = cases_at_looks(LOOKS, n)
    levels = nominal_levels(LOOKS, ALPHA, boundary)
    reg_levels = levels if REGRESSION == "nominal" else regression_levels(LOOKS, ALPHA, boundary)
    status: list[str | None] = [None] * len(data)
    used = [n] * len(data)
    for k, (c, level, reg_level) in enumerate(zip(counts, levels, reg_levels, strict=True)):
        open_ = [j for j, s in enumerate(status) if s is None]
        p_reg = [1.0] * len(data)
        looks = {}
        for j in open_:
            yb, yc = data[j]
            dec = slice_decision(
                yb[:c], yc[:c], margin, level, reps, stable_seed(26, boundary, *key, j, k), boundary=boundary
            )
            looks[j] = dec
            p_reg[j] = dec.p_reg
        q = regression_q(p_reg, reg_level)
        final = k == len(counts) - 1
        for j in open_:
            futility = ALPHA if FUTILITY and not final else None
            shown = looks[j].decision == "PASS"
            outcome = look_outcome(q[j], level, shown, looks[j].p_reg, futility, regression_level=reg_level)
            if outcome is not None:
                status[j], used[j] = outcome, c
        if all(s is not None for s in status):
            break
    return [s or "FAIL_NOT_SHOWN" for s in status], used


def run_cell(mu, seeds, n, delta_m, sims, reps, slices) -> dict:
    key = (mu, MARGIN, seeds, n, delta_m, slices)
    rng = np.random.default_rng(stable_seed(26, "sequential", *key))
    tallies = {
        d: {"pass": 0, "regression": 0, "futility": 0, "release_pass": 0, "cases": 0, "cases_sq": 0.0}
        for d in DESIGNS
    }
    for i in range(sims):
        data = [draw(rng, mu, n, seeds, delta_m * MARGIN) for _ in range(slices)]
        for design in DESIGNS:
            if design == "fixed":
                status, used = fixed_design(data, MARGIN, reps, (*key, i))
            else:
                status, used = sequential_design(data, MARGIN, reps, (*key, i), design)
            t = tallies[design]
            t["pass"] += sum(s == "PASS" for s in status)
            t["regression"] += sum(s == "FAIL_REGRESSION" for s in status)
            t["futility"] += sum(s == "FUTILITY" for s in status)
            t["release_pass"] += all(s == "PASS" for s in status)
            share = sum(used) / (n * slices)
            t["cases"] += share
            t["cases_sq"] += share * share
    row = {
        "mu": mu,
        "margin": MARGIN,
        "futility": FUTILITY,
        "regression_levels": REGRESSION,
        "looks": list(LOOKS),
        "seeds": seeds,
        "n": n,
        "delta_m": delta_m,
        "sims": sims,
        "slices": slices,
        "designs": list(DESIGNS),
    }
    for design, t in tallies.items():
        m = t["cases"] / sims
        row[design] = {
            "pass": t["pass"] / (sims * slices),
            "regression": t["regression"] / (sims * slices),
            "futility": t["futility"] / (sims * slices),
            "release_pass": t["release_pass"] / sims,
            "share": m,
            "share_se": math.sqrt(max(t["cases_sq"] / sims - m * m, 0.0) / sims),
        }
    return row


def _se(p: float, count: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / count)


def render(rows: list[dict]) -> str:
    lines = [
        "| μ | R | n | δ | design | P(PASS) per slice | P(FAIL_REGRESSION) per slice | P(futility stop) "
        "| release PASS | requests / fixed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    designs = list(dict.fromkeys(d for r in rows for d in r.get("designs", DEFAULT_DESIGNS)))
    sized = {d for r in rows if r["delta_m"] == -1.0 for d in r.get("designs", DEFAULT_DESIGNS)}
    worst_size = {d: 0.0 for d in designs}
    held = total = 0
    for r in sorted(rows, key=lambda r: (r["mu"], r["seeds"], r["n"], -r["delta_m"])):
        count = r["sims"] * r["slices"]
        for design in r.get("designs", DEFAULT_DESIGNS):
            x = r[design]
            if r["delta_m"] == -1.0:
                worst_size[design] = max(worst_size[design], x["pass"])
                if design == SHIPPED:
                    total += 1
                    held += x["pass"] <= ALPHA + 2 * _se(ALPHA, count)
            lines.append(
                f"| {r['mu']:g} | {r['seeds']} | {r['n']} | {r['delta_m']:g}M | {design} | "
                f"{x['pass']:.3f} ± {_se(x['pass'], count):.3f} | {x['regression']:.3f} ± "
                f"{_se(x['regression'], count):.3f} | {x.get('futility', 0.0):.3f} | "
                f"{x['release_pass']:.3f} ± "
                f"{_se(x['release_pass'], r['sims']):.3f} | "
                f"{x['share']:.2f} ± {x['share_se']:.2f} |"
            )
    sims = sorted({(r["sims"], r["slices"]) for r in rows})
    at_zero = [r for r in rows if r["delta_m"] == 0.0]
    shortfall = max((r["fixed"]["pass"] - r[SHIPPED]["pass"] for r in at_zero), default=0.0)
    shares = {k: [r[SHIPPED]["share"] for r in rows if r["delta_m"] == k] for k in (0.0, -1.0, -3.0)}
    head_shares = "; ".join(f"δ = {k:g}M: {min(v):.2f}–{max(v):.2f}" for k, v in shares.items() if v)
    head = (
        f"{NAMES.get(SHIPPED, SHIPPED)} against the fixed design on the same data: largest power "
        "(A/A P(PASS)) shortfall "
        f"{shortfall:.3f}; its requests as a share of the fixed design's, over the cells: {head_shares}. "
        f"Replicates (releases × slices per release): {', '.join(f'{a} × {b}' for a, b in sims)}; "
        f"M = {MARGIN}, "
        f"α = {ALPHA} one-sided, looks at {', '.join(f'{t:g}' for t in LOOKS)} of the cases, BY regression "
        f"family over the release's slices. Largest P(PASS) at δ = −M: "
        + (
            ", ".join(f"{d} {v:.3f}" for d, v in worst_size.items() if d in sized)
            or "not run (no δ = −M cell)"
        )
        + f"; {NAMES.get(SHIPPED, SHIPPED)} size cells within α + 2 MC-SE: {held} of {total}."
    )
    return head + "\n\n" + "\n".join(lines)


def _looks_name(looks: tuple[float, ...]) -> str:
    equal = all(abs(t - (i + 1) / len(looks)) < 1e-9 for i, t in enumerate(looks))
    return f"{len(looks)} equal" if equal else ", ".join(f"{t:g}" for t in looks)


def render_frontier(rows: list[dict]) -> str:
    """Every (looks, family) the results hold against the fixed design on the same data: per δ = 0 cell
    its power shortfall and requests / fixed, then its largest P(PASS) at δ = −M and its requests at
    −3M (over the cells run; — where none was)."""
    cells = sorted({(r["mu"], r["seeds"], r["n"]) for r in rows if r["delta_m"] == 0.0})
    found: dict[tuple[tuple[float, ...], str], dict] = {}
    for r in rows:
        cell = (r["mu"], r["seeds"], r["n"])
        for design in r.get("designs", DEFAULT_DESIGNS):
            if design == "fixed":
                continue
            entry = found.setdefault((tuple(r.get("looks", DEFAULT_LOOKS)), design), {"size": [], "far": []})
            if r["delta_m"] == 0.0:
                entry[cell] = (r["fixed"]["pass"] - r[design]["pass"], r[design]["share"])
            elif r["delta_m"] == -1.0:
                entry["size"].append(r[design]["pass"])
            elif r["delta_m"] == -3.0:
                entry["far"].append(r[design]["share"])
    head = " | ".join(f"μ {m:g}, R {s}, n {n}" for m, s, n in cells)
    lines = [
        f"| looks | family | {head} | largest P(PASS) at δ = −M | requests / fixed at −3M |",
        "|---|---|" + "---|" * len(cells) + "---|---|",
    ]
    for (looks, design), entry in sorted(found.items(), key=lambda kv: (len(kv[0][0]), kv[0])):
        per_cell = " | ".join(f"{entry[c][0]:+.3f} / {entry[c][1]:.3f}" if c in entry else "—" for c in cells)
        size = f"{max(entry['size']):.3f}" if entry["size"] else "—"
        far = f"{min(entry['far']):.2f}–{max(entry['far']):.2f}" if entry["far"] else "—"
        lines.append(f"| {_looks_name(looks)} | {design} | {per_cell} | {size} | {far} |")
    note = (
        "Per δ = 0 cell: power shortfall against the fixed design on the same data (fixed P(PASS) − "
        "the design's; the criterion: ≤ .02) / requests as a share of the fixed design's (the goal: ≤ .70). "
        f"M = {MARGIN}, α = {ALPHA} one-sided, BY regression family over 4 slices, futility at α."
    )
    return note + "\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    results = REPO / "docs" / "sequential-calibration.jsonl"
    ap = grid_parser(__doc__, results, mus=MUS, seeds=SEEDS, cases=CASES)  # --sims: releases per cell
    ap.add_argument("--slices", type=int, default=4, help="slices per release (the regression family)")
    ap.add_argument("--delta", type=float, nargs="*", default=list(DELTAS), help="true delta in units of M")
    ap.add_argument("--no-futility", action="store_true", help="no futility stop (the first, PASS-only grid)")
    ap.add_argument(
        "--designs", nargs="*", default=list(DEFAULT_DESIGNS[1:]), help="sequential designs beside 'fixed'"
    )
    ap.add_argument("--shipped", default="obrien-fleming", help="the design the summary line is about")
    ap.add_argument("--marker", default=None, help="doc marker to write (default: by futility and looks)")
    ap.add_argument(
        "--regression",
        choices=("separate", "nominal"),
        default="separate",
        help="regression levels: alpha t spending (issue #36) or the NI boundary's own (before it)",
    )
    ap.add_argument("--looks", type=float, nargs="*", default=list(DEFAULT_LOOKS), help="look fractions")
    ap.add_argument(
        "--frontier", action="store_true", help="write every (looks, family) of the results as one table"
    )
    args = ap.parse_args(argv)
    global FUTILITY, LOOKS, DESIGNS, SHIPPED, REGRESSION
    FUTILITY = not args.no_futility
    REGRESSION = args.regression
    LOOKS = tuple(args.looks)
    DESIGNS = ("fixed", *args.designs)
    SHIPPED = args.shipped
    done = {
        (r["mu"], r["seeds"], r["n"], r["delta_m"], r["sims"], r["slices"])
        for r in load_rows(args.results)
        if tuple(r.get("looks", DEFAULT_LOOKS)) == LOOKS
        and r.get("futility", False) == FUTILITY
        and r.get("regression_levels", "nominal") == REGRESSION
        and tuple(r.get("designs", DEFAULT_DESIGNS)) == DESIGNS
    }
    started = time.monotonic()
    for mu, seeds, n, delta_m in itertools.product(args.mu, args.seeds, args.cases, args.delta):
        if args.sims <= 0 or (mu, seeds, n, delta_m, args.sims, args.slices) in done:
            continue
        cell = (mu, seeds, n, delta_m, args.sims, args.reps, args.slices)
        timed_cell(args.results, lambda cell=cell: run_cell(*cell))
    print(f"elapsed {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.frontier:
        write_block(
            render_frontier(load_rows(args.results)),
            args.marker or "sequential-frontier",
            "### 8.7 The saving frontier (scripts/sequential_calibration.py --frontier)",
        )
    if args.render:
        rows = [
            r
            for r in load_rows(args.results)
            if r.get("futility", False) == FUTILITY
            and tuple(r.get("looks", DEFAULT_LOOKS)) == LOOKS
            and SHIPPED in r.get("designs", DEFAULT_DESIGNS)
        ]
        suffix = "" if LOOKS == DEFAULT_LOOKS else "-looks-" + "-".join(f"{t:g}" for t in LOOKS)
        write_block(
            render(rows),
            args.marker or MARKERS[FUTILITY] + suffix,
            "### 8.1 Simulation grid (scripts/sequential_calibration.py)",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Calibration grid of the gate's per-slice non-inferiority test (issue #22, item 1 and 6).

For every cell of the grid — baseline mean accuracy mu, margin M, seeds R, cases n, loss shape — draw
``--sims`` slices at the null boundary delta = -M and count how often the gate's own slice test
(``depthgate.judge.bounds.slice_lower`` > −M: ``slice_statistics(...).lower`` without the p-values,
the condition of a PASS; tests/test_gate_error_control.py checks the two are equal) shows
non-inferiority: the size, which must be <= alpha + 2 MC-SE. With ``--power-sims`` it also draws slices
at delta = 0 (A/A) and reports the power.

Data (research/stats_gate.md §4): per-case baseline pass probability p_i ~ Beta(2 mu, 2 (1 - mu)) (strong
case heterogeneity), R independent runs per arm (no seed coupling). Loss shapes at delta = -M:

* ``broken``: a random share M/mu of the cases drops to p = 0 (a sparse, clustered regression);
* ``scale``: every case is scaled, q_i = p_i (1 - M/mu).

Results are appended to a JSON-lines file (``--results``) cell by cell, so a run can be resumed or split;
``--render`` writes the table from that file into docs/gate-calibration.md between the markers
``<!-- calibration-grid:begin -->`` and ``<!-- calibration-grid:end -->``. Seeds are sha256-derived
(``stable_seed``): the same cell gives the same numbers in every process.

    nice -n 15 .venv/bin/python scripts/gate_calibration.py --sims 1000 --power-sims 200 --render
    .venv/bin/python scripts/gate_calibration.py --render          # table only, from the results file
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import numpy as np
from calibration_cli import REPO, grid_parser, load_rows, timed_cell, write_block

from depthgate.judge.bounds import slice_lower
from depthgate.judge.gate import stable_seed

MUS = (0.9, 0.95, 0.99, 0.995)
MARGINS = (0.03, 0.05, 0.10)
SEEDS = (1, 3, 5)
CASES = (40, 100, 300)
LOSSES = ("broken", "scale")
ALPHA = 0.05
KAPPA = 2.0


def draw(
    rng: np.random.Generator, mu: float, n: int, seeds: int, delta: float, loss: str
) -> tuple[np.ndarray, np.ndarray]:
    """One slice: (baseline, candidate) 0/1 arrays of shape (n, seeds)."""
    pb = rng.beta(mu * KAPPA, (1.0 - mu) * KAPPA, size=n)
    if delta < 0 and loss == "broken":
        pc = np.where(rng.random(n) < -delta / mu, 0.0, pb)
    elif delta < 0:
        pc = pb * (1.0 + delta / mu)
    else:
        pc = pb
    yb = (rng.random((n, seeds)) < pb[:, None]).astype(np.float64)
    yc = (rng.random((n, seeds)) < pc[:, None]).astype(np.float64)
    return yb, yc


def run_cell(
    mu: float,
    margin: float,
    seeds: int,
    n: int,
    loss: str,
    delta: float,
    sims: int,
    reps: int,
    salt: str = "",
) -> dict:
    """One cell; ``salt`` (empty: the grid's own seeds) draws an independent replicate of the cell."""
    key = (mu, margin, seeds, n, loss, delta)
    tag = ("calibration", "boot") if not salt else (f"calibration:{salt}", f"boot:{salt}")
    rng = np.random.default_rng(stable_seed(22, tag[0], *key))
    shown = 0
    for i in range(sims):
        yb, yc = draw(rng, mu, n, seeds, delta, loss)
        shown += slice_lower(yb, yc, ALPHA, reps, stable_seed(22, tag[1], *key, i)) > -margin
    rate = shown / sims
    row = {
        "mu": mu,
        "margin": margin,
        "seeds": seeds,
        "n": n,
        "loss": loss,
        "delta": delta,
        "sims": sims,
        "shown": shown,
        "rate": rate,
        "mc_se": math.sqrt(max(rate * (1 - rate), 1e-12) / sims),
        "bootstrap_reps": reps,
    }
    if salt:
        row["salt"] = salt
    return row


def render(rows: list[dict]) -> str:
    size = {(r["mu"], r["margin"], r["seeds"], r["n"], r["loss"]): r for r in rows if r["delta"] < 0}
    power = {(r["mu"], r["margin"], r["seeds"], r["n"], r["loss"]): r for r in rows if r["delta"] == 0}
    lines = [
        "| μ | M | R | n | size, broken | size, scale | power at δ = 0 (A/A) |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    held = total = 0
    for mu, margin, seeds, n in itertools.product(MUS, MARGINS, SEEDS, CASES):
        cells = []
        for loss in LOSSES:
            r = size.get((mu, margin, seeds, n, loss))
            if r is None:
                cells.append("–")
                continue
            bound = ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / r["sims"])
            ok = r["rate"] <= bound
            held += ok
            total += 1
            worst = max(worst, r["rate"])
            cells.append(f"{r['rate']:.3f} ± {r['mc_se']:.3f}{'' if ok else ' **over**'}")
        p = power.get((mu, margin, seeds, n, "broken")) or power.get((mu, margin, seeds, n, "scale"))
        cells.append("–" if p is None else f"{p['rate']:.2f} ± {p['mc_se']:.2f}")
        if all(c == "–" for c in cells):
            continue
        lines.append(f"| {mu:g} | {margin:g} | {seeds} | {n} | " + " | ".join(cells) + " |")
    missing = [
        f"μ {mu:g} M {m:g} R {r} n {n} {loss}"
        for mu, m, r, n, loss in itertools.product(MUS, MARGINS, SEEDS, CASES, LOSSES)
        if (mu, m, r, n, loss) not in size
    ]
    sims = sorted({r["sims"] for r in rows if r["delta"] < 0})
    head = (
        f"{held} of {total} size cells hold (rate <= α + 2 MC-SE at α = {ALPHA}, with the MC-SE of α at the "
        f"cell's replicate count {', '.join(map(str, sims))}); largest size {worst:.3f}. "
        "Power is P(non-inferiority shown) at δ = 0 for one slice (a release of k slices needs all k)."
    )
    if missing:
        more = " …" if len(missing) > 6 else ""
        head += f" **Not run yet: {len(missing)} size cells** ({'; '.join(missing[:6])}{more})."
    return head + "\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    results = REPO / "docs" / "gate-calibration-grid.jsonl"
    ap = grid_parser(__doc__, results, mus=MUS, seeds=SEEDS, cases=CASES)  # --sims: per size cell
    ap.add_argument("--power-sims", type=int, default=0, help="replicates per power cell (delta = 0)")
    ap.add_argument("--margin", type=float, nargs="*", default=list(MARGINS))
    ap.add_argument("--loss", nargs="*", default=list(LOSSES))
    ap.add_argument(
        "--salt", default="", help="seed salt: an independent replicate of the cells (empty: the grid's)"
    )
    args = ap.parse_args(argv)
    done = {
        (r["mu"], r["margin"], r["seeds"], r["n"], r["loss"], r["delta"], r["sims"], r.get("salt", ""))
        for r in load_rows(args.results)
    }
    started = time.monotonic()
    for mu, margin, seeds, n, loss in itertools.product(
        args.mu, args.margin, args.seeds, args.cases, args.loss
    ):
        for delta, sims in ((-margin, args.sims), (0.0, args.power_sims if loss == "broken" else 0)):
            if sims <= 0 or (mu, margin, seeds, n, loss, delta, sims, args.salt) in done:
                continue
            cell = (mu, margin, seeds, n, loss, delta, sims, args.reps, args.salt)
            timed_cell(args.results, lambda cell=cell: run_cell(*cell))
    print(f"elapsed {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.render:
        write_block(
            render(load_rows(args.results)),
            "calibration-grid",
            "## Calibration grid (scripts/gate_calibration.py)",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

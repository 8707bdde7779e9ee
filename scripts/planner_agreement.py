#!/usr/bin/env python
"""Agreement of the planner's approximation with simulation through the gate (issue #36, item 3).

For every cell (baseline accuracy p, ICC, seeds R, cases n) at a true difference of 0 (A/A), the
approximation's per-slice power (``depthgate.judge.planning.power.predicted_power``) beside the share of
``--sims`` simulated slices in which ``gate()`` itself showed non-inferiority
(``depthgate.judge.planning.simulate_gate_power``: the planner's own generative model, B = 999,
M = 0.10, alpha = 0.05). The joint power of ``--slices`` independent slices is the per-slice power to
that power on both sides. One JSON line per cell on stdout; a fixed seed gives the same numbers in every
process.

    nice -n 15 .venv/bin/python scripts/planner_agreement.py --sims 100 > planner-agreement.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

from depthgate.judge.gate import Sizing
from depthgate.judge.planning import DesignParameters, power_per_slice, simulate_gate_power


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sims", type=int, default=100)
    ap.add_argument("--slices", type=int, default=10)
    ap.add_argument("--p", type=float, nargs="+", default=[0.85, 0.95, 0.99])
    ap.add_argument("--icc", type=float, nargs="+", default=[0.0, 0.33, 0.5])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--cases", type=int, nargs="+", default=[40, 100, 300])
    args = ap.parse_args()
    sizing = Sizing(margin=0.10, alpha=0.05, n_min=2)
    for p, icc, r, n in itertools.product(args.p, args.icc, args.seeds, args.cases):
        design = DesignParameters.from_icc(p, icc)
        row = power_per_slice(n, r, design, sizing, n_slices=args.slices)
        sim = simulate_gate_power(
            design, n_cases=n, seeds=r, margin=0.10, alpha=0.05, sims=args.sims, batch=10
        )
        out = {
            "p": p,
            "icc": icc,
            "seeds": r,
            "cases": n,
            "approx": round(row.power_approx, 4),
            "flagged": row.check_by_simulation,
            "sim": sim.rate,
            "mc_se": round(sim.mc_se, 4),
            "sims": args.sims,
            "joint_approx": round(row.power_approx**args.slices, 4),
            "joint_sim": round(sim.rate**args.slices, 4),
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

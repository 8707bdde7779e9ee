#!/usr/bin/env python
"""Issue #36 item 1 (F4): candidate slice lower bounds compared on the calibration grid's own draws.

Every candidate is evaluated on the SAME slices as ``scripts/gate_calibration.py`` (its ``draw`` and its
sha256-derived seeds: the first ``--sims`` draws of a cell are the grid's first draws, and the case
bootstrap uses the grid's bootstrap seed), so differences between candidates are paired. Size is
P(LB > −M) at δ = −M ('broken' and 'scale' losses), power P(LB > −M) at δ = 0. Only R ≥ 2 cells (R = 1
is Newcombe-10, untouched by the candidates).

Candidates (one-sided level α = .05 unless said; "RS(m₀, level)" is the Newcombe-RS monotone envelope of
``judge/bounds/rs_envelope.py`` with the design effect shrunk toward R with m₀ discordant runs):

* ``today``    — the gate: min(percentile bootstrap, RS(max(6, .03 N), .9α)) (checked equal to
  ``bounds.slice_lower`` slice by slice);
* ``unshrunk`` — reference only: min(percentile bootstrap, RS(0, α)), no shrinkage, no level cut (close
  to the gate of a week ago, which used the bootstrap-t);
* ``rs_only``  — "one of the two bounds": today's Newcombe-RS alone (the bootstrap dropped);
* ``lm``       — Learned-Miller & Thomas (2019): the α-quantile of the Dirichlet(1, …, 1)-weighted mean
  of {−1, d_1, …, d_n} (a Bayesian bootstrap with one pseudo-observation at the lower end of the
  support); valid for any distribution of per-case differences in [−1, 1], no constant;
* ``pseudoK``  — min(percentile bootstrap, RS(0, α) on the data plus K pseudo-cases whose R runs all
  pass in the baseline and fail in the candidate): the prior is "K broken cases" (in cases, not in runs),
  shown at K = 0.5, 1, 2;
* ``boot_half`` — the percentile bootstrap alone at α/2 (the other "one bound, corrected level");
* ``lf_score`` — a case-level score bound whose null variance adds the least-favourable broken mass
  w (1 − w) (w = the mass at −1 the null needs), ``lf_boot`` its min with the bootstrap;
* ``lm_jeffreys`` / ``lm_quarter`` (``--lm-only``) — ``lm`` with the pseudo-observation's weight
  Gamma(1/2) (the Jeffreys / mid-p analogue of the Poisson bound for unseen broken cases) or Gamma(1/4).

Data of docs/gate-calibration.md §11 (1,000 slices per size cell, 400 per power cell):

    nice -n 15 python scripts/power_candidates.py --sims 1000 --power-sims 400 \
        --results docs/power-candidates-screen.jsonl
    nice -n 15 python scripts/power_candidates.py --lm-only --sims 1000 --power-sims 400 \
        --results docs/power-candidates-lm.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from calibration_cli import REPO, load_rows
from gate_calibration import ALPHA, CASES, MARGINS, MUS, draw

from depthgate.judge.bounds import newcombe10_lower_grid, prior_runs, resample_means, slice_lower
from depthgate.judge.gate import stable_seed

CANDIDATES = (
    "today",
    "unshrunk",
    "rs_only",
    "lm",
    "pseudo0.5",
    "pseudo1",
    "pseudo2",
    "boot_half",
    "lf_score",
    "lf_boot",
    "lm_jeffreys",
    "lm_quarter",
)
_Z = statistics.NormalDist().inv_cdf(1.0 - ALPHA)


def rs_lower(yb: np.ndarray, yc: np.ndarray, m0: float, level: float, pseudo: float = 0.0) -> float:
    """The Newcombe-RS envelope lower bound (one-sided ``level``) of ``judge/bounds/rs_envelope.rs_grid``
    with the prior weight ``m0`` (discordant runs) and ``pseudo`` added broken cases (weight, in cases)."""
    n, runs = yb.shape
    a0 = float((yc * yb).sum())
    b0 = float((yc * (1 - yb)).sum())
    c0 = float(((1 - yc) * yb).sum()) + pseudo * runs
    d0 = float(((1 - yc) * (1 - yb)).sum())
    c_real = c0 - pseudo * runs
    i = np.arange(round(c_real) + 1, dtype=np.float64)[:, None]
    j = np.arange(int(d0) + 1, dtype=np.float64)[None, :]
    a, b, c, d = (np.broadcast_to(x, (i.size, j.size)) for x in (a0 + i, b0 + j, c0 - i, d0 - j))
    d_case = yc.mean(axis=1) - yb.mean(axis=1)
    failures = (runs - yc.sum(axis=1)).astype(np.int64)
    gains = [
        (di + t / runs) ** 2 - (di + (t - 1) / runs) ** 2
        for di, f in zip(d_case.tolist(), failures.tolist(), strict=True)
        for t in range(1, int(f) + 1)
    ]
    prefix = np.concatenate(([0.0], np.cumsum(np.sort(np.asarray(gains, dtype=np.float64))[::-1])))
    k = (i + j).astype(np.int64)
    n_w = n + pseudo
    s1 = float(d_case.sum()) - pseudo + (i + j) / runs
    s2 = float((d_case * d_case).sum()) + pseudo + prefix[k]
    total = float(n * runs) + pseudo * runs
    var_cluster = np.maximum(s2 - s1 * s1 / n_w, 0.0) / (n_w - 1) / n_w
    m = b + c
    var_srs = (m / total - ((b - c) / total) ** 2) / total
    with np.errstate(divide="ignore", invalid="ignore"):
        d_hat = np.where(var_srs > 0, var_cluster / np.where(var_srs > 0, var_srs, 1.0), float(runs))
    d_hat = np.clip(d_hat, 1.0, float(runs))
    deff = np.clip((m * d_hat + m0 * runs) / (m + m0), 1.0, float(runs)) if m0 > 0 else d_hat
    return float(newcombe10_lower_grid(a / deff, b / deff, c / deff, d / deff, 2.0 * level).min())


def lm_lower(d_case: np.ndarray, level: float, reps: int, seed: int, atom: float = 1.0) -> float:
    """Learned-Miller & Thomas: α-quantile of Dirichlet(atom, 1, ..., 1) weights on {−1, d_1, ..., d_n}
    (atom 1: their bound; atom 1/2: the Jeffreys / mid-p analogue for the unseen broken cases)."""
    rng = np.random.default_rng(seed)
    points = np.concatenate(([-1.0], d_case))
    w = rng.exponential(size=(reps, points.size))
    if atom != 1.0:
        w[:, 0] = np.random.default_rng([seed, 1]).gamma(atom, size=reps)
    means = (w @ points) / w.sum(axis=1)
    return float(np.quantile(means, level, method="lower"))


def lf_score_lower(d_case: np.ndarray) -> float:
    """The cluster score bound with a least-favourable null variance: LB solves
    (Δ̂ − δ₀)² = z² (s² + w (1 − w)(1 + Δ̂)²) / n, w = (Δ̂ − δ₀)/(1 + Δ̂): the null distribution nearest the
    data moves a mass w of cases to −1 (the broken case the sample may have missed)."""
    n = d_case.size
    mean = float(d_case.mean())
    s2 = float(d_case.var(ddof=1))
    lo, hi = -1.0, mean
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        w = min(max((mean - mid) / (1.0 + mean), 0.0), 1.0) if mean > -1 else 1.0
        var = (s2 + w * (1.0 - w) * (1.0 + mean) ** 2) / n
        if (mean - mid) > _Z * math.sqrt(var):
            lo = mid
        else:
            hi = mid
    return lo


LM_FAMILY = ("today", "lm", "lm_jeffreys", "lm_quarter")


def candidates(
    yb: np.ndarray, yc: np.ndarray, reps: int, seed: int, lm_only: bool = False
) -> dict[str, float]:
    d_case = yc.mean(axis=1) - yb.mean(axis=1)
    if lm_only:
        return {
            "today": slice_lower(yb, yc, ALPHA, reps, seed),
            "lm": lm_lower(d_case, ALPHA, reps, seed + 1),
            "lm_jeffreys": lm_lower(d_case, ALPHA, reps, seed + 1, atom=0.5),
            "lm_quarter": lm_lower(d_case, ALPHA, reps, seed + 1, atom=0.25),
        }
    means = resample_means(d_case, reps, seed)
    boot = float(np.quantile(means, ALPHA, method="lower"))
    total = float(yb.size)
    rs_today = rs_lower(yb, yc, prior_runs(total), 0.9 * ALPHA)
    rs_free = rs_lower(yb, yc, 0.0, ALPHA)
    out = {
        "today": min(boot, rs_today),
        "unshrunk": min(boot, rs_free),
        "rs_only": rs_today,
        "lm": lm_lower(d_case, ALPHA, reps, seed + 1),
        "boot_half": float(np.quantile(means, ALPHA / 2, method="lower")),
    }
    out["lm_jeffreys"] = lm_lower(d_case, ALPHA, reps, seed + 1, atom=0.5)
    out["lm_quarter"] = lm_lower(d_case, ALPHA, reps, seed + 1, atom=0.25)
    out["lf_score"] = lf_score_lower(d_case)
    out["lf_boot"] = min(boot, out["lf_score"])
    for k in (0.5, 1.0, 2.0):
        out[f"pseudo{k:g}"] = min(boot, rs_lower(yb, yc, 0.0, ALPHA, pseudo=k))
    return out


def run_cell(
    mu: float,
    margin: float,
    seeds: int,
    n: int,
    loss: str,
    delta: float,
    sims: int,
    reps: int,
    check: bool,
    lm_only: bool = False,
) -> dict:
    key = (mu, margin, seeds, n, loss, delta)
    rng = np.random.default_rng(stable_seed(22, "calibration", *key))
    names = LM_FAMILY if lm_only else CANDIDATES
    shown = dict.fromkeys(names, 0)
    for i in range(sims):
        yb, yc = draw(rng, mu, n, seeds, delta, loss)
        seed = stable_seed(22, "boot", *key, i)
        lows = candidates(yb, yc, reps, seed, lm_only)
        if check and i < 5:
            ref = slice_lower(yb, yc, ALPHA, reps, seed)
            assert abs(ref - lows["today"]) < 1e-12, (ref, lows["today"])
        for name in names:
            shown[name] += lows[name] > -margin
    return {
        "mu": mu,
        "margin": margin,
        "seeds": seeds,
        "n": n,
        "loss": loss,
        "delta": delta,
        "sims": sims,
        "bootstrap_reps": reps,
        "shown": shown,
        "rate": {k: v / sims for k, v in shown.items()},
    }


def summary(rows: list[dict]) -> str:
    """Per candidate: worst size (and cells over α + 2 MC-SE), mean power, the three target cells."""
    lines = []
    for name in CANDIDATES:
        size = [(r["rate"][name], r) for r in rows if r["delta"] < 0 and name in r["rate"]]
        power = [r["rate"][name] for r in rows if r["delta"] == 0 and name in r["rate"]]
        if not size:
            continue
        over = [r for v, r in size if v > ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / r["sims"])]
        worst = max(size, key=lambda t: t[0])
        targets = []
        for mu, m, s, n in ((0.9, 0.05, 5, 40), (0.99, 0.03, 5, 100), (0.99, 0.03, 3, 100)):
            hit = [
                r["rate"][name]
                for r in rows
                if r["delta"] == 0 and (r["mu"], r["margin"], r["seeds"], r["n"]) == (mu, m, s, n)
            ]
            targets.append(f"{hit[0]:.3f}" if hit else "–")
        w = worst[1]
        lines.append(
            f"{name:10s} worst size {worst[0]:.4f} (μ {w['mu']} M {w['margin']} R {w['seeds']} n {w['n']} "
            f"{w['loss']}), over {len(over)}/{len(size)}; mean power {statistics.fmean(power):.3f} "
            f"({len(power)} cells); targets {' / '.join(targets)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=300, help="slices per size cell (δ = −M)")
    ap.add_argument("--power-sims", type=int, default=100, help="slices per power cell (δ = 0)")
    ap.add_argument("--reps", type=int, default=999)
    ap.add_argument("--mu", type=float, nargs="*", default=list(MUS))
    ap.add_argument("--margin", type=float, nargs="*", default=list(MARGINS))
    ap.add_argument("--seeds", type=int, nargs="*", default=[3, 5])
    ap.add_argument("--cases", type=int, nargs="*", default=list(CASES))
    ap.add_argument("--loss", nargs="*", default=["broken", "scale"])
    ap.add_argument("--results", type=Path, default=REPO / "docs" / "power-candidates.jsonl")
    ap.add_argument("--lm-only", action="store_true", help="today and the Learned-Miller family only")
    ap.add_argument("--summary", action="store_true", help="print the summary of the results file only")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(load_rows(args.results)))
        return 0
    done = {
        (r["mu"], r["margin"], r["seeds"], r["n"], r["loss"], r["delta"], r["sims"])
        for r in load_rows(args.results)
    }
    started = time.monotonic()
    for mu, margin, seeds, n, loss in itertools.product(
        args.mu, args.margin, args.seeds, args.cases, args.loss
    ):
        for delta, sims in ((-margin, args.sims), (0.0, args.power_sims if loss == "broken" else 0)):
            if sims <= 0 or (mu, margin, seeds, n, loss, delta, sims) in done:
                continue
            t0 = time.monotonic()
            row = run_cell(
                mu, margin, seeds, n, loss, delta, sims, args.reps, check=True, lm_only=args.lm_only
            )
            row["seconds"] = round(time.monotonic() - t0, 1)
            with args.results.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(f"elapsed {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(summary(load_rows(args.results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

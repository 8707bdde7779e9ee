"""Length in characters beside tokens: each arm's rendered prompts per token length (a token length holds
another amount of text under another tokenizer), for every report file but junit.xml."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.judge.tables import ARMS, BASELINE, CANDIDATE
from depthgate.report.verdict import LengthChars


def length_chars(layouts: Mapping[str, str | Path]) -> list[LengthChars]:
    """Characters of each arm's ok layouts per token length (``target_tokens``), from the rendered
    ``text``. ``layouts``: arm → ``layouts.parquet``. The file is checked and its small columns read with
    :func:`~depthgate.layout.layouts.read_layouts`; the text is only measured, in a streaming scan, never
    held (it is ≈ 4 bytes per token: gigabytes for a 128K matrix)."""
    from depthgate.layout.layouts import read_layouts

    rows: list[LengthChars] = []
    for arm in ARMS:
        if arm not in layouts:
            continue
        path = Path(layouts[arm])
        read_layouts(path, columns=["target_tokens", "total_tokens", "status"])  # a layouts file, or refused
        stats = (
            pl.scan_parquet(path)
            .filter(pl.col("status") == "ok")
            .select("target_tokens", "total_tokens", pl.col("text").str.len_chars().alias("chars"))
            .group_by("target_tokens")
            .agg(
                pl.len().alias("layouts"),
                pl.col("chars").mean().alias("chars_mean"),
                pl.col("chars").min().alias("chars_min"),
                pl.col("chars").max().alias("chars_max"),
                pl.col("total_tokens").mean().alias("tokens_mean"),
                (pl.col("chars").sum() / pl.col("total_tokens").sum()).alias("chars_per_token"),
            )
            .sort("target_tokens")
            .collect(engine="streaming")
        )
        for row in stats.iter_rows(named=True):
            rows.append(
                LengthChars.model_validate(
                    {
                        "length": int(row["target_tokens"]),
                        "arm": arm,
                        "layouts": int(row["layouts"]),
                        "chars_mean": round(float(row["chars_mean"]), 2),
                        "chars_min": int(row["chars_min"]),
                        "chars_max": int(row["chars_max"]),
                        "tokens_mean": round(float(row["tokens_mean"]), 2),
                        "chars_per_token": round(float(row["chars_per_token"]), 4),
                    }
                )
            )
    return sorted(rows, key=lambda r: (r.length, ARMS.index(r.arm)))


def run_layouts(out_dir: str | Path, manifest: Mapping[str, Any]) -> dict[str, Path] | None:
    """The layouts of the run whose reports go to ``out_dir``, when ``out_dir`` is the run folder's
    ``report`` (the default of ``depthgate run``, ``gate`` and ``report``): its parent holds a
    ``manifest.json`` with this manifest's digest and ``<arm>/layouts.parquet``. None otherwise."""
    run = Path(out_dir).resolve().parent
    digest = manifest.get("manifest_digest")
    try:
        on_disk = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not digest or not isinstance(on_disk, dict) or on_disk.get("manifest_digest") != digest:
        return None
    paths = {arm: run / arm / "layouts.parquet" for arm in ARMS}
    return paths if all(path.is_file() for path in paths.values()) else None


def length_char_rows(chars: Sequence[LengthChars]) -> list[dict[str, str]]:
    """One row per token length: both arms' characters (mean, min–max), characters per token and the
    candidate's mean relative to the baseline's."""
    by_length: dict[int, dict[str, LengthChars]] = {}
    for row in chars:
        by_length.setdefault(row.length, {})[row.arm] = row
    out: list[dict[str, str]] = []
    for length in sorted(by_length):
        arms = by_length[length]
        b, c = arms.get(BASELINE), arms.get(CANDIDATE)

        def cell(r: LengthChars | None) -> str:
            return "–" if r is None else f"{r.chars_mean:,.0f} ({r.chars_min:,}–{r.chars_max:,})"

        def per_token(r: LengthChars | None) -> str:
            return "–" if r is None else f"{r.chars_per_token:.2f}"

        change = (
            f"{100 * (c.chars_mean / b.chars_mean - 1):+.1f}%"
            if b is not None and c is not None and b.chars_mean
            else "–"
        )
        out.append(
            {
                "length": f"{length:,}",
                "layouts": f"{b.layouts if b else 0} / {c.layouts if c else 0}",
                "baseline": cell(b),
                "candidate": cell(c),
                "per_token": f"{per_token(b)} → {per_token(c)}",
                "change": change,
            }
        )
    return out


CHARS_NOTE = (
    "Characters of the rendered prompts (ok layouts) at each token length, per arm: a token length holds "
    "another amount of text under another tokenizer or template, so compare a tokenizer upgrade here."
)

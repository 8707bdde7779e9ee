"""summary.md: the pull-request comment (verdict line, failing and inconclusive slices first, worst
positions, length in characters, oracle problems per slice, digests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from depthgate.judge.gate import GateResult, SliceResult, SliceStatus
from depthgate.judge.health import EARLIER, RunHealth
from depthgate.judge.tables import BASELINE, CANDIDATE
from depthgate.report.chars import CHARS_NOTE, length_char_rows
from depthgate.report.formatting import md_cell, ordered_slices, plain, q_value, signed, slice_key
from depthgate.report.verdict import (
    JUNIT_XML,
    REPORT_HTML,
    VERDICT_JSON,
    LengthChars,
    OracleCounts,
    ReportInputs,
    exit_code_for,
    health_reasons,
    manifest_digests,
    verdict_name,
)


def _verdict_icon(verdict: str) -> str:
    return {"PASS": "✅", "FAIL": "❌", "INCONCLUSIVE": "⚠️", "INFRA": "🔌"}[verdict]


def _canary_lines(canaries: Mapping[str, Any] | None) -> list[str]:
    """The full-length canaries (verdict.json ``serving_checks.canaries``) as a summary.md table."""
    if not canaries:
        return []
    lines = [
        "",
        "### Full-length canaries (answer at the very start / end of a prompt of each length)",
        "",
        "| length | kind | baseline answered | candidate answered |",
        "|---:|---|---:|---:|",
    ]
    cells: dict[tuple[int, str], dict[str, str]] = {}
    for c in canaries.get("counts", []):
        cells.setdefault((int(c["length"]), str(c["kind"])), {})[str(c["arm"])] = (
            f"{c['passed']} / {c['runs']}"
        )
    for (length, kind), by_arm in sorted(cells.items()):
        lines.append(
            f"| {length} | {kind} | {by_arm.get('baseline', '–')} | {by_arm.get('candidate', '–')} |"
        )
    lines += ["", *(f"- **{line}**" for line in canaries.get("findings", []))]
    return lines


def _headline(inputs: ReportInputs) -> list[str]:
    """The verdict line, the slice counts and the plan in one sentence."""
    result, health = inputs.result, inputs.health
    plan = result.plan
    code = exit_code_for(result, health)
    ordered = ordered_slices(result.slice_results)
    n_fail = sum(1 for s in ordered if s.status.value.startswith("FAIL"))
    n_inc = sum(1 for s in ordered if s.status is SliceStatus.INCONCLUSIVE)
    n_pass = len(ordered) - n_fail - n_inc
    return [
        f"## depthgate: {_verdict_icon(verdict_name(result, health))} {verdict_name(result, health)}"
        + (" · 🛑 SAFETY" if result.safety_flag else "")
        + f" (exit {int(code)} {code.name})",
        "",
        f"{len(ordered)} slices (length × evidence depth): **{n_fail} failing**, {n_inc} inconclusive, "
        f"{n_pass} passing. Non-inferiority margin M = {plan.margin:g}, one-sided α = {plan.look_alpha:g} "
        "per look; a slice passes when the lower bound on Δ (candidate − baseline accuracy) is above −M.",
    ]


def _health_lines(health: RunHealth | None) -> list[str]:
    """What the run says about the verdict: lost runs by slice, requests per endpoint."""
    lines: list[str] = []
    for reason in health_reasons(health):
        lines += ["", f"> **{reason.split(':', 1)[0]}**:{reason.split(':', 1)[1]}"]
    if health is not None and health.infra is not None and health.infra.lost:
        lines += ["", "| lost runs by slice | runs |", "|---|---:|"]
        lines += [f"| `{k}` | {v} |" for k, v in sorted(health.infra.by_slice.items())]
        lines += ["", "The slice table below is computed over incomplete data: provisional, not a verdict."]
    if health is not None and health.infra is not None and health.infra.endpoints:
        lines += _endpoint_lines(health.infra.endpoints)
    return lines


def _endpoint_lines(endpoints: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Where the requests went (one row per endpoint or replica; "failed attempts": attempts that failed
    there before the job's final record, in the call that wrote it, on this replica or another; a run
    resumed after failures adds "failed in earlier calls", the killed or stopped calls' own)."""
    earlier = any(EARLIER in v for v in endpoints.values())
    head = "| endpoint | ok | system_fail | infra_error | failed attempts |"
    lines = [
        "",
        "<details><summary>Requests per endpoint</summary>",
        "",
        head + (" failed in earlier calls |" if earlier else ""),
        "|---|---:|---:|---:|---:|" + ("---:|" if earlier else ""),
    ]
    for k, v in sorted(endpoints.items()):
        row = f"| `{k}` | {v['ok']} | {v['system_fail']} | {v['infra_error']} | {v['failed']} |"
        lines.append(row + (f" {v.get(EARLIER, 0)} |" if earlier else ""))
    return [*lines, "", "</details>"]


def _safety_lines(result: GateResult) -> list[str]:
    if not result.safety_flag:
        return []
    s = result.safety
    return [
        "",
        f"> **SAFETY**: {s.hits_candidate} candidate and {s.hits_baseline} baseline run(s) gave a "
        "forbidden claim as the answer. This blocks the release pending human review, whatever the "
        "statistics say.",
    ]


_SLICE_HEADER = "| slice | status | cases | baseline | candidate | Δ | lower bound | q BY (regr.) | reason |"
_SLICE_RULE = "|---|---|---:|---:|---:|---:|---:|---:|---|"


def _slice_row(s: SliceResult) -> str:
    return (
        f"| `{slice_key(s.length, s.position)}` | {s.status.value} | {s.n_cases} | "
        f"{plain(s.acc_baseline)} | {plain(s.acc_candidate)} | {signed(s.delta)} | "
        f"{signed(s.lower)} | {q_value(s.q_reg)} | {md_cell(s.reason)} |"
    )


def _slice_lines(ordered: Sequence[SliceResult]) -> list[str]:
    """Failing and inconclusive slices in a table, passing ones folded."""
    problems = [s for s in ordered if s.status is not SliceStatus.PASS]
    lines = ["", "### Failing and inconclusive slices", ""]
    if problems:
        lines += [_SLICE_HEADER, _SLICE_RULE, *[_slice_row(s) for s in problems]]
    else:
        lines.append("None: every slice passes.")
    passing = [s for s in ordered if s.status is SliceStatus.PASS]
    if passing:
        lines += [
            "",
            f"<details><summary>Passing slices ({len(passing)})</summary>",
            "",
            _SLICE_HEADER,
            _SLICE_RULE,
            *[_slice_row(s) for s in passing],
            "",
            "</details>",
        ]
    return lines


def _worst_lines(result: GateResult) -> list[str]:
    lines = ["", "### Worst positions", ""]
    if not result.worst_by_length:
        return [*lines, "No complete cases to compare positions."]
    lines += [
        "| length | worst slice (lower bound) | worst-position accuracy baseline → candidate | Δ | "
        "lower bound | position range baseline → candidate |",
        "|---:|---|---|---:|---:|---|",
    ]
    for w in result.worst_by_length:
        worst = (
            "–"
            if w.slice_worst_position is None
            else f"`{slice_key(w.length, w.slice_worst_position)}` ({signed(w.slice_worst_lower)})"
        )
        lines.append(
            f"| {w.length} | {worst} | {plain(w.worst_acc_baseline)} → {plain(w.worst_acc_candidate)} "
            f"| {signed(w.worst_delta)} | {signed(w.worst_lower)} | "
            f"{plain(w.range_baseline)} → {plain(w.range_candidate)} |"
        )
    return lines


def _chars_lines(chars: Sequence[LengthChars] | None) -> list[str]:
    if not chars:
        return []
    lines = [
        "",
        "### Length in characters",
        "",
        CHARS_NOTE,
        "",
        "| length (tokens) | layouts baseline / candidate | baseline chars: mean (min–max) | "
        "candidate chars: mean (min–max) | chars per token, baseline → candidate | candidate vs "
        "baseline chars |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    lines += [
        f"| {r['length']} | {r['layouts']} | {r['baseline']} | {r['candidate']} | {r['per_token']} | "
        f"{r['change']} |"
        for r in length_char_rows(chars)
    ]
    return lines


def _oracle_lines(oracle: Sequence[OracleCounts], ordered: Sequence[SliceResult]) -> list[str]:
    """Per slice with a problem: runs with missing claims, wrong citations, forbidden answers, system
    failures by reason and missing runs, candidate / baseline."""
    lines = ["", "### Oracle: problems per slice", ""]
    by_slice: dict[str, dict[str, OracleCounts]] = {}
    for o in oracle:
        by_slice.setdefault(o.slice, {})[o.arm] = o
    order = {slice_key(s.length, s.position): i for i, s in enumerate(ordered)}
    noisy = [
        key
        for key in sorted(by_slice, key=lambda k: order.get(k, len(order)))
        if any(
            o.missing_claims
            or o.wrong_citations
            or o.system_fail
            or o.safety_hits
            or o.wrong_hits
            or o.missing
            for o in by_slice[key].values()
        )
    ]
    if not noisy:
        return [*lines, "No missing claims, wrong citations, forbidden answers or system failures."]
    lines += [
        "Runs with missing claims, wrong citations, forbidden answers by severity (safety: a prohibited "
        "claim; wrong: a superseded, overridden or ruled-out value), system failures (by reason: "
        "truncation, refusal, overflow …) and missing runs, candidate / baseline:",
        "",
        "| slice | missing claims | wrong citations | forbidden: safety | forbidden: wrong / superseded | "
        "system failures | missing |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for key in noisy:
        c, b = by_slice[key].get(CANDIDATE), by_slice[key].get(BASELINE)

        def pair(name: str, c: OracleCounts | None = c, b: OracleCounts | None = b) -> str:
            return f"{getattr(c, name) if c else 0} / {getattr(b, name) if b else 0}"

        reasons = ", ".join(f"{k} {v}" for k, v in (c.system_fail_reasons if c else {}).items()) or "–"
        lines.append(
            f"| `{key}` | {pair('missing_claims')} | {pair('wrong_citations')} | {pair('safety_hits')} | "
            f"{pair('wrong_hits')} | "
            f"{pair('system_fail')} ({md_cell(reasons)}) | {pair('missing')} |"
        )
    return lines


def _digest_lines(manifest: Mapping[str, Any]) -> list[str]:
    digests = manifest_digests(manifest)
    if not digests:
        return []
    return [
        "",
        "<details><summary>Digests</summary>",
        "",
        *(f"- `{k}`: `{v}`" for k, v in digests.items()),
        "",
        "</details>",
    ]


def render_summary(inputs: ReportInputs) -> str:
    """The Markdown pull-request comment."""
    result = inputs.result
    ordered = ordered_slices(result.slice_results)
    lines = [
        *_headline(inputs),
        *_health_lines(inputs.health),
        *_canary_lines((inputs.checks or {}).get("canaries")),
        *_safety_lines(result),
        *_slice_lines(ordered),
        *_worst_lines(result),
        *_chars_lines(inputs.chars),
        *_oracle_lines(inputs.oracle, ordered),
        *_digest_lines(inputs.manifest),
        "",
        f"Full report: `{REPORT_HTML}` · machine-readable: `{VERDICT_JSON}`, `{JUNIT_XML}`.",
        "",
    ]
    return "\n".join(lines)

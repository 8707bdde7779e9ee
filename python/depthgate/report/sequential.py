"""Sequential gating in the reports (issue #26; the looks are replayed from the records by
:mod:`depthgate.commands.sequential`): verdict.json ``sequential``, a section of summary.md and of
report.html saying at which look each slice was decided and what was not sent."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from depthgate.report.document import AnalysisContext, Section
from depthgate.report.formatting import markdown_table

__all__ = ["render_sequential_markdown", "sequential_section"]

_HEAD = ["length", "position", "decided at look", "decision", "cases sent / planned"]


def _rows(body: Mapping[str, Any]) -> list[list[str]]:
    return [
        [
            str(r["length"]),
            str(r["position"]),
            str(r["look"]),
            str(r["decision"]),
            f"{r['cases_sent']} / {r['cases_planned']}",
        ]
        for r in body["slices"]
    ]


def _looks_line(design: Mapping[str, Any]) -> str:
    return (
        "Looks at "
        + ", ".join(
            f"{c} cases (level {lv:.3g})" for c, lv in zip(design["cases"], design["levels"], strict=True)
        )
        + "."
    )


def _sent_line(body: Mapping[str, Any]) -> str:
    return (
        f"Requests sent: {body['requests_sent']} of {body['requests_planned']} planned; "
        f"{body['requests_not_sent']} not sent (decided slices get no more cases)."
    )


def _title(design: Mapping[str, Any]) -> str:
    return f"Sequential gating ({design['boundary']}, {len(design['cases'])} pre-registered looks)"


def render_sequential_markdown(body: Mapping[str, Any]) -> str:
    """The summary.md section."""
    design = body["design"]
    lines = ["", "", f"### {_title(design)}", "", _looks_line(design), ""]
    lines += markdown_table(_HEAD, _rows(body), right=(0, 2, 4))
    lines += ["", _sent_line(body), ""]
    return "\n".join(lines)


def _render_html(body: Mapping[str, Any]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in _HEAD)
    rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in _rows(body))
    return (
        f"<h2>{esc(_title(body['design']))}</h2>\n<p>{esc(_looks_line(body['design']))}</p>\n"
        f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>\n<p>{esc(_sent_line(body))}</p>\n"
    )


def sequential_section(ctx: AnalysisContext) -> Section | None:
    """The look history of a ``stop_rule = "sequential"`` run (None for any other run)."""
    if ctx.sequential is None:
        return None
    return Section(
        key="sequential",
        data=ctx.sequential,
        markdown=render_sequential_markdown(ctx.sequential),
        html=_render_html(ctx.sequential),
    )

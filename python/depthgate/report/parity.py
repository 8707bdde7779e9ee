"""Tokenizer parity in the reports (issue #37, item 1): what the check before the first request found per
arm (:mod:`depthgate.run.parity` writes ``RUN/<arm>/tokenizer_parity.json``), as verdict.json
``tokenizer_parity``, a section of summary.md and report.html and a junit.xml suite
``depthgate.parity`` (one testcase per arm: ``skipped`` when not checked). A parity that did not run is
never silent; the section never changes the verdict (a difference refused the run before it started)."""

from __future__ import annotations

import html
import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

from depthgate.report.document import AnalysisContext, Section
from depthgate.spec.limits import summarise_urls

__all__ = ["parity_section"]

PARITY_FILE = "tokenizer_parity.json"
ARMS = ("baseline", "candidate")
#: The worst status of an arm's endpoints names the arm's (one unchecked endpoint is enough).
_RANK = {"checked": 0, "no_route": 1, "unreachable": 2, "failed": 3}


def _status(entry: Mapping[str, Any]) -> str:
    """An endpoint's status, also from a file written before statuses were (route, unreachable)."""
    status = entry.get("status")
    if isinstance(status, str) and status in _RANK:
        return status
    if entry.get("unreachable"):
        return "unreachable"
    return "checked" if entry.get("route") else "no_route"


def _outcome(entry: Mapping[str, Any]) -> str:
    text = entry.get("outcome")
    if isinstance(text, str):
        return text
    if _status(entry) == "checked":
        checked, scope, route = entry.get("checked"), entry.get("scope"), entry.get("route")
        return f"{checked} prompt(s) ({scope}) tokenized identically by {route}"
    return {"unreachable": "not checked (unreachable)"}.get(_status(entry), "not checked (no tokenize route)")


def _arm_data(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    status = max((_status(e) for e in entries), key=_RANK.__getitem__, default="no_route")
    groups: dict[str, list[str]] = {}
    for entry in entries:
        groups.setdefault(_outcome(entry), []).append(str(entry.get("endpoint")))
    return {
        "status": status,
        "checked": sum(int(e.get("checked") or 0) for e in entries),
        "endpoints": len(entries),
        "policy": next((str(e["policy"]) for e in entries if e.get("policy")), None),
        "outcomes": [
            {"outcome": outcome, "endpoints": summarise_urls(urls), "count": len(urls)}
            for outcome, urls in groups.items()
        ],
    }


def _read(ctx: AnalysisContext) -> dict[str, list[Mapping[str, Any]]]:
    found: dict[str, list[Mapping[str, Any]]] = {}
    for arm in ARMS:
        path = ctx.run / arm / PARITY_FILE
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None  # an unreadable record of the check is reported as such, below
        entries: list[Mapping[str, Any]] = (
            [e for e in data if isinstance(e, Mapping)] if isinstance(data, list) else []
        )
        unreadable = {"endpoint": str(path), "status": "failed", "outcome": "unreadable record"}
        found[arm] = entries or [unreadable]
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _markdown(data: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [
        "",
        "",
        "### Tokenizer parity (the server's own tokenizer on the built prompts, before any request)",
        "",
        "| arm | status | endpoints | outcome |",
        "|---|---|---|---|",
    ]
    for arm, d in data.items():
        status = d["status"] if d["status"] == "checked" else f"**NOT CHECKED** ({d['status']})"
        for o in d["outcomes"]:
            lines.append(f"| {arm} | {status} | {_cell(o['endpoints'])} | {_cell(o['outcome'])} |")
    return "\n".join([*lines, ""])


def _html(data: Mapping[str, Mapping[str, Any]]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(arm)}</td><td>{html.escape(d['status'])}</td>"
        f"<td>{html.escape(o['endpoints'])}</td><td>{html.escape(o['outcome'])}</td></tr>"
        for arm, d in data.items()
        for o in d["outcomes"]
    )
    return (
        "<section><h2>Tokenizer parity</h2><table><tr><th>arm</th><th>status</th><th>endpoints</th>"
        f"<th>outcome</th></tr>{rows}</table></section>"
    )


def _junit(data: Mapping[str, Mapping[str, Any]]) -> Any:
    def add(root: ET.Element) -> None:
        suite = ET.SubElement(root, "testsuite", name="depthgate.parity", errors="0", failures="0", time="0")
        skipped = 0
        for arm, d in data.items():
            case = ET.SubElement(
                suite, "testcase", classname="depthgate.parity", name=f"tokenizer parity: {arm}"
            )
            text = "; ".join(f"{o['endpoints']}: {o['outcome']}" for o in d["outcomes"])
            if d["status"] == "checked":
                ET.SubElement(case, "system-out").text = text
            else:
                skipped += 1
                ET.SubElement(case, "skipped", message=f"NOT CHECKED ({d['status']}): {text}")
        suite.set("tests", str(len(data)))
        suite.set("skipped", str(skipped))
        root.set("tests", str(int(root.get("tests", "0")) + len(data)))
        root.set("skipped", str(int(root.get("skipped", "0")) + skipped))

    return add


def parity_section(ctx: AnalysisContext) -> Section | None:
    """The parity of each arm that was checked against a server (None when neither arm was: embedded
    engines build with the model's own tokenizer)."""
    found = _read(ctx)
    if not found:
        return None
    data = {arm: _arm_data(entries) for arm, entries in found.items()}
    return Section(
        key="tokenizer_parity", data=data, markdown=_markdown(data), html=_html(data), junit=_junit(data)
    )

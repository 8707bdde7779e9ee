"""The arguments of ``depthgate faults`` and ``depthgate diff-tokenizer | diff-template``, without their
modules.

Those modules import polars, the layout builder and the backends (≈ 1 s on a busy 2-core machine);
the parser of every command is built on every start, so a refusal of bad input (``depthgate build
m.toml`` with ``lengths = [10**12]``) waited for imports it never used (issue #21, item 1: exit 20 in
< 1 s). Here the arguments are declared with the handler passed in; the CLI passes a handler that
imports its module when the command runs, the modules' own ``add_parsers`` pass their functions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from depthgate.spec.paths import csv_ints, csv_list

__all__ = ["FAULT_NAMES", "add_diff_parsers", "add_faults_parser"]

Handler = Callable[[argparse.Namespace], int]

#: The six faults of DESIGN §4 and the engine crash (issue #35), in the order ``depthgate faults``
#: injects them.
FAULT_NAMES: tuple[str, ...] = (
    "tokenizer-upgrade",
    "gateway-tail-cut",
    "retriever-reorder",
    "template-preamble",
    "serializer-duplicate",
    "window-catalog",
    "engine-crash",
)


def add_faults_parser(subparsers: Any, func: Handler) -> None:
    """Add ``faults`` to the CLI's subparsers, run by ``func``."""
    p = subparsers.add_parser(
        "faults",
        help="inject the six DESIGN §4 faults on the embedded model; exit 0 only if each is caught by name",
    )
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(FAULT_NAMES)}")
    p.add_argument("--out", help="folder for the layouts and records of every run (default: a temp folder)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--cases", type=int, default=2, help="built-in cases per fault (default 2)")
    p.set_defaults(func=func)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=csv_ints, default=[1024])
    p.add_argument("--positions", type=csv_list, default=["0", "0.25", "0.5", "0.75", "1"])
    p.add_argument("--cases", type=int, default=8, help="built-in suite size (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lang", default="en", choices=["en", "zh"])
    p.add_argument("--suite", help="a suite JSON file instead of the built-in suite")
    p.add_argument("--out", help="write the JSON report to this file")
    p.add_argument("--limit", type=int, default=40, help="rows in the printed table (default 40)")


def add_diff_parsers(subparsers: Any, tokenizer_func: Handler, template_func: Handler) -> None:
    """Add ``diff-tokenizer`` and ``diff-template`` to the CLI's subparsers."""
    t = subparsers.add_parser(
        "diff-tokenizer",
        help="token-span drift of the suite's layouts between two tokenizers (exit 0 none, 10 drift)",
    )
    t.add_argument("--old", required=True, help="old tokenizer.json (or gguf:[file])")
    t.add_argument("--new", required=True, help="new tokenizer.json (or gguf:[file])")
    t.add_argument("--chat-template", help="build both with this chat template (default: raw frame)")
    _common(t)
    t.set_defaults(func=tokenizer_func)

    m = subparsers.add_parser(
        "diff-template",
        help="token-span drift of the suite's layouts between two chat templates (exit 0 none, 10 drift)",
    )
    m.add_argument("--old", required=True, help="old template (.jinja / tokenizer_config.json), or 'raw'")
    m.add_argument("--new", required=True, help="new template (.jinja / tokenizer_config.json), or 'raw'")
    m.add_argument("--tokenizer", required=True, help="tokenizer.json (or gguf:[file]) both are rendered for")
    m.add_argument(
        "--turns",
        type=int,
        default=None,
        help="build a conversation of this many turns (odd) and report each turn's drift (issue 25)",
    )
    _common(m)
    m.set_defaults(func=template_func)

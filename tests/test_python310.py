"""`requires-python = ">=3.10"` (README: "Python ≥ 3.10") on a machine that has 3.11 only.

No Python 3.10 can run here, so this reads the package's source for the one way it has broken that
promise: a name of Python 3.11 imported at run time (``from typing import Unpack`` in
``exceptions.py`` made ``import depthgate`` fail on 3.10). Imports under ``if TYPE_CHECKING:`` never
run, and every module has ``from __future__ import annotations``, so annotations may use them.
``tomllib`` (3.11) is imported only by ``spec/_compat.py``, behind its version check (``tomli``, a
dependency below 3.11, otherwise).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "depthgate"

#: What ``typing`` gained in Python 3.11 (https://docs.python.org/3/library/typing.html, "Added in 3.11").
TYPING_311 = frozenset(
    {
        "Unpack",
        "Self",
        "LiteralString",
        "Never",
        "assert_never",
        "assert_type",
        "reveal_type",
        "NotRequired",
        "Required",
        "TypeVarTuple",
        "dataclass_transform",
        "get_overloads",
        "clear_overloads",
    }
)
STDLIB_311 = frozenset({"tomllib"})


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _version_guarded(test: ast.expr) -> bool:
    """``if sys.version_info >= (3, 11):``: the branch runs only where the name exists."""
    return "version_info" in ast.unparse(test)


def violations(source: str, name: str) -> list[str]:
    """Run-time imports of a Python 3.11 name in ``source`` (module ``name``), as "name:line what"."""
    found: list[str] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and (_is_type_checking(node.test) or _version_guarded(node.test)):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, guarded)
            return
        if not guarded:
            if isinstance(node, ast.ImportFrom) and node.module in ("typing", "collections.abc"):
                found.extend(
                    f"{name}:{node.lineno} typing.{a.name}" for a in node.names if a.name in TYPING_311
                )
            elif isinstance(node, ast.Import):
                found.extend(f"{name}:{node.lineno} {a.name}" for a in node.names if a.name in STDLIB_311)
            elif isinstance(node, ast.ImportFrom) and node.module in STDLIB_311:
                found.append(f"{name}:{node.lineno} {node.module}")
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "typing"
                and node.attr in TYPING_311
            ):
                found.append(f"{name}:{node.lineno} typing.{node.attr}")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(source), False)
    return found


def test_no_module_imports_a_311_name_at_run_time() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40
    found = [v for path in modules for v in violations(path.read_text(encoding="utf-8"), str(path))]
    assert found == []


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("from typing import TypedDict, Unpack\n", True),  # the fault this exists for
        ("import typing\nx = typing.Self\n", True),
        ("import tomllib\n", True),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from typing import Unpack\n", False),
        ("import sys\nif sys.version_info >= (3, 11):\n    import tomllib\nelse:\n    import tomli\n", False),
        ("from typing import TypedDict\n", False),
    ],
)
def test_the_check_catches_the_fault(source: str, caught: bool) -> None:
    assert bool(violations(source, "m.py")) is caught, source

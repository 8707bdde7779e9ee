"""The size rules of the house, checked: no Python module of depthgate over 800 lines and no function
over 100 lines, unless its docstring says why it must stay whole (the words "stays whole" and a reason).
A file or function that grows past the rule fails here, naming itself, instead of being found by a
reader later; the checks are themselves tested with an injected fault."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "depthgate"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 100
EXEMPTION = "stays whole"


def long_files(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path.relative_to(root.parent)}: {lines} lines")
    return found


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if lines > MAX_FUNCTION_LINES and EXEMPTION not in doc:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_module_over_800_lines() -> None:
    assert long_files(PACKAGE) == []


def test_no_function_over_100_lines_without_a_reason() -> None:
    assert long_functions(PACKAGE) == []


@pytest.mark.parametrize("explained", [False, True])
def test_the_checks_catch_the_fault(tmp_path: Path, explained: bool) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    doc = f'    """It {EXEMPTION}: one state machine."""\n' if explained else ""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (package / "big.py").write_text(f"def f():\n{doc}{body}\n" + "#\n" * MAX_FILE_LINES, encoding="utf-8")
    assert long_files(package) == [f"pkg/big.py: {MAX_FILE_LINES + MAX_FUNCTION_LINES + 2 + explained} lines"]
    assert (long_functions(package) == []) is explained


def test_the_fast_tier_names_only_tests_that_exist() -> None:
    # A stale entry would silently move a slow test into `scripts/test.sh --fast`.
    import tiers

    tests = Path(tiers.__file__).resolve().parent
    for module in tiers.FULL_ONLY_MODULES:
        assert (tests / module).is_file(), module
    for test in tiers.FULL_ONLY_TESTS:
        module, name = test.split("::")
        assert f"def {name}(" in (tests / module).read_text(encoding="utf-8"), test

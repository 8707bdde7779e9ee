"""No module imports another module's private name (issue #23 item 3): neither ``from depthgate.x import
_y`` nor ``x._y`` on a depthgate module bound by an import. A private name is the module's own business;
a name two modules share gets a public name in a module both may import (``ray_engine`` once imported the
runner's ``_Run``, ``merge`` the pipeline's ``_planned_jobs``, ``run/controls`` the layouts'
``_LayoutSink``).

The rule is checked on the source (every ``.py`` file of the package, parsed), in the style of
tests/test_layering.py: the untouched package passes, and each injected violation in a copy of it is
caught, so a failure below is the injected line and nothing else. The one exception is ``_core``, the
compiled bindings module that the typed package wraps by design (DESIGN.md, STYLE.md)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGE = REPO / "python" / "depthgate"
#: Private names any module may import: the compiled core behind the typed package.
ALLOWED = frozenset({"_core"})


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(root: Path, dotted: str) -> bool:
    relative = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    base = root / relative
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in ALLOWED


def private_uses(root: Path) -> list[str]:
    """Every use of another depthgate module's private name in the package at ``root``, as
    ``file:line: what``."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        here = _module_name(root, path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules: dict[str, str] = {}  # local name -> depthgate module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "depthgate":
                        # `import depthgate.x.y` binds `depthgate`; `import depthgate.x.y as z` binds z
                        modules[alias.asname or "depthgate"] = alias.name if alias.asname else "depthgate"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "depthgate":
                source = str(node.module)
                for alias in node.names:
                    if _private(alias.name) and source != here:
                        where = path.relative_to(root.parent)
                        found.append(f"{where}:{node.lineno}: {source}.{alias.name}")
                    if _is_module(root, f"{source}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            # `records._x` or `depthgate.run.records._x`
            chain: list[str] = []
            value: ast.expr = node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in modules:
                continue
            target = ".".join([modules[value.id], *reversed(chain)])
            if target != here and _is_module(root, target):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_name() -> None:
    assert private_uses(PACKAGE) == []


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    root = tmp_path / "depthgate"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert private_uses(root) == []
    return root


@pytest.mark.parametrize(
    ("module", "line", "caught"),
    [
        # the Ray engine reaching for the runner's loop object (it did: `_Run`)
        (
            "run/ray_engine.py",
            "from depthgate.run.execute import _MAX_FAILOVERS",
            "run.execute._MAX_FAILOVERS",
        ),
        # a command importing a helper the pipeline keeps to itself (merge did: `_planned_jobs`)
        (
            "commands/merge.py",
            "from depthgate.commands.pipeline import _freeze_manifest as freeze",
            "commands.pipeline._freeze_manifest",
        ),
        # through a module bound by `from package import module` (controls did: `_layouts._LayoutSink`)
        (
            "run/controls.py",
            "from depthgate.layout import layouts as lay\nX = lay._GapFiller",
            "layout.layouts._GapFiller",
        ),
        # through a dotted `import depthgate.x.y`
        (
            "judge/health/run_health.py",
            "import depthgate.spec.system\nY = depthgate.spec.system._url_identity",
            "_url_identity",
        ),
    ],
    ids=["from-import", "from-import-aliased", "module-attribute", "dotted-attribute"],
)
def test_an_injected_private_use_is_caught(package_copy: Path, module: str, line: str, caught: str) -> None:
    path = package_copy / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")
    found = private_uses(package_copy)
    assert len(found) == 1 and caught in found[0] and module in found[0], found


def test_a_modules_own_private_names_and_the_core_are_allowed(package_copy: Path) -> None:
    path = package_copy / "run" / "execute.py"
    path.write_text(
        path.read_text(encoding="utf-8")
        + "\nfrom depthgate import _core as core_again\nfrom depthgate.run.execute import _MAX_FAILOVERS\n",
        encoding="utf-8",
    )
    assert private_uses(package_copy) == []

"""The judge's subpackages each show one public face (issue #38): every subpackage of
``depthgate.judge`` says in its ``__init__`` what it holds and lists its public names in ``__all__``,
the face imports only its own modules, and code outside a subpackage imports from the face, never
from a module behind it (a test may reach a private helper, a name with a leading underscore). There
is no flat module beside the subpackages and no re-export hub: each face name comes from the one
module that defines it. The layering of the subpackages is pyproject.toml's import-linter contract
(tests/test_layering.py); the checks here are themselves tested with an injected fault."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JUDGE = REPO / "python" / "depthgate" / "judge"
#: Where importers live: the package, the tests and the scripts.
SOURCES = ("python", "tests", "scripts")


def subpackages(judge: Path) -> list[str]:
    return sorted(p.parent.name for p in judge.glob("*/__init__.py"))


def face_faults(judge: Path) -> list[str]:
    """What is wrong with the faces: a missing docstring or ``__all__``, an import from outside the
    subpackage, a listed name the face does not import, or a module of judge/ outside a subpackage."""
    found = [
        f"judge/{p.name}: a module outside every subpackage"
        for p in judge.glob("*.py")
        if p.name != "__init__.py"
    ]
    for name in subpackages(judge):
        tree = ast.parse((judge / name / "__init__.py").read_text(encoding="utf-8"))
        if not ast.get_docstring(tree):
            found.append(f"judge/{name}: no docstring saying what it holds")
        imported: set[str] = set()
        listed: list[str] | None = None
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                if not (node.module or "").startswith(f"depthgate.judge.{name}."):
                    found.append(f"judge/{name}: the face imports {node.module}")
                imported.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                listed = [ast.literal_eval(e) for e in getattr(node.value, "elts", [])]
        if listed is None:
            found.append(f"judge/{name}: no __all__")
        else:
            found.extend(
                f"judge/{name}: __all__ lists {n}, not imported" for n in listed if n not in imported
            )
    return found


def behind_the_face(root: Path, judge: Path) -> list[str]:
    """Imports of a public name from a module behind a subpackage's face, by a file outside it."""
    packages = set(subpackages(judge))
    found = []
    for source in SOURCES:
        for path in sorted((root / source).rglob("*.py")):
            inside = path.relative_to(judge).parts[0] if path.is_relative_to(judge) else None
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not (isinstance(node, ast.ImportFrom) and node.module):
                    continue
                parts = node.module.split(".")
                if parts[:2] != ["depthgate", "judge"] or len(parts) < 3:
                    continue
                if parts[2] not in packages:
                    found.append(
                        f"{path.relative_to(root)}:{node.lineno} imports {node.module} (no such subpackage)"
                    )
                elif len(parts) > 3 and parts[2] != inside:
                    public = [a.name for a in node.names if not a.name.startswith("_")]
                    if public:
                        where = f"{path.relative_to(root)}:{node.lineno}"
                        found.append(f"{where} imports {', '.join(public)} from {node.module}")
    return found


def test_every_subpackage_shows_one_face() -> None:
    assert subpackages(JUDGE), "judge/ has no subpackages"
    assert face_faults(JUDGE) == []


def test_no_importer_reaches_behind_a_face() -> None:
    assert behind_the_face(REPO, JUDGE) == []


@pytest.mark.parametrize("fault", ["flat-module", "no-all", "behind-the-face", "old-module"])
def test_the_checks_catch_the_fault(tmp_path: Path, fault: str) -> None:
    judge = tmp_path / "python" / "depthgate" / "judge"
    (judge / "bounds").mkdir(parents=True)
    (judge / "__init__.py").write_text('"""The judge."""\n', encoding="utf-8")
    (judge / "bounds" / "intervals.py").write_text("def wilson_lower(): ...\n", encoding="utf-8")
    face = '"""Bounds."""\nfrom depthgate.judge.bounds.intervals import wilson_lower\n'
    listed = '__all__ = ["wilson_lower"]\n'
    (judge / "bounds" / "__init__.py").write_text(
        face + ("" if fault == "no-all" else listed), encoding="utf-8"
    )
    user = tmp_path / "tests" / "test_x.py"
    user.parent.mkdir()
    user.write_text("from depthgate.judge.bounds import wilson_lower\n", encoding="utf-8")
    if fault == "flat-module":
        (judge / "stats.py").write_text("from depthgate.judge.bounds import wilson_lower\n", encoding="utf-8")
    elif fault == "behind-the-face":
        user.write_text("from depthgate.judge.bounds.intervals import wilson_lower\n", encoding="utf-8")
    elif fault == "old-module":
        user.write_text("from depthgate.judge.stats import wilson_lower\n", encoding="utf-8")
    faults = face_faults(judge) + behind_the_face(tmp_path, judge)
    assert len(faults) == 1, faults
    user.write_text("from depthgate.judge.bounds.intervals import _private\n", encoding="utf-8")
    (judge / "stats.py").unlink(missing_ok=True)
    (judge / "bounds" / "__init__.py").write_text(face + listed, encoding="utf-8")
    assert face_faults(judge) + behind_the_face(tmp_path, judge) == []

"""The sequential tables of docs/gate-calibration.md §8 are what their shipped data renders.

Each table sits between ``<!-- marker:begin/end -->`` lines and was written by
``scripts/sequential_calibration.py --render`` (or ``--frontier``) from a JSONL file in docs/. Here every
one is rendered again from that file into a copy of the doc: a table edited by hand, or data that no
longer matches its table, makes the copy differ from the shipped doc. (The simulations themselves take
minutes a cell; the rows are their aggregates, so the re-derivation is from the rows, the commands that
made them are in the doc beside each table.)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "gate-calibration.md"

# marker -> the command line that wrote it (docs/gate-calibration.md says which one beside each table)
RENDERS = {
    "sequential-comparison": ["--no-futility", "--results", "docs/sequential-comparison.jsonl", "--render"],
    "sequential-grid": ["--results", "docs/sequential-calibration.jsonl", "--render"],
    "sequential-grid-looks-0.5-1": [
        *("--results", "docs/sequential-calibration-two-looks.jsonl", "--looks", "0.5", "1.0", "--render"),
    ],
    "sequential-spending": [
        *("--results", "docs/sequential-calibration-spending.jsonl", "--render"),
        *("--shipped", "power-4", "--marker", "sequential-spending"),
    ],
    "sequential-frontier": ["--results", "docs/sequential-calibration-frontier.jsonl", "--frontier"],
    "sequential-late-looks": [
        *("--results", "docs/sequential-calibration-late-looks.jsonl", "--render", "--shipped", "power-5"),
        *(
            "--looks",
            "0.3",
            "0.4",
            "0.5",
            "0.6",
            "0.7",
            "0.8",
            "0.9",
            "1.0",
            "--marker",
            "sequential-late-looks",
        ),
    ],
}


@pytest.mark.parametrize("marker", sorted(RENDERS))
def test_doc_table_is_what_its_data_renders(
    marker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    monkeypatch.chdir(REPO)
    import calibration_cli
    import sequential_calibration

    copy = tmp_path / "gate-calibration.md"
    shutil.copy(DOC, copy)
    monkeypatch.setattr(calibration_cli, "DOC", copy)
    assert f"<!-- {marker}:begin -->" in DOC.read_text(), marker
    sequential_calibration.main(RENDERS[marker])
    assert copy.read_text() == DOC.read_text(), f"{marker}: the table differs from what its data renders"
    # the script keeps its design in module globals: leave them as a fresh import would
    sys.modules.pop("sequential_calibration")


def test_a_changed_number_in_the_data_changes_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: one share moved by .05 in a copy of the late-looks data renders a
    table that is no longer the shipped one."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    monkeypatch.chdir(REPO)
    import calibration_cli
    import sequential_calibration

    rows = [json.loads(line) for line in (REPO / "docs" / "sequential-calibration-late-looks.jsonl").open()]
    rows[-1]["power-5"]["share"] += 0.05
    data = tmp_path / "late.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    copy = tmp_path / "gate-calibration.md"
    shutil.copy(DOC, copy)
    monkeypatch.setattr(calibration_cli, "DOC", copy)
    argv = RENDERS["sequential-late-looks"]
    sequential_calibration.main([data.as_posix() if a.endswith("late-looks.jsonl") else a for a in argv])
    assert copy.read_text() != DOC.read_text()
    sys.modules.pop("sequential_calibration")

"""Reports from one document (issue 23 item 1): the gate and every analysis beside it (controls, position
science, noise floor) contribute sections; one writer renders verdict.json, summary.md, report.html and
junit.xml once and swaps them in as a set. Checked through the CLI on a real run folder (the PerfectReader
stub of tests/test_verdict_trust.py on 127.0.0.1) and with failures injected mid-write."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from test_report import MANIFEST, PLAN, synthetic_scored
from test_verdict_trust import PerfectReader, _matrix

from depthgate.commands.cli import main
from depthgate.commands.pipeline import gate_run
from depthgate.exceptions import ExitCode
from depthgate.judge.gate import GateResult, gate
from depthgate.report import analyses, writer
from depthgate.report.document import Section
from depthgate.report.report import write_reports
from helpers import free_port

REPORT_FILES = {
    "verdict.json",
    "summary.md",
    "junit.xml",
    "report.html",
    "heatmap_delta.png",
    "heatmap_accuracy.png",
}


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run with controls (PerfectReader: every answer right), reported once by `depthgate run`."""
    tmp = tmp_path_factory.mktemp("document")
    port = free_port()
    matrix, run = _matrix(tmp, port), tmp / "run"
    with PerfectReader(port):
        assert main(["run", str(matrix), "--out", str(run)]) == ExitCode.PASS
    return run


def _opens(run: Path, action: Any) -> list[tuple[str, str]]:
    """(file name, "r"/"w") of every file opened under ``run`` while ``action()`` runs (audit hook)."""
    seen: list[tuple[str, str]] = []
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not active[0] or not isinstance(args[0], str | Path):
            return
        path = Path(args[0])
        if run not in path.parents:
            return
        mode, flags = args[1], args[2]
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & 0o3 != 0
        )
        seen.append((path.name, "w" if writing else "r"))

    sys.addaudithook(hook)
    try:
        action()
    finally:
        active[0] = False
    return seen


def test_gate_writes_each_report_file_once_and_reads_none(run_folder: Path) -> None:
    before = {p.name: p.read_bytes() for p in (run_folder / "report").iterdir()}
    assert set(before) == REPORT_FILES
    assert {"controls", "position"} <= set(json.loads(before["verdict.json"]))
    # The pipeline's gate (the CLI then reads verdict.json once, to print its console lines).
    opened = _opens(run_folder, lambda: gate_run(run_folder))
    # One temporary file per report file (``.<name>.XXXX.tmp``, then renamed): one write each.
    temps = [re.fullmatch(r"\.(.+)\.[^.]+\.tmp", name) for name, how in opened if how == "w"]
    writes = Counter(m.group(1) for m in temps if m is not None)
    assert writes == Counter(dict.fromkeys(REPORT_FILES, 1)), opened
    # No report file is opened again to be patched (reading or writing it under its own name).
    assert not [(n, how) for n, how in opened if n in REPORT_FILES], opened
    after = {p.name: p.read_bytes() for p in (run_folder / "report").iterdir()}
    assert after == before  # the same bytes as `depthgate run` wrote
    assert not [p for p in run_folder.iterdir() if p.name.startswith(".report")]  # no staging left


def test_a_registered_analysis_reaches_every_file_in_the_same_write(
    run_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def mark(root: ET.Element) -> None:
        ET.SubElement(root, "testsuite", name="depthgate.extra", tests="0")

    def extra(ctx: Any) -> Section:
        return Section(
            key="noise_floor",
            data={"marker": ctx.run.name},
            markdown="\n### Extra analysis\n",
            html='<h2 id="extra">Extra</h2>\n',
            junit=mark,
            console=("extra: done",),
        )

    monkeypatch.setattr(analyses, "ANALYSES", (*analyses.ANALYSES, extra))
    out = tmp_path / "report"
    main(["gate", str(run_folder), "--report-dir", str(out)])
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["noise_floor"] == {"marker": "run"} and verdict["position"] is not None
    summary = (out / "summary.md").read_text()
    assert summary.index("### Position science") < summary.index("### Extra analysis")
    page = (out / "report.html").read_text()
    assert page.index('id="position-science"') < page.index('id="extra"') < page.index("<!-- depthgate:")
    assert ET.parse(out / "junit.xml").getroot().find("testsuite[@name='depthgate.extra']") is not None


@pytest.fixture
def old_and_new(tmp_path: Path) -> tuple[Path, dict[str, bytes], GateResult, pl.DataFrame]:
    scored = synthetic_scored()
    out = tmp_path / "run" / "report"
    write_reports(gate(scored, PLAN), scored, out, manifest=MANIFEST)
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    return out, old, gate(synthetic_scored(seed=1), PLAN), scored


def _state(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_a_failure_mid_write_leaves_the_old_set(
    old_and_new: tuple[Path, dict[str, bytes], GateResult, pl.DataFrame], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, old, other, scored = old_and_new
    real = writer.atomic_write
    calls: list[str] = []

    def third_fails(path: Path, data: bytes, *, fsync: bool = False) -> Path:
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, data, fsync=fsync)

    monkeypatch.setattr(writer, "atomic_write", third_fails)
    with pytest.raises(OSError, match="No space"):
        write_reports(other, scored, out, manifest=MANIFEST)
    assert _state(out) == old
    assert [p.name for p in out.parent.iterdir()] == ["report"]  # no staging folder left


def test_a_failure_at_the_swap_leaves_the_old_set(
    old_and_new: tuple[Path, dict[str, bytes], GateResult, pl.DataFrame], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, old, other, scored = old_and_new

    def refuse(a: Path, b: Path) -> bool:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer, "_exchange", refuse)
    with pytest.raises(OSError, match="Input/output"):
        write_reports(other, scored, out, manifest=MANIFEST)
    assert _state(out) == old
    assert [p.name for p in out.parent.iterdir()] == ["report"]


def test_the_swap_without_renameat2_gives_the_new_set(
    old_and_new: tuple[Path, dict[str, bytes], GateResult, pl.DataFrame], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, old, other, scored = old_and_new
    new_dir = out.parent / "fresh"
    write_reports(other, scored, new_dir, manifest=MANIFEST)
    new = _state(new_dir)
    assert new != old and set(new) == set(old)
    monkeypatch.setattr(writer, "_exchange", lambda a, b: False)
    write_reports(other, scored, out, manifest=MANIFEST)
    assert _state(out) == new
    assert sorted(p.name for p in out.parent.iterdir()) == ["fresh", "report"]


def test_a_killed_writer_leaves_the_old_set(
    old_and_new: tuple[Path, dict[str, bytes], GateResult, pl.DataFrame],
) -> None:
    """A process killed (os._exit, no cleanup) after half the new files are written: the old set stays."""
    out, old, _, _ = old_and_new
    script = f"""
import os
from depthgate.judge.gate.release import gate
from depthgate.report import writer
from depthgate.report.report import write_reports
from test_report import MANIFEST, PLAN, synthetic_scored
real, calls = writer.atomic_write, []
def dies(path, data, *, fsync=False):
    calls.append(path)
    if len(calls) == 4:
        os._exit(9)
    return real(path, data, fsync=fsync)
writer.atomic_write = dies
scored = synthetic_scored(seed=1)
write_reports(gate(scored, PLAN), scored, {str(out)!r}, manifest=MANIFEST)
"""
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=tests, env=_env(tests), timeout=300)
    assert done.returncode == 9
    assert _state(out) == old
    left = [p for p in out.parent.iterdir() if p.name != "report"]
    assert len(left) == 1 and left[0].name.startswith(".report.new-")  # hidden, beside it, never in it
    assert len(list(left[0].iterdir())) == 3  # three files written before the kill
    # The next writer removes the dead writer's staging folder, and keeps a live writer's (this
    # process's pid stands for a gate of the same folder running at the same time).
    live = out.parent / f".report.new-{os.getpid()}-busy"
    live.mkdir()
    scored = synthetic_scored(seed=1)
    write_reports(gate(scored, PLAN), scored, out, manifest=MANIFEST)
    assert sorted(p.name for p in out.parent.iterdir()) == [live.name, "report"]


def _env(tests: Path) -> dict[str, str]:
    env = dict(os.environ)
    # this folder (test_report) and tests/ (helpers, fixtures_paths) for the child's imports
    folders = [str(tests), str(tests / "report")]
    env["PYTHONPATH"] = os.pathsep.join([*folders, *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_a_folder_holding_other_files_keeps_them(tmp_path: Path) -> None:
    scored = synthetic_scored()
    (tmp_path / "notes.txt").write_text("mine")
    write_reports(gate(scored, PLAN), scored, tmp_path, manifest=MANIFEST)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert {p.name for p in tmp_path.iterdir()} >= REPORT_FILES
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_symlinked_report_folder_stays_a_link(tmp_path: Path) -> None:
    scored = synthetic_scored()
    target = tmp_path / "reports" / "today"
    target.mkdir(parents=True)
    link = tmp_path / "report"
    link.symlink_to(target)
    write_reports(gate(scored, PLAN), scored, link, manifest=MANIFEST)
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert {p.name for p in target.iterdir()} == REPORT_FILES
    assert sorted(p.name for p in target.parent.iterdir()) == ["today"]

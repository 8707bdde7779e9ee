"""An arm on many replicas, all down: every console line summarises the endpoints (issue #21, item 1).

With 10,000 endpoints per arm, every retry line printed all 10,000 URLs and the summary one line per
endpoint. Here 20 replicas on closed ports of 127.0.0.1 (nothing listens: connection refused at once):
the run ends INFRA (exit 30), and no stderr line names more than a few of the URLs; the per-endpoint
summary is at most 8 lines per arm plus one line for the rest.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from helpers import free_port, stub_matrix

REPLICAS = 20


def test_twenty_dead_replicas_are_summarised_on_every_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ports: set[int] = set()
    while len(ports) < REPLICAS:
        ports.add(free_port())
    urls = [f"http://127.0.0.1:{port}" for port in sorted(ports)]
    matrix = tmp_path / "many.toml"
    listed = ", ".join(f'"{u}"' for u in urls)
    matrix.write_text(
        stub_matrix("many", where=f"endpoints = [{listed}]", lengths="[512]", arm="window = 1024")
    )
    code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls", "--progress"])
    err = capsys.readouterr().err
    assert code == ExitCode.INFRA, err
    url = re.compile(r"http://127\.0\.0\.1:\d+")
    lines = err.splitlines()
    assert any("transient errors" in line for line in lines), err  # the retry line was printed
    for line in lines:
        assert len(url.findall(line)) <= 4, line
    # One set of per-endpoint counts for the run (both arms share these replicas): 8 lines at most, then
    # one line for the rest.
    per_endpoint = [line for line in lines if line.startswith("depthgate: http")]
    assert len(per_endpoint) <= 8, per_endpoint
    assert any(line.startswith("depthgate: 12 more endpoints") for line in lines), err
    # The tokenizer parity check names the replicas it could not reach in one summarised line per arm.
    parity = [line for line in lines if line.startswith("tokenizer parity: baseline")]
    assert len(parity) == 1 and "not checked (unreachable" in parity[0], parity

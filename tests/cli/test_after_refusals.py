"""``depthgate run --after`` refused before any work (issue #37, item 5): a wrong ``--after`` folder is
exit 20 naming ``--after`` before a layout is built or a request sent (``/tokenize`` included), and the
``--out`` folder is left absent (nothing written: no suite.json, no layouts, no tokenizer parity).

The server behind 127.0.0.1 is a **stub** (labelled as such, not a model): a vLLM-shaped server that
decodes the prompt ids with the GPT-2 tokenizer and answers each case's question; it counts every
request it receives, so a refusal that asked it anything is seen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import StubServer, reading_handler, stub_matrix

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
CASES = 8


class CountingReader(StubServer):
    """Answers every case with its true value; ``requests`` counts every request (any route)."""

    def __init__(self) -> None:
        answers = {
            c.query: c.required_claims[0].aliases[0] if c.required_claims else "not stated"
            for c in builtin_suite(CASES).cases
        }
        base = reading_handler({"good": Tokenizer.from_file(str(GPT2))}, answers)
        lock = threading.Lock()
        counter = self

        class Handler(base):  # type: ignore[valid-type, misc]
            def parse_request(self) -> bool:
                with lock:
                    counter.requests += 1
                return bool(super().parse_request())

        self.requests = 0
        super().__init__(Handler)


def _matrix(folder: Path, port: int, name: str = "after-stub") -> Path:
    text = stub_matrix(name, where=f'endpoint = "http://127.0.0.1:{port}"', cases=CASES, resamples=499)
    text += 'stop_rule = "sequential"\nlooks = [0.5, 1.0]\n'
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def rounds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, CountingReader]]:
    """Round 1 of a sharded sequential run (two shards and their merge) and an unsharded run of the same
    matrix, against a stub that stays up for the module."""
    root = tmp_path_factory.mktemp("after")
    server = CountingReader().__enter__()
    matrix = _matrix(root, server.port)
    base = ["run", str(matrix), "--no-controls"]
    for i in (1, 2):
        assert main([*base, "--shard", f"{i}/2", "--out", str(root / f"shard{i}")]) == ExitCode.PASS
    assert main(["merge", str(root / "shard1"), str(root / "shard2"), "--out", str(root / "merged1")]) == 0
    main([*base, "--out", str(root / "whole")])  # its verdict does not matter here: a finished run folder
    assert (root / "whole" / "report" / "verdict.json").is_file()
    _matrix(root, server.port, name="other-matrix")
    (root / "empty").mkdir()
    (root / "afile").write_text("not a folder\n")
    yield root, server
    server.__exit__(None, None, None)


def _argv(
    root: Path, *, matrix: str = "after-stub", shard: str = "1/2", after: str, aa: bool = False
) -> list[str]:
    return [
        "run", str(root / f"{matrix}.toml"), "--no-controls", "--shard", shard, "--after", str(root / after),
        *(["--aa"] if aa else []),
    ]  # fmt: skip


WRONG_AFTER: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "missing": (lambda r: _argv(r, after="nothing-here"), ("nothing-here", "does not exist")),
    "empty": (lambda r: _argv(r, after="empty"), ("empty", "manifest.json")),
    "a-file": (lambda r: _argv(r, after="afile"), ("afile", "not a folder")),
    "another-matrix": (lambda r: _argv(r, matrix="other-matrix", after="merged1"), ("another run",)),
    "another-shard-count": (lambda r: _argv(r, shard="1/3", after="merged1"), ("2 shards", "1/3")),
    "an-unsharded-run": (lambda r: _argv(r, after="whole"), ("not the merge",)),
    "a-shard-not-a-merge": (lambda r: _argv(r, after="shard1"), ("shard 1/2", "merge")),
    "with-aa": (lambda r: _argv(r, after="merged1", aa=True), ("--aa",)),
}


@pytest.mark.parametrize("case", list(WRONG_AFTER), ids=list(WRONG_AFTER))
def test_a_wrong_after_folder_is_refused_before_any_work(
    rounds: tuple[Path, CountingReader], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    root, server = rounds
    make, fragments = WRONG_AFTER[case]
    out = tmp_path / "out"
    before = server.requests
    capsys.readouterr()
    code = main([*make(root), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err
    assert "--after" in err and "fix" in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert server.requests == before, f"{server.requests - before} request(s) sent before the refusal"
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))

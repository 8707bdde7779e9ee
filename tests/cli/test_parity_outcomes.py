"""Tokenizer parity never off without a trace (issue #37, item 1), through the CLI against stub servers on
127.0.0.1 (labelled stand-ins, not models: ``/v1/completions`` answers "not stated" and echoes the ids;
the tokenize routes tokenize with the real GPT-2 tokenizer, or misbehave as each test says).

* A ``/tokenize`` that answers HTTP 500, HTML, JSON without ``tokens`` or hangs is retried, then refuses
  the run by default (``runtime.tokenizer_parity = "refuse_on_failure"``: exit 30, nothing sent, no
  folder left); it used to be recorded "unreachable, 0 checked" and the run sent everything.
* A route that fails twice and then answers is checked (the retries).
* ``"best_effort"``: the run goes on, and verdict.json, summary.md and junit.xml say per arm that parity
  was not checked and why.
* A server with no route at all runs "not checked" by default, said in every report (it used to be on
  the console and in the arm's parity file only); ``"required"`` refuses it (exit 22).
* The ``vllm-server`` backend finds llama-cpp-python's ``/extras/tokenize`` (it never tried it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from fixtures_paths import tokenizers_dir
from helpers import ModelsHandler, StubServer, completion, read_verdict, stub_matrix

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
RAN = (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE)

#: (handler, route, body, times the route was called) -> True when the behaviour answered.
Behaviour = Callable[[ModelsHandler, str, Any, int], bool]


class Server(StubServer):
    """Completions as :class:`helpers.NotStatedReader`; ``routes`` are the tokenize routes it has (others
    404); ``behaviour`` may answer a tokenize call itself (a fault) before the real tokenizer does."""

    def __init__(self, routes: tuple[str, ...], behaviour: Behaviour | None = None) -> None:
        tokenizer = Tokenizer.from_file(str(GPT2))
        self.completions = 0
        calls: dict[str, int] = {}
        lock = threading.Lock()
        server = self

        class Handler(ModelsHandler):
            max_model_len = 1024
            serves_tokenize = True

            def do_POST(self) -> None:
                body = self.read_json()
                if self.path in self.tokenizer_routes:
                    with lock:
                        calls[self.path] = calls.get(self.path, 0) + 1
                        n = calls[self.path]
                    if self.path not in routes:
                        self.send_json({"detail": "Not Found"}, status=404)
                    elif behaviour is None or not behaviour(self, self.path, body, n):
                        text = body.get("prompt", body.get("input", body.get("content")))
                        self.send_json({"tokens": tokenizer.encode(text).ids})
                    return
                with lock:
                    server.completions += 1
                self.send_json(completion(body["model"], " not stated", list(body["prompt"])))

        super().__init__(Handler)


def _run(
    tmp_path: Path, server: Server, *, runtime: str = "", backend: str = "vllm-server"
) -> tuple[int, Path]:
    arm = "runtime = { timeout_s = 1.0" + (f", {runtime}" if runtime else "") + " }"
    text = stub_matrix("parity", where=f'endpoint = "http://127.0.0.1:{server.port}"', arm=arm)
    text = text.replace('backend = "vllm-server"', f'backend = "{backend}"')
    matrix = tmp_path / "parity.toml"
    matrix.write_text(text, encoding="utf-8")
    run = tmp_path / "run"
    with server:
        code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
    return code, run


def _status_500(handler: ModelsHandler, route: str, body: Any, n: int) -> bool:
    handler.send_json({"error": {"message": "tokenizer worker crashed"}}, status=500)
    return True


def _html(handler: ModelsHandler, route: str, body: Any, n: int) -> bool:
    data = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
    handler.send_response(200)
    handler.send_header("Content-Type", "text/html")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
    return True


def _no_tokens(handler: ModelsHandler, route: str, body: Any, n: int) -> bool:
    handler.send_json({"count": 12, "max_model_len": 1024})
    return True


def _hangs(handler: ModelsHandler, route: str, body: Any, n: int) -> bool:
    time.sleep(2.5)  # past the arm's timeout_s of 1 s
    return _no_tokens(handler, route, body, n)


@pytest.mark.parametrize(
    ("behaviour", "said"),
    [
        (_status_500, "HTTP 500"),
        (_html, "non-JSON"),
        (_no_tokens, "no token list"),
        (_hangs, "timeout"),
    ],
    ids=["http-500", "html", "json-without-tokens", "hangs"],
)
def test_a_failing_tokenize_route_is_retried_then_refuses_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], behaviour: Behaviour, said: str
) -> None:
    server = Server(("/tokenize",), behaviour)
    code, run = _run(tmp_path, server)
    err = capsys.readouterr().err
    assert code == ExitCode.INFRA, err[-2000:]
    assert "tokenizer parity at http://127.0.0.1:" in err and "the tokenize route failed 3 tries" in err
    assert said in err and "tokenizer_parity = 'refuse_on_failure', so nothing was sent" in err
    assert "baseline.runtime.tokenizer_parity" in err and "best_effort" in err  # the field and the fix
    assert server.completions == 0 and not run.exists()


def test_a_hung_tokenize_route_is_cut_at_the_parity_limit_not_the_request_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arm's request ``timeout_s`` (60 s here, 300 s by default) is sized for generating; a hung
    tokenize route is cut at parity's own limit (``TOKENIZE_TIMEOUT_S``, 30 s; 1 s here against a
    route that hangs 2.5 s), so the run refuses in seconds with "timeout" named. It used to wait the
    request timeout three times (the route answers after 2.5 s here, so the old code reported its late
    answer's missing token list instead)."""
    monkeypatch.setattr("depthgate.run.parity.TOKENIZE_TIMEOUT_S", 1.0)
    server = Server(("/tokenize",), _hangs)
    text = stub_matrix(
        "parity", where=f'endpoint = "http://127.0.0.1:{server.port}"', arm="runtime = { timeout_s = 60.0 }"
    )
    matrix = tmp_path / "parity.toml"
    matrix.write_text(text, encoding="utf-8")
    with server:
        code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls"])
    err = capsys.readouterr().err
    assert code == ExitCode.INFRA, err[-2000:]
    assert "the tokenize route failed 3 tries: timeout: tokenize (1 s)" in err
    assert server.completions == 0 and not (tmp_path / "run").exists()


def test_a_route_that_fails_twice_then_answers_is_checked(tmp_path: Path) -> None:
    server = Server(("/tokenize",), lambda h, route, body, n: n <= 2 and _status_500(h, route, body, n))
    code, run = _run(tmp_path, server)
    assert code in RAN
    parity = read_verdict(run)["tokenizer_parity"]
    assert parity["baseline"]["status"] == parity["candidate"]["status"] == "checked"
    assert parity["baseline"]["checked"] > 0


def test_best_effort_runs_and_every_report_says_parity_was_not_checked(tmp_path: Path) -> None:
    server = Server(("/tokenize",), _status_500)
    code, run = _run(tmp_path, server, runtime='tokenizer_parity = "best_effort"')
    assert code in RAN and server.completions > 0
    parity = read_verdict(run)["tokenizer_parity"]
    for arm in ("baseline", "candidate"):
        assert parity[arm]["status"] == "failed" and parity[arm]["policy"] == "best_effort"
        (outcome,) = parity[arm]["outcomes"]
        assert "the tokenize route failed 3 tries" in outcome["outcome"] and "HTTP 500" in outcome["outcome"]
    summary = (run / "report" / "summary.md").read_text(encoding="utf-8")
    assert "### Tokenizer parity" in summary and summary.count("**NOT CHECKED** (failed)") == 2
    junit = (run / "report" / "junit.xml").read_text(encoding="utf-8")
    assert 'name="depthgate.parity"' in junit and junit.count('<skipped message="NOT CHECKED (failed)') == 2


def test_a_server_without_a_route_runs_unchecked_and_every_report_says_so(tmp_path: Path) -> None:
    server = Server(())
    code, run = _run(tmp_path, server)
    assert code in RAN
    parity = read_verdict(run)["tokenizer_parity"]
    (outcome,) = parity["candidate"]["outcomes"]
    assert parity["candidate"]["status"] == "no_route"
    for tried in ("/tokenize HTTP 404", "/v1/tokenize HTTP 404", "/extras/tokenize HTTP 404"):
        assert tried in outcome["outcome"]
    assert "**NOT CHECKED** (no_route)" in (run / "report" / "summary.md").read_text(encoding="utf-8")
    junit = (run / "report" / "junit.xml").read_text(encoding="utf-8")
    assert '<skipped message="NOT CHECKED (no_route)' in junit
    assert json.loads((run / "candidate" / "tokenizer_parity.json").read_text())[0]["status"] == "no_route"


def test_required_parity_refuses_a_server_without_a_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = Server(())
    code, run = _run(tmp_path, server, runtime='tokenizer_parity = "required"')
    err = capsys.readouterr().err
    assert code == ExitCode.TOKENIZER_MISMATCH, err[-2000:]
    assert "tokenizer_parity = 'required'" in err and "no tokenize route" in err
    assert server.completions == 0 and not run.exists()


def test_the_vllm_server_backend_finds_the_extras_tokenize_route(tmp_path: Path) -> None:
    server = Server(("/extras/tokenize",))
    code, run = _run(tmp_path, server)
    assert code in RAN
    (outcome,) = read_verdict(run)["tokenizer_parity"]["baseline"]["outcomes"]
    assert outcome["outcome"].endswith("tokenized identically by /extras/tokenize")

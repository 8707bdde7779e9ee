"""Only the model's answers are scored (issue #37, item 2), through the CLI against a stub server on
127.0.0.1 (a labelled stand-in, not a model: it decodes the prompt ids with GPT-2 and answers each
case's question with its true value, a perfect reader, so a verdict depends only on the answers' shape).

* A 200 with ``text: ""`` and ``completion_tokens: 0`` (echo and count correct) is ``empty_completion``:
  retried, and the retry's real answer is scored; it used to be recorded ``ok`` and scored as the
  model's failure (FAIL).
* A 200 without ``choices`` is ``malformed_answer``: retried, then a named serving failure of the
  candidate (FAIL_SYSTEM, exit 13) with the server's own words in the record, its API key and the
  prompt kept out; it used to be ``infra_error`` named only ``BackendError`` (INFRA, exit 30).
* Answers that contradict their own counts (text with ``completion_tokens: 0``, generated ids of another
  number than ``completion_tokens``) are ``malformed_answer`` the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.run.records import read_records
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import ModelsHandler, StubServer, answer_in, completion, read_verdict, stub_matrix

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
CASES = 20
"""Enough cases for two identical arms to PASS at margin 0.20; a failing candidate needs fewer."""
FEW = 6
KEY = "sk-stub-secret-0123456789"


def _placed(cases: int) -> int:
    return sum(1 for c in builtin_suite(cases).cases if c.evidence)


#: (model, ids, decoded text, times this prompt was seen) -> the answer body, or None for a good one.
Fault = Callable[[str, list[int], str, int], "dict[str, Any] | None"]


class Reader(StubServer):
    """Models "good" and "bad" read their prompt ids with GPT-2 and answer correctly; ``fault`` may
    replace the answer of model "bad" (the candidate)."""

    def __init__(self, fault: Fault, cases: int) -> None:
        tokenizer = Tokenizer.from_file(str(GPT2))
        answers = {
            c.query: c.required_claims[0].aliases[0] if c.required_claims else "not stated"
            for c in builtin_suite(cases).cases
        }
        seen: dict[tuple[str, int], int] = {}
        lock = threading.Lock()

        class Handler(ModelsHandler):
            models = ("good", "bad")

            def do_POST(self) -> None:
                body = self.read_json()
                ids, model = list(body["prompt"]), body["model"]
                text = tokenizer.decode(ids)
                with lock:
                    key = (model, hash(tuple(ids)))
                    seen[key] = seen.get(key, 0) + 1
                    times = seen[key]
                bad = fault(model, ids, text, times) if model == "bad" else None
                good = completion(model, f" {answer_in(answers, text)}", ids, completion_tokens=3)
                self.send_json(good if bad is None else bad)

        super().__init__(Handler)


def _run(tmp_path: Path, fault: Fault, *, cases: int = FEW, runtime: str = "") -> tuple[int, Path]:
    with Reader(fault, cases) as server:
        text = stub_matrix(
            "answers",
            where=f'endpoint = "http://127.0.0.1:{server.port}"',
            cases=cases,
            candidate_model="bad",
            candidate=runtime,
        )
        matrix = tmp_path / "answers.toml"
        matrix.write_text(text, encoding="utf-8")
        run = tmp_path / "run"
        return main(["run", str(matrix), "--out", str(run), "--no-controls"]), run


def _candidate(run: Path) -> pl.DataFrame:
    return read_records(run).filter(pl.col("arm") == "candidate")


def test_an_empty_completion_is_retried_not_scored_as_the_models_answer(tmp_path: Path) -> None:
    def empty_once(model: str, ids: list[int], text: str, times: int) -> dict[str, Any] | None:
        return completion(model, "", ids, completion_tokens=0) if times == 1 else None

    code, run = _run(tmp_path, empty_once, cases=CASES)
    assert code == ExitCode.PASS, read_verdict(run)["reasons"]
    records = _candidate(run)
    assert records.height == 2 * _placed(CASES)
    assert set(records["status"]) == {"ok"} and set(records["attempts"]) == {2}
    assert all(t.strip() for t in records["output_text"])  # the retry's answer, not the empty one


def test_a_persistently_empty_completion_is_a_named_serving_failure(tmp_path: Path) -> None:
    def always_empty(model: str, ids: list[int], text: str, times: int) -> dict[str, Any] | None:
        return completion(model, "", ids, completion_tokens=0)

    code, run = _run(tmp_path, always_empty)
    assert code == ExitCode.FAIL_SYSTEM
    doc = read_verdict(run)
    assert doc["failure_class"] == "system" and doc["infra"]["lost"] == 0
    assert doc["system_fail_reasons"] == {"empty_completion": 2 * _placed(FEW)}
    records = _candidate(run)
    assert set(records["system_fail_reason"]) == {"empty_completion"} and set(records["attempts"]) == {4}
    assert "empty_completion" in (run / "report" / "summary.md").read_text(encoding="utf-8")


def test_an_answer_without_choices_keeps_the_servers_words_not_its_key_or_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's body echoes the prompt (ids and text) and the key it was sent: the record keeps
    its message, never the key, the ids or a run of the prompt's text."""
    monkeypatch.setenv("STUB_GATEWAY_KEY", KEY)
    texts: list[str] = []

    def no_choices(model: str, ids: list[int], text: str, times: int) -> dict[str, Any] | None:
        texts.append(text)
        return {
            "object": "error",
            "detail": "upstream worker restarting, try again",
            "seen_authorization": f"Bearer {KEY}",
            "prompt": ids,
            "echoed": text[-300:],
            "usage": {"prompt_tokens": len(ids)},
        }

    code, run = _run(tmp_path, no_choices, runtime='[candidate.runtime]\napi_key_env = "STUB_GATEWAY_KEY"\n')
    assert code == ExitCode.FAIL_SYSTEM  # the candidate's serving path, not lost data (INFRA, exit 30)
    doc = read_verdict(run)
    assert doc["infra"]["lost"] == 0 and doc["system_fail_reasons"] == {"malformed_answer": 2 * _placed(FEW)}
    records = _candidate(run)
    assert set(records["status"]) == {"system_fail"} and set(records["attempts"]) == {4}
    for error in records["error"]:
        assert "malformed_answer: no 'choices'" in error and "upstream worker restarting" in error
        assert KEY not in error and "Bearer ***" in error
        assert "<prompt text>" in error and "<removed>" in error
        assert not any(t[-200:-140] in error for t in texts)
    everything = b"".join(p.read_bytes() for p in run.rglob("*") if p.is_file())
    assert KEY.encode() not in everything


def _with_generated(body: dict[str, Any], n: int) -> dict[str, Any]:
    body["choices"][0]["token_ids"] = list(range(n))
    return body


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (
            lambda model, ids: completion(model, " 42", ids, completion_tokens=0),
            "3 characters of text but usage.completion_tokens 0",
        ),
        (
            lambda model, ids: _with_generated(completion(model, " 42", ids, completion_tokens=3), 1),
            "1 generated token ids but usage.completion_tokens 3",
        ),
    ],
    ids=["text-with-zero-tokens", "ids-not-the-count"],
)
def test_an_answer_contradicting_its_counts_is_malformed(
    tmp_path: Path, answer: Callable[[str, list[int]], dict[str, Any]], words: str
) -> None:
    code, run = _run(tmp_path, lambda model, ids, text, times: answer(model, ids))
    assert code == ExitCode.FAIL_SYSTEM
    records = _candidate(run)
    assert set(records["system_fail_reason"]) == {"malformed_answer"}
    assert all(words in e for e in records["error"])

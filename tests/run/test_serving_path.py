"""Serving-path findings of issue #21 (item 6), each injected for real on a server on 127.0.0.1:

* one wording per verdict class: a slice driven by the candidate's serving path reads FAIL_SYSTEM on the
  console and in every report, never "FAIL_REGRESSION (confirmed regression …)";
* the candidate's controls lost to its serving path are classed ``serving_path``, not ``unknown``;
* an arm's position results (NoLiMa base score, effective lengths) come from its own records only;
* endpoint names are kept apart (no pseudo-endpoint of both URLs joined), a resume keeps the first call's
  failure counts, and the console and verdict.json give one set of per-endpoint counts;
* the full-length canary: a gateway that cuts the head of every prompt and forges both the count and the
  echo is FAIL_SYSTEM (exit 13) with ``canary_head_lost`` named, not a model regression at depth 0.

The model behind 127.0.0.1 here is a **stub** (labelled as such): a vLLM-shaped server that decodes the
prompt ids with the real GPT-2 tokenizer and answers each case with its true value (and a canary with
the number it reads in the prompt). The same gateway in front of the real embedded model is
``test_head_cutting_gateway_in_front_of_the_real_model_is_canary_head_lost`` (``smoke_model``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import polars as pl
import pytest
from tokenizers import Tokenizer

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.judge.health import EARLIER
from depthgate.run.records import read_records
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import (
    JSONHandler,
    LlamaServerProcess,
    StubServer,
    completion,
    free_port,
    read_verdict,
    small_smoke_matrix,
    stub_matrix,
)

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
CASES = 20
PLACED = sum(1 for c in builtin_suite(CASES).cases if c.evidence)
CHECK = re.compile(r"check number of this document is (\d+)")
#: Placed cases whose evidence-only control model "blind" fails (the first three cases').
BLIND = sum(1 for c in builtin_suite(3).cases if c.decisive)
#: The share of the prompt a head-cutting gateway drops.
CUT = 0.4


class Reader(StubServer):
    """A vLLM-shaped STUB on 127.0.0.1. Models: ``good`` (answers every case with its true value and a
    canary with the number in the prompt; echoes the ids); ``doubled-bos`` (the same answer, the ids
    echoed with one extra leading token: a server adding a second BOS); ``blind`` (``good``, but fails
    the evidence-only control of the first three cases); ``head-cut`` (a gateway
    that drops the first ``CUT`` of the prompt ids before the model reads them, then forges the answer's
    ``prompt_tokens`` and echo as the full prompt's). ``die_after``: answers that many completions,
    then drops every request without an answer (a server that died)."""

    def __init__(self, port: int = 0, *, die_after: int | None = None) -> None:
        tokenizer = Tokenizer.from_file(str(GPT2))
        models = ("good", "doubled-bos", "blind", "head-cut")
        # query -> (the decisive documents' texts, the answer): a case is answered only when its
        # decisive evidence is in what the model read.
        answers = {
            c.query: (
                [d.text.strip() for d in c.decisive],
                c.required_claims[0].aliases[0] if c.required_claims else "not stated",
            )
            for c in builtin_suite(CASES).cases
        }
        blind = {c.query for c in builtin_suite(3).cases}
        self.requests = 0

        def answer(model: str, ids: list[int]) -> str:
            seen = ids[int(len(ids) * CUT) :] if model == "head-cut" else ids
            text = tokenizer.decode(seen)
            if "What is the check number of this document?" in text:
                found = CHECK.findall(text)
                return found[0] if found else "not stated"
            for query, (evidence, value) in answers.items():
                if query in text:
                    if model == "blind" and query in blind and len(ids) < 256:
                        return "not stated"
                    return value if all(e in text for e in evidence) else "not stated"
            return "not stated"

        reader = self

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                data = [{"id": m, "object": "model", "max_model_len": 4096} for m in models]
                self.send_json({"object": "list", "data": data})

            def do_POST(self) -> None:
                body = self.read_json()
                if die_after is not None and reader.requests >= die_after:
                    self.close_connection = True  # dead: the connection drops without an answer
                    return
                reader.requests += 1
                ids = list(body["prompt"])
                text = answer(body["model"], ids)
                echo = [50256, *ids] if body["model"] == "doubled-bos" else ids
                self.send_json(completion(body["model"], f" {text}", echo, completion_tokens=3))

        super().__init__(Handler, port)


def _matrix(tmp: Path, where: str, *, baseline: str = "good", candidate: str = "good", top: str = "") -> Path:
    text = stub_matrix(
        "serving",
        where=where,
        cases=CASES,
        candidate_model=candidate,
        top=top,
        resamples=499,
    )
    text = text.replace('model = "good"', f'model = "{baseline}"', 1)
    path = tmp / f"{baseline}-{candidate}.toml"
    path.write_text(text)
    return path


@pytest.fixture()
def reader() -> Iterator[Reader]:
    with Reader() as server:
        yield server


def _endpoint(server: Reader) -> str:
    return f'endpoint = "http://127.0.0.1:{server.port}"'


def test_a_doubled_bos_candidate_reads_fail_system_everywhere_and_leaves_the_baseline_alone(
    tmp_path: Path, reader: Reader, capsys: pytest.CaptureFixture[str]
) -> None:
    """The candidate's server doubles BOS on every request (matrix and controls). Every failing slice
    reads FAIL_SYSTEM with the serving path's reason — on the console, in verdict.json, summary.md,
    junit.xml and report.html — the candidate's controls are ``serving_path``, and the baseline's base
    score and effective lengths equal those of the same baseline beside a healthy candidate."""
    broken = _matrix(tmp_path, _endpoint(reader), baseline="blind", candidate="doubled-bos")
    healthy = _matrix(tmp_path, _endpoint(reader), baseline="blind", candidate="good")
    code = main(["run", str(broken), "--out", str(tmp_path / "broken")])
    out = capsys.readouterr().out
    assert code == ExitCode.FAIL_SYSTEM == 13, out
    assert main(["run", str(healthy), "--out", str(tmp_path / "healthy")]) == ExitCode.PASS
    capsys.readouterr()

    report = tmp_path / "broken" / "report"
    assert "FAIL_REGRESSION" not in out and "confirmed regression" not in out
    assert "640/0: FAIL_SYSTEM (serving path: " in out and "server_ids_mismatch" in out
    doc = read_verdict(tmp_path / "broken")
    assert {s["status"] for s in doc["slices"]} == {"FAIL_SYSTEM"}
    assert doc["slice_counts"]["FAIL_SYSTEM"] == 2 and doc["slice_counts"]["FAIL_REGRESSION"] == 0
    assert all(s["reason"].startswith("serving path: ") for s in doc["slices"])
    assert not any("FAIL_REGRESSION" in r or "confirmed regression" in r for r in doc["reasons"])
    for name in ("summary.md", "junit.xml", "report.html"):
        text = (report / name).read_text()
        # (the page's style sheet and legend name every status; its slice rows must not)
        for wrong in (
            "confirmed regression",
            "| FAIL_REGRESSION |",
            'type="FAIL_REGRESSION"',
            's-FAIL_REGRESSION"',
        ):
            assert wrong not in text, (name, wrong)
        assert "FAIL_SYSTEM" in text, name

    # The candidate's controls were all lost to its serving path: classed so, never "unknown".
    counts = doc["controls"]["counts"]
    assert counts == {
        **{k: v for k, v in counts.items() if k.startswith("baseline:")},
        "candidate:serving_path": PLACED,
    }
    cases = [c for c in doc["controls"]["cases"] if c["arm"] == "candidate"]
    assert all("server_ids_mismatch" in c["detail"] for c in cases)

    # The baseline's position numbers are its own: the same with a broken or a healthy candidate.
    el = doc["position"]["effective_length"]
    calm = read_verdict(tmp_path / "healthy")["position"]["effective_length"]
    assert (
        el["base_scores"]["baseline"] == calm["base_scores"]["baseline"] == pytest.approx(1 - BLIND / PLACED)
    )
    rows = [r for r in el["rows"] if r["arm"] == "baseline"]
    assert rows == [r for r in calm["rows"] if r["arm"] == "baseline"]
    assert el["base_scores"]["candidate"] == 1.0
    assert any("candidate: no usable evidence-only control" in n for n in doc["position"]["notes"])


def test_a_gateway_cutting_the_head_and_forging_count_and_echo_is_canary_head_lost(
    tmp_path: Path, reader: Reader, capsys: pytest.CaptureFixture[str]
) -> None:
    """The candidate sits behind a gateway that drops the first 40 % of every prompt and forges the
    count and the echo: every record looks sound, and depth 0 fails as if the model had regressed. With
    canaries (2 per kind, arm and length: 8 requests) the run ends FAIL_SYSTEM (exit 13) naming
    ``canary_head_lost``; the tail canaries pass on both arms."""
    top = "canaries = 2"
    without = _matrix(tmp_path, _endpoint(reader), candidate="head-cut", top="canaries = 0")
    before = reader.requests
    code = main(["run", str(without), "--out", str(tmp_path / "blind"), "--no-controls"])
    assert code == ExitCode.FAIL == 10  # what a run without canaries can see: a "model regression"
    # `canaries = 0` still turns them off for a server arm (issue #37 item 7): the matrix alone is sent
    assert reader.requests - before == 2 * PLACED * 2
    assert not (tmp_path / "blind" / "canaries").exists()
    assert "canaries" not in read_verdict(tmp_path / "blind").get("serving_checks", {})
    capsys.readouterr()

    matrix = _matrix(tmp_path, _endpoint(reader), candidate="head-cut", top=top)
    before = reader.requests
    code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls"])
    out = capsys.readouterr().out
    assert code == ExitCode.FAIL_SYSTEM == 13, out
    assert reader.requests - before == 2 * PLACED * 2 + 8  # the matrix plus 2 × 2 canaries per arm
    assert "canary_head_lost" in out and "FAIL_REGRESSION" not in out
    doc = read_verdict(tmp_path / "run")
    assert doc["failure_class"] == "system" and doc["system_driven_slices"] == ["640/0", "640/1"]
    assert doc["system_fail_reasons"] == {"canary_head_lost": 2}
    canaries = doc["serving_checks"]["canaries"]
    assert canaries["lost"] == ["candidate:canary_head_lost@640"]
    by = {(c["arm"], c["kind"]): (c["passed"], c["runs"]) for c in canaries["counts"]}
    assert by == {
        ("baseline", "head"): (2, 2),
        ("baseline", "tail"): (2, 2),
        ("candidate", "head"): (0, 2),
        ("candidate", "tail"): (2, 2),
    }
    summary = (tmp_path / "run" / "report" / "summary.md").read_text()
    assert "| 640 | head | 2 / 2 | 0 / 2 |" in summary and "candidate canary_head_lost at 640" in summary
    assert '<failure type="FAIL_SYSTEM"' in (tmp_path / "run" / "report" / "junit.xml").read_text()
    # The gate of the folder judges the canaries again from their records.
    assert main(["gate", str(tmp_path / "run")]) == ExitCode.FAIL_SYSTEM
    # A healthy candidate with canaries: they pass on both arms, the verdict is the plain one.
    capsys.readouterr()
    fine = _matrix(tmp_path, _endpoint(reader), top=top)
    assert main(["run", str(fine), "--out", str(tmp_path / "fine"), "--no-controls"]) == ExitCode.PASS
    assert read_verdict(tmp_path / "fine")["serving_checks"]["canaries"]["lost"] == []


def test_a_candidate_with_its_own_prompt_content_sends_the_baselines_canaries(
    tmp_path: Path, reader: Reader
) -> None:
    """Canaries hold the prompt content fixed (run/canary.py): a candidate with a preamble and the
    query-first assembler on a healthy server sends the very canary prompts the baseline sends, they
    pass its pre-send gate (no ``presend_frame_mismatch``: the gate checks them against the fixed
    content, not the arm's), every one is answered, none is lost. On the real vLLM server the
    candidate's own-content canaries read a position effect as ``canary_head_lost`` (exit 13)."""
    text = stub_matrix(
        "content",
        where=_endpoint(reader),
        cases=4,
        candidate='preamble = "About this document. Read it and answer."\nassembler = "query-first"',
    )
    matrix = tmp_path / "content.toml"
    matrix.write_text(text)
    out = tmp_path / "run"
    assert main(["run", str(matrix), "--out", str(out), "--no-controls"]) in (ExitCode.PASS, ExitCode.FAIL)
    records = read_records(out / "canaries")
    assert records.height == 2 * 2 * 2 and set(records["status"]) == {"ok"}  # arms × kinds × canaries
    ids = {
        arm: pl.read_parquet(out / arm / "canaries.parquet").sort("layout_id")["token_ids"].to_list()
        for arm in ("baseline", "candidate")
    }
    assert ids["baseline"] == ids["candidate"]
    layouts = pl.read_parquet(out / "candidate" / "layouts.parquet")["text"].to_list()
    assert all("About this document." in t for t in layouts)
    assert read_verdict(out)["serving_checks"]["canaries"]["lost"] == []


def test_a_baseline_that_loses_its_canaries_is_named_too(
    tmp_path: Path, reader: Reader, capsys: pytest.CaptureFixture[str]
) -> None:
    """The head-cutting gateway on the *baseline*: the candidate now looks better at depth 0, yet the
    comparison came through a broken path — every slice at that length is FAIL_SYSTEM, the baseline
    named (``baseline:canary_head_lost``), never a PASS over broken reference data."""
    matrix = _matrix(tmp_path, _endpoint(reader), baseline="head-cut", top="canaries = 2")
    code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls"])
    out = capsys.readouterr().out
    assert code == ExitCode.FAIL_SYSTEM, out
    doc = read_verdict(tmp_path / "run")
    assert doc["system_fail_reasons"] == {"baseline:canary_head_lost": 2}
    assert doc["serving_checks"]["canaries"]["lost"] == ["baseline:canary_head_lost@640"]
    assert "the baseline's serving path failed" in out


def test_a_forging_gateway_is_caught_by_the_default_matrix(
    tmp_path: Path, reader: Reader, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #37 item 7: the head-cutting, count-forging gateway in front of the candidate, and a matrix
    that says nothing about canaries. A server arm gets 2 head + 2 tail canaries per arm and length by
    default, so the run ends FAIL_SYSTEM (exit 13) with ``canary_head_lost`` — not the exit 10 "model
    regression at depth 0" a user who never heard of canaries got before."""
    matrix = _matrix(tmp_path, _endpoint(reader), candidate="head-cut")
    assert "canaries" not in matrix.read_text()
    before = reader.requests
    code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls"])
    out = capsys.readouterr().out
    assert code == ExitCode.FAIL_SYSTEM == 13, out
    assert reader.requests - before == 2 * PLACED * 2 + 8  # the matrix plus 2 × 2 canaries per arm
    assert "canary_head_lost" in out and "FAIL_REGRESSION" not in out
    doc = read_verdict(tmp_path / "run")
    assert doc["system_fail_reasons"] == {"canary_head_lost": 2}
    assert doc["serving_checks"]["canaries"]["lost"] == ["candidate:canary_head_lost@640"]


def test_the_canary_default_follows_the_arms_and_zero_keeps_the_old_run_id(tmp_path: Path) -> None:
    """A server matrix without ``canaries`` is the same matrix (digest, run id) as one that says
    ``canaries = 2``; ``canaries = 0`` is the digest a matrix had before canaries existed. Two embedded
    arms (the smoke matrix) keep 0 by default, their digest unchanged."""
    from depthgate.spec.loading import load_matrix
    from depthgate.spec.matrix import DEFAULT_SERVER_CANARIES

    def variant(path: Path, name: str, line: str) -> Path:
        text = path.read_text()
        first = text.index("\nname = ") + 1
        end = text.index("\n", first)
        out = tmp_path / f"{name}.toml"
        out.write_text(text[: end + 1] + line + "\n" + text[end + 1 :])
        return out

    plain = _matrix(tmp_path, 'endpoint = "http://127.0.0.1:9"')
    zero, two = variant(plain, "zero", "canaries = 0"), variant(plain, "two", "canaries = 2")
    assert load_matrix(plain).canaries == DEFAULT_SERVER_CANARIES == 2
    assert load_matrix(zero).canaries == 0
    assert load_matrix(plain).digest() == load_matrix(two).digest() != load_matrix(zero).digest()
    assert '"canaries"' not in load_matrix(zero).canonical_json()

    embedded = tmp_path / "embedded.toml"
    embedded.write_text("\n" + small_smoke_matrix())
    embedded_zero = variant(embedded, "embedded-zero", "canaries = 0")
    assert load_matrix(embedded).canaries == 0
    assert load_matrix(embedded).digest() == load_matrix(embedded_zero).digest()


def test_lost_jobs_name_real_endpoints_and_a_resume_keeps_the_first_failure_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens on either replica: every lost job is "no endpoint up", none under a
    pseudo-endpoint of both URLs joined. Then two replicas serve both arms and die mid-run (after 6
    answers each): jobs are lost on both, each counted under the replica that failed it last. With the
    replicas back, the resume (controls on) finishes; verdict.json keeps the first call's failed
    attempts, named apart as failed in earlier calls, and the console's per-endpoint counts are
    verdict.json's (matrix and controls alike)."""
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    matrix = _matrix(tmp_path, f"endpoints = {json.dumps(urls)}")
    # Nothing listens yet: no replica ever takes a job, so no job names an endpoint.
    assert main(["run", str(matrix), "--out", str(tmp_path / "dead"), "--no-controls"]) == ExitCode.INFRA
    dead = read_verdict(tmp_path / "dead")["infra"]
    assert set(dead["by_endpoint"]) == {"no endpoint up", "not sent"}, dead["by_endpoint"]
    assert dead["endpoints"] == {}
    run = tmp_path / "run"
    with Reader(ports[0], die_after=6), Reader(ports[1], die_after=6):
        assert main(["run", str(matrix), "--out", str(run), "--no-controls"]) == ExitCode.INFRA
    capsys.readouterr()
    first = read_verdict(run)["infra"]
    assert first["lost"] > 0
    assert set(first["by_endpoint"]) <= {*urls, "no endpoint up", "not sent"}, first["by_endpoint"]
    assert set(first["endpoints"]) == set(urls)
    failed_first = {u: first["endpoints"][u]["failed"] for u in urls}
    assert all(failed_first.values())

    with Reader(ports[0]), Reader(ports[1]):
        code = main(["run", str(matrix), "--out", str(run)])
    err = capsys.readouterr().err
    assert code == ExitCode.PASS, err
    doc = read_verdict(run)
    endpoints = doc["infra"]["endpoints"]
    assert set(endpoints) == set(urls)
    for url in urls:
        counts = endpoints[url]
        # The first call's failures are not forgotten, and not passed off as the resume's (issue #37):
        # those of the jobs the resume answered are "failed in earlier calls"; `failed` keeps only the
        # failures of the calls that wrote the final records (here the first call's moved-and-answered
        # jobs: the resume itself failed nothing).
        earlier = counts.get(EARLIER, 0)
        assert earlier > 0 and counts["failed"] + earlier == failed_first[url], (counts, failed_first)
        sent = counts["ok"] + counts["system_fail"] + counts["infra_error"]
        line = (
            f"depthgate: {url}: sent {sent} (ok {counts['ok']}, system_fail {counts['system_fail']}, "
            f"infra_error {counts['infra_error']}), failed {counts['failed']}, failed in earlier calls "
            f"{earlier}, "
        )
        assert line in err, (line, err[-3000:])
    summary = (run / "report" / "summary.md").read_text()
    assert "| failed attempts | failed in earlier calls |" in summary
    # controls count too, in both places: more answers than the matrix's own jobs
    assert sum(e["ok"] for e in endpoints.values()) > 2 * PLACED * 2


# --------------------------------------------------------------------------------------------------
# the same gateway in front of the real embedded model (llama-cpp-python server, text prompts)


class HeadCutGateway(StubServer):
    """A gateway on 127.0.0.1 in front of ``upstream`` (llama-cpp-python's server, text prompts): it
    drops the first ``CUT`` of each prompt's tokens (Gemma's own tokenizer) before forwarding, then
    forges ``usage.prompt_tokens`` as the full prompt's count — the counts agree, the head is gone."""

    def __init__(self, upstream: str) -> None:
        from depthgate.layout.gguf_tokenizer import gemma_default_gguf
        from depthgate.layout.layouts import load_tokenizer

        # The GGUF's tokenizer as a `tokenizers` Tokenizer (id for id llama.cpp's).
        tokenizer = Tokenizer.from_file(str(load_tokenizer(f"gguf:{gemma_default_gguf()}").path))
        lock = threading.Lock()

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                reply = httpx.get(f"{upstream}{self.path}", timeout=30)
                self.send_json(reply.json(), status=reply.status_code)

            def do_POST(self) -> None:
                body = self.read_json()
                with lock:
                    ids = tokenizer.encode(body["prompt"], add_special_tokens=False).ids
                    kept = tokenizer.decode(ids[int(len(ids) * CUT) :], skip_special_tokens=False)
                    dropped = len(ids) - len(tokenizer.encode(kept, add_special_tokens=False).ids)
                reply = httpx.post(f"{upstream}{self.path}", json={**body, "prompt": kept}, timeout=300)
                data = reply.json()
                if reply.status_code == 200 and "usage" in data:
                    data["usage"]["prompt_tokens"] += dropped  # forged: the full prompt's count
                self.send_json(data, status=reply.status_code)

        super().__init__(Handler)


@pytest.mark.smoke_model
def test_head_cutting_gateway_in_front_of_the_real_model_is_canary_head_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded Gemma-3-270M behind llama-cpp-python's server: the baseline talks to it directly,
    the candidate through the head-cutting gateway (counts forged). Both arms are the same model and
    prompt, so every difference is the gateway's: FAIL_SYSTEM (exit 13) with ``canary_head_lost``."""
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")
    server = LlamaServerProcess.start(tmp_path, n_threads=2)
    try:
        server.wait_up(time.monotonic() + 120)
        with HeadCutGateway(server.url) as gateway:
            text = small_smoke_matrix(cases=4, lengths="[480]", preamble="")
            head, tail = text.split("\n[candidate]", 1)
            head = head.replace("window = 2048\n", f'window = 2048\nendpoint = "{server.url}"\n')
            via = f'window = 2048\nendpoint = "http://127.0.0.1:{gateway.port}"\n'
            text = head + "\n[candidate]" + tail.replace("window = 2048\n", via)
            runtime = '\n[{arm}.runtime]\nprompt_format = "text"\nconcurrency = 1\n'
            text = text.replace("\n[candidate]", runtime.format(arm="baseline") + "\n[candidate]")
            text = text.replace("\n[plan]", runtime.format(arm="candidate") + "\n[plan]")
            text = text.replace('name = "smoke"', 'name = "smoke"\ncanaries = 2', 1)
            matrix = tmp_path / "gateway.toml"
            matrix.write_text(text, encoding="utf-8")
            code = main(["run", str(matrix), "--out", str(tmp_path / "run"), "--no-controls"])
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert code == ExitCode.FAIL_SYSTEM == 13, out
    doc = read_verdict(tmp_path / "run")
    assert "candidate:canary_head_lost@480" in doc["serving_checks"]["canaries"]["lost"], doc[
        "serving_checks"
    ]
    assert "canary_head_lost" in out and "FAIL_REGRESSION" not in out

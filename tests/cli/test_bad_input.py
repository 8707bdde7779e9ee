"""Hostile input through every command (issue #10, item 10): a corpus of bad inputs, each run through
``main(argv)`` in process. The corpus is data, one row per case: ``fixtures/hostile_corpus.toml``.

Every case must end with its documented exit code (README "Exit codes"):

* 20 for bad input — the message on stderr names the file and/or the field and says how to fix it
  (``fix:``); this includes *values* that parse but are invalid (``--window 0``, ``--positions @99999``
  beyond every length, ``--cases 0``), which are ours to refuse, not argparse's;
* 2 only for usage errors argparse itself rejects (a value that is not a number, a missing option);
* 21 for ``depthgate check`` on a layouts file whose *rows* break the token-exact contract. Decision:
  a layout whose ``evidence_spans`` is null, or whose ``token_ids`` hold negative (or > u32) ids, is a
  **violation** (exit 21), listed per layout on stdout with the field, plus one stderr line naming the
  file and the fix (rebuild). It is what ``check`` exists to catch: the file is a layouts file, but one
  that can no longer be trusted. A file that is not a layouts file at all (not parquet, missing
  columns) is bad input (exit 20).

and never a traceback, and nothing half-written: the folder the case runs in is snapshotted before and
after — no new file or folder (no ``*.tmp``, no empty folder, no manifest), and every file that existed
is unchanged.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import string
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode
from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.spec._compat import tomllib
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir
from helpers import NotStatedReader, stub_matrix

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
BAD = int(ExitCode.BAD_INPUT)
VERIFY = int(ExitCode.VERIFY_FAILED)
USAGE = 2


def _unwritable_parent() -> Path:
    """A folder nobody may create entries in. As root, permission bits do not stop writes; sysfs does."""
    return Path("/sys") if os.geteuid() == 0 else Path("/")


UNWRITABLE = _unwritable_parent() / "depthgate-hostile-out"


def matrix_text(port: int = 9, *, candidate_extra: str = "", tok: Path | str = GPT2) -> str:
    where = f'endpoint = "http://127.0.0.1:{port}"'
    return stub_matrix(
        "hostile",
        where=where,
        tokenizer=tok,
        lengths="[512]",
        top="repeats = 1",
        arm="window = 1024",
        candidate=candidate_extra,
    )


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run folder (both arms, records, report) from a run against the stub server below; the
    gate cases tamper with copies of it."""
    root = tmp_path_factory.mktemp("good-run")
    # The run's own console output is not the tested command's: kept out of the first case's capsys.
    with NotStatedReader() as reader, redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        matrix = root / "m.toml"
        matrix.write_text(matrix_text(reader.port))
        code = main(["run", str(matrix), "--out", str(root / "run"), "--no-controls"])
    assert code in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE)
    return root / "run"


def _write_runs(root: Path, good_run: Path, needed: set[str]) -> dict[str, str]:
    """Tampered copies of a real run folder, only those a case names (``gr_*``)."""

    def manifest_edit(key: str, value: Any) -> Callable[[Path], None]:
        def edit(run: Path) -> None:
            doc = json.loads((run / "manifest.json").read_text())
            if "." in key:
                outer, inner = key.split(".")
                doc[outer][inner] = value
            else:
                doc[key] = value
            (run / "manifest.json").write_text(json.dumps(doc))

        return edit

    def remove_report(run: Path) -> None:
        shutil.rmtree(run / "report")
        (run / "report").write_text("a file where the report folder goes\n")

    def records_edit(column: str, value: str, *, every: bool = False) -> Callable[[Path], None]:
        def edit(run: Path) -> None:
            frame = pl.read_parquet(run / "records.parquet")
            which = pl.lit(True) if every else pl.int_range(pl.len()) == 0
            frame = frame.with_columns(
                pl.when(which).then(pl.lit(value)).otherwise(pl.col(column)).alias(column)
            )
            frame.write_parquet(run / "records.parquet")

        return edit

    def scored_edit(run: Path, *, cut: bool) -> None:
        path = run / "scored.parquet"
        if cut:
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
        else:
            pl.read_parquet(path).drop("outcome").write_parquet(path)

    variants: dict[str, Callable[[Path], None]] = {
        "gr_records_wrong_type": lambda run: (
            pl.read_parquet(run / "records.parquet")
            .with_columns(pl.lit("x").alias("seed"))
            .write_parquet(run / "records.parquet")
        ),
        "gr_records_cut": lambda run: (run / "records.parquet").write_bytes(b"PAR1 cut"),
        "gr_foreign_run_id": records_edit("run_id", "another-run-0123456789ab", every=True),
        "gr_foreign_layout": records_edit("layout_id", "f" * 64),
        "gr_foreign_arm": records_edit("arm", "shadow"),
        "gr_scored_cut": lambda run: scored_edit(run, cut=True),
        "gr_scored_wrong_cols": lambda run: scored_edit(run, cut=False),
        "gr_shard_corrupt": lambda run: (run / "shard.json").write_text("{"),
        "gr_shard_wrong_types": lambda run: (run / "shard.json").write_text('{"index": "x", "count": 2}'),
        "gr_manifest_surrogate": manifest_edit("run_id", "\ud800"),
        "gr_manifest_deep": lambda run: (run / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
        "gr_no_records": lambda run: (run / "records.parquet").unlink(),
        "gr_no_layouts": lambda run: (run / "baseline" / "layouts.parquet").unlink(),
        "gr_corrupt_layouts": lambda run: (run / "candidate" / "layouts.parquet").write_bytes(b"PAR1 cut"),
        "gr_corrupt_suite": lambda run: (run / "suite.json").write_text("{"),
        "gr_plan_edited": manifest_edit("plan.margin", 0.3),
        "gr_seeds_wrong_type": manifest_edit("seeds", "0"),
        "gr_report_is_file": remove_report,
    }
    out: dict[str, str] = {}
    for name, tamper in variants.items():
        if name in needed:
            target = root / name.replace("_", "-")
            shutil.copytree(good_run, target)
            tamper(target)
            out[name] = str(target)
    return out


@pytest.fixture(scope="module")
def good_layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid layouts file (GPT-2, 2 cases, one length, one position) the tampered variants start from."""
    path = tmp_path_factory.mktemp("layouts") / "layouts.parquet"
    options = BuildOptions(lengths=[512], positions=parse_positions(["0.5"]))
    build_layouts(builtin_suite(2), load_tokenizer(GPT2), options, path)
    return path


def _write_inputs(root: Path, good_layouts: Path) -> dict[str, str]:
    """Every hostile file of the corpus, written into ``root``; returns the names argv templates use."""
    w: dict[str, str] = {"tmp": str(root), "tok": str(GPT2), "out": str(root / "out")}

    def put(name: str, data: str | bytes) -> str:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data, encoding="utf-8")
        return str(path)

    binary = bytes(range(256)) * 4
    w["file"] = put("afile.txt", "an existing file, not a folder\n")
    w["under_file"] = str(root / "afile.txt" / "sub")
    w["dir"] = str(root / "adir")
    (root / "adir").mkdir()
    w["nonempty_dir"] = str(root / "nonempty")
    put("nonempty/keep.txt", "someone's file\n")
    w["unwritable"] = str(UNWRITABLE)
    w["missing"] = str(root / "missing" / "nothing.here")

    # text inputs
    w["latin1"] = put("preamble-latin1.txt", "Caf\u00e9 cr\u00e8me policy\n".encode("latin-1"))
    w["preamble"] = put("preamble.txt", "Read the excerpt and answer.\n")
    w["tok_binary"] = put("tok-binary.json", binary)
    w["tok_notjson"] = put("tok-notjson.json", "this is not JSON {")
    w["tok_wrongjson"] = put("tok-wrongjson.json", json.dumps({"model": {"type": "NoSuchModel"}}))
    w["tpl_raises"] = put("raises.jinja", "{{ raise_exception('Conversation roles must alternate') }}")
    w["tpl_syntax"] = put("syntax.jinja", "{% for m in messages %}{{ m.content }")
    w["tpl_binary"] = put("binary.jinja", binary)
    w["tpl_good"] = put("good.jinja", "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")

    # suites
    suite = json.loads(builtin_suite(2).model_dump_json())
    dup = dict(suite, cases=[suite["cases"][0], suite["cases"][0]])
    w["suite_dup"] = put("suite-dup.json", json.dumps(dup))
    w["suite_empty"] = put("suite-empty.json", "")
    w["suite_list"] = put("suite-list.json", json.dumps(suite["cases"]))
    w["suite_binary"] = put("suite-binary.json", binary)
    w["suite_dir"] = str(root / "suite-dir.json")
    (root / "suite-dir.json").mkdir()
    w["suite_nocases"] = put("suite-nocases.json", json.dumps(dict(suite, cases=[])))

    query = json.dumps(suite["cases"][0]["query"])  # a lone half of a UTF-16 pair in the first query
    surrogate = json.dumps(suite).replace(query, query[:-1] + ' \\ud800"', 1)
    w["suite_surrogate"] = put("suite-surrogate.json", surrogate)
    w["suite_deep"] = put("suite-deep.json", "[" * 100_000 + "]" * 100_000)
    w["empty"] = ""
    # A link to a device: an output written "atomically" (temp file + rename) would replace the node;
    # through a link, only the link is at stake (the test never writes to a real device).
    (root / "device-link").symlink_to("/dev/null")
    w["device"] = str(root / "device-link")

    # incidents
    incident = {
        "id": "INC-1",
        "documents": [{"id": "kb-1", "version": 1, "text": "Refunds above 500 EUR need a second approver."}],
        "query": "Who approves a refund of 800 EUR?",
        "evidence_ids": ["kb-1"],
        "claims": [{"id": "second", "text": "A second approver.", "aliases": ["second approver"]}],
    }
    w["incidents_ok"] = put("incidents.jsonl", json.dumps(incident) + "\n")
    w["incidents_dup"] = put("incidents-dup.jsonl", (json.dumps(incident) + "\n") * 2)
    w["incidents_empty"] = put("incidents-empty.jsonl", "\n# only a comment\n")
    w["incidents_list"] = put("incidents-list.jsonl", "[1, 2, 3]\n")
    w["incidents_binary"] = put("incidents-binary.jsonl", binary)
    w["incidents_surrogate"] = put(
        "incidents-surrogate.jsonl", json.dumps(incident).replace("Refunds", "Refunds \\udc00") + "\n"
    )
    w["incidents_badref"] = put(
        "incidents-badref.jsonl", json.dumps(dict(incident, evidence_ids=["kb-404"])) + "\n"
    )

    # matrices
    w["m_ok"] = put("m-ok.toml", matrix_text())
    w["m_empty"] = put("m-empty.toml", "")
    w["m_binary"] = put("m-binary.toml", binary)
    w["m_syntax"] = put("m-syntax.toml", matrix_text().replace("lengths = [512]", "lengths = [512"))
    w["m_unknown"] = put(
        "m-unknown.toml", matrix_text().replace("repeats = 1", 'repeats = 1\ncolour = "red"')
    )
    w["m_unknown_plan"] = put(
        "m-unknown-plan.toml", matrix_text().replace("n_min = 2", "n_min = 2\nn_max = 9")
    )
    w["m_wrongtype"] = put("m-wrongtype.toml", matrix_text().replace("lengths = [512]", 'lengths = "512"'))
    w["m_neglen"] = put("m-neglen.toml", matrix_text().replace("lengths = [512]", "lengths = [-512]"))
    w["m_zeroseeds"] = put("m-zeroseeds.toml", matrix_text().replace("seeds = [0]", "seeds = []"))
    w["m_dupseeds"] = put(
        "m-dupseeds.toml",
        matrix_text().replace("seeds = [0]", "seeds = [3, 3]").replace("repeats = 1", "repeats = 2"),
    )
    w["m_negseed"] = put("m-negseed.toml", matrix_text().replace("seeds = [0]", "seeds = [-1]"))
    w["m_offset"] = put("m-offset.toml", matrix_text().replace("[0.0, 1.0]", '[0.0, "@99999"]'))
    w["m_window0"] = put("m-window0.toml", matrix_text().replace("window = 1024", "window = 0", 1))
    w["m_missing_tok"] = put("m-missing-tok.toml", matrix_text(tok="no/such/tokenizer.json"))
    w["m_notjson_tok"] = put("m-notjson-tok.toml", matrix_text(tok=w["tok_notjson"]))
    w["m_missing_tpl"] = put(
        "m-missing-tpl.toml", matrix_text(candidate_extra='chat_template = "no-such.jinja"')
    )
    w["m_tpl_raises"] = put(
        "m-tpl-raises.toml", matrix_text(candidate_extra='chat_template = "raises.jinja"')
    )
    w["m_tpl_syntax"] = put(
        "m-tpl-syntax.toml", matrix_text(candidate_extra='chat_template = "syntax.jinja"')
    )
    w["m_suite_dir"] = put(
        "m-suite-dir.toml",
        matrix_text().replace(
            'suite = { kind = "builtin", cases = 2, seed = 0, language = "en" }',
            'suite = { kind = "file", path = "suite-dir.json" }',
        ),
    )
    w["m_dir"] = str(root / "adir")

    # absurd sizes, numbers that are not finite, names and lists a user can get wrong (issue #21)
    def variant(name: str, old: str, new: str, base: str | None = None) -> str:
        text = matrix_text() if base is None else base
        assert old in text, old
        return put(name, text.replace(old, new))

    runtime = "[candidate.runtime]\n"
    for key, length in (
        ("m_len_1e12", "1000000000000"),
        ("m_len_u32", "4294967312"),
        ("m_len_i64", str(2**63 - 1)),
    ):
        w[key] = variant(key.replace("_", "-") + ".toml", "lengths = [512]", f"lengths = [{length}]")
    w["m_window_huge"] = variant("m-window-huge.toml", "window = 1024", f"window = {2**63 - 1}")
    w["m_builtin_cases_huge"] = variant("m-builtin-cases-huge.toml", "cases = 2,", "cases = 1000000,")
    many_seeds = matrix_text().replace("seeds = [0]", f"seeds = {list(range(1001))}")
    w["m_seeds_many"] = put("m-seeds-many.toml", many_seeds.replace("repeats = 1", "repeats = 1001"))
    positions = ", ".join(f'"@{i}"' for i in range(1001))
    w["m_positions_many"] = variant(
        "m-positions-many.toml", "positions = [0.0, 1.0]", f"positions = [{positions}]"
    )
    depths = ", ".join(str(i / 100) for i in range(101))
    w["m_layouts_many"] = variant(
        "m-layouts-many.toml", "lengths = [512]", "lengths = [512, 1024, 2048, 4096]"
    )
    (root / "m-layouts-many.toml").write_text(
        (root / "m-layouts-many.toml")
        .read_text()
        .replace("cases = 2,", "cases = 4000,")
        .replace("positions = [0.0, 1.0]", f"positions = [{depths}]")
    )
    endpoints = ", ".join(f'"http://10.0.{i // 250}.{i % 250 + 1}:8000"' for i in range(10_000))
    w["m_endpoints_many"] = put(
        "m-endpoints-many.toml",
        matrix_text().replace('endpoint = "http://127.0.0.1:9"', f"endpoints = [{endpoints}]"),
    )
    w["m_endpoint_case"] = put(
        "m-endpoint-case.toml",
        matrix_text().replace(
            'endpoint = "http://127.0.0.1:9"', 'endpoints = ["http://127.0.0.1:9", "HTTP://127.0.0.1:9"]'
        ),
    )
    for key, line in (
        ("m_connect_inf", "connect_timeout_s = inf"),
        ("m_timeout_nan", "timeout_s = nan"),
        ("m_timeout_huge", "timeout_s = 1e300"),
        ("m_tolerance_nan", "count_tolerance = nan"),
        ("m_connections_huge", "max_connections = 1000000000000"),
        ("m_concurrency_huge", "concurrency = 1000000000000"),
        # issue #37, item 1: what a tokenize route that fails means, one of three names
        ("m_parity_unknown", 'tokenizer_parity = "sometimes"'),
        ("m_parity_bool", "tokenizer_parity = false"),
        ("m_parity_case", 'tokenizer_parity = "Required"'),
        ("m_parity_list", 'tokenizer_parity = ["required"]'),
    ):
        w[key] = put(key.replace("_", "-") + ".toml", matrix_text(candidate_extra=runtime + line))
    w["m_margin_inf"] = variant("m-margin-inf.toml", "margin = 0.20", "margin = inf")
    w["m_alpha_nan"] = variant("m-alpha-nan.toml", "n_min = 2", "n_min = 2\nalpha = nan")
    w["m_missing_nan"] = variant("m-missing-nan.toml", "n_min = 2", "n_min = 2\nmax_missing = -inf")
    w["m_temperature_inf"] = variant(
        "m-temperature-inf.toml", "max_tokens = 8", "max_tokens = 8\ntemperature = inf"
    )
    w["m_position_nan"] = variant("m-position-nan.toml", "positions = [0.0, 1.0]", "positions = [0.0, nan]")
    w["m_position_inf"] = variant("m-position-inf.toml", "positions = [0.0, 1.0]", "positions = [0.0, inf]")
    w["m_long_name"] = put(
        "m-long-name.toml", matrix_text().replace('name = "base"', f'name = "{"b" * 200}"')
    )
    w["m_spacing_single"] = variant("m-spacing-single.toml", "repeats = 1", 'repeats = 1\nspacings = ["far"]')
    w["m_suite_surrogate"] = put(
        "m-suite-surrogate.toml",
        matrix_text().replace(
            'suite = { kind = "builtin", cases = 2, seed = 0, language = "en" }',
            'suite = { kind = "file", path = "suite-surrogate.json" }',
        ),
    )
    w["m_deep"] = put("m-deep.toml", matrix_text() + "\ndeep = " + "[" * 50_000 + "]" * 50_000 + "\n")
    w["m_builtin_seed_huge"] = variant("m-builtin-seed-huge.toml", "seed = 0,", f"seed = {2**63},")
    w["positions_1001"] = ",".join(f"@{i}" for i in range(1001))

    # issue #37, item 6: URLs, floats, sizes, paths and flags refused by name
    endpoint = 'endpoint = "http://127.0.0.1:9"'
    for key, url in (
        ("m_port_99999", "http://127.0.0.1:99999"),
        ("m_port_space", "http://127.0.0.1:9 "),
        ("m_port_unicode", "http://127.0.0.1:\u0669"),
        ("m_port_zero", "http://127.0.0.1:0"),
        ("m_url_fragment_token", "http://127.0.0.1:9/v1#access_token=s3cr3t"),
        ("m_url_query_token", "http://127.0.0.1:9/v1?access_token=s3cr3t"),
        ("m_url_userinfo", "http://user:s3cr3t@127.0.0.1:9"),
        ("m_url_crlf", "http://127.0.0.1:9/v1\\r\\nX-Injected: 1"),
        ("m_url_tab", "http://127.0.0.1:9/\tv1"),
        ("m_url_long", "http://127.0.0.1:9/" + "a" * 1_000_000),
        # more of each form (the stop after 40): each message is one that item 6 introduced
        ("m_port_65536", "http://127.0.0.1:65536"),
        ("m_port_negative", "http://127.0.0.1:-1"),
        ("m_port_empty", "http://127.0.0.1:"),
        ("m_port_ipv6_99999", "http://[::1]:99999"),
        ("m_url_nul", "http://127.0.0.1:9/\\u0000"),
        ("m_url_del", "http://127.0.0.1:9/\\u007f"),
        ("m_url_lf", "http://127.0.0.1:9/v1\\n"),
        ("m_url_password_only", "http://:s3cr3t@127.0.0.1:9"),
        ("m_url_api_key_query", "http://127.0.0.1:9/v1?api_key=abc"),
        ("m_url_3000", "http://127.0.0.1:9/" + "a" * 3000),
    ):
        w[key] = variant(key.replace("_", "-") + ".toml", endpoint, f'endpoint = "{url}"')
    for key, urls in (
        ("m_endpoints_userinfo", '["http://127.0.0.1:9", "http://u:p@127.0.0.1:8"]'),
        ("m_endpoints_port", '["http://127.0.0.1:9", "http://127.0.0.1:70000"]'),
        ("m_endpoints_fragment", '["http://127.0.0.1:9", "http://127.0.0.1:8/#token=x"]'),
    ):
        w[key] = variant(key.replace("_", "-") + ".toml", endpoint, f"endpoints = {urls}")
    w["m_alpha_1e_7"] = variant("m-alpha-1e-7.toml", "n_min = 2", "n_min = 2\nalpha = 1e-7")
    w["m_resamples_100001"] = variant(
        "m-resamples-100001.toml", "bootstrap_resamples = 199", "bootstrap_resamples = 100001"
    )
    # A subnormal margin ended `plan` and `run` in a traceback (the planner's 1/M² overflowed).
    w["m_margin_subnormal"] = variant("m-margin-subnormal.toml", "margin = 0.20", "margin = 5e-324")
    w["m_margin_tiny"] = variant("m-margin-tiny.toml", "margin = 0.20", "margin = 1e-100")
    w["m_endpoints_crlf"] = variant(
        "m-endpoints-crlf.toml", endpoint, 'endpoints = ["http://127.0.0.1:9", "http://127.0.0.1:8\\r\\n"]'
    )
    # issue #37, item 7: canaries (on by default for a server arm) take a count 0..8, nothing else
    for key, line in (
        ("m_canaries_negative", "canaries = -1"),
        ("m_canaries_over", "canaries = 9"),
        ("m_canaries_text", 'canaries = "2"'),
        ("m_canaries_float", "canaries = 2.0"),
        ("m_canaries_bool", "canaries = true"),
        ("m_canaries_huge", "canaries = 1000000000000"),
    ):
        w[key] = variant(key.replace("_", "-") + ".toml", "repeats = 1", f"repeats = 1\n{line}")
    w["m_alpha_subnormal"] = variant("m-alpha-subnormal.toml", "n_min = 2", "n_min = 2\nalpha = 5e-324")
    w["m_alpha_tiny"] = variant("m-alpha-tiny.toml", "n_min = 2", "n_min = 2\nalpha = 1e-9")
    w["m_resamples_1e12"] = variant(
        "m-resamples-1e12.toml", "bootstrap_resamples = 199", "bootstrap_resamples = 1000000000000"
    )
    bos_yes = root / "bos-yes"
    bos_yes.mkdir()
    shutil.copyfile(GPT2, bos_yes / "tokenizer.json")
    (bos_yes / "tokenizer_config.json").write_text('{"add_bos_token": "yes", "bos_token": "<|endoftext|>"}')
    w["tok_bos_yes"] = str(bos_yes)
    eos_one = root / "eos-one"
    eos_one.mkdir()
    shutil.copyfile(GPT2, eos_one / "tokenizer.json")
    (eos_one / "tokenizer_config.json").write_text('{"add_eos_token": 1, "eos_token": "<|endoftext|>"}')
    w["tok_eos_one"] = str(eos_one)
    # Issue #37: a template that writes {{ bos_token }}, alone in its folder (no tokenizer_config.json).
    w["tpl_bos_alone"] = put(
        "bos-alone/bos.jinja", "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    # A run folder whose manifest.json is a folder (a device or a symlink loop would stall the corpus's
    # own snapshot of this tree: tests/cli/test_named_wording.py covers those).
    (root / "run-manifest-folder" / "manifest.json").mkdir(parents=True)
    w["run_manifest_folder"] = str(root / "run-manifest-folder")
    # An output name that is not UTF-8 (a byte 0xFF, as a shell passes it): Python holds it as a surrogate.
    w["out_not_utf8"] = str(root / "out\udcff")

    # layouts
    w["layouts_text"] = put("notparquet.parquet", "layout_id,text\nx,y\n")
    w["layouts_empty"] = put("empty.parquet", b"")
    frame = pl.read_parquet(good_layouts)
    w["layouts_good"] = str(root / "good.parquet")
    shutil.copyfile(good_layouts, root / "good.parquet")
    nulled = frame.with_columns(
        pl.when(pl.int_range(pl.len()) == 0)
        .then(pl.lit(None, dtype=frame.schema["evidence_spans"]))
        .otherwise(pl.col("evidence_spans"))
        .alias("evidence_spans")
    )
    w["layouts_null_spans"] = str(root / "null-spans.parquet")
    nulled.write_parquet(w["layouts_null_spans"])
    negative = frame.with_columns(
        pl.col("token_ids").cast(pl.List(pl.Int64)).list.eval(pl.element() - 100_000).alias("token_ids")
    )
    w["layouts_negative"] = str(root / "negative.parquet")
    negative.write_parquet(w["layouts_negative"])
    # an earlier build's output folder: a failed rebuild must leave it as it was
    for rel in ("prev/layouts.parquet", "prev/baseline/layouts.parquet", "prev/candidate/layouts.parquet"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(good_layouts, root / rel)
    w["prev_out"] = str(root / "prev")
    w["layouts_nocols"] = str(root / "nocols.parquet")
    frame.select("layout_id", "text").write_parquet(w["layouts_nocols"])
    w["layouts_char_negative"] = str(root / "char-negative.parquet")
    frame.with_columns(
        pl.col("evidence_spans").list.eval(pl.element().struct.with_fields(pl.field("char_start") * 0 - 5))
    ).write_parquet(w["layouts_char_negative"])
    w["layouts_cut"] = put("cut.parquet", good_layouts.read_bytes()[: good_layouts.stat().st_size // 2])
    w["layouts_string_ids"] = str(root / "string-ids.parquet")
    frame.with_columns(pl.col("token_ids").cast(pl.List(pl.String))).write_parquet(w["layouts_string_ids"])

    # run folders
    put("run-corrupt/manifest.json", '{"run_id": "x", ')
    w["run_corrupt"] = str(root / "run-corrupt")
    put("run-binary/manifest.json", binary)
    w["run_binary"] = str(root / "run-binary")
    put("run-list/manifest.json", "[]")
    w["run_list"] = str(root / "run-list")
    put("run-empty-obj/manifest.json", "{}")
    w["run_empty_obj"] = str(root / "run-empty-obj")
    (root / "run-dir-manifest" / "manifest.json").mkdir(parents=True)
    w["run_dir_manifest"] = str(root / "run-dir-manifest")
    return w


@dataclass(frozen=True)
class Hostile:
    """One hostile input: argv (``{name}`` placeholders filled from the written inputs), the exit code
    and the fragments stderr must contain (file and/or field)."""

    name: str
    argv: tuple[str, ...]
    code: int = BAD
    fragments: tuple[str, ...] = ()
    stdout: tuple[str, ...] = field(default=())


_CODES = {"VERIFY": VERIFY, "USAGE": USAGE, "INFRA": int(ExitCode.INFRA)}


def _load_corpus(path: Path) -> list[Hostile]:
    """The cases of ``fixtures/hostile_corpus.toml``: ``[name, argv, *fragments]`` rows, with an optional
    last ``{code, stdout}`` table."""
    rows = tomllib.loads(path.read_text(encoding="utf-8"))["cases"]
    corpus = []
    for row in rows:
        extra: dict[str, Any] = row.pop() if isinstance(row[-1], dict) else {}
        name, argv, *fragments = row
        code = _CODES[extra["code"]] if "code" in extra else BAD
        corpus.append(
            Hostile(name, tuple(argv.split()), code, tuple(fragments), tuple(extra.get("stdout", ())))
        )
    return corpus


CORPUS = _load_corpus(Path(__file__).resolve().parents[1] / "fixtures" / "hostile_corpus.toml")


def _snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every path under ``root``: kind and content digest (files) — to prove nothing was written."""
    out: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = ("dir", "")
        for name in filenames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return out


#: A refusal is short (an endpoint list is summarised, never printed whole). That it comes before any
#: work (issue #21: an absurd size ran out of memory for minutes) is tests/layout/test_refusal_speed.py's
#: check, by the refusing process's peak memory: a wall-clock bound here measured the machine's load.
MAX_ERROR_CHARS = 2_000
#: Words of a message meant for a developer: internal module or object names, library jargon.
DEVELOPER_WORDS = (
    "depthgate.spec.",
    "depthgate.layout.",
    "depthgate.judge.",
    "depthgate.run.",
    "pydantic",
    "serde",
    "usize",
    "ComputeError",
    "PanicException",
    "DEPTHGATE_",
    "field 'spec'",
    "by hand",
    "NoneType",
    "OverflowError",
    "UnicodeEncodeError",
)


#: A file (a path, or a name with a known extension) or a field, as a message names it.
FILE_OR_FIELD = re.compile(r"^depthgate: error: (/|[^ ]*\.(json|jsonl|toml|jinja|parquet|txt|gz)\b)|field '")


def _assert_for_a_user(err: str, argv: list[str]) -> None:
    """An exit-20 message (issue #21, item 4): one ``depthgate: error:`` line per problem that names the
    file (a path from the command line, or a file inside one) or the field, says a fix, and holds no
    developer words."""
    errors = [line for line in err.splitlines() if line.startswith("depthgate: error: ")]
    assert len(errors) == 1, err
    line = errors[0]
    assert "(fix: " in line, line
    assert FILE_OR_FIELD.search(line), f"names neither a file nor a field: {line}"
    for word in DEVELOPER_WORDS:
        assert word not in line, f"developer word {word!r} in: {line}"


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse usage errors (exit 2) stay argparse's
        return int(exc.code or 0)


def test_corpus_is_large_and_covers_every_command() -> None:
    assert len(CORPUS) >= 40
    assert len({h.name for h in CORPUS}) == len(CORPUS)
    commands = {" ".join(h.argv[:2]) if h.argv[0] == "suite" else h.argv[0] for h in CORPUS}
    assert commands >= {
        "build", "check", "run", "gate", "report", "schema", "suite generate", "suite import",
        "faults", "diff-tokenizer", "diff-template",
    }  # fmt: skip


@pytest.mark.parametrize("case", CORPUS, ids=lambda h: h.name)
def test_hostile_input(
    case: Hostile,
    tmp_path: Path,
    good_layouts: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = _write_inputs(tmp_path, good_layouts)
    needed = {name for part in case.argv for _, name, _, _ in string.Formatter().parse(part) if name}
    if any(name.startswith("gr_") for name in needed):
        names.update(_write_runs(tmp_path, request.getfixturevalue("good_run"), needed))
    argv = [part.format(**names) for part in case.argv]
    before = _snapshot(tmp_path)
    code = _run(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert code == case.code, (
        f"exit {code}, expected {case.code}\nstderr: {captured.err}\nstdout: {captured.out}"
    )
    assert len(captured.err) < MAX_ERROR_CHARS, (
        f"{len(captured.err)} characters on stderr: {captured.err[:300]}"
    )
    if case.code == BAD:
        _assert_for_a_user(captured.err, argv)
    for fragment in case.fragments:
        assert fragment in captured.err, f"{fragment!r} not named on stderr: {captured.err}"
    for fragment in case.stdout:
        assert fragment in captured.out, f"{fragment!r} not on stdout: {captured.out}"
    if case.code != USAGE:
        assert "fix" in captured.err, captured.err
    after = _snapshot(tmp_path)
    assert after == before, (
        f"half-written: new {sorted(set(after) - set(before))}, "
        f"gone {sorted(set(before) - set(after))}, "
        f"changed {sorted(k for k in set(before) & set(after) if before[k] != after[k])}"
    )
    assert not UNWRITABLE.exists()


# --------------------------------------------------------------------------------------------------
# A run whose template raises leaves no run folder; after the template is fixed the same folder runs.


@pytest.mark.parametrize("precreated", [False, True], ids=["new-folder", "empty-folder"])
def test_run_with_a_raising_template_leaves_nothing_and_the_fixed_template_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], precreated: bool
) -> None:
    template = tmp_path / "turns.jinja"
    template.write_text("{{ raise_exception('Conversation roles must alternate') }}")
    run = tmp_path / "run"
    if precreated:
        run.mkdir()
    with NotStatedReader() as reader:
        matrix = tmp_path / "m.toml"
        matrix.write_text(matrix_text(reader.port, candidate_extra='chat_template = "turns.jinja"'))
        assert main(["run", str(matrix), "--out", str(run), "--no-controls"]) == BAD
        err = capsys.readouterr().err
        assert "turns.jinja" in err and "fix" in err
        # Nothing frozen: no manifest, no layouts; a folder the user made stays, empty.
        assert (run.is_dir() and not any(run.iterdir())) if precreated else not run.exists()
        template.write_text(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        code = main(["run", str(matrix), "--out", str(run), "--no-controls"])
        captured = capsys.readouterr()
    assert "plan" not in captured.err.lower() or "changed" not in captured.err.lower(), captured.err
    assert code in (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE, ExitCode.FAIL_SYSTEM), captured
    assert (run / "manifest.json").is_file() and (run / "report" / "verdict.json").is_file()


def test_main_maps_an_unexpected_os_error_on_a_user_path_to_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError about the user's own path that no command anticipated still ends as exit 20 naming the
    path, never a traceback; an error that is not about a path (a bug) stays visible."""
    import depthgate.commands.cli as cli

    target = tmp_path / "somewhere.json"

    def boom(args: Any) -> int:
        raise PermissionError(13, "Permission denied", str(target))

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        action.choices["schema"].set_defaults(func=boom)  # type: ignore[index]
    assert main(["schema"]) == BAD
    err = capsys.readouterr().err
    assert str(target) in err and "fix" in err and "Traceback" not in err

    def bug(args: Any) -> int:
        raise OSError("not about a path")

    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        action.choices["schema"].set_defaults(func=bug)  # type: ignore[index]
    with pytest.raises(OSError, match="not about a path"):
        main(["schema"])

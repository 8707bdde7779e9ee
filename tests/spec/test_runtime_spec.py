"""The per-arm ``runtime`` block of a matrix (issue #10, items 8 and 9): typed, closed (unknown names and
fields that cannot apply to the arm's backend are refused with the file, the field and the fix, exit 20
through the CLI), and digested only where it can change an answer. What each field does is tested with
its backend: tests/run/test_backends_http.py (HTTP fields, vLLM engine arguments, keys) and
tests/run/test_backend_llamacpp.py (embedded fields, paths, cache control)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from depthgate.commands.cli import main
from depthgate.exceptions import ExitCode, SpecError
from depthgate.spec.loading import load_matrix
from depthgate.spec.system import Runtime, System, VLLMEngineArgs
from helpers import REPO, small_smoke_matrix


def _matrix(tmp_path: Path, baseline_runtime: str = "", *, baseline: str | None = None) -> Path:
    """smoke.toml (2 cases, 480 tokens) with the baseline system replaced or given a runtime block."""
    text = small_smoke_matrix()
    if baseline is not None:
        head = text.index("[baseline]")
        tail = text.index("[candidate]")
        text = text[:head] + baseline + "\n" + text[tail:]
    if baseline_runtime:
        tail = text.index("[candidate]")
        text = text[:tail] + "[baseline.runtime]\n" + baseline_runtime + "\n\n" + text[tail:]
    path = tmp_path / "matrix.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _system(**kw: Any) -> System:
    base: dict[str, Any] = {
        "name": "arm",
        "backend": "llamacpp",
        "model": "gemma3-270m",
        "tokenizer": "gguf:",
    }
    base.update(kw)
    return System.model_validate(base)


# --------------------------------------------------------------------------------------------------
# closed: unknown names


def test_unknown_runtime_field_is_a_spec_error_naming_the_field(tmp_path: Path) -> None:
    path = _matrix(tmp_path, "timeout = 30")  # the field is timeout_s
    with pytest.raises(SpecError) as info:
        load_matrix(path)
    assert info.value.field == "baseline.runtime.timeout"
    assert "remove `timeout`" in str(info.value) and str(path) in str(info.value)


def test_unknown_vllm_engine_argument_is_refused(tmp_path: Path) -> None:
    system = (
        '[baseline]\nname = "offline"\nbackend = "vllm"\nmodel = "org/model"\ntokenizer = "gguf:"\n'
        "window = 2048\n\n[baseline.runtime.vllm]\ntrust_remote_code = true\n"
    )
    with pytest.raises(SpecError) as info:
        load_matrix(_matrix(tmp_path, baseline=system))
    assert info.value.field == "baseline.runtime.vllm.trust_remote_code"


def test_unknown_runtime_field_exits_20_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["run", str(_matrix(tmp_path, "timeout = 30")), "--out", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "baseline.runtime.timeout" in err and "fix:" in err
    assert not out.exists()  # refused before anything was written


# --------------------------------------------------------------------------------------------------
# closed: fields that cannot change anything for the arm's backend

VLLM_SERVER: dict[str, Any] = {"backend": "vllm-server", "endpoint": "http://127.0.0.1:8000"}


@pytest.mark.parametrize(
    ("system", "field"),
    [
        ({"backend": "anthropic", "runtime": {"prompt_format": "text"}}, "runtime.prompt_format"),
        ({"backend": "openai", "runtime": {"prompt_format": "token_ids"}}, "runtime.prompt_format"),
        ({"runtime": {"prompt_format": "text"}}, "runtime.prompt_format"),  # embedded: always ids
        ({**VLLM_SERVER, "runtime": {"api": "chat"}}, "runtime.api"),
        ({"runtime": {"timeout_s": 5}}, "runtime.timeout_s"),
        ({"runtime": {"concurrency": 2}}, "runtime.concurrency"),
        ({"backend": "vllm", "runtime": {"api_key_env": "K"}}, "runtime.api_key_env"),
        ({"backend": "vllm", "runtime": {"count_tolerance": 0.01}}, "runtime.count_tolerance"),
        ({**VLLM_SERVER, "runtime": {"reuse_prefix": True}}, "runtime.reuse_prefix"),
        ({"backend": "openai", "runtime": {"n_threads": 4}}, "runtime.n_threads"),
        ({"endpoint": "http://127.0.0.1:8080", "runtime": {"cache_control": True}}, "runtime.cache_control"),
        ({"runtime": {"vllm": {"tensor_parallel_size": 2}}}, "runtime.vllm"),
        # a key is always sent over https and to loopback: the exception would change nothing
        ({"backend": "anthropic", "runtime": {"allow_insecure_key": True}}, "runtime.allow_insecure_key"),
        (
            {"backend": "openai", "endpoint": "http://127.0.0.1:9", "runtime": {"allow_insecure_key": True}},
            "runtime.allow_insecure_key",
        ),
        # vllm-server sends no key unless api_key_env names one
        (
            {**VLLM_SERVER, "endpoint": "http://10.0.0.5:8000", "runtime": {"allow_insecure_key": True}},
            "runtime.allow_insecure_key",
        ),
    ],
)  # fmt: skip
def test_runtime_fields_that_cannot_apply_are_refused(system: dict[str, Any], field: str) -> None:
    data = {"name": "arm", "backend": "llamacpp", "model": "m", "tokenizer": "gguf:", **system}
    with pytest.raises(SpecError) as info:
        from depthgate.spec.loading import parse_spec

        parse_spec(System, data, file="m.toml")
    assert info.value.field == field
    assert "has no effect" in str(info.value) and "fix:" in str(info.value)


def test_runtime_values_are_typed_and_ranged() -> None:
    from pydantic import ValidationError

    for bad in (
        {"timeout_s": 0},
        {"timeout_s": "30"},
        {"concurrency": 0},
        {"max_connections": 1.5},
        {"count_tolerance": 1.0},
        {"allow_insecure_key": "yes"},
        {"prompt_format": "ids"},
        {"api_key_env": "sk-live-123"},  # a key, not a variable name
        {"vllm": {"gpu_memory_utilization": 1.5}},
        {"vllm": {"dtype": "int3"}},
    ):
        with pytest.raises(ValidationError):
            Runtime.model_validate(bad)


def test_accepted_runtime_blocks(tmp_path: Path) -> None:
    """Every field is accepted where it applies (its effect is tested with the backend)."""
    _system(runtime={"n_threads": 2, "reuse_prefix": True, "cache_control": True})
    _system(
        backend="llamacpp",
        endpoint="http://127.0.0.1:8080",
        runtime={
            "prompt_format": "text", "api_key_env": "LLAMA_KEY", "count_tolerance": 0.001, "timeout_s": 30,
            "connect_timeout_s": 2.5, "max_connections": 8, "concurrency": 2,
        },
    )  # fmt: skip
    _system(backend="openai", endpoint="http://10.0.0.5:8000", runtime={"allow_insecure_key": True})
    _system(backend="openai", runtime={"api": "completions", "prompt_format": "token_ids"})
    _system(
        backend="vllm-server",
        endpoint="http://gpu-box:8000",
        runtime={"api_key_env": "VLLM_KEY", "allow_insecure_key": True},
    )
    offline = _system(
        backend="vllm",
        model="org/model",
        runtime={"vllm": {"tensor_parallel_size": 2, "max_model_len": 8192, "gpu_memory_utilization": 0.85}},
    )
    assert offline.runtime.vllm == VLLMEngineArgs(
        tensor_parallel_size=2, max_model_len=8192, gpu_memory_utilization=0.85
    )
    assert offline.runtime.vllm is not None
    assert offline.runtime.vllm.engine_kwargs() == {
        "tensor_parallel_size": 2,
        "max_model_len": 8192,
        "gpu_memory_utilization": 0.85,
    }
    # the block validates inside a matrix file too
    loaded = load_matrix(_matrix(tmp_path, "n_threads = 2\nreuse_prefix = true"))
    assert loaded.baseline.runtime.n_threads == 2 and loaded.baseline.runtime.reuse_prefix


# --------------------------------------------------------------------------------------------------
# digests


def test_digest_binds_only_result_changing_runtime_fields() -> None:
    plain = _system(endpoint="http://127.0.0.1:8080")
    operational = _system(
        endpoint="http://127.0.0.1:8080",
        runtime={"timeout_s": 900, "connect_timeout_s": 3, "max_connections": 4, "concurrency": 1,
                 "api_key_env": "LLAMA_KEY"},
    )  # fmt: skip
    # A resume may raise a timeout or lower the concurrency: same digest, same run id.
    assert operational.digest() == plain.digest()
    assert "runtime" not in plain.model_dump()
    text = _system(endpoint="http://127.0.0.1:8080", runtime={"prompt_format": "text"})
    assert text.digest() != plain.digest()
    assert _system(runtime={"reuse_prefix": True}).digest() != _system().digest()
    assert _system(runtime={"cache_control": True}).digest() == _system().digest()  # an extra artifact
    vllm_a = _system(backend="vllm", runtime={"vllm": {"tensor_parallel_size": 2}})
    vllm_b = _system(backend="vllm", runtime={"vllm": {"tensor_parallel_size": 4}})
    assert vllm_a.digest() != vllm_b.digest()


def test_every_shipped_matrix_still_validates_with_its_runtime() -> None:
    for path in sorted((REPO / "matrices").glob("*.toml")):
        matrix = load_matrix(path)
        for system in (matrix.baseline, matrix.candidate):
            assert isinstance(system.runtime, Runtime), path


def test_relative_paths_of_the_matrix_are_not_resolved_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make_backend takes the matrix's folder; a tokenizer path relative to it is found from any cwd."""
    from depthgate.run.backends import make_backend
    from depthgate.run.backends.chat import OpenAIChatBackend
    from fixtures_paths import tokenizers_dir

    matrix_dir = tmp_path / "matrices"
    (matrix_dir / "tok").mkdir(parents=True)
    (matrix_dir / "tok" / "tokenizer.json").write_bytes(
        (tokenizers_dir() / "gpt2" / "tokenizer.json").read_bytes()
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    system = _system(backend="openai", endpoint="http://127.0.0.1:9", tokenizer="tok/tokenizer.json")
    backend = make_backend(system, base_dir=matrix_dir)
    assert isinstance(backend, OpenAIChatBackend) and backend.local_count is not None
    assert backend.local_count("Hello world") == 2  # GPT-2: "Hello", " world"
    assert os.getcwd() == str(elsewhere)


# --------------------------------------------------------------------------------------------------
# determinism settings in the manifest (issue #13 item 3)


def _installed(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def test_determinism_settings_per_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the manifest records per arm about repeatability, from the system and the environment (no
    engine is started: vLLM cannot run here, so its row is checked from the spec and env alone)."""
    from depthgate.run.backends import determinism_settings
    from depthgate.spec.system import DecodeParams

    greedy, sampled = DecodeParams(seeds=[0, 1]), DecodeParams(temperature=0.7, seeds=[3])
    embedded = determinism_settings(_system(runtime={"n_threads": 3, "reuse_prefix": True}), greedy)
    assert embedded["sequences_in_flight"] == 1 and embedded["batch_invariant"] is True
    assert embedded["n_threads"] == 3 and embedded["reuse_prefix"] is True
    assert embedded["sampling"] == "greedy (argmax)" and embedded["seeds"] == [0, 1]
    assert embedded["seed_sent"] == "unused (greedy)"
    assert determinism_settings(_system(), sampled)["seed_sent"] == "per request (sampler seed)"

    vllm = _system(backend="vllm", model="org/model", tokenizer=str(REPO / "README.md"))
    vllm = vllm.model_copy(update={"runtime": Runtime(vllm=VLLMEngineArgs(seed=7, enforce_eager=True))})
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    row = determinism_settings(vllm, greedy)
    assert row["engine_seed"] == 7 and row["enforce_eager"] is True and row["batch_invariant"] is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert determinism_settings(vllm, greedy)["batch_invariant"] is True

    server = _system(backend="vllm-server", endpoints=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    row = determinism_settings(server, sampled)
    assert row["endpoints"] == 2 and row["batch_invariant"] == "unknown (server-side setting)"
    # The installed engine's version; an absent one (vLLM here) is said, not made up.
    assert embedded["engine_version"] == _installed("llama-cpp-python")
    assert determinism_settings(vllm, greedy)["engine_version"] == _installed("vllm")

    assert row["sampling"] == "temperature 0.7, seeded per request"
    row = determinism_settings(_system(backend="anthropic", model="claude", endpoint=None), greedy)
    assert row["seed_sent"] == "no (the API has no seed)"
    assert "key" not in json.dumps(row).lower()

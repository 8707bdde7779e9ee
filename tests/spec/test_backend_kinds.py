"""One descriptor per backend (issue #23 item 3): the registry of depthgate.spec.backend_kinds is what
the matrix validation, the backend factory, the Ray engine's driver and the manifest read. Registering
a toy backend (a descriptor and its factory, nothing else) makes a matrix with it valid, its runtime
fields checked, its backend built and its determinism recorded; an unknown name is refused by name,
listing the registered ones."""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from depthgate.exceptions import SpecError
from depthgate.run.backends import determinism_settings, make_backend
from depthgate.run.backends.base import Request, Response
from depthgate.run.backends.factories import BackendFactory, BuildContext
from depthgate.run.ray_engine import driver_backend
from depthgate.spec.backend_kinds import (
    HTTP_FIELDS,
    BackendKind,
    ServingPath,
    register_backend,
    registered_backends,
    unregister_backend,
)
from depthgate.spec.loading import parse_spec
from depthgate.spec.manifest import RunManifest
from depthgate.spec.matrix import Matrix
from depthgate.spec.system import DecodeParams, System

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


class ToyBackend:
    """Answers every request with the same text (a backend needs nothing more)."""

    accepts_token_ids = True
    count_tolerance = 0.0

    def __init__(self, name: str, window: int | None) -> None:
        self.name, self.window = name, window

    async def generate(self, request: Request) -> Response:
        n = None if request.token_ids is None else len(request.token_ids)
        return Response(text=" 42", finish_reason="stop", prompt_tokens_server=n, completion_tokens=1)

    async def aclose(self) -> None:
        return None


def _build(system: System, context: BuildContext) -> ToyBackend:
    return ToyBackend(system.name, system.window or 1024)


TOY_FACTORY = BackendFactory(_build, lambda system, greedy: {"engine": "toy", "batch_invariant": True})

TOY = BackendKind(
    "toy",
    {
        "default": ServingPath(
            label="backend 'toy'",
            takes="token_ids",
            embedded=True,
            endpoint="forbidden",
            runtime_fields=frozenset({"n_threads"}),
            probe="none",
            parity="none",
            factory=f"{__name__}:TOY_FACTORY",
            default_window=1024,
        )
    },
)


@pytest.fixture
def toy() -> Iterator[BackendKind]:
    register_backend(TOY)
    try:
        yield TOY
    finally:
        unregister_backend("toy")


def _matrix_data(backend: str, **system: Any) -> dict[str, Any]:
    arm = {"name": "base", "backend": "llamacpp", "model": "gemma3-270m", "tokenizer": "gguf:"}
    return {
        "name": "toy-matrix",
        "suite": "builtin",
        "lengths": [1024],
        "positions": [0.5],
        "baseline": arm,
        "candidate": {**arm, "name": "cand", "backend": backend, **system},
    }


def test_a_registered_toy_backend_is_accepted_by_the_matrix(toy: BackendKind) -> None:
    assert "toy" in registered_backends()
    matrix = parse_spec(Matrix, _matrix_data("toy", runtime={"n_threads": 2}), file="m.toml")
    assert matrix.candidate.backend == "toy"
    assert matrix.candidate.serving is toy.paths["default"]
    # its runtime fields, and only those, apply
    with pytest.raises(SpecError) as info:
        parse_spec(Matrix, _matrix_data("toy", runtime={"timeout_s": 5}), file="m.toml")
    assert info.value.field == "candidate.runtime.timeout_s"
    assert "has no effect on backend 'toy'" in str(info.value)
    # its endpoint rule
    with pytest.raises(SpecError) as info:
        parse_spec(Matrix, _matrix_data("toy", endpoint="http://127.0.0.1:9"), file="m.toml")
    assert info.value.field == "candidate.endpoint"


def test_a_registered_toy_backend_is_built_recorded_and_driven(toy: BackendKind) -> None:
    system = System(name="cand", backend="toy", model="m", tokenizer="gguf:")
    backend = make_backend(system)
    assert isinstance(backend, ToyBackend) and backend.window == 1024
    settings = determinism_settings(system, DecodeParams())
    assert settings["backend"] == "toy" and settings["engine"] == "toy"
    # embedded: the Ray driver holds a window-only stand-in, the descriptor's default window
    stand_in = driver_backend(system)
    assert not isinstance(stand_in, ToyBackend) and stand_in.window == 1024
    # the manifest's record of the arm validates
    record = {
        "name": "cand",
        "backend": "toy",
        "model": "m",
        "system_digest": system.digest(),
        "tokenizer_digest": "t",
        "template_digest": "raw",
        "pinned_date": "",
        "assembler": "default",
        "assembler_version": "1",
    }
    manifest = {
        "run_id": "r",
        "manifest_digest": "d",
        "created_at": "now",
        "matrix": "m",
        "matrix_file": "m.toml",
        "matrix_digest": "x",
        "plan_digest": "p",
        "suite_digest": "s",
        "suite": {},
        "seeds": [0],
        "decode": {},
        "lengths": [1024],
        "positions": ["0.5"],
        "systems": {"candidate": record},
        "versions": {},
    }
    assert RunManifest.model_validate(copy.deepcopy(manifest)).systems["candidate"].backend == "toy"


def test_an_unknown_backend_is_refused_by_name_listing_the_registered_ones(toy: BackendKind) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(Matrix, _matrix_data("llama"), file="m.toml")
    assert info.value.field == "candidate.backend"
    assert "unknown backend 'llama'" in str(info.value)
    for name in ("'llamacpp'", "'vllm'", "'vllm-server'", "'openai'", "'anthropic'", "'toy'"):
        assert name in (info.value.fix or "")


def test_an_unregistered_backend_is_refused_again() -> None:
    register_backend(TOY)
    unregister_backend("toy")
    with pytest.raises(SpecError) as info:
        parse_spec(Matrix, _matrix_data("toy"), file="m.toml")
    assert "unknown backend 'toy'" in str(info.value) and "'toy'" not in (info.value.fix or "")


def test_a_factory_that_disagrees_with_its_descriptor_is_refused(toy: BackendKind) -> None:
    """The descriptor says what the backend takes; a factory building a text backend for an ids path is
    a bug caught when the backend is made."""
    system = System(name="cand", backend="toy", model="m", tokenizer="gguf:")
    text_only = ToyBackend("cand", 1024)
    text_only.accepts_token_ids = False
    global TOY_FACTORY
    saved = TOY_FACTORY
    TOY_FACTORY = BackendFactory(lambda system, context: text_only, saved.determinism)
    try:
        with pytest.raises(TypeError, match="takes text"):
            make_backend(system)
    finally:
        TOY_FACTORY = saved


def test_registering_a_name_twice_is_refused(toy: BackendKind) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_backend(toy)


def test_no_module_branches_on_a_backend_name() -> None:
    """Outside the registry, no comparison of anything with a registered backend's name (the `if
    backend == "vllm"` chains that were in four places): counted on the source, the count is 0."""
    names = set(registered_backends())
    chains: list[str] = []
    for path in sorted((REPO / "python" / "depthgate").rglob("*.py")):
        if path.name == "backend_kinds.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            constants = [
                elt
                for operand in [node.left, *node.comparators]
                for elt in (
                    operand.elts if isinstance(operand, ast.Tuple | ast.Set | ast.List) else [operand]
                )
            ]
            if any(isinstance(c, ast.Constant) and c.value in names for c in constants):
                chains.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert chains == [], chains


def test_every_built_in_path_names_a_factory_that_exists() -> None:
    from depthgate.run.backends import factory_for
    from depthgate.spec.backend_kinds import backend_kind

    for name in registered_backends():
        for key, path in backend_kind(name).paths.items():
            system = System(
                name="arm",
                backend=name,
                model="m",
                tokenizer="gguf:",
                endpoint="http://127.0.0.1:9" if path.endpoint == "required" else None,
                runtime={"api": key} if path.accepts("api") else {},
            )
            assert system.serving is path
            assert isinstance(factory_for(system), BackendFactory)
            assert path.sends_token_ids() == (path.takes != "text")
            assert not path.sends_token_ids("text") or path.takes == "token_ids"
            assert path.runtime_fields <= HTTP_FIELDS | {
                "prompt_format",
                "tokenizer_parity",
                "api",
                "n_threads",
                "reuse_prefix",
                "cache_control",
                "vllm",
            }


def test_the_json_schema_lists_the_registered_backends(toy: BackendKind) -> None:
    from depthgate.spec.loading import schema

    backend = schema()["System"]["properties"]["backend"]
    assert backend["type"] == "string" and backend["enum"] == list(registered_backends())
    assert "toy" in backend["enum"]


def test_canaries_default_on_for_every_server_path_and_off_for_embedded_engines(toy: BackendKind) -> None:
    """Issue #37 item 7: a matrix that leaves ``canaries`` out gets DEFAULT_SERVER_CANARIES when an arm's
    serving path is not embedded — every built-in server path, read from the registry, not by name —
    and 0 when both arms are embedded engines (llama.cpp in process, vLLM offline, a registered toy);
    an explicit ``canaries = 0`` stays 0."""
    from depthgate.spec.backend_kinds import backend_kind
    from depthgate.spec.matrix import DEFAULT_SERVER_CANARIES

    seen = set()
    for name in registered_backends():
        for key, path in backend_kind(name).paths.items():
            arm = {
                "backend": name,
                "model": "m",
                "tokenizer": "gguf:",
                **({"endpoint": "http://127.0.0.1:9"} if path.endpoint == "required" else {}),
                **({"runtime": {"api": key}} if path.accepts("api") else {}),
            }
            data = {**_matrix_data(name), "baseline": {**arm, "name": "base"}}
            data["candidate"] = {**arm, "name": "cand"}
            matrix = parse_spec(Matrix, data, file="m.toml")
            assert matrix.candidate.serving is path
            expected = 0 if path.embedded else DEFAULT_SERVER_CANARIES
            assert matrix.canaries == expected, (name, key)
            assert parse_spec(Matrix, {**data, "canaries": 0}, file="m.toml").canaries == 0
            # one server arm is enough: the other side of the comparison may be an embedded engine
            mixed = {**_matrix_data(name), "candidate": {**arm, "name": "cand"}}
            assert parse_spec(Matrix, mixed, file="m.toml").canaries == expected, (name, key)
            seen.add((name, path.embedded))
    assert {("vllm-server", False), ("openai", False), ("anthropic", False), ("llamacpp", False)} <= seen
    assert {("llamacpp", True), ("vllm", True), ("toy", True)} <= seen

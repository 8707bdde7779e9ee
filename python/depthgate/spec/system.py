"""One arm of a comparison: decoding parameters shared by both arms, the backend's runtime block, and
the :class:`System` (backend, model, tokenizer, template, endpoints). What each backend accepts is its
descriptor's (:mod:`depthgate.spec.backend_kinds`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)

from depthgate.spec.backend_kinds import ServingPath, backend_kind, registered_backends, serving_path
from depthgate.spec.base import Frozen, StrictFloat, StrictInt, violation
from depthgate.spec.limits import (
    MAX_ENDPOINTS,
    MAX_SEEDS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    count_problems,
    summarise_urls,
)
from depthgate.spec.text_checks import check_id, check_prompt_text
from depthgate.spec.urls import check_url


def _registered_backend(name: str) -> str:
    if name not in registered_backends():
        raise violation(
            f"unknown backend {name!r}",
            fix="use one of the registered backends: " + ", ".join(map(repr, registered_backends())),
        )
    return name


#: A backend kind named in the registry of :mod:`depthgate.spec.backend_kinds` (checked when read, so a
#: registered backend is accepted by the matrix and the manifest alike).
def _backend_schema(schema: dict[str, Any]) -> None:
    """The JSON Schema lists the backends registered when it is generated (``depthgate schema``)."""
    schema["enum"] = list(registered_backends())


Backend: TypeAlias = Annotated[
    str, AfterValidator(_registered_backend), Field(json_schema_extra=_backend_schema)
]


#: Prompt assemblers (depthgate.spec.assemblers): where the question goes relative to the document.
Assembler: TypeAlias = Literal["default", "query-first"]


class DecodeParams(Frozen):
    """Decoding parameters shared by both arms. One seed per repeat."""

    max_tokens: StrictInt = Field(default=12, ge=1, le=65536)
    temperature: StrictFloat = Field(default=0.0, ge=0.0, le=2.0)
    seeds: list[StrictInt] = Field(default_factory=lambda: [0])
    stop: list[str] = Field(default_factory=lambda: ["\n"])

    @model_validator(mode="after")
    def _check_decode(self) -> DecodeParams:
        empty, over = (
            "list one seed per repeat, e.g. [0]",
            f"list at most {MAX_SEEDS} seeds (more cases buy more power than more seeds)",
        )
        for problem, fix in count_problems(len(self.seeds), MAX_SEEDS, "seeds", empty, over):
            raise violation(problem, field="seeds", fix=fix)
        for index, seed in enumerate(self.seeds):
            if not 0 <= seed < 2**63:
                raise violation(
                    f"{seed} is out of range", field=f"seeds[{index}]", fix="use 0 <= seed < 2**63"
                )
        if len(set(self.seeds)) != len(self.seeds):
            raise violation("contains a repeated seed", field="seeds", fix="make the seeds distinct")
        for index, stop in enumerate(self.stop):
            if not stop:
                raise violation("is empty", field=f"stop[{index}]", fix="remove the empty stop string")
        return self


_ENV_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _clear_text_remote(url: str) -> bool:
    """``url`` is plain http (not https) to a host that is not loopback (127.0.0.0/8, ::1, localhost)."""
    import ipaddress
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme.lower() == "https":
        return False
    host = (parts.hostname or "").rstrip(".").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


class VLLMEngineArgs(Frozen):
    """Engine arguments for the offline ``vllm`` backend, passed to ``vllm.LLM(...)`` as given (``[<arm>
    .runtime.vllm]`` in a matrix). Only these keys are accepted; ``trust_remote_code`` is deliberately
    not among them (a matrix must not be able to run code from a model repository). A relative
    ``tokenizer`` that exists next to the matrix file, and a relative ``download_dir``, are taken relative
    to the matrix file; ``max_model_len`` overrides the system's ``window`` as the engine's length."""

    tensor_parallel_size: StrictInt | None = Field(default=None, ge=1)
    pipeline_parallel_size: StrictInt | None = Field(default=None, ge=1)
    max_model_len: StrictInt | None = Field(default=None, ge=16, le=MAX_TOKENS)
    gpu_memory_utilization: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = None
    quantization: str | None = Field(default=None, min_length=1)
    kv_cache_dtype: str | None = Field(default=None, min_length=1)
    enforce_eager: StrictBool | None = None
    enable_prefix_caching: StrictBool | None = None
    max_num_seqs: StrictInt | None = Field(default=None, ge=1)
    max_num_batched_tokens: StrictInt | None = Field(default=None, ge=1)
    swap_space: StrictFloat | None = Field(default=None, ge=0.0)
    seed: StrictInt | None = Field(default=None, ge=0)
    tokenizer: str | None = Field(default=None, min_length=1)
    revision: str | None = Field(default=None, min_length=1)
    download_dir: str | None = Field(default=None, min_length=1)

    def engine_kwargs(self) -> dict[str, Any]:
        """The keys that were set, as keyword arguments of ``vllm.LLM``."""
        return {name: value for name, value in self if value is not None}

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class Runtime(Frozen):
    """How one arm's backend runs: ``[baseline.runtime]`` / ``[candidate.runtime]`` in a matrix.

    Unset fields keep the backend's own default. A field that cannot change anything for the arm's
    backend is refused (:class:`System` says which backend each applies to):

    * OpenAI-compatible ``/v1/completions`` (``vllm-server``, ``llamacpp`` with an endpoint, ``openai``
      with ``api = "completions"``): ``prompt_format`` — ``"token_ids"`` (default; vLLM, llama-server) or
      ``"text"`` (servers that take text only, e.g. llama-cpp-python's); ``tokenizer_parity`` — what
      happens when the server's tokenizer cannot be asked (:mod:`depthgate.run.parity`; a route that
      fails, hangs or answers garbage is retried first): ``"refuse_on_failure"`` (default: a route that
      still fails refuses the run, exit 30; a server with no tokenize route runs with parity "not
      checked", said in every report), ``"required"`` (also no route refuses, exit 22) or
      ``"best_effort"`` (run with parity "not checked" and the reason, in every report).
    * ``openai``: ``api`` — ``"chat"`` (default) or ``"completions"``.
    * every HTTP backend: ``api_key_env`` (the NAME of the variable holding the key), ``allow_insecure_key``
      (send the key over plain http to a non-loopback endpoint: refused otherwise), ``count_tolerance``
      (relative prompt-count difference allowed; default 0, exact), ``timeout_s``, ``connect_timeout_s``,
      ``max_connections`` (pool size), ``concurrency`` (this arm's requests in flight, per endpoint when
      the arm lists several ``endpoints``; the run's ``--concurrency`` still caps both arms together).
    * embedded ``llamacpp`` (no endpoint): ``n_threads``, ``reuse_prefix`` (keep the KV prefix between
      requests), ``cache_control`` (after the run, the warm/cold prefix-cache control of
      ``depthgate.run.cache`` on this arm's layouts, written to ``RUN/<arm>/cache_control.json``).
    * ``vllm`` (offline): ``vllm`` — engine arguments (:class:`VLLMEngineArgs`).

    The system digest (and so the run id) binds the fields that can change an answer — ``prompt_format``,
    ``api``, ``count_tolerance``, ``n_threads``, ``reuse_prefix``, ``vllm`` — and only when set; the
    operational ones (key variable, timeouts, pool, concurrency, ``allow_insecure_key``,
    ``cache_control``, ``tokenizer_parity``) can change between a run and its resume.
    """

    prompt_format: Literal["token_ids", "text"] | None = None
    tokenizer_parity: Literal["required", "refuse_on_failure", "best_effort"] | None = None
    api: Literal["chat", "completions"] | None = None
    api_key_env: str | None = None
    allow_insecure_key: StrictBool = False
    count_tolerance: StrictFloat | None = Field(default=None, ge=0.0, lt=1.0)
    timeout_s: StrictFloat | None = Field(default=None, gt=0.0, le=MAX_TIMEOUT_S)
    connect_timeout_s: StrictFloat | None = Field(default=None, gt=0.0, le=MAX_TIMEOUT_S)
    max_connections: StrictInt | None = Field(default=None, ge=1, le=65_536)
    concurrency: StrictInt | None = Field(default=None, ge=1, le=65_536)
    n_threads: StrictInt | None = Field(default=None, ge=1, le=4_096)
    reuse_prefix: StrictBool = False
    cache_control: StrictBool = False
    vllm: VLLMEngineArgs | None = None

    #: Fields bound by the system digest (when set to something other than their default).
    RESULT_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"prompt_format", "api", "count_tolerance", "n_threads", "reuse_prefix", "vllm"}
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_var_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_VAR_NAME.match(value):
            raise violation(
                f"{value!r} is not an environment variable name",
                fix="give the NAME of the variable that holds the key (e.g. 'MY_GATEWAY_KEY'), never the key",
            )
        return value

    @model_serializer(mode="wrap")
    def _result_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        fields = type(self).model_fields
        return {
            k: v
            for k, v in data.items()
            if k in self.RESULT_FIELDS and getattr(self, k) != fields[k].default and v not in ({}, None)
        }


class System(Frozen):
    """One arm of a comparison: backend, model, tokenizer, chat template, prompt assembler, and how the
    backend runs (:class:`Runtime`). Relative paths (``tokenizer``, ``chat_template``, a ``.gguf``
    ``model``) are relative to the matrix file.

    ``endpoint``: the one server of an HTTP arm. ``endpoints``: several servers, replicas of one model,
    for the OpenAI-compatible ``/v1/completions`` backends (``vllm-server``, ``llamacpp``, ``openai``
    with ``api = "completions"``): every one is probed before the first request (served model; windows
    must agree), requests of one haystack go to one replica, a replica that dies is drained and its jobs
    retried on the others (:mod:`depthgate.run.backends.pool`); ``runtime.concurrency`` is then per
    endpoint. The digest binds that the arm runs on replicas, not which: a resume may add, drop or
    replace replicas (each is probed and must agree)."""

    name: str
    backend: Backend
    model: str = Field(min_length=1)
    tokenizer: str = Field(
        min_length=1, description='a tokenizer path, or "gguf:" (optionally "gguf:<path>")'
    )
    chat_template: str | None = None
    assembler: Assembler = "default"
    preamble: str = ""
    window: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    endpoint: str | None = None
    endpoints: list[str] | None = None
    runtime: Runtime = Runtime()

    @property
    def urls(self) -> list[str]:
        """The arm's servers: ``endpoints``, else ``[endpoint]``, else none."""
        if self.endpoints is not None:
            return list(self.endpoints)
        return [] if self.endpoint is None else [self.endpoint]

    @model_serializer(mode="wrap")
    def _without_default_runtime(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A system without result-changing runtime settings digests exactly as before the block existed.
        data: dict[str, Any] = handler(self)
        if not data.get("runtime"):
            data.pop("runtime", None)
        # Replicas are interchangeable (probed to serve one model and window): the digest binds that the
        # arm runs on replicas, not which ones, so a resume may replace a dead replica.
        if data.get("endpoints") is None:
            data.pop("endpoints", None)
        else:
            data["endpoints"] = "replicas"
        return data

    @property
    def serving(self) -> ServingPath:
        """The arm's serving path (:mod:`depthgate.spec.backend_kinds`): from its backend, whether it names
        an endpoint, and its ``runtime.api``."""
        has_endpoint = self.endpoint is not None or self.endpoints is not None
        return serving_path(self.backend, has_endpoint=has_endpoint, api=self.runtime.api)

    def _check_runtime(self) -> None:
        runtime, path = self.runtime, self.serving
        for name in sorted(runtime.model_fields_set):
            if not path.accepts(name):
                raise violation(
                    f"has no effect on {path.label}",
                    field=f"runtime.{name}",
                    fix=f"remove it; it applies only to {_paths_accepting(name)}",
                )
        names_key = runtime.api_key_env is not None or path.always_sends_key
        clear = [url for url in self.urls if _clear_text_remote(url)]
        url_field = "endpoints" if self.endpoints is not None else "endpoint"
        if names_key and clear and not runtime.allow_insecure_key:
            raise violation(
                f"would send the API key in clear text: {clear[0]} is plain http to a host that is not "
                "loopback",
                field=url_field,
                fix="use an https:// endpoint; on a trusted network only, set allow_insecure_key = true in "
                "this arm's runtime block",
            )
        if runtime.allow_insecure_key:
            url = ", ".join(self.urls) or None
            if not clear:
                raise violation(
                    f"has no effect: the endpoint {url or '(the provider default)'} is https or loopback",
                    field="runtime.allow_insecure_key",
                    fix="remove it; keys are always sent over https and to loopback hosts",
                )
            if path.default_key_env is None and not path.always_sends_key and runtime.api_key_env is None:
                raise violation(
                    f"has no effect: {path.label} sends no key without api_key_env",
                    field="runtime.allow_insecure_key",
                    fix="remove it, or name the key's variable in runtime.api_key_env",
                )

    @model_validator(mode="after")
    def _check_system(self) -> System:
        # The URLs first: the runtime checks below parse them.
        if self.endpoint is not None:
            check_url(self.endpoint, field="endpoint")
        if self.endpoints is not None:
            self._check_endpoints()
        self._check_runtime()
        check_id(self.name, field="name")
        check_prompt_text(self.preamble, field="preamble")
        path = self.serving
        hint = f", {path.endpoint_hint}" if path.endpoint_hint else ""
        if path.endpoint == "required" and not self.urls:
            raise violation(
                f"{path.label} needs an endpoint",
                field="endpoint",
                fix=f"set endpoint = 'http://host:port' (or endpoints = [...] for replicas){hint}",
            )
        if path.endpoint == "forbidden" and self.urls:
            raise violation(
                f"{path.label} runs in this process and takes no endpoint",
                field="endpoints" if self.endpoints is not None else "endpoint",
                fix=f"remove it{hint}",
            )
        return self

    def _check_endpoints(self) -> None:
        endpoints = self.endpoints or []
        if self.endpoint is not None:
            raise violation(
                "endpoint and endpoints are both set",
                field="endpoints",
                fix="list every server in endpoints (one server: endpoint alone)",
            )
        if not endpoints:
            raise violation(
                "is empty", field="endpoints", fix="list at least one server, e.g. ['http://127.0.0.1:8000']"
            )
        if len(endpoints) > MAX_ENDPOINTS:
            raise violation(
                f"lists {len(endpoints)} endpoints ({summarise_urls(endpoints)}), over the limit of "
                f"{MAX_ENDPOINTS} per arm",
                field="endpoints",
                fix=f"list at most {MAX_ENDPOINTS} replicas (put a load balancer in front of more), or split "
                "the run with --shard i/N",
            )
        for i, url in enumerate(endpoints):
            check_url(url, field=f"endpoints[{i}]")
        seen: dict[str, int] = {}
        for i, url in enumerate(endpoints):
            norm = _url_identity(url)
            if norm in seen:
                raise violation(
                    f"{url!r} is the same server as endpoints[{seen[norm]}]",
                    field=f"endpoints[{i}]",
                    fix="list each server once",
                )
            seen[norm] = i
        path = self.serving
        if not path.replicas and path.endpoint != "forbidden":  # no endpoint at all: refused below
            raise violation(
                f"several endpoints need an OpenAI-compatible /v1/completions backend, not {path.label}",
                field="endpoints",
                fix="use backend 'vllm-server' or 'llamacpp' (or 'openai' with runtime.api = 'completions'), "
                "or one endpoint (a load balancer in front of the replicas)",
            )


def _url_identity(url: str) -> str:
    """A server URL without the differences that name the same server (case of scheme and host, a
    trailing ``/`` or ``/v1``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{path}"


def _paths_accepting(runtime_field: str) -> str:
    """The serving paths a runtime field applies to, named for an error's fix."""
    labels = [
        path.label
        for name in registered_backends()
        for path in backend_kind(name).paths.values()
        if path.accepts(runtime_field)
    ]
    return ", ".join(labels) or "no registered backend"

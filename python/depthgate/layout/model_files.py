"""The tokenizer and chat template *of a model*: a model folder, or a hub id pinned to a revision.

A nightly job serves a model from a folder or a hub snapshot; copying its ``tokenizer.json`` and chat
template by hand is where a harness and the server drift apart. ``tokenizer`` and ``chat_template`` in
a matrix (and ``--tokenizer`` / ``--chat-template``) may therefore name

* a **model folder** (``tokenizer.json`` + ``tokenizer_config.json``, optionally
  ``chat_template.jinja``), relative to the matrix file, or
* ``hf:ORG/NAME@REVISION`` (``@REVISION`` optional, default ``main``): the snapshot in the Hugging Face
  cache, resolved by ``huggingface_hub`` itself — the ecosystem's own cache layout, ``HF_HOME`` /
  ``HF_HUB_CACHE`` and offline mode (``HF_HUB_OFFLINE=1``) are honoured as vLLM and transformers honour
  them. A revision given as a 40-hex commit is looked up in the cache first (no network for a pinned,
  cached snapshot); a branch or tag asks the hub unless offline.

BOS/EOS come from the same snapshot. ``tokenizer.json`` alone does not say whether the model wants a BOS:
transformers applies ``add_bos_token`` / ``add_eos_token`` from ``tokenizer_config.json`` on top of it
(measured on Gemma-3-270M converted from its GGUF: the ``tokenizer.json`` post-processor adds nothing,
the config says ``add_bos_token: true``, and without BOS the model answers noise). When the config asks
for a BOS/EOS the post-processor does not add, depthgate writes the tokenizer with that post-processor
(as transformers' ``update_post_processor`` does) into its cache and loads that, so layouts start with
the BOS the server's own tokenizer would add. The chat template comes from ``chat_template.jinja``, else
the ``chat_template`` key of ``tokenizer_config.json``; its bos/eos strings from the same config.

The resolved revision (a commit for ``hf:``) and the sha256 of every file read go into the run manifest.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from depthgate.exceptions import InputError, TemplateError, TokenizerLoadError
from depthgate.layout.templates import ChatTemplate, load_chat_template
from depthgate.spec.files import (
    ReadFailures,
    atomic_write,
    cache_dir,
    import_extra,
    read_json_object,
    sha256_file,
)
from depthgate.spec.paths import resolve_relative

__all__ = ["HF_PREFIX", "ModelFiles", "is_model_reference", "load_template", "resolve_model_files"]

HF_PREFIX = "hf:"
_TOKENIZER = "tokenizer.json"
_CONFIG = "tokenizer_config.json"
_TEMPLATE = "chat_template.jinja"
_FILES = (_TOKENIZER, _CONFIG, _TEMPLATE, "special_tokens_map.json", "chat_template.json")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

_CONFIG_READ = ReadFailures(
    InputError,
    missing=("tokenizer_config.json not found", "give a model folder that has its tokenizer_config.json"),
    unreadable=("cannot read file: {strerror}", "check that the path is a readable file"),
    field="tokenizer",
)


@dataclass(frozen=True)
class ModelFiles:
    """What depthgate reads from one model snapshot."""

    reference: str
    """As the matrix wrote it (``hf:org/name@rev`` or the folder)."""
    folder: Path
    revision: str | None
    """The commit the hub reference resolved to; ``None`` for a plain folder."""
    tokenizer_file: Path
    """The ``tokenizer.json`` to load: the snapshot's own, or the cache copy with BOS/EOS applied."""
    add_bos: bool | None
    add_eos: bool | None
    bos_token: str | None
    eos_token: str | None
    post_processor_patched: bool
    digests: dict[str, str] = field(default_factory=dict)
    """sha256 of every snapshot file read, by file name."""

    @property
    def template_file(self) -> Path | None:
        """The file holding the chat template (``chat_template.jinja`` or ``tokenizer_config.json``),
        or ``None`` when the snapshot has none."""
        jinja = self.folder / _TEMPLATE
        if jinja.is_file():
            return jinja
        config = self.folder / _CONFIG
        if config.is_file() and "chat_template" in _read_config(config):
            return config
        return None

    def manifest(self) -> dict[str, Any]:
        """What the run manifest binds of this snapshot (no local paths: they differ between machines)."""
        return {
            "reference": self.reference,
            "revision": self.revision,
            "files": dict(sorted(self.digests.items())),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "post_processor_patched": self.post_processor_patched,
        }


def is_model_reference(spec: str, *, base_dir: Path | None = None) -> bool:
    """``hf:…``, or an existing folder (relative to ``base_dir``)."""
    return spec.startswith(HF_PREFIX) or resolve_relative(spec, base_dir).is_dir()


def _read_config(path: Path) -> dict[str, Any]:
    return read_json_object(path, _CONFIG_READ, "give the model's own tokenizer_config.json")


def _flag(config: dict[str, Any], name: str, path: Path) -> bool | None:
    """A boolean flag of ``tokenizer_config.json`` (None: absent or null). Anything else is refused: a
    ``"yes"`` or ``1`` used to be read as unset, so the BOS the model needs was silently left out."""
    value = config.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise InputError(
        f"{name} is {value!r}, not true or false",
        file=str(path),
        field=name,
        fix=f"write {name}: true or {name}: false (a JSON boolean, no quotes), as the model's own file has",
    )


def _token(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _parse_hf(spec: str) -> tuple[str, str]:
    body = spec[len(HF_PREFIX) :]
    repo, _, revision = body.partition("@")
    if not _REPO_ID.match(repo) or ("@" in body and not revision):
        raise InputError(
            f"{spec!r} is not a hub reference",
            field="tokenizer",
            fix="write hf:ORG/NAME@REVISION (a commit, tag or branch), e.g. hf:google/gemma-3-270m@main",
        )
    return repo, revision or "main"


def _hub_snapshot(spec: str) -> tuple[Path, str]:
    """The cached (or, online, downloaded) snapshot folder of ``hf:repo@rev`` and its commit."""
    repo, revision = _parse_hf(spec)
    hub: Any = import_extra(
        "huggingface_hub",
        error=InputError,
        what="huggingface_hub is needed to resolve hub references",
        field="tokenizer",
        fix="pip install huggingface_hub (a dependency of depthgate; reinstall it)",
    )
    # Read at call time (huggingface_hub reads them once, at its import): the same variables, the same
    # meaning, whether the process set them before or after importing it.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "on", "yes", "true"}
    cache = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None
    )
    patterns = list(_FILES)
    folder: str | None = None
    try:
        # A pinned commit that is cached needs no network; a branch is re-resolved unless offline.
        local_first = offline or bool(_COMMIT.match(revision))
        if local_first:
            try:
                folder = hub.snapshot_download(
                    repo, revision=revision, allow_patterns=patterns, local_files_only=True, cache_dir=cache
                )
            except Exception:
                if offline:
                    raise
        if folder is None:
            folder = hub.snapshot_download(repo, revision=revision, allow_patterns=patterns, cache_dir=cache)
    except Exception as exc:
        raise InputError(
            f"{spec}: the snapshot is not in the Hugging Face cache and cannot be fetched "
            f"({type(exc).__name__})",
            field="tokenizer",
            fix="download it once where the hub is reachable (huggingface-cli download "
            f"{repo} --revision {revision}), point HF_HOME/HF_HUB_CACHE at that cache, or name the model "
            "folder instead",
        ) from None
    path = Path(folder)
    commit = path.name if _COMMIT.match(path.name) else revision
    return path, commit


def _special_id(tokenizer: dict[str, Any], token: str) -> int | None:
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return int(added["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
        return int(vocab[token])
    return None


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> dict[str, Any]:
    """transformers' ``update_post_processor``: ``[BOS] $A [EOS]`` (and ``$B`` likewise for pairs)."""

    def seq(name: str, type_id: int) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if bos is not None:
            parts.append({"SpecialToken": {"id": bos[0], "type_id": type_id}})
        parts.append({"Sequence": {"id": name, "type_id": type_id}})
        if eos is not None:
            parts.append({"SpecialToken": {"id": eos[0], "type_id": type_id}})
        return parts

    specials = {
        pair[0]: {"id": pair[0], "ids": [pair[1]], "tokens": [pair[0]]} for pair in (bos, eos) if pair
    }
    return {
        "type": "TemplateProcessing",
        "single": seq("A", 0),
        "pair": seq("A", 0) + seq("B", 1),
        "special_tokens": specials,
    }


def _adds(processor: object, token: str | None) -> bool:
    """Whether ``processor`` (a tokenizer.json post_processor) already adds ``token``."""
    return token is not None and isinstance(processor, dict) and f'"{token}"' in json.dumps(processor)


def _tokenizer_with_specials(
    folder: Path, config: dict[str, Any], add_bos: bool | None, add_eos: bool | None
) -> tuple[Path, bool]:
    """The tokenizer file to load, and whether it is a copy with BOS/EOS added per the config."""
    original = folder / _TOKENIZER
    if not original.is_file():
        raise TokenizerLoadError(
            "the model has no tokenizer.json (a slow, sentencepiece-only tokenizer cannot be checked "
            "token for token)",
            file=str(original),
            field="tokenizer",
            fix="convert it once with transformers (AutoTokenizer.from_pretrained(...).save_pretrained(...)) "
            "and name that folder",
        )
    if not add_bos and not add_eos:
        return original, False
    data = json.loads(original.read_text(encoding="utf-8"))
    processor = data.get("post_processor")
    wanted: dict[str, tuple[str, int] | None] = {"bos": None, "eos": None}
    missing = False
    for kind, flag in (("bos", add_bos), ("eos", add_eos)):
        token = _token(config.get(f"{kind}_token"))
        if not flag:
            continue
        token_id = None if token is None else _special_id(data, token)
        if token is None or token_id is None:
            raise TokenizerLoadError(
                f"tokenizer_config.json sets add_{kind}_token but its {kind}_token "
                f"{token!r} is not in the tokenizer",
                file=str(folder / _CONFIG),
                field="tokenizer",
                fix=f"set {kind}_token to the model's {kind.upper()} string, or add_{kind}_token to false",
            )
        wanted[kind] = (token, token_id)
        missing = missing or not _adds(processor, token)
    if not missing:
        return original, False
    patched = copy.deepcopy(data)
    patched["post_processor"] = _post_processor(wanted["bos"], wanted["eos"])
    text = json.dumps(patched, ensure_ascii=False, sort_keys=True)
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()
    target = cache_dir() / "tokenizers" / f"model-{key}.json"
    if not target.is_file():
        atomic_write(target, text.encode("utf-8"))
    return target, True


def resolve_model_files(spec: str, *, base_dir: Path | None = None) -> ModelFiles:
    """The snapshot a ``tokenizer`` / ``chat_template`` value names (see the module docstring)."""
    if spec.startswith(HF_PREFIX):
        folder, revision = _hub_snapshot(spec)
    else:
        folder, revision = resolve_relative(spec, base_dir), None
        if not folder.is_dir():
            raise InputError(
                "model folder not found",
                file=str(folder),
                field="tokenizer",
                fix="name a folder holding tokenizer.json and tokenizer_config.json, or hf:ORG/NAME@REV",
            )
    config_path = folder / _CONFIG
    config = _read_config(config_path) if config_path.is_file() else {}
    add_bos = _flag(config, "add_bos_token", config_path)
    add_eos = _flag(config, "add_eos_token", config_path)
    tokenizer_file, patched = _tokenizer_with_specials(folder, config, add_bos, add_eos)
    digests = {name: sha256_file(folder / name) for name in _FILES if (folder / name).is_file()}
    return ModelFiles(
        reference=spec,
        folder=folder,
        revision=revision,
        tokenizer_file=tokenizer_file,
        add_bos=add_bos,
        add_eos=add_eos,
        bos_token=_token(config.get("bos_token")),
        eos_token=_token(config.get("eos_token")),
        post_processor_patched=patched,
        digests=digests,
    )


def load_template(spec: str, *, base_dir: Path | None = None) -> ChatTemplate:
    """The chat template a ``chat_template`` value names: a ``.jinja`` / ``tokenizer_config.json`` /
    ``chat_template.json`` file, or a model folder / ``hf:`` reference (its ``chat_template.jinja``, else
    its ``tokenizer_config.json``), relative to ``base_dir``."""
    if is_model_reference(spec, base_dir=base_dir):
        files = resolve_model_files(spec, base_dir=base_dir)
        source = files.template_file
        if source is None:
            raise TemplateError(
                "the model has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json; base models often have none)",
                file=str(files.folder),
                field="chat_template",
                fix="leave chat_template out for a raw completion frame, or name a .jinja file",
            )
        return load_chat_template(source)
    return load_chat_template(resolve_relative(spec, base_dir))

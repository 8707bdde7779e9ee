"""A tokenizer file the Rust core cannot load, named for a user (issue #37, item 6): the tokenizers
library reports an unknown ``model.type`` as "data did not match any variant of untagged enum
ModelUntagged", a Rust enum name that tells a user nothing; the message names the section and the type
the file holds instead."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from depthgate.exceptions import InputError

__all__ = ["named_load_error"]

#: The sections of a tokenizer.json the tokenizers library reads as an "untagged enum" of known types: its
#: error names the Rust enum (``ModelUntagged``), which tells a user nothing.
_UNTAGGED_SECTIONS = {
    "ModelUntagged": ("model", "BPE, WordPiece, WordLevel or Unigram"),
    "NormalizerUntagged": ("normalizer", "one of the library's normalizers"),
    "PreTokenizerUntagged": ("pre_tokenizer", "one of the library's pre-tokenizers"),
    "PostProcessorUntagged": ("post_processor", "one of the library's post-processors"),
    "DecoderUntagged": ("decoder", "one of the library's decoders"),
}


def _section_type(path: Path, section: str) -> object:
    """``section.type`` of the tokenizer JSON at ``path`` (None when it cannot be read)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        value = json.loads(raw).get(section)
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return value.get("type") if isinstance(value, dict) else value


def named_load_error(path: Path, exc: InputError) -> InputError:
    """``exc`` with the library's enum name replaced by the section and type a user wrote."""
    for enum, (section, known) in _UNTAGGED_SECTIONS.items():
        if f"untagged enum {enum}" in exc.message:
            found = _section_type(path, section)
            shown = f"{section}.type {found!r}" if isinstance(found, str) else f"its {section}"
            return type(exc)(
                f"cannot load tokenizer: {shown} is not a {section} the tokenizers library can read "
                f"(it reads {known})",
                file=str(path),
                field=f"{section}.type",
                fix="pass the model's own tokenizer.json (saved by tokenizers >= 0.20 or transformers), "
                f"or fix its {section} section",
            )
    return exc

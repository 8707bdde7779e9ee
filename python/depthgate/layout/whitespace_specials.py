"""Added tokens that are only whitespace but flagged ``special`` (a Gemma-3 ``tokenizer.json`` marks
``"\\n"`` and ``"\\n\\n"`` so; issue #37): read as ordinary text tokens.

The layout engine refuses any text that contains a special-token string, because a control token
(``<|im_start|>``) inside case text would be parsed as one by the server. A whitespace token is no such
thing: the server encodes every newline of the prompt as that very token, special flag or not, and the
filler and evidence are full of newlines, so the refusal turned every build of such a tokenizer into
exit 20. The tokenizer is loaded from a copy in the cache (keyed by the file's sha256) with those tokens'
``special`` flag off and ``normalized`` off, so they are matched on the raw text exactly as before: the
same ids for every text, only no longer treated as control tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from depthgate.spec.files import atomic_write, cache_dir

__all__ = ["whitespace_specials_as_text"]

_VERSION = "1"


def _whitespace_specials(data: Any) -> list[dict[str, Any]]:
    added = data.get("added_tokens") if isinstance(data, dict) else None
    if not isinstance(added, list):
        return []
    return [
        t
        for t in added
        if isinstance(t, dict)
        and t.get("special") is True
        and isinstance(t.get("content"), str)
        and t["content"]
        and not t["content"].strip()
    ]


def whitespace_specials_as_text(path: Path) -> Path:
    """``path``, or the cached copy of it whose whitespace-only special tokens are ordinary tokens
    (same ids). A file that is not readable JSON is returned as it is: loading it says what is wrong."""
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError):
        return path
    tokens = _whitespace_specials(data)
    if not tokens:
        return path
    for token in tokens:
        token["special"] = False
        token["normalized"] = False
    digest = hashlib.sha256(raw).hexdigest()
    target = cache_dir() / "tokenizers" / f"{digest}.whitespace-text-v{_VERSION}.json"
    if not target.is_file():
        atomic_write(target, json.dumps(data, ensure_ascii=False).encode("utf-8"))
    return target

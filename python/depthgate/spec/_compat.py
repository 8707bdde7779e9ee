"""The TOML reader shared by the spec modules: the standard library's, or tomli on Python 3.10."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

__all__ = ["tomllib"]

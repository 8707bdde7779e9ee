"""Type stub for the Rust extension ``depthgate._core`` (rust/depthgate-py). Private: use
``depthgate.layout.layouts`` instead."""

from typing import Any, final

import numpy as np

__all__ = [
    "ASSEMBLER_VERSION",
    "Tokenizer",
    "build_layout_columns",
    "presend_check_batch",
    "verify_layouts",
]

ASSEMBLER_VERSION: str

@final
class Tokenizer:
    @staticmethod
    def from_file(path: str) -> Tokenizer: ...
    @property
    def digest(self) -> str: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def fast_unsound_reason(self) -> str | None: ...
    def encode(self, text: str, add_special_tokens: bool) -> np.ndarray[Any, np.dtype[np.uint32]]: ...

def build_layout_columns(
    tokenizer: Tokenizer, spec_json: str
) -> tuple[np.ndarray[Any, np.dtype[np.uint32]], np.ndarray[Any, np.dtype[np.uint64]], list[str], str]: ...
def verify_layouts(
    tokenizer: Tokenizer,
    layouts_json: str,
    ids_flat: np.ndarray[Any, np.dtype[np.uint32]],
    row_offsets: np.ndarray[Any, np.dtype[np.uint64]],
) -> str: ...
def presend_check_batch(
    texts: list[str],
    ids_flat: np.ndarray[Any, np.dtype[np.uint32]],
    id_offsets: np.ndarray[Any, np.dtype[np.uint64]],
    target_tokens: np.ndarray[Any, np.dtype[np.int64]],
    template_digests: list[str],
    pinned_dates: list[str | None],
    span_offsets: np.ndarray[Any, np.dtype[np.uint64]],
    span_ids: list[str],
    span_kinds: list[str],
    span_tokens: tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]],
    span_chars: tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]],
    span_sha256: list[str],
    contract_json: str,
) -> list[list[tuple[str, str]]]: ...

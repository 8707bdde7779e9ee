"""The one atomic write (:func:`depthgate.spec.files.atomic_write`): bytes, text or a writer function;
whole or not at all, nothing left beside the target on a failure."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from depthgate.spec.files import atomic_write


@pytest.mark.parametrize("fsync", [False, True])
def test_bytes_text_and_a_writer_land_whole(tmp_path: Path, fsync: bool) -> None:
    target = tmp_path / "new" / "file.json"
    assert atomic_write(target, b"\x00bytes", fsync=fsync) == target
    assert target.read_bytes() == b"\x00bytes"
    atomic_write(target, "text é\r\n", fsync=fsync)
    assert target.read_bytes() == "text é\r\n".encode()  # UTF-8, newlines as given
    atomic_write(target, lambda tmp: tmp.write_bytes(b"written"), fsync=fsync)
    assert target.read_bytes() == b"written"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.json"]


def test_a_failing_writer_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "file.txt"
    target.write_text("old", encoding="utf-8")

    def dies(tmp: Path) -> None:
        tmp.write_text("half", encoding="utf-8")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, dies)
    assert target.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]

"""Writing a report set atomically: every file of the new set, or the old set, never a mix.

:func:`write_report_set` writes the rendered files into a staging folder beside ``out_dir`` (same parent,
so the same file system), fsyncs them, then swaps the staging folder with ``out_dir`` in one
``renameat2(RENAME_EXCHANGE)`` (Linux ≥ 3.15 on ext4, xfs, btrfs, tmpfs, overlayfs). A crash before the
swap leaves the old set in ``out_dir`` (and a hidden staging folder beside it, named with the writer's
pid, which the next writer removes once that process is gone); after the swap the new set is complete.
Where the exchange is not available (another OS or file system), the swap is two renames (old aside,
new in): a crash between them leaves ``out_dir`` missing and the old set in the hidden ``.<name>.old-*``
folder beside it, never a mixed set.

A folder that holds anything but report files (``--report-dir .``) is never swapped whole: there every
file is moved in with ``os.replace`` and ``verdict.json`` (removed first, moved last) is the commit
marker, so a verdict on disk always comes with its complete set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from depthgate.spec.files import atomic_write

__all__ = ["write_report_set"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` atomically; False when the OS or file system cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
        return False
    raise OSError(errno, os.strerror(errno), str(a), None, str(b))


def _swap_in(staging: Path, out: Path) -> None:
    """Put ``staging`` at ``out``; the old ``out`` ends in ``staging``'s place (then removed)."""
    if _exchange(staging, out):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    aside.rmdir()
    os.rename(out, aside)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(aside, out)
        raise
    os.rename(aside, staging)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _sweep_stale(out: Path) -> None:
    """Remove ``.<name>.new-<pid>-*`` staging folders of writers that were killed before their swap (a
    staging folder without a pid in its name predates this rule and is stale too). A live writer's is
    kept: two gates of one folder at once each keep their own."""
    prefix = f".{out.name}.new-"
    for entry in out.parent.iterdir():
        if not (entry.name.startswith(prefix) and entry.is_dir()):
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _only_reports(out: Path, names: Mapping[str, bytes]) -> bool:
    return all(entry.name in names for entry in out.iterdir())


def _move_each(files: Mapping[str, bytes], out: Path, commit: str) -> None:
    """The fallback for a folder holding other files: per-file moves, ``commit`` removed first and
    moved last."""
    staging = Path(tempfile.mkdtemp(prefix=".depthgate-report-", dir=out))
    try:
        for name, data in files.items():
            atomic_write(staging / name, data, fsync=True)
        (out / commit).unlink(missing_ok=True)
        for name in files:
            if name != commit:
                os.replace(staging / name, out / name)
        os.replace(staging / commit, out / commit)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_report_set(files: Mapping[str, bytes], out_dir: str | Path, *, commit: str) -> Path:
    """Write ``files`` (name → bytes) as the whole content of ``out_dir``, atomically as a set.

    ``out_dir`` is created when missing. When it holds only report files (any of ``files``' names) it is
    swapped whole with a staging folder beside it; otherwise every file is moved in and ``commit`` (the
    verdict) is moved last. On an error before the swap ``out_dir`` keeps its previous content and no
    staging folder remains."""
    out = Path(out_dir)
    if out.is_symlink():  # swap the folder it points to, never the link itself
        out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not _only_reports(out, files):
        _move_each(files, out, commit)
        return out
    _sweep_stale(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-{os.getpid()}-", dir=out.parent))
    try:
        for name, data in files.items():
            atomic_write(staging / name, data, fsync=True)
        descriptor = os.open(staging, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.chmod(staging, out.stat().st_mode & 0o7777)
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out

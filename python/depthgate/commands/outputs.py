"""Where commands write, and the command-line values they read: checked before any work starts,
written atomically, nothing half-written.

* :func:`check_output` refuses an output path before a command does anything expensive: a folder where a
  file is expected (``schema --out DIR``), an existing file where a folder is expected, a path under a
  file, a folder that cannot be written. Every refusal is an :class:`InputError` (exit 20) naming the
  path, the option and the fix.
* :func:`write_output_text` writes the file an option names through :func:`depthgate.spec.files.atomic_write`
  (a temp file in the same folder, renamed into place); on any error the temp file is removed, the
  target is unchanged and the error names the option.
* :func:`undo_on_error` removes what a command created (new folders, new entries of an existing folder)
  when it fails, so a refused input leaves no empty folder and no partial output behind.
* :func:`read_text_arg` reads a text file named by an option (``--preamble-file``) as UTF-8.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from depthgate.exceptions import InputError
from depthgate.spec.files import ReadFailures, atomic_write, read_utf8

__all__ = [
    "CreatedPaths",
    "OutputKind",
    "check_output",
    "first_missing",
    "read_text_arg",
    "undo_on_error",
    "write_output_text",
]

#: ``file``: a file to (over)write; ``dir``: a folder to create or write into; ``empty_dir``: a new or
#: empty folder; ``run_dir``: a new or empty folder, or the folder of an earlier run (has manifest.json).
OutputKind = Literal["file", "dir", "empty_dir", "run_dir"]


def first_missing(path: Path) -> Path | None:
    """The topmost ancestor of ``path`` (or ``path`` itself) that does not exist yet, or None."""
    missing = None
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            break
        missing = candidate
    return missing


def _existing_ancestor(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(".")


def _cannot_write(
    exc: OSError, path: Path, option: str, *, folder: Path | None = None, wanted: str = "a path"
) -> InputError:
    """The refusal for an OSError met while writing ``path`` (given by ``option``), optionally ``folder``."""
    where = "" if folder is None else f" in {folder}"
    return InputError(
        f"cannot write{where} ({exc.strerror or exc})",
        file=str(path),
        field=option,
        fix=f"give {option} {wanted} in a folder you can write to",
    )


def _probe_writable(folder: Path, path: Path, option: str) -> None:
    """Create and remove a temp file in ``folder``: permission bits say nothing for root, and read-only or
    virtual file systems only answer an actual write."""
    try:
        fd, name = tempfile.mkstemp(prefix=".depthgate-probe-", dir=folder)
    except OSError as exc:
        raise _cannot_write(exc, path, option, folder=folder) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


def _utf8_or_none(path: str) -> str | None:
    """None when ``path`` is UTF-8 text; else the path with its undecodable bytes shown as ``\\xNN``."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    return None


def check_output(path: str | os.PathLike[str], kind: OutputKind, *, option: str = "--out") -> Path:
    """Refuse an output path before any work is done (see the module docstring); returns it as a Path."""
    target = Path(path)
    shown = _utf8_or_none(str(target))
    if shown is not None:
        # Every output names its files in UTF-8 (manifest.json, reports; polars takes only str paths):
        # a name that is not UTF-8 failed deep inside the first write, with a traceback.
        raise InputError(
            "the path is not valid UTF-8 (bytes that decode to no character)",
            file=shown,
            field=option,
            fix=f"give {option} a path in UTF-8 (rename the bytes shown as \\xNN)",
        )
    if kind == "file" and target.is_dir():
        raise InputError(
            "is a folder, but a file is expected",
            file=str(target),
            field=option,
            fix=f"give {option} a file path, e.g. {target / 'out.json'}",
        )
    if kind == "file" and os.path.lexists(target) and not (target.is_file() or target.is_dir()):
        # A device, pipe or socket (`--json /dev/full`): the atomic rename would replace the node itself
        # with a regular file (as root, even /dev/null).
        raise InputError(
            "is not a regular file (a device, pipe or socket); it would be replaced by the output",
            file=str(target),
            field=option,
            fix=f"give {option} a path to a regular file, e.g. out.json",
        )
    if kind != "file" and os.path.lexists(target) and not target.is_dir():
        raise InputError(
            "is an existing file, but a folder is expected",
            file=str(target),
            field=option,
            fix=f"give {option} a new folder (or an existing one), not a file",
        )
    anchor = _existing_ancestor(target.parent if kind == "file" else target)
    if not anchor.is_dir():
        raise InputError(
            f"{anchor} is a file, so nothing can be created under it",
            file=str(target),
            field=option,
            fix=f"give {option} a path whose parent folders are folders",
        )
    if kind == "empty_dir" and target.is_dir() and any(target.iterdir()):
        raise InputError(
            "the folder is not empty",
            file=str(target),
            field=option,
            fix=f"give {option} a new or empty folder",
        )
    if (
        kind == "run_dir"
        and target.is_dir()
        and not (target / "manifest.json").is_file()
        and any(target.iterdir())
    ):
        raise InputError(
            "the folder is not empty and holds no run (no manifest.json)",
            file=str(target),
            field=option,
            fix=f"give {option} a new or empty folder, or the folder of an earlier run to resume it",
        )
    _probe_writable(anchor, target, option)
    return target


def write_output_text(path: str | os.PathLike[str], text: str, *, option: str = "--out") -> Path:
    """Write ``text`` (UTF-8) to the file ``option`` names, atomically (:func:`atomic_write`). Creates
    missing parent folders (removed again on failure). An OSError becomes an InputError naming the path
    and the option; the target is unchanged and no temp file is left."""
    target = check_output(path, "file", option=option)
    with undo_on_error(target.parent):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _cannot_write(exc, target, option) from None
        try:
            atomic_write(target, text)
        except OSError as exc:
            raise _cannot_write(exc, target, option, wanted="a file path") from None
    return target


class CreatedPaths:
    """What exists at ``folder`` now, so that :meth:`undo` can remove what was created after: the folder
    itself and its new parents when it did not exist, otherwise the entries that were not in it. Entries
    that existed are never touched (a file replaced atomically in between stays replaced)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.created = first_missing(self.folder)
        self.before: set[str] = set()
        if self.created is None and self.folder.is_dir():
            self.before = set(os.listdir(self.folder))

    def undo(self) -> None:
        if self.created is not None:
            _remove(self.created)
        elif self.folder.is_dir():
            for name in set(os.listdir(self.folder)) - self.before:
                _remove(self.folder / name)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def undo_on_error(folder: str | os.PathLike[str]) -> Iterator[None]:
    """On any exception inside the block, remove what the block created at ``folder``
    (:class:`CreatedPaths`), then re-raise."""
    created = CreatedPaths(folder)
    try:
        yield
    except BaseException:
        created.undo()
        raise


def read_text_arg(path: str | os.PathLike[str], *, option: str) -> str:
    """The UTF-8 text of a file named by a command-line option; every failure names the file and option."""
    failures = ReadFailures(
        InputError,
        missing=("file not found", f"give {option} an existing text file"),
        unreadable=("cannot read ({strerror})", f"give {option} a readable text file (not a folder)"),
        not_utf8=("not UTF-8 text ({reason} at byte {start})", "save the file as UTF-8"),
        field=option,
    )
    return read_utf8(Path(path), failures)

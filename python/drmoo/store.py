"""The run store: every byte drmoo writes or reads in a run directory, an output directory or a data cache.

Run directories and caches may be shared with other users or damaged by a crash, a full disk or a
careless edit, so everything that touches them goes through this module, which promises:

* **No symbolic link is followed at a file or at the directory that holds it.**  Every read and
  write first opens the file's directory with ``O_DIRECTORY|O_NOFOLLOW`` and then the file
  relative to that descriptor (``openat``) with ``O_NOFOLLOW``; a link at either name is refused
  with one line, never followed.  So a link planted at a run directory's name inside a comparison
  (``CMP/mgda-seed0 -> VICTIM``) or at a side file's name (``metrics.csv -> ~/.ssh/id_ed25519``)
  redirects nothing.  The directories above the file's directory are the caller's: they are the
  path the user typed (``--out``, ``--runs``, ``DRMOO_CACHE``).  Directories are created refusing
  a link at their name too (:func:`make_directory`).
* **Atomic writes.**  A file is written into an exclusive temporary file of unpredictable name in the
  target's directory (``O_CREAT|O_EXCL|O_NOFOLLOW``: a planted file or symlink at that name is never
  opened), fsynced, renamed over the target (``renameat`` in the same directory descriptor) and the
  directory fsynced.  A reader sees the old file or the new one, never a mix; a failed write removes
  its temporary file and keeps the old file.  The rename replaces a symlink at the target's name by
  a regular file; it never writes through it.  A regular file replaced keeps its permission bits,
  and a read-only one (``chmod 444``: no write bit for anyone) is refused, never replaced.  The lock
  file is opened ``O_NOFOLLOW`` and must be a regular file with one link, so a planted link to another
  file is refused, never truncated.
* **Check, then write.**  :func:`check_writable` refuses, writing nothing, a file that could not later
  be replaced (a read-only file, a directory at its name, a directory without write permission), so
  that a command can check every file it will write before changing any; :func:`write_files` writes
  several files or none: each is written and fsynced into its temporary (where a full disk refuses)
  before the first is renamed over its target.
* **Stale temporary files are removed** when a run directory is locked: only regular files named
  like this module's own temporaries (``.NAME.<pid>.<16 hex digits>.drmoo-tmp``) whose writing
  process no longer exists (a SIGKILL or power loss mid-write).  Nothing else is touched.
* **Bounded reads.**  JSON, CSV and text side files are read only when they are regular files below
  a size cap, and JSON is parsed with a nesting-depth limit and finite numbers only.  CSV files are
  streamed (:func:`iter_csv`): one row at a time, each row at most ``MAX_CSV_ROW_BYTES``, so a reader
  keeps only what it needs.  A checkpoint is checked in this order before anything is unpickled: a
  regular file, the magic line, a header of at most ``MAX_HEADER_BYTES``, the file size equal to
  the header's announced payload size, that size at most the caller's bound (what the run can
  legitimately hold, computed from its model and data, never from a file; :data:`MAX_PAYLOAD_BYTES` when the
  caller knows nothing better), a ``torch.save`` archive signature; only then is the payload
  streamed once into one buffer of exactly that size while it is hashed, its SHA-256 compared
  with the header's, and the buffer unpickled in place with ``weights_only=True``.
* **One-line errors.**  A full disk, a file-size limit, a read-only or forbidden place raise
  :class:`UsageError` naming the file and the cause; the old file stays as it was.

The dependency direction is kernels -> optim -> (data, store) -> experiments -> cli: this module
imports nothing else of drmoo.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

__all__ = [
    "CHECKPOINT_MAGIC", "MAX_CSV_ROW_BYTES", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH", "MAX_PAYLOAD_BYTES",
    "MAX_SIDE_FILE_BYTES",
    "CheckpointError", "CheckpointFile", "ResultNotSaved", "RunLockedError", "SymlinkRefused", "UsageError",
    "atomic_write", "available_memory", "check_writable", "clean_stale_temporaries", "iter_csv", "json_bytes",
    "make_directory", "nesting_depth",
    "open_mapped_file", "parse_json",
    "read_bytes", "read_checkpoint_file", "read_checkpoint_header", "read_csv", "read_head", "read_json", "read_text",
    "regular_file_size", "remove_file", "run_lock", "save_result", "write_bytes", "write_checkpoint_file", "write_csv",
    "write_figure", "write_files", "write_json", "write_text",
]

CHECKPOINT_MAGIC = b"DRMOO-CHECKPOINT 1\n"  # then one line of JSON header, then the torch.save payload
MAX_HEADER_BYTES = 1 << 20
MAX_SIDE_FILE_BYTES = 256 << 20  # JSON / CSV / markdown side files: a 100-epoch steps.csv is ~10 MB
MAX_JSON_DEPTH = 64
MAX_CSV_ROW_BYTES = 1 << 16  # one line of a CSV side file: a steps.csv row of 64 tasks is ~3 KB
# The payload bound of a checkpoint whose reader knows nothing of the run (a library caller, a cache
# without a recipe): 4 GiB, ten times a ResNet18 run's.  drmoo's own readers pass what the run can
# legitimately hold (drmoo.experiments.checkpoints.payload_budget), far less for small models.
MAX_PAYLOAD_BYTES = 4 << 30
LOCK_FILE = "train.lock"
TEMP_SUFFIX = ".drmoo-tmp"
_CHUNK = 1 << 20
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
# This module's temporaries, exactly: .NAME.<pid>.<16 hex>.drmoo-tmp (see _create_temporary).  No other
# name is ever removed by the sweep: a user's .draft.99999.tmp is theirs.
_TEMPORARY = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{16}\.drmoo-tmp$")
# OS errors a user can fix (space, quota, file-size limit, permissions, read-only file system).
_CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EFBIG: "file too large (a file-size limit, e.g. ulimit -f)", errno.EROFS: "read-only file system",
           errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
           errno.ENOENT: "no such file or directory", errno.ENOTDIR: "a parent is not a directory",
           errno.EISDIR: "it is a directory", errno.ELOOP: "it is a symbolic link", errno.EEXIST: "it exists"}


class UsageError(ValueError):
    """A setting or a file the user handed in is refused; the message is one line naming the problem.

    The command line prints it without a traceback and exits with status 2.
    """


class CheckpointError(UsageError):
    """A checkpoint that is corrupt, truncated, crafted or from another run: refused, never unpickled freely."""


class RunLockedError(UsageError):
    """Another process is training in the run directory."""


class ResultNotSaved(UsageError):
    """A result was computed but its file could not be written; ``result`` carries it (to print it anyway)."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result


def _cause(error: OSError) -> str:
    return _CAUSES.get(error.errno or -1) or error.strerror or str(error)


def _write_error(path: Path, error: OSError) -> UsageError:
    return UsageError(f"cannot write {path}: {_cause(error)}; the previous {path.name}, if any, is unchanged")


# ---------------------------------------------------------------------------------------------- writing


def make_directory(directory: str | Path, what: str = "output directory") -> Path:
    """Create ``directory`` (and its parents) or refuse with one line: empty, a file in the way, no permission."""
    if str(directory) == "":
        raise UsageError(f"the {what} is an empty path (an unset shell variable?)")
    path = Path(directory)
    if path.is_symlink():  # the store never follows a link at a file's directory: refuse it here already
        raise UsageError(f"the {what} {path} is a symbolic link: drmoo does not follow links at a directory it "
                         "writes in; give the directory itself")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file, not a directory: pick another {what}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a parent that is a file, a read-only or forbidden place
        raise UsageError(f"cannot create the {what} {path}: {_cause(error)}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write in the {what} {path}: permission denied")
    return path


class SymlinkRefused(UsageError):
    """A symbolic link at a file's name or at the name of the directory that holds it: never followed."""


def _open_directory(directory: Path) -> int:
    """A descriptor of ``directory`` (the one a file is in), refusing a symbolic link at its name.

    ``O_NOFOLLOW`` with ``O_DIRECTORY`` fails with ELOOP (or ENOTDIR) on a link; the directories above
    it are the caller's path and resolved as usual.  OSError otherwise (missing, forbidden).
    """
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            raise SymlinkRefused(f"{directory} is a symbolic link: drmoo never follows a link at a run, result or "
                                 "cache directory (someone may have planted it); refused") from None
        raise


@contextmanager
def _directory_of(path: Path) -> Iterator[int]:
    """The no-follow descriptor of ``path``'s directory, for ``*at`` calls on ``path.name``; closed after."""
    descriptor = _open_directory(path.parent)
    try:
        yield descriptor
    finally:
        os.close(descriptor)


def _symlink_error(path: Path, what: str) -> SymlinkRefused:
    return SymlinkRefused(f"the {what} {path} is a symbolic link: drmoo never follows a link at a file it reads or "
                          "writes (someone may have planted it); refused")


def _create_temporary(directory: int, name: str, path: Path) -> tuple[int, str]:
    """An exclusive new file beside ``name`` in the open ``directory``: unpredictable name, never an existing file."""
    for _ in range(100):
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(tmp, flags, 0o644, dir_fd=directory), tmp
        except FileExistsError:
            continue  # 64 random bits taken: someone planted that very name; draw another
    raise UsageError(f"cannot create a temporary file beside {path}: every name drawn exists")


def _replaceable_mode(directory: int, path: Path) -> int | None:
    """The permission bits of the regular file at ``path`` (None when there is none), which its
    replacement keeps; a read-only one (no write bit for anyone, as ``chmod 444`` leaves it) is refused,
    and so is a directory at its name (IsADirectoryError, which the rename would raise after the write).

    rename(2) ignores the target's mode: without this check a file someone made read-only to keep it
    would be replaced, and a replaced file would get the temporary's 0644.  Read from the mode bits,
    not ``access(2)``: root may write anything, but a read-only file still says "keep me".
    """
    try:
        info = os.stat(path.name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(info.st_mode):  # refused now, before anything is written, rather than by the rename
        raise IsADirectoryError(errno.EISDIR, "it is a directory")
    if not stat.S_ISREG(info.st_mode):
        return None  # a link or other entry: replaced by a regular file, never written through (see above)
    mode = stat.S_IMODE(info.st_mode)
    if not mode & 0o222:
        raise UsageError(f"{path} is read-only (mode {mode:o}): drmoo does not replace a file made read-only; make it "
                         "writable (chmod u+w) to let drmoo replace it, or write elsewhere")
    return mode & 0o777  # the permission bits; never set-id bits onto a file drmoo wrote


@dataclass
class _Prepared:
    """A file written and fsynced into its temporary beside ``path``, not yet renamed over it."""

    path: Path
    directory: int  # the no-follow descriptor of path's directory, held until commit or discard
    temporary: str


def _prepare(path: Path, chunks: Iterable[bytes | memoryview]) -> _Prepared:
    """``chunks`` in a fsynced temporary beside ``path``, the target checked replaceable; nothing else changed.

    A refusal (read-only target, a directory at its name, full disk, ...) raises UsageError having
    removed the temporary."""
    try:
        directory = _open_directory(path.parent)
    except OSError as error:
        raise _write_error(path, error) from None
    try:
        try:
            mode = _replaceable_mode(directory, path)
            descriptor, temporary = _create_temporary(directory, path.name, path)
        except OSError as error:
            raise _write_error(path, error) from None
        try:
            if mode is not None:
                os.fchmod(descriptor, mode)
            with os.fdopen(descriptor, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException as error:
            with suppress(OSError):
                os.unlink(temporary, dir_fd=directory)
            if isinstance(error, OSError):
                raise _write_error(path, error) from None
            raise
    except BaseException:
        os.close(directory)
        raise
    return _Prepared(path, directory, temporary)


def _discard(prepared: _Prepared) -> None:
    with suppress(OSError):
        os.unlink(prepared.temporary, dir_fd=prepared.directory)
    os.close(prepared.directory)


def _commit(prepared: _Prepared) -> None:
    """Rename the prepared temporary over its target and make the rename durable; closes the directory."""
    path, directory = prepared.path, prepared.directory
    try:
        try:
            os.replace(prepared.temporary, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except OSError as error:
            with suppress(OSError):
                os.unlink(prepared.temporary, dir_fd=directory)
            raise _write_error(path, error) from None
        try:
            os.fsync(directory)  # makes the rename itself durable
        except OSError as error:  # the file is in place; only the rename's durability is unconfirmed
            raise _write_error(path, error) from None
    finally:
        os.close(directory)


def atomic_write(path: str | Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``path`` all or nothing (see the module's promises); a user-fixable OS error is one line."""
    _commit(_prepare(Path(path), chunks))


def write_files(contents: Mapping[Path, bytes]) -> None:
    """Write several files, none of them unless every one can be: each is written and fsynced into its
    temporary (the step a full disk, a read-only file or a directory in the way refuses) before the
    first is renamed over its target.  A refusal removes every temporary and changes no file."""
    prepared: list[_Prepared] = []
    try:
        for path, data in contents.items():
            prepared.append(_prepare(Path(path), [data]))
    except BaseException:
        for item in prepared:
            _discard(item)
        raise
    for index, item in enumerate(prepared):
        try:
            _commit(item)
        except BaseException:
            for rest in prepared[index + 1:]:
                _discard(rest)
            raise


def check_writable(paths: Iterable[str | Path]) -> None:
    """Refuse (UsageError naming the file) when one of ``paths`` could not later be replaced or removed:
    its directory missing, a link or not writable, a directory at its name, or a regular file made
    read-only (see :func:`atomic_write`).  Nothing is written: a command calls this for every file it
    will write before it changes any, so that a refusal leaves the directory as it was.  What cannot
    be known in advance (the disk filling meanwhile) still refuses the write itself, keeping the old file.
    """
    for path in map(Path, paths):
        try:
            with _directory_of(path) as directory:
                if not os.access(path.parent, os.W_OK | os.X_OK):
                    raise PermissionError(errno.EACCES, "permission denied")
                _replaceable_mode(directory, path)
        except OSError as error:
            raise _write_error(path, error) from None


def write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, [data])


def write_text(path: str | Path, text: str) -> None:
    atomic_write(path, [text.encode()])


def _finite_or_none(value: Any) -> Any:
    """``value`` with every NaN / infinity replaced by None (JSON has no token for them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def json_bytes(value: Any) -> bytes:
    """``value`` as :func:`write_json` writes it (strict JSON, a non-finite number as null), for :func:`write_files`."""
    return json.dumps(_finite_or_none(value), indent=2, allow_nan=False, default=str).encode() + b"\n"


def write_json(path: str | Path, value: Any) -> None:
    """Strict JSON, written atomically: a non-finite number becomes null, never the ``NaN`` token."""
    atomic_write(path, [json_bytes(value)])


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]], fieldnames: Sequence[str] | None = None) -> None:
    """``rows`` as CSV (columns: ``fieldnames`` or the first row's keys; others ignored), atomically.

    Nothing is written for no rows and no ``fieldnames``.
    """
    if not rows and fieldnames is None:
        return
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(fieldnames if fieldnames is not None else rows[0]),
                            extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, [text.getvalue().encode()])


def write_figure(figure: Any, path: str | Path, **savefig: Any) -> None:
    """A matplotlib figure as PNG, atomically (``savefig`` options such as ``dpi`` pass through)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", **savefig)
    atomic_write(path, [buffer.getvalue()])


def remove_file(path: str | Path) -> None:
    """Remove ``path`` (a marker or a stale result) if it is there; a symlink is removed, never followed."""
    path = Path(path)
    try:
        with _directory_of(path) as directory:
            os.unlink(path.name, dir_fd=directory)
    except FileNotFoundError:
        return  # the file, or its directory, is not there: nothing to remove
    except OSError as error:
        raise UsageError(f"cannot remove {path}: {_cause(error)}") from None


def save_result(path: str | Path, result: Any) -> None:
    """:func:`write_json` a computed result; a refused write raises :class:`ResultNotSaved` carrying ``result``."""
    try:
        write_json(path, result)
    except UsageError as error:
        raise ResultNotSaved(f"{error} (the result above was computed but not saved)", result) from None


def open_mapped_file(path: str | Path, size: int, clear: bool = False) -> tuple[BinaryIO, bool]:
    """A cache file of exactly ``size`` bytes to memory-map, opened read-write; (file, whether it starts empty).

    Created exclusively (``O_EXCL|O_NOFOLLOW``, sparse), or an existing regular file with one link
    opened ``O_NOFOLLOW``; one of another size, or any when ``clear``, is cleared to ``size`` zero
    bytes.  A symlink, device or hard link planted at ``path`` is refused, never written through.
    """
    path = Path(path)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with _directory_of(path) as directory:
            try:
                descriptor, empty = os.open(path.name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=directory), True
            except FileExistsError:
                descriptor, empty = os.open(path.name, flags | os.O_NONBLOCK, dir_fd=directory), False
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UsageError(f"the cache file {path} is a symbolic link: refused (remove it)") from None
        raise _write_error(path, error) from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise UsageError(f"the cache file {path} is not a regular file of its own (a device, FIFO or hard link): "
                             "refused")
        if not empty and (clear or info.st_size != size):
            os.ftruncate(descriptor, 0)  # another layout: start over rather than read it as this one
            empty = True
        os.ftruncate(descriptor, size)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "r+b"), empty
    except OSError as error:
        os.close(descriptor)
        raise _write_error(path, error) from None
    except BaseException:
        os.close(descriptor)
        raise


# ---------------------------------------------------------------------------------------------- reading


def _open_regular(path: Path, what: str) -> tuple[int, os.stat_result]:
    """A read descriptor of ``path`` when it is a regular file (not a device, FIFO, directory or link).

    Opened relative to its directory's no-follow descriptor with ``O_NOFOLLOW``: a symbolic link at
    the file's name or at its directory's name is refused, its target never read.
    """
    try:
        with _directory_of(path) as directory:
            # O_NONBLOCK: opening a FIFO must not hang; it is refused just below
            descriptor = os.open(path.name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 dir_fd=directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _symlink_error(path, what) from None
        raise UsageError(f"cannot read the {what} {path}: {_cause(error)}") from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise UsageError(f"the {what} {path} is not a regular file (a device, FIFO or directory): refused")
    return descriptor, info


def _chunks(descriptor: int, size: int) -> Iterator[bytes]:
    """Up to ``size`` bytes from the descriptor's position, in pieces of at most ``_CHUNK`` (fewer at EOF)."""
    left = size
    while left > 0:
        part = os.read(descriptor, min(left, _CHUNK))
        if not part:
            return
        yield part
        left -= len(part)


def _read_exactly(descriptor: int, size: int) -> bytes:
    """Up to ``size`` bytes; only for reads already bounded by a cap (side files, headers)."""
    return b"".join(_chunks(descriptor, size))


def regular_file_size(path: str | Path, what: str = "file") -> int:
    """The size of the regular file ``path`` (opened as every read is: no link followed), without reading it."""
    path = Path(path)
    descriptor, info = _open_regular(path, what)
    os.close(descriptor)
    return info.st_size


def read_bytes(path: str | Path, max_bytes: int = MAX_SIDE_FILE_BYTES, what: str = "file") -> bytes:
    """The content of the regular file ``path``, refused (one line) when larger than ``max_bytes``."""
    path = Path(path)
    descriptor, info = _open_regular(path, what)
    try:
        if info.st_size > max_bytes:
            raise UsageError(f"the {what} {path} holds {info.st_size} bytes, more than the {max_bytes} it may: refused")
        data = _read_exactly(descriptor, max_bytes + 1)  # a file growing meanwhile is caught here
    finally:
        os.close(descriptor)
    if len(data) > max_bytes:
        raise UsageError(f"the {what} {path} holds more than the {max_bytes} bytes it may: refused")
    return data


def read_head(path: str | Path, size: int, what: str = "file") -> bytes:
    """The first ``size`` bytes of the regular file ``path`` (fewer when it is shorter); never reads more."""
    path = Path(path)
    descriptor, _ = _open_regular(path, what)
    try:
        return _read_exactly(descriptor, size)
    finally:
        os.close(descriptor)


def read_text(path: str | Path, max_bytes: int = MAX_SIDE_FILE_BYTES, what: str = "file",
              encoding: str = "utf-8") -> str:
    path = Path(path)
    try:
        return read_bytes(path, max_bytes, what).decode(encoding)
    except UnicodeDecodeError as error:
        raise UsageError(f"the {what} {path} is not {encoding} text ({error.reason} at byte {error.start})") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"the non-standard number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} overflows a float")
    return value


def nesting_depth(value: Any) -> int:
    """Nesting depth of parsed JSON or TOML (dicts and lists), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class _RepeatedKey(ValueError):
    """A JSON object that holds a key twice (see :func:`parse_json`'s ``unique_keys``)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a key given twice (``json`` would keep the last silently)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return value


def parse_json(data: str | bytes, source: str | Path, *, unique_keys: bool = False) -> Any:
    """Strict JSON (finite numbers, at most ``MAX_JSON_DEPTH`` levels); UsageError naming ``source`` otherwise.

    ``unique_keys``: an object holding a key twice is refused too (for settings, where the silently
    kept last value would not be the one the reader sees first).
    """
    try:
        value = json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float,
                           object_pairs_hook=_unique_keys if unique_keys else None)
    except RecursionError:
        raise UsageError(f"{source}: refused: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except _RepeatedKey as error:
        key = str(error)
        raise UsageError(f"{source}: refused: the key {key[:80]!r} is given twice in one object (JSON would keep "
                         "the last silently); give it once") from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise UsageError(f"{source}: refused: not valid JSON ({str(error)[:200]})") from None
    if nesting_depth(value) > MAX_JSON_DEPTH:
        raise UsageError(f"{source}: refused: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json(path: str | Path, max_bytes: int = MAX_SIDE_FILE_BYTES, what: str = "JSON file") -> Any:
    """A bounded, strict JSON side file (see :func:`parse_json`)."""
    path = Path(path)
    return parse_json(read_bytes(path, max_bytes, what), path)


def _lines(descriptor: int, path: Path, what: str, max_bytes: int, max_row_bytes: int) -> Iterator[str]:
    """The text lines of an open file, each at most ``max_row_bytes``, at most ``max_bytes`` in all."""
    total = 0
    with os.fdopen(os.dup(descriptor), "rb", buffering=_CHUNK) as handle:
        for number in range(1, 1 << 62):
            line = handle.readline(max_row_bytes + 1)
            if not line:
                return
            total += len(line)
            if total > max_bytes:
                raise UsageError(f"the {what} {path} holds more than the {max_bytes} bytes it may: refused")
            if len(line) > max_row_bytes and not line.endswith(b"\n"):  # no end within the cap
                raise UsageError(f"{path}: refused: line {number} is longer than the {max_row_bytes} bytes a row of "
                                 f"a {what} may hold")
            try:
                yield line.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise UsageError(f"the {what} {path} is not utf-8 text ({error.reason} on line {number})") from None


def iter_csv(path: str | Path, max_bytes: int = MAX_SIDE_FILE_BYTES, what: str = "CSV file",
             max_row_bytes: int = MAX_CSV_ROW_BYTES) -> Iterator[dict[str, str]]:
    """The rows of a CSV file as dicts of strings, streamed: the caller keeps what it needs, nothing more.

    The file is opened as every read is (a regular file, no link followed) and refused (one line)
    when larger than ``max_bytes``, when one line is longer than ``max_row_bytes`` or when a row has
    more or fewer cells than the header.  Memory is one row at a time whatever the file's size.
    """
    path = Path(path)
    descriptor, info = _open_regular(path, what)
    try:
        if info.st_size > max_bytes:
            raise UsageError(f"the {what} {path} holds {info.st_size} bytes, more than the {max_bytes} it may: refused")
        reader = csv.DictReader(_lines(descriptor, path, what, max_bytes, max_row_bytes))
        try:
            for line, row in enumerate(reader, start=2):
                if None in row or None in row.values():
                    columns = len(reader.fieldnames or [])
                    raise UsageError(f"{path}: refused: row {line} does not have the header's {columns} cells")
                yield row
        except csv.Error as error:
            raise UsageError(f"{path}: refused: not valid CSV ({error})") from None
    finally:
        os.close(descriptor)


def read_csv(path: str | Path, max_bytes: int = MAX_SIDE_FILE_BYTES, what: str = "CSV file") -> list[dict[str, str]]:
    """A bounded CSV file as a list of rows of strings (:func:`iter_csv` kept whole: for small files)."""
    return list(iter_csv(path, max_bytes, what))


def available_memory() -> int | None:
    """Bytes of memory this process could still get (``MemAvailable``, else physical memory); None when unknown.

    What a caller compares a size it is about to allocate with, to refuse it with one line first.
    """
    try:
        for line in read_text(Path("/proc/meminfo"), 1 << 20, "memory description").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------- checkpoints


@dataclass
class CheckpointFile:
    """A verified checkpoint: its header, its unpickled state and the payload's SHA-256."""

    header: dict[str, Any]
    state: dict[str, Any]
    sha256: str


def write_checkpoint_file(path: str | Path, state: Mapping[str, Any], header: dict[str, Any]) -> str:
    """``state`` (``torch.save``) behind a header (``header`` + the payload's size and SHA-256); returns the hash.

    The format: :data:`CHECKPOINT_MAGIC`, one line of JSON (``format``, ``payload_bytes``,
    ``payload_sha256`` and ``header``'s fields, e.g. the run's ``config``), then the payload.
    """
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    digest = hashlib.sha256(payload).hexdigest()
    text = json.dumps({**header, "format": 1, "payload_bytes": len(payload), "payload_sha256": digest},
                      sort_keys=True, allow_nan=False)
    if len(text) >= MAX_HEADER_BYTES:
        raise ValueError(f"a checkpoint header of {len(text)} bytes is over the {MAX_HEADER_BYTES} readers accept")
    atomic_write(path, [CHECKPOINT_MAGIC, text.encode(), b"\n", payload])
    return digest


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a buffer: torch.load reads the payload in place, no copy of it."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        count = max(0, min(len(target), len(self._view) - self._position))
        target[:count] = self._view[self._position : self._position + count]
        self._position += count
        return count

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position


def _read_hashed(descriptor: int, offset: int, size: int) -> tuple[bytearray, str]:
    """``size`` bytes from ``offset`` into one buffer of exactly that size, hashed as they stream in.

    No list of chunks and no join: the memory is the bounded buffer, allocated once.  Fewer bytes
    (the file shrank meanwhile) give a shorter buffer, which the caller's hash check refuses.
    """
    buffer = bytearray(size)
    view = memoryview(buffer)
    digest = hashlib.sha256()
    filled = 0
    while filled < size:
        count = os.preadv(descriptor, [view[filled : filled + _CHUNK]], offset + filled)
        if count == 0:
            break
        digest.update(view[filled : filled + count])
        filled += count
    view.release()
    del buffer[filled:]
    return buffer, digest.hexdigest()


def _read_header(descriptor: int, info: os.stat_result, path: Path, what: str) -> tuple[dict[str, Any], int]:
    """The checked header of an open checkpoint and its payload's offset; the size check included."""
    head = _read_exactly(descriptor, min(info.st_size, len(CHECKPOINT_MAGIC) + MAX_HEADER_BYTES + 1))
    if not head.startswith(CHECKPOINT_MAGIC):
        raise CheckpointError(f"{path}: refused: not a drmoo {what} (no drmoo header: corrupt, or written by "
                              "something else or an older drmoo)")
    start = len(CHECKPOINT_MAGIC)
    end = head.find(b"\n", start)
    if end < 0:
        raise CheckpointError(f"{path}: refused: its header is corrupt or truncated (no end within "
                              f"{MAX_HEADER_BYTES} bytes)")
    try:
        header = parse_json(head[start:end], path)
    except UsageError:
        raise CheckpointError(f"{path}: refused: its header is corrupt or truncated") from None
    size, digest = (header.get("payload_bytes"), header.get("payload_sha256")) if isinstance(header, dict) else (
        None, None)
    if (isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_PAYLOAD_BYTES
            or not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise CheckpointError(f"{path}: refused: its header is corrupt or truncated")
    offset = end + 1
    if info.st_size - offset != size:
        raise CheckpointError(f"{path}: refused: truncated or extended: holds {info.st_size - offset} payload "
                              f"bytes, its header announces {size}")
    return header, offset


def _open_checkpoint(path: Path, what: str) -> tuple[int, os.stat_result]:
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return _open_regular(path, what)
    except UsageError as error:
        raise CheckpointError(f"{error}") from None


def read_checkpoint_header(path: str | Path, what: str = "checkpoint") -> dict[str, Any]:
    """The header of a checkpoint (its size checked, its payload not read): cheap, for provenance checks."""
    path = Path(path)
    descriptor, info = _open_checkpoint(path, what)
    try:
        return _read_header(descriptor, info, path, what)[0]
    finally:
        os.close(descriptor)


def read_checkpoint_file(path: str | Path, what: str = "checkpoint",
                         max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> CheckpointFile:
    """Read and verify a file of :func:`write_checkpoint_file`'s format; :class:`CheckpointError` otherwise.

    ``max_payload_bytes`` is what the reader expects at most: the header, which anyone can write
    with a matching hash, cannot raise it.  Memory stays bounded by the header cap until the file's
    size matches the announced payload, that size is within ``max_payload_bytes`` and the payload
    starts like a ``torch.save`` archive; then the payload is streamed once into a buffer of that
    size while it is hashed, and unpickled from that buffer (no second copy) only if the hash matches.
    """
    import torch

    path = Path(path)
    descriptor, info = _open_checkpoint(path, what)
    try:
        header, offset = _read_header(descriptor, info, path, what)
        size, digest = header["payload_bytes"], header["payload_sha256"]
        if size > max_payload_bytes:
            raise CheckpointError(f"{path}: refused: its payload of {size} bytes is more than the {max_payload_bytes} "
                                  f"a {what} of this run can hold (crafted, or written for another run)")
        if os.pread(descriptor, len(_ZIP_MAGIC), offset) != _ZIP_MAGIC:
            raise CheckpointError(f"{path}: refused: its payload is not a torch.save archive (corrupt)")
        payload, streamed = _read_hashed(descriptor, offset, size)
    finally:
        os.close(descriptor)
    if streamed != digest or len(payload) != size:
        raise CheckpointError(f"{path}: refused: the payload's SHA-256 differs from the one recorded in its "
                              "header (the file is corrupt)")
    try:
        state = torch.load(cast(BinaryIO, _MemoryFile(memoryview(payload))), map_location="cpu", weights_only=True)
    except Exception as error:  # untrusted bytes: any failure to parse them refuses the file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: refused: its payload holds more than tensors and plain containers "
                              f"or is malformed ({reason[:200]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: refused: its payload does not match its header")
    return CheckpointFile(header, state, digest)


# ---------------------------------------------------------------------------------------------- lock


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or an absurd pid): leave its file alone
    return True


def _clean_stale_temporaries_at(directory: int) -> list[str]:
    removed = []
    with suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            match = _TEMPORARY.match(entry.name)
            if match is None or int(match.group(1)) == os.getpid() or _process_exists(int(match.group(1))):
                continue
            if entry.is_file(follow_symlinks=False):
                with suppress(OSError):
                    os.unlink(entry.name, dir_fd=directory)
                    removed.append(entry.name)
    return removed


def clean_stale_temporaries(directory: str | Path) -> list[str]:
    """Remove this module's temporary files in ``directory`` whose writer process is gone; returns their names.

    Only regular files named exactly like the store's own temporaries
    (``.NAME.<pid>.<16 hex>.drmoo-tmp``) are touched; ``directory`` must not be a symbolic link.
    """
    descriptor = _open_directory(Path(directory))
    try:
        return _clean_stale_temporaries_at(descriptor)
    finally:
        os.close(descriptor)


# How often run_lock opens the lock file again when its holder removed it between the open and the flock:
# each retry needs another trainer to have taken and released the lock in that instant.
_LOCK_ATTEMPTS = 100


@contextmanager
def run_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold ``run_dir/train.lock`` (an exclusive ``flock``) or refuse at once: one trainer per directory.

    The lock file must be a regular file with a single link (opened ``O_NOFOLLOW``): a planted
    symlink or hard link to another file is refused before anything is written to it.  The lock goes
    with the process (closing the descriptor, or dying, releases it), so a crashed run never leaves
    the directory locked.  Once locked, stale temporary files of crashed writers are removed.

    The holder removes the file when it leaves (a finished or stopped run keeps no ``train.lock``),
    still holding the lock as it unlinks.  A starter that opened the file just before may then lock
    the removed file: it checks, once locked, that the name still leads to the file it locked, and
    otherwise opens the name again; so two trainers never hold two files of the same name.  Only the
    holder removes the file, and only the file it locked.  A crashed holder leaves the file (unlocked).
    """
    run_dir = Path(run_dir)
    try:
        directory = _open_directory(run_dir)
    except OSError as error:
        raise UsageError(f"cannot write in the run directory {run_dir}: {_cause(error)}") from None
    try:
        for _attempt in range(_LOCK_ATTEMPTS):
            descriptor = _locked_file(run_dir, directory)
            if descriptor is not None:
                break
        else:
            raise RunLockedError(f"{run_dir / LOCK_FILE} was removed and created again {_LOCK_ATTEMPTS} times "
                                 "while this trainer tried to lock it: other drmoo processes are starting runs in "
                                 f"{run_dir}; pick another --out")
        try:
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
            _clean_stale_temporaries_at(directory)
            yield
        finally:
            _remove_lock_file(directory, descriptor)  # still locked: no other trainer is between these two lines
            os.close(descriptor)
    finally:
        os.close(directory)


def _same_file(first: os.stat_result, second: os.stat_result) -> bool:
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _remove_lock_file(directory: int, descriptor: int) -> None:
    """Unlink ``train.lock`` if the name still leads to the file ``descriptor`` holds locked (it does, unless
    someone replaced it by hand): called by the holder, before it releases the lock."""
    with suppress(OSError):
        if _same_file(os.stat(LOCK_FILE, dir_fd=directory, follow_symlinks=False), os.fstat(descriptor)):
            os.unlink(LOCK_FILE, dir_fd=directory)


def _locked_file(run_dir: Path, directory: int) -> int | None:
    """A descriptor of ``train.lock`` in ``directory``, exclusively locked; None when the file locked is no longer
    the one at that name (its holder removed it after this process opened it): open it again then.

    Raises:
        UsageError: the lock file is a link or not a regular file of its own, or the directory is not writable.
        RunLockedError: another process holds the lock.
    """
    path = run_dir / LOCK_FILE
    try:
        descriptor = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                             dir_fd=directory)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UsageError(f"{path} is a symbolic link, not drmoo's lock file: refused (remove it if you "
                             "did not plant it)") from None
        raise UsageError(f"cannot write in the run directory {run_dir}: {_cause(error)}") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise UsageError(f"{path} is not a regular file of its own (a device, FIFO or a hard link to another "
                             "file): refused")
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "?"
            if holder.isdigit() and not _process_exists(int(holder)):
                # The lock belongs to an open file, not a pid: a child that inherited the descriptor
                # (a forked data-loader worker) holds it after the drmoo process that wrote the pid died.
                raise RunLockedError(
                    f"{run_dir} is locked ({path}), but pid {holder}, the drmoo process that took the lock, no "
                    f"longer exists: a leftover child of it still holds the file open (`fuser {path}` names "
                    "it); stop that process, or pick another --out"
                ) from None
            raise RunLockedError(
                f"{run_dir} is in use by another drmoo process (pid {holder}, holding {path}); wait for it to "
                "finish or pick another --out"
            ) from None
        try:
            current = os.stat(LOCK_FILE, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        if current is None or not _same_file(current, info):  # removed (and perhaps created anew) meanwhile
            os.close(descriptor)
            return None
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor

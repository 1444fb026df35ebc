"""File-system helpers for every file the project writes: atomic publishing (checkpoints, datasets, logs,
figures, exports), durable renames, and telling a dead writer's temporary files from a live one's.

Every temporary file or directory is named `.NAME.tmp-PID-RANDOM` beside what it becomes (`temp_name`, or
`tempfile.mkdtemp(prefix=temp_prefix(path))` for a directory): `remove_stale_temps` removes those whose
writer process is gone, never a live one's.

Links planted in an output directory are never followed. An output directory may be shared, copied or
unpacked from someone else's archive, so any name in it may be a symbolic link to a file elsewhere (or a
hard link to one). Every write therefore goes through one of:
- `replacing` / `writing` / `write_text`: a new file under a temporary name, renamed over the name: a link
  there is replaced by the new file, its target untouched. The temporary name has a random part, so nobody
  can plant a link at it beforehand; `open_new` creates it with O_EXCL|O_NOFOLLOW in any case.
- `appending` (logs): O_APPEND|O_NOFOLLOW; a symbolic link at the name is replaced by a new empty file,
  and a file with other hard links by a copy of itself, so what the other names show never grows.
- `own_dir`: a directory the project fills with files it names itself (TensorBoard's): a symbolic link
  there is replaced by a new directory.
On any failure the temporary file is removed (the name keeps its old file)."""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (its temporary files must stay)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except OverflowError:  # larger than any pid
        return False
    return True


TEMP = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)(-\w+)?")


def temp_name(path: Path) -> Path:
    """`.NAME.tmp-PID-RANDOM` beside `path`: what a writer fills before renaming it over `path`. A new name
    at each call, that nobody can guess (and plant a link at) before it exists."""
    path = Path(path)
    return path.with_name(temp_prefix(path) + secrets.token_hex(6))


def temp_prefix(path: Path) -> str:
    """`.NAME.tmp-PID-`: the prefix of a unique temporary directory for `path` (tempfile.mkdtemp's prefix)."""
    return f".{Path(path).name}.tmp-{os.getpid()}-"


def remove_stale_temps(directory: Path, name: str | None = None) -> list[Path]:
    """Remove the temporary files, links and directories in `directory` (only those for `name`, if given)
    whose writing process no longer runs; those of live processes are never touched. Returns what was removed."""
    removed = []
    if not Path(directory).is_dir():  # (nothing there yet: nothing to remove)
        return removed
    for f in Path(directory).iterdir():
        match = TEMP.fullmatch(f.name)
        if not match or (name is not None and match["name"] != name):
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or process_alive(pid):
            continue
        if f.is_symlink() or f.is_file():  # a checkpoint, or a link being switched (gpt/checkpoints/dcp.py)
            f.unlink(missing_ok=True)  # missing: another process cleaned it first
        elif f.is_dir():  # a sharded checkpoint or a dataset being written
            shutil.rmtree(f, ignore_errors=True)
        removed.append(f)
    return removed


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a new temporary path beside `path` (nothing there yet) to write; when the block ends without an
    error it is renamed over `path` (atomic on POSIX: readers see the old file or the new one, never half of
    one; a link at `path` is replaced, not followed), else removed, whatever the error (a full disk, Ctrl-C)."""
    tmp = temp_name(Path(path))
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        _remove(tmp)  # (nothing left there after the rename)


_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def open_new(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None):
    """A file object for a file that does not exist yet (never an existing one, never through a link), with
    the usual permissions (0666 less the umask)."""
    fd = os.open(path, _NEW, 0o666)
    try:
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def writing(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None, sync: bool = False):
    """A file object to write `path` through: a new temporary file renamed over `path` when the block ends
    without an error (see `replacing`); with `sync`, flushed to the disk before the rename."""
    with replacing(path) as tmp:
        with open_new(tmp, mode, encoding) as f:
            yield f
            if sync:
                f.flush()
                os.fsync(f.fileno())


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """`Path.write_text`, atomic and never through a link at `path`."""
    with writing(path, "w", encoding) as f:
        f.write(text)


def appending(path: str | os.PathLike, encoding: str = "utf-8", buffering: int = 1):
    """`open(path, "a")` for a log, never through a link: a symbolic link at `path` is replaced by a new empty
    file and a file with other hard links by a copy of itself (the other names keep what they show). Anything
    else that is not a regular file there (a directory, a FIFO) is an OSError."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(3):  # (another process racing to plant links again gets an error, not our data)
        try:  # O_NONBLOCK: a FIFO without a reader fails at once instead of waiting for one
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            os.unlink(path)  # a symbolic link: replaced, its target untouched
            continue
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            os.set_blocking(fd, True)
            return os.fdopen(fd, "a", buffering=buffering, encoding=encoding)
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file", str(path))
        with replacing(path) as tmp:  # hard-linked: this name gets a copy of its own
            shutil.copyfile(path, tmp)
    raise OSError(errno.ELOOP, "it keeps being replaced by a link", str(path))


def own_dir(path: str | os.PathLike) -> Path:
    """`path` as a directory (made if missing) to create new files in: a symbolic link there is replaced by a
    new directory, its target untouched. Anything else there that is not a directory is an OSError."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)  # (FileExistsError for a file there)
    return path


def _remove(path: Path) -> None:
    """Remove a temporary file, link or directory, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or a directory's entries (a rename into it), to the disk."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

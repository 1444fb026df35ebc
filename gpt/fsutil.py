"""File-system helpers for atomic publishing (checkpoints, datasets): durable renames, and telling a
dead writer's temporary files from a live one's.

Every temporary file or directory is named `.NAME.tmp-PID` (or `.NAME.tmp-PID-XXXX` for a directory made
with `tempfile.mkdtemp(prefix=temp_prefix(path))`) beside what it becomes: `remove_stale_temps` removes
those whose writer process is gone, never a live one's."""

from __future__ import annotations

import os
import re
import shutil
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
    """`.NAME.tmp-PID` beside `path`: what a writer fills before renaming it over `path`."""
    return path.with_name(temp_prefix(path).rstrip("-"))


def temp_prefix(path: Path) -> str:
    """`.NAME.tmp-PID-`: the prefix of a unique temporary directory for `path` (tempfile.mkdtemp's prefix)."""
    return f".{Path(path).name}.tmp-{os.getpid()}-"


def remove_stale_temps(directory: Path, name: str | None = None) -> list[Path]:
    """Remove the temporary files, links and directories in `directory` (only those for `name`, if given)
    whose writing process no longer runs; those of live processes are never touched. Returns what was removed."""
    removed = []
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
    """Yields a temporary path beside `path` to write; when the block ends without an error it is renamed
    over `path` (atomic on POSIX: readers see the old file or the new one, never half of one), else removed."""
    tmp = temp_name(Path(path))
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # (nothing left there after the rename)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or a directory's entries (a rename into it), to the disk."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

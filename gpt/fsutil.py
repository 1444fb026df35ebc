"""File-system helpers for atomic publishing (checkpoints, datasets): durable renames, and telling a
dead writer's temporary files from a live one's."""

from __future__ import annotations

import os
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


def temp_name(path: Path) -> Path:
    """`.NAME.tmp-PID` beside `path`: what a writer fills before renaming it over `path` (the PID tells a dead
    writer's leftovers from a live one's: gpt/checkpoints/native.py `remove_stale_temps`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


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

"""File-system helpers for atomic publishing (checkpoints, datasets): durable renames, and telling a
dead writer's temporary files from a live one's."""

from __future__ import annotations

import os
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


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or a directory's entries (a rename into it), to the disk."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

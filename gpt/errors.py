"""User-facing errors: one base class, shown one way.

Every mistake a user can make (a bad flag, a missing file, a vocabulary mismatch, a full disk) raises a
subclass of `UserError` whose message names the problem and the fix. `gpt.cli.run_main`, which every
entry point uses, prints it as one `error: ...` line and exits 2. Any other exception is a bug and
keeps its traceback.

Each module keeps its own subclass (ConfigError, DataError, CheckpointError, ...) so callers can tell
them apart; they also derive from ValueError or RuntimeError as they always did.
"""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """A mistake or a condition the user can fix; the message says how."""


class StorageError(UserError, OSError):
    """Reading or writing a file failed in a way the user can fix (full disk, permissions, a path that is
    a file)."""


class ConfigError(UserError, ValueError):
    """Bad configuration (a model's or a run's): the message lists every problem, one per line."""


def storage_error(e: OSError, action: str, path: str | os.PathLike, nothing_lost: str = "") -> StorageError:
    """An OSError while `action`ing `path`, as one line with the likely fix."""
    reason = {
        errno.ENOSPC: "the disk is full; free some space",
        errno.EDQUOT: "the disk quota is exceeded; free some space",
        errno.EACCES: "permission denied; choose a writable location",
        errno.EPERM: "permission denied; choose a writable location",
        errno.EROFS: "the file system is read-only; choose a writable location",
        errno.ENOTDIR: "a part of the path is a file, not a directory",
        errno.EISDIR: "it is a directory",
        errno.ENOENT: "no such file or directory",
    }.get(e.errno, e.strerror or str(e))
    return StorageError(f"could not {action} {path}: {reason}" + (f"; {nothing_lost}" if nothing_lost else ""))

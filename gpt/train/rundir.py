"""A run directory (`--out-dir`): checked before anything is written, and held for the run's lifetime.

    with RunDir(path).claim(resume=False, force=False):
        ...  # train: config.json, log.jsonl, last.pt, best.pt

- Usable: a path that is a file, lies under a file or cannot be written is one line naming it.
- One trainer at a time: a lock file (`.lock`, flock'ed, with the holder's pid and host) is held until
  the run ends; a second trainer into the same directory is refused, naming the first. The kernel
  drops the lock when its process dies, so a killed run never leaves the directory locked. The file
  itself stays (the flock is the lock: removing the file would let two trainers lock two files of one
  name), and is never opened through a symbolic link, nor truncated when it is a hard link to another file
  (a run directory unpacked from someone's archive may hold `.lock` linked to its own `best.pt`).
- Every file in it (config.json, log.jsonl, checkpoints, run.png, tensorboard/) is written through
  gpt/fsutil.py: a link planted at any of those names is replaced, never followed.
- Never overwritten by accident: a directory holding a run (a checkpoint, a log, or a sharded checkpoint
  `step-NNNNNN/` that no link points to) is refused for a new run without `--force`; with `--force` that
  run's files are removed first, so two runs never mix.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
from contextlib import contextmanager
from pathlib import Path

from gpt.checkpoints.native import is_sharded
from gpt.checkpoints.outputs import LOCK_FILE, RUN_FILES
from gpt.errors import UserError, storage_error
from gpt.fsutil import remove_stale_temps, write_text

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows): no lock, the other checks still apply
    fcntl = None


class RunDirError(UserError, ValueError):
    """An out dir that cannot take this run (in use, holds another run)."""


class RunDir:
    def __init__(self, path: str | os.PathLike, master: bool = True):
        self.path = Path(path)
        self.master = master  # under torchrun only rank 0 writes
        self._lock = None

    def holds_checkpoint(self) -> bool:
        return self._resumable() or bool(self.unlinked())

    def _resumable(self) -> bool:
        return any((self.path / name).exists() for name in ("last.pt", "best.pt", "last.dcp"))

    def unlinked(self) -> list[str]:
        """Sharded checkpoints (`step-NNNNNN/`) no link points to (a save killed before its link switch, or one
        kept by hand): a new run's first save would delete them (gpt/checkpoints/dcp.py)."""
        links = [os.path.join(self.path, name) for name in ("last.dcp", "best.dcp")]
        linked = {os.readlink(p) for p in links if os.path.islink(p)}
        steps = self.path.glob("step-*")
        return sorted(d.name for d in steps if d.name not in linked and not d.is_symlink() and is_sharded(d))

    def holds_run(self) -> bool:
        """A checkpoint, or a log with something in it: a run that stopped before its first step (a bad
        --init-from, a block too short for the data) leaves an empty log, and the directory is free again."""
        log = self.path / "log.jsonl"
        return self.holds_checkpoint() or (log.exists() and log.stat().st_size > 0)

    @contextmanager
    def claim(self, resume: bool, force: bool):
        """Check, create and lock the directory; on leaving, release the lock."""
        if not self.master:
            yield self
            return
        self._make()
        self._acquire()
        try:
            remove_stale_temps(self.path)  # what killed writers left (a checkpoint, the plot's PNG)
            if not resume and self.holds_run():
                unlinked = [] if force or self._resumable() else self.unlinked()
                if unlinked:
                    raise RunDirError(
                        f"--out-dir {self.path} holds the checkpoint {unlinked[0]}/, which no last.dcp points "
                        f"to; move it elsewhere, or pass --force to start over there (it is removed)"
                    )
                if not force:
                    raise RunDirError(
                        f"--out-dir {self.path} already holds a run; continue it with `--resume {self.path}`, "
                        f"or pass --force to start over there (its checkpoints and log are removed)"
                        if self.holds_checkpoint()
                        else f"--out-dir {self.path} holds the log of a run that saved no checkpoint (nothing to "
                        f"resume); pass --force to start over there (the log is removed), or choose another --out-dir"
                    )
                for name in RUN_FILES:
                    (self.path / name).unlink(missing_ok=True)
                for sharded in self.path.glob("step-*"):  # the directories the .dcp links pointed to
                    shutil.rmtree(sharded, ignore_errors=True)
            yield self
        finally:
            self._release()

    def write_config(self, config: dict) -> None:
        if self.master:
            try:
                write_text(self.path / "config.json", json.dumps(config, indent=2))
            except OSError as e:
                raise storage_error(e, "write", self.path / "config.json") from None

    def _make(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"--out-dir {self.path} is a file, not a directory; choose another --out-dir")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise RunDirError(f"--out-dir {self.path}: a part of the path is a file, not a directory") from None
        except OSError as e:
            raise storage_error(e, "create --out-dir", self.path) from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise RunDirError(f"--out-dir {self.path} is not writable; choose a writable location")

    def _acquire(self) -> None:
        path = self.path / LOCK_FILE
        try:  # never through a symbolic link, never truncated before it is ours: the file may be someone else's
            fd = os.open(
                path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644
            )
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirError(
                    f"--out-dir {self.path}: {path} is a symbolic link, not a lock file; remove it "
                    f"(a trainer never writes through it)"
                ) from None
            raise storage_error(e, "write the lock file", path) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:  # a hard link: truncating it changes the other names
            os.close(fd)
            raise RunDirError(
                f"--out-dir {self.path}: {path} is "
                + ("a hard link to another file" if stat.S_ISREG(info.st_mode) else "not a regular file")
                + "; remove it"
            )
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise RunDirError(
                    f"--out-dir {self.path} is in use by another trainer ({holder}); wait for it "
                    f"to finish or choose another --out-dir"
                ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())  # (at offset 0: just opened)
        self._lock = fd

    def _release(self) -> None:
        """Drop the flock and leave `.lock` in place: unlinking it would let a trainer that opened it before
        the unlink and one that creates a new `.lock` after it both hold "the" lock."""
        if self._lock is not None:
            os.ftruncate(self._lock, 0)  # (it names no holder once released)
            os.close(self._lock)  # closing drops the flock
            self._lock = None

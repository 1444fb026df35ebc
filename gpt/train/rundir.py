"""A run directory (`--out-dir`): checked before anything is written, and held for the run's lifetime.

    with RunDir(path).claim(resume=False, force=False):
        ...  # train: config.json, log.jsonl, last.pt, best.pt

- Usable: a path that is a file, lies under a file or cannot be written is one line naming it.
- One trainer at a time: a lock file (`.lock`, flock'ed, with the holder's pid and host) is held until
  the run ends; a second trainer into the same directory is refused, naming the first. The kernel
  drops the lock when its process dies, so a killed run never leaves the directory locked.
- Never overwritten by accident: a directory holding a run (a checkpoint or a log) is refused for a
  new run without `--force`; with `--force` that run's files are removed first, so two runs never mix.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

from gpt.errors import UserError, storage_error

RUN_FILES = ("last.pt", "best.pt", "log.jsonl", "config.json", "last.dcp", "best.dcp")  # .dcp: links (gpt/checkpoints/dcp.py)

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

    def holds_run(self) -> bool:
        return any((self.path / name).exists() for name in ("last.pt", "best.pt", "log.jsonl", "last.dcp"))

    @contextmanager
    def claim(self, resume: bool, force: bool):
        """Check, create and lock the directory; on leaving, release the lock."""
        if not self.master:
            yield self
            return
        self._make()
        self._acquire()
        try:
            if not resume and self.holds_run():
                if not force:
                    raise RunDirError(
                        f"--out-dir {self.path} already holds a run; continue it with `--resume {self.path}`, "
                        f"or pass --force to start over there (its checkpoints and log are removed)")
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
                (self.path / "config.json").write_text(json.dumps(config, indent=2))
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
        path = self.path / ".lock"
        try:
            f = open(path, "a+")
        except OSError as e:
            raise storage_error(e, "write the lock file", path) from None
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise RunDirError(f"--out-dir {self.path} is in use by another trainer ({holder}); wait for it "
                                  f"to finish or choose another --out-dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._lock = f

    def _release(self) -> None:
        if self._lock is not None:
            (self.path / ".lock").unlink(missing_ok=True)
            self._lock.close()  # closing drops the flock
            self._lock = None

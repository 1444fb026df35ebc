"""Writing a dataset: into a fresh hidden directory beside --out, moved into place when complete, within a byte
budget (no torch).

    from gpt.data.staging import OutputBudget, staged
    with staged("data/mine", force=False) as tmp:           # a hidden directory beside data/mine
        ...                                                 # write tmp/train.bin, tmp/val.bin, ...
        write_meta(tmp, meta)                               # ... and meta.json last (gpt.data.format)
    # on leaving: moved into data/mine, meta.json last; after any error: the temporary directory is gone

Footguns
- Publishing replaces only the dataset's own files (format.DATASET_FILES): a recipe's directory keeps its
  prepare.py, and a directory that is not a dataset is never replaced wholesale.
- A dataset's files are bounded on disk (`OutputBudget`, `--max-output-bytes`): by default a small multiple of
  the inputs' own size, so a few hundred bytes of Parquet or gzip that decode to GBs stop early.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gpt.data.format import DATASET_FILES, META_FILE, DataError
from gpt.errors import StorageError, UserError, storage_error
from gpt.fsutil import fsync_path, remove_stale_temps, temp_prefix

OUTPUT_RATIO = 32  # --max-output-bytes by default: this many times the inputs' bytes on disk,
OUTPUT_FLOOR = 16 << 20  # and at least this many bytes


@contextmanager
def staged(out: str | os.PathLike, force: bool = False, log: Callable[[str], None] | None = None) -> Iterator[Path]:
    """A fresh hidden directory beside `out` to write a dataset into, moved into place on leaving.

    On entry: an `out` that holds a dataset (without `force`), is a file, lies under a file or cannot be
    written is refused, the temporary directories of killed prepares of `out` are removed, and `out`'s
    missing parents are made. The body writes every file, meta.json last (`write_meta`). On leaving,
    the files are synced and moved into `out`, meta.json last, so `out` never looks complete before it
    is. After any error the temporary directory and the parents made are removed, `out` is as it was,
    and an OSError (a full disk, a read-only place) becomes one StorageError line.
    """
    out = Path(out)
    _check_out(out, force)
    _remove_stale_tmp(out, log or (lambda message: print(message, file=sys.stderr)))
    had_dataset = (out / META_FILE).is_file()
    made, tmp, touched = [], None, False
    try:
        made = _mkdirs(out.parent)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the dataset gets the usual permissions
        yield tmp
        for file in tmp.iterdir():
            fsync_path(file)
        if not out.exists():
            os.rename(tmp, out)  # atomic: `out` appears complete or not at all
            fsync_path(out.parent)
            return
        # `out` is a directory without a dataset (a recipe's directory) or one being replaced (--force).
        (out / META_FILE).unlink(missing_ok=True)  # from here on the old dataset no longer looks complete
        touched = True
        fsync_path(out)
        new = {p.name for p in tmp.iterdir()}
        for name in DATASET_FILES:
            if name != META_FILE:
                if name in new:
                    os.replace(tmp / name, out / name)
                else:
                    (out / name).unlink(missing_ok=True)  # e.g. the old BPE ranks when replaced by char
        fsync_path(out)
        os.replace(tmp / META_FILE, out / META_FILE)
        fsync_path(out)
        tmp.rmdir()
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in made:  # parents this call created, innermost first
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, OSError) and not isinstance(e, UserError):
            left = (
                f"{out} no longer holds a complete dataset"
                if touched
                else f"the dataset in {out} was left as it was"
                if had_dataset
                else "nothing was written"
            )
            raise storage_error(e, "write", out, left) from None
        raise


class OutputBudget:
    """The bytes a dataset's files may take (`--max-output-bytes`), counted as they are written: the writer
    stops at the first write past it, and `staged` removes what was written (an old dataset stays as it was).

    By default `OUTPUT_RATIO` times the inputs' bytes on disk, at least `OUTPUT_FLOOR`. Text encodes to about 2
    bytes per byte at most (4 with uint32 ids), and a compressed record file of real text to a few times its
    size; but a few hundred bytes of Parquet hold one long string repeated in a million rows (a dictionary
    and run-length encoding), and gzip expands up to 1032-fold. The rule stops those after a small multiple
    of what they store, and never nears a real corpus of any size, which a fixed cap would stop hours into its
    work. A `limit` given replaces the rule: a cap for a small disk, or room for a corpus that compresses
    better than real text does.
    """

    def __init__(self, out: str | os.PathLike, input_bytes: int, limit: int | None = None):
        self.out, self.input_bytes, self.given = Path(out), input_bytes, limit is not None
        self.limit = limit if limit is not None else max(OUTPUT_FLOOR, OUTPUT_RATIO * input_bytes)
        self.spent = 0

    def spend(self, nbytes: int) -> None:
        """Count `nbytes` about to be written: a DataError naming the limit once they would pass it."""
        self.spent += nbytes
        if self.spent <= self.limit:
            return
        left = f"{self.out} was left as it was"
        if self.given:
            raise DataError(
                f"the dataset would take more than --max-output-bytes {self.limit:,} bytes; raise it if the corpus "
                f"is that large; {left}"
            )
        raise DataError(
            f"the dataset would take more than {self.limit:,} bytes, the default --max-output-bytes ({OUTPUT_RATIO} "
            f"times the inputs' {self.input_bytes:,} bytes on disk, at least {OUTPUT_FLOOR >> 20} MiB): a record file "
            f"that decodes to far more than it stores (a Parquet or gzip bomb)? If the corpus is real, pass a larger "
            f"--max-output-bytes; {left}"
        )


def _check_out(out: Path, force: bool) -> None:
    existing = next(p for p in (out, *out.parents) if p.exists())  # "/" or "." at the latest
    if not existing.is_dir():
        where = "it is a file" if existing == out else f"{existing} is a file"
        raise StorageError(f"could not write {out}: {where}, not a directory; choose another --out")
    present = [name for name in DATASET_FILES if (out / name).exists()]
    if present and not force:
        raise DataError(
            f"{out} already holds a dataset ({', '.join(present)}): pass --force to replace it, or choose another --out"
        )
    for d in (out, out.parent) if existing == out else (existing,):  # where the files and the temp dir go
        if not os.access(d, os.W_OK | os.X_OK):  # before any work (root passes: then the writes themselves fail)
            raise storage_error(PermissionError(errno.EACCES, "Permission denied"), "write", out, "nothing was written")


def _remove_stale_tmp(out: Path, log: Callable[[str], None]) -> None:
    """Remove temporary directories left by a prepare of `out` that was killed (its process is gone)."""
    if out.parent.is_dir():
        for tmp in remove_stale_temps(out.parent, out.name):
            log(f"removed {tmp}, left by an interrupted prepare")


def _mkdirs(path: Path) -> list[Path]:
    """mkdir -p; returns the directories it created, innermost first (to undo it on failure)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return missing

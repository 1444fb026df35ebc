"""Compiled decode steps kept on disk (`gpt.model.compiled`): a later run of `gpt sample --compile` on the same
weights loads its step instead of compiling it again (loading against compiling: bench/README.md, "Against
llama.cpp").

    GPT_COMPILE_CACHE=DIR      # where (default: $XDG_CACHE_HOME/gpt/compiled-steps, else ~/.cache/gpt/...)
    GPT_COMPILE_CACHE=off      # never read or write one: every run compiles, as before the cache

An entry is the AOTInductor package AOTInductor wrote (`<key>.step.pt2`: the C++ step with the weights inside),
named by a hash of everything the compile read: the weights and buffers, the model's config, the cache layout and
row kind, the compiler options, torch's version, the source of gpt/model (the traced code), and this CPU (its
model, flags and the ISA caps in the environment: the code is built for them, so a home directory shared by
different machines keeps one entry per kind of CPU). Entries are written whole (a temporary name, then a rename);
the least recently used are removed past `BUDGET_BYTES`, and only names of that form: other files there (a
`.pt2` export of your own) are never counted or removed.

Trust: an entry is native code, run when it is loaded (its shared library's constructors run at `dlopen`), so
whoever can write the cache can run code as you. The cache is used only when the directory and every directory
above it (the real path, links resolved) are owned by you or root and writable by nobody else: no group or
other write bit, except on a parent with the sticky bit (/tmp), never on the cache directory itself. Otherwise
the run compiles without it and one warning line says why. The directory and any parents it makes are created
0700. An entry is loaded only when it is a regular file owned by you, mode 0600, opened without following a
link; it is copied through that descriptor into a new private directory and loaded from the copy, so what is
loaded is what was checked. An entry that fails a check, or does not load, is a warning: the step compiles and
the entry is replaced, never silently.

Footguns
- A cache that cannot be written (a full disk, read-only, no home) is not an error: the step compiles as
  without a cache.
- A group-writable ~/.cache (made under a umask of 002) turns the cache off, with the warning: `chmod g-w` it.
- Loading copies the entry into the temporary directory (about the size of the weights) for the moment of the load.
- Only whole runs of the same weights hit: a checkpoint trained further is another entry (about the size of the weights).
- Entries named `<key>.pt2` by versions before the `.step.pt2` suffix are neither loaded nor removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn as nn

BUDGET_BYTES = 4 << 30  # about six GPT-2 124M float32 steps
SUFFIX = ".step.pt2"
ENTRY = re.compile(r"[0-9a-f]{40}" + re.escape(SUFFIX))  # the names `keep` gives; nothing else is evicted
_SAFE = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)  # never through a link, never inherited
_READ = os.O_RDONLY | _SAFE | getattr(os, "O_NONBLOCK", 0)  # (a FIFO there does not block the open)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE


class CacheWarning(UserWarning):
    """The compile cache, or an entry of it, was not used (the message says why)."""


def directory() -> Path | None:
    """The cache directory GPT_COMPILE_CACHE names (or the default), or None when it is off."""
    named = os.environ.get("GPT_COMPILE_CACHE", "")
    if named.lower() in ("off", "0", "none", "false"):
        return None
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpt" / "compiled-steps"


def usable() -> Path | None:
    """The cache directory (its real path), created if missing, when it can be trusted (module notes); None
    when the cache is off, cannot be created, or is not trusted (then with one warning line)."""
    named = directory()
    if named is None:
        return None
    named = Path(os.path.abspath(named))
    try:
        for d in reversed([d for d in (named, *named.parents) if not d.exists()]):
            os.mkdir(d, 0o700)  # (Path.mkdir(parents=True) would make the parents 0777 less the umask)
    except OSError:
        if not named.is_dir():
            return None  # nowhere to keep steps (read-only, no home): compiled as without a cache
    root = Path(os.path.realpath(named))
    reason = _distrust(root)
    if reason:
        warnings.warn(
            f"compile cache {named} not used: {reason}; it and every directory above it must be writable by you "
            "or root only (set GPT_COMPILE_CACHE to a private directory, or to off)",
            CacheWarning,
            stacklevel=2,
        )
        return None
    return root


def key(model: nn.Module, layout: str, options: dict) -> str:
    """The name of the entry for `model`'s step: a hash of what the compile depends on (module notes)."""
    h = hashlib.sha256()
    for part in (
        torch.__version__,
        _source_digest(),
        _cpu(),
        json.dumps(model.config.to_dict(), sort_keys=True, default=str),
        layout,
        json.dumps(options, sort_keys=True, default=str),
    ):
        h.update(part.encode() + b"\0")
    seen = set()  # a tied matrix once
    for name, tensor in model.state_dict().items():
        h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\0".encode())
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:40]


def load(root: Path, name: str):
    """The kept step of that name loaded (an AOTInductor model: call its `.loader.run`), or None when the cache
    `root` (from `usable`) holds none, or one that fails a check or does not load (then with a warning; the
    caller compiles the step again and `keep` replaces the entry)."""
    path = root / f"{name}{SUFFIX}"
    try:
        fd = os.open(path, _READ)  # never through a link
    except FileNotFoundError:
        return None
    except OSError as e:
        return _refused(path, "it is a symbolic link" if os.path.islink(path) else e.strerror or str(e))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _refused(path, "it is not a regular file")
        if st.st_uid != os.geteuid():
            return _refused(path, f"it is owned by another user (uid {st.st_uid})")
        if stat.S_IMODE(st.st_mode) != 0o600:
            return _refused(path, f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600")
        try:
            os.utime(fd)  # used now: the last to be evicted
        except OSError:  # a read-only cache is still read
            pass
        with tempfile.TemporaryDirectory(prefix="gpt-step-") as private:  # mode 0700, a new random name
            copy = Path(private) / "step.pt2"
            with open(fd, "rb", closefd=False) as src, open(os.open(copy, _NEW, 0o600), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)  # what was checked, through its descriptor
            try:
                return torch._inductor.aoti_load_package(str(copy))  # (it unpacks the copy: the copy can go)
            except Exception as e:  # damaged (a disk error, a file truncated by hand)
                first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                return _refused(path, f"it did not load ({first.strip()[:200]})")
    except OSError as e:  # unreadable, or no room in the temporary directory for the copy
        return _refused(path, f"it could not be read and copied ({e.strerror or e})")
    finally:
        os.close(fd)


def keep(root: Path, package: str | os.PathLike, name: str) -> None:
    """Copy the compiled package into the cache `root` (from `usable`) under `name`, whole or not at all, then
    evict past the budget. Failures (a full disk, a read-only cache) leave the cache as it was."""
    tmp = None
    try:
        with open(package, "rb") as src, tempfile.NamedTemporaryFile("wb", dir=root, suffix=".part", delete=False) as f:
            tmp = Path(f.name)  # (mode 0600, created new: never through a link)
            shutil.copyfileobj(src, f, 1 << 24)
        os.replace(tmp, root / f"{name}{SUFFIX}")  # a link or a refused entry there is replaced, its target untouched
        tmp = None
        evict(root, BUDGET_BYTES, keep_name=name)
    except OSError:
        pass
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def evict(root: Path, budget: int, keep_name: str = "") -> None:
    """Remove the least recently used entries until they hold at most `budget` bytes (never `keep_name`'s).
    Only the names `keep` gives are entries."""
    entries = []
    for path in root.iterdir():
        st = path.lstat()
        if ENTRY.fullmatch(path.name) and stat.S_ISREG(st.st_mode):
            entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= budget:
            break
        if path.name != f"{keep_name}{SUFFIX}":
            total -= size
            path.unlink(missing_ok=True)


def _distrust(root: Path) -> str | None:
    """Why the directory `root` (a real path) cannot be trusted with native code, or None when only this user
    and root can change what it holds (module notes)."""
    if not hasattr(os, "geteuid"):
        return "this system has no file owners to check"
    try:
        for d in (root, *root.parents):
            st = os.stat(d)
            if not stat.S_ISDIR(st.st_mode):
                return f"{d} is not a directory"
            if st.st_uid not in (0, os.geteuid()):
                return f"{d} is owned by another user (uid {st.st_uid})"
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o022 and (d == root or not mode & stat.S_ISVTX):  # sticky (/tmp): only a parent
                return f"{d} is writable by {'others' if mode & 0o002 else 'its group'} (mode {mode:04o})"
    except OSError as e:
        return f"{e.filename} cannot be checked ({e.strerror})"
    return None


def _refused(path: Path, reason: str) -> None:
    warnings.warn(
        f"compile cache entry {path} not loaded: {reason}; the step is compiled again and the entry replaced",
        CacheWarning,
        stacklevel=3,
    )
    return None


def _source_digest() -> str:
    """The model code the step was traced from (this directory's sources)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _cpu() -> str:
    """This CPU, as far as the compiled code depends on it."""
    caps = [os.environ.get(v, "") for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")]
    described = platform.processor()
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            fields.setdefault(field.strip(), value.strip())
        described = f"{fields.get('model name', '')} {fields.get('flags', fields.get('Features', ''))}"
    except OSError:
        pass
    return " ".join([platform.machine(), described, torch.backends.cpu.get_cpu_capability(), *caps])

"""The compiled decode steps kept on disk (gpt/model/stepcache.py): a second compile of the same weights is a
load, other weights are another entry, a damaged entry compiles again, and a cache that cannot be written is
not an error. An entry is native code: a cache others can write, and an entry that is a link or not the
user's own private file, are never loaded (the tests stop the step before it would load or compile)."""

import os
import stat
from pathlib import Path

import pytest
import torch
from test_compile_decoding import PROMPT, greedy, tiny, twin_of

from gpt.model import stepcache
from gpt.model.compiled import inductor_options


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT_COMPILE_CACHE", str(tmp_path / "steps"))
    return tmp_path / "steps"


@pytest.fixture()
def compiles(monkeypatch):
    """The compiles that ran (AOTInductor's own, counted)."""
    real, calls = torch._inductor.aoti_compile_and_package, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", counted)
    return calls


def test_the_same_weights_load_the_kept_step_and_a_damaged_entry_compiles_again(cache, compiles):
    eager = greedy(tiny(), PROMPT, 20)
    assert greedy(twin_of(tiny()), PROMPT, 20) == eager and len(compiles) == 1
    (entry,) = cache.glob("*.pt2")
    assert oct(cache.stat().st_mode & 0o777) == "0o700"

    again = twin_of(tiny())  # a new process would do the same: a new model, the same weights
    assert greedy(again, PROMPT, 20) == eager and len(compiles) == 1 and again.decode_step.cache_hits == 1

    entry.write_bytes(b"not a package")  # damaged (a disk error): compiled again and replaced, with a warning
    with pytest.warns(UserWarning, match="not loaded: it did not load"):
        assert greedy(twin_of(tiny()), PROMPT, 20) == eager and len(compiles) == 2
    assert entry.stat().st_size > 1000
    assert not list(cache.glob("*.part"))


def test_the_key_changes_with_what_the_compile_read(monkeypatch):
    model = tiny()
    options = inductor_options(model)
    name = stepcache.key(model, "rows one", options)
    assert stepcache.key(tiny(), "rows one", options) == name  # the same weights, another model object
    assert stepcache.key(model, "rows any", options) != name
    assert stepcache.key(model, "rows one", {"freezing": True}) != name
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.bias[3] += 1e-6
    assert stepcache.key(model, "rows one", options) != name
    other_isa = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other_isa)  # code for another kind of CPU
    assert stepcache.key(tiny(), "rows one", options) != name


def test_keep_evicts_the_least_recently_used_past_the_budget_and_never_fails(cache, tmp_path, monkeypatch):
    package = tmp_path / "step.pt2"
    package.write_bytes(b"x" * 1000)
    root = stepcache.usable()
    a, b, c, d, e = (letter * 40 for letter in "abcde")  # names as stepcache.key gives them
    (root / "export.pt2").write_bytes(b"y" * 5000)  # the user's own package, the oldest file there
    os.utime(root / "export.pt2", (1, 1))
    for i, name in enumerate([a, b, c]):
        stepcache.keep(root, package, name)
        os.utime(root / f"{name}{stepcache.SUFFIX}", (1000 + i, 1000 + i))
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: "loaded")
    assert stepcache.load(root, a) == "loaded"  # used now: the most recent
    monkeypatch.setattr(stepcache, "BUDGET_BYTES", 2500)
    stepcache.keep(root, package, d)
    assert {p.name for p in cache.iterdir()} == {"export.pt2", a + stepcache.SUFFIX, d + stepcache.SUFFIX}

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    stepcache.keep(root, package, e)  # nothing kept, nothing raised, no partial file left
    assert {p.name for p in cache.iterdir()} == {"export.pt2", a + stepcache.SUFFIX, d + stepcache.SUFFIX}
    monkeypatch.setenv("GPT_COMPILE_CACHE", "off")
    assert stepcache.directory() is None and stepcache.usable() is None


NAME = "5" * 40  # the entry every step below looks up (stepcache.key replaced)
ANOTHER_USER = 4242
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root"
)


class Loading(BaseException):
    """The step handed a package to aoti_load_package (stopped there: nothing is loaded)."""


class Compiling(BaseException):
    """The step went on to compile (stopped at the export)."""


@pytest.fixture()
def first_step(monkeypatch):
    """Runs a tiny model's first compiled step until it would load a package or compile; returns what it would
    load (the file's bytes, path and mode, its directory's mode) or "compiled"."""
    monkeypatch.setattr(stepcache, "key", lambda *args: NAME)

    def loading(path, *args, **kwargs):
        path = Path(path)
        raise Loading(
            path.read_bytes(), path, stat.S_IMODE(path.stat().st_mode), stat.S_IMODE(path.parent.stat().st_mode)
        )

    def compiling(*args, **kwargs):
        raise Compiling

    monkeypatch.setattr(torch._inductor, "aoti_load_package", loading)
    monkeypatch.setattr(torch.export, "export", compiling)

    def run():
        try:
            greedy(twin_of(tiny()), PROMPT, 1)
        except Loading as e:
            return e.args
        except Compiling:
            return "compiled"
        raise AssertionError("the step neither loaded nor compiled")

    return run


def plant(cache: Path, content: bytes = b"a kept step") -> Path:
    """An entry as `keep` writes it (a private file of this user) in `cache` (made 0700 if missing)."""
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    entry = cache / f"{NAME}{stepcache.SUFFIX}"
    entry.write_bytes(content)
    entry.chmod(0o600)
    return entry


def cache_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "compile cache" in str(w.message)]


def test_a_private_cache_under_a_sticky_parent_is_loaded_from_a_private_copy(tmp_path, monkeypatch, first_step):
    shared = tmp_path / "tmp"  # like /tmp: everyone may write, the sticky bit set
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("GPT_COMPILE_CACHE", str(shared / "steps"))
    plant(shared / "steps")
    content, path, mode, dir_mode = first_step()
    assert content == b"a kept step"
    assert shared not in path.parents and (mode, dir_mode) == (0o600, 0o700)  # a copy of its own, in its own directory


@pytest.mark.parametrize(
    "where, mode, owner",
    [
        ("steps", 0o777, None),  # the cache writable by others
        ("steps", 0o770, None),  # by its group
        ("steps", 0o1777, None),  # sticky or not: the cache itself is never shared
        ("shared", 0o777, None),  # a parent writable by others, no sticky bit
        pytest.param("steps", 0o700, ANOTHER_USER, marks=needs_root),  # private, but another user's
        pytest.param("shared", 0o755, ANOTHER_USER, marks=needs_root),  # a parent another user owns
    ],
)
def test_a_cache_others_can_write_is_not_used(tmp_path, monkeypatch, first_step, where, mode, owner):
    cache = tmp_path / "shared" / "steps"
    monkeypatch.setenv("GPT_COMPILE_CACHE", str(cache))
    entry = plant(cache)
    (tmp_path / where if where == "shared" else cache).chmod(mode)
    if owner is not None:
        os.chown(tmp_path / where if where == "shared" else cache, owner, owner)
    with pytest.warns(UserWarning) as record:
        assert first_step() == "compiled"
    (line,) = cache_warnings(record)
    assert f"compile cache {cache} not used" in line and "\n" not in line
    assert entry.read_bytes() == b"a kept step"  # left as it was


@pytest.mark.parametrize("kind", ["link", "mode 0644", pytest.param("another user's", marks=needs_root)])
def test_an_entry_that_is_a_link_or_not_a_private_file_of_the_user_is_not_loaded_nor_silently_removed(
    tmp_path, cache, first_step, kind
):
    entry = plant(cache)
    target = tmp_path / "victim.pt2"  # a link's target: never read, never changed
    target.write_bytes(b"the victim's file")
    target.chmod(0o600)
    if kind == "link":
        entry.unlink()
        entry.symlink_to(target)
    elif kind == "mode 0644":
        entry.chmod(0o644)
    else:
        os.chown(entry, ANOTHER_USER, ANOTHER_USER)
    with pytest.warns(UserWarning) as record:
        assert first_step() == "compiled"
    (line,) = cache_warnings(record)
    assert f"compile cache entry {entry} not loaded" in line
    assert os.path.lexists(entry) and target.read_bytes() == b"the victim's file"

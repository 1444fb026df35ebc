"""The compiled decode steps kept on disk (gpt/model/stepcache.py): a second compile of the same weights is a
load, other weights are another entry, a damaged entry compiles again, and a cache that cannot be written is
not an error."""

import os

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

    entry.write_bytes(b"not a package")  # damaged (a disk error, a foreign file): compiled again, replaced
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
    for i, name in enumerate(["a", "b", "c"]):
        stepcache.keep(package, name)
        os.utime(cache / f"{name}.pt2", (1000 + i, 1000 + i))
    assert stepcache.lookup("a") == cache / "a.pt2"  # used now: the most recent
    monkeypatch.setattr(stepcache, "BUDGET_BYTES", 2500)
    stepcache.keep(package, "d")
    assert sorted(p.stem for p in cache.glob("*.pt2")) == ["a", "d"]

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    stepcache.keep(package, "e")  # nothing kept, nothing raised, no partial file left
    assert sorted(p.name for p in cache.iterdir()) == ["a.pt2", "d.pt2"]
    monkeypatch.setenv("GPT_COMPILE_CACHE", "off")
    assert stepcache.directory() is None and stepcache.lookup("a") is None

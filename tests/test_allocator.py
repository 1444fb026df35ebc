"""gpt.runtime.tune_allocator: every long-running command keeps freed memory for its next step (glibc), with
an off switch, and leaves other C libraries alone.

The commands run in a child process as a user runs them; afterwards the child asks glibc what it does with
8 freed blocks of 12 MiB: its defaults map them with mmap and unmap them on free (or trim them off the heap),
the fast path takes them from the heap and keeps them there for the next step."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from gpt import runtime
from gpt.runtime import AllocatorError, tune_allocator

pytestmark = pytest.mark.skipif(runtime.glibc() is None, reason="the allocator settings are glibc's")

MiB = 1 << 20

# runs COMMAND's entry point (runpy, as `python X.py` / `python -m X` would), then probes glibc's malloc
CHILD = """
import ctypes, json, runpy, sys

kind, target, *argv = sys.argv[1:]
if argv[:1] == ["serve"]:  # the server starts up as it would, then stops instead of serving
    import gpt.serve.app
    gpt.serve.app.Server.run = lambda self, sockets=None: None
sys.argv = [target, *argv]
try:
    runpy.run_path(target, run_name="__main__") if kind == "path" else runpy.run_module(target, run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
before = libc.mallinfo2()
blocks = [libc.malloc(12 << 20) for _ in range(8)]
during = libc.mallinfo2()
for b in blocks:
    libc.free(b)
print(json.dumps({"mmapped": during.hblkhd - before.hblkhd, "kept": libc.mallinfo2().keepcost}))
"""


def probe(tmp_path, kind, target, *argv, **env) -> dict:
    """Run the command in a child process, then: how much of 96 MiB of 12 MiB blocks glibc mapped with mmap,
    and how much free memory the heap's top kept after they were freed."""
    import os

    environ = {k: v for k, v in os.environ.items() if k != runtime.MALLOC_SWITCH and not k.startswith("MALLOC_")}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, kind, target, *map(str, argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**environ, "OMP_NUM_THREADS": "1", **env},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def fast(p: dict) -> bool:
    return p["mmapped"] == 0 and p["kept"] >= 96 * MiB


TINY = ["--n-layer", "1", "--n-head", "1", "--n-embd", "16", "--block-size", "16", "--batch-size", "2"]
TINY += ["--max-iters", "2", "--eval-iters", "1", "--device", "cpu", "--dtype", "float32", "--no-plot"]


def test_training_keeps_freed_memory_unless_switched_off(tiny_char_data, tmp_path):
    train = ["path", "train.py", "--data", tiny_char_data, *TINY]
    assert fast(probe(tmp_path, *train, "--out-dir", tmp_path / "a"))
    off = probe(tmp_path, *train, "--out-dir", tmp_path / "b", GPT_MALLOC="default")
    assert off["mmapped"] >= 96 * MiB and off["kept"] < 96 * MiB  # glibc's defaults: mapped, unmapped on free
    # a setting the user made stays theirs: no 512 MiB top pad; the others are still tuned (heap, kept)
    mine = probe(tmp_path, *train, "--out-dir", tmp_path / "c", MALLOC_TOP_PAD_="0")
    assert mine["mmapped"] == 0 and 96 * MiB <= mine["kept"] < 512 * MiB


@pytest.mark.parametrize(
    "command",
    [
        ["path", "sample.py", "--ckpt", "{ckpt}", "--max-new-tokens", "3", "--num-samples", "1", "--seed", "0"],
        ["module", "gpt", "evaluate", "--ckpt", "{ckpt}", "--text", "{text}"],
        ["module", "gpt", "serve", "--ckpt", "{ckpt}", "--port", "0"],
    ],
    ids=["sample", "evaluate", "serve"],
)
def test_sampling_evaluation_and_the_server_keep_freed_memory(command, base, tmp_path):
    if command[1:3] == ["gpt", "serve"]:
        pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 4)
    argv = [a.format(ckpt=base, text=text) for a in command]
    assert fast(probe(tmp_path, *argv))  # the off switch: test_training_keeps_freed_memory_unless_switched_off


class Recorder:
    """A stand-in C library that records the mallopt calls."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


def test_what_is_set_and_what_is_left_alone():
    libc = Recorder()
    assert tune_allocator({}, libc) == "glibc malloc tuned (mmap_threshold, trim_threshold, top_pad)"
    assert libc.calls == [(-3, 32 * MiB), (-1, 2**31 - 1), (-2, 512 * MiB)]  # malloc.h's M_* numbers
    libc = Recorder()
    said = tune_allocator({"MALLOC_TOP_PAD_": "0", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, libc)
    assert libc.calls == [(-1, 2**31 - 1)] and said.endswith("; mmap_threshold, top_pad as set")
    libc = Recorder()
    assert tune_allocator({"GPT_MALLOC": "default"}, libc) == "allocator unchanged (GPT_MALLOC=default)"
    assert libc.calls == []
    with pytest.raises(AllocatorError, match=r"^GPT_MALLOC='slow': use fast .* or default"):
        tune_allocator({"GPT_MALLOC": "slow"}, libc)


@pytest.mark.parametrize("platform", ["darwin", "win32", "linux-musl"])
def test_other_c_libraries_are_left_alone(platform, monkeypatch):
    if platform == "linux-musl":  # musl's confstr does not know glibc's version name
        monkeypatch.setattr(runtime.os, "confstr", lambda name: (_ for _ in ()).throw(ValueError(name)))
    else:
        monkeypatch.setattr(runtime.sys, "platform", platform)
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda *a: pytest.fail("the C library was opened"))
    assert runtime.glibc() is None
    assert tune_allocator({}) == "allocator unchanged (not glibc)"


def test_onednn_keeps_a_bounded_number_of_shapes_unless_the_user_says_otherwise():
    environ = {}
    runtime.bound_onednn_cache(environ)
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128"}
    mine = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
    runtime.bound_onednn_cache(mine)
    assert mine == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


# a heap with holes: blocks of 10..40 MiB freed between small blocks that stay, so that no free top can be trimmed
HOLES = """
import ctypes, json, sys
from gpt import runtime

print(runtime.tune_allocator(), file=sys.stderr)
libc = runtime.glibc()
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


cap = runtime.FreeMemoryCap(int(sys.argv[1]) << 20, least=16 << 20)
big, small = [], []
for i in range(16):
    big.append(libc.malloc((10 + 2 * i) << 20))
    libc.memset(big[-1], 1, (10 + 2 * i) << 20)  # touched: resident
    small.append(libc.malloc(4096))
for b in big:
    libc.free(b)
before, free = resident(), runtime.malloc_stats(libc)["free"]
done = cap.after_step()
returned = before - resident()
mapped = runtime.malloc_stats(libc)["mmapped"]
large = libc.malloc(512 << 20)  # over glibc's largest mmap threshold (32 MiB) and every free block (untouched)
mapped = runtime.malloc_stats(libc)["mmapped"] - mapped
print(json.dumps({"free": free, "done": done, "trims": cap.trims, "returned": returned, "mapped": mapped,
                  "counted": cap.returned}))
"""


def holes(limit_mib: int, **env) -> dict:
    import os

    environ = {k: v for k, v in os.environ.items() if k != runtime.MALLOC_SWITCH and not k.startswith("MALLOC_")}
    res = subprocess.run(
        [sys.executable, "-c", HOLES, str(limit_mib)], cwd=ROOT, capture_output=True, text=True, env={**environ, **env}
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(runtime.glibc(), "mallinfo2"), reason="mallinfo2: glibc 2.33+")
def test_free_memory_past_the_cap_goes_back_to_the_system():
    """400 MiB freed in holes the heap's top cannot give back: with the resident set over a limit of 64 MiB,
    malloc_trim returns the pages (the resident set falls by most of them); under a limit of 1 GiB they stay
    for the next step. Blocks over glibc's mmap threshold come from the heap, unless the user says otherwise."""
    trimmed = holes(64)
    assert trimmed["free"] >= 400 * MiB and trimmed["trims"] == 1
    assert trimmed["returned"] >= 350 * MiB and trimmed["done"] == trimmed["counted"] >= 350 * MiB
    assert trimmed["mapped"] == 0  # a block of 512 MiB comes from the heap
    kept = holes(1024)
    assert kept["done"] == 0 and kept["trims"] == 0 and abs(kept["returned"]) < 16 * MiB
    assert holes(1024, MALLOC_MMAP_MAX_="65536")["mapped"] >= 512 * MiB  # the user's setting wins
    off = holes(64, GPT_MALLOC="default")  # glibc's own settings: the cap does nothing
    assert off["done"] == 0 and off["trims"] == 0 and off["mapped"] >= 512 * MiB

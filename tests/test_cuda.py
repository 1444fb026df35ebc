"""The CUDA paths, run as a user runs them (train.py / sample.py / torchrun in subprocesses).

Skipped where there is no CUDA device (CI has none): bench/bench_gpu.py runs the whole suite on a
GPU machine and records the result in bench/results/gpu.json. CUDA-only pieces elsewhere: KV-cached
and CUDA-graph decoding == recompute (test_sampling.py), pinned-memory batches (test_data.py).
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "64",
    "--block-size",
    "64",
    "--batch-size",
    "8",
    "--eval-iters",
    "4",
    "--log-interval",
    "1",
    "--warmup-iters",
    "2",
    "--device",
    "cuda",
]


def run_cmd(*argv, check=True, env=None):
    res = subprocess.run(
        [sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, **(env or {}))
    )
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def records(out_dir, kind):
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])  # float16 trains with a GradScaler
def test_mixed_precision_training_resumes_bit_identically(char_data, tmp_path, dtype):
    common = [
        "--data",
        char_data,
        *TINY,
        "--dtype",
        dtype,
        "--dropout",
        "0.1",
        "--grad-accum",
        "2",
        "--lr-decay-iters",
        "12",
        "--eval-interval",
        "6",
        "--deterministic",
    ]
    run_cmd("train.py", *common, "--out-dir", tmp_path / "full", "--max-iters", "12")
    run_cmd("train.py", *common, "--out-dir", tmp_path / "split", "--max-iters", "6")
    run_cmd("train.py", "--resume", tmp_path / "split", "--max-iters", "12")
    full = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "full", "train")]
    split = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "split", "train")]
    assert [s for s, *_ in split] == list(range(1, 13))
    assert split == full  # bit for bit after the resume, dropout and (float16) loss scale included
    assert full[-1][1] < full[0][1]
    ckpt = torch.load(tmp_path / "split" / "last.pt", weights_only=True)
    assert (ckpt["scaler"] is not None) == (dtype == "float16")
    assert "cuda" in ckpt["rng"]


def test_compiled_training_and_sampling(char_data, tmp_path):
    out = tmp_path / "run"
    run_cmd(
        "train.py",
        "--data",
        char_data,
        *TINY,
        "--compile",
        "--max-iters",
        "40",
        "--eval-interval",
        "20",
        "--learning-rate",
        "3e-3",
        "--out-dir",
        out,
    )
    evals = records(out, "eval")
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] < 4.2
    state = torch.load(out / "last.pt", weights_only=True)["model"]
    assert not any(k.startswith("_orig_mod") for k in state)  # the uncompiled module is what is saved
    greedy = [
        "sample.py",
        "--ckpt",
        out,
        "--prompt",
        "ROMEO:",
        "--temperature",
        "0",
        "--max-new-tokens",
        "40",
        "--dtype",
        "float32",
        "--device",
        "cuda",
    ]
    compiled = run_cmd(*greedy, "--compile").stdout
    graphed = run_cmd(*greedy).stdout  # CUDA-graph decode steps (the default on CUDA)
    eager = run_cmd(*greedy, "--no-cuda-graph").stdout
    assert compiled == graphed == eager and len(eager) > len("ROMEO:")


def test_torchrun_uses_nccl_and_resumes_in_one_process(char_data, tmp_path):
    n = torch.cuda.device_count()
    common = ["--data", char_data, *TINY, "--grad-accum", str(2 * n), "--eval-interval", "4"]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(n),
            "train.py",
            *common,
            "--max-iters",
            "4",
            "--out-dir",
            str(tmp_path / "ddp"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )  # --standalone: a free port
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{n} process(es)" in res.stdout
    meta = json.loads(torch.load(tmp_path / "ddp" / "last.pt", weights_only=True)["meta"])
    assert meta["world_size"] == n and meta["step"] == 4
    run_cmd("train.py", "--resume", tmp_path / "ddp", "--max-iters", "8")
    assert [r["step"] for r in records(tmp_path / "ddp", "train")] == list(range(1, 9))


def test_out_of_memory_is_one_line_naming_the_fix_and_keeps_the_checkpoint(char_data, tmp_path):
    # Wide enough that the first activation of the huge batch cannot be allocated at all (~130 GB):
    # the test never fills the GPU, whatever else runs on it.
    out = tmp_path / "run"
    run_cmd(
        "train.py",
        "--data",
        char_data,
        *TINY,
        "--n-embd",
        "512",
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
        "--out-dir",
        out,
    )
    before = (out / "last.pt").read_bytes()
    res = run_cmd("train.py", "--resume", out, "--max-iters", "4", "--batch-size", "1000000", check=False)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "CUDA out of memory" in lines[0] and "--batch-size 500000 --grad-accum 2" in lines[0]
    assert "intact" in lines[0]
    assert (out / "last.pt").read_bytes() == before
    res = run_cmd("sample.py", "--ckpt", out, "--num-samples", "3000000", "--max-new-tokens", "8", check=False)
    assert res.returncode == 2 and "--num-samples" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


def _cmdline(pid: str) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def test_torchrun_killed_then_resumed_continues_exactly_under_deterministic(char_data, tmp_path):
    """One torchrun process SIGKILLed after a checkpoint, resumed by torchrun: the same losses as a twin."""
    common = [*TINY, "--data", char_data, "--max-iters", "400", "--eval-interval", "50", "--deterministic"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "train.py"]
    subprocess.run([*torchrun, *common, "--out-dir", str(tmp_path / "twin")], cwd=ROOT, check=True, capture_output=True)
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [*torchrun, *common, "--out-dir", str(out)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while not (out / "last.pt").exists() and proc.poll() is None:
        time.sleep(0.02)
    # the agent and its worker (torchrun may start the worker in a session of its own), as a job kill would
    for pid in [p for p in os.listdir("/proc") if p.isdigit() and str(out).encode() in _cmdline(p)]:
        os.kill(int(pid), signal.SIGKILL)
    proc.wait()
    while any(str(out).encode() in _cmdline(p) for p in os.listdir("/proc") if p.isdigit()):
        time.sleep(0.02)
    step = json.loads(torch.load(out / "last.pt", weights_only=True)["meta"])["step"]
    assert proc.returncode == -signal.SIGKILL and 50 <= step < 400, (proc.returncode, step)
    res = subprocess.run([*torchrun, "--resume", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]

    def losses(run):
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run, "train")}

    assert losses(out) == losses(tmp_path / "twin")  # bit for bit, every step, after the kill
    assert sorted(losses(out)) == list(range(1, 401))


def test_muon_trains_on_cuda(char_data, tmp_path):
    run_cmd(
        "train.py",
        "--data",
        char_data,
        *TINY,
        "--optimizer",
        "muon",
        "--max-iters",
        "30",
        "--eval-interval",
        "30",
        "--out-dir",
        tmp_path / "muon",
    )
    train = records(tmp_path / "muon", "train")
    assert len(train) == 30 and all(map(math.isfinite, (r["loss"] for r in train)))
    assert train[-1]["loss"] < train[0]["loss"] - 0.5

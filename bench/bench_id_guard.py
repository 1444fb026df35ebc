"""What checking every batch's ids against the vocabulary costs (gpt.dataformat.IdGuard).

    python bench/bench_id_guard.py                # ~1 minute on a 2-core CPU; prints a table

For each batch shape: the time to read a random batch of windows from a memory-mapped uint16 split
(gpt.data.gather_windows, what every step does anyway) and the time of the guard's check on it (one
vectorised max over the batch), medians over many repetitions. Then the step time of the README's main
job (`--config shakespeare_char_cpu`: 2 x 4 x 128, block 64, batch 24, Muon; forward, backward and
optimizer step on random ids, float32, one process), to put the check beside what it guards.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpt.data.format import IdGuard
from gpt.data.tokens import gather_windows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def batch_costs(ids: np.ndarray, vocab: int, batch: int, block: int, reps: int) -> tuple[float, float]:
    guard = IdGuard(ids, vocab, Path("bench"), "train", Path("train.bin"))
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - block - 1, size=batch)
    xy = gather_windows(ids, starts, block + 1)
    read = median_seconds(lambda: gather_windows(ids, starts, block + 1), reps)
    check = median_seconds(lambda: guard.check(xy, lambda: iter(())), reps)
    return read, check


def main_job_step_seconds(steps: int) -> float:
    from dataclasses import replace

    from gpt.model.transformer import GPT
    from gpt.runtime import setup
    from gpt.train.start import resolve_run
    from gpt.train.step import make_optimizer, train_step

    cfg = resolve_run(["--config", "shakespeare_char_cpu", "--device", "cpu", "--dtype", "float32"]).cfg
    rt = setup("cpu", "float32", 0, False)
    model = GPT(replace(cfg.model, vocab_size=128))
    optimizer = make_optimizer(model, cfg.optimizer_config(), rt.device)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    g = torch.Generator().manual_seed(0)

    def batch(step, micro):
        x = torch.randint(66, (cfg.batch_size, cfg.model.block_size), generator=g)
        return x, torch.roll(x, -1, 1)

    def step():
        train_step(model, optimizer, scaler, batch, 0, 1, rt, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    return median_seconds(step, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "train.bin"
        np.random.default_rng(0).integers(0, 50257, size=16 << 20, dtype=np.uint16).tofile(file)  # 16M tokens
        ids = np.memmap(file, dtype="<u2", mode="r")
        print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}")
        print("| batch x block | read the batch (us) | check (us) |")
        print("|---|---|---|")
        for batch, block in ((24, 64), (24, 256), (12, 1024), (32, 1024)):
            read, check = batch_costs(ids, 50257, batch, block, args.reps)
            print(f"| {batch} x {block} | {read * 1e6:.1f} | {check * 1e6:.1f} |")
        del ids
    step = main_job_step_seconds(args.steps)
    print(f"main job (shakespeare_char_cpu, 24 x 64, float32) step: {step * 1e3:.1f} ms (median of {args.steps})")


if __name__ == "__main__":
    main()

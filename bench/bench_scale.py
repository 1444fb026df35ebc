"""Beyond one process: memory per rank of FSDP against DDP, and what activation checkpointing costs.

    python bench/bench_scale.py                     # both; results in bench/results/scale.{json,md}
    python bench/bench_scale.py --only memory       # or: recompute

1. memory: the same model trained 3 steps by 2 processes under torchrun (gloo on CPU, nccl on CUDA)
   with DDP, DDP + activation checkpointing, FSDP and FSDP + activation checkpointing, through the
   trainer's own pieces (gpt.train.parallel.wrap, gpt.train.step.make_optimizer / train_step). Per rank: the
   bytes of parameters, gradients and AdamW state it holds (exact: its tensors, shards under FSDP),
   and the peak memory: on CUDA max_memory_allocated, on CPU the growth of the process's peak RSS
   from before the model was built (which also counts allocator slack, and the whole model every
   rank builds once before sharding it). glibc's mmap threshold is pinned at 128 KiB so that freed
   tensors go back to the system instead of staying in the heap (by default the threshold grows
   with the first large free, and the RSS then keeps every buffer ever used).
2. recompute: one process, float32, ms per training step with and without --activation-checkpointing
   (median of interleaved repeats), and the bytes autograd keeps from the forward in each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "scale"
# a mid-sized GPT (33.6M parameters) and a small micro-batch: the training state, what FSDP shards, is
# most of the memory (at 4 x 256 the float32 activations are as large, and the same under both)
MEMORY_MODEL = dict(vocab_size=16384, block_size=256, n_layer=8, n_head=8, n_embd=512)
MEMORY_BATCH = 1
RECOMPUTE_MODEL = dict(vocab_size=8192, block_size=256, n_layer=6, n_head=6, n_embd=384)
MODES = {"DDP": (False, False), "DDP + AC": (False, True), "FSDP": (True, False), "FSDP + AC": (True, True)}


def held_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors` (each once; a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(mode: str, steps: int) -> None:
    """One rank of the memory benchmark (launched by torchrun)."""
    import torch

    from gpt.model.config import GPTConfig
    from gpt.model.transformer import GPT
    from gpt.runtime import setup
    from gpt.train import parallel
    from gpt.train.config import TrainConfig
    from gpt.train.step import make_optimizer, train_step

    rt = setup(device="auto", dtype="float32", threads=1)
    fsdp, ac = MODES[mode]
    cfg = TrainConfig(fsdp=fsdp, activation_checkpointing=ac, batch_size=MEMORY_BATCH, model=GPTConfig(**MEMORY_MODEL))
    torch.manual_seed(0)
    start_rss = peak_rss()
    model = GPT(cfg.model).to(rt.device)
    train_model = parallel.wrap(model, cfg, rt)
    optimizer = make_optimizer(model, cfg.optimizer_config(), rt.device)
    scaler = torch.amp.GradScaler(rt.device.type, enabled=False)
    gen = torch.Generator().manual_seed(rt.rank)

    def batch(step, micro):
        x = torch.randint(0, MEMORY_MODEL["vocab_size"], (cfg.batch_size, cfg.model.block_size + 1), generator=gen)
        return x[:, :-1].to(rt.device), x[:, 1:].to(rt.device)

    t0 = time.time()
    for step in range(steps):
        loss, _, _ = train_step(train_model, optimizer, scaler, batch, step, 1, rt, cfg.grad_clip)
        grads = held_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = (time.time() - t0) / steps
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    result = dict(
        rank=rt.rank,
        params=held_bytes(model.parameters()),
        grads=grads,
        optimizer=held_bytes(state),
        peak=(torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else peak_rss() - start_rss),
        peak_kind="cuda allocated" if rt.device.type == "cuda" else "RSS growth",
        seconds_per_step=seconds,
        loss=loss.item(),
    )
    gathered = [None] * rt.world_size
    torch.distributed.all_gather_object(gathered, result)
    if rt.master:
        print("RESULT " + json.dumps(gathered), flush=True)
    torch.distributed.destroy_process_group()


def memory(steps: int = 3) -> dict:
    out = {
        "model": MEMORY_MODEL,
        "micro_batch": [MEMORY_BATCH, MEMORY_MODEL["block_size"]],
        "processes": 2,
        "modes": {},
    }
    for mode in MODES:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                __file__,
                "--worker",
                mode,
                "--steps",
                str(steps),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(1 << 17)),
        )
        lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
        if res.returncode or not lines:
            raise RuntimeError(f"{mode} failed:\n{res.stderr[-3000:]}")
        ranks = json.loads(lines[0].removeprefix("RESULT "))
        out["modes"][mode] = ranks
        r = ranks[0]
        print(
            f"{mode}: rank 0 holds params {r['params'] / 2**20:.0f} MiB, grads {r['grads'] / 2**20:.0f} MiB, "
            f"AdamW {r['optimizer'] / 2**20:.0f} MiB; peak {r['peak'] / 2**20:.0f} MiB ({r['peak_kind']}); "
            f"{r['seconds_per_step']:.2f} s/step",
            flush=True,
        )
    state = {m: max(r["params"] + r["grads"] + r["optimizer"] for r in ranks) for m, ranks in out["modes"].items()}
    out["state_drop_fsdp_vs_ddp"] = 1 - state["FSDP"] / state["DDP"]
    out["peak_drop_fsdp_vs_ddp"] = 1 - max(r["peak"] for r in out["modes"]["FSDP"]) / max(
        r["peak"] for r in out["modes"]["DDP"]
    )
    return out


def recompute(repeats: int = 5, steps: int = 4) -> dict:
    import torch

    from gpt.model.transformer import GPT, GPTConfig
    from gpt.runtime import Runtime
    from gpt.train import parallel
    from gpt.train.step import train_step

    torch.set_num_threads(1)
    rt = Runtime(torch.device("cpu"), torch.float32)
    batch_size, T = 8, RECOMPUTE_MODEL["block_size"]
    x = torch.randint(0, RECOMPUTE_MODEL["vocab_size"], (batch_size, T + 1), generator=torch.Generator().manual_seed(0))
    batch = lambda step, micro: (x[:, :-1], x[:, 1:])  # noqa: E731
    runs = {}
    for ac in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**RECOMPUTE_MODEL))
        if ac:
            parallel.checkpoint_activations(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # noqa: B023 (this iteration's)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rt.autocast():
            model(*batch(0, 0))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        runs[ac] = dict(
            model=model, optimizer=optimizer, times=[], saved=sum(n for ptr, n in saved.items() if ptr not in params)
        )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(repeats):  # interleaved: the machine's load hits both alike
        for run in runs.values():
            t0 = time.perf_counter()
            for step in range(steps):
                train_step(run["model"], run["optimizer"], scaler, batch, step, 1, rt, 1.0)
                run["optimizer"].step()
                run["optimizer"].zero_grad(set_to_none=True)
            run["times"].append((time.perf_counter() - t0) / steps * 1e3)
    out = {"model": RECOMPUTE_MODEL, "micro_batch": [batch_size, T], "dtype": "float32", "threads": 1}
    for ac, run in runs.items():
        name = "with AC" if ac else "without AC"
        out[name] = dict(ms_per_step=statistics.median(run["times"]), all_ms=run["times"], saved_bytes=run["saved"])
        print(f"{name}: {out[name]['ms_per_step']:.0f} ms/step, saves {run['saved'] / 2**20:.0f} MiB", flush=True)
    out["step_time_cost"] = out["with AC"]["ms_per_step"] / out["without AC"]["ms_per_step"] - 1
    out["saved_drop"] = 1 - out["with AC"]["saved_bytes"] / out["without AC"]["saved_bytes"]
    return out


def markdown(results: dict) -> str:
    lines = [f"Measured on {results['machine']}.", ""]
    if "memory" in results:
        m = results["memory"]
        lines += [
            f"**Memory per rank, 2 processes** ({sum(1 for _ in m['modes'])} runs of 3 steps; model "
            f"{m['model']['n_layer']}x{m['model']['n_head']}x{m['model']['n_embd']}, vocab "
            f"{m['model']['vocab_size']}, micro-batch {m['micro_batch'][0]} x {m['micro_batch'][1]}, float32, one "
            f"thread each; load average {m['load_at_start']} at the start)",
            "",
            "| mode | parameters | gradients | AdamW state | params + grads + state | peak | s/step |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode, ranks in m["modes"].items():
            r = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
            mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
            lines.append(
                f"| {mode} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])} | "
                f"{mib(r['params'] + r['grads'] + r['optimizer'])} | {mib(max(x['peak'] for x in ranks))} "
                f"({r['peak_kind']}) | {r['seconds_per_step']:.2f} |"
            )
        lines += [
            "",
            f"FSDP holds {m['state_drop_fsdp_vs_ddp']:.0%} less training state per rank than DDP; its peak "
            f"is {m['peak_drop_fsdp_vs_ddp']:.0%} lower.",
            "",
        ]
    if "recompute" in results:
        r = results["recompute"]
        lines += [
            f"**Activation checkpointing, one process** (model {r['model']['n_layer']}x{r['model']['n_head']}x"
            f"{r['model']['n_embd']}, micro-batch {r['micro_batch'][0]} x {r['micro_batch'][1]}, float32, "
            f"{r['threads']} thread; median of interleaved repeats; load average {r['load_at_start']} at the start)",
            "",
            "| | ms/step | activations kept for the backward |",
            "|---|---|---|",
        ]
        for name in ("without AC", "with AC"):
            lines.append(f"| {name} | {r[name]['ms_per_step']:.0f} | {r[name]['saved_bytes'] / 2**20:,.0f} MiB |")
        lines += [
            "",
            f"Recomputing costs {r['step_time_cost']:.0%} more time per step for {r['saved_drop']:.0%} "
            f"less activation memory.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["memory", "recompute"])
    ap.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    import torch

    from gpt.runtime import cpu_description

    json_path = RESULTS.with_suffix(".json")
    results = json.loads(json_path.read_text()) if json_path.exists() else {}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    results.update(
        machine=f"{cpu_description()}, {os.cpu_count()} cores, {device}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )
    for name, fn in (("memory", memory), ("recompute", recompute)):
        if args.only in (None, name):
            load = os.getloadavg()[0]  # the machine may be shared: each part says how busy it was
            results[name] = dict(fn(), load_at_start=round(load, 1))
            json_path.write_text(json.dumps(results, indent=1) + "\n")
    RESULTS.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

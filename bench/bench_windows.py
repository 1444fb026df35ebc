"""Training step time and peak memory against the sequence length: full attention, sliding windows through
the linear-cost chunks (gpt/model/sparse.py), and windows through the dense reference masks, on the CPU.

    python bench/bench_windows.py                                   # 512 .. 16384, full and windows 128, 512
    python bench/bench_windows.py --lengths 512,1024 --rounds 2 --out /tmp/w.json   # a quick check that it runs
    python bench/bench_windows.py --lengths 256,384,512,768,1024 --attention 64,128 --dense-max 0   # the crossover

Each (length, attention) case runs in a process of its own (so its peak resident set is its own): a model of
--n-layer blocks, --n-embd wide, one sequence of T tokens per step, float32; one warm-up step, then --rounds
timed steps (forward, backward, AdamW). Recorded per case: the step's median, min and max seconds, the peak
resident set of the process (ru_maxrss) and its resident set before the first step (the model, optimizer
state and torch itself), and their difference, what the steps added. "reference" (windows as one dense (T, T)
mask per window size, GPT.window_masks) runs only up to --reference-max positions: it is the quadratic path.

Writes bench/results/windows.json (or --out), with the machine (CPU model, torch's CPU capability, load).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

from gpt.model import sparse  # noqa: E402


def rss_mib() -> float:
    """The process's resident set now (Linux: /proc/self/statm)."""
    import os

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_case(T: int, attention: str, args) -> dict:
    """Time and memory of one case, in this process (what the parent runs once per case)."""
    import torch

    from gpt.model.config import GPTConfig
    from gpt.model.transformer import GPT

    if args.dense_max is not None:  # where the dense band mask gives way to the chunks (the crossover to tune)
        sparse.DENSE_MAX = args.dense_max
    window, reference = attention.removesuffix("-reference"), attention.endswith("-reference")
    cfg = GPTConfig(
        vocab_size=256,
        block_size=T,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        pos_encoding="rope",
        attention_window="" if window == "full" else window,
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    if reference:
        GPT.bands = lambda self, *a, **k: None  # the dense per-layer masks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = (torch.randint(0, 256, (1, T)) for _ in range(2))

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()

    before = rss_mib()
    step()  # warm-up (the optimizer's state made)
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "T": T,
        "attention": attention,
        "step_s": harness.spread(times),
        "tokens_per_s": round(T / statistics.median(times), 1),
        "rss_before_mib": round(before, 1),
        "peak_rss_mib": round(peak, 1),
        "added_mib": round(peak - before, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--attention", default="full,128,512,128-reference", help="full | W | W-reference, comma-separated")
    p.add_argument("--reference-max", type=int, default=4096, help="the dense reference only up to this length")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dense-max", type=int, help="gpt/model/sparse.py's DENSE_MAX for this run (default: its own)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "windows.json"))
    p.add_argument("--one", nargs=2, metavar=("T", "ATTENTION"), help=argparse.SUPPRESS)  # (a child process)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_case(int(args.one[0]), args.one[1], args)))
        return
    cases = []
    for T in map(int, args.lengths.split(",")):
        for attention in args.attention.split(","):
            if attention.endswith("-reference") and T > args.reference_max:
                continue
            cmd = [sys.executable, __file__, "--one", str(T), attention, "--rounds", str(args.rounds)]
            cmd += ["--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd)]
            cmd += ["--dense-max", str(args.dense_max)] if args.dense_max is not None else []
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"T={T} {attention} failed:\n{res.stderr[-2000:]}")
            case = json.loads(res.stdout.splitlines()[-1])
            print(
                f"T={T:6d} {attention:>14}: step {case['step_s']['median']:.3f} s, "
                f"peak {case['peak_rss_mib']:.0f} MiB (+{case['added_mib']:.0f})",
                flush=True,
            )
            cases.append(case)
    result = {
        "machine": harness.machine(),
        "config": {
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "n_embd": args.n_embd,
            "batch": 1,
            "dtype": "float32",
            "pos_encoding": "rope",
            "optimizer": "adamw",
            "dense_max": args.dense_max if args.dense_max is not None else sparse.DENSE_MAX,
        },
        "rounds": args.rounds,
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

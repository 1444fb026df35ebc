"""GRPO's worked example (docs/grpo.md): a tiny char model learns two-digit additions from a corpus, then
`gpt train --objective grpo --reward exact` raises its exact-match reward on problems it never saw.

    python bench/bench_grpo.py                    # SFT once, GRPO with seeds 0..2: about 10 minutes, 1 thread
    python bench/bench_grpo.py --seeds 0          # one GRPO run

1. data: `data/arithmetic/prepare.py`: 7,000 of the 10,000 problems a + b (a, b < 100) as a corpus, a share
   --period of them ending with a full stop ("12+7=19."), the other 3,000 as prompt rows (the answer alone:
   "19"); GRPO holds out every 20th row (150 problems neither phase trains on).
2. SFT: a 3-layer x 96 char model on the corpus (`gpt train`, --sft-steps), seed 0: it learns most sums, and
   ends about half of its answers with a full stop, which the exact reward scores 0.
3. GRPO from it, per seed: --steps steps of 8 prompts x 8 completions (<= 5 tokens, temperature 1), LR
   --lr constant, beta --beta; the train log's per-step reward (the sampled completions' mean) is the curve.
4. before and after, on the 150 held-out problems, measured here with the run's own sampler
   (gpt/train/grpo.py `sample_group`): the greedy exact-match rate, and the mean reward of 8 sampled
   completions per problem at temperature 1 (what GRPO maximises), with a fixed sampling seed.

Results: `grpo.json` and the plot `grpo.png` (reward per step, mean of seeds, 25-step windows) in --results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402

QUIET = ["--no-plot", "--device", "cpu", "--dtype", "float32", "--threads", "1"]
SFT = ["--n-layer", "3", "--n-head", "4", "--n-embd", "96", "--block-size", "16", "--batch-size", "32"]
SFT += ["--learning-rate", "3e-3", "--warmup-iters", "50", "--dropout", "0", "--eval-iters", "20"]
WINDOW = 25
MAX_NEW = 5  # a sum's 3 digits, a full stop, the end-of-text token


def run(cmd: list, log: Path) -> dict:
    out = harness.launch(cmd, ROOT, log, timeout=3600, env={"OMP_NUM_THREADS": "1"})
    if out["returncode"] != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{harness.tail(out)}")
    return out


def held_out(prompts: Path) -> list[dict]:
    """The rows GRPO holds out: every 20th good row (gpt/train/prompts.py; every row here is good)."""
    from gpt.train.prompts import VAL_PERIOD

    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    return [r for i, r in enumerate(rows, 1) if i % VAL_PERIOD == 0]


def measure(ckpt: Path, rows: list[dict], group: int = 8, seed: int = 1234) -> dict:
    """Greedy exact-match rate and the mean exact-match reward of `group` samples at temperature 1."""
    import torch

    from gpt.checkpoints import loader
    from gpt.data.tokenizer import get_tokenizer
    from gpt.train.grpo import sample_group

    torch.set_num_threads(1)
    model, meta = loader.load_model(ckpt)
    tok = get_tokenizer(meta["tokenizer"])
    gen = torch.Generator().manual_seed(seed)

    def rewards(prompt: list[int], answer: str, g: int, temperature: float) -> list[float]:
        out, n = sample_group(model, prompt, g, MAX_NEW, temperature, [tok.eot_token], gen)
        texts = [tok.decode([t for t in row[:k] if t != tok.eot_token]) for row, k in zip(out.tolist(), n.tolist())]
        return [float(t.strip() == answer) for t in texts]

    greedy, sampled = [], []
    for r in rows:
        prompt = [tok.eot_token, *tok.encode(r["prompt"])]
        greedy += rewards(prompt, r["answer"], 1, 0.0)
        sampled += rewards(prompt, r["answer"], group, 1.0)
    return {"greedy": statistics.fmean(greedy), "sampled": statistics.fmean(sampled), "problems": len(rows)}


def windows(values: list[float], size: int = WINDOW) -> list[float]:
    return [round(statistics.fmean(values[i : i + size]), 4) for i in range(0, len(values) - size + 1, size)]


def plot(path: Path, curves: dict, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for seed, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, alpha=0.25, lw=0.8, label=f"seed {seed}, per step")
    mean = [statistics.fmean(c[i] for c in curves.values()) for i in range(steps)]
    xs = [WINDOW * (i + 1) for i in range(len(windows(mean)))]
    ax.plot(xs, windows(mean), "k-o", ms=3, label=f"mean of seeds, {WINDOW}-step windows")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (exact match, sampled)")
    ax.set_title("GRPO on two-digit additions (bench/bench_grpo.py)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_grpo"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--sft-steps", type=int, default=2400)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--period", type=float, default=0.5, help="the share of the corpus's sums ending with '.'")
    args = p.parse_args(argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    prep = [py, "data/arithmetic/prepare.py", "--out", str(work), "--period", str(args.period)]
    subprocess.run(prep, cwd=ROOT, check=True, capture_output=True)
    run([py, "-m", "gpt", "prepare", work / "corpus.jsonl", "--out", work / "chars", "--tokenizer", "char",
         "--block-size", "16", "--force", "--quiet"], work / "prepare.log")  # fmt: skip
    sft = work / "sft"
    n = args.sft_steps
    sft_run = run([py, "-m", "gpt", "train", "--data", work / "chars", "--out-dir", sft, "--force", *QUIET, *SFT,
                   "--max-iters", n, "--eval-interval", n, "--log-interval", 100, "--seed", 0], work / "sft.log")  # fmt: skip
    rows = held_out(work / "prompts.jsonl")
    before = measure(sft, rows)
    print(f"sft: {before} in {sft_run['seconds']:.0f} s", flush=True)
    seeds = {}
    for seed in args.seeds:
        out = work / f"grpo-{seed}"
        cmd = [py, "-m", "gpt", "train", "--objective", "grpo", "--init-from", sft, "--data", work / "prompts.jsonl",
               "--reward", "exact", "--out-dir", out, "--force", *QUIET, "--max-iters", args.steps,
               "--eval-interval", 50, "--eval-iters", 0, "--no-eval-train", "--batch-size", 8, "--group-size", 8,
               "--grpo-max-new-tokens", MAX_NEW, "--learning-rate", args.lr, "--min-lr", 0, "--lr-schedule", "constant",
               "--warmup-iters", 0, "--beta", args.beta, "--log-interval", 1, "--seed", seed]  # fmt: skip
        r = run(cmd, work / f"grpo-{seed}.log")
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        train = [x for x in log if x["kind"] == "train"]
        curve = [round(x["reward"], 4) for x in train]
        after = measure(out / "last.pt", rows)
        seeds[seed] = {
            "reward_per_step": curve,
            "reward_windows": windows(curve),
            "first_window": statistics.fmean(curve[:WINDOW]),
            "last_window": statistics.fmean(curve[-WINDOW:]),
            "mean_length_last_window": statistics.fmean(x["completions/mean_length"] for x in train[-WINDOW:]),
            "kl_last_window": statistics.fmean(x.get("kl", 0.0) for x in train[-WINDOW:]),
            "val_reward_evals": {x["step"]: x["val_reward"] for x in log if x["kind"] == "eval"},
            "held_out_after": after,
            "wall_s": round(r["seconds"], 1),
        }
        print(
            f"seed {seed}: {json.dumps({k: v for k, v in seeds[seed].items() if k != 'reward_per_step'})}", flush=True
        )

    def spread(f) -> dict:
        return harness.spread([f(s) for s in seeds.values()])

    result = {
        "machine": harness.machine(),
        "note": "one thread per run, on a 2-core machine shared with other work: wall times are noisy",
        "threads": 1,
        "settings": {
            "corpus_period": args.period,
            "sft": SFT + ["--max-iters", str(n)],
            "grpo": {"steps": args.steps, "lr": args.lr, "beta": args.beta, "batch": 8, "group": 8, "max_new": MAX_NEW},
            "seeds": args.seeds,
            "held_out_problems": len(rows),
            "window": WINDOW,
        },
        "sft_wall_s": round(sft_run["seconds"], 1),
        "before": before,
        "seeds": seeds,
        "summary": {
            "train_reward_first_window": spread(lambda s: s["first_window"]),
            "train_reward_last_window": spread(lambda s: s["last_window"]),
            "held_out_greedy_after": spread(lambda s: s["held_out_after"]["greedy"]),
            "held_out_sampled_after": spread(lambda s: s["held_out_after"]["sampled"]),
            "wall_s": spread(lambda s: s["wall_s"]),
        },
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "grpo.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(args.results / "grpo.png", {s: v["reward_per_step"] for s, v in seeds.items()}, args.steps)
    print(json.dumps({"before": before, **result["summary"]}, indent=1))


if __name__ == "__main__":
    main()

"""Context extension of a rope model: a char model trained at block B (`--config shakespeare_char_rope_cpu`,
B = 64), fine-tuned briefly at 4B with `--rope-scaling yarn`, with `linear`, and with no scaling, against the
base model itself on the same 4B-long windows of the val split: cropped to B (each target sees at most the
B tokens before it: a banded causal mask, what the rolling KV cache computes) and uncropped (4B positions,
3B of them never trained at).

    python bench/bench_yarn.py                    # base 800 steps (the config's), fine-tunes 200, windows of 256
    python bench/bench_yarn.py --quick            # base 200 steps, fine-tunes 50: a few minutes
    python bench/bench_yarn.py --smoke            # base 4 steps, fine-tunes 2, 4 windows: checks it runs

1. data: tiny-shakespeare's characters (`data/shakespeare_char/prepare.py`).
2. the base: the config at block B for --base-steps, seed 0.
3. each fine-tune: `--init-from` the base, `--block-size 4B`, the scaling, --steps steps at the config's
   tokens per step (batch 24 / 4), learning rate --lr with a warmup of 10% and the config's decay to --lr / 10.
4. val loss (nats per char) over disjoint 4B-long windows of the val split (--windows of them, 0 = all),
   the whole window, and split by position: the first B targets (context up to B for every model) and the
   3B after them (where only an extended model sees more than B tokens back).

Results: `yarn.json` in `--results` (default bench/results/; `yarn-quick.json` / `yarn-smoke.json`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402

CONFIG = ["--config", "shakespeare_char_rope_cpu"]
QUIET = ["--no-plot", "--log-interval", "50", "--device", "cpu", "--dtype", "float32", "--threads", "1"]
SCALINGS = ("yarn", "linear", "none")  # "none": a longer block with the rotary angles as they were


def train(data: Path, out: Path, flags: list, steps: int) -> None:
    """One `gpt train` run to the end (its log beside `out`)."""
    cmd = [sys.executable, "-m", "gpt", "train", "--data", data, "--out-dir", out, "--force", *QUIET, *flags]
    cmd += ["--max-iters", steps, "--lr-decay-iters", steps, "--eval-interval", steps, "--seed", 0]
    run = harness.launch(cmd, ROOT, out.parent / f"{out.name}.log", timeout=3 * 3600, env={"OMP_NUM_THREADS": "1"})
    if run["returncode"] != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{harness.tail(run)}")


def band(T: int, width: int):
    """Causal attention over the last `width` positions (each query's own included)."""
    import torch

    i = torch.arange(T)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - width)


def losses(model, vocab: int, tokens, length: int, windows: int, crop: int | None, batch: int = 16) -> dict:
    """Mean val loss over disjoint windows of `length` targets: all of them, the first `length // 4`, the
    rest; `crop`: each target sees at most `crop` tokens (the base model cropped to its block). Logits over the
    tokenizer's `vocab` ids (a padded vocabulary's extra rows cut off, as `gpt evaluate` does)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    n = (len(tokens) - 1) // length
    n = min(n, windows) if windows else n
    total = torch.zeros(length, dtype=torch.float64)
    mask = band(length, crop) if crop else None
    with torch.no_grad():
        for s in range(0, n, batch):
            starts = np.arange(s, min(n, s + batch)) * length
            x = torch.from_numpy(np.stack([tokens[i : i + length] for i in starts]).astype(np.int64))
            y = torch.from_numpy(np.stack([tokens[i + 1 : i + 1 + length] for i in starts]).astype(np.int64))
            logits = model.lm_head(model.hidden(x, mask=mask))[..., :vocab]
            nll = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view(y.shape)
            total += nll.double().sum(0)
    per_position = total / n
    first = length // 4
    return {
        "windows": n,
        "loss": round(per_position.mean().item(), 4),
        "loss_first_quarter": round(per_position[:first].mean().item(), 4),
        "loss_rest": round(per_position[first:].mean().item(), 4),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_yarn"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--quick", action="store_true", help="base 200 steps, fine-tunes 50")
    p.add_argument("--smoke", action="store_true", help="base 4 steps, fine-tunes 2, 4 windows: it runs")
    p.add_argument("--base-steps", type=int, default=800, help="the base's steps (the config's 800)")
    p.add_argument("--steps", type=int, default=200, help="each fine-tune's steps")
    p.add_argument("--block", type=int, default=64, help="the base's block B (the config's 64)")
    p.add_argument("--factor", type=float, default=4.0, help="the fine-tunes' block is factor x B")
    p.add_argument("--lr", type=float, default=1e-3, help="the fine-tunes' peak learning rate")
    p.add_argument("--windows", type=int, default=0, help="val windows scored (0 = all)")
    args = p.parse_args(argv)
    if args.quick:
        args.base_steps, args.steps = 200, 50
    if args.smoke:
        args.base_steps, args.steps, args.windows = 4, 2, 4
    from gpt import load_checkpoint
    from gpt.data.tokens import open_dataset

    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "char"
    tiny = harness.SHARED_DATA / "tinyshakespeare.txt"
    cmd = [sys.executable, "data/shakespeare_char/prepare.py", "--input", tiny, "--out", data]
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, capture_output=True)

    B, long = args.block, int(args.block * args.factor)
    base_dir = args.work / "base"
    train(data, base_dir, [*CONFIG, "--block-size", B], args.base_steps)
    tune = ["--batch-size", max(1, round(24 * B / long)), "--learning-rate", args.lr, "--min-lr", args.lr / 10]
    tune += ["--warmup-iters", max(1, args.steps // 10), "--block-size", long, "--init-from", base_dir]
    for scaling in SCALINGS:
        extra = [] if scaling == "none" else ["--rope-scaling", scaling, "--rope-factor", args.factor]
        train(data, args.work / scaling, [*CONFIG, *tune, *extra], args.steps)

    val = open_dataset(data).split("val")
    base, tok, _ = load_checkpoint(base_dir)
    base, vocab = base.float().eval(), tok.vocab_size
    rows = {
        "base_cropped": losses(base, vocab, val, long, args.windows, crop=B),
        "base_uncropped": losses(base, vocab, val, long, args.windows, crop=None),
    }
    for scaling in SCALINGS:
        model = load_checkpoint(args.work / scaling)[0].float().eval()
        rows[f"finetuned_{scaling}"] = losses(model, vocab, val, long, args.windows, crop=None)
        print(f"{scaling}: {rows[f'finetuned_{scaling}']}", flush=True)
    result = {
        "machine": harness.machine(),
        "settings": {
            "config": CONFIG,
            "block": B,
            "long_block": long,
            "factor": args.factor,
            "base_steps": args.base_steps,
            "steps": args.steps,
            "lr": args.lr,
            "windows": args.windows or "all",
            "loss": "nats per char over disjoint long_block windows of the val split; first quarter: targets "
            "0..block-1; rest: the others",
        },
        "rows": rows,
        "yarn_minus_base_cropped": round(rows["finetuned_yarn"]["loss"] - rows["base_cropped"]["loss"], 4),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    name = "yarn-smoke.json" if args.smoke else "yarn-quick.json" if args.quick else "yarn.json"
    (args.results / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Training benchmarks on this machine, each measured side by side in one run.

    python bench/bench_train.py                      # all three; results in bench/results/train.json
    python bench/bench_train.py --only speedrun      # or throughput / finetune

1. speedrun: wall-clock seconds from launching `train.py` to the first evaluation with val loss
   <= 1.88 on char-level tiny-shakespeare (val = last 10%, loss over the whole val split), for the
   shipped `shakespeare_char_cpu` config and for nanoGPT's CPU recipe run through our trainer.
2. throughput: training tokens/s for nanoGPT's CPU recipe model and batch (4x4x128, block 64,
   batch 12), our train step vs a plain eager float32 loop in the same process; peak memory.
3. finetune: a GPT-2-BPE model pretrained on WikiText-2, fine-tuned on tiny-shakespeare, against the
   same model trained from scratch on tiny-shakespeare for the same number of steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GPT_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULTS = ROOT / "bench" / "results" / "train.json"
NANOGPT_CPU = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64", "--batch-size", "12",
               "--max-iters", "2000", "--lr-decay-iters", "2000", "--dropout", "0.0", "--bias", "true",
               "--learning-rate", "1e-3", "--min-lr", "1e-4", "--warmup-iters", "100", "--beta2", "0.99",
               "--eval-interval", "250", "--eval-iters", "0", "--eval-batch-size", "256", "--dtype", "float32"]
TARGET = 1.88


ENV = dict(os.environ, GPT2_TIKTOKEN_FILE=str(SHARED / "gpt2.tiktoken"))  # offline GPT-2 BPE


def sh(*cmd):
    res = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True, env=ENV)
    if res.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{res.stderr[-2000:]}")
    return res


def prepare(tmp: Path) -> dict[str, Path]:
    out = {"char": tmp / "shakespeare_char", "shakespeare": tmp / "shakespeare", "wikitext": tmp / "wikitext"}
    sh("data/prepare.py", SHARED / "tinyshakespeare.txt", "--out", out["char"], "--tokenizer", "char",
       "--block-size", "64")
    sh("data/prepare.py", SHARED / "tinyshakespeare.txt", "--out", out["shakespeare"], "--tokenizer", "gpt2",
       "--block-size", "128")
    sh("data/prepare.py", SHARED / "wikitext2-valid.txt", SHARED / "wikitext2-test.txt", "--out", out["wikitext"],
       "--tokenizer", "gpt2", "--block-size", "128")
    return out


def time_to_target(data: Path, out: Path, args: list[str]) -> dict:
    """Launch train.py and read its log: seconds from launch to the first eval at or under TARGET."""
    t0 = time.time()
    res = subprocess.run([sys.executable, "train.py", "--data", str(data), "--out-dir", str(out), *args,
                          "--target-val-loss", str(TARGET)], cwd=ROOT, capture_output=True, text=True, env=ENV)
    wall = time.time() - t0
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    hit = next((r for r in evals if r["val_loss"] <= TARGET), None)
    steps = [r for r in records if r["kind"] == "train"]
    return {
        "seconds_to_target": round(hit["time"] - t0, 1) if hit else None,
        "step_at_target": hit["step"] if hit else None,
        "val_loss": hit["val_loss"] if hit else evals[-1]["val_loss"],
        "ms_per_step": round(sorted(r["ms_per_step"] for r in steps)[len(steps) // 2], 2),
        "process_seconds": round(wall, 1),
        "evals": [(r["step"], round(r["val_loss"], 4), round(r["time"] - t0, 1)) for r in evals],
    }


def speedrun(data: dict, tmp: Path) -> dict:
    ours = time_to_target(data["char"], tmp / "speedrun", ["--config", "shakespeare_char_cpu"])
    recipe = time_to_target(data["char"], tmp / "nanogpt_recipe", NANOGPT_CPU)
    return {
        "shipped_config": ours,
        "nanogpt_recipe_in_our_trainer": recipe,
        "nanogpt_reference_seconds": 134,  # nanoGPT itself, its published CPU recipe, on this machine (issue)
        "speedup_vs_nanogpt_reference": round(134 / ours["seconds_to_target"], 2) if ours["seconds_to_target"] else None,
        "speedup_vs_recipe_in_our_trainer": (
            round(recipe["seconds_to_target"] / ours["seconds_to_target"], 2)
            if ours["seconds_to_target"] and recipe["seconds_to_target"] else None
        ),
    }


def throughput(steps: int = 60) -> dict:
    """Our train step against a plain eager float32 loop, same model and batches, same process."""
    import torch

    sys.path.insert(0, str(ROOT))
    from gpt.model import GPT, GPTConfig
    from gpt.runtime import Runtime
    from gpt.trainer import make_optimizer, train_step
    from gpt.config import build_config

    cfg = build_config(NANOGPT_CPU)
    mcfg = GPTConfig(vocab_size=128, **cfg.model_kwargs())
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 65, (steps, cfg.batch_size, cfg.block_size), generator=g)
    tokens = steps * cfg.batch_size * cfg.block_size

    def plain():
        model = GPT(mcfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        t0 = time.perf_counter()
        for x in xs:
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return tokens / (time.perf_counter() - t0)

    def ours(dtype):
        model = GPT(mcfg)
        opt = make_optimizer(model, cfg, torch.device("cpu"))
        rt = Runtime(torch.device("cpu"), dtype)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        t0 = time.perf_counter()
        for step in range(steps):
            train_step(model, opt, scaler, lambda s, m: (xs[s], xs[s]), step, 1, rt, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return tokens / (time.perf_counter() - t0)

    plain(), ours(torch.float32)  # warm up both
    result = {"plain_eager_fp32_tok_s": [], "ours_fp32_tok_s": [], "ours_bf16_tok_s": []}
    for _ in range(3):  # interleaved repeats, best of three each
        result["plain_eager_fp32_tok_s"].append(plain())
        result["ours_fp32_tok_s"].append(ours(torch.float32))
        result["ours_bf16_tok_s"].append(ours(torch.bfloat16))
    best = {k: round(max(v)) for k, v in result.items()}
    best["ratio_ours_fp32"] = round(best["ours_fp32_tok_s"] / best["plain_eager_fp32_tok_s"], 2)
    best["ratio_ours_bf16"] = round(best["ours_bf16_tok_s"] / best["plain_eager_fp32_tok_s"], 2)
    best["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return best


def finetune(data: dict, tmp: Path, pretrain_steps: int = 400, steps: int = 200) -> dict:
    """Pretrain on WikiText-2, then fine-tune on tiny-shakespeare vs train on it from scratch."""
    model = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "128", "--batch-size", "8",
             "--dropout", "0.0", "--eval-iters", "40", "--eval-batch-size", "8", "--log-interval", "50",
             "--dtype", "bfloat16"]
    sh("train.py", "--data", data["wikitext"], "--out-dir", tmp / "wiki", *model, "--max-iters", pretrain_steps,
       "--learning-rate", "2e-3", "--min-lr", "2e-4", "--warmup-iters", "30", "--eval-interval", pretrain_steps)
    runs = {}
    for name, extra in {"finetuned": ["--init-from", tmp / "wiki", "--learning-rate", "1e-3"],
                        "scratch": ["--learning-rate", "2e-3"]}.items():
        out = tmp / f"shakes_{name}"
        sh("train.py", "--data", data["shakespeare"], "--out-dir", out, *model, *extra, "--max-iters", steps,
           "--min-lr", "1e-4", "--warmup-iters", "20", "--eval-interval", steps // 4)
        evals = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        runs[name] = [(r["step"], round(r["val_loss"], 4)) for r in evals if r["kind"] == "eval"]
    return {
        "model": "GPT-2 BPE, 4x4x128, block 128, batch 8, bf16",
        "pretrain": f"{pretrain_steps} steps on WikiText-2 valid+test", "finetune_steps": steps,
        "val_loss_by_step": runs,
        "finetuned_minus_scratch": round(runs["finetuned"][-1][1] - runs["scratch"][-1][1], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["speedrun", "throughput", "finetune"])
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads default"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare(tmp) if args.only != "throughput" else {}
        for name, fn in (("speedrun", lambda: speedrun(data, tmp)), ("throughput", throughput),
                         ("finetune", lambda: finetune(data, tmp))):
            if args.only in (None, name):
                t0 = time.time()
                results[name] = fn()
                print(f"{name} ({time.time() - t0:.0f}s): {json.dumps(results[name])}", flush=True)
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")  # after each: a later failure keeps it


if __name__ == "__main__":
    main()

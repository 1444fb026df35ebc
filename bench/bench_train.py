"""Training benchmarks on this machine, each measured side by side in one run.

    python bench/bench_train.py                      # all three; results in bench/results/train.json
    python bench/bench_train.py --only speedrun      # or throughput / finetune

1. speedrun: wall-clock seconds from launching `train.py --config shakespeare_char_cpu` to the first
   evaluation with val loss <= 1.88 on char-level tiny-shakespeare (val = the last 10%, loss over the
   whole val split), and, in the same run, nanoGPT's own train.py with its README's CPU recipe (4x4x128,
   block 64, batch 12, 2000 steps, its own evaluation on 20 random batches) from a scratch copy of
   `../shared/baselines/nanoGPT`: the time to its first evaluation <= 1.88, or to its last one.
2. throughput: training tokens/s for nanoGPT's CPU recipe model and batch (4x4x128, block 64,
   batch 12): our train step against a plain eager float32 loop in the same process, float32 (and
   bf16 where the CPU has native bf16); peak memory.
3. finetune: a GPT-2-BPE model pretrained on WikiText-2, fine-tuned on tiny-shakespeare, against the
   same model trained from scratch on tiny-shakespeare for the same number of steps.

Every result records the machine (CPU model, AVX2 / AVX-512 / native bf16, threads, torch, load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: E402 (bench/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GPT_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULTS = ROOT / "bench" / "results" / "train.json"
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
               "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
               "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]  # its README's line
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
    """Launch our train.py and read its log: seconds from launch to the first eval at or under TARGET."""
    run = harness.launch([sys.executable, "train.py", "--data", data, "--out-dir", out, *args,
                          "--target-val-loss", TARGET], ROOT, out.with_suffix(".log"), timeout=900, env=ENV)
    if run["returncode"]:
        raise RuntimeError(harness.tail(run))
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    hit = next((r for r in evals if r["val_loss"] <= TARGET), None)
    steps = [r for r in records if r["kind"] == "train"]
    return {
        "seconds_to_target": round(hit["time"] - run["t0"], 1) if hit else None,
        "step_at_target": hit["step"] if hit else None,
        "val_loss": hit["val_loss"] if hit else evals[-1]["val_loss"],
        "ms_per_step": round(sorted(r["ms_per_step"] for r in steps)[len(steps) // 2], 2),
        "process_seconds": round(run["seconds"], 1),
        "evals": [(r["step"], round(r["val_loss"], 4), round(r["time"] - run["t0"], 1)) for r in evals],
    }


def nanogpt_time_to_target(nano: Path, tmp: Path) -> dict:
    """nanoGPT's own train.py and CPU recipe: its evaluations (20 random batches per split) with the time
    since launch; the first at or under TARGET, else its best."""
    found = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
    run = harness.launch([sys.executable, "train.py", *NANOGPT_CPU, f"--out_dir={tmp / 'nano_out'}"], nano,
                         tmp / "nanogpt.log", timeout=900, env=ENV,
                         stop_when=lambda line: bool(m := found.search(line)) and float(m[3]) <= TARGET)
    evals = [(int(m[1]), float(m[3]), round(t, 1)) for t, line in run["lines"] if (m := found.search(line))]
    iters = [(t, int(m[1])) for t, line in run["lines"] if (m := re.match(r"iter (\d+):", line))]
    per_iter = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(iters, iters[1:]) if b[1] > a[1] > 10]
    hit = next((e for e in evals if e[1] <= TARGET), None)
    best = min(evals, key=lambda e: e[1]) if evals else None
    return {
        "seconds_to_target": hit[2] if hit else None, "step_at_target": hit[0] if hit else None,
        "best_val_loss": best[1] if best else None, "seconds_to_best": best[2] if best else None,
        "seconds_to_last_eval": evals[-1][2] if evals else None,
        "ms_per_step": round(1e3 * sorted(per_iter)[len(per_iter) // 2], 2) if per_iter else None,
        "process_seconds": round(run["seconds"], 1), "evals": evals,
    }


def speedrun(data: dict, tmp: Path) -> dict:
    ours = time_to_target(data["char"], tmp / "speedrun", ["--config", "shakespeare_char_cpu"])
    nano = nanogpt_time_to_target(harness.nanogpt_copy(tmp), tmp)
    theirs = nano["seconds_to_target"] or nano["seconds_to_last_eval"]  # it may never reach the target
    return {
        "shipped_config": ours, "nanogpt": nano,
        "speedup_vs_nanogpt": round(theirs / ours["seconds_to_target"], 2) if ours["seconds_to_target"] else None,
        "nanogpt_reached_target": nano["seconds_to_target"] is not None,
    }


def throughput(steps: int = 60) -> dict:
    """Our train step against a plain eager float32 loop, same model and batches, same process."""
    import torch

    sys.path.insert(0, str(ROOT))
    from gpt.config import GPTConfig, TrainConfig
    from gpt.model import GPT
    from gpt.runtime import Runtime, cpu_has_native_bf16
    from gpt.trainer import make_optimizer, train_step

    cfg = TrainConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, dropout=0.0, bias=False)
    mcfg = GPTConfig(vocab_size=128, **cfg.model_kwargs())  # nanoGPT's CPU recipe model, 65 chars padded
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
    dtypes = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if cpu_has_native_bf16() else {})}
    result = {"plain_eager_fp32_tok_s": [], **{f"ours_{k}_tok_s": [] for k in dtypes}}
    for _ in range(3):  # interleaved repeats, best of three each
        result["plain_eager_fp32_tok_s"].append(plain())
        for name, dtype in dtypes.items():
            result[f"ours_{name}_tok_s"].append(ours(dtype))
    best = {k: round(max(v)) for k, v in result.items()}
    for name in dtypes:
        best[f"ratio_ours_{name}"] = round(best[f"ours_{name}_tok_s"] / best["plain_eager_fp32_tok_s"], 2)
    if "bf16" not in dtypes:
        best["bf16"] = "not measured: this CPU has no native bf16 (emulated bf16 is many times slower)"
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
    results.pop("machine", None)  # each section records its own
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare(tmp) if args.only != "throughput" else {}
        for name, fn in (("speedrun", lambda: speedrun(data, tmp)), ("throughput", throughput),
                         ("finetune", lambda: finetune(data, tmp))):
            if args.only in (None, name):
                t0 = time.time()
                load_before = harness.machine()["load_avg"]
                results[name] = dict(fn(), machine=dict(harness.machine(), load_avg_before=load_before))
                print(f"{name} ({time.time() - t0:.0f}s): {json.dumps(results[name])}", flush=True)
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")  # after each: a later failure keeps it


if __name__ == "__main__":
    main()

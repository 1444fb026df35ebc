"""Training benchmarks on this machine, each measured side by side in one run.

    python bench/bench_train.py                      # all three; results in bench/results/train.json
    python bench/bench_train.py --only speedrun      # or throughput / finetune / precision

1. speedrun: wall-clock seconds from launching `train.py --config shakespeare_char_cpu` to the first
   evaluation with val loss <= 1.88 on char-level tiny-shakespeare (val = the last 10%, loss over the
   whole val split), and, in the same run, nanoGPT's own train.py with its README's CPU recipe (4x4x128,
   block 64, batch 12, 2000 steps, its own evaluation on 20 random batches) from a scratch copy of
   `../shared/baselines/nanoGPT`: the time to its first evaluation <= 1.88, or to its last one.
2. throughput: training tokens/s for nanoGPT's CPU recipe model and batch (4x4x128, block 64,
   batch 12): our train step against a plain eager float32 loop in the same process, float32 eager
   and with --compile (and bf16 where the CPU has native bf16); peak memory.
3. finetune: a GPT-2-BPE model pretrained on WikiText-2, then trained on tiny-shakespeare for the same
   steps: full fine-tuning, LoRA (--lora-rank, the tied embedding included), LoRA on the blocks'
   projections only, and from scratch. Val loss, trainable parameters, checkpoint size, step time and
   peak memory (RSS of each training process) side by side.
4. likeforlike: nanoGPT's own model and settings (4x4x128, block 64, batch 12, AdamW at lr 1e-3, GPT-2's
   tanh GELU, biases, dropout 0, float32, no compile) trained for the same steps by nanoGPT's train.py and by
   ours (`GPT_CPU_BF16=0`: float32 whatever the CPU): the same work, so ms per step compares the loops, not
   the recipes; interleaved repeats, medians with min and max.
5. precision (a CPU with native bf16, or GPT_CPU_BF16=1; `OMP_NUM_THREADS=1` on a shared CPU): ms per
   step of the main job's training step
   (`--config shakespeare_char_cpu`: model, batch, Muon + AdamW) in float32, as on a CPU without
   native bf16 (GPT_CPU_BF16=0: float32 Newton-Schulz too), and in what `--dtype auto` picks with it
   (bf16 autocast and bf16 Newton-Schulz), interleaved in one process, medians.

Every result records the machine (CPU model, AVX2 / AVX-512 / native bf16, threads, torch, load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gpt.runtime import cpu_description, cpu_has_native_bf16  # noqa: E402

SHARED = harness.SHARED_DATA
RESULTS = ROOT / "bench" / "results" / "train.json"
NANOGPT_CPU = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]  # its README's line
TARGET = 1.88


ENV = dict(os.environ)  # (GPT2_TIKTOKEN_FILE set by harness where the shared copy exists)


def sh(*cmd):
    res = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True, env=ENV)
    if res.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{res.stderr[-2000:]}")
    return res


def prepare(tmp: Path) -> dict[str, Path]:
    """tiny-shakespeare in characters; a 4096-id BPE trained on WikiText-2 and tiny-shakespeare encoded with
    that same vocabulary (--tokenizer-from), so a WikiText model can be fine-tuned on it."""
    out = {"char": tmp / "shakespeare_char", "shakespeare": tmp / "shakespeare", "wikitext": tmp / "wikitext"}
    sh(
        "data/prepare.py",
        SHARED / "tinyshakespeare.txt",
        "--out",
        out["char"],
        "--tokenizer",
        "char",
        "--block-size",
        "64",
    )
    sh(
        "data/prepare.py",
        SHARED / "wikitext2-valid.txt",
        SHARED / "wikitext2-test.txt",
        "--out",
        out["wikitext"],
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "4096",
        "--block-size",
        "64",
    )
    sh(
        "data/prepare.py",
        SHARED / "tinyshakespeare.txt",
        "--out",
        out["shakespeare"],
        "--tokenizer-from",
        out["wikitext"],
        "--block-size",
        "64",
    )
    return out


def time_to_target(data: Path, out: Path, args: list[str]) -> dict:
    """Launch our train.py and read its log: seconds from launch to the first eval at or under TARGET."""
    run = harness.launch(
        [sys.executable, "train.py", "--data", data, "--out-dir", out, *args, "--target-val-loss", TARGET],
        ROOT,
        out.with_suffix(".log"),
        timeout=900,
        env=ENV,
    )
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
    run = harness.launch(
        [sys.executable, "train.py", *NANOGPT_CPU, f"--out_dir={tmp / 'nano_out'}"],
        nano,
        tmp / "nanogpt.log",
        timeout=900,
        env=ENV,
        stop_when=lambda line: bool(m := found.search(line)) and float(m[3]) <= TARGET,
    )
    evals = [(int(m[1]), float(m[3]), round(t, 1)) for t, line in run["lines"] if (m := found.search(line))]
    iters = [(t, int(m[1])) for t, line in run["lines"] if (m := re.match(r"iter (\d+):", line))]
    per_iter = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(iters, iters[1:]) if b[1] > a[1] > 10]
    hit = next((e for e in evals if e[1] <= TARGET), None)
    best = min(evals, key=lambda e: e[1]) if evals else None
    return {
        "seconds_to_target": hit[2] if hit else None,
        "step_at_target": hit[0] if hit else None,
        "best_val_loss": best[1] if best else None,
        "seconds_to_best": best[2] if best else None,
        "seconds_to_last_eval": evals[-1][2] if evals else None,
        "ms_per_step": round(1e3 * sorted(per_iter)[len(per_iter) // 2], 2) if per_iter else None,
        "process_seconds": round(run["seconds"], 1),
        "evals": evals,
    }


def speedrun(data: dict, tmp: Path, repeats: int = 2) -> dict:
    """Ours and nanoGPT's, interleaved `repeats` times (this VM's speed drifts by +-15% within minutes);
    the speed-up compares the medians."""
    nano_dir = harness.nanogpt_copy(tmp)
    ours, nano = [], []
    for i in range(repeats):
        ours.append(time_to_target(data["char"], tmp / f"speedrun{i}", ["--config", "shakespeare_char_cpu"]))
        (tmp / f"nano{i}").mkdir()
        nano.append(nanogpt_time_to_target(nano_dir, tmp / f"nano{i}"))

    def median(runs, key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if len(values) == len(runs) else None

    theirs = median(nano, "seconds_to_target") or median(nano, "seconds_to_last_eval")  # it may never reach it
    mine = median(ours, "seconds_to_target")
    return {
        "shipped_config": ours,
        "nanogpt": nano,
        "ours_median_seconds": mine,
        "nanogpt_median_seconds": theirs,
        "speedup_vs_nanogpt": round(theirs / mine, 2) if mine else None,
        "nanogpt_reached_target": all(r["seconds_to_target"] is not None for r in nano),
    }


def likeforlike(data: dict, tmp: Path, steps: int = 300, repeats: int = 3) -> dict:
    """nanoGPT's model and settings trained `steps` steps by its train.py and by ours, interleaved: ms per step
    (the median of each run's steps after the first 10) and each run's last val loss."""
    nano_dir = harness.nanogpt_copy(tmp)
    nano_args = [a for a in NANOGPT_CPU if not a.startswith(("--max_iters", "--lr_decay_iters"))]
    nano_args += [f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps}"]
    shape = ["--n-layer", 4, "--n-head", 4, "--n-embd", 128, "--block-size", 64, "--batch-size", 12, "--dropout", 0]
    ours_args = [*shape, "--optimizer", "adamw", "--learning-rate", 1e-3, "--min-lr", 1e-4, "--warmup-iters", 100]
    ours_args += ["--max-iters", steps, "--lr-decay-iters", steps, "--eval-interval", steps, "--eval-iters", 20]
    ours_args += ["--log-interval", 1, "--dtype", "float32", "--activation", "gelu_tanh"]
    ours, nano = [], []
    for i in range(repeats):
        out = tmp / f"lfl{i}"
        run = harness.launch(
            [sys.executable, "train.py", "--data", data["char"], "--out-dir", out, *ours_args],
            ROOT,
            out.with_suffix(".log"),
            timeout=900,
            env={**ENV, "GPT_CPU_BF16": "0"},
        )
        if run["returncode"]:
            raise RuntimeError(harness.tail(run))
        records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        ms = [r["ms_per_step"] for r in records if r["kind"] == "train" and r["step"] > 10]
        val = [r["val_loss"] for r in records if r["kind"] == "eval"][-1]
        ours.append({"ms_per_step": statistics.median(ms), "val_loss": val, "process_seconds": run["seconds"]})
        (tmp / f"lflnano{i}").mkdir()
        found = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
        run = harness.launch(
            [sys.executable, "train.py", *nano_args, f"--out_dir={tmp / f'lflnano{i}' / 'out'}"],
            nano_dir,
            tmp / f"lflnano{i}.log",
            timeout=900,
            env=ENV,
        )
        timed = [re.match(r"iter (\d+): .*time ([\d.]+)ms", line) for _, line in run["lines"]]
        steps_ms = [float(m[2]) for m in timed if m and int(m[1]) > 10]
        evals = [float(m[3]) for _, line in run["lines"] if (m := found.search(line))]
        nano.append(
            {"ms_per_step": statistics.median(steps_ms), "val_loss": evals[-1], "process_seconds": run["seconds"]}
        )
        print(f"likeforlike {i}: ours {ours[-1]}, nanoGPT {nano[-1]}", file=sys.stderr)
    return {
        "steps": steps,
        "repeats": repeats,
        "model": "nanoGPT's CPU recipe model: 4x4x128, block 64, batch 12, AdamW lr 1e-3, tanh GELU, biases, float32",
        "ours": ours,
        "nanogpt": nano,
        "ours_ms_per_step": harness.spread(r["ms_per_step"] for r in ours),
        "nanogpt_ms_per_step": harness.spread(r["ms_per_step"] for r in nano),
        "speedup": harness.spread(n["ms_per_step"] / o["ms_per_step"] for o, n in zip(ours, nano)),
    }


def throughput(steps: int = 60) -> dict:
    """Our train step against a plain eager float32 loop, same model and batches, same process."""
    import torch

    sys.path.insert(0, str(ROOT))
    from dataclasses import replace

    from gpt.model.config import GPTConfig
    from gpt.model.transformer import GPT
    from gpt.runtime import Runtime, cpu_has_native_bf16
    from gpt.train.config import TrainConfig
    from gpt.train.parallel import compile_options
    from gpt.train.step import make_optimizer, train_step

    cfg = TrainConfig(
        model=GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, bias=False), batch_size=12
    )
    mcfg = replace(cfg.model, vocab_size=128)  # nanoGPT's CPU recipe model, 65 chars padded
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 65, (steps, cfg.batch_size, cfg.model.block_size), generator=g)
    tokens = steps * cfg.batch_size * cfg.model.block_size

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

    def ours(dtype, compiled=False):
        model = GPT(mcfg)
        opt = make_optimizer(model, cfg.optimizer_config(), torch.device("cpu"))
        rt = Runtime(torch.device("cpu"), dtype, compiled=compiled)
        step_model = torch.compile(model, options=compile_options(rt.device)) if compiled else model
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        t0 = time.perf_counter()
        for step in range(steps):
            train_step(step_model, opt, scaler, lambda s, m: (xs[s], xs[s]), step, 1, rt, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return tokens / (time.perf_counter() - t0)

    plain(), ours(torch.float32)  # warm up
    t0 = time.perf_counter()
    ours(torch.float32, compiled=True)  # compiles once; later models reuse the compiled code
    compile_s = time.perf_counter() - t0
    runs = {
        "fp32": (torch.float32, False),
        "fp32_compiled": (torch.float32, True),
        **({"bf16": (torch.bfloat16, False)} if cpu_has_native_bf16() else {}),
    }
    result = {"plain_eager_fp32_tok_s": [], **{f"ours_{k}_tok_s": [] for k in runs}}
    for _ in range(5):  # interleaved repeats, the median of five each (this VM's speed drifts)
        result["plain_eager_fp32_tok_s"].append(plain())
        for name, (dtype, compiled) in runs.items():
            result[f"ours_{name}_tok_s"].append(ours(dtype, compiled))
    medians = {k: round(statistics.median(v)) for k, v in result.items()}
    for name in runs:
        medians[f"ratio_ours_{name}"] = round(medians[f"ours_{name}_tok_s"] / medians["plain_eager_fp32_tok_s"], 2)
    medians["first_compiled_run_s"] = round(compile_s, 1)
    if "bf16" not in runs:
        medians["bf16"] = "not measured: this CPU has no native bf16 (emulated bf16 is many times slower)"
    medians["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return medians


def precision(steps: int = 30, repeats: int = 5) -> dict:
    """The main job's step in float32 and in bf16 (see the module notes), interleaved, medians."""
    from dataclasses import replace

    import torch

    from gpt.model.transformer import GPT
    from gpt.runtime import BF16_OVERRIDE, Runtime
    from gpt.train.start import resolve_run
    from gpt.train.step import make_optimizer, train_step

    cfg = resolve_run(["--config", "shakespeare_char_cpu", "--data", "unused"]).cfg
    mcfg = replace(cfg.model, vocab_size=128)  # 65 chars padded
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 65, (steps + 3, cfg.batch_size, cfg.model.block_size), generator=g)
    before = os.environ.get(BF16_OVERRIDE)

    def ms_per_step(dtype) -> float:
        os.environ[BF16_OVERRIDE] = "1" if dtype == torch.bfloat16 else "0"  # Muon's Newton-Schulz follows it
        torch.manual_seed(0)
        model = GPT(mcfg)
        opt = make_optimizer(model, cfg.optimizer_config(), torch.device("cpu"))
        rt = Runtime(torch.device("cpu"), dtype)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for step in range(steps + 3):
            if step == 3:  # after warm-up
                t0 = time.perf_counter()
            train_step(model, opt, scaler, lambda s, m: (xs[s], xs[s]), step, 1, rt, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return 1000 * (time.perf_counter() - t0) / steps

    times = {"float32": [], "bfloat16": []}
    try:
        for i in range(repeats):
            for name in ("float32", "bfloat16") if i % 2 == 0 else ("bfloat16", "float32"):
                times[name].append(ms_per_step(getattr(torch, name)))
    finally:
        os.environ.pop(BF16_OVERRIDE, None) if before is None else os.environ.__setitem__(BF16_OVERRIDE, before)
    ratios = [f / b for f, b in zip(times["float32"], times["bfloat16"])]
    return {
        "ms_per_step_float32": round(statistics.median(times["float32"]), 1),
        "ms_per_step_bfloat16": round(statistics.median(times["bfloat16"]), 1),
        "bf16_speedup": round(statistics.median(ratios), 2),
        "steps": steps,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "all": {k: [round(x, 1) for x in v] for k, v in times.items()},
    }


MEASURED = (
    "import resource, runpy, sys\nsys.argv = ['train.py', *sys.argv[1:]]\ntry:\n"
    "    runpy.run_path('train.py', run_name='__main__')\nfinally:\n"
    "    print('peak_rss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
)
LORA = [
    "--lora-rank",
    "4",
    "--lora-alpha",
    "8",
    "--learning-rate",
    "1e-2",
    "--lora-targets",
    "attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj,wte",
]  # wte: token frequencies move (see bench/README.md, "Fine-tuning")


def finetune_run(out: Path, args: list) -> dict:
    """Train in a process of its own; its log, checkpoint and peak memory."""
    import torch

    res = sh("-c", MEASURED, "--out-dir", out, *args)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r["ms_per_step"] for r in records if r["kind"] == "train" and r["step"] > 1]
    total, trained = (
        int(n.replace(",", ""))
        for n in re.search(r"preflight: ([\d,]+) parameters, ([\d,]+) trained", res.stdout).groups()
    )
    weights = torch.load(out / "last.pt", weights_only=True, mmap=True)["model"]
    return {
        "val_loss_by_step": [(r["step"], round(r["val_loss"], 4)) for r in records if r["kind"] == "eval"],
        "params": total,
        "trainable_params": trained,
        "checkpoint_mb": round((out / "last.pt").stat().st_size / 1e6, 3),
        "weights_mb": round(
            sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weights.values()}.values())
            / 1e6,
            3,
        ),
        "ms_per_step": round(statistics.median(steps), 1),
        "peak_rss_mb": round(int(re.search(r"peak_rss_kb (\d+)", res.stderr)[1]) / 1024),
        "estimated_mb": re.search(r"estimated memory per process .* = (.+)", res.stdout)[1],
    }


def step_times(base: Path, data: Path, steps: int = 20, repeats: int = 3) -> dict:
    """ms per training step (forward, backward, AdamW) of full fine-tuning and the LoRA variants on the same
    model and batches, interleaved in one process, best of `repeats`, one thread: separate runs on a shared
    CPU see different loads."""
    import torch

    from gpt.checkpoints import loader
    from gpt.data.tokens import Batches, open_dataset
    from gpt.model import lora
    from gpt.runtime import Runtime
    from gpt.train.flags import build_config
    from gpt.train.step import make_optimizer, train_step

    torch.set_num_threads(1)
    cfg = build_config(["--batch-size", "8", "--block-size", "64"])
    batches = Batches(open_dataset(data).split("train"), 64, 8, seed=0)
    rt = Runtime(torch.device("cpu"), torch.float32)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    targets = LORA[LORA.index("--lora-targets") + 1].split(",")
    variants = {"full": None, "lora": targets, "lora_projections_only": targets[:4]}
    built = {}
    for name, adapt in variants.items():
        model, _ = loader.load_model(base)
        if adapt:
            lora.apply(model, lora.LoRAConfig(int(LORA[1]), float(LORA[3]), targets=adapt))
        built[name] = (model.train(), make_optimizer(model, cfg.optimizer_config(), rt.device))
    best = {name: float("inf") for name in variants}
    for _ in range(repeats):
        for name, (model, opt) in built.items():
            t0 = time.perf_counter()
            for step in range(steps):
                train_step(model, opt, scaler, lambda s, m: batches.get(s), step, 1, rt, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            best[name] = min(best[name], (time.perf_counter() - t0) / steps * 1e3)
    return {name: round(ms, 1) for name, ms in best.items()}


def finetune(data: dict, tmp: Path, pretrain_steps: int = 300, steps: int = 160) -> dict:
    """Pretrain on WikiText-2, then on tiny-shakespeare: full fine-tuning vs LoRA vs from scratch."""
    model = [
        "--n-layer",
        "4",
        "--n-head",
        "4",
        "--n-embd",
        "128",
        "--block-size",
        "64",
        "--batch-size",
        "8",
        "--dropout",
        "0.0",
        "--eval-iters",
        "8",
        "--eval-batch-size",
        "16",
        "--log-interval",
        "10",
        "--dtype",
        "auto",
        "--threads",
        "1",
    ]
    sh(
        "train.py",
        "--data",
        data["wikitext"],
        "--out-dir",
        tmp / "wiki",
        *model,
        "--max-iters",
        pretrain_steps,
        "--learning-rate",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--warmup-iters",
        "20",
        "--eval-interval",
        pretrain_steps,
    )
    load = [os.getloadavg()[0]]
    runs = {}
    for name, extra in {
        "full": ["--init-from", tmp / "wiki", "--learning-rate", "1e-3"],
        "lora": ["--init-from", tmp / "wiki", *LORA],
        "lora_projections_only": ["--init-from", tmp / "wiki", *LORA[:-2]],
        "scratch": ["--learning-rate", "2e-3"],
    }.items():
        runs[name] = finetune_run(
            tmp / f"shakes_{name}",
            [
                "--data",
                data["shakespeare"],
                *model,
                *extra,
                "--max-iters",
                steps,
                "--min-lr",
                "1e-4",
                "--warmup-iters",
                "10",
                "--eval-interval",
                steps // 2,
            ],
        )
        print(f"finetune {name}: {json.dumps(runs[name])}", flush=True)
        load.append(os.getloadavg()[0])
    interleaved = step_times(tmp / "wiki" / "best.pt", data["shakespeare"])
    full, lora = runs["full"], runs["lora"]
    val = {name: run["val_loss_by_step"][-1][1] for name, run in runs.items()}
    return {
        "model": "BPE 4096 (trained on WikiText-2), 4x4x128, block 64, batch 8, --dtype auto",
        "cpu": f"{cpu_description()}, {os.cpu_count()} cores",
        "load_average_1min": load,
        "pretrain": f"{pretrain_steps} steps on WikiText-2 valid+test",
        "finetune_steps": steps,
        "lora_settings": " ".join(LORA),
        "runs": runs,
        "finetuned_minus_scratch": round(val["full"] - val["scratch"], 4),
        "lora_minus_full": round(val["lora"] - val["full"], 4),
        "lora_trainable_fraction": round(lora["trainable_params"] / lora["params"], 4),
        "lora_checkpoint_ratio": round(lora["checkpoint_mb"] / full["checkpoint_mb"], 4),
        "lora_weights_ratio": round(lora["weights_mb"] / full["weights_mb"], 4),
        "interleaved_ms_per_step": interleaved,
        "lora_step_time_ratio": round(interleaved["lora"] / interleaved["full"], 3),
        "goal_met": (
            val["lora"] - val["full"] <= 0.1
            and lora["trainable_params"] < 0.05 * lora["params"]
            and lora["checkpoint_mb"] < 0.1 * full["checkpoint_mb"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["speedrun", "throughput", "finetune", "likeforlike", "precision"])
    parser.add_argument("--pretrain-steps", type=int, default=300, help="finetune: WikiText-2 steps (default: 300)")
    parser.add_argument("--finetune-steps", type=int, default=160, help="finetune: steps of each run (default: 160)")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.pop("machine", None)  # each section records its own
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare(tmp) if args.only not in ("throughput", "precision") else {}
        for name, fn in (
            ("speedrun", lambda: speedrun(data, tmp)),
            ("throughput", throughput),
            ("finetune", lambda: finetune(data, tmp, args.pretrain_steps, args.finetune_steps)),
            ("likeforlike", lambda: likeforlike(data, tmp)),
            ("precision", precision),
        ):
            if args.only == name or (args.only is None and (name != "precision" or cpu_has_native_bf16())):
                t0 = time.time()
                load_before = harness.machine()["load_avg"]
                results[name] = dict(fn(), machine=dict(harness.machine(), load_avg_before=load_before))
                print(f"{name} ({time.time() - t0:.0f}s): {json.dumps(results[name])}", flush=True)
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")  # after each: a later failure keeps it


if __name__ == "__main__":
    main()

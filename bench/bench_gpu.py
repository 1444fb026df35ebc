"""GPU benchmarks and the CUDA test run, in one command; nanoGPT's own code timed beside ours.

    python bench/bench_gpu.py                          # every section below (~15 min on one H100)
    python bench/bench_gpu.py --only env,gpt2          # some sections; the others keep their results
    python bench/bench_gpu.py --shared ../shared --out /tmp/gpu-logs

Results go to bench/results/gpu.json (merged section by section, so sections can run in separate
calls; each records when and on which device it ran) and a summary table to bench/results/gpu.md.
Logs of every process go to --out. nanoGPT runs from a scratch copy of `<shared>/baselines/nanoGPT`
(nothing of it is imported here or copied into the project).

Sections
- env: GPU, driver, CUDA, torch, CPU; a bf16 8192^3 matmul as the measured matrix ceiling.
- tests: the README's test command (`python -m pytest -q`) with CUDA visible, CUDA-only tests included.
- gpt2: GPT-2 124M (12 x 12 x 768, block 1024, vocab 50304, bf16 autocast, torch.compile, flash
  attention, fused AdamW) training tokens/s and MFU against the H100's dense bf16 peak (989 TFLOP/s):
  our train.py and nanoGPT's train.py with the same model, micro-batch, context and accumulation,
  then ours at larger micro-batches. Tokens/s are the median over steps after compilation; peak
  GPU memory is polled with nvidia-smi (the process's whole use, allocator cache included), and
  ours also reports torch's max_memory_allocated.
- shakespeare: wall time from launching train.py to the first evaluation with val loss <= 1.47 on
  char-level tiny-shakespeare (val = the last 10% of the text), our shipped `shakespeare_char_gpu`
  config vs nanoGPT's `config/train_shakespeare_char.py`, each alone on the GPU. Ours evaluates on
  the whole val split; nanoGPT on its 200 random batches.
- sampling: GPT-2 124M-sized random weights in bf16, greedy, batch 1 and 16, 256 new tokens after a
  16-token prompt: our `generate` (eager steps, and CUDA-graph steps) against transformers'
  `GPT2LMHeadModel.generate` on the same weights exported with `gpt.checkpoints.hf.export_hf`.
- sweep: (recipe search, not part of the default run) several shakespeare-char recipes trained at
  once on the GPU to compare val loss against steps; its timings are not meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
from harness import tail

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
H100_PEAK = 989e12  # dense bf16 FLOP/s, the datasheet figure the MFU is quoted against
TARGET = 1.47
SECTIONS = ("env", "tests", "gpt2", "shakespeare", "sampling")
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)


def log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def median(xs):
    return statistics.median(xs) if xs else None


# ---- processes, timestamped -----------------------------------------------------------------------


class GpuMemory:
    """Polls nvidia-smi's memory.used while a process runs: the peak above what was in use before."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.peak, self.base = interval, 0, self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _used() -> int:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            return sum(int(x) for x in out.split())  # MiB
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return 0

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._used() - self.base)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak_gib(self) -> float:
        return round(self.peak / 1024, 2)


def launch(cmd: list, cwd: Path, log_path: Path, timeout: float, stop_when=None, env=None) -> dict:
    """harness.launch, with the GPU memory the run used (nvidia-smi's view, above what was in use before)."""
    with GpuMemory() as mem:
        run = harness.launch(cmd, cwd, log_path, timeout, stop_when, env)
    return dict(run, gpu_mem_gib=mem.peak_gib)


def records(out_dir: Path, kind: str) -> list[dict]:
    path = out_dir / "log.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


# ---- data -----------------------------------------------------------------------------------------


def prepare_data(shared: Path, work: Path) -> dict[str, Path]:
    """Char-level tiny-shakespeare and a GPT-2-BPE corpus (tiny-shakespeare + WikiText-2) for throughput."""
    data = shared / "data"
    env = dict(os.environ, GPT2_TIKTOKEN_FILE=str(data / "gpt2.tiktoken"))
    out = {"char": work / "shakespeare_char", "gpt2": work / "gpt2_corpus"}
    for args in (
        [data / "tinyshakespeare.txt", "--out", out["char"], "--tokenizer", "char", "--block-size", "256"],
        [
            data / "tinyshakespeare.txt",
            data / "wikitext2-valid.txt",
            data / "wikitext2-test.txt",
            "--out",
            out["gpt2"],
            "--tokenizer",
            "gpt2",
            "--val-fraction",
            "0.34",
        ],
    ):
        subprocess.run(
            [sys.executable, "data/prepare.py", *map(str, args), "--force", "--quiet"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
    return out


def nanogpt_copy(shared: Path, work: Path, data: dict[str, Path]) -> Path:
    """harness.nanogpt_copy, plus our GPT-2 ids (uint16, like its openwebtext files) as its `gpt2bench`."""
    dst = harness.nanogpt_copy(work, shared)
    bench = dst / "data" / "gpt2bench"
    bench.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        shutil.copy(data["gpt2"] / f"{split}.bin", bench / f"{split}.bin")
    return dst


# ---- sections -------------------------------------------------------------------------------------


def section_env(args) -> dict:
    import torch

    def sh(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    props = torch.cuda.get_device_properties(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    lscpu = sh("lscpu")
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "sm_count": props.multi_processor_count,
        "driver": sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "bf16_matmul_8192_tflops": round(2 * 8192**3 / statistics.median(times) / 1e12, 1),
        "peak_bf16_tflops_datasheet": H100_PEAK / 1e12,
    }


def section_tests(args) -> dict:
    timeout = max(60, min(args.tests_timeout, args.deadline - time.time()))
    run = launch(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"],
        ROOT,
        args.out / "tests.log",
        timeout=timeout,
        env={"GPT_SHARED_DATA": str(args.shared / "data")},
    )
    text = [line for _, line in run["lines"]]
    summary = next((ln for ln in reversed(text) if re.search(r"\d+ (passed|failed)", ln)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    return {
        "command": "python -m pytest -q",
        "returncode": run["returncode"],
        "seconds": round(run["seconds"], 1),
        "timed_out": run["timed_out"],
        "summary": summary.strip("= "),
        **counts,
        "failures": [ln for ln in text if ln.startswith(("FAILED", "ERROR"))][:30],
        "skipped": [ln for ln in text if ln.startswith("SKIPPED")][:30],
        "cuda_tests": [ln for ln in text if "test_cuda" in ln][:30],
    }


def flops_per_token(cfg: dict) -> float:
    """6N + 12 L T C, N without the position table (the head is tied to wte): GPT.flops_per_token."""
    import torch

    from gpt.model.transformer import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**cfg, bias=True))
    return model.flops_per_token()


def ours_gpt2(args, data: Path, batch: int, accum: int, steps: int, name: str, extra=(), env=None) -> dict:
    out = args.work / f"gpt2_{name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        "gpt2_124m",
        "--data",
        data,
        "--out-dir",
        out,
        "--batch-size",
        batch,
        "--grad-accum",
        accum,
        "--max-iters",
        steps,
        "--warmup-iters",
        10,
        "--log-interval",
        1,
        "--eval-interval",
        10**6,
        "--eval-iters",
        1,
        *extra,
        *args.ours_args,
    ]
    run = launch(cmd, ROOT, args.out / f"gpt2_{name}.log", timeout=args.step_timeout, env=env)
    steps_ = records(out, "train")
    warm = [r for r in steps_ if r["step"] > args.skip_steps]
    if run["returncode"] or not warm:
        return {"error": tail(run), "returncode": run["returncode"]}
    tok_s = median([r["tokens_per_s"] for r in warm])
    return {
        "run": "ours: train.py --config gpt2_124m",
        "micro_batch": batch,
        "grad_accum": accum,
        "tokens_per_step": batch * accum * GPT2["block_size"],
        "steps_timed": len(warm),
        "tokens_per_s": round(tok_s),
        "ms_per_step": round(median([r["ms_per_step"] for r in warm]), 1),
        "mfu": round(args.fpt * tok_s / H100_PEAK, 4),
        "peak_mem_allocated_gib": round(max(r.get("peak_mem_gib") or 0 for r in warm), 2),
        "gpu_mem_used_gib": run["gpu_mem_gib"],
        "process_seconds": round(run["seconds"], 1),
        "first_step_seconds": round(steps_[0]["elapsed"], 1) if steps_ else None,
        "extra_args": list(map(str, extra)),
        "env": env or {},
    }


def nanogpt_gpt2(args, nano: Path, batch: int, accum: int, steps: int) -> dict:
    cmd = [
        sys.executable,
        "train.py",
        "--dataset=gpt2bench",
        f"--batch_size={batch}",
        "--block_size=1024",
        f"--gradient_accumulation_steps={accum}",
        f"--max_iters={steps}",
        "--eval_interval=1000000",
        "--eval_iters=1",
        "--log_interval=1",
        "--compile=True",
        "--bias=True",
        "--dtype=bfloat16",
        "--always_save_checkpoint=False",
        "--warmup_iters=10",
        f"--out_dir={args.work / 'nano_gpt2_out'}",
        *args.nanogpt_args,
    ]
    run = launch(cmd, nano, args.out / "gpt2_nanogpt.log", timeout=args.step_timeout)
    its = [
        (t, int(m.group(1)), float(m.group(2)))
        for t, line in run["lines"]
        if (m := re.match(r"iter (\d+): loss [\d.na]+, time ([\d.]+)ms", line))
    ]
    # each log line follows loss.item(), a sync: the time between lines is one iteration's wall time
    gaps = [b[0] - a[0] for a, b in zip(its, its[1:]) if a[1] >= args.skip_steps]
    if run["returncode"] or not gaps:
        return {"error": tail(run), "returncode": run["returncode"]}
    sec = median(gaps)
    tok_s = batch * accum * 1024 / sec
    return {
        "run": "nanoGPT: train.py (its own code, compile=True, bias=True, bf16)",
        "micro_batch": batch,
        "grad_accum": accum,
        "tokens_per_step": batch * accum * 1024,
        "steps_timed": len(gaps),
        "tokens_per_s": round(tok_s),
        "ms_per_step": round(sec * 1e3, 1),
        "ms_per_step_own_print": round(median([dt for _, i, dt in its if i >= args.skip_steps]), 1),
        "mfu": round(args.fpt * tok_s / H100_PEAK, 4),
        "gpu_mem_used_gib": run["gpu_mem_gib"],
        "process_seconds": round(run["seconds"], 1),
    }


def attention_backends(batch: int = 12) -> dict:
    """Causal SDPA forward + backward at GPT-2 124M's shape, bf16, per available kernel (ms)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (
        torch.randn(batch, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    out = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):

                def step():
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    step()
                torch.cuda.synchronize()
            out[backend.name] = round((time.perf_counter() - t) / 20 * 1e3, 3)
        except RuntimeError as e:
            out[backend.name] = f"unavailable: {str(e)[:120]}"
    return out


def section_gpt2(args, data, nano) -> dict:
    args.fpt = flops_per_token(GPT2)
    result = {"flops_per_token": args.fpt, "peak_flops": H100_PEAK, "runs": []}
    try:
        result["attention_fwd_bwd_ms"] = attention_backends()
        log(f"gpt2: attention kernels {result['attention_fwd_bwd_ms']}")
    except Exception as e:  # informative only
        result["attention_fwd_bwd_ms"] = f"{type(e).__name__}: {e}"
    plan = [("ours", *r) for r in args.gpt2_ours] + [("nanogpt", *r) for r in args.gpt2_nanogpt]
    for who, batch, accum, env in plan:
        if time.time() > args.deadline - 90:
            result["runs"].append({"skipped": f"{who} b{batch}x{accum}: out of time"})
            continue
        log(f"gpt2: {who} micro-batch {batch} x accum {accum} {env}")
        if who == "ours":
            r = ours_gpt2(
                args, data["gpt2"], batch, accum, args.gpt2_steps, f"b{batch}x{accum}{len(result['runs'])}", env=env
            )
        else:
            r = nanogpt_gpt2(args, nano, batch, accum, args.gpt2_steps)
        log(f"  -> {r.get('tokens_per_s')} tok/s, mfu {r.get('mfu')}, {r.get('error', '')[-300:]}")
        result["runs"].append(r)
    timed = [r for r in result["runs"] if "tokens_per_s" in r]
    nano_runs = [r for r in timed if r["run"].startswith("nanoGPT")]
    ours_same = [
        r
        for r in timed
        if r["run"].startswith("ours")
        and not r["env"]
        and nano_runs
        and (r["micro_batch"], r["grad_accum"]) == (nano_runs[0]["micro_batch"], nano_runs[0]["grad_accum"])
    ]
    if nano_runs and ours_same:
        result["ours_over_nanogpt_same_batch"] = round(ours_same[0]["tokens_per_s"] / nano_runs[0]["tokens_per_s"], 3)
    return result


def ours_time_to_target(args, data: Path, name: str, extra=()) -> dict:
    out = args.work / f"sc_{name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        "shakespeare_char_gpu",
        "--data",
        data,
        "--out-dir",
        out,
        "--target-val-loss",
        TARGET,
        *extra,
        *args.ours_args,
    ]
    run = launch(cmd, ROOT, args.out / f"sc_{name}.log", timeout=args.step_timeout)
    evals = records(out, "eval")
    hit = next((r for r in evals if r["val_loss"] <= TARGET), None)
    steps = records(out, "train")
    return {
        "run": f"ours: train.py --config shakespeare_char_gpu {' '.join(map(str, extra))}".strip(),
        "seconds_to_target": round(hit["time"] - run["t0"], 1) if hit else None,
        "step_at_target": hit["step"] if hit else None,
        "val_loss": hit["val_loss"] if hit else (min(e["val_loss"] for e in evals) if evals else None),
        "ms_per_step": round(median([r["ms_per_step"] for r in steps[2:]]) or 0, 2),
        "first_log_seconds": round(steps[0]["time"] - run["t0"], 1) if steps else None,
        "evals": [(r["step"], round(r["val_loss"], 4), round(r["time"] - run["t0"], 1)) for r in evals],
        "gpu_mem_used_gib": run["gpu_mem_gib"],
        "returncode": run["returncode"],
        **({"error": tail(run)} if run["returncode"] else {}),
    }


def nanogpt_time_to_target(args, nano: Path) -> dict:
    hit_re = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")

    def reached(line):
        m = hit_re.search(line)
        return bool(m) and float(m.group(3)) <= TARGET

    cmd = [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char.py",
        f"--out_dir={args.work / 'nano_sc_out'}",
        *args.nanogpt_args,
    ]
    run = launch(cmd, nano, args.out / "sc_nanogpt.log", timeout=args.nanogpt_sc_timeout, stop_when=reached)
    evals = [
        (int(m.group(1)), float(m.group(3)), round(t, 1)) for t, line in run["lines"] if (m := hit_re.search(line))
    ]
    hit = next((e for e in evals if e[1] <= TARGET), None)
    its = [(t, int(m.group(1))) for t, line in run["lines"] if (m := re.match(r"iter (\d+):", line))]
    per_it = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(its, its[1:]) if a[1] >= 100 and b[1] > a[1]]
    return {
        "run": "nanoGPT: train.py config/train_shakespeare_char.py (its own code and recipe, compile, bf16)",
        "seconds_to_target": hit[2] if hit else None,
        "step_at_target": hit[0] if hit else None,
        "val_loss": hit[1] if hit else (min(e[1] for e in evals) if evals else None),
        "ms_per_step": round(1e3 * median(per_it), 2) if per_it else None,
        "evals": evals,
        "gpu_mem_used_gib": run["gpu_mem_gib"],
        "timed_out": run["timed_out"] and not hit,
        "returncode": run["returncode"],
        **({"error": tail(run)} if run["returncode"] and not hit else {}),
    }


def section_shakespeare(args, data, nano) -> dict:
    result = {"target_val_loss": TARGET}
    log("shakespeare: ours, shipped config")
    result["ours"] = ours_time_to_target(args, data["char"], "shipped")
    log(f"  -> {result['ours']['seconds_to_target']} s")
    for i, extra in enumerate(args.sc_variants):
        if time.time() > args.deadline - 120:
            break
        log(f"shakespeare: ours {extra}")
        result.setdefault("ours_variants", []).append(ours_time_to_target(args, data["char"], f"v{i}", extra.split()))
        log(f"  -> {result['ours_variants'][-1]['seconds_to_target']} s")
    if args.nanogpt_sc and time.time() < args.deadline - 60:
        log("shakespeare: nanoGPT")
        args.nanogpt_sc_timeout = min(args.nanogpt_sc_timeout, args.deadline - time.time() - 20)
        result["nanogpt"] = nanogpt_time_to_target(args, nano)
        log(f"  -> {result['nanogpt']['seconds_to_target']} s")
        a, b = result["ours"]["seconds_to_target"], result["nanogpt"]["seconds_to_target"]
        if a and b:
            result["speedup_vs_nanogpt"] = round(b / a, 2)
    return result


def section_sweep(args, data, nano) -> dict:
    """Recipes trained concurrently (timings meaningless): val loss against steps."""
    procs, result = [], {}
    for i, extra in enumerate(args.sweep):
        out = args.work / f"sweep{i}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [
            sys.executable,
            "train.py",
            "--config",
            "shakespeare_char_gpu",
            "--data",
            data["char"],
            "--out-dir",
            out,
            "--compile",
            "false",
            "--eval-interval",
            "100",
            "--eval-iters",
            "0",
            "--eval-batch-size",
            "512",
            "--log-interval",
            "100",
            "--max-minutes",
            str(args.sweep_minutes),
            *extra.split(),
            *args.ours_args,
        ]
        f = open(args.out / f"sweep{i}.log", "w")
        procs.append(
            (extra, out, subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT), f)
        )
    for extra, out, proc, f in procs:
        try:
            proc.wait(timeout=max(10, args.deadline - time.time() - 30))
        except subprocess.TimeoutExpired:
            proc.kill()
        f.close()
        evals = records(out, "eval")
        hit = next((r for r in evals if r["val_loss"] <= TARGET), None)
        result[extra] = {
            "step_at_target": hit["step"] if hit else None,
            "best": min((r["val_loss"] for r in evals), default=None),
            "evals": [(r["step"], round(r["val_loss"], 4)) for r in evals],
        }
        log(f"sweep {extra}: first <= {TARGET} at {result[extra]['step_at_target']}, best {result[extra]['best']}")
    return result


def section_sampling(args) -> dict:
    import torch
    import transformers

    from gpt import GPT, GPTConfig, generate
    from gpt.checkpoints.hf import export_hf
    from gpt.data.tokenizer import get_tokenizer

    os.environ.setdefault("GPT2_TIKTOKEN_FILE", str(args.shared / "data" / "gpt2.tiktoken"))
    tok = get_tokenizer("gpt2")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT2))
    hf_dir = export_hf(model, tok, args.work / "hf_gpt2_random")
    model = model.to("cuda", torch.bfloat16).eval()
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.bfloat16).to("cuda").eval()
    text = (args.shared / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:2000]
    prompt = tok.encode(text)[:16]
    new = args.new_tokens
    out = {
        "model": "GPT-2 124M shape, random weights, bf16",
        "prompt_tokens": len(prompt),
        "new_tokens": new,
        "decoding": "greedy",
        "transformers": transformers.__version__,
        "runs": [],
    }

    def ours(batch, graph, n=new):
        ids = []
        for piece in generate(
            model, tok, prompt, num_samples=batch, max_new_tokens=n, temperature=0, stop_at_eot=False, cuda_graph=graph
        ):
            if piece.sample == 0:
                ids += piece.ids
        return ids

    def theirs(batch, n=new):
        x = torch.tensor([prompt] * batch, device="cuda")
        with torch.no_grad():
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tok.eot_token,
            )
        return y[0, len(prompt) :].tolist()

    def timed(fn, *a):
        fn(*a, n=8)  # warm-up: kernels, cuBLAS handles, graph capture
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times, result = [], None
        for _ in range(args.sampling_repeats):
            t = time.perf_counter()
            result = fn(*a)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times), result, torch.cuda.max_memory_allocated() / 2**30

    for batch in (1, 16):
        row = {"batch": batch}
        for name, fn, extra in (
            ("ours_cuda_graph", ours, (True,)),
            ("ours_eager", ours, (False,)),
            ("transformers", theirs, ()),
        ):
            sec, ids, mem = timed(fn, batch, *extra)
            row[name] = {
                "tokens_per_s": round(batch * new / sec, 1),
                "seconds": round(sec, 3),
                "peak_mem_gib": round(mem, 2),
            }
            row[name + "_ids"] = ids
        ref = row.pop("transformers_ids")
        for name in ("ours_cuda_graph", "ours_eager"):
            ids = row.pop(name + "_ids")
            row[name]["same_tokens_as_transformers"] = next(
                (i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref)
            )
        row["speedup_graph_vs_transformers"] = round(
            row["ours_cuda_graph"]["tokens_per_s"] / row["transformers"]["tokens_per_s"], 2
        )
        row["speedup_eager_vs_transformers"] = round(
            row["ours_eager"]["tokens_per_s"] / row["transformers"]["tokens_per_s"], 2
        )
        log(f"sampling batch {batch}: {row}")
        out["runs"].append(row)
    return out


# ---- report ---------------------------------------------------------------------------------------


def markdown(res: dict) -> str:
    env = res.get("env", {})
    lines = [
        f"GPU: {env.get('gpu')} ({env.get('gpu_memory_gib')} GiB), driver {env.get('driver')}, CUDA "
        f"{env.get('cuda')}, torch {env.get('torch')}; measured bf16 matmul {env.get('bf16_matmul_8192_tflops')} "
        f"TFLOP/s; MFU against {H100_PEAK / 1e12:.0f} TFLOP/s.",
        "",
    ]
    if "gpt2" in res:
        lines += [
            "| GPT-2 124M run | micro-batch x accum | tokens/s | MFU | ms/step | GPU memory used |",
            "|---|---|---|---|---|---|",
        ]
        for r in res["gpt2"].get("runs", []):
            if "tokens_per_s" in r:
                lines.append(
                    f"| {r['run']} | {r['micro_batch']} x {r['grad_accum']} | {r['tokens_per_s']:,} | "
                    f"{r['mfu']:.1%} | {r['ms_per_step']} | {r['gpu_mem_used_gib']} GiB |"
                )
        lines.append("")
    if "shakespeare" in res:
        lines += [
            "| shakespeare-char run | val <= 1.47 after | at step | val there | ms/step |",
            "|---|---|---|---|---|",
        ]
        sc = res["shakespeare"]
        for r in [sc.get("ours"), *sc.get("ours_variants", []), sc.get("nanogpt")]:
            if r:
                val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else None
                lines.append(
                    f"| {r['run']} | {r['seconds_to_target']} s | {r['step_at_target']} | {val} | {r['ms_per_step']} |"
                )
        lines.append("")
    if "sampling" in res:
        lines += [
            "| sampling, 256 new tokens | ours, CUDA graph | ours, eager | transformers | graph / transformers |",
            "|---|---|---|---|---|",
        ]
        for r in res["sampling"]["runs"]:
            lines.append(
                f"| batch {r['batch']} | {r['ours_cuda_graph']['tokens_per_s']:,} tok/s | "
                f"{r['ours_eager']['tokens_per_s']:,} tok/s | {r['transformers']['tokens_per_s']:,} tok/s | "
                f"{r['speedup_graph_vs_transformers']}x |"
            )
    return "\n".join(lines) + "\n"


def run_spec(spec: str) -> tuple[int, int, dict]:
    """'32x4' or '32x4+NAME=VALUE+...': micro-batch, accumulation, environment of the run."""
    size, *env = spec.split("+")
    batch, accum = map(int, size.split("x"))
    return batch, accum, dict(e.split("=", 1) for e in env)


def save(res: dict, args) -> None:
    """Results and their table, written after every section (a later crash keeps them); copies in --out."""
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(res, indent=1))
    table = args.results.with_suffix(".md")
    table.write_text(markdown(res))
    for path in (args.results, table):
        if path.resolve() != (args.out / path.name).resolve():
            shutil.copy(path, args.out / path.name)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}, sweep")
    p.add_argument(
        "--shared", type=Path, default=ROOT.parent / "shared", help="folder with data/ and baselines/nanoGPT"
    )
    p.add_argument("--out", type=Path, default=None, help="folder for logs and a copy of the results (default: temp)")
    p.add_argument("--results", type=Path, default=RESULTS / "gpu.json")
    p.add_argument("--budget", type=float, default=3600, help="seconds for the whole run; later parts are skipped")
    p.add_argument(
        "--gpt2-ours",
        default="12x4,32x4",
        help="our runs: micro-batch x accumulation, each "
        "optionally with environment variables: 32x4+TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1",
    )
    p.add_argument("--gpt2-nanogpt", default="12x4", help="nanoGPT's runs (the first is the side-by-side one)")
    p.add_argument("--gpt2-steps", type=int, default=30)
    p.add_argument("--skip-steps", type=int, default=8, help="steps left out of the timing (compilation)")
    p.add_argument("--sc-variants", action="append", default=[], help="extra train.py args for more shakespeare runs")
    p.add_argument("--no-nanogpt-sc", dest="nanogpt_sc", action="store_false")
    p.add_argument("--nanogpt-sc-timeout", type=float, default=300)
    p.add_argument("--sweep", action="append", default=[], help="train.py args of one sweep recipe (repeatable)")
    p.add_argument("--sweep-minutes", type=float, default=2.5)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--sampling-repeats", type=int, default=3)
    p.add_argument("--step-timeout", type=float, default=240)
    p.add_argument(
        "--ours-args",
        type=str.split,
        default=[],
        help="appended to our train.py runs, one string (e.g. a CPU smoke run: --ours-args='--device cpu --n-layer 2')",
    )
    p.add_argument("--nanogpt-args", type=str.split, default=[], help="appended to nanoGPT's train.py runs, one string")
    p.add_argument("--tests-timeout", type=float, default=420)
    args = p.parse_args()
    args.deadline = time.time() + args.budget
    sections = args.only.split(",")
    args.gpt2_ours = [run_spec(s) for s in args.gpt2_ours.split(",") if s]
    args.gpt2_nanogpt = [run_spec(s) for s in args.gpt2_nanogpt.split(",") if s]
    args.out = args.out or Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="bench_gpu_work_"))
    args.shared = args.shared.resolve()
    sys.path.insert(0, str(ROOT))

    res = json.loads(args.results.read_text()) if args.results.exists() else {}
    data = nano = None
    if {"gpt2", "shakespeare", "sweep"} & set(sections):
        data = prepare_data(args.shared, args.work)
        nano = nanogpt_copy(args.shared, args.work, data)
    background = None
    if "tests" in sections and "sweep" in sections:  # the sweep's timings do not matter: share the machine
        background = threading.Thread(target=lambda: res.__setitem__("tests", section_tests(args)))
        background.start()
    for name in ["env", "sweep", "gpt2", "shakespeare", "sampling", "tests"]:  # timings on a quiet machine first
        if name not in sections or (name == "tests" and background):
            continue
        log(f"== {name}")
        t = time.time()
        try:
            if name in ("gpt2", "shakespeare", "sweep"):
                value = globals()[f"section_{name}"](args, data, nano)
            else:
                value = globals()[f"section_{name}"](args)
        except Exception as e:  # a broken section must not lose the others' results
            import traceback

            value = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        if name == "sweep" and background:
            background.join(timeout=max(1, args.deadline - time.time()))
        if isinstance(value, dict):
            value["measured"] = {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "seconds": round(time.time() - t, 1),
                "gpu": res.get("env", {}).get("gpu"),
            }
        res[name] = value
        save(res, args)
        log(f"== {name} done in {time.time() - t:.0f} s")
    if background:
        background.join(timeout=max(1, args.deadline - time.time()))
    save(res, args)
    print(markdown(res))
    print(json.dumps({k: v for k, v in res.get("tests", {}).items() if k in ("summary", "failures")}, indent=1))


if __name__ == "__main__":
    main()

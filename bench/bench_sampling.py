"""Sampling speed on CPU: our KV-cached generate vs recomputing the context (nanoGPT's sample.py) vs
transformers' GPT2LMHeadModel.generate on the same (exported) weights.

    python bench/bench_sampling.py                       # ~5 minutes; writes bench/results/sampling.{json,md}
    python bench/bench_sampling.py --threads 0 --budget 10     # torch's default thread count
    python bench/bench_sampling.py --runs cached,int8,val-loss --out bench/results/sampling-int8   # int8 only
    python bench/bench_sampling.py --runs dtype --models char-cpu,char-gpu,bpe-6x384 --out bench/results/sampling-dtype

Models (random weights: speed does not depend on them; end-of-text never stops a run, so every run
generates exactly the tokens asked for):
| name        | vocab                      | layers x heads x embd | block |
|-------------|----------------------------|-----------------------|-------|
| char-cpu    | 65 tiny-shakespeare chars + eot | 4 x 4 x 128      | 64    | nanoGPT's CPU shakespeare-char
| char-gpu    | same                       | 6 x 6 x 384           | 256   | nanoGPT's GPU shakespeare-char
| bpe-6x384   | GPT-2 BPE, 50304 rows      | 6 x 6 x 384           | 256   |

Runs, each in its own process (so peak RSS is that run's), 5 samples as one batch, temperature 1,
top-k 200, after a short warm-up:
- `cached`: ours, a full block_size-token prompt (tiny shakespeare), 500 new tokens: the window
  slides (a re-prefill of block_size/2 tokens every block_size/2 + 1 steps).
- `recompute`: the same prompt, nanoGPT's loop: crop to the last block_size tokens, run the whole
  model, take the last position's logits (only that position through lm_head, as nanoGPT does),
  sample. Its cost per token is constant once the context is full, so it runs for `--budget`
  seconds (at most 500 tokens) and tokens/s is measured over what it generated.
- `cached-in-context` and `hf`: a 16-token prompt and block_size - 16 new tokens (transformers'
  GPT-2 cannot go past n_positions), ours vs `generate(do_sample=True, top_k=200, use_cache=True)`.
- `int8`: `cached` with the Linear layers in int8 (`gpt.model.quantize`, what `--quantize int8`
  does), on the same random weights.
- `dtype`: `cached` in float32 and in bf16 weights (what `sample.py --dtype bfloat16` runs), alternated
  `--repeats` times in one process so both see the same load on a shared CPU; medians and the
  bf16 / float32 ratio of each pair (what `--dtype auto` for inference on CPU is chosen from).
- `layout` (`--models gpt2-124m,char-cpu`): batch-1 greedy decode of a 22-token prompt, `--layout-tokens`
  new tokens, before and after gpt/model/packed.py: the Linear layers as nn.Linear (and for bf16 a bf16
  KV cache, as before `GPT.cache_dtype`) against packed (what load_for_inference does on the CPU), in
  float32 (at 2+ threads also the transposed layout without packed's column blocks, `pack(chunks=1)`), in bf16 where oneDNN computes it natively, and int8 for reference; the variants alternated `--repeats` times in one process, prefill (time to the
  first logits) and decode tokens/s separately, medians and the median of the after / before ratios.
- `compile` (`--models gpt2-124m,char-cpu`): batch-1 greedy decode as `layout` (22-token prompt,
  `--layout-tokens` new tokens), the packed model eager against the same model unpacked with
  `GPT.compile_decoding` (what `sample.py --compile` runs), float32 and bf16 where native: the first
  compiled step's seconds (the compile) against eager's, then `--repeats` interleaved rounds, medians of
  the decode tokens/s and of the compiled / eager ratios; dynamo's graph count (off the CPU only: there the
  step is compiled ahead of time; one graph per length is a bug).
- `val-loss`: the same shapes trained briefly on tiny-shakespeare (bench/models.py, cached in
  out/bench-models/; trained on first use, about 12 minutes), mean loss over up to `--val-windows`
  evenly spaced block_size windows of the validation split, float32 and int8 on the same windows.
- `scripts` (char-cpu): our sample.py against nanoGPT's own sample.py, each run as a user runs it, on
  the same weights and prompt (see `scripts()`).
Reported: time to first token (prompt prefill + first sample), tokens/s over the whole run, peak RSS
and RSS after loading the model. The machine's load average is recorded: the CPU may be shared.
The int8 goals: tokens/s >= 1.5x float32 (`int8` / `cached`) and val loss within 1% of float32.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/models.py
import harness  # noqa: E402
from models import MODELS as TRAINED  # noqa: E402  (the models val-loss trains)

SHARED = harness.SHARED_DATA

MODELS = {
    "char-cpu": dict(tokenizer="char", n_layer=4, n_head=4, n_embd=128, block_size=64),
    "char-gpu": dict(tokenizer="char", n_layer=6, n_head=6, n_embd=384, block_size=256),
    "bpe-6x384": dict(tokenizer="gpt2", n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2-124m": dict(tokenizer="gpt2", n_layer=12, n_head=12, n_embd=768, block_size=1024),  # the layout run
}
SAMPLES, NEW_TOKENS, SHORT_PROMPT, TOP_K = 5, 500, 16, 200
# run -> its prompt length (None: a full block_size prompt)
RUNS = {
    "cached": None,
    "recompute": None,
    "cached-in-context": SHORT_PROMPT,
    "hf": SHORT_PROMPT,
    "int8": None,
    "dtype": None,
    "layout": 22,
    "compile": 22,
    "val-loss": None,
    "scripts": None,
}
SCRIPT_SHORT = 20  # scripts: new tokens of the short run whose time (start-up, loading) is subtracted
SCRIPT_TOKENS = {"char-cpu": 1500}  # scripts: the models compared and the new tokens of the long run


def spec(name: str) -> dict:
    """A model of MODELS, or another shape named `char-LxHxE` / `bpe-LxHxE` (block 256; the dtype run's
    sizes between the shipped ones)."""
    if name in MODELS:
        return MODELS[name]
    kind, _, shape = name.partition("-")
    try:
        n_layer, n_head, n_embd = map(int, shape.split("x"))
    except ValueError:
        raise SystemExit(
            f"--models: {name!r} is neither one of {', '.join(MODELS)} nor char-LxHxE / bpe-LxHxE"
        ) from None
    return dict(
        tokenizer="char" if kind == "char" else "gpt2", n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=256
    )


def tokenizer_and_text(name: str):
    """The model's tokenizer and the prompt source (tiny shakespeare's opening) as ids."""
    from gpt.data.tokenizer import CharTokenizer, get_tokenizer

    text = (SHARED / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text) if spec(name)["tokenizer"] == "char" else get_tokenizer("gpt2")
    return tok, tok.encode(text[:5000])


def build(name: str, tok):
    """The benchmark model, seeded random weights."""
    from gpt import GPT, GPTConfig

    shape = spec(name)
    vocab = tok.vocab_size if shape["tokenizer"] == "char" else 50304  # GPT-2's 50257 padded to 64s
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, **{k: v for k, v in shape.items() if k != "tokenizer"})).eval()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---- one run (child process) ---------------------------------------------------------------------


def run_ours(model, tok, prompt, new_tokens):
    from gpt import generate

    def once(p, n):
        t0, first, count = time.perf_counter(), None, 0
        for piece in generate(
            model,
            tok,
            p,
            num_samples=SAMPLES,
            max_new_tokens=n,
            temperature=1.0,
            top_k=TOP_K,
            stop_at_eot=False,
            generator=torch.Generator().manual_seed(0),
        ):
            first = first if first is not None else time.perf_counter() - t0
            count += len(piece.ids)
        return first, count, time.perf_counter() - t0

    once(prompt[:8], 4)  # warm-up
    return once(prompt, new_tokens)


def run_dtypes(model, tok, prompt, repeats: int) -> dict:
    """`run_ours` in float32 and in bf16 weights, each laid out as load_for_inference lays it out on the CPU
    (gpt.model.packed.pack: our C kernels where they build), alternated (which goes first alternates too),
    medians."""
    import statistics

    from gpt.model.packed import pack

    models = {"float32": pack(copy.deepcopy(model)), "bfloat16": pack(copy.deepcopy(model).to(torch.bfloat16))}
    speed = {name: [] for name in models}
    for i in range(repeats):
        for name in ("float32", "bfloat16") if i % 2 == 0 else ("bfloat16", "float32"):
            _, count, elapsed = run_ours(models[name], tok, prompt, NEW_TOKENS)
            speed[name].append(count / elapsed)
    ratios = [b / f for b, f in zip(speed["bfloat16"], speed["float32"])]
    return {
        "tokens_per_s_float32": statistics.median(speed["float32"]),
        "tokens_per_s_bfloat16": statistics.median(speed["bfloat16"]),
        "bf16_vs_float32": statistics.median(ratios),
        "bf16_vs_float32_min": min(ratios),
        "bf16_vs_float32_max": max(ratios),
        "repeats": repeats,
        **{f"all_{name}": [round(x, 1) for x in values] for name, values in speed.items()},
    }


@torch.no_grad()
def decode_speed(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of batch-1 greedy decoding through `Decoder`."""
    from gpt.infer.sampling import Decoder

    idx = torch.tensor([prompt])
    t0 = time.perf_counter()
    dec = Decoder(model, idx)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        dec.advance(dec.logits.argmax(-1))
    return prefill, new_tokens / (time.perf_counter() - t0)


def run_layouts(model, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """`decode_speed` of nn.Linear against packed layers (float32; bf16 where native) and int8, alternated."""
    import statistics

    from gpt.model.packed import can_pack, pack
    from gpt.model.quantize import quantize

    # PyTorch's layouts (kernels=False), not our kernels': bench_kernels.py measures those against these
    variants = {"float32": model, "float32-packed": pack(copy.deepcopy(model), kernels=False)}
    if torch.get_num_threads() > 1:  # packed's float32 column blocks against the transposed layout alone
        variants["float32-transposed"] = pack(copy.deepcopy(model), chunks=1, kernels=False)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    if can_pack(bf16):
        bf16.cache_dtype = lambda: torch.bfloat16  # before: bf16 KV caches (GPT.cache_dtype)
        variants |= {"bf16": bf16, "bf16-packed": pack(copy.deepcopy(model).to(torch.bfloat16), kernels=False)}
    variants["int8"] = quantize(copy.deepcopy(model), "int8")
    for m in variants.values():
        decode_speed(m, prompt[:8], 4)  # warm-up
    speed = {name: [] for name in variants}
    prefill = {name: [] for name in variants}
    for i in range(repeats):
        for name in variants if i % 2 == 0 else reversed(variants):
            seconds, tps = decode_speed(variants[name], prompt, new_tokens)
            speed[name].append(tps)
            prefill[name].append(seconds)
    out = {
        "new_tokens": new_tokens,
        "repeats": repeats,
        "decode_tokens_per_s": {k: statistics.median(v) for k, v in speed.items()},
        "prefill_ms": {k: 1000 * statistics.median(v) for k, v in prefill.items()},
        "all_decode_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in speed.items()},
    }
    out["packed_vs_linear"] = {
        dt: statistics.median(a / b for a, b in zip(speed[f"{dt}-packed"], speed[dt]))
        for dt in ("float32", "bf16")
        if dt in speed
    }
    if "float32-transposed" in speed:
        out["blocks_vs_transposed"] = statistics.median(
            a / b for a, b in zip(speed["float32-packed"], speed["float32-transposed"])
        )
    return out


def run_compiled(model, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """`decode_speed` of the packed model eager against `compile_decoding`'s step (on the unpacked model), alternated
    (see `compile`)."""
    import statistics

    from torch._dynamo.utils import counters

    from gpt.infer.sampling import Decoder
    from gpt.model.packed import can_pack, pack

    models = {"float32": copy.deepcopy(model)}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    if can_pack(bf16):
        models["bf16"] = bf16
    variants, first_step = {}, {}
    for dt, m in models.items():
        compiled = copy.deepcopy(m)  # unpacked: the compiled step lays its weights out itself
        compiled.compile_decoding()
        m = pack(m)
        variants |= {dt: m, f"{dt}-compiled": compiled}
        for name in (dt, f"{dt}-compiled"):
            with torch.no_grad():
                dec = Decoder(variants[name], torch.tensor([prompt]))
                t0 = time.perf_counter()
                dec.advance(dec.logits.argmax(-1))  # the compiled variant compiles here
                first_step[name] = time.perf_counter() - t0
                # warm-up: up to a full cache (the second graph) if the rounds get there
                fill = m.config.block_size - len(prompt) + 1
                decode_speed(variants[name], prompt, fill if fill <= new_tokens else 4)
        counters.clear()
    speed = {name: [] for name in variants}
    for i in range(repeats):
        for name in variants if i % 2 == 0 else reversed(variants):
            speed[name].append(decode_speed(variants[name], prompt, new_tokens)[1])
    graphs = dict(counters["stats"])  # compiled during the rounds: none
    return {
        "new_tokens": new_tokens,
        "repeats": repeats,
        "first_step_s": first_step,
        "decode_tokens_per_s": {k: statistics.median(v) for k, v in speed.items()},
        "all_decode_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in speed.items()},
        "compiled_vs_eager": {
            dt: statistics.median(a / b for a, b in zip(speed[f"{dt}-compiled"], speed[dt])) for dt in models
        },
        "dynamo_stats_after_warmup": graphs,
    }


@torch.no_grad()
def run_recompute(model, prompt, new_tokens, budget):
    """nanoGPT's sample loop: crop, full forward, last position's logits, sample."""
    from gpt.infer.logits import next_token

    block = model.config.block_size
    g = torch.Generator().manual_seed(0)

    def step(idx):
        cond = idx if idx.size(1) <= block else idx[:, -block:]
        logits = model.head(model.hidden(cond)[:, -1])
        return torch.cat([idx, next_token(logits, temperature=1.0, top_k=TOP_K, generator=g)[:, None]], 1)

    step(torch.tensor([prompt[:8]] * SAMPLES))  # warm-up
    idx = torch.tensor([prompt] * SAMPLES)
    t0 = time.perf_counter()
    idx = step(idx)
    first = time.perf_counter() - t0
    n = 1
    while n < new_tokens and time.perf_counter() - t0 < budget:
        idx = step(idx)
        n += 1
    return first, n * SAMPLES, time.perf_counter() - t0


def run_hf(hf_dir, prompt, new_tokens):
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    model.generation_config.eos_token_id = None
    rss_loaded = rss_mb()
    times = []

    class Clock(transformers.generation.BaseStreamer):
        def put(self, value):
            times.append(time.perf_counter())

        def end(self):
            pass

    def once(p, n):
        ids = torch.tensor([p] * SAMPLES)
        torch.manual_seed(0)
        times.clear()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=True,
                temperature=1.0,
                top_k=TOP_K,
                top_p=1.0,
                use_cache=True,
                pad_token_id=0,
                eos_token_id=None,
                streamer=Clock(),
            )
        elapsed = time.perf_counter() - t0
        return times[1] - t0, (out.size(1) - ids.size(1)) * SAMPLES, elapsed  # put #0 is the prompt

    once(prompt[:8], 4)  # warm-up
    return rss_loaded, once(prompt, new_tokens)


@torch.no_grad()
def run_val_loss(name: str, windows: int) -> dict:
    """Mean next-token loss of the trained model over evenly spaced val windows, float32 and int8."""
    from models import ensure, val_tokens

    from gpt import load_checkpoint
    from gpt.model.quantize import quantize

    model, _, _ = load_checkpoint(ensure(name))
    block = model.config.block_size
    ids = torch.from_numpy(val_tokens(name))
    starts = torch.linspace(0, len(ids) - block - 1, min(windows, (len(ids) - 1) // block)).long()
    x = torch.stack([ids[s : s + block] for s in starts])
    y = torch.stack([ids[s + 1 : s + block + 1] for s in starts])

    def loss(m) -> float:
        return sum(m(x[i : i + 8], y[i : i + 8])[1].item() * len(x[i : i + 8]) for i in range(0, len(x), 8)) / len(x)

    fp32 = loss(model)
    int8 = loss(quantize(model, "int8"))
    return {
        "val_loss_fp32": fp32,
        "val_loss_int8": int8,
        "val_loss_rel_diff": (int8 - fp32) / fp32,
        "val_windows": len(x),
        "val_tokens": len(x) * block,
    }


def child(args) -> None:
    if args.as_avx2:
        harness.as_avx2()  # (the variables came from the parent: PyTorch's oneDNN bf16 products off)
    if args.threads:
        torch.set_num_threads(args.threads)
    job = json.loads(args.child)
    if job["run"] == "val-loss":
        print(json.dumps(dict(job, threads=torch.get_num_threads(), **run_val_loss(job["model"], args.val_windows))))
        return
    tok, text_ids = tokenizer_and_text(job["model"])
    block = spec(job["model"])["block_size"]
    if job["run"] == "dtype":
        model = build(job["model"], tok)
        print(
            json.dumps(
                dict(
                    job,
                    threads=torch.get_num_threads(),
                    n_params=model.num_params(),
                    **run_dtypes(model, tok, text_ids[:block], args.repeats),
                )
            )
        )
        return
    if job["run"] == "layout":
        model = build(job["model"], tok)
        print(
            json.dumps(
                dict(
                    job,
                    threads=torch.get_num_threads(),
                    n_params=model.num_params(),
                    **run_layouts(model, text_ids[: RUNS["layout"]], args.layout_tokens, args.repeats),
                )
            )
        )
        return
    if job["run"] == "compile":
        model = build(job["model"], tok)
        result = run_compiled(model, text_ids[: RUNS["compile"]], args.layout_tokens, args.repeats)
        print(json.dumps(dict(job, threads=torch.get_num_threads(), n_params=model.num_params(), **result)))
        return
    if job["run"] == "hf":
        rss_loaded, (first, count, elapsed) = run_hf(job["hf_dir"], text_ids[:SHORT_PROMPT], block - SHORT_PROMPT)
    else:
        model = build(job["model"], tok)
        if job["run"] == "int8":
            from gpt.model.quantize import quantize

            model = quantize(model, "int8")
        rss_loaded = rss_mb()
        if job["run"] in ("cached", "int8"):
            first, count, elapsed = run_ours(model, tok, text_ids[:block], NEW_TOKENS)
        elif job["run"] == "cached-in-context":
            first, count, elapsed = run_ours(model, tok, text_ids[:SHORT_PROMPT], block - SHORT_PROMPT)
        else:
            first, count, elapsed = run_recompute(model, text_ids[:block], NEW_TOKENS, args.budget)
    print(
        json.dumps(
            dict(
                job,
                threads=torch.get_num_threads(),
                ttft_ms=1000 * first,
                tokens=count,
                seconds=elapsed,
                tokens_per_s=count / elapsed,
                peak_rss_mb=peak_rss_mb(),
                rss_loaded_mb=rss_loaded,
            )
        )
    )


# ---- sample.py against nanoGPT's own sample.py (parent) ------------------------------------------


def scripts(name: str, tmp: Path, repeats: int = 3) -> dict:
    """Our sample.py and nanoGPT's own sample.py (a scratch copy of ../shared/baselines/nanoGPT), each
    run as a user runs it (default threads, float32, no compile) on the same weights and the same
    block_size-character prompt: SAMPLES samples of SCRIPT_TOKENS[name] and of SCRIPT_SHORT new tokens,
    temperature 1, top-k 200. Tokens/s = SAMPLES * (difference in new tokens) / (difference of the wall
    times), so start-up and loading cancel out; each time the best of `repeats`. nanoGPT's sample.py
    draws its samples one after another at batch 1 (ours: as one batch), recomputing the whole context
    per token. The char-cpu model only: nanoGPT's sample.py downloads GPT-2's BPE for other checkpoints,
    and on the 6x384 models it runs at a few tokens/s."""
    import pickle

    from harness import nanogpt_copy

    from gpt.checkpoints import native

    tok, text_ids = tokenizer_and_text(name)
    model, block = build(name, tok), spec(name)["block_size"]
    cfg = model.config
    work = tmp / f"scripts-{name}"
    prompt = work / "prompt.txt"
    work.mkdir()
    prompt.write_text(tok.decode(text_ids[:block]), encoding="utf-8")
    ours = work / "ours"  # our checkpoint
    native.save(
        ours / "best.pt",
        {"model": model.state_dict()},
        {"step": 0, "model_config": cfg.to_dict(), "tokenizer": tok.spec},
    )
    nano = nanogpt_copy(tmp)  # its checkpoint: the same tensors under the same names, its meta.pkl for chars
    dataset = f"bench_{name}"
    (nano / "data" / dataset).mkdir(exist_ok=True)
    itos = dict(enumerate(tok.chars + "\n"))  # the end-of-text id (never in the prompt) decodes as a newline
    with open(nano / "data" / dataset / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": cfg.vocab_size, "itos": itos, "stoi": tok.stoi}, f)
    model_args = dict(
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        block_size=cfg.block_size,
        bias=cfg.bias,
        vocab_size=cfg.vocab_size,
        dropout=0.0,
    )
    (work / "nano").mkdir()
    torch.save(
        {"model": model.state_dict(), "model_args": model_args, "config": {"dataset": dataset}},
        work / "nano" / "ckpt.pt",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}

    def command(which: str, n: int) -> tuple[list, Path]:
        if which == "ours":
            return [
                sys.executable,
                ROOT / "sample.py",
                "--ckpt",
                ours,
                "--prompt-file",
                prompt,
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--num-samples",
                SAMPLES,
                "--max-new-tokens",
                n,
                "--temperature",
                1,
                "--top-k",
                TOP_K,
                "--seed",
                0,
                "--no-stop-at-eot",
            ], ROOT
        return [
            sys.executable,
            "sample.py",
            f"--out_dir={work / 'nano'}",
            f"--start=FILE:{prompt}",
            "--device=cpu",
            "--dtype=float32",
            "--compile=False",
            f"--num_samples={SAMPLES}",
            f"--max_new_tokens={n}",
            "--temperature=1.0",
            f"--top_k={TOP_K}",
        ], nano

    def seconds(which: str, n: int) -> float:
        cmd, cwd = command(which, n)
        t0 = time.perf_counter()
        subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, check=True, capture_output=True)
        return time.perf_counter() - t0

    result = {}
    n = SCRIPT_TOKENS[name]
    for which in ("ours", "nanogpt"):
        runs = [(seconds(which, SCRIPT_SHORT), seconds(which, n)) for _ in range(repeats)]
        short, full = min(r[0] for r in runs), min(r[1] for r in runs)
        result[which] = {
            "seconds_short": round(short, 2),
            "seconds_full": round(full, 2),
            "tokens_per_s": round(SAMPLES * (n - SCRIPT_SHORT) / (full - short), 1),
        }
    result["new_tokens"] = n
    result["ours_vs_nanogpt"] = round(result["ours"]["tokens_per_s"] / result["nanogpt"]["tokens_per_s"], 2)
    return result


# ---- the whole benchmark (parent) ----------------------------------------------------------------


def table(results: list[dict]) -> str:
    rows = [
        "| model | run | prompt -> new tokens (x5 samples) | time to first token | tokens/s | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["run"] in ("val-loss", "dtype", "layout"):
            continue
        new = r["tokens"] // SAMPLES
        rows.append(
            f"| {r['model']} | {r['run']} | {r['prompt']} -> {new} | {r['ttft_ms']:.0f} ms | "
            f"{r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} MB |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, 0 for torch's default (default: 1: on a shared CPU more threads stall)",
    )
    p.add_argument("--budget", type=float, default=15.0, help="seconds for each no-cache recompute run (default: 15)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--repeats", type=int, default=7, help="float32/bf16 pairs of the dtype run (default: 7)")
    p.add_argument("--layout-tokens", type=int, default=256, help="new tokens of each layout run (default: 256)")
    p.add_argument("--val-windows", type=int, default=64, help="block_size windows of the val split for val-loss")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sampling"), help="results path, without suffix")
    p.add_argument(
        "--as-avx2",
        action="store_true",
        help="as a CPU without AVX-512 or native bf16 runs it, approximated on this one (harness.AS_AVX2)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    as_avx2 = harness.as_avx2() if args.as_avx2 else None

    from gpt.checkpoints.hf import export_hf
    from gpt.runtime import cpu_has_native_bf16, cpu_name

    load_before = os.getloadavg()
    results, scripts_result = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            tok, _ = tokenizer_and_text(name)
            block = spec(name)["block_size"]
            hf_dir = export_hf(build(name, tok), tok, Path(tmp) / name) if "hf" in args.runs.split(",") else ""
            for run in args.runs.split(","):
                if run == "scripts":
                    if name in SCRIPT_TOKENS:
                        scripts_result[name] = dict(scripts(name, Path(tmp)), load_avg=os.getloadavg())
                        print(
                            f"{name:10s} sample.py {scripts_result[name]['ours']['tokens_per_s']:.0f} tokens/s, "
                            f"nanoGPT's sample.py {scripts_result[name]['nanogpt']['tokens_per_s']:.0f} tokens/s",
                            flush=True,
                        )
                    continue
                if run == "val-loss" and name not in TRAINED:  # (gpt2-124m: random weights only)
                    print(f"{name:10s} val-loss           skipped: no trained model (bench/models.py)", flush=True)
                    continue
                job = dict(model=name, run=run, prompt=RUNS[run] or block, hf_dir=str(hf_dir))
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    json.dumps(job),
                    "--budget",
                    str(args.budget),
                    "--threads",
                    str(args.threads),
                    "--val-windows",
                    str(args.val_windows),
                    "--repeats",
                    str(args.repeats),
                    "--layout-tokens",
                    str(args.layout_tokens),
                    *(["--as-avx2"] if as_avx2 else []),
                ]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                result.pop("hf_dir")
                result["load_avg"] = os.getloadavg()
                results.append(result)
                if run == "dtype":
                    print(
                        f"{name:10s} {run:18s} float32 {result['tokens_per_s_float32']:6.0f} tokens/s  bf16 "
                        f"{result['tokens_per_s_bfloat16']:6.0f} tokens/s  bf16/float32 {result['bf16_vs_float32']:.2f}",
                        flush=True,
                    )
                    continue
                if run == "compile":
                    ratios = " ".join(f"{k} {v:.2f}x" for k, v in result["compiled_vs_eager"].items())
                    print(f"{name:10s} {run:18s} compiled / eager decode: {ratios}", flush=True)
                    continue
                if run == "layout":
                    speeds = " ".join(f"{k} {v:.1f}" for k, v in result["decode_tokens_per_s"].items())
                    print(f"{name:10s} {run:18s} decode tokens/s: {speeds}", flush=True)
                    continue
                if run == "val-loss":
                    print(
                        f"{name:10s} {run:18s} float32 {result['val_loss_fp32']:.4f}  int8 "
                        f"{result['val_loss_int8']:.4f}  ({100 * result['val_loss_rel_diff']:+.2f}%)",
                        flush=True,
                    )
                    continue
                print(
                    f"{name:10s} {run:18s} {result['tokens_per_s']:8.0f} tokens/s  "
                    f"ttft {result['ttft_ms']:6.0f} ms  peak {result['peak_rss_mb']:5.0f} MB",
                    flush=True,
                )
    speedups = {}
    for name in args.models.split(","):
        by = {r["run"]: r for r in results if r["model"] == name}
        ratios = {
            "cached_vs_recompute": ("cached", "recompute"),
            "cached_vs_hf_in_context": ("cached-in-context", "hf"),
            "int8_vs_float32": ("int8", "cached"),
        }
        speedups[name] = {
            k: by[a]["tokens_per_s"] / by[b]["tokens_per_s"] for k, (a, b) in ratios.items() if a in by and b in by
        }
        if "val-loss" in by:
            speedups[name]["int8_val_loss_rel_diff"] = by["val-loss"]["val_loss_rel_diff"]
    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        cpu=cpu_name(),
        capability=torch.backends.cpu.get_cpu_capability(),
        native_bf16=cpu_has_native_bf16(),
        mkldnn_bf16=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        cores=os.cpu_count(),
        threads=args.threads,
        load_avg_before=load_before,
        load_avg_after=os.getloadavg(),
        cpu_family_model=harness.cpu_family_model(),
        commit=harness.commit(),
        date=time.strftime("%Y-%m-%d"),
        **({"as_avx2": as_avx2} if as_avx2 else {}),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(dict(env=env, results=results, speedups=speedups, scripts=scripts_result), indent=2) + "\n"
    )
    md = [f"Environment: {json.dumps(env)}"]

    def cell(v: dict, key: str, fmt: str, unit: str = "") -> str:
        return format(v[key], fmt) + unit if key in v else "-"

    if any(r["run"] not in ("val-loss", "dtype", "layout", "compile") for r in results):
        md += [
            "",
            table(results),
            "",
            "| model | cached / recompute | ours / transformers (in context) | "
            "int8 / float32 tokens/s | int8 val loss vs float32 |",
            "|---|---|---|---|---|",
        ]
        md += [
            f"| {k} | {cell(v, 'cached_vs_recompute', '.1f', 'x')} | {cell(v, 'cached_vs_hf_in_context', '.2f', 'x')} | "
            f"{cell(v, 'int8_vs_float32', '.2f', 'x')} | {cell(v, 'int8_val_loss_rel_diff', '+.2%')} |"
            for k, v in speedups.items()
        ]
    dtypes = [r for r in results if r["run"] == "dtype"]
    if dtypes:
        md += [
            "",
            f"float32 against bf16 weights ({SAMPLES} x {NEW_TOKENS} new tokens, {args.threads} thread(s), "
            f"{args.repeats} interleaved pairs in one process, medians; load average {load_before[0]:.1f} before, "
            f"{env['load_avg_after'][0]:.1f} after: other jobs may share the CPU, the ratios are the figures to read):",
            "",
            "| model | parameters | float32 tokens/s | bf16 tokens/s | bf16 / float32 (min-max) |",
            "|---|---|---|---|---|",
        ]
        md += [
            f"| {r['model']} | {r['n_params'] / 1e6:.1f}M | {r['tokens_per_s_float32']:.0f} | "
            f"{r['tokens_per_s_bfloat16']:.0f} | {r['bf16_vs_float32']:.2f} "
            + (
                f"({r['bf16_vs_float32_min']:.2f}-{r['bf16_vs_float32_max']:.2f}) |"
                if "bf16_vs_float32_min" in r
                else "|"
            )
            for r in dtypes
        ]
    layouts = [r for r in results if r["run"] == "layout"]
    if layouts:
        md += [
            "",
            "Batch-1 greedy decode, before (nn.Linear; bf16: a bf16 KV cache) against after (gpt/model/packed.py; "
            f"bf16: a float32 KV cache): a {RUNS['layout']}-token prompt, {args.layout_tokens} new tokens, {args.threads} thread(s), {args.repeats} interleaved rounds in "
            f"one process, medians; load average {load_before[0]:.1f} before, {env['load_avg_after'][0]:.1f} after "
            "(a shared CPU: read the ratios):",
            "",
            "| model | variant | prefill | decode tokens/s | after / before |",
            "|---|---|---|---|---|",
        ]
        for r in layouts:
            for k, v in r["decode_tokens_per_s"].items():
                ratio = r["packed_vs_linear"].get(k.removesuffix("-packed")) if k.endswith("-packed") else None
                if k == "float32-transposed":  # what float32-packed was before its column blocks
                    ratio, k = r["blocks_vs_transposed"], "float32-transposed (packed / this)"
                md.append(
                    f"| {r['model']} | {k} | {r['prefill_ms'][k.split()[0]]:.0f} ms | {v:.1f} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}x'} |"
                )
    compiles = [r for r in results if r["run"] == "compile"]
    if compiles:
        md += [
            "",
            f"Batch-1 greedy decode, eager against `compile_decoding` (both packed): a {RUNS['compile']}-token prompt, "
            f"{args.layout_tokens} new tokens, {args.threads} thread(s), {args.repeats} interleaved rounds in one "
            f"process, medians; load average {load_before[0]:.1f} before, {env['load_avg_after'][0]:.1f} after:",
            "",
            "| model | variant | first decode step | decode tokens/s | compiled / eager |",
            "|---|---|---|---|---|",
        ]
        for r in compiles:
            for k, v in r["decode_tokens_per_s"].items():
                ratio = r["compiled_vs_eager"][k.removesuffix("-compiled")] if k.endswith("-compiled") else None
                md.append(
                    f"| {r['model']} | {k} | {r['first_step_s'][k]:.2f} s | {v:.1f} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}x'} |"
                )
    losses = [r for r in results if r["run"] == "val-loss"]
    if losses:
        md += ["", "| model | val loss float32 | val loss int8 | difference | val tokens |", "|---|---|---|---|---|"]
        md += [
            f"| {r['model']} | {r['val_loss_fp32']:.4f} | {r['val_loss_int8']:.4f} | "
            f"{r['val_loss_rel_diff']:+.2%} | {r['val_tokens']} |"
            for r in losses
        ]
    if scripts_result:
        md += [
            "",
            f"sample.py against nanoGPT's sample.py (default threads, {SAMPLES} samples, start-up subtracted):",
            "",
            "| model | ours tokens/s | nanoGPT tokens/s | ours / nanoGPT |",
            "|---|---|---|---|",
        ]
        md += [
            f"| {k} | {v['ours']['tokens_per_s']:.0f} | {v['nanogpt']['tokens_per_s']:.0f} | {v['ours_vs_nanogpt']:.1f}x |"
            for k, v in scripts_result.items()
        ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Batch-1 greedy decoding on CPU: sample.py's path against llama.cpp on the same weights (our GGUF export).

    python bench/bench_llamacpp.py                          # both models, 2 threads, 5 rounds; ~5 minutes
    python bench/bench_llamacpp.py --models char --rounds 1 --new-tokens 16      # a quick check that it runs
    python bench/bench_llamacpp.py --no-compile                                   # without the --compile rows
    python bench/bench_llamacpp.py --models gpt2 --pairs f32 --out /tmp/f32      # one precision only
    python bench/bench_llamacpp.py --pairs f32,q8_0,q4_0 --out bench/results/llamacpp-int4   # int4 beside them
    python bench/bench_llamacpp.py --ckpt out/shakespeare-char --models char     # a trained run as the char model
    python bench/bench_llamacpp.py --as-avx2      # as a CPU without AVX-512 runs both: bench/results/llamacpp-avx2

Pairs, each at a comparable precision, on the same random weights (speed does not depend on them):
| ours (gpt.checkpoints.loader.load_for_inference + gpt.infer.sampling.generate, as sample.py) | llama.cpp |
|----------------------------------------------------------------------------------------------|-----------|
| float32                                                                                      | f32       |
| bf16 weights (where the CPU has native bf16 or our C kernels build: elsewhere it is emulated)  | f16       |
| `--quantize int8` (int8 Linear layers, weights and activations: gpt/model/quantize.py)        | q8_0      |
| float32 `--compile` (the decode step compiled ahead of time: gpt/model/compiled.py)           | f32       |
| bf16 `--compile`                                                                             | f16       |
| `--quantize int8 --compile`                                                                  | q8_0      |
| `--quantize int4` (int4 weights in groups of 32, bf16 scales: gpt/model/quantize.py)          | q4_0      |
| `--quantize int4 --compile`                                                                  | q4_0      |

Models: `gpt2` is GPT-2 124M's shape (12 x 12 x 768, 50304 rows, block 1024, GPT-2's BPE); `char` is the
main job's model (`--config shakespeare_char_cpu`: 2 x 4 x 128, block 64, no biases, erf GELU), or the run
given with --ckpt. Each of ours is loaded and warmed up once, before the rounds (with --compile that is the
compile: its seconds are reported apart). Prefill (a 22-token prompt to the first token) and decode (the
tokens after the first, in tokens/s) are timed apart.

The peer is llama.cpp as its users run it: built for this CPU (`bench/llamacpp_native.py`: the sources the
installed llama-cpp-python vendors, -march=native, in a folder of its own; `--portable` uses the installed
wheel instead, which .ci/run builds for any AVX2 CPU), with its defaults (float16 KV cache, flash attention
on auto), the same thread count. Two front ends over that one build, both in every round:
- `llama-bench -p 0 -n N -d P` (llama.cpp's own C++ benchmark: N tokens generated after a P-token context,
  no Python per token): the figure the README quotes;
- llama-cpp-python on the native libraries (`eval` one token at a time, argmax in numpy: the same loop as
  ours), which adds a Python call and a copy of the logits per token.
Each round runs every pair, ours then both of theirs, so all see the same load; each figure is the median
over rounds with its min and max. The decode length is capped at block_size - prompt (llama.cpp's learned
positions end there; ours would slide).

`--as-avx2` approximates a CPU without AVX-512 and without native bf16 on this one (harness.AS_AVX2: PyTorch,
MKL, oneDNN and our kernels on their AVX2 code, our precision policy as for such a CPU) against llama.cpp built
as for any AVX2 CPU (`llamacpp_native.py --avx2`): the code paths such a CPU runs, on this machine's memory and
clock.

Writes bench/results/llamacpp.{json,md} (or --out; with --as-avx2, llamacpp-avx2). The goal (issue 43),
GPT-2 124M, 2 threads, against llama-bench: ours / llama.cpp >= 1.0 with --compile at each precision, >= 0.8
eager.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402
import llamacpp_native  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402
from gpt.checkpoints import native  # noqa: E402
from gpt.checkpoints.gguf import write_gguf  # noqa: E402
from gpt.checkpoints.loader import load_checkpoint, load_for_inference  # noqa: E402
from gpt.data.tokenizer import CharTokenizer  # noqa: E402
from gpt.infer import llamacpp  # noqa: E402
from gpt.infer.sampling import SampleConfig, generate  # noqa: E402
from gpt.model import rowkernels  # noqa: E402
from gpt.runtime import cpu_has_native_bf16  # noqa: E402

MODELS = {
    "gpt2": (dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304), {"kind": "gpt2"}),
    "char": (dict(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=128, bias=False, activation="gelu"), None),
}
PAIRS = [
    ("float32", "none", False, "f32"),
    ("bfloat16", "none", False, "f16"),
    ("float32", "int8", False, "q8_0"),
    ("float32", "none", True, "f32"),
    ("bfloat16", "none", True, "f16"),
    ("float32", "int8", True, "q8_0"),
    ("float32", "int4", False, "q4_0"),
    ("float32", "int4", True, "q4_0"),
]  # ours dtype, quantize, --compile; theirs
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks? It is the east"


def random_checkpoint(name: str, directory: Path) -> Path:
    cfg, spec = MODELS[name]
    if spec is None:
        spec = CharTokenizer.from_text((harness.SHARED_DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")).spec
    model = GPT(GPTConfig(**cfg))
    path = directory / f"{name}.pt"
    native.save(path, {"model": model.state_dict()}, native.build_meta(model.config.to_dict(), spec))
    return path


def load_ours(ckpt: Path, dtype: str, quantize: str, compile_step: bool, threads: int, prompt: list[int]):
    """sample.py's model and tokenizer, warmed up (with --compile: compiled), and the seconds that took."""
    t0 = time.perf_counter()
    _, model, tok, _, _ = load_for_inference(ckpt, "cpu", dtype, threads, quantize, compile_step=compile_step)
    cfg = SampleConfig(max_new_tokens=4, temperature=0.0, stop_at_eot=False, num_samples=1)
    list(generate(model, tok, prompt, cfg))  # warm-up; the compiled step compiles here
    return model, tok, time.perf_counter() - t0


def ours(model, tok, prompt: list[int], n: int) -> tuple[float, float]:
    """(prefill seconds to the first token, decode tokens/s after it) of sample.py's path, greedy."""
    cfg = SampleConfig(max_new_tokens=n, temperature=0.0, stop_at_eot=False, num_samples=1)
    t0 = time.perf_counter()
    first = None
    for _ in generate(model, tok, prompt, cfg):
        first = first or time.perf_counter()
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first)


def theirs(llm, prompt: list[int], n: int) -> tuple[float, float]:
    """The same for llama-cpp-python: eval the prompt, then one token at a time, argmax of the last logits."""
    llm.reset()
    llm.eval(prompt[:4])  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    first = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([nxt])
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    end = time.perf_counter()
    return first - t0, (n - 1) / (end - first)


def llama_bench(binary: Path, gguf: Path, depth: int, n: int, threads: int) -> float:
    """llama.cpp's own benchmark: tokens/s generating `n` tokens after a `depth`-token context (one repetition
    after its warm-up run)."""
    cmd = [binary, "-m", gguf, "-p", "0", "-n", str(n), "-d", str(depth), "-t", str(threads), "-r", "1", "-o", "json"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, check=True).stdout
    (result,) = json.loads(out)
    return float(result["avg_ts"])


def bench_model(name, ckpt, pairs, threads, rounds, new_tokens, tmp: Path, bench_bin: Path | None) -> list[dict]:
    model, tok, meta = load_checkpoint(ckpt)
    prompt = tok.encode(PROMPT)[:22]
    n = min(new_tokens, model.config.block_size - len(prompt))
    files = {}
    for *_, quant in pairs:
        files[quant] = tmp / f"{name}-{quant}.gguf"
        write_gguf(model, tok, files[quant], quant, meta.get("chat_template"))
    del model
    llms = {
        q: llamacpp.open_gguf(p, n_ctx=len(prompt) + n, n_threads=threads, logits_all=False, kv_f32=False)
        for q, p in files.items()
    }
    loaded = {}
    for pair in pairs:  # each loaded (and compiled) once; the rounds decode
        loaded[pair] = load_ours(ckpt, *pair[:3], threads, prompt)
        print(f"{name}: {pair[:3]} loaded and warmed up in {loaded[pair][2]:.1f} s", file=sys.stderr)
    runs = {pair: [] for pair in pairs}
    for r in range(rounds):
        for pair in pairs:
            quant = pair[3]
            got = {
                "ours": ours(*loaded[pair][:2], prompt, n),
                "python": theirs(llms[quant], prompt, n),
                # n - 1: the tokens ours and llama-cpp-python time, after the first
                "bench": llama_bench(bench_bin, files[quant], len(prompt), n - 1, threads) if bench_bin else None,
            }
            runs[pair].append(got)
            print(f"{name} round {r + 1}: {pair}: {got}", file=sys.stderr)
    rows = []
    for (dtype, quantize, compiled, quant), got in runs.items():
        row = {
            "model": name,
            "ours": (dtype if quantize == "none" else quantize) + (" --compile" if compiled else ""),
            "llama_cpp": quant,
            "ours_load_and_warmup_s": loaded[dtype, quantize, compiled, quant][2],
            "prompt_tokens": len(prompt),
            "new_tokens": n,
            "ours_prefill_s": harness.spread(g["ours"][0] for g in got),
            "ours_tok_s": harness.spread(g["ours"][1] for g in got),
            "python_prefill_s": harness.spread(g["python"][0] for g in got),
            "python_tok_s": harness.spread(g["python"][1] for g in got),
            "ratio_python": harness.spread(g["ours"][1] / g["python"][1] for g in got),
            "rounds": got,
        }
        if bench_bin:
            row["bench_tok_s"] = harness.spread(g["bench"] for g in got)
            row["ratio"] = harness.spread(g["ours"][1] / g["bench"] for g in got)
        rows.append(row)
    return rows


def _spread(s: dict, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return f"{fmt.format(scale * s['median'])} ({fmt.format(scale * s['min'])}-{fmt.format(scale * s['max'])})"


def markdown(rows: list[dict], info: dict) -> str:
    m = info["machine"]
    lines = [
        f"Batch-1 greedy decode, {info['threads']} threads, {m['cpu']} ({m.get('cpu_family_model', '')}, torch "
        f"capability {m['capability']}, native bf16 {m['native_bf16']}), torch {m['torch']}, commit "
        f"{m.get('commit', '?')}, {m.get('date', '?')}; llama.cpp {info['llama_cpp']}; medians (min-max) of "
        f"{info['rounds']} interleaved rounds; ratios are the median of each round's ratio."
        + (
            " Both sides as a CPU without AVX-512 or native bf16 runs them, approximated on this one (--as-avx2: "
            + ", ".join(f"{k}={v}" for k, v in info["as_avx2"].items())
            + ")."
            if "as_avx2" in info
            else ""
        ),
        "",
        "| model | ours | llama.cpp | new tokens | ours tok/s | llama-bench tok/s | ours / llama-bench "
        "| llama-cpp-python tok/s | ours / llama-cpp-python | ours load + warm-up s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bench = (_spread(r["bench_tok_s"]), f"**{_spread(r['ratio'], '{:.2f}')}x**") if "ratio" in r else ("-", "-")
        lines.append(
            f"| {r['model']} | {r['ours']} | {r['llama_cpp']} | {r['new_tokens']} | {_spread(r['ours_tok_s'])} | "
            f"{bench[0]} | {bench[1]} | {_spread(r['python_tok_s'])} | {_spread(r['ratio_python'], '{:.2f}')}x | "
            f"{r['ours_load_and_warmup_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="gpt2,char", help="comma-separated: gpt2, char")
    p.add_argument("--ckpt", help="a run or checkpoint to use as the char model instead of random weights")
    p.add_argument("--threads", type=int, default=2, help="threads for both (torch and llama.cpp)")
    p.add_argument(
        "--pairs",
        default="f32,f16,q8_0",
        help="comma-separated, by llama.cpp's side: f32, f16 (bf16 ours), q8_0, q4_0 (int4 ours)",
    )
    p.add_argument(
        "--no-compile", action="store_true", help="leave out the --compile rows (their compiles take minutes)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--portable",
        action="store_true",
        help="llama.cpp as the installed llama-cpp-python wheel has it (no llama-bench) instead of the native build",
    )
    p.add_argument(
        "--as-avx2",
        action="store_true",
        help="both sides as a CPU without AVX-512 or native bf16 runs them (module notes); llama.cpp's AVX2 build",
    )
    p.add_argument("--new-tokens", type=int, default=256, help="greedy tokens (capped at block_size - prompt)")
    p.add_argument("--out", help="writes OUT.json and OUT.md (default bench/results/llamacpp, or llamacpp-avx2)")
    args = p.parse_args()
    as_avx2 = harness.as_avx2() if args.as_avx2 else None
    bench_bin = None
    if not args.portable:  # the native (or AVX2) libraries, loaded by llama-cpp-python instead of its own
        native_bin = llamacpp_native.ensure(args.as_avx2) / "bin"
        os.environ["LLAMA_CPP_LIB_PATH"] = str(native_bin)
        bench_bin = native_bin / "llama-bench"
    import llama_cpp

    torch.set_num_threads(args.threads)
    wanted = set(args.pairs.split(","))
    if not wanted <= {pair[3] for pair in PAIRS}:
        p.error(f"--pairs: {args.pairs!r}: each one of f32, f16, q8_0, q4_0")
    bf16 = cpu_has_native_bf16() or rowkernels.library() is not None  # else bf16 products are emulated
    pairs = [pair for pair in PAIRS if pair[3] in wanted and (pair[0] != "bfloat16" or bf16)]
    if args.no_compile:
        pairs = [pair for pair in pairs if not pair[2]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            ckpt = Path(args.ckpt) if (args.ckpt and name == "char") else random_checkpoint(name, Path(tmp))
            rows += bench_model(name, ckpt, pairs, args.threads, args.rounds, args.new_tokens, Path(tmp), bench_bin)
    info = {
        "machine": harness.machine(),
        "threads": args.threads,
        "rounds": args.rounds,
        "llama_cpp": f"{llama_cpp.__version__}'s sources, "
        + (
            "the installed wheel (llama-cpp-python only)"
            if args.portable
            else "built for any AVX2 CPU (GGML_NATIVE=OFF)"
            if args.as_avx2
            else "built natively (-march=native)"
        ),
        "bf16_pair": "run" if any(p[0] == "bfloat16" for p in pairs) else "skipped: no native bf16, no C kernels",
    }
    if as_avx2:
        info["as_avx2"] = as_avx2
    out = Path(args.out or ROOT / "bench" / "results" / ("llamacpp-avx2" if args.as_avx2 else "llamacpp"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, info))
    print(markdown(rows, info))


if __name__ == "__main__":
    main()

"""Quantisation-aware training against quantising after training: val loss of int8 / int4 / Q4_0 models.

    python bench/bench_qat.py                     # the main job's char model and a GPT-2 BPE model, 3 seeds
    python bench/bench_qat.py --models char --seeds 0 --base-steps 100 --steps 20   # a quick check that it runs

For each model: a base trained in float32 (the main job's recipe, `--config shakespeare_char_cpu`, on
tiny-shakespeare; the BPE model is the same shape over GPT-2's tokenizer), then fine-tuned from it for the
same budget (`--steps`, AdamW) three ways, per seed:
- `float`: plain fine-tuning; its checkpoint then quantised after training (PTQ) to int8, int4 (groups of 32)
  and Q4_0 (a GGUF run by llama.cpp);
- `qat int4`: `gpt train --qat int4`, then `--quantize int4`;
- `qat q4_0`: `gpt train --qat q4_0`, then exported to a Q4_0 GGUF, run by llama.cpp.
Val loss is the mean next-token loss over the whole val split in consecutive windows of the block size (ours:
the model as `gpt sample` loads it; llama.cpp: llama-cpp-python's logits over the same windows), in nats per
token, and bits per byte for the char model (one byte a token). Training is deterministic for a seed, so the
figures do not depend on the machine's load (wall times are not reported).

Writes bench/results/qat.{json,md} (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

from gpt.checkpoints.gguf import write_gguf  # noqa: E402
from gpt.checkpoints.loader import load_for_inference  # noqa: E402
from gpt.data.tokens import open_dataset  # noqa: E402
from gpt.infer import llamacpp  # noqa: E402
from gpt.train.start import resolve_run  # noqa: E402
from gpt.train.trainer import train  # noqa: E402

TOKENIZERS = {"char": "char", "bpe": "gpt2"}
FINETUNE = ["--optimizer", "adamw", "--learning-rate", "1e-3", "--min-lr", "1e-4", "--warmup-iters", "0"]


def prepare(kind: str, out: Path) -> Path:
    text = harness.SHARED_DATA / "tinyshakespeare.txt"
    cmd = [sys.executable, "-m", "gpt", "prepare", str(text), "--out", str(out), "--tokenizer", TOKENIZERS[kind]]
    subprocess.run([*cmd, "--quiet"], cwd=ROOT, check=True)
    return out


def run(*argv) -> None:
    train(resolve_run([str(a) for a in argv]))


def val_ids(data: Path) -> np.ndarray:
    return np.asarray(open_dataset(data).split("val"), dtype=np.int64)


def windows(ids: np.ndarray, block: int) -> torch.Tensor:
    n = (len(ids) - 1) // block
    return torch.from_numpy(ids[: n * block + 1].copy())


def ours(ckpt: Path, ids: np.ndarray, quantize: str) -> float:
    """Mean next-token loss of the checkpoint, loaded as `gpt sample --quantize` loads it."""
    _, model, _, _, _ = load_for_inference(ckpt, "cpu", "float32", 0, quantize)
    block = model.config.block_size
    flat = windows(ids, block)
    n = (len(flat) - 1) // block
    x, y = flat[:-1].view(n, block), flat[1:].view(n, block)
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 64):
            logits = model(x[i : i + 64])[0].float()
            total += F.cross_entropy(logits.flatten(0, 1), y[i : i + 64].flatten(), reduction="sum").item()
    return total / (n * block)


def llama(ckpt: Path, ids: np.ndarray, tmp: Path) -> float:
    """The same loss of the checkpoint exported to a Q4_0 GGUF and run by llama.cpp."""
    from gpt import load_checkpoint

    model, tok, meta = load_checkpoint(ckpt)
    path = tmp / "m.gguf"
    write_gguf(model, tok, path, "q4_0", meta.get("chat_template"))
    block = model.config.block_size
    llm = llamacpp.open_gguf(path, n_ctx=block, n_threads=torch.get_num_threads())
    flat = windows(ids, block).numpy()
    n, total = (len(flat) - 1) // block, 0.0
    for i in range(n):
        logits = llamacpp.logits(llm, flat[i * block : (i + 1) * block].tolist())
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total -= logp[np.arange(block), flat[i * block + 1 : (i + 1) * block + 1]].sum()
    return float(total / (n * block))


def bench_model(kind: str, seeds: list[int], base_steps: int, steps: int, tmp: Path) -> dict:
    data = prepare(kind, tmp / f"data-{kind}")
    ids = val_ids(data)
    base = tmp / f"{kind}-base"
    recipe = ["--config", "shakespeare_char_cpu", "--max-iters", base_steps, "--lr-decay-iters", base_steps]
    run(*recipe, "--data", data, "--out-dir", base, "--dtype", "float32", "--eval-interval", base_steps, "--no-plot")
    out = {"base": {"float32": ours(base, ids, "none"), "int4": ours(base, ids, "int4")}, "seeds": {}}
    for seed in seeds:
        common = ["--init-from", base, "--data", data, "--max-iters", steps, "--lr-decay-iters", steps]
        common += [*FINETUNE, "--seed", seed, "--dtype", "float32", "--eval-interval", steps, "--no-plot"]
        got = {}
        for name, extra in (("float", []), ("qat int4", ["--qat", "int4"]), ("qat q4_0", ["--qat", "q4_0"])):
            ckpt = tmp / f"{kind}-{seed}-{name.replace(' ', '-')}"
            run(*common, "--out-dir", ckpt, *extra)
            if name == "float":
                got["float32"] = ours(ckpt, ids, "none")
                got["ptq int8"] = ours(ckpt, ids, "int8")
                got["ptq int4"] = ours(ckpt, ids, "int4")
                got["ptq q4_0 llama-cpp"] = llama(ckpt, ids, tmp)
            elif name == "qat int4":
                got["qat int4"] = ours(ckpt, ids, "int4")
            else:
                got["qat q4_0 llama-cpp"] = llama(ckpt, ids, tmp)
        out["seeds"][seed] = got
        print(kind, seed, json.dumps(got), file=sys.stderr)
    names = next(iter(out["seeds"].values())).keys()
    out["loss"] = {n: harness.spread(s[n] for s in out["seeds"].values()) for n in names}
    return out


def markdown(results: dict, info: dict) -> str:
    m = info["machine"]
    lines = [
        f"Val loss (nats/token; char: bits per byte = nats / ln 2) after {info['steps']} fine-tuning steps from a "
        f"float32 base, medians (min-max) over seeds {info['seeds']}; {m['cpu']}, torch {m['torch']}, commit "
        f"{m['commit']}, {m['date']}.",
        "",
        "| model | float32 | PTQ int8 | PTQ int4 | QAT int4 | PTQ Q4_0 (llama.cpp) | QAT Q4_0 (llama.cpp) |",
        "|---|---|---|---|---|---|---|",
    ]
    order = ["float32", "ptq int8", "ptq int4", "qat int4", "ptq q4_0 llama-cpp", "qat q4_0 llama-cpp"]
    for kind, r in results.items():
        cells = [f"{r['loss'][n]['median']:.4f} ({r['loss'][n]['min']:.4f}-{r['loss'][n]['max']:.4f})" for n in order]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="char,bpe", help="comma-separated: char, bpe")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated fine-tuning seeds")
    p.add_argument("--base-steps", type=int, default=400, help="the base's steps (the main job's: 400)")
    p.add_argument("--steps", type=int, default=200, help="fine-tuning steps of each arm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "qat"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            results[kind] = bench_model(kind, seeds, args.base_steps, args.steps, Path(tmp))
    info = {"machine": harness.machine(), "seeds": seeds, "steps": args.steps, "base_steps": args.base_steps}
    info["threads"] = args.threads
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"info": info, "models": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results, info))
    print(markdown(results, info))
    assert all(math.isfinite(v["median"]) for r in results.values() for v in r["loss"].values())


if __name__ == "__main__":
    main()

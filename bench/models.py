"""The CPU benchmark models, trained briefly on tiny-shakespeare with train.py and cached in out/bench-models/.

    python bench/models.py                 # train whatever is missing (about 12 minutes on 2 busy cores)
    from models import ensure, val_tokens  # bench_sampling.py (int8 val loss) and bench_serve.py use them

| name      | tokenizer            | layers x heads x embd | block | training (float32, AdamW)                      |
|-----------|----------------------|-----------------------|-------|------------------------------------------------|
| char-cpu  | characters (66 ids)  | 4 x 4 x 128           | 64    | 800 steps of 24 x 64, lr 5e-3, tanh GELU (the main job's earlier recipe) |
| char-gpu  | characters (66 ids)  | 6 x 6 x 384           | 256   | 80 steps of 8 x 256 tokens, lr 1e-3           |
| bpe-6x384 | GPT-2 BPE (50304 rows) | 6 x 6 x 384         | 256   | 80 steps of 8 x 256 tokens, lr 1e-3           |

The shapes are bench_sampling.py's (the char ones are nanoGPT's CPU and GPU shakespeare-char
models). They are trained in float32 (this CPU has no native bf16: bf16 autocast ran 10-30x slower)
on one thread (on a shared machine a second thread mostly waits for a busy core). The 6 x 384 models are far from converged (a few minutes of training); they are real
trained weights for the int8 loss comparison and text without end-of-text for the serving load
test, not good language models. The validation split is the last 10% of the text (data/prepare.py's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import harness
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = harness.SHARED_DATA  # (harness also points GPT2_TIKTOKEN_FILE at it, offline)
CACHE = ROOT / "out" / "bench-models"
SIX_384 = [
    "--n-layer",
    "6",
    "--n-head",
    "6",
    "--n-embd",
    "384",
    "--block-size",
    "256",
    "--batch-size",
    "8",
    "--max-iters",
    "80",
    "--learning-rate",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--warmup-iters",
    "10",
    "--eval-interval",
    "80",
    "--eval-iters",
    "4",
    "--log-interval",
    "10",
]
MODELS = {
    "char-cpu": (
        "char",
        [
            "--config",
            "shakespeare_char_cpu",
            "--optimizer",
            "adamw",
            "--n-layer",
            "4",
            "--activation",
            "gelu_tanh",
            "--batch-size",
            "24",
            "--max-iters",
            "800",
            "--lr-decay-iters",
            "800",
            "--learning-rate",
            "5e-3",
            "--min-lr",
            "5e-4",
            "--eval-interval",
            "400",
            "--eval-train",
        ],
    ),
    "char-gpu": ("char", SIX_384),
    "bpe-6x384": ("gpt2", SIX_384),
}
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def dataset(kind: str) -> Path:
    """tiny-shakespeare prepared with the `char` or `gpt2` tokenizer (cached)."""
    out = CACHE / "data" / kind
    if not (out / "meta.json").exists():
        subprocess.run(
            [
                sys.executable,
                "data/prepare.py",
                str(SHARED / "tinyshakespeare.txt"),
                "--out",
                str(out),
                "--tokenizer",
                kind,
                "--block-size",
                "256",
                "--force",
                "--quiet",
            ],
            cwd=ROOT,
            env=ENV,
            check=True,
        )
    return out


def ensure(name: str) -> Path:
    """The run directory of a trained benchmark model, training it first if it is not cached."""
    kind, args = MODELS[name]
    out = CACHE / name
    stamp = out / "bench-args.json"
    if (out / "best.pt").exists() and stamp.exists() and json.loads(stamp.read_text()) == args:
        return out
    print(f"training the benchmark model {name} into {out} ...", file=sys.stderr, flush=True)
    subprocess.run(
        [
            sys.executable,
            "train.py",
            "--data",
            str(dataset(kind)),
            "--out-dir",
            str(out),
            "--force",
            "true",
            "--dtype",
            "float32",
            "--threads",
            "1",
            *args,
        ],
        cwd=ROOT,
        env=ENV,
        check=True,
        stdout=sys.stderr,
    )
    stamp.write_text(json.dumps(args))
    return out


def val_tokens(name: str) -> np.ndarray:
    """The model's validation split as token ids."""
    data = dataset(MODELS[name][0])
    meta = json.loads((data / "meta.json").read_text())
    return np.fromfile(data / "val.bin", dtype=meta["dtype"]).astype(np.int64)


if __name__ == "__main__":
    for model in MODELS:
        print(model, ensure(model))

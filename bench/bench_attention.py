"""Does keeping attention weights on call cost the normal forward anything? The model of this checkout
against the model of an earlier commit (before `GPT.attention_maps` existed), side by side.

    python bench/bench_attention.py                       # against 9a05ad0, about a minute on 2 cores
    python bench/bench_attention.py --before HEAD~5 --reps 30

Both models (`git show REV:gpt/model/transformer.py`, loaded as a module of its own) get the same
config and weights, and the same batch; their logits are checked equal first. Then, interleaved, each
rep times a forward without gradients and a forward + backward of each; the medians and their ratio
(now / before) are reported, and the recording forward (`attention_maps`) for scale. CPU, float32, the
threads PyTorch picks. Writes bench/results/attention.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
import torch  # noqa: E402

from gpt.model.config import GPTConfig  # noqa: E402
from gpt.model.transformer import GPT  # noqa: E402


def model_at(rev: str):
    """The GPT class of gpt/model/transformer.py at git revision `rev`."""
    source = subprocess.run(
        ["git", "show", f"{rev}:gpt/model/transformer.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "transformer_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("transformer_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="9a05ad0", help="the revision to compare with (default: %(default)s)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention.json"))
    args = p.parse_args()
    cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.0)
    torch.manual_seed(0)
    now = GPT(cfg)
    before = model_at(args.before)(cfg)
    before.load_state_dict(now.state_dict())
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    now.eval(), before.eval()
    with torch.no_grad():
        assert torch.equal(now(x)[0], before(x)[0]), "the two models disagree"

    def forward(model):
        with torch.no_grad():
            model(x)

    def train_step(model):
        model.zero_grad(set_to_none=True)
        model(x, y)[1].backward()

    times = {k: [] for k in ("fwd_now", "fwd_before", "step_now", "step_before", "maps")}
    for model in (now, before):  # warm-up
        forward(model)
        train_step(model)
    for _ in range(args.reps):
        times["fwd_now"].append(timed(lambda: forward(now)))
        times["fwd_before"].append(timed(lambda: forward(before)))
        times["step_now"].append(timed(lambda: train_step(now)))
        times["step_before"].append(timed(lambda: train_step(before)))
        times["maps"].append(timed(lambda: now.attention_maps(x)))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "machine": harness.machine(),
        "config": {"n_layer": 6, "n_head": 6, "n_embd": 384, "batch": 8, "block_size": 256, "dtype": "float32"},
        "before": args.before,
        "reps": args.reps,
        "median_ms": {k: round(v * 1000, 2) for k, v in med.items()},
        "forward_ratio_now_over_before": round(med["fwd_now"] / med["fwd_before"], 3),
        "train_step_ratio_now_over_before": round(med["step_now"] / med["step_before"], 3),
        "maps_over_forward": round(med["maps"] / med["fwd_now"], 2),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

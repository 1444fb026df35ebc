"""What a sliding window costs in quality: the same small model trained at block 1024 with full attention and
with windows of 128 (alone, and with 4 global tokens), on a BPE corpus, at equal steps over 3 seeds; val loss
and bits per byte, and each run's val curve against its wall time (for the comparison at equal time).

    python bench/bench_window_quality.py                  # 200 steps, seeds 0..2
    python bench/bench_window_quality.py --steps 20 --seeds 1 --eval-every 10   # a smoke run

1. data: WikiText-2's validation text (the stored copy has validation and test only) as the training text,
   with a BPE of --vocab tokens trained on it (`gpt prepare --tokenizer bpe`; 10% held out as val).
2. per attention pattern and seed: `gpt train` at --block tokens, 4 layers x 128, batch 2, --steps steps,
   an evaluation every --eval-every steps (the val loss over --eval-iters batches), one thread.
3. results: the final val loss and bits per byte per run, their median over seeds; each run's curve of
   (step, elapsed seconds, val loss). Wall times come from a machine that may be shared (`machine.loadavg`
   records the load at the start): equal-step figures do not depend on it, equal-time ones do.

Results: `window-quality.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
PATTERNS = {"full": [], "window 128": ["--attention-window", "128"],
            "window 128 and 4 global": ["--attention-window", "128", "--global-tokens", "4"]}  # fmt: skip
MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--bias", "false", "--pos-encoding", "rope"]
QUIET = ["--no-plot", "--log-interval", "25", "--device", "cpu", "--dtype", "float32", "--threads", "1"]


def prepare(work: Path, vocab: int) -> Path:
    out = work / "data"
    if (out / "meta.json").is_file():
        return out
    cmd = [sys.executable, "-m", "gpt", "prepare", str(SHARED / "wikitext2-valid.txt"), "--out", str(out)]
    cmd += ["--tokenizer", "bpe", "--vocab-size", str(vocab), "--val-fraction", "0.1", "--quiet"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def train(data: Path, out: Path, flags: list, args, seed: int) -> dict:
    cmd = [sys.executable, "-m", "gpt", "train", "--data", data, "--out-dir", out, "--force", *QUIET, *MODEL, *flags]
    cmd += ["--block-size", args.block, "--batch-size", "2", "--max-iters", args.steps, "--lr-decay-iters", args.steps]
    cmd += ["--eval-interval", args.eval_every, "--eval-iters", args.eval_iters, "--seed", seed]
    cmd += ["--learning-rate", "1e-3", "--min-lr", "1e-4", "--warmup-iters", "20"]
    run = harness.launch(cmd, ROOT, out.parent / f"{out.name}.log", timeout=7200, env={"OMP_NUM_THREADS": "1"})
    if run["returncode"] != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{harness.tail(run)}")
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    ms = [r["ms_per_step"] for r in rows if r["kind"] == "train" and r["step"] > 1]
    return {
        "val_loss": evals[-1]["val_loss"],
        "val_bpb": evals[-1].get("val_bpb"),
        "ms_per_step_median": statistics.median(ms) if ms else None,
        "curve": [{"step": r["step"], "elapsed_s": r.get("elapsed"), "val_loss": r["val_loss"]} for r in evals],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_window_quality"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    data = prepare(args.work, args.vocab)
    out = {"machine": {**harness.machine(), "loadavg": os.getloadavg()[0]}, "commit": harness.commit()}
    out["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out["settings"]["model"] = MODEL
    runs: dict[str, list[dict]] = {}
    for seed in range(args.seeds):  # seeds outermost: a cut-short run still has every pattern for some seeds
        for name, flags in PATTERNS.items():
            run = train(data, args.work / f"{name.replace(' ', '-').replace('+', '')}-s{seed}", flags, args, seed)
            runs.setdefault(name, []).append(run)
            print(f"{name:22s} seed {seed}: val {run['val_loss']:.4f}, {run['ms_per_step_median']:.0f} ms/step")
    out["runs"] = runs
    out["summary"] = {
        name: {
            "val_loss": harness.spread([r["val_loss"] for r in rs]),
            "val_bpb": harness.spread([r["val_bpb"] for r in rs]) if all(r["val_bpb"] for r in rs) else None,
            "ms_per_step": harness.spread([r["ms_per_step_median"] for r in rs]),
        }
        for name, rs in runs.items()
    }
    full = out["summary"]["full"]["val_loss"]["median"]
    for s in out["summary"].values():
        s["val_loss_minus_full"] = s["val_loss"]["median"] - full
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "window-quality.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.results / 'window-quality.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""DPO's reference log-probs, computed once for every pair and kept on disk for the run (--reference-cache).

    gpt train --objective dpo --init-from out/chat --data data/prefs --out-dir out/dpo --reference-cache
    cache = load_or_compute(objective, task, cfg, rt)   # (pairs of train then val, 2): chosen, rejected

Before the first step the reference reads every pair of both splits once (the split's pairs in order, in
batches of the evaluation's size); the (chosen, rejected) summed log-probs go to OUT_DIR/reference_logps.pt
with what they were computed from: the reference's path and a fingerprint of its weights, the dataset's
checksums and the precision. A resumed run reads them back when all of that still matches, else computes
them again. The steps then look the pairs' values up (a batch carries its pairs' numbers) instead of running
the reference, which is freed: a step costs one forward and backward of the policy, not two forwards and a
backward, and the reference holds no memory.

Footguns: every process computes the whole cache itself (no file is awaited); the first writes the file.
Values equal the per-micro-batch ones up to float rounding (another batch, another padding length).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpt.data.format import SPLITS
from gpt.data.preference_batches import eval_batches
from gpt.fsutil import replacing
from gpt.progress import Progress

FILE = "reference_logps.pt"


def fingerprint(model: torch.nn.Module) -> list[float]:
    """Sums of the model's weights and of their squares (float64): another checkpoint gives other numbers."""
    total, squares = 0.0, 0.0
    for p in model.parameters():
        total += float(p.detach().double().sum())
        squares += float(p.detach().double().square().sum())
    return [total, squares]


def compute(objective, ds, batch_size: int, device) -> torch.Tensor:
    """(pairs over both splits, 2) float32: the reference's summed log-probs of each pair's answers."""
    out = torch.empty(ds.pairs("train") + ds.pairs("val"), 2)
    bar = Progress("reference log-probs", len(out), unit="pairs", scale=1)
    for split in SPLITS:
        for x, y, _, ids in eval_batches(ds, split, batch_size, 0, device):
            ref = objective.reference_logps(x, y).float().cpu()
            out[ids.cpu()] = torch.stack(ref.split(len(ids)), dim=1)
            bar.update(len(ids))
    bar.close(keep=False)
    return out


def load_or_compute(objective, task, cfg, rt) -> torch.Tensor:
    """The cache of OUT_DIR when it was computed from this reference, data and precision, else a new one
    (written by the first process); the reference is freed either way."""
    path = Path(cfg.out_dir) / FILE
    key = {
        "reference": str(cfg.reference),
        "weights": fingerprint(objective.reference),
        "dataset": [task.dataset.meta["splits"][s]["sha256"] for s in SPLITS],
        "dtype": str(rt.dtype),
    }
    logps = None
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("key") == key:
            logps = saved["logps"]
    if logps is None:
        logps = compute(objective, task.dataset, cfg.eval_batch_size or cfg.batch_size, rt.device)
        if rt.master:
            with replacing(path) as tmp:
                torch.save({"key": key, "logps": logps}, tmp)
    objective.reference = None
    return logps.to(rt.device)

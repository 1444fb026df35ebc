"""Batches of a preference dataset: each pair's chosen and rejected sequences, padded, the answers' tokens
the targets.

    ds = open_preferences("data/prefs")                        # written by gpt prepare --preferences
    batches = PreferenceBatches(ds, "train", batch_size=8, seed=0)
    x, y, z, ids = batches.get(step, micro_step)               # (2B, T): B chosen rows, then their B rejected

Row i of the first half and row B + i of the second are one pair's chosen and rejected sequences (prompt +
answer), right-padded with id 0 to the batch's longest, less one (x is a sequence's tokens but its last, y
the next tokens). `y[t]` is the next token where it is an answer's, else -1: the prompt and the padding are
never targets (`z[t]`, ORPO's, is any next token but the padding), and causal attention keeps padding from changing a real position's logits. A model's summed
log-probability of `y` over a row is the answer's log-likelihood given its prompt, what DPO and ORPO compare.

Each epoch shuffles the pairs (a pure function of seed and epoch); a batch is addressed by (step,
micro-step, rank), so a resumed run draws exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpt.data.chat import ChatTemplate
from gpt.data.format import SPLITS, DataError, check_ids, memmap_ids, prepare_hint, read_meta


class PreferenceDataset:
    """A preference dataset's sequences (memory-mapped ids, the answers' mask) and where each starts."""

    def __init__(self, path: Path, meta: dict, ids: dict, mask: dict, starts: dict):
        self.path, self.meta = path, meta
        self.vocab_size = int(meta["vocab_size"])
        spec = meta.get("chat_template")
        self.template = ChatTemplate.from_spec(spec, f"{path}/meta.json") if spec else None
        self.ids, self.mask, self.starts = ids, mask, starts

    def pairs(self, split: str) -> int:
        return (len(self.starts[split]) - 1) // 2

    def lengths(self, split: str) -> np.ndarray:
        """Each sequence's length: pair i's chosen at 2i, its rejected at 2i + 1."""
        return np.diff(self.starts[split])

    def sequence(self, split: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.starts[split][k], self.starts[split][k + 1]
        return np.asarray(self.ids[split][a:b], dtype=np.int64), np.asarray(self.mask[split][a:b], dtype=bool)


def open_preferences(path: str | Path) -> PreferenceDataset:
    """Open a preference dataset directory, checking meta.json against its files (sizes, index, ids)."""
    path = Path(path)
    meta = read_meta(path, "preferences")
    hint = prepare_hint("preferences", path)
    ids, mask, starts = {}, {}, {}
    for name in SPLITS:
        entry = meta["splits"][name]
        file = path / entry["file"]
        ids[name] = memmap_ids(file, meta["dtype"], entry["tokens"], hint)
        check_ids(ids[name], meta["vocab_size"], name, file, entry["max_id"])
        mask[name] = memmap_ids(path / entry["mask"], "uint8", entry["tokens"], hint)
        index = path / entry["index"]
        if not index.is_file():
            raise DataError(f"no {index.name} in {path}: {hint}")
        s = starts[name] = np.fromfile(index, dtype="<i8")
        if len(s) != 2 * entry["pairs"] + 1 or s[0] != 0 or s[-1] != entry["tokens"] or np.any(np.diff(s) < 2):
            raise DataError(f"{index} does not index the {entry['pairs']:,} pairs of {file}: {hint}")
    return PreferenceDataset(path, meta, ids, mask, starts)


def batch(ds: PreferenceDataset, split: str, pairs: list[int]):
    """(x, y, z, ids): x, y, z int64 (2 x len(pairs), longest - 1), the chosen sequences, then the rejected; y the
    answers' next tokens, z every next token but the padding, -1 elsewhere (module docstring); ids the pairs'
    numbers over both splits (train's first, then val's: what a cache of per-pair values is indexed by)."""
    seqs = [ds.sequence(split, 2 * i + side) for side in (0, 1) for i in pairs]
    T = max(len(ids) for ids, _ in seqs)
    tokens = np.zeros((len(seqs), T), dtype=np.int64)
    target = np.zeros((len(seqs), T), dtype=bool)
    real = np.zeros((len(seqs), T), dtype=bool)
    for r, (ids, mask) in enumerate(seqs):
        tokens[r, : len(ids)], target[r, : len(ids)], real[r, : len(ids)] = ids, mask, True
    y = np.where(target[:, 1:], tokens[:, 1:], -1)
    z = np.where(real[:, 1:], tokens[:, 1:], -1)
    ids = np.asarray(pairs, dtype=np.int64) + (ds.pairs("train") if split == "val" else 0)
    return tuple(torch.from_numpy(a) for a in (tokens[:, :-1].copy(), y, z, ids))


class PreferenceBatches:
    """Training batches of pairs, a pure function of (seed, step, micro_step, rank)."""

    def __init__(
        self,
        ds: PreferenceDataset,
        split: str,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        device="cpu",
    ):
        self.ds, self.split, self.batch_size, self.seed = ds, split, batch_size, seed
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.device = torch.device(device)
        self._orders: dict[int, np.ndarray] = {}

    def order(self, e: int) -> np.ndarray:
        """The pairs of epoch `e`, in an order drawn from (seed, e)."""
        if e not in self._orders:
            self._orders = {e: np.random.default_rng([self.seed, 3, e]).permutation(self.ds.pairs(self.split))}
        return self._orders[e]

    def pairs(self, first: int, count: int) -> list[int]:
        """Pairs first .. first + count - 1 of the endless sequence of epochs."""
        n = self.ds.pairs(self.split)
        return [int(self.order(k // n)[k % n]) for k in range(first, first + count)]

    def get(self, step: int, micro_step: int = 0):
        k = (step * self.grad_accum + micro_step) * self.world_size + self.rank
        return tuple(
            t.to(self.device) for t in batch(self.ds, self.split, self.pairs(k * self.batch_size, self.batch_size))
        )


def eval_batches(ds: PreferenceDataset, split: str, batch_size: int, limit: int = 0, device="cpu"):
    """The split's pairs in order, in batches: all of them, or the first `limit` batches."""
    n = ds.pairs(split)
    starts = range(0, n, batch_size)
    for i in starts[:limit] if limit else starts:
        yield tuple(t.to(device) for t in batch(ds, split, list(range(i, min(n, i + batch_size)))))

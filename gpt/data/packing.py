"""Batches of a chat dataset: conversations packed into windows, the loss on the assistant's tokens.

    ds = open_chat_dataset("data/chat")                        # written by data/prepare.py --chat
    batches = PackedBatches(ds, "train", block_size=256, batch_size=16, seed=0)
    x, y, doc = batches.get(step, micro_step)                  # GPT.forward(x, y, doc=doc)

Each epoch shuffles the conversations (a pure function of seed and epoch) and packs them in that order
into rows of block_size + 1 tokens, next fit: a conversation goes into the current row if it fits, else
it starts the next one (a conversation is never split; prepare cut the longer ones to one window). Every
conversation is trained on once per epoch, and a row wastes only its tail.

In a row, `doc` numbers the conversations (padding has its own number), and the model attends within a
conversation only, positions restarting at its start (GPT.hidden), so a packed conversation gives the
same logits as alone. A target `y[t]` is the next token where that token is under the loss mask
(`loss_on="assistant"`: the assistant's words and end-of-turn) or any token of the same conversation
(`loss_on="all"`), else -1 (ignored): never across two conversations nor into padding.

Rows are addressed globally (step, then micro-step, then rank), so a run resumed at step N draws exactly
the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpt.data.chat import ChatTemplate
from gpt.data.format import SPLITS, DataError, check_ids, memmap_ids, prepare_hint, read_meta

LOSS_ON = ("assistant", "all")


class ChatDataset:
    """A chat dataset's conversations (ids and loss mask), read into memory (chat datasets are small)."""

    def __init__(self, path: Path, meta: dict, ids: dict, mask: dict, starts: dict):
        self.path, self.meta = path, meta
        self.vocab_size = int(meta["vocab_size"])
        self.template = ChatTemplate.from_spec(meta["chat_template"], f"{path}/meta.json")
        self.ids, self.mask, self.starts = ids, mask, starts

    def conversations(self, split: str) -> int:
        return len(self.starts[split]) - 1

    def lengths(self, split: str) -> np.ndarray:
        return np.diff(self.starts[split])

    def conversation(self, split: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.starts[split][i], self.starts[split][i + 1]
        return self.ids[split][a:b], self.mask[split][a:b]


def open_chat_dataset(path: str | Path) -> ChatDataset:
    """Open a chat dataset directory, checking meta.json against its files (sizes, index, ids)."""
    path = Path(path)
    meta = read_meta(path, "chat")
    hint = prepare_hint("chat", path)
    ids, mask, starts = {}, {}, {}
    for name in SPLITS:
        entry = meta["splits"][name]
        file = path / entry["file"]
        ids[name] = np.array(memmap_ids(file, meta["dtype"], entry["tokens"], hint), dtype=np.int64)
        check_ids(ids[name], meta["vocab_size"], name, file, None)
        mask[name] = np.array(memmap_ids(path / entry["mask"], "uint8", entry["tokens"], hint), dtype=bool)
        index = path / entry["index"]
        if not index.is_file():
            raise DataError(f"no {index.name} in {path}: {hint}")
        starts[name] = np.fromfile(index, dtype="<i8")
        s = starts[name]
        if len(s) != entry["conversations"] + 1 or s[0] != 0 or s[-1] != entry["tokens"] or np.any(np.diff(s) < 1):
            raise DataError(f"{index} does not index the {entry['conversations']:,} conversations of {file}: {hint}")
    return ChatDataset(path, meta, ids, mask, starts)


def pack(lengths: np.ndarray, order: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of conversation indices, `order` packed next fit into rows of `capacity` tokens."""
    rows, row, used = [], [], 0
    for i in order.tolist():
        n = int(lengths[i])
        if n > capacity:
            raise DataError(
                f"conversation {i} has {n} tokens, more than a window of {capacity}: prepare with --block-size"
            )
        if used + n > capacity:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += n
    if row:
        rows.append(row)
    return rows


def batch(ds: ChatDataset, split: str, rows: list[list[int]], block_size: int, loss_on: str = "assistant"):
    """(x, y, doc) int64 (len(rows), block_size) of the packed rows (see the module's docstring)."""
    B, T = len(rows), block_size
    tokens = np.zeros((B, T + 1), dtype=np.int64)
    target = np.zeros((B, T + 1), dtype=bool)
    doc = np.full((B, T + 1), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for n, i in enumerate(row):
            ids, mask = ds.conversation(split, i)
            tokens[r, at : at + len(ids)] = ids
            target[r, at : at + len(ids)] = mask if loss_on == "assistant" else True
            doc[r, at : at + len(ids)] = n
            at += len(ids)
        doc[r, at:] = len(row)  # the padding: a document of its own
    y = np.where((doc[:, 1:] == doc[:, :-1]) & target[:, 1:], tokens[:, 1:], -1)  # padding is never a target
    return torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(y), torch.from_numpy(doc[:, :-1].copy())


class PackedBatches:
    """Training batches of packed conversations, a pure function of (seed, step, micro_step, rank)."""

    def __init__(
        self,
        ds: ChatDataset,
        split: str,
        block_size: int,
        batch_size: int,
        seed: int = 0,
        loss_on: str = "assistant",
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        device="cpu",
    ):
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
        self.ds, self.split, self.block_size, self.batch_size = ds, split, block_size, batch_size
        self.seed, self.loss_on = seed, loss_on
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.device = torch.device(device)
        self._epochs: list[list[list[int]]] = []

    def epoch(self, e: int) -> list[list[int]]:
        """The packed rows of epoch `e`: the conversations in an order drawn from (seed, e)."""
        while len(self._epochs) <= e:
            n = len(self._epochs)
            order = np.random.default_rng([self.seed, 2, n]).permutation(self.ds.conversations(self.split))
            self._epochs.append(pack(self.ds.lengths(self.split), order, self.block_size + 1))
        return self._epochs[e]

    def rows(self, first: int, count: int) -> list[list[int]]:
        """Rows first .. first + count - 1 of the endless sequence of epochs."""
        out, e, offset = [], 0, first
        while len(out) < count:
            rows = self.epoch(e)
            if offset >= len(rows):
                offset -= len(rows)
            else:
                out += rows[offset : offset + count - len(out)]
                offset = 0
            e += 1
        return out

    def get(self, step: int, micro_step: int = 0):
        k = (step * self.grad_accum + micro_step) * self.world_size + self.rank
        x, y, doc = batch(
            self.ds, self.split, self.rows(k * self.batch_size, self.batch_size), self.block_size, self.loss_on
        )
        return x.to(self.device), y.to(self.device), doc.to(self.device)


def eval_batches(
    ds: ChatDataset, split: str, block_size: int, batch_size: int, loss_on: str = "assistant", device="cpu"
):
    """The split's conversations in order, packed, in batches: the whole split once."""
    rows = pack(ds.lengths(split), np.arange(ds.conversations(split)), block_size + 1)
    for i in range(0, len(rows), batch_size):
        x, y, doc = batch(ds, split, rows[i : i + batch_size], block_size, loss_on)
        yield x.to(device), y.to(device), doc.to(device)


def eval_rows(ds: ChatDataset, split: str, block_size: int) -> int:
    return len(pack(ds.lengths(split), np.arange(ds.conversations(split)), block_size + 1))

"""Token datasets on disk, read through np.memmap, and deterministic batches of windows.

    ds = open_dataset("data/shakespeare_char")          # checks meta.json against the files
    train = Batches(ds.split("train"), block_size=256, batch_size=64, seed=1337, device="cuda",
                    guard=ds.id_guard("train"))          # every batch's ids checked against the vocabulary
    x, y = train.get(step)                               # int64 (64, 256); y is x shifted by one
    for x, y in eval_batches(ds.split("val"), 256, 64, max_batches=20, guard=ds.id_guard("val")): ...

A dataset directory (written by `python data/prepare.py`, see gpt/data/prepare.py) holds `train.bin` and
`val.bin` (flat token ids, little-endian uint16 or uint32), `meta.json`, and for a trained BPE its
ranks file `tokenizer.tiktoken`; gpt/data/format.py owns that format and checks meta.json.

Sampling is a pure function of (seed, step): the global batch of a step is `batch_size * grad_accum
* world_size` windows, and rank r / micro-step m reads slice `r * grad_accum + m` of it. So a resumed
run draws exactly the batches an uninterrupted one would, DDP ranks read disjoint slices, and the
windows of a step do not depend on how the global batch is split between ranks and micro-steps.

Footguns
- Offsets are int64 before any arithmetic: a uint16/uint32 id or an int32 index times block_size
  wraps past 2^31 tokens (4 GiB of uint16) without a sound.
- A memmap slice is a view of the page cache; windows are copied out (and widened to int64) before
  they become tensors, and the memmap itself is read-only.
- On CUDA the host batch is pinned and copied with non_blocking=True, so the copy overlaps the
  previous step's compute. Nothing per step touches more than the batch's own windows.
"""

from __future__ import annotations

import math
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from gpt.data.format import (
    SPLITS,
    DataError,
    IdGuard,
    check_ids,
    check_sha256,
    inline_ranks,
    memmap_ids,
    prepare_hint,
    read_meta,
)
from gpt.data.tokenizer import get_tokenizer

MODES = ("random", "epoch")


# ---- datasets ---------------------------------------------------------------------------------------


class TokenDataset:
    """A prepared dataset directory; `split(name)` is one split's token ids, memory-mapped."""

    def __init__(self, path: Path, meta: dict, splits: dict[str, np.ndarray]):
        self.path = path
        self.meta = meta
        self.vocab_size = int(meta["vocab_size"])
        self._splits = splits

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={self.meta['splits'][s]['tokens']:,}" for s in SPLITS)
        return f"TokenDataset({str(self.path)!r}, {self.meta['tokenizer']['kind']}, vocab={self.vocab_size}, {counts})"

    @property
    def tokenizer_spec(self) -> dict:
        """A self-contained spec for gpt.data.tokenizer.get_tokenizer (a bpe's ranks are read in inline),
        so a checkpoint that stores it can rebuild the tokenizer without the dataset directory."""
        return dict(self._tokenizer_spec)

    @cached_property
    def _tokenizer_spec(self) -> dict:
        return inline_ranks(self.path, self.meta["tokenizer"])

    def tokenizer(self):
        return get_tokenizer(self.tokenizer_spec)

    def split(self, name: str) -> np.ndarray:
        """The split's token ids as a read-only 1-D array backed by the file (nothing is loaded)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        return self._splits[name]

    def id_guard(self, name: str) -> IdGuard:
        """The per-batch vocabulary check of split `name`, for `Batches(..., guard=)` and `eval_batches`."""
        file = self.path / self.meta["splits"][name]["file"]
        return IdGuard(self.split(name), self.vocab_size, self.path, name, file)

    def text_bytes(self, name: str) -> int:
        """UTF-8 bytes of the text split `name` was encoded from (end-of-text ids stand for none): meta.json's
        `bytes`, or, for a dataset prepared before prepare recorded it, counted by decoding the split (the
        caller keeps it: the training task asks once) (a TokenizerError where its tokenizer cannot be built
        here, e.g. GPT-2's offline without its file)."""
        recorded = self.meta["splits"][name].get("bytes")
        if recorded is not None:
            return recorded
        tok, ids = self.tokenizer(), self.split(name)
        total = 0
        for start in range(0, len(ids), 1 << 20):
            chunk = ids[start : start + (1 << 20)]
            total += len(tok.decode_bytes(chunk[chunk != tok.eot_token].tolist()))
        return total

    def verify_checksums(self) -> None:
        """Hash every file in full and compare with meta.json (reads the whole dataset once)."""
        for name in SPLITS:
            check_sha256(self.path / self.meta["splits"][name]["file"], self.meta["splits"][name]["sha256"])
        spec = self.meta["tokenizer"]
        if spec["kind"] == "bpe" and "ranks_file" in spec:
            check_sha256(self.path / spec["ranks_file"], spec["ranks_sha256"])


def open_dataset(path: str | Path, verify: bool = False) -> TokenDataset:
    """Open a prepared dataset directory, checking meta.json against the files.

    Always checked: every field of meta.json (gpt.data.format.read_meta), that each .bin exists with a
    byte size that is a whole number of tokens and equal to meta.json's token count, and that every
    id is below the vocabulary size (the largest id meta.json recorded, or for older datasets every
    id once). `verify=True` also compares the full sha256 of every file.
    """
    path = Path(path)
    meta = read_meta(path, "tokens")
    splits = {}
    for name in SPLITS:
        entry = meta["splits"][name]
        file = path / entry["file"]
        splits[name] = memmap_ids(file, meta["dtype"], entry["tokens"], prepare_hint("tokens", path))
        check_ids(splits[name], meta["vocab_size"], name, file, entry.get("max_id"))
    ds = TokenDataset(path, meta, splits)
    if verify:
        ds.verify_checksums()
    return ds


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """A total negative log-likelihood in nats -> bits per UTF-8 byte of the text it scored: comparable
    across tokenizers (lm-evaluation-harness's `bits_per_byte`). A mean loss per token converts as
    `bits_per_byte(loss * tokens, n_bytes)`."""
    return nll_nats / math.log(2) / n_bytes


# ---- batches ----------------------------------------------------------------------------------------


def gather_windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """(len(starts), length) int64 array of tokens[s : s + length] for each start (int64 offsets)."""
    starts = np.asarray(starts, dtype=np.int64)
    out = np.empty((len(starts), length), dtype=np.int64)
    for i, s in enumerate(starts.tolist()):  # Python ints: arbitrary precision, no wrap-around
        out[i] = tokens[s : s + length]
    return out


def _to_device(x: np.ndarray, y: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device.type == "cuda":
        # Pinned host memory lets the copy run asynchronously; torch's caching host allocator keeps
        # each pinned block alive until its copy has finished, so reusing memory is safe.
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def _windows_to_device(tokens: np.ndarray, starts: np.ndarray, block_size: int, guard: IdGuard | None, device):
    """(x, y) of the windows at `starts`, their ids checked by `guard` (if any) before they become tensors."""
    xy = gather_windows(tokens, starts, block_size + 1)
    if guard is not None:
        guard.check(xy, lambda: ((s, s + block_size + 1) for s in starts.tolist()))
    return _to_device(xy[:, :-1].copy(), xy[:, 1:].copy(), device)


def _check_tokens(tokens, block_size: int) -> np.ndarray:
    if not isinstance(tokens, np.ndarray):
        tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if len(tokens) < block_size + 1:
        raise DataError(
            f"the split has {len(tokens):,} tokens, fewer than one window of block_size + 1 = {block_size + 1}: "
            f"lower --block-size or prepare a larger corpus"
        )
    return tokens


class Batches:
    """Deterministic batches of (x, y) windows from a 1-D token array.

    mode="random": each window starts at any offset (nanoGPT's sampling); a global batch holds
    distinct windows whenever the split has enough of them.
    mode="epoch": the non-overlapping windows starting at 0, T, 2T, ... (every token is a target once),
    visited in a fresh permutation per epoch drawn from (seed, epoch); the global batches run through
    the permutations back to back, so each window comes exactly once per epoch, a batch may straddle
    two epochs, and `steps_per_epoch` = n_windows / global_batch need not be whole.
    """

    def __init__(
        self,
        tokens,
        block_size: int,
        batch_size: int,
        *,
        seed: int = 0,
        mode: str = "random",
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        device="cpu",
        guard: IdGuard | None = None,
    ):
        self.tokens = _check_tokens(tokens, block_size)
        self.guard = guard
        if mode not in MODES:
            raise ValueError(f"unknown batch mode {mode!r}; expected one of {', '.join(MODES)}")
        if batch_size < 1 or grad_accum < 1 or world_size < 1:
            raise ValueError(
                f"batch_size, grad_accum and world_size must be >= 1: {batch_size}, {grad_accum}, {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.block_size, self.batch_size, self.seed, self.mode = block_size, batch_size, seed, mode
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.device = torch.device(device)
        self.global_batch = batch_size * grad_accum * world_size
        n = len(self.tokens)
        self.n_windows = n - block_size if mode == "random" else (n - 1) // block_size
        self._perms: dict[int, np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> float:
        return self.n_windows / self.global_batch

    def window_starts(self, step: int) -> np.ndarray:
        """Token offsets (int64) of all `global_batch` windows of `step`, before slicing by rank."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.mode == "random":
            rng = np.random.default_rng([self.seed, 0, step])
            replace = self.global_batch > self.n_windows
            return rng.choice(self.n_windows, size=self.global_batch, replace=replace).astype(np.int64)
        positions = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, index = np.divmod(positions, self.n_windows)
        windows = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            at = epochs == epoch
            windows[at] = self._permutation(epoch)[index[at]]
        return windows * self.block_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            # Keep the permutation of the epoch in use and of the one before (a batch can straddle).
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = np.random.default_rng([self.seed, 1, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def get(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for this rank's slice `micro_step` of global step `step`: int64 (batch_size, block_size)."""
        if not 0 <= micro_step < self.grad_accum:
            raise ValueError(
                f"micro_step {micro_step} is outside 0..{self.grad_accum - 1} (grad_accum {self.grad_accum})"
            )
        k = self.rank * self.grad_accum + micro_step
        starts = self.window_starts(step)[k * self.batch_size : (k + 1) * self.batch_size]
        return _windows_to_device(self.tokens, starts, self.block_size, self.guard, self.device)


def eval_batches(
    tokens, block_size: int, batch_size: int, max_batches: int | None = None, device="cpu", guard: IdGuard | None = None
):
    """Yield (x, y) over consecutive non-overlapping windows from the start of the split (the whole
    split when max_batches is None; the last partial batch may be smaller); `guard` checks each batch's ids."""
    tokens = _check_tokens(tokens, block_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    n_windows = (len(tokens) - 1) // block_size
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        first = b * batch_size
        starts = np.arange(first, min(first + batch_size, n_windows), dtype=np.int64) * block_size
        yield _windows_to_device(tokens, starts, block_size, guard, device)

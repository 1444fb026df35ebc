"""Parallel text for the seq2seq model: prepare sentence pairs, open them, batch them by length.

    gpt prepare --pairs train.de train.en --val-pairs val.de val.en --out data/NAME --tokenizer bpe
    python data/multi30k/prepare.py                  # the Multi30k recipe: de -> en, bpe 8192

    from gpt.data.pairs import open_pairs, PairBatches
    ds = open_pairs("data/multi30k/de-en")
    batches = PairBatches(ds, "train", max_tokens=4096, seed=0)
    src, src_mask, tgt_in, tgt_out = batches.get(step)      # a pure function of (seed, step, rank)

Input: two UTF-8 text files, line i of SRC translates line i of TGT. Lines are split on "\n" only
(not str.splitlines, which also splits on U+2028 and friends and would misalign the pairs), and
stripped of surrounding whitespace. Different line counts are an error.

Filtering, counted per split in meta.json and printed in the summary:
- a pair with an empty side (after stripping) is skipped (`skipped_empty`);
- a side longer than `max_len` tokens *including* its end/start token is skipped
  (`skipped_long`), or with `truncate=True` cut to fit (`truncated`). Skipping is the default:
  a truncated sentence no longer translates its partner.

On disk, `data/NAME/`:

| file            | contents                                                                   |
|-----------------|----------------------------------------------------------------------------|
| `meta.json`     | `"kind": "pairs"`, tokenizer spec, `bos` / `eos` / `pad` ids, `dtype`,     |
|                 | `max_len`, per-split counts and largest id (`max_id`)                       |
| `tokenizer.tiktoken` | bpe only: the trained ranks (tiktoken's format), checksummed in meta   |
| `{split}.bin`   | token ids (uint16, or uint32 when the vocabulary needs it), for each pair   |
|                 | its source tokens then its target tokens, no special tokens                 |
| `{split}.idx`   | int64 offsets into `.bin`, 2N+1 of them: pair i's source is                |
|                 | `bin[idx[2i]:idx[2i+1]]`, its target `bin[idx[2i+1]:idx[2i+2]]`             |

One tokenizer serves both sides: `gpt2`, `char` (the characters of all the text) or `bpe`, a
byte-level BPE trained on both sides of the training pairs (`--vocab-size`, default 8192). As in
the LM datasets (gpt/data/prepare.py), a bpe's ranks live in `tokenizer.tiktoken` and meta.json names
the file and its sha256; `open_pairs(path).tokenizer_spec` reads them back inline, a self-contained
spec a checkpoint can store to rebuild the tokenizer without the dataset directory.

Special tokens: the tokenizer's end-of-text id serves as end token (`eos`), start token (`bos`)
and padding id (`pad`) alike. That is unambiguous: the start token is always at position 0 of
the decoder input, padding is masked (source) or ignored by the loss (targets are -1 there), and
it needs no new id in GPT-2's vocabulary. The batcher adds them: source = tokens + eos,
decoder input = bos + tokens, labels = tokens + eos.

The format (shared with token datasets) and the atomic writing are gpt/data/format.py's: the files
are written into a hidden directory beside `--out` and moved into place at the end, meta.json last,
so a crash or a full disk never leaves a half-written dataset; an `--out` that holds a dataset is
refused unless `force=True`, and other files in it are never touched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from gpt.data.bpe import train_bpe
from gpt.data.format import (
    REPREPARE,
    SPLITS,
    DataError,
    IdGuard,
    check_ids,
    inline_ranks,
    memmap_ids,
    new_meta,
    prepare_hint,
    read_meta,
    store_ranks,
    write_meta,
)
from gpt.data.prepare import (
    DEFAULT_BPE_VOCAB,
    TOKENIZER_FILE_FLAG,
    check_tokenizer_options,
)
from gpt.data.staging import staged
from gpt.data.tokenizer import (
    CharTokenizer,
    Tokenizer,
    TokenizerError,
    get_tokenizer,
    gpt2_tokenizer,
)
from gpt.fsutil import open_new


class PairsError(DataError):
    """Bad input for a pairs dataset: mismatched files, nothing left after filtering."""


# ---- preparing ------------------------------------------------------------------------------------


def make_tokenizer(kind: str, texts: Sequence[str], vocab_size: int | None = None, tokenizer_file: str | None = None):
    """The tokenizer for both sides: `gpt2`, `char` (over `texts`) or `bpe` (trained on `texts`,
    `vocab_size` ids including end-of-text, default 8192; fewer if `texts` has fewer pairs to merge)."""
    check_tokenizer_options(kind, vocab_size, tokenizer_file)
    if kind == "gpt2":
        try:
            return gpt2_tokenizer(tokenizer_file, file_flag=TOKENIZER_FILE_FLAG)
        except TokenizerError as e:
            raise PairsError(str(e)) from None
    if kind == "char":
        return CharTokenizer.from_text("".join(texts))
    try:
        return train_bpe(texts, vocab_size or DEFAULT_BPE_VOCAB)
    except ValueError as e:  # a vocabulary too small for byte-level BPE
        raise PairsError(str(e)) from None


def read_lines(path: str | os.PathLike) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise PairsError(f"no such file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PairsError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}): convert it to UTF-8 first") from None
    if text.endswith("\n"):
        text = text[:-1]
    return [line.strip() for line in text.split("\n")] if text else []


def read_pairs(src_file: str | os.PathLike, tgt_file: str | os.PathLike) -> tuple[list[str], list[str]]:
    """The lines of two parallel files; different line counts are an error."""
    src, tgt = read_lines(src_file), read_lines(tgt_file)
    if len(src) != len(tgt):
        raise PairsError(
            f"{src_file} has {len(src)} lines but {tgt_file} has {len(tgt)}: line i of the source must "
            f"translate line i of the target"
        )
    return src, tgt


def encode_pairs(tok: Tokenizer, src: list[str], tgt: list[str], max_len: int, truncate: bool = False):
    """Token id lists of the kept pairs, and counts of what was skipped or truncated."""
    stats = {"lines": len(src), "skipped_empty": 0, "skipped_long": 0, "truncated": 0}
    keep = [i for i in range(len(src)) if src[i] and tgt[i]]
    stats["skipped_empty"] = len(src) - len(keep)
    src_ids = tok.encode_batch([src[i] for i in keep])
    tgt_ids = tok.encode_batch([tgt[i] for i in keep])
    limit = max_len - 1  # room for the end token (source, labels) / start token (decoder input)
    pairs = []
    for s, t in zip(src_ids, tgt_ids):
        if len(s) > limit or len(t) > limit:
            if not truncate:
                stats["skipped_long"] += 1
                continue
            stats["truncated"] += 1
            s, t = s[:limit], t[:limit]
        if s and t:  # text that tokenizes to nothing counts as empty
            pairs.append((s, t))
        else:
            stats["skipped_empty"] += 1
    return pairs, stats


def write_split(out_dir: Path, split: str, pairs: list, dtype: str) -> dict:
    lengths = np.array([[len(s), len(t)] for s, t in pairs], dtype=np.int64).reshape(-1)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter(
        (i for s, t in pairs for i in (*s, *t)), dtype=np.dtype(dtype).newbyteorder("<"), count=int(offsets[-1])
    )
    for array, name in ((tokens, f"{split}.bin"), (offsets, f"{split}.idx")):
        with open_new(out_dir / name) as f:  # (in the fresh directory staging.staged made)
            array.tofile(f)
    src_len, tgt_len = lengths[0::2], lengths[1::2]
    return {
        "pairs": len(pairs),
        "src_tokens": int(src_len.sum()),
        "tgt_tokens": int(tgt_len.sum()),
        "max_src_len": int(src_len.max()),
        "max_tgt_len": int(tgt_len.max()),
        "max_id": int(tokens.max()),
    }


def prepare_pairs(
    src_file: str | os.PathLike,
    tgt_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    val_pairs: Sequence[str | os.PathLike] | None = None,
    val_fraction: float = 0.01,
    max_len: int = 256,
    truncate: bool = False,
    vocab_size: int | None = None,
    tokenizer_file: str | None = None,
    seed: int = 0,
    force: bool = False,
) -> dict:
    """Tokenize parallel files into a pairs dataset at `out_dir`; returns its meta.

    The validation split is `val_pairs` (two files) if given, else a random `val_fraction` of the
    lines (drawn with `seed`). One tokenizer serves both sides; `char` and `bpe` are built from
    the training text of both sides (char also from the validation text, so it can encode it).
    Raises a DataError for every user mistake (a PairsError for the pairs themselves) and a
    StorageError for an `out_dir` that cannot be written or a full disk; nothing is left behind then.
    """
    out_dir = Path(out_dir)
    check_tokenizer_options(tokenizer, vocab_size, tokenizer_file)
    if max_len < 2:
        raise PairsError(f"max_len must be >= 2 (a token plus the end token), got {max_len}")
    if not val_pairs and not (0.0 < val_fraction < 1.0):
        raise PairsError(f"val_fraction must be in (0, 1) when no --val-pairs are given, got {val_fraction}")

    with staged(out_dir, force) as tmp:  # first, so an `out_dir` that cannot be written fails before the work
        src, tgt, val = _split_lines(src_file, tgt_file, val_pairs, val_fraction, seed)
        texts = src + tgt + (val[0] + val[1] if tokenizer == "char" else [])
        tok = make_tokenizer(tokenizer, texts, vocab_size=vocab_size, tokenizer_file=tokenizer_file)
        meta = new_meta(
            "pairs",
            tok.vocab_size,
            store_ranks(tmp, tok.spec),
            bos=tok.eot_token,
            eos=tok.eot_token,
            pad=tok.eot_token,
            max_len=max_len,
            truncate=truncate,
            splits={},
            source={"train": [str(src_file), str(tgt_file)], "val": [str(p) for p in val_pairs] if val_pairs else None},
        )
        for split, (s, t) in (("train", (src, tgt)), ("val", val)):
            pairs, stats = encode_pairs(tok, s, t, max_len, truncate)
            if not pairs:
                raise PairsError(
                    f"no {split} pairs left out of {stats['lines']} lines ({stats['skipped_empty']} empty, "
                    f"{stats['skipped_long']} longer than max_len={max_len}): check the files, or raise --max-len"
                )
            meta["splits"][split] = {**stats, **write_split(tmp, split, pairs, meta["dtype"])}
        write_meta(tmp, meta)
    return meta


def _split_lines(src_file, tgt_file, val_pairs, val_fraction: float, seed: int):
    """(train source lines, train target lines, (val source lines, val target lines))."""
    src, tgt = read_pairs(src_file, tgt_file)
    if val_pairs:
        return src, tgt, read_pairs(*val_pairs)
    held_out = np.zeros(len(src), dtype=bool)
    n_val = max(1, round(val_fraction * len(src)))
    held_out[np.random.default_rng(seed).permutation(len(src))[:n_val]] = True
    val = [s for s, h in zip(src, held_out) if h], [t for t, h in zip(tgt, held_out) if h]
    return [s for s, h in zip(src, held_out) if not h], [t for t, h in zip(tgt, held_out) if not h], val


def summary(meta: dict, out_dir) -> str:
    lines = [f"wrote {out_dir} ({meta['tokenizer']['kind']} tokenizer, vocab {meta['vocab_size']}, {meta['dtype']})"]
    for split, s in meta["splits"].items():
        lines.append(
            f"  {split}: {s['pairs']} pairs of {s['lines']} lines, {s['src_tokens']} + {s['tgt_tokens']} tokens "
            f"(longest {s['max_src_len']} / {s['max_tgt_len']}); skipped {s['skipped_empty']} empty, "
            f"{s['skipped_long']} over max_len={meta['max_len']}; truncated {s['truncated']}"
        )
    return "\n".join(lines)


# ---- reading --------------------------------------------------------------------------------------


class PairDataset:
    """A prepared pairs dataset: memory-mapped splits, the special ids and the tokenizer."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.meta = read_meta(self.path, "pairs")
        self.bos, self.eos, self.pad = self.meta["bos"], self.meta["eos"], self.meta["pad"]
        self.vocab_size = self.meta["vocab_size"]
        self._splits = {name: self._open_split(name) for name in SPLITS}
        self._guards = {
            name: IdGuard(ids, self.vocab_size, self.path, name, self.path / f"{name}.bin")
            for name, (ids, _) in self._splits.items()
        }

    def _open_split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """The split's ids (memory-mapped) and offsets, checked against meta.json and the vocabulary."""
        entry, hint = self.meta["splits"][split], prepare_hint("pairs", self.path)
        file, index = self.path / f"{split}.bin", self.path / f"{split}.idx"
        tokens = memmap_ids(file, self.meta["dtype"], entry["src_tokens"] + entry["tgt_tokens"], hint)
        if not index.is_file():
            raise DataError(f"no {index.name} in {self.path}: {hint}")
        offsets = np.fromfile(index, dtype="<i8")
        if (
            len(offsets) != 2 * entry["pairs"] + 1
            or offsets[0] != 0
            or offsets[-1] != len(tokens)
            or (np.diff(offsets) < 0).any()
        ):
            raise DataError(f"{index} does not match {file.name} and meta.json (truncated or damaged): {REPREPARE}")
        check_ids(tokens, self.vocab_size, split, file, entry.get("max_id"))
        return tokens, offsets

    @property
    def splits(self) -> list[str]:
        return list(self.meta["splits"])

    def _split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        if split not in self._splits:
            raise PairsError(f"{self.path} has no split {split!r}; it has {self.splits}")
        return self._splits[split]

    def __len__(self) -> int:
        return self.meta["splits"]["train"]["pairs"]

    def num_pairs(self, split: str) -> int:
        return len(self._split(split)[1]) // 2

    def lengths(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths in tokens (without special tokens), one per pair."""
        n = np.diff(self._split(split)[1])
        return n[0::2], n[1::2]

    def check_ids(self, split: str, batch: np.ndarray, pairs: np.ndarray) -> None:
        """Every id of `batch`, read from `pairs` of `split`, is in the vocabulary (see IdGuard)."""
        offsets = self._split(split)[1]
        self._guards[split].check(batch, lambda: ((offsets[2 * i], offsets[2 * i + 2]) for i in pairs.tolist()))

    def pair(self, split: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, off = self._split(split)
        return tokens[off[2 * i] : off[2 * i + 1]], tokens[off[2 * i + 1] : off[2 * i + 2]]

    @property
    def tokenizer_spec(self) -> dict:
        """A self-contained spec for gpt.data.tokenizer.get_tokenizer (a bpe's ranks are read in inline,
        checked against meta.json's sha256), so a checkpoint that stores it can rebuild the
        tokenizer without the dataset directory."""
        return dict(self._tokenizer_spec)

    @cached_property
    def _tokenizer_spec(self) -> dict:
        return inline_ranks(self.path, self.meta["tokenizer"])

    def tokenizer(self) -> Tokenizer:
        return get_tokenizer(self.tokenizer_spec)

    def seq2seq_meta(self) -> dict:
        """What a checkpoint must carry (as meta["seq2seq"]) to translate: the special ids."""
        return {"bos": self.bos, "eos": self.eos, "pad": self.pad}


def open_pairs(path: str | os.PathLike) -> PairDataset:
    return PairDataset(path)


# ---- batching -------------------------------------------------------------------------------------


class PairBatches:
    """Padded (src, src_mask, tgt_in, tgt_out) batches of similar lengths, sized by tokens.

    The split is cut once into batches: pairs shuffled with `seed`, sorted by (source, target)
    length (a stable sort, so equal lengths stay shuffled), then packed greedily while
    `batch_size * max(padded source length, padded target length) <= max_tokens` (the paper's
    "approximately 25000 source tokens and 25000 target tokens"). Each epoch visits these batches
    in a fresh order drawn from (seed, epoch). Micro-batch j = (step * grad_accum + micro_step)
    * world_size + rank of that endless sequence is what `get` returns: a pure function of its
    arguments, so resuming at a step reproduces the data exactly and ranks never overlap.

    Padding: `src` and `tgt_in` hold `pad` there, `src_mask` is False and `tgt_out` is -1 (the
    loss's ignore_index). Batches hold different numbers of tokens; the loss is a mean per token.
    `pad_to` > 1 pads both sides' lengths up to a multiple of it (packing counts the padded widths),
    so that batch shapes repeat: every new shape costs the CPU new oneDNN primitives and blocks of new
    sizes that the allocator's free holes do not fit (Multi30k at 3,072 tokens: 137 shapes, 5% padding;
    pad_to 8: 24 shapes, 22% padding). The loss on the real tokens is the same.
    """

    def __init__(
        self,
        dataset: PairDataset,
        split: str,
        max_tokens: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        device="cpu",
        pad_to: int = 1,
    ):
        import torch  # here, not at the top: preparing a dataset never imports torch

        if not (0 <= rank < world_size) or grad_accum < 1 or pad_to < 1:
            raise ValueError(
                f"need 0 <= rank < world_size, grad_accum >= 1 and pad_to >= 1, got {rank}, {world_size}, "
                f"{grad_accum}, {pad_to}"
            )
        self.dataset, self.split, self.max_tokens, self.seed = dataset, split, max_tokens, seed
        self.rank, self.world_size, self.grad_accum, self.pad_to = rank, world_size, grad_accum, pad_to
        self.device = torch.device(device)
        src_len, tgt_len = dataset.lengths(split)
        self.src_len, self.tgt_len = src_len + 1, tgt_len + 1  # with the end / start token
        # the padded widths a batch takes: multiples of pad_to (what packing counts)
        self.src_width, self.tgt_width = -(-self.src_len // pad_to) * pad_to, -(-self.tgt_len // pad_to) * pad_to
        longest = int(np.maximum(self.src_width, self.tgt_width).max())
        if longest > max_tokens:
            raise PairsError(
                f"max_tokens={max_tokens} is smaller than the longest {split} pair ({longest} tokens per side): "
                f"raise --max-tokens or re-prepare the data with a smaller --max-len"
            )
        self.batches = self._pack()
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def _pack(self) -> list[np.ndarray]:
        perm = np.random.default_rng([self.seed, 1]).permutation(len(self.src_len))
        perm = perm[np.argsort(self.tgt_len[perm], kind="stable")]
        order = perm[np.argsort(self.src_len[perm], kind="stable")]  # by source, then target length
        batches, start, width = [], 0, 0
        for end, i in enumerate(order):
            w = max(width, self.src_width[i], self.tgt_width[i])
            if (end - start + 1) * w > self.max_tokens:
                batches.append(order[start:end])
                start, w = end, max(self.src_width[i], self.tgt_width[i])
            width = w
        batches.append(order[start:])
        return batches

    def __len__(self) -> int:
        """Batches per epoch (over all ranks and micro-steps)."""
        return len(self.batches)

    def epoch(self, step: int) -> float:
        """Epochs completed after `step` optimizer steps (for logging)."""
        return step * self.grad_accum * self.world_size / len(self.batches)

    def padding_fraction(self) -> float:
        """Share of padded positions over both sides of all batches (the waste length grouping avoids)."""
        real = padded = 0
        for b in self.batches:
            real += self.src_len[b].sum() + self.tgt_len[b].sum()
            padded += len(b) * (self.src_width[b].max() + self.tgt_width[b].max())
        return float(1 - real / padded)

    def indices(self, step: int, micro_step: int = 0) -> np.ndarray:
        """Pair indices of this rank's micro-batch at (step, micro_step)."""
        j = (step * self.grad_accum + micro_step) * self.world_size + self.rank
        epoch, pos = divmod(j, len(self.batches))
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, np.random.default_rng([self.seed, 2, epoch]).permutation(len(self.batches)))
        return self.batches[self._epoch_order[1][pos]]

    def get(self, step: int, micro_step: int = 0):
        return self.collate(self.indices(step, micro_step))

    def __iter__(self):
        """Every batch of the split once, in length order, this rank's share (e.g. a full val loss)."""
        for b in self.batches[self.rank :: self.world_size]:
            yield self.collate(b)

    def collate(self, idx: np.ndarray):
        ds = self.dataset
        S, T = int(self.src_width[idx].max()), int(self.tgt_width[idx].max())
        src = np.full((len(idx), S), ds.pad, dtype=np.int64)
        tgt_in = np.full((len(idx), T), ds.pad, dtype=np.int64)
        tgt_out = np.full((len(idx), T), -1, dtype=np.int64)
        for row, i in enumerate(idx):
            s, t = ds.pair(self.split, i)
            src[row, : len(s)], src[row, len(s)] = s, ds.eos
            tgt_in[row, 0], tgt_in[row, 1 : len(t) + 1] = ds.bos, t
            tgt_out[row, : len(t)], tgt_out[row, len(t)] = t, ds.eos
        ds.check_ids(self.split, src, idx)  # the sources, and the targets (padded with -1) as labels
        ds.check_ids(self.split, tgt_out, idx)
        src_mask = np.arange(S)[None, :] < self.src_len[idx][:, None]
        import torch  # torch: not in prepare

        out = [torch.from_numpy(a) for a in (src, src_mask, tgt_in, tgt_out)]
        if self.device.type == "cuda":
            return tuple(a.pin_memory().to(self.device, non_blocking=True) for a in out)
        return tuple(a.to(self.device) for a in out)


# ---- command line ---------------------------------------------------------------------------------

DEFAULT_MAX_LEN = 256
DEFAULT_VAL_FRACTION = 0.01

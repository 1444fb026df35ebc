"""What the trainer trains on: a token stream (language modelling), sentence pairs (seq2seq), chat
conversations (fine-tuning with the loss on the answers) or preference pairs (DPO, ORPO).

The dataset directory's meta.json says which (`"kind"`: tokens, pairs, chat or preferences). Every kind gives the
loop the same face, so the loop itself never asks:

    task = open_task(cfg.data)                  # vocab_size, tokenizer_spec, checkpoint_meta
    task.start(cfg, rt, accum)                  # the training sampler (after the model is built)
    args = task.train_batch(step, micro_step)   # positional args of GPT.forward: (idx, targets, ...)
    task.tokens(args)                           # the tokens it trains on, for tokens/s and MFU
    for args in task.eval_batches("val"): ...
    task.val_bits_per_byte(val_loss)            # a token stream's val loss in bits per byte, else None

Batches are pure functions of (seed, step, micro_step, rank) for both kinds: that is what makes a
resumed run draw exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

from gpt.data import packing, preference_batches
from gpt.data.format import dataset_kind, inline_ranks
from gpt.data.pairs import PairBatches, open_pairs
from gpt.data.tokens import Batches, bits_per_byte, eval_batches, open_dataset
from gpt.errors import ConfigError, UserError


def count_targets(batch):
    """The tokens a batch trains on: its targets (for pairs, those that are not padding)."""
    return batch[1].ne(-1).sum()


class Counted:
    """An iterable that knows its length in advance (evaluation progress)."""

    def __init__(self, n: int, iterable):
        self.n, self.iterable = n, iterable

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(self.iterable)


class LanguageModelling:
    """Windows of block_size + 1 tokens from a memory-mapped token stream (gpt/data/tokens.py)."""

    kind = "tokens"

    def __init__(self, path: str):
        self.dataset = open_dataset(path)
        self.vocab_size = self.dataset.vocab_size
        self.tokenizer_spec = self.dataset.tokenizer_spec
        self.checkpoint_meta: dict = {}

    def check_model(self, cfg) -> None:
        if cfg.model.n_encoder_layer:
            raise ConfigError(
                f"n_encoder_layer: {cfg.model.n_encoder_layer} needs a pairs dataset (gpt prepare --pairs)"
            )

    def start(self, cfg, rt, accum: int) -> None:
        self.cfg, self.device = cfg, rt.device
        self.sampler = Batches(
            self.dataset.split("train"),
            cfg.model.block_size,
            cfg.batch_size,
            seed=cfg.seed,
            mode=cfg.sampling,
            rank=rt.rank,
            world_size=rt.world_size,
            grad_accum=accum,
            device=rt.device,
            guard=self.dataset.id_guard("train"),
        )

    def train_batch(self, step: int, micro_step: int):
        return self.sampler.get(step, micro_step)

    tokens = staticmethod(count_targets)

    def describe_batch(self, cfg) -> str:
        return f"{cfg.batch_size * cfg.grad_accum} x {cfg.model.block_size} tokens"

    def eval_tokens(self) -> int:
        """Tokens one evaluation reads, both splits (for time estimates)."""
        cfg = self.cfg
        splits = 2 if cfg.eval_train else 1
        if cfg.eval_iters == 0 or cfg.sampling == "epoch":
            return splits * (len(self.dataset.split("val")) - 1)
        return splits * cfg.eval_iters * (cfg.eval_batch_size or cfg.batch_size) * cfg.model.block_size

    def val_bits_per_byte(self, val_loss: float) -> float | None:
        """The val loss (nats per token) in bits per byte of text, which compares across tokenizers:
        val_loss / ln 2 * tokens_in_val / bytes_in_val, the standard conversion. The loss is estimated on
        the evaluation's windows, whose tokens per byte are taken to be the whole split's (its end-of-text
        ids, scored like any token, count as tokens of no bytes). The bytes are meta.json's, or the split
        decoded once for a dataset prepared before they were recorded; None (no bits per byte, no error)
        where they are unknown: the tokenizer cannot be built here, or the split is empty."""
        if not hasattr(self, "_val_bytes"):
            try:
                self._val_bytes = self.dataset.text_bytes("val")
            except UserError:
                self._val_bytes = None
        if not self._val_bytes:
            return None
        return bits_per_byte(val_loss * len(self.dataset.split("val")), self._val_bytes)

    def eval_batches(self, split: str):
        """The same `eval_iters` random batches at every evaluation; or, with eval_iters = 0 or epoch
        sampling, the whole val split, and as many train tokens (the train split is usually ~10x
        larger, and the comparison wants equal counts)."""
        cfg, tokens, guard = self.cfg, self.dataset.split(split), self.dataset.id_guard(split)
        bs = cfg.eval_batch_size or cfg.batch_size
        if cfg.eval_iters == 0 or cfg.sampling == "epoch":
            n_val = -(-((len(self.dataset.split("val")) - 1) // cfg.model.block_size) // bs)
            n = n_val if split == "val" else min(n_val, -(-((len(tokens) - 1) // cfg.model.block_size) // bs))
            return Counted(
                n, eval_batches(tokens, cfg.model.block_size, bs, max_batches=n, device=self.device, guard=guard)
            )
        sampler = Batches(tokens, cfg.model.block_size, bs, seed=cfg.seed + 1, device=self.device, guard=guard)
        return Counted(cfg.eval_iters, (sampler.get(i) for i in range(cfg.eval_iters)))


class Translation:
    """Length-grouped, token-budgeted (src, tgt) pair batches for the encoder-decoder (gpt/data/pairs.py)."""

    kind = "pairs"

    def __init__(self, path: str):
        self.dataset = open_pairs(path)
        self.vocab_size = self.dataset.vocab_size
        self.tokenizer_spec = getattr(self.dataset, "tokenizer_spec", None) or self.dataset.meta["tokenizer"]
        self.checkpoint_meta = {"seq2seq": self.dataset.seq2seq_meta()}

    def check_model(self, cfg) -> None:
        problems = []
        if cfg.model.n_encoder_layer < 1:
            problems.append("n_encoder_layer: a pairs dataset needs an encoder (e.g. --config multi30k_cpu)")
        splits = self.dataset.meta["splits"].values()
        need = 1 + max(max(s["max_src_len"], s["max_tgt_len"]) for s in splits)  # plus the start / end token
        padded = -(-need // cfg.pad_to) * cfg.pad_to
        if cfg.model.block_size < padded:
            problems.append(
                f"block_size: {cfg.model.block_size} is shorter than the dataset's longest side ({need} tokens"
                + (f", {padded} padded to a multiple of --pad-to {cfg.pad_to})" if padded > need else ")")
            )
        if problems:
            raise ConfigError("\n".join(problems))

    def _tokens(self, cfg) -> int:
        return cfg.max_tokens or cfg.batch_size * cfg.model.block_size

    def start(self, cfg, rt, accum: int) -> None:
        self.cfg, self.rt = cfg, rt
        self.sampler = PairBatches(
            self.dataset,
            "train",
            self._tokens(cfg),
            seed=cfg.seed,
            rank=rt.rank,
            world_size=rt.world_size,
            grad_accum=accum,
            device=rt.device,
            pad_to=cfg.pad_to,
        )

    @staticmethod
    def _args(batch):
        src, src_mask, tgt_in, tgt_out = batch
        return tgt_in, tgt_out, src, src_mask  # GPT.forward(idx, targets, src, src_mask)

    def train_batch(self, step: int, micro_step: int):
        return self._args(self.sampler.get(step, micro_step))

    tokens = staticmethod(count_targets)

    def describe_batch(self, cfg) -> str:
        return f"{cfg.grad_accum} x <= {self._tokens(cfg)} tokens of length-grouped pairs"

    def eval_tokens(self) -> int:
        """Tokens one evaluation reads, both splits, at most (for time estimates)."""
        val = int(sum(lengths.sum() for lengths in self.dataset.lengths("val")))
        train = val if self.cfg.eval_iters == 0 else self.cfg.eval_iters * self._tokens(self.cfg)
        return val + (train if self.cfg.eval_train else 0)

    def eval_batches(self, split: str):
        cfg = self.cfg
        batches = PairBatches(
            self.dataset, split, self._tokens(cfg), seed=cfg.seed + 1, device=self.rt.device, pad_to=cfg.pad_to
        )
        if split == "val" or cfg.eval_iters == 0:
            return Counted(len(batches), (self._args(b) for b in batches))  # the whole split once
        return Counted(cfg.eval_iters, (self._args(batches.get(i)) for i in range(cfg.eval_iters)))

    def val_bits_per_byte(self, val_loss: float) -> None:
        """None: the loss is on targets given their source, not on running text (no bits per byte)."""
        return None


class ChatFineTuning:
    """Conversations packed into windows, the loss on the assistant's tokens (gpt/data/packing.py)."""

    kind = "chat"

    def __init__(self, path: str):
        self.dataset = packing.open_chat_dataset(path)
        self.vocab_size = self.dataset.vocab_size
        self.tokenizer_spec = inline_ranks(self.dataset.path, self.dataset.meta["tokenizer"])
        self.checkpoint_meta = {"chat_template": self.dataset.template.spec}

    def check_model(self, cfg) -> None:
        if cfg.model.n_encoder_layer:
            raise ConfigError("n_encoder_layer: a chat dataset trains a decoder-only model (no encoder)")
        if cfg.model.global_tokens:  # (packed conversations: each one's first tokens; gpt/model/sparse.py)
            raise ConfigError("global_tokens: not with a chat dataset's packed conversations in this version")

    def start(self, cfg, rt, accum: int) -> None:
        fits_block(self.dataset, cfg.model.block_size, "conversation", "the chat data")
        self.cfg, self.device = cfg, rt.device
        self.sampler = packing.PackedBatches(
            self.dataset,
            "train",
            cfg.model.block_size,
            cfg.batch_size,
            seed=cfg.seed,
            loss_on=cfg.loss_on,
            rank=rt.rank,
            world_size=rt.world_size,
            grad_accum=accum,
            device=rt.device,
        )

    @staticmethod
    def _args(batch):
        x, y, doc = batch
        return x, y, None, None, doc  # GPT.forward(idx, targets, src, src_mask, doc)

    def train_batch(self, step: int, micro_step: int):
        return self._args(self.sampler.get(step, micro_step))

    @staticmethod
    def tokens(batch):
        """Every position of the windows: the model reads (and spends its FLOPs on) the prompts and the
        little padding as much as the answers, so tokens/s and MFU compare with pretraining's."""
        return batch[0].numel()

    def describe_batch(self, cfg) -> str:
        return f"{cfg.batch_size * cfg.grad_accum} x {cfg.model.block_size} tokens of packed conversations"

    def _eval_size(self) -> tuple[int, int]:
        """(batches, batch size) of one split's evaluation: val in full, train as many batches."""
        cfg = self.cfg
        bs = cfg.eval_batch_size or cfg.batch_size
        n = -(-packing.eval_rows(self.dataset, "val", cfg.model.block_size) // bs)
        return (n if cfg.eval_iters == 0 else min(n, cfg.eval_iters)), bs

    def eval_tokens(self) -> int:
        n, bs = self._eval_size()
        return (2 if self.cfg.eval_train else 1) * n * bs * self.cfg.model.block_size

    def eval_batches(self, split: str):
        """The masked loss on held-out conversations: val packed in order (its first `eval_iters` batches,
        all of them with eval_iters = 0); train the same number of batches of a fixed shuffle."""
        cfg = self.cfg
        n, bs = self._eval_size()
        if split == "val":
            batches = packing.eval_batches(self.dataset, "val", cfg.model.block_size, bs, cfg.loss_on, self.device)
            return Counted(n, (self._args(b) for b, _ in zip(batches, range(n))))
        sampler = packing.PackedBatches(
            self.dataset, "train", cfg.model.block_size, bs, seed=cfg.seed + 1, loss_on=cfg.loss_on, device=self.device
        )
        return Counted(n, (self._args(sampler.get(i)) for i in range(n)))

    def val_bits_per_byte(self, val_loss: float) -> None:
        """None: the loss is on the answers only, in packed conversations (no bits per byte)."""
        return None


class PreferenceTuning:
    """Pairs of a chosen and a rejected answer to one prompt, for --objective dpo | orpo
    (gpt/data/preference_batches.py; the loss is gpt/train/prefer.py's)."""

    kind = "preferences"

    def __init__(self, path: str):
        self.dataset = preference_batches.open_preferences(path)
        self.vocab_size = self.dataset.vocab_size
        self.tokenizer_spec = inline_ranks(self.dataset.path, self.dataset.meta["tokenizer"])
        template = self.dataset.template
        self.checkpoint_meta = {"chat_template": template.spec} if template else {}

    def check_model(self, cfg) -> None:
        if cfg.model.n_encoder_layer:
            raise ConfigError("n_encoder_layer: a preference dataset trains a decoder-only model (no encoder)")

    def start(self, cfg, rt, accum: int) -> None:
        fits_block(self.dataset, cfg.model.block_size, "sequence", "the pairs")
        self.cfg, self.device = cfg, rt.device
        self.sampler = preference_batches.PreferenceBatches(
            self.dataset,
            "train",
            cfg.batch_size,
            seed=cfg.seed,
            rank=rt.rank,
            world_size=rt.world_size,
            grad_accum=accum,
            device=rt.device,
        )

    def train_batch(self, step: int, micro_step: int):
        return self.sampler.get(step, micro_step)

    @staticmethod
    def tokens(batch):
        """Every position of both sequences of each pair (the model reads them all)."""
        return batch[0].numel()

    def describe_batch(self, cfg) -> str:
        return f"{cfg.batch_size * cfg.grad_accum} preference pairs (x 2 sequences)"

    def _eval_size(self) -> tuple[int, int]:
        cfg = self.cfg
        bs = cfg.eval_batch_size or cfg.batch_size
        n = -(-self.dataset.pairs("val") // bs)
        return (n if cfg.eval_iters == 0 else min(n, cfg.eval_iters)), bs

    def eval_tokens(self) -> int:
        n, bs = self._eval_size()
        return (2 if self.cfg.eval_train else 1) * n * 2 * bs * self.cfg.model.block_size

    def eval_batches(self, split: str):
        """The first pairs of the split in order: as many batches as val has (at most `eval_iters`)."""
        n, bs = self._eval_size()
        return Counted(n, preference_batches.eval_batches(self.dataset, split, bs, n, self.device))

    def val_bits_per_byte(self, val_loss: float) -> None:
        """None: the loss is a preference loss, not one on running text."""
        return None


def open_task(path: str):
    """The task for a prepared dataset directory, by its meta.json kind."""
    kind = dataset_kind(path)
    tasks = {"pairs": Translation, "chat": ChatFineTuning, "preferences": PreferenceTuning}
    return tasks.get(kind, LanguageModelling)(path)


def fits_block(dataset, block_size: int, what: str, data: str) -> None:
    """ConfigError unless the longest sequence of either split of `dataset` fits a window of block_size + 1."""
    longest = int(max(dataset.lengths(split).max() for split in ("train", "val")))
    if longest > block_size + 1:
        raise ConfigError(
            f"block_size: the model's {block_size} is too short for the dataset's longest {what} ({longest} tokens, "
            f"a window holds block_size + 1): prepare {data} with --block-size {block_size}"
        )

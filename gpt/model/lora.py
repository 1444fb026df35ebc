"""LoRA: a frozen pretrained GPT plus small trained low-rank adapters (Hu et al., 2021).

    gpt train --config finetune --init-from out/wikitext --data data/shakespeare --out-dir out/lora --lora-rank 8
    gpt sample --ckpt out/lora --prompt "ROMEO:"                    # base + adapters (merged on load)
    gpt lora merge --ckpt out/lora --out out/lora-merged.pt     # a plain checkpoint: sample, export, init-from
    gpt hf export --ckpt out/lora --out hf/lora                 # loads base + adapters, exports merged

Each targeted `nn.Linear` y = x W^T + b becomes a `LoRALinear`:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T        A: (r, in), B: (out, r)

W and b keep their names and are frozen (requires_grad False, bitwise unchanged by training); A starts
Kaiming-uniform and B at zero (the paper's reference code), so step 0 computes exactly the base model.
Everything outside the adapters is frozen too (embeddings, LayerNorms). `merge` folds the update into W
(W + alpha/r * B A) and gives back plain `nn.Linear`s: same logits, no extra cost when sampling.

The target `wte` adapts the token embedding, which is tied to the output head: one update B A
(B: vocab x r, A: r x n_embd) that both see, rows E[i] + (alpha/r) B[i] A going in and logits
h (E + (alpha/r) B A)^T coming out (the head is a LoRALinear over the shared matrix, the embedding a
`TiedLoRAEmbedding` reading its adapters). Merging updates the shared matrix once, so the tie holds.
It is what lets adapters move token frequencies, which dominate a change of domain (see bench/README.md's
fine-tuning benchmark). With `untied_head` the two matrices are separate, and so are their updates: the
head a LoRALinear, the embedding a `LoRAEmbedding` with adapters of its own (rows E[i] + (alpha/r) B[i] A).

A LoRA checkpoint holds only the adapters (`...attn.c_attn.lora_A`, `...lora_B`) and names its base in
`meta["lora"]` (gpt/checkpoints/native.py): `base` (absolute path), `base_relative` (from the checkpoint's
directory, so a base moved together with the run still loads), `base_sha256` (a fingerprint of the
base weights as adapted: a base that changed since, e.g. a best.pt that moved on, is refused in one
line instead of silently giving other text), and `rank`, `alpha`, `dropout`, `targets`.
`gpt.checkpoints.native.load_model` / `load_checkpoint` (sample.py, `gpt hf export`, `--init-from`,
and any server built on them) load base + adapters merged; `load_adapted(path, merge=False)` keeps the
adapters separate (e.g. a server swapping adapters over one base).

Why not Hugging Face PEFT: it would wrap our GPT in a PeftModel that renames every parameter
(`base_model.model....base_layer.weight`), which breaks the key-for-key GPT-2 names the checkpoint,
HF import/export and `--resume` rely on, saves adapters in its own format beside (not inside) our
atomic checkpoint with its meta, and pulls in accelerate, huggingface_hub, psutil and PyYAML. The math
is the twenty lines of `LoRALinear` below.

Footgun: seq2seq models slice `c_attn.weight` directly for cross-attention (gpt/model/attention.py), which would
bypass an adapter; LoRA is refused for them (`--lora-rank` with `--n-encoder-layer`).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt.errors import ConfigError, UserError
from gpt.model.config import LORA_DEFAULT_TARGETS, LORA_TARGETS, LoRAConfig  # noqa: F401 (what LoRA can adapt, how)

ADAPTER_KEYS = ("lora_A", "lora_B")


class LoRAError(UserError, ValueError):
    """A LoRA checkpoint whose base is missing or changed, or adapters that do not fit the model."""


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trained low-rank update; `weight` and `bias` keep their names (and are the
    base layer's own tensors, shared, not copied)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)
        self.bias = base.bias.requires_grad_(False) if base.bias is not None else None
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # scaled at rank r, the narrowest point: (B, T, r), not (B, T, out_features)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A) * self.scale, self.lora_B)
        return F.linear(x, self.weight, self.bias) + update

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function: W becomes W + scale * B A in place (a matrix tied
        elsewhere, the token embedding, changes with it) and is shared, as is the bias."""
        out = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
            self.weight.copy_((self.weight.float() + delta).to(self.weight.dtype))
        out.weight, out.bias = self.weight, self.bias
        return out


class TiedLoRAEmbedding(nn.Module):
    """The token embedding tied to a LoRALinear output head: rows of (E + scale * B A), the head's update."""

    def __init__(self, base: nn.Embedding, head: LoRALinear):
        super().__init__()
        assert base.weight is head.weight, "the embedding must be tied to the head"
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.weight, self.lora_A, self.lora_B, self.scale = head.weight, head.lora_A, head.lora_B, head.scale

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight) + (F.embedding(idx, self.lora_B) * self.scale) @ self.lora_A

    def merged(self) -> nn.Embedding:
        """A plain nn.Embedding over the shared matrix (which the head's merge has already updated)."""
        out = nn.Embedding(self.num_embeddings, self.embedding_dim, device="meta")
        out.weight = self.weight
        return out


class LoRAEmbedding(nn.Module):
    """A frozen nn.Embedding (not tied to the head: untied_head) plus a trained low-rank update of its rows,
    E[i] + scale * B[i] A; B starts at zero, so step 0 looks up the base rows."""

    def __init__(self, base: nn.Embedding, rank: int, alpha: float):
        super().__init__()
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.weight = base.weight.requires_grad_(False)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.embedding_dim, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.num_embeddings, rank, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight) + (F.embedding(idx, self.lora_B) * self.scale) @ self.lora_A

    def merged(self) -> nn.Embedding:
        """A plain nn.Embedding of the same rows: E becomes E + scale * B A in place."""
        out = nn.Embedding(self.num_embeddings, self.embedding_dim, device="meta")
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
            self.weight.copy_((self.weight.float() + delta).to(self.weight.dtype))
        out.weight = self.weight
        return out


class MultiLoRALinear(nn.Module):
    """A frozen nn.Linear serving several adapters side by side: row b of a batch adds adapter `rows[b]`'s update
    (0: none), all rows in one batched product (gathered A and B, zero-padded to the largest rank: exact).
    `select(model, rows)` sets the rows before each forward."""

    def __init__(self, base: nn.Linear, updates: list[tuple[torch.Tensor, torch.Tensor, float] | None]):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        rank = max((a.size(0) for a, _, _ in filter(None, updates)), default=1)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        A = torch.zeros(len(updates) + 1, rank, self.in_features, **kw)  # adapter 0: none
        B = torch.zeros(len(updates) + 1, self.out_features, rank, **kw)
        for j, update in enumerate(updates, start=1):
            if update is not None:
                a, b, scale = update
                A[j, : a.size(0)] = a
                B[j, :, : a.size(0)] = b * scale  # the scale folded in
        self.register_buffer("stacked_A", A, persistent=False)
        self.register_buffer("stacked_B", B, persistent=False)
        self.rows: torch.Tensor | None = None  # (B,) adapter of each row; None: every row the base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.rows is None:
            return y
        A, B = self.stacked_A[self.rows], self.stacked_B[self.rows]  # (B, r, in), (B, out, r)
        rows = x.reshape(x.size(0), -1, x.size(-1))  # (B, T, in)
        return y + torch.bmm(torch.bmm(rows, A.transpose(1, 2)), B.transpose(1, 2)).view(y.shape)


def serve_side_by_side(model: nn.Module, adapted: list[nn.Module]) -> None:
    """Put the adapters of `adapted` (models of this base with LoRALinear layers, unmerged) on `model`'s layers,
    in place, as adapters 1..n of MultiLoRALinear layers; `select` picks one per batch row. Adapters of the
    embedding (target wte) are refused: its rows are looked up, not multiplied, per batch row."""
    for other in adapted:
        if any(isinstance(m, (TiedLoRAEmbedding, LoRAEmbedding)) for m in other.modules()):
            raise LoRAError("an adapter of the token embedding (--lora-targets wte) cannot be served beside others")
    names = {name for other in adapted for name, m in other.named_modules() if isinstance(m, LoRALinear)}
    for name in sorted(names):
        parent, _, attr = name.rpartition(".")
        base = model.get_submodule(name)
        updates = []
        for other in adapted:
            m = dict(other.named_modules()).get(name)
            updates.append((m.lora_A.detach(), m.lora_B.detach(), m.scale) if isinstance(m, LoRALinear) else None)
        setattr(model.get_submodule(parent), attr, MultiLoRALinear(base, updates))


def select(model: nn.Module, rows: torch.Tensor | None) -> None:
    """The adapter of each row of the next forward (0: the base), on every MultiLoRALinear; None: all the base."""
    for m in model.modules():
        if isinstance(m, MultiLoRALinear):
            m.rows = rows


def _targets(model: nn.Module, targets: list[str]):
    """(parent module, attribute name, Linear) for every targeted Linear of the decoder blocks."""
    for name, module in list(model.named_modules()):
        for target in targets:
            if name.startswith("transformer.h.") and name.endswith("." + target) and isinstance(module, nn.Linear):
                parent, _, attr = name.rpartition(".")
                yield model.get_submodule(parent), attr, module


def apply(model: nn.Module, config: LoRAConfig) -> int:
    """Freeze `model` and put adapters on its targeted layers, in place; returns the trainable parameters."""
    if getattr(model.config, "n_encoder_layer", 0):
        raise ConfigError("--lora-rank: LoRA adapts decoder-only models here, not seq2seq (--n-encoder-layer)")
    layers = list(_targets(model, config.targets))
    untied = getattr(model.config, "untied_head", False)
    if "wte" in config.targets:  # adapt the head; a tied embedding reads its adapters, an untied one has its own
        layers.append((model, "lm_head", model.lm_head))
    smallest = min(min(m.in_features, m.out_features) for _, _, m in layers)
    if config.rank > smallest:
        raise ConfigError(
            f"--lora-rank: {config.rank} exceeds the smallest adapted layer's {smallest} features; "
            f"use at most {smallest} (ranks of 4-64 are usual)"
        )
    model.requires_grad_(False)
    for parent, attr, linear in layers:
        setattr(parent, attr, LoRALinear(linear, config.rank, config.alpha, config.dropout))
    if "wte" in config.targets and untied:
        model.transformer.wte = LoRAEmbedding(model.transformer.wte, config.rank, config.alpha)
    elif "wte" in config.targets:
        model.transformer.wte = TiedLoRAEmbedding(model.transformer.wte, model.lm_head)
    return trainable_params(model)


def trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_adapted(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer, in place; the model computes the same logits with plain modules
    (the heads first: a tied embedding's merge only unwraps the matrix its head's merge updated)."""
    for kind in (LoRALinear, TiedLoRAEmbedding, LoRAEmbedding):
        for name, module in list(model.named_modules()):
            if type(module) is kind:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, module.merged())
    return model


# ---- what a checkpoint holds ------------------------------------------------------------------------


def saved_weights(model: nn.Module) -> dict:
    """The state a checkpoint stores: only the adapters of an adapted model, everything otherwise."""
    state = model.state_dict()
    if not is_adapted(model):
        return state
    return {k: v for k, v in state.items() if k.rpartition(".")[2] in ADAPTER_KEYS}


def load_weights(model: nn.Module, state: dict, source) -> None:
    """Load what `saved_weights` stored; adapters that do not fit are one line naming `source`."""
    if not is_adapted(model):
        model.load_state_dict(state)
        return
    want = saved_weights(model)
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    shapes = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or shapes:
        what = (
            f"missing {missing[:2]}"
            if missing
            else f"unexpected {unexpected[:2]}"
            if unexpected
            else f"{shapes[0]} is {tuple(state[shapes[0]].shape)}, the adapters want {tuple(want[shapes[0]].shape)}"
        )
        raise LoRAError(
            f"{source}: the LoRA adapters do not fit this model ({what}); a resumed LoRA run keeps "
            f"its --lora-rank and --lora-targets"
        )
    model.load_state_dict(state, strict=False)


def fingerprint(model: nn.Module) -> str:
    """sha256 of the frozen base weights (names, dtypes, shapes, bytes), adapters excluded."""
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        if key.rpartition(".")[2] in ADAPTER_KEYS:
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()

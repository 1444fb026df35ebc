"""Attention windows: which keys each layer's queries may see (sliding-window and global-token attention,
Longformer's pattern), one owner for the model's `attention_window` and `global_tokens`.

    w = Windows.of(config)            # config.attention_window "128,128,512,full", config.global_tokens 4
    w.size(i)                         # layer i's window in tokens (the pattern cycled over the layers); 0: full
    w.allowed(W, q, k, causal=True)   # boolean (..., Tq, Tk): query position q sees key position k

A window of W tokens lets the query at position p see the keys at positions p - W + 1 .. p (causal; W
keys, its own included), or within W - 1 positions either way (the encoder, not causal). The first
`global_tokens` positions are global: every query sees them and they see every key (in a causal model a
global query is early enough to see all it may anyway). `allowed` is the window's part of the mask only:
causality, padding and packed documents are the caller's, combined with `&`.

Footguns
- Positions, not slots: `allowed` compares the absolute positions of queries and keys, so a caller whose
  keys are not stored in position order (a ring cache) passes each slot's position, not its index.
- `attention_window` is a string in the config (the flag's own spelling), parsed here; "" and "full" are
  full attention, the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config imports this module, and a config is read without torch (gpt prepare)
    import torch


def parse(spec: str) -> tuple[int, ...]:
    """The window pattern of `spec` ("64", "128,128,512,full"): one size per entry, 0 for "full"; () for "".
    Raises ValueError with what is wrong."""
    if not isinstance(spec, str):
        raise ValueError(f"must be a string of comma-separated sizes or 'full', got {spec!r}")
    if not spec.strip():
        return ()
    sizes = []
    for part in spec.split(","):
        part = part.strip().lower()
        if part == "full":
            sizes.append(0)
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"each entry must be a window size >= 1 or 'full', got {part!r} in {spec!r}")
        sizes.append(int(part))
    return tuple(sizes) if any(sizes) else ()


@dataclass(frozen=True)
class Windows:
    """The windows of one model (build it with `Windows.of(config)`)."""

    pattern: tuple[int, ...] = ()  # window sizes cycled over the layers, 0 = full; () = full everywhere
    global_tokens: int = 0

    @classmethod
    def of(cls, config) -> Windows:
        return cls(parse(config.attention_window), config.global_tokens)

    @property
    def any(self) -> bool:
        """Some layer attends through a window."""
        return bool(self.pattern)

    def size(self, layer: int) -> int:
        """Layer `layer`'s window in tokens; 0 = full attention."""
        return self.pattern[layer % len(self.pattern)] if self.pattern else 0

    def sizes(self, n_layer: int) -> list[int]:
        return [self.size(i) for i in range(n_layer)]

    def allowed(self, size: int, q: torch.Tensor, k: torch.Tensor, causal: bool = True) -> torch.Tensor:
        """Boolean (..., Tq, Tk): the query at position q[..., i] may see the key at position k[..., j] through
        a window of `size` tokens and the global tokens (module notes). `q` (..., Tq) and `k` (..., Tk) are
        absolute positions; their leading dimensions broadcast."""
        d = q[..., :, None] - k[..., None, :]
        near = d < size if causal else d.abs() < size
        glob = k[..., None, :] < self.global_tokens
        if not causal:
            glob = glob | (q[..., :, None] < self.global_tokens)
        return near | glob

"""A one-token decode step is overhead bound on small models (about 1 us of dispatch per aten op): these count the
ops it dispatches, deterministically, so a change that adds view/metadata ops to the per-layer path shows."""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpt.model.transformer import GPT, GPTConfig


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(cfg: GPTConfig) -> collections.Counter:
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    caches = model.new_caches(1)
    idx = torch.randint(cfg.vocab_size, (1, 5))
    with torch.no_grad():
        model.hidden(idx, caches)  # the prompt
        with _Count() as count:
            model.head(model.hidden(idx[:, -1:], caches)[:, -1])
    return count.ops


def test_a_decode_step_of_the_char_model_dispatches_only_the_ops_it_needs():
    # the main job's model (shakespeare_char_cpu: 2 layers x 128): 84 ops a token before the qkv heads came from
    # one view + permute, the output from one reshape, and casts only where dtypes differ
    ops = _step_ops(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128, bias=False))
    assert sum(ops.values()) <= 74, ops
    assert ops["aten.transpose"] == 0 and ops["aten.split"] == 0, ops
    assert ops["aten._to_copy"] == 0, ops  # no dtype casts on a float32 model with a float32 cache
    assert ops["aten.mm"] == 9  # the compute itself: 4 Linears a layer and the head


def test_each_further_layer_costs_a_fixed_small_number_of_ops():
    base = dict(vocab_size=65, block_size=64, n_head=4, n_embd=64, bias=True)
    one, three = (sum(_step_ops(GPTConfig(n_layer=n, **base)).values()) for n in (1, 3))
    # 32: 4 Linears (4 ops each: view, t, addmm, view), 2 LayerNorms, qkv view/permute/unbind, 2 cache writes, SDPA,
    # 2 residual adds, GELU, ...; 37 before (split and per-head transposes, the output's transpose)
    assert (three - one) / 2 <= 32

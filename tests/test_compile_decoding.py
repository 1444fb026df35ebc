"""`GPT.compile_decoding` (`sample.py --compile`): one compiled one-token step, the same tokens as eager."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from gpt import GPT, GPTConfig
from gpt.infer.sampling import Decoder
from gpt.model.packed import pack


def tiny(dtype=torch.float32, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=23, block_size=16, n_layer=2, n_head=2, n_embd=32) | kw
    return pack(GPT(GPTConfig(**cfg)).eval().to(dtype))


def greedy(model: GPT, prompt: torch.Tensor, n: int, check=None) -> list[int]:
    dec = Decoder(model, prompt, keep=8)
    out = []
    for _ in range(n):
        if check:
            check(dec)
        token = dec.logits.argmax(-1)
        out.append(int(token))
        dec.advance(token)
    return out


def compiled_copy(model: GPT) -> GPT:
    twin = GPT.__new__(GPT)
    twin.__dict__ = dict(model.__dict__)  # the same weights, its own compiled step
    twin.compile_decoding()
    return twin


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_step_equals_eager_and_full_forward_and_compiles_once():
    model = tiny()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    compiled = compiled_copy(model)

    def full_forward_agrees(dec):
        logits = model(dec.tokens[:, dec.start :])[0][:, -1].float()
        torch.testing.assert_close(dec.logits, logits, rtol=1e-4, atol=1e-4)

    # 30 tokens in a 16-token context: every length, and window slides (eager prefills) in between
    eager = greedy(model, prompt, 30)
    assert greedy(compiled, prompt, 30, full_forward_agrees) == eager
    # one graph for every length, a second for the full (contiguous) cache; a new decoder adds none
    assert counters["stats"]["unique_graphs"] == 2
    assert greedy(compiled, prompt[:, :3], 20) == greedy(model, prompt[:, :3], 20)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]


def test_rope_rolling_cache_compiled_equals_eager():
    model = tiny(pos_encoding="rope")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    assert greedy(compiled_copy(model), prompt, 24) == greedy(model, prompt, 24)  # past the full cache
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN computes bf16 natively only")
def test_bf16_packed_layers_compile_without_graph_breaks():
    model = tiny(torch.bfloat16)
    prompt = torch.tensor([[1, 2, 3]])
    assert greedy(compiled_copy(model), prompt, 12) == greedy(model, prompt, 12)
    assert not counters["graph_break"]  # PackedLinear goes through the gpt::packed_linear op
    assert counters["stats"]["unique_graphs"] == 1  # 15 tokens: the 16-slot cache is never full


def test_float32_column_blocks_compile_without_graph_breaks():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=23, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
    model = pack(GPT(cfg).eval(), chunks=2, chunk_bytes=0)  # every Linear a ChunkedLinear (23 ids: one padded)
    prompt = torch.tensor([[1, 2, 3]])
    assert greedy(compiled_copy(model), prompt, 12) == greedy(model, prompt, 12)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1


def test_the_cache_length_is_marked_dynamic_once_per_decoder_not_at_every_step(monkeypatch):
    """Marking costs Python time at every token (~35 us, an eighth of the char model's compiled step);
    once per decoder is enough: the symbolic-length graph then serves every length without recompiling."""
    model = compiled_copy(tiny())
    marked = []
    real = torch._dynamo.mark_dynamic
    monkeypatch.setattr(torch._dynamo, "mark_dynamic", lambda t, dim: (marked.append(dim), real(t, dim)))
    prompt = torch.tensor([[1, 2, 3]])
    assert greedy(model, prompt, 10) == greedy(tiny(), prompt, 10)
    assert len(marked) == 2 * 2  # keys and values of 2 layers, at the first step only
    greedy(model, prompt, 10)
    assert len(marked) == 2 * 2 * 2 and counters["stats"]["unique_graphs"] == 1

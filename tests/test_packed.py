"""CPU decode layout (gpt/model/packed.py): which layers change, that nothing else does, where it applies. PyTorch's
layouts (`kernels=False`, as without a C compiler) and our kernels' (tests/test_rowkernels.py has their numbers)."""

import pytest
import torch
import torch.nn as nn

from gpt import GPT, GPTConfig
from gpt.checkpoints.loader import load_for_inference
from gpt.infer.batching import BatchEngine, Request
from gpt.infer.sampling import Decoder, SampleConfig, complete
from gpt.model import rowkernels
from gpt.model.packed import ChunkedLinear, PackedLinear, can_pack, pack
from gpt.model.quantize import Int8Linear
from gpt.model.rowkernels import RowLinear

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**over) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, **over)).eval()


def greedy(model: GPT, idx: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV-cached greedy tokens and the last step's logits."""
    dec = Decoder(model, idx)
    for _ in range(steps):
        dec.advance(dec.logits.argmax(-1))
    return dec.tokens, dec.logits


def test_float32_packs_every_linear_layer_and_computes_the_same():
    model, reference = tiny(), tiny()
    idx = torch.randint(0, 50, (3, 9))
    pack(model, kernels=False)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 4 + 1
    assert all(m.weight.stride() == (1, m.out_features) for m in linears)  # (in, out) contiguous
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied: no second copy
    assert torch.equal(model.transformer.wte.weight, reference.transformer.wte.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference(idx)[0], atol=1e-5, rtol=1e-5)
    # decoding: token for token as the unpacked model, and the cached steps equal a full recompute
    tokens, logits = greedy(model, idx[:1, :5], 10)
    ref_tokens, _ = greedy(reference, idx[:1, :5], 10)
    assert torch.equal(tokens, ref_tokens)
    with torch.no_grad():
        full = model.lm_head(model.hidden(tokens))[:, -1]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_float32_column_blocks_compute_what_nn_linear_does_and_decode_the_same(bias):
    """ChunkedLinear (one column block per thread, the big float32 matrices): the same logits as the plain
    model, token for token the same greedy decode, and the cached steps equal a full recompute; 3 blocks
    of 50 ids pad the last one, which must never show up as logits."""
    model, reference = tiny(bias=bias), tiny(bias=bias)
    pack(model, chunks=3, chunk_bytes=0, kernels=False)
    chunked = [m for m in model.modules() if isinstance(m, ChunkedLinear)]
    assert len(chunked) == 2 * 4 + 1 and not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.lm_head.weight.shape == (3, 32, 17)  # 50 ids in 3 blocks of 17, the last padded
    assert torch.equal(model.transformer.wte.weight, reference.transformer.wte.weight)  # rows still read
    x = torch.randn(2, 5, 32)
    for ours, theirs in [
        (model.lm_head, reference.lm_head),
        (model.transformer.h[0].mlp.c_fc, reference.transformer.h[0].mlp.c_fc),
    ]:
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours(x[0, 0]), theirs(x[0, 0]), atol=1e-5, rtol=1e-5)  # one row, no batch
    idx = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference(idx)[0], atol=1e-5, rtol=1e-5)
    tokens, logits = greedy(model, idx[:1, :5], 10)
    assert torch.equal(tokens, greedy(reference, idx[:1, :5], 10)[0])
    with torch.no_grad():
        full = model.head(model.hidden(tokens))[:, -1]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)


def test_float32_blocks_follow_the_thread_count_and_small_matrices_stay_transposed():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = pack(
            tiny(), chunk_bytes=32 * 128 * 4, kernels=False
        )  # the MLP's matrices are that big, the rest smaller
    finally:
        torch.set_num_threads(n)
    assert (
        isinstance(model.transformer.h[0].mlp.c_fc, ChunkedLinear)
        and model.transformer.h[0].mlp.c_fc.weight.size(0) == 2
    )
    assert type(model.transformer.h[0].attn.c_attn) is nn.Linear
    assert model.transformer.h[0].attn.c_attn.weight.stride() == (1, 96)
    assert model.lm_head.weight is model.transformer.wte.weight  # a small head stays tied to the embedding
    assert (
        type(pack(tiny(), chunk_bytes=0, kernels=False).lm_head) is nn.Linear
    )  # one thread (this test file's): no blocks


def test_bf16_is_packed_where_onednn_computes_it_natively():
    model, reference = tiny().to(torch.bfloat16), tiny().to(torch.bfloat16)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert can_pack(model) == native
    pack(model, kernels=False)
    assert isinstance(model.lm_head, PackedLinear if native else nn.Linear)
    idx = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0].float(), reference(idx)[0].float(), atol=2e-2, rtol=2e-2)
    tokens, _ = greedy(model, idx[:1, :4], 8)
    assert torch.equal(tokens, greedy(reference, idx[:1, :4], 8)[0])


@pytest.mark.parametrize("kernels", [False, True])
def test_cross_attention_and_other_devices_stay_as_they_are(kernels):
    model = tiny(n_encoder_layer=1)
    pack(model, kernels=kernels)
    assert model.transformer.h[0].cross_attn.c_attn.weight.is_contiguous()  # slices its weight: kept
    assert type(model.transformer.h[0].cross_attn.c_attn) is nn.Linear
    if kernels and rowkernels.library():
        assert isinstance(model.transformer.h[0].attn.c_attn, RowLinear)
        assert isinstance(model.encoder.h[0].mlp.c_fc, RowLinear)
    else:
        assert not model.transformer.h[0].attn.c_attn.weight.is_contiguous()
        assert not model.encoder.h[0].mlp.c_fc.weight.is_contiguous()
    assert not can_pack(tiny().to(torch.float16))  # not a CPU inference precision
    if torch.cuda.is_available():
        assert not can_pack(tiny().cuda())


def test_load_for_inference_lays_out_float32_and_int8_on_the_cpu(trained_run):
    """With our kernels (where they build) float32 and int8 become RowLinear; without, float32 is transposed and
    int8 stays Int8Linear. Either way greedy decoding agrees with the server's batch engine."""
    rt, model, tok, _, _ = load_for_inference(trained_run, "cpu", "float32")
    if rowkernels.library():
        assert isinstance(model.lm_head, RowLinear) and isinstance(model.transformer.h[0].mlp.c_fc, RowLinear)
    else:
        assert not model.lm_head.weight.is_contiguous()
        assert not model.transformer.h[0].mlp.c_fc.weight.is_contiguous()
    text = complete(model, tok, "ROMEO:", max_new_tokens=20, temperature=0)[0]
    engine = BatchEngine(model, tok, max_rows=3)  # the server: several rows, per-row positions
    out = []
    config = SampleConfig(max_new_tokens=20, temperature=0)
    engine.submit(Request(tok.encode("ROMEO:"), config, lambda p: out.append(p.text)))
    while engine.busy:
        engine.step()
    assert "".join(out) == text
    _, int8, _, _, _ = load_for_inference(trained_run, "cpu", "float32", quantize="int8")
    assert isinstance(int8.lm_head, RowLinear if rowkernels.library() else Int8Linear)


def test_a_bf16_model_on_the_cpu_attends_over_a_float32_cache_and_decodes_as_it_recomputes():
    model = tiny().to(torch.bfloat16)
    assert model.new_caches(1)[0].k.dtype == torch.float32  # the CPU's bf16 attention kernel is the slow one
    assert tiny().new_caches(1)[0].k.dtype == torch.float32
    idx = torch.randint(0, 50, (1, 4))
    tokens, logits = greedy(model, idx, 10)
    with torch.no_grad():  # the cached steps against a full recompute in bf16 (attention over bf16 keys)
        full = model.lm_head(model.hidden(tokens))[:, -1].float()
        steps = model.lm_head(model.hidden(tokens[:, :-1])).float().argmax(-1)[0, 3:]
    assert torch.equal(steps, tokens[0, 4:])
    torch.testing.assert_close(logits, full, atol=3e-2, rtol=3e-2)

"""RoPE (`pos_encoding="rope"`): the rotation against transformers' LLaMA helpers, positions that matter,
and KV-cached decoding equal to recomputing, rolling past block_size without a prefill (causality:
tests/test_model.py)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from gpt import GPT, GPTConfig
from gpt.infer.logits import next_token
from gpt.infer.sampling import Decoder, complete
from gpt.infer.translate import generate as translate_ids
from gpt.model.transformer import apply_rope, rope_cos_sin

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def rope_model(block=16, n_encoder_layer=0, seed=0) -> GPT:
    """Random matrices with a large spread (LayerNorms as initialised), so the text varies."""
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            vocab_size=40,
            block_size=block,
            n_layer=2,
            n_head=4,
            n_embd=32,
            pos_encoding="rope",
            n_encoder_layer=n_encoder_layer,
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if not n_encoder_layer else 0.5)
    return model


def hf_rotate(q, k, positions):
    """transformers' rotation: LlamaRotaryEmbedding's cos / sin, apply_rotary_pos_emb."""
    nh, hs = q.size(1), q.size(-1)
    config = LlamaConfig(
        hidden_size=nh * hs,
        num_attention_heads=nh,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    return apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("start", [0, 1000])
def test_rotation_matches_transformers(start):
    q, k = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16)
    positions = torch.arange(start, start + 7)
    want_q, want_k = hf_rotate(q, k, positions)
    cos, sin = rope_cos_sin(positions, 16)
    atol = 1e-5 if start == 0 else 2e-4  # transformers computes the angles in float32, we in float64
    torch.testing.assert_close(apply_rope(q, cos, sin), want_q, atol=atol, rtol=1e-5)
    torch.testing.assert_close(apply_rope(k, cos, sin), want_k, atol=atol, rtol=1e-5)


def test_attention_scores_depend_on_relative_positions_only():
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        rotated = (
            apply_rope(q, *rope_cos_sin(torch.tensor([i]), 16)),
            apply_rope(k, *rope_cos_sin(torch.tensor([j]), 16)),
        )
        return (rotated[0] * rotated[1]).sum()

    torch.testing.assert_close(score(9, 4), score(1009, 1004), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(9, 4), score(9, 5))


def test_attention_layer_matches_a_reference_built_on_transformers_rotation():
    model = rope_model()
    attn, T = model.transformer.h[0].attn, 10
    x = torch.randn(2, T, 32)
    q, k, v = (t.view(2, T, 4, 8).transpose(1, 2) for t in attn.c_attn(x).split(32, dim=2))
    q, k = hf_rotate(q, k, torch.arange(T))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, T, 32)
    out = attn(x, causal=True, rope=model.rope(0, T, x.device))  # values ~10 (weights of std 1): float32 rounding
    torch.testing.assert_close(out, attn.c_proj(y), atol=1e-4, rtol=1e-4)


def test_no_position_table_and_positions_matter():
    model = rope_model()
    assert (
        not any("wpe" in name or name == "pe" for name, _ in model.named_buffers()) and "wpe" not in model.transformer
    )
    idx = torch.randint(0, 40, (1, 12))
    swapped = idx.clone()
    swapped[0, [0, 1]] = idx[0, [1, 0]]
    assert idx[0, 0] != idx[0, 1]
    # the same tokens in another order: a model without positions would give the same last logits
    assert not torch.allclose(model(idx)[0][0, -1], model(swapped)[0][0, -1])


def band_mask(T: int, width: int) -> torch.Tensor:
    """Causal attention over the last `width` positions (each query's own included)."""
    i = torch.arange(T)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - width)


@pytest.mark.parametrize("graph", [False, True])  # the dynamic cache; the static one (CUDA-graph steps)
@pytest.mark.parametrize("prompt_len", [3, 16, 21])  # short, exactly block_size, longer (its tail is kept)
def test_cache_rolls_past_block_size_and_equals_recompute(prompt_len, graph):
    """Within the window the cached logits equal a plain forward; past it the cache rolls (no prefill)
    and equals a full forward in which every layer attends over the last block_size positions."""
    model = rope_model(block=16)
    idx = torch.randint(0, 40, (3, prompt_len))
    dec = Decoder(model, idx, graph=graph)
    draws, reference = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)  # in lockstep
    for _ in range(40):  # more than two windows
        context = dec.tokens[:, -(dec.tokens.size(1) - max(0, prompt_len - 16)) :]  # all since the prompt's tail
        with torch.no_grad():
            want = model.lm_head(model.hidden(context, mask=band_mask(context.size(1), 16))[:, -1])
        torch.testing.assert_close(dec.logits, want, atol=5e-4, rtol=1e-4)  # logits ~10: float32 rounding
        drawn = next_token(dec.logits, temperature=1.0, generator=draws)  # sampled: greedy text would repeat
        assert torch.equal(drawn, next_token(want, temperature=1.0, generator=reference))
        dec.advance(drawn)
    assert dec.prefills == 1 and dec.context_len == 16
    assert len(set(dec.tokens[:, prompt_len:].flatten().tolist())) > 5  # a non-trivial sequence
    with torch.no_grad():  # before any roll, the cache also equals the plain causal forward
        short = Decoder(model, idx[:, :3])
        torch.testing.assert_close(short.logits, model(idx[:, :3])[0][:, -1], atol=1e-5, rtol=1e-5)


def test_encoder_decoder_with_rope_is_causal_and_caches_exactly():
    model = rope_model(block=24, n_encoder_layer=2)
    src = torch.randint(1, 39, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    tgt = torch.randint(0, 40, (2, 10))
    base, _ = model(tgt, src=src, src_mask=mask)
    changed = tgt.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 40
    torch.testing.assert_close(model(changed, src=src, src_mask=mask)[0][:, :5], base[:, :5], rtol=0, atol=0)
    swapped = src.clone()
    swapped[:, [0, 1]] = src[:, [1, 0]]  # the encoder knows the order of its source too
    assert not torch.allclose(model.encode(swapped, mask)[:, 4], model.encode(src, mask)[:, 4])
    cached = translate_ids(model, src, mask, 39, 39, max_new_tokens=20)
    assert cached == translate_ids(model, src, mask, 39, 39, max_new_tokens=20, use_cache=False)
    assert max(map(len, cached)) >= 8


def test_generate_runs_far_past_the_context_without_prefills(monkeypatch):
    from gpt.data.tokenizer import CharTokenizer

    model = rope_model(block=16)
    prefills = []
    real = Decoder._prefill
    monkeypatch.setattr(Decoder, "_prefill", lambda self: prefills.append(1) or real(self))
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,\n!?ABCDEF")
    (text,) = complete(model, tok, "abc", max_new_tokens=100, temperature=0, stop_at_eot=False)
    assert len(text) == 100 and prefills == [1]


def test_a_rope_model_is_exported_as_gpt_neox():
    from gpt.checkpoints.hf import config_to_hf

    config = config_to_hf(rope_model().config, eot_token=0)  # tests/test_hf_export.py: transformers' logits
    assert config["architectures"] == ["GPTNeoXForCausalLM"] and config["use_parallel_residual"] is False
    assert config["rotary_pct"] == 1.0 and config["rotary_emb_base"] == 10000.0


def test_the_shipped_rope_config_trains_and_samples_past_its_context(char_data, tmp_path, monkeypatch):
    from gpt.checkpoints.loader import load_checkpoint
    from gpt.train.start import resolve_run
    from gpt.train.trainer import train

    out = tmp_path / "rope"
    plan = resolve_run(
        [
            "--config",
            "shakespeare_char_rope_cpu",
            "--data",
            str(char_data),
            "--out-dir",
            str(out),
            "--n-layer",
            "2",
            "--n-embd",
            "64",
            "--block-size",
            "32",
            "--max-iters",
            "60",
            "--lr-decay-iters",
            "60",
            "--eval-interval",
            "30",
            "--eval-iters",
            "4",
            "--threads",
            "1",
            "--device",
            "cpu",
        ]
    )
    assert plan.cfg.model.pos_encoding == "rope"
    summary = train(plan)
    assert summary["val_loss"] < 2.9  # from about ln(vocab size) = 4.2 at the start
    model, tok, meta = load_checkpoint(out)
    assert meta["model_config"]["pos_encoding"] == "rope" and "wpe" not in model.transformer
    prefills = []
    real = Decoder._prefill
    monkeypatch.setattr(Decoder, "_prefill", lambda self: prefills.append(1) or real(self))
    (text,) = complete(model, tok, "ROMEO:", max_new_tokens=100, temperature=0.8, seed=0, stop_at_eot=False)
    assert len(text) == 100 and prefills == [1]  # 3 windows of 32, one prefill

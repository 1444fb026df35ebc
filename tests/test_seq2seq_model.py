"""The encoder-decoder model: parity with torch.nn.Transformer, masks, causality, padding."""

import pytest
import torch
import torch.nn.functional as F

from gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


S2S = dict(vocab_size=50, block_size=24, n_layer=2, n_encoder_layer=3, n_head=4, n_embd=32)


def seq2seq(**kw) -> GPT:
    return GPT(GPTConfig(**{**S2S, **kw})).eval()


def padded_batch(lengths, S=10, vocab=50, pad=0):
    """Random source ids, right-padded with `pad` to S, and the padding mask (True = real)."""
    src = torch.randint(1, vocab, (len(lengths), S))
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    return src.masked_fill(~mask, pad), mask


def randomize_(model: torch.nn.Module) -> None:
    """Random weights everywhere, LayerNorm gains and biases included, so no parameter hides."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)


def copy_into_nn_transformer(model: GPT) -> torch.nn.Transformer:
    """An nn.Transformer (post-norm, batch_first) holding `model`'s encoder and decoder weights."""
    C = model.config.n_embd
    ref = torch.nn.Transformer(
        d_model=C,
        nhead=model.config.n_head,
        num_encoder_layers=model.config.n_encoder_layer,
        num_decoder_layers=model.config.n_layer,
        dim_feedforward=4 * C,
        dropout=0.0,
        activation=lambda x: F.gelu(x, approximate="tanh"),  # our MLP's GELU (GPT-2's gelu_new)
        batch_first=True,
        norm_first=False,
    ).eval()

    def attn(theirs: torch.nn.MultiheadAttention, ours):
        # c_attn's rows are [q; k; v] exactly like in_proj_weight
        theirs.in_proj_weight.copy_(ours.c_attn.weight)
        theirs.in_proj_bias.copy_(ours.c_attn.bias)
        theirs.out_proj.weight.copy_(ours.c_proj.weight)
        theirs.out_proj.bias.copy_(ours.c_proj.bias)

    def ln(theirs, ours):
        theirs.weight.copy_(ours.weight)
        theirs.bias.copy_(ours.bias)

    def mlp(layer, ours):
        layer.linear1.load_state_dict(ours.c_fc.state_dict())
        layer.linear2.load_state_dict(ours.c_proj.state_dict())

    with torch.no_grad():
        for layer, block in zip(ref.encoder.layers, model.encoder.h):
            attn(layer.self_attn, block.attn), ln(layer.norm1, block.ln_1)
            mlp(layer, block.mlp), ln(layer.norm2, block.ln_2)
        ln(ref.encoder.norm, model.encoder.ln_f)
        for layer, block in zip(ref.decoder.layers, model.transformer.h):
            attn(layer.self_attn, block.attn), ln(layer.norm1, block.ln_1)
            attn(layer.multihead_attn, block.cross_attn), ln(layer.norm2, block.ln_cross)
            mlp(layer, block.mlp), ln(layer.norm3, block.ln_2)
        ln(ref.decoder.norm, model.transformer.ln_f)
    return ref


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # nn.Transformer's slow path is the point
@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_parity_with_torch_nn_transformer(pos_encoding):
    torch.manual_seed(0)
    model = seq2seq(norm="post", pos_encoding=pos_encoding)
    randomize_(model)
    ref = copy_into_nn_transformer(model)
    src, src_mask = padded_batch([10, 7, 3])
    tgt = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        ours = model.decode(memory, src_mask, tgt)
        x_src, x_tgt = model.embed(src), model.embed(tgt)  # nn.Transformer starts after the embeddings
        ref_memory = ref.encoder(x_src, src_key_padding_mask=~src_mask)
        theirs = ref(
            x_src,
            x_tgt,
            src_key_padding_mask=~src_mask,
            memory_key_padding_mask=~src_mask,
            tgt_mask=ref.generate_square_subsequent_mask(9),
            tgt_is_causal=True,
        )
    real = src_mask[..., None].expand_as(memory)
    torch.testing.assert_close(memory[real], ref_memory[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours.abs().mean() > 0.1  # a real signal, not two zero tensors


def test_forward_gives_logits_and_loss_of_decode():
    model = seq2seq()
    src, src_mask = padded_batch([10, 4])
    tgt_in = torch.randint(0, 50, (2, 6))
    tgt_out = torch.randint(0, 50, (2, 6))
    tgt_out[1, 3:] = -1  # padded target positions are ignored by the loss
    logits, loss = model(tgt_in, tgt_out, src=src, src_mask=src_mask)
    assert logits.shape == (2, 6, 50)
    expected = model.lm_head(model.decode(model.encode(src, src_mask), src_mask, tgt_in))
    torch.testing.assert_close(logits, expected)
    keep = tgt_out != -1
    torch.testing.assert_close(loss, F.cross_entropy(logits[keep], tgt_out[keep]))


def test_changing_a_padded_source_token_changes_nothing():
    model = seq2seq()
    src, src_mask = padded_batch([10, 6, 2])
    tgt = torch.randint(0, 50, (3, 8))
    base, _ = model(tgt, src=src, src_mask=src_mask)
    changed = torch.where(src_mask, src, torch.randint(0, 50, src.shape))
    assert not torch.equal(changed, src)
    out, _ = model(tgt, src=changed, src_mask=src_mask)
    torch.testing.assert_close(out, base, rtol=0, atol=0)
    # and the encoder output at real positions does not move either
    m0, m1 = model.encode(src, src_mask), model.encode(changed, src_mask)
    torch.testing.assert_close(m0[src_mask], m1[src_mask], rtol=0, atol=0)


def test_padded_batch_equals_each_sentence_alone():
    model = seq2seq()
    src, src_mask = padded_batch([10, 5])
    tgt = torch.randint(0, 50, (2, 7))
    batched, _ = model(tgt, src=src, src_mask=src_mask)
    alone, _ = model(tgt[1:], src=src[1:, :5], src_mask=src_mask[1:, :5])
    torch.testing.assert_close(batched[1:], alone, atol=1e-5, rtol=1e-5)


def test_cross_attention_ignores_padded_memory():
    """Even garbage in the memory at padded positions (not only the source tokens) is invisible."""
    model = seq2seq()
    src, src_mask = padded_batch([10, 3])
    tgt = torch.randint(0, 50, (2, 5))
    memory = model.encode(src, src_mask)
    noisy = torch.where(src_mask[..., None], memory, torch.randn_like(memory) * 100)
    torch.testing.assert_close(model.decode(noisy, src_mask, tgt), model.decode(memory, src_mask, tgt), rtol=0, atol=0)
    # without the mask the noise does leak in: the test above would catch a mask that is dropped
    assert not torch.allclose(model.decode(noisy, None, tgt), model.decode(memory, None, tgt))


def test_decoder_is_causal_and_encoder_is_not():
    model = seq2seq()
    src, src_mask = padded_batch([10])
    tgt = torch.randint(0, 50, (1, 12))
    base, _ = model(tgt, src=src, src_mask=src_mask)
    for t in (0, 4, 10):
        changed = tgt.clone()
        changed[0, t + 1 :] = (changed[0, t + 1 :] + 1) % 50
        out, _ = model(changed, src=src, src_mask=src_mask)
        torch.testing.assert_close(out[0, : t + 1], base[0, : t + 1], rtol=0, atol=0)
        assert not torch.allclose(out[0, t + 1 :], base[0, t + 1 :])
    # the encoder sees the whole source: changing the last source token moves the first position
    changed = src.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 50
    assert not torch.allclose(model.encode(changed, src_mask)[0, 0], model.encode(src, src_mask)[0, 0])


def test_tgt_mask_hides_target_keys():
    model = seq2seq()
    src, src_mask = padded_batch([10])
    tgt = torch.randint(0, 50, (1, 6))
    memory = model.encode(src, src_mask)
    keep = torch.tensor([[True, False, True, True, True, True]])
    out = model.decode(memory, src_mask, tgt, tgt_mask=keep)
    changed = tgt.clone()
    changed[0, 1] = (changed[0, 1] + 1) % 50
    out2 = model.decode(memory, src_mask, changed, tgt_mask=keep)
    # position 1 itself changes (its own query), every later position never saw key 1
    torch.testing.assert_close(out2[0, 2:], out[0, 2:], rtol=0, atol=0)


def test_cached_decoding_equals_full_decode():
    from gpt.model.cache import KVCache

    model = seq2seq()
    src, src_mask = padded_batch([10, 6])
    tgt = torch.randint(0, 50, (2, 8))
    memory = model.encode(src, src_mask)
    full = model.decode(memory, src_mask, tgt)
    C, nh = model.config.n_embd, model.config.n_head
    caches = [KVCache(2, nh, 8, C // nh, "cpu", torch.float32) for _ in model.transformer.h]
    kv = [block.cross_attn.project_kv(memory) for block in model.transformer.h]
    steps = [model.decode(kv, src_mask, tgt[:, :3], caches=caches)]  # a prompt, then one at a time
    steps += [model.decode(kv, src_mask, tgt[:, t : t + 1], caches=caches) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_shared_embedding_for_source_target_and_head():
    model = seq2seq()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not any("wte" in name for name, _ in model.encoder.named_parameters())
    src, src_mask = padded_batch([10])
    tgt = torch.randint(0, 50, (1, 5))
    _, loss = model(tgt, tgt, src=src, src_mask=src_mask)
    loss.backward()
    grads = model.transformer.wte.weight.grad
    assert grads[src[0].unique()].abs().sum(-1).gt(0).all()  # source rows get gradient too


def test_param_count_and_groups_include_encoder():
    model = seq2seq(pos_encoding="sinusoidal")
    C, V = 32, 50
    attn = 3 * C * C + 3 * C + C * C + C
    mlp = 4 * C * C + 4 * C + 4 * C * C + C
    enc_layer = 2 * 2 * C + attn + mlp
    dec_layer = enc_layer + 2 * C + attn
    expected = V * C + 3 * enc_layer + 2 * C + 2 * dec_layer + 2 * C  # no wpe with sinusoidal positions
    assert model.num_params() == model.num_params(non_embedding=False) == expected
    decay, no_decay = model.param_groups(0.1)
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == expected
    assert any(p is model.encoder.h[0].attn.c_attn.weight for p in decay["params"])
    assert model.flops_per_token(16) == 6 * expected + 12 * 5 * 16 * C


def test_misuse_is_a_clear_error():
    decoder_only = GPT(GPTConfig(**{**S2S, "n_encoder_layer": 0}))
    src, src_mask = padded_batch([10])
    with pytest.raises(ValueError, match="n_encoder_layer=0"):
        decoder_only(src, src=src, src_mask=src_mask)
    with pytest.raises(ValueError, match="pass src="):
        seq2seq()(src)
    with pytest.raises(ValueError, match="boolean"):
        seq2seq().encode(src, src_mask.long())


def test_decoder_only_state_dict_unchanged_by_seq2seq_options():
    keys = set(GPT(GPTConfig(**{**S2S, "n_encoder_layer": 0})).state_dict())
    assert not any(k.startswith("encoder.") or "cross" in k for k in keys)
    s2s_keys = set(seq2seq().state_dict())
    assert keys < s2s_keys

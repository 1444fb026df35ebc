import math

import pytest
import torch

from gpt import GPT, GPTConfig
from gpt.checkpoints.hf import state_dict_from_hf

TINY = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)


def tiny(**kw) -> GPT:
    return GPT(GPTConfig(**{**TINY, **kw})).eval()


def test_logits_shape_with_and_without_targets():
    model = tiny()
    idx = torch.randint(0, 97, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, 97) and loss is None
    logits2, loss2 = model(idx, idx)
    assert logits2.shape == (3, 10, 97) and loss2.ndim == 0
    torch.testing.assert_close(logits, logits2)


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal", "rope"])
def test_causality(pos_encoding):
    model = tiny(pos_encoding=pos_encoding)
    idx = torch.randint(0, 97, (1, 20))
    base, _ = model(idx)
    for t in (0, 5, 18):
        changed = idx.clone()
        changed[0, t + 1 :] = (changed[0, t + 1 :] + 1) % 97  # every later token changes
        out, _ = model(changed)
        torch.testing.assert_close(out[0, : t + 1], base[0, : t + 1], rtol=0, atol=0)
        assert not torch.allclose(out[0, t + 1 :], base[0, t + 1 :])


def test_input_longer_than_block_size_is_an_error():
    with pytest.raises(ValueError, match="exceeds block_size 32"):
        tiny()(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize(
    "field,value",
    [
        ("n_embd", 30),
        ("n_head", 0),
        ("vocab_size", -1),
        ("block_size", 0),
        ("n_layer", 0),
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("norm", "middle"),
        ("pos_encoding", "rotary"),
        ("activation", "relu"),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**TINY, field: value})


def test_weight_tying_by_identity_and_param_count():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_params(non_embedding=False) == sum(unique.values())
    assert model.num_params() == sum(unique.values()) - 32 * 32  # minus wpe
    # by hand: wte + wpe + per layer (2 LN + qkv + proj + fc + proj) + ln_f
    C, L = 32, 2
    per_layer = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    assert model.num_params(non_embedding=False) == 97 * C + 32 * C + L * per_layer + 2 * C


def test_param_groups_decay_matrices_only():
    model = tiny()
    decay, no_decay = model.param_groups(0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == model.num_params(non_embedding=False)


def test_flops_per_token():
    model = tiny()
    assert model.flops_per_token(16) == 6 * model.num_params() + 12 * 2 * 16 * 32


def test_residual_projection_init_is_scaled():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=8, n_head=4, n_embd=256))
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_initial_loss_is_near_uniform_and_one_batch_overfits():
    torch.manual_seed(0)
    model = tiny().train()
    x = torch.randint(0, 97, (4, 32))
    y = torch.randint(0, 97, (4, 32))
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(97)) < 0.1
    opt = torch.optim.AdamW(model.param_groups(0.0), lr=3e-3)
    for _ in range(300):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_ignore_index_targets_do_not_count():
    model = tiny()
    x = torch.randint(0, 97, (2, 8))
    y = torch.randint(0, 97, (2, 8))
    y_masked = y.clone()
    y_masked[:, 4:] = -1
    logits, loss = model(x, y_masked)
    expected = torch.nn.functional.cross_entropy(logits[:, :4].reshape(-1, 97), y[:, :4].reshape(-1))
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("ours_act, theirs_act", [("gelu_tanh", "gelu_new"), ("gelu", "gelu")])
def test_parity_with_transformers_gpt2(ours_act, theirs_act):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=97,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function=theirs_act,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # random weights everywhere, biases and LayerNorms included
        for p in hf.parameters():
            p.normal_(0, 0.2)
    model = tiny(activation=ours_act)
    model.load_state_dict(state_dict_from_hf(hf.state_dict()))
    idx = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_crop_block_size_keeps_leading_positions():
    model = tiny()
    wpe = model.transformer.wpe.weight[:16].clone()
    model.crop_block_size(16)
    assert model.config.block_size == 16 and torch.equal(model.transformer.wpe.weight, wpe)
    with pytest.raises(ValueError):
        model.crop_block_size(64)

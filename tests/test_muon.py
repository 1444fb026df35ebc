"""gpt/train/muon.py: the orthogonalisation, the update against torch.optim.Muon, AdamW groups against
torch.optim.AdamW, and which parameters each half of the optimizer gets."""

import pytest
import torch

from gpt import runtime
from gpt.errors import ConfigError
from gpt.model.transformer import GPT, GPTConfig
from gpt.train.config import TrainConfig
from gpt.train.muon import Muon, ns_dtype_for, orthogonalize


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 128)])
def test_orthogonalize_keeps_the_directions_and_flattens_the_singular_values(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(-1, 1, shape[1]))
    o = orthogonalize(g)
    assert o.shape == g.shape and o.dtype == torch.float32
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.5 and s.max() < 1.5  # from singular values spread over 0.1..10 in g
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    assert torch.sum(o * polar) / (o.norm() * polar.norm()) > 0.9  # close to U V^T


def test_muon_groups_equal_torch_muon_in_bf16():
    """With ns_dtype=bf16 the update is torch.optim.Muon's (momentum, Nesterov, scale, weight decay)."""
    gen = torch.Generator().manual_seed(0)
    wide, tall = torch.randn(16, 48, generator=gen), torch.randn(48, 16, generator=gen)
    ours = [torch.nn.Parameter(w.clone()) for w in (wide, tall)]
    theirs = [torch.nn.Parameter(w.clone()) for w in (wide, tall)]
    opt = Muon([{"params": ours, "muon": True, "weight_decay": 0.1}], lr=0.05, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="original")
    for _ in range(3):
        grads = [torch.randn(w.shape, generator=gen) for w in (wide, tall)]
        for params in (ours, theirs):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.equal(ours[0], wide)


def test_other_groups_are_adamw():
    model_a, model_b = (GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)) for _ in "ab")
    model_b.load_state_dict(model_a.state_dict())
    opt = Muon(model_a.param_groups(0.1, muon=True), lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(model_b.param_groups(0.1), lr=1e-2, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        if ".h." in name and a.dim() == 2:
            assert not torch.allclose(a, b), name  # Muon moved the blocks' matrices differently
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_muon_takes_the_blocks_linear_weights_only():
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, n_encoder_layer=1))
    muon, matrices, vectors = model.param_groups(0.1, muon=True)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(names[id(p)] for p in muon["params"])
    assert muon["muon"] and len(muon_names) == 2 * 6 + 1 * 4  # decoder blocks: self + cross attention, MLP
    assert all(
        n.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))
        for n in muon_names
    )
    assert any("encoder" in n for n in muon_names) and any("cross_attn" in n for n in muon_names)
    assert "transformer.wte.weight" in {names[id(p)] for p in matrices["params"]}  # embedding and tied head: AdamW
    assert len(model.param_groups(0.1)) == 2 and not any(g.get("muon") for g in model.param_groups(0.1))


def test_ns_precision_follows_the_device(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: False)
    assert ns_dtype_for(torch.device("cpu")) == torch.float32
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    assert ns_dtype_for(torch.device("cpu")) == torch.bfloat16


def test_config_mistakes_are_named():
    with pytest.raises(ConfigError, match="--optimizer: 'sgd' is not one of 'adamw', 'muon'"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="--optimizer muon: not with --fsdp"):
        TrainConfig(optimizer="muon", fsdp=True)
    with pytest.raises(ConfigError, match="--muon-lr: must be > 0"):
        TrainConfig(optimizer="muon", muon_lr=0)

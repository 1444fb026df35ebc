"""gpt/train/muon.py: the orthogonalisation, the update against torch.optim.Muon, AdamW groups against
torch.optim.AdamW, and which parameters each half of the optimizer gets; cautious weight decay, the weight
decay schedule and x0_skip's scalar groups (their LRs: gpt/train/trainer.py `set_hyperparameters`)."""

import pytest
import torch

from gpt import runtime
from gpt.errors import ConfigError
from gpt.model.transformer import GPT, GPTConfig
from gpt.train.config import TrainConfig
from gpt.train.flags import build_config
from gpt.train.muon import Muon, ns_dtype_for, orthogonalize
from gpt.train.step import make_optimizer, set_hyperparameters


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


def test_cautious_weight_decay_decays_only_where_the_update_and_the_weight_agree_in_sign():
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
    steps = {}
    for cautious in (False, True):
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        Muon([{"params": [p], "muon": True}], lr=0.1, weight_decay=0.5, cautious_wd=cautious).step()
        steps[cautious] = p.detach()
    update = orthogonalize(g.lerp(g * (1 - 0.95), 0.95))  # the first step's Nesterov update
    agree = update * w >= 0
    assert 0.2 < agree.float().mean() < 0.8
    moved = w - 0.1 * update  # the update alone, scale 1 (16 rows <= 32 columns)
    torch.testing.assert_close(steps[True], torch.where(agree, moved - 0.05 * w, moved))
    torch.testing.assert_close(steps[False], moved - 0.05 * w)


def test_x0_skips_scalars_have_groups_of_their_own_never_muons_and_never_decayed():
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, x0_skip=True, value_embeds=True))
    names = {id(p): n for n, p in model.named_parameters()}
    for muon in (False, True):
        groups = model.param_groups(0.1, muon=muon)
        scalar = [g for g in groups if g.get("scalar")]
        assert [(g["scalar"], [names[id(p)] for p in g["params"]], g["weight_decay"]) for g in scalar] == [
            ("resid", ["resid_lambdas"], 0.0),
            ("x0", ["x0_lambdas"], 0.0),
        ]
        decayed = {names[id(p)] for g in groups if g["weight_decay"] and not g.get("muon") for p in g["params"]}
        assert {"transformer.wte.weight", "value_embeds.1.weight", "transformer.h.1.attn.ve_gate"} <= decayed
        grouped = [names[id(p)] for g in groups for p in g["params"]]
        assert sorted(grouped) == sorted(names.values())  # each parameter in exactly one group


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_each_group_gets_its_lr_and_the_scheduled_weight_decay(optimizer):
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, x0_skip=True))
    cfg = TrainConfig(
        optimizer=optimizer,
        learning_rate=1e-3,
        muon_lr=0.02,
        scalar_lr=0.4,
        resid_lr=0.004,
        weight_decay=0.2,
        wd_schedule="linear",
        warmup_iters=0,
        lr_schedule="constant",
        max_iters=100,
    )
    opt = make_optimizer(model, cfg.optimizer_config(), torch.device("cpu"))
    for step, wd in ((0, 0.2), (50, 0.1), (100, 0.0), (0, 0.2)):  # back up: resuming at an earlier step
        assert set_hyperparameters(opt, step, cfg) == 1e-3
        for g in opt.param_groups:
            want = {"resid": 0.004, "x0": 0.4}.get(g.get("scalar"), 0.02 if g.get("muon") else 1e-3)
            assert g["lr"] == pytest.approx(want)
            biases_norms_or_scalars = all(p.dim() < 2 for p in g["params"])
            assert g["weight_decay"] == pytest.approx(0.0 if biases_norms_or_scalars else wd)


def test_the_new_flags_and_their_mistakes():
    cfg = build_config("--optimizer muon --muon-cautious-wd --wd-schedule cosine --scalar-lr 0.3".split())
    assert (cfg.muon_cautious_wd, cfg.wd_schedule, cfg.scalar_lr, cfg.resid_lr) == (True, "cosine", 0.3, 0.005)
    assert cfg.optimizer_config().cautious_wd
    with pytest.raises(ConfigError, match="--muon-cautious-wd: Muon's weight decay; give --optimizer muon"):
        build_config(["--muon-cautious-wd"])
    with pytest.raises(ConfigError, match="--wd-schedule: 'step' is not one of 'constant', 'linear', 'cosine'"):
        build_config(["--wd-schedule", "step"])
    with pytest.raises(ConfigError, match="--resid-lr: must be > 0"):
        build_config(["--resid-lr", "0"])

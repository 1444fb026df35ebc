"""The speedrun recipe's model options (issue 35): activation="relu2", qk_norm, zero_init_proj, logit_softcap,
untied_head, x0_skip, value_embeds (the Muon weight decay options: tests/test_muon.py). Each: what it computes, a KV-cached decode equal to the full forward, causality, the checkpoint
round trip, flags, resume exactness, LoRA, and the export paths' refusals."""

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import train_run

from gpt import GPT, GPTConfig
from gpt.checkpoints import loader, native
from gpt.data.tokenizer import CharTokenizer
from gpt.errors import ConfigError
from gpt.infer.sampling import Decoder
from gpt.model import lora
from gpt.model.compiled import AheadOfTimeStep
from gpt.model.quantize import quantize
from gpt.model.transformer import QK_NORM_SCALE
from gpt.train import parallel
from gpt.train.flags import build_config

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

OPTIONS = {
    "relu2": dict(activation="relu2"),
    "qk_norm": dict(qk_norm=True),
    "qk_norm_rope": dict(qk_norm=True, pos_encoding="rope"),
    "zero_init_proj": dict(zero_init_proj=True),
    "logit_softcap": dict(logit_softcap=2.0),
    "untied_head": dict(untied_head=True),
    "x0_skip": dict(x0_skip=True),
    "value_embeds": dict(value_embeds=True, n_layer=3),  # layers 0 and 2
    "value_embeds_rope": dict(value_embeds=True, pos_encoding="rope"),
    "all": dict(
        activation="relu2",
        qk_norm=True,
        zero_init_proj=True,
        logit_softcap=2.0,
        untied_head=True,
        x0_skip=True,
        value_embeds=True,
    ),
}


def model_with(seed=0, **options) -> GPT:
    """A small model with the options, its weights spread (std 0.5: zero-initialised projections too) so the
    options change the logits visibly."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False) | options
    model = GPT(GPTConfig(**shape))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
            elif name.endswith("lambdas"):  # x0_skip's scalars away from their (neutral) 1 and 0
                p.uniform_(0.5, 1.5)
    return model.eval()


def test_every_option_is_off_by_default():
    c = GPTConfig()
    assert (c.activation, c.qk_norm, c.zero_init_proj, c.logit_softcap, c.untied_head, c.x0_skip, c.value_embeds) == (
        "gelu_tanh",
        False,
        False,
        0.0,
        False,
        False,
        False,
    )
    old = {k: v for k, v in c.to_dict().items() if k not in ("x0_skip", "value_embeds")}  # an older checkpoint's
    assert GPTConfig.from_dict(old) == c


@pytest.mark.parametrize(
    "field, value",
    [
        ("activation", "relu3"),
        ("qk_norm", "yes"),
        ("zero_init_proj", 1),
        ("logit_softcap", -1.0),
        ("untied_head", 0),
        ("x0_skip", "on"),
        ("value_embeds", 1),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"{field}: must"):
        GPTConfig(**{field: value})


# the dynamic cache; the static one (CUDA-graph steps); the one-token step `compile_decoding` compiles, run eagerly
# (gpt/model/compiled.py's exported module, the caches gathered to their written slots)
@pytest.mark.parametrize("graph", [False, True, "step", "int8 step"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_shapes_and_a_cached_decode_equal_the_full_forward(name, graph):
    model = model_with(**OPTIONS[name])
    if graph == "int8 step":  # every option through int8 layers, decoded by the exported step
        quantize(model, "int8")
    if graph in ("step", "int8 step"):
        model.decode_step = AheadOfTimeStep(model, compiled=False)
    idx = torch.randint(0, 40, (2, 5))
    dec = Decoder(model, idx, graph=bool(graph))
    for _ in range(8):
        with torch.no_grad():
            full, _ = model(dec.tokens)
        assert full.shape == (2, dec.tokens.size(1), 40)
        torch.testing.assert_close(dec.logits, full[:, -1].float(), atol=1e-5, rtol=1e-5)
        dec.advance(dec.logits.argmax(-1, keepdim=True))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_causal(name):
    model = model_with(**OPTIONS[name])
    idx = torch.randint(0, 40, (1, 10))
    changed = idx.clone()
    changed[0, 6:] = (idx[0, 6:] + 1) % 40
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[0, :6], b[0, :6])
    assert not torch.allclose(a[0, 6:], b[0, 6:])


def test_relu2_is_relu_squared():
    model = model_with(activation="relu2")
    mlp = model.transformer.h[0].mlp
    x = torch.randn(3, 32)
    want = F.linear(F.relu(F.linear(x, mlp.c_fc.weight)) ** 2, mlp.c_proj.weight)
    torch.testing.assert_close(mlp(x), want)


def test_qk_norm_scores_are_of_unit_rms_queries_and_keys():
    model = model_with(qk_norm=True)
    attn = model.transformer.h[0].attn
    x = torch.randn(1, 6, 32)
    q, k, v = (t.view(1, 6, 4, 8).transpose(1, 2) for t in F.linear(x, attn.c_attn.weight).split(32, dim=2))
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(t.dtype).eps).sqrt()  # noqa: E731
    y = F.scaled_dot_product_attention(rms(q) * QK_NORM_SCALE, rms(k) * QK_NORM_SCALE, v, is_causal=True)
    torch.testing.assert_close(attn(x, causal=True), F.linear(y.transpose(1, 2).reshape(1, 6, 32), attn.c_proj.weight))
    assert not torch.allclose(attn(x, causal=True), model_with().transformer.h[0].attn(x, causal=True))


def test_zero_init_projections_start_at_zero_and_the_rest_as_before():
    torch.manual_seed(0)
    zero = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32, zero_init_proj=True))
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32))
    for (name, p), q in zip(zero.named_parameters(), plain.parameters()):
        if name.endswith("c_proj.weight"):
            assert not p.any() and q.any()
        else:
            assert torch.equal(p, q), name


def test_softcap_bounds_the_logits_and_is_tanh():
    capped, plain = model_with(logit_softcap=2.0), model_with()
    idx = torch.randint(0, 40, (2, 8))
    with torch.no_grad():
        a, b = capped(idx)[0], plain(idx)[0]
    assert a.abs().max() < 2.0 < b.abs().max()
    torch.testing.assert_close(a, 2.0 * torch.tanh(b / 2.0))


def test_untied_head_is_its_own_matrix():
    model = model_with(untied_head=True)
    assert model.lm_head.weight is not model.transformer.wte.weight
    tied = model_with()
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert tied.num_params() + 40 * 32 == model.num_params()
    model.grow_vocab(64, range(40, 42))  # a chat template's tokens: both matrices grow
    assert model.lm_head.weight.shape == model.transformer.wte.weight.shape == (64, 32)
    assert model.lm_head.weight is not model.transformer.wte.weight


def test_x0_skip_mixes_the_embedding_into_each_blocks_input():
    model = model_with(x0_skip=True, n_layer=3)
    idx = torch.randint(0, 40, (2, 6))
    inputs, outputs = [], []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        block.register_forward_hook(lambda m, args, out: outputs.append(out))
    with torch.no_grad():
        model(idx)
        x0 = model.embed(idx)
    r, a = model.resid_lambdas, model.x0_lambdas
    torch.testing.assert_close(inputs[0], (r[0] + a[0]) * x0)  # block 0's x is x0 itself
    for i in (1, 2):
        torch.testing.assert_close(inputs[i], r[i] * outputs[i - 1] + a[i] * x0)


def test_x0_skip_and_value_embeds_start_as_the_model_without_them():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=4, n_embd=32))
    torch.manual_seed(0)
    x0 = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=4, n_embd=32, x0_skip=True))
    assert x0.resid_lambdas.tolist() == [1.0] * 3 and x0.x0_lambdas.tolist() == [0.0] * 3
    ve = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=4, n_embd=32, value_embeds=True))
    assert sorted(ve.value_embeds) == ["0", "2"] and not hasattr(ve.transformer.h[1].attn, "ve_gate")
    assert not ve.transformer.h[0].attn.ve_gate.any()  # every gate 3 * sigmoid(0) = 1.5
    idx = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(x0(idx)[0], plain(idx)[0])
        ve.load_state_dict(plain.state_dict(), strict=False)
        for table in ve.value_embeds.values():
            table.weight.zero_()
        torch.testing.assert_close(ve(idx)[0], plain(idx)[0])  # zero value embeddings: the plain model
    assert ve.num_params() == plain.num_params() + 2 * 4 * 12  # the gates; value embeddings are lookups


def test_value_embeds_add_gated_token_embeddings_to_the_values():
    model = model_with(value_embeds=True)
    attn, table = model.transformer.h[1].attn, model.value_embeds["1"]
    x, idx = torch.randn(1, 6, 32), torch.randint(0, 40, (1, 6))
    ve = table(idx)
    q, k, v = (t.view(1, 6, 4, 8).transpose(1, 2) for t in F.linear(x, attn.c_attn.weight).split(32, dim=2))
    gate = 3 * torch.sigmoid(x[..., :12] @ attn.ve_gate.T)  # (1, 6, 4): per token and head
    v = v + gate.transpose(1, 2)[..., None] * ve.view(1, 6, 4, 8).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, causal=True, ve=ve), F.linear(y, attn.c_proj.weight))
        assert not torch.allclose(attn(x, causal=True, ve=ve), attn(x, causal=True))


def test_value_embeds_grow_with_the_vocabulary():
    model = model_with(value_embeds=True)
    before = model.value_embeds["1"].weight.clone()
    model.grow_vocab(64, range(40, 42))
    assert model.value_embeds["1"].weight.shape == (64, 32)
    assert torch.equal(model.value_embeds["1"].weight[:40], before)
    with torch.no_grad():
        assert model(torch.tensor([[41, 63, 3]]))[0].shape == (1, 3, 64)  # new ids look up rows of their own


@pytest.mark.parametrize("how", ["activation_checkpointing", "fsdp"])
def test_x0_skip_and_value_embeds_train_the_same_checkpointed_and_sharded(how, tmp_path):
    """The scalars and value embeddings sit at the root, beside the blocks that activation checkpointing wraps
    and FSDP shards one at a time: the loss and every gradient are those of the plain module (FSDP: one
    process in this one, gloo; tests/test_parallel.py runs torchrun)."""
    model = model_with(x0_skip=True, value_embeds=True, n_layer=3).train()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 40, (2, 12))
    _, want = reference(idx, idx)
    want.backward()
    if how == "fsdp":
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        if how == "fsdp":
            parallel.shard(model, torch.float32)
        else:
            parallel.checkpoint_activations(model)
        _, loss = model(idx, idx)
        loss.backward()
        torch.testing.assert_close(loss, want)
        grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if how == "fsdp" else p.grad
            torch.testing.assert_close(grad, grads[name].grad, atol=1e-6, rtol=1e-5, msg=name)
    finally:
        if how == "fsdp":
            torch.distributed.destroy_process_group()


def test_checkpoint_round_trip(tmp_path):
    model, _, run = save_run(tmp_path, **OPTIONS["all"])
    back, _ = loader.load_model(run)
    assert back.config == model.config
    idx = torch.randint(0, 40, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(idx)[0], model(idx)[0])
    assert back.lm_head.weight is not back.transformer.wte.weight


def test_flags_set_the_options():
    m = build_config(
        ["--activation", "relu2", "--qk-norm", "--zero-init-proj", "--logit-softcap", "15", "--untied-head"]
        + ["--x0-skip", "--value-embeds"]
    ).model
    assert (m.activation, m.qk_norm, m.zero_init_proj, m.logit_softcap, m.untied_head, m.x0_skip, m.value_embeds) == (
        "relu2",
        True,
        True,
        15.0,
        True,
        True,
        True,
    )
    with pytest.raises(ConfigError, match="--logit-softcap: must be a number >= 0"):
        build_config(["--logit-softcap", "-3"])


@pytest.mark.parametrize("targets", [lora.LORA_DEFAULT_TARGETS, [*lora.LORA_DEFAULT_TARGETS, "wte"]])
def test_lora_adapts_an_optioned_model_and_merges_to_the_same_logits(targets):
    model = model_with(**OPTIONS["all"])
    idx = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        before = model(idx)[0]
    lora.apply(model, lora.LoRAConfig(rank=2, targets=list(targets)))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], before)  # B starts at zero: the base model
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.5)  # as if trained
        adapted = model(idx)[0]
    assert not torch.allclose(adapted, before)
    if "wte" in targets:  # untied: the embedding's adapters are its own, not the head's
        assert model.transformer.wte.lora_B is not model.lm_head.lora_B
        assert model.transformer.wte.lora_B.shape == model.lm_head.lora_B.shape == (40, 2)
    lora.merge(model)
    assert not lora.is_adapted(model) and type(model.transformer.wte) is torch.nn.Embedding
    assert model.lm_head.weight is not model.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], adapted, atol=1e-5, rtol=1e-5)


def test_a_lora_run_from_an_untied_base_adapting_wte_trains_saves_and_loads(tiny_char_data, tmp_path):
    from conftest import BASE_CFG, TRAIN

    from gpt.data.tokens import open_dataset

    cfg = dataclasses.replace(
        BASE_CFG,
        untied_head=True,
        activation="relu2",
        qk_norm=True,
        logit_softcap=15.0,
        x0_skip=True,
        value_embeds=True,
    )
    meta = native.build_meta(model_config=cfg.to_dict(), tokenizer=open_dataset(tiny_char_data).tokenizer_spec)
    native.save(tmp_path / "base" / "best.pt", {"model": GPT(cfg).state_dict()}, meta)
    out = tmp_path / "lora"
    train_run(
        *("--data", tiny_char_data, "--out-dir", out, "--init-from", tmp_path / "base", "--lora-rank", "2"),
        *("--lora-targets", "attn.c_attn,wte", *TRAIN, "--max-iters", "3", "--eval-interval", "3"),
    )
    saved = loader.read(out / "last.pt")["model"]
    assert {"transformer.wte.lora_A", "transformer.wte.lora_B", "lm_head.lora_A", "lm_head.lora_B"} <= set(saved)
    assert not torch.equal(saved["transformer.wte.lora_B"], saved["lm_head.lora_B"])  # two updates, both trained
    adapted, _ = loader.load_adapted(out)
    merged, _ = loader.load_model(out)
    assert merged.config == cfg and merged.lm_head.weight is not merged.transformer.wte.weight
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(x)[0], adapted(x)[0], rtol=1e-5, atol=1e-5)


def resumed_exactly(char_data, tmp_path, options: str):
    """Train 8 steps in one go and 4 + resume + 4 with `options`; assert the losses are the same, step by step;
    return the resumed run's model."""
    common = [
        "--data",
        char_data,
        *"--n-layer 2 --n-head 2 --n-embd 32 --block-size 32 --batch-size 4 --eval-iters 2".split(),
        *"--log-interval 1 --warmup-iters 2 --device cpu --lr-decay-iters 8 --eval-interval 4".split(),
        *options.split(),
    ]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "8")
    train_run(*common, "--out-dir", tmp_path / "split", "--max-iters", "4")
    train_run("--resume", tmp_path / "split", "--max-iters", "8")
    full, split = (
        [(r["step"], r["loss"]) for r in records(tmp_path / run) if r["kind"] == "train"] for run in ("full", "split")
    )
    assert [s for s, _ in split] == list(range(1, 9)) and split == full
    assert math.isfinite(full[-1][1])
    return loader.load_model(tmp_path / "split")[0]


@pytest.mark.precision
def test_exact_resume_with_every_option_on(char_data, tmp_path):
    model = resumed_exactly(
        char_data, tmp_path, "--activation relu2 --qk-norm --zero-init-proj --logit-softcap 15 --untied-head"
    )
    assert (model.config.activation, model.config.qk_norm, model.config.logit_softcap) == ("relu2", True, 15.0)
    assert model.config.untied_head and model.lm_head.weight is not model.transformer.wte.weight


@pytest.mark.precision
def test_exact_resume_with_x0_skip_value_embeds_and_muons_weight_decay_options(char_data, tmp_path):
    options = "--x0-skip --value-embeds --optimizer muon --muon-cautious-wd --wd-schedule cosine"
    model = resumed_exactly(char_data, tmp_path, options)
    assert model.config.x0_skip and model.config.value_embeds
    assert model.x0_lambdas.abs().min() > 0  # trained away from 0, at --scalar-lr
    saved = json.loads((tmp_path / "split" / "config.json").read_text())["train"]
    assert (saved["muon_cautious_wd"], saved["wd_schedule"]) == (True, "cosine")


def records(out_dir):
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


# ---- export: what each target can express, the rest refused in one line naming the option ---------------


def save_run_model(**options) -> tuple:
    """`model_with(**options)`, a char tokenizer of its 40 ids, and the model's checkpoint meta."""
    model = model_with(**options)
    tok = CharTokenizer("".join(chr(97 + i) for i in range(26)) + " .,:;!?\n'-ABC")
    return model, tok, native.build_meta(model.config.to_dict(), tok.spec)


def save_run(tmp_path, name="run", **options) -> tuple:
    """A checkpoint (best.pt in tmp_path/name) of `save_run_model(**options)`: (model, tokenizer, run dir)."""
    model, tok, meta = save_run_model(**options)
    path = tmp_path / name / "best.pt"
    native.save(path, {"model": model.state_dict()}, meta)
    return model, tok, path.parent


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])  # GPT-2 (both), GPT-NeoX
def test_hugging_face_export_carries_relu2_and_an_untied_head(tmp_path, pos):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from gpt.checkpoints.hf import export_hf

    model, tok, _ = save_run(tmp_path, activation="relu2", untied_head=True, zero_init_proj=True, pos_encoding=pos)
    out = export_hf(model, tok, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=2e-5, rtol=1e-5)
    again, _, _ = loader.load_checkpoint(out)  # import: the same model
    assert again.config == model.config and again.lm_head.weight is not again.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(again(idx)[0], model(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(qk_norm=True), "qk_norm (GPT-2 and GPT-NeoX have no norm on queries and keys"),
        (dict(logit_softcap=15.0), "logit_softcap=15 (GPT-2 and GPT-NeoX have no cap on the logits"),
        (dict(x0_skip=True), "x0_skip (GPT-2 and GPT-NeoX do not mix the embedding into each block's input"),
        (dict(value_embeds=True), "value_embeds (GPT-2 and GPT-NeoX have no embeddings added to the attention"),
    ],
)
def test_hugging_face_export_refuses_in_one_line(tmp_path, capsys, option, message):
    from gpt.cli.hf import main as hf_main

    _, _, run = save_run(tmp_path, **option)
    assert hf_main(["export", "--ckpt", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot export to Hugging Face: " + message) and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(activation="relu2"), "activation='relu2' (their MLP is GELU)"),
        (dict(qk_norm=True), "qk_norm (no norm on queries and keys)"),
        (dict(logit_softcap=15.0), "logit_softcap=15 (no cap on the logits)"),
        (dict(x0_skip=True), "x0_skip (no embedding mixed into each block's input)"),
        (dict(value_embeds=True), "value_embeds (no embeddings added to the attention values)"),
    ],
)
def test_gguf_export_refuses_in_one_line(tmp_path, capsys, option, message):
    pytest.importorskip("gguf")
    from gpt.cli.export import main as export_main

    _, _, run = save_run(tmp_path, **option)
    code = export_main(["--ckpt", str(run), "--format", "gguf", "--out", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"error: llama.cpp's gpt2 and gptneox graphs cannot compute {message}: "
        "export it with `gpt export --format onnx` instead\n"
    )
    assert not (tmp_path / "x.gguf").exists()


def test_gguf_export_of_an_untied_head_computes_our_logits_in_llama_cpp(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from gpt.cli.export import main as export_main
    from gpt.infer import llamacpp

    model, tok, run = save_run(tmp_path, untied_head=True)
    out = tmp_path / "m.gguf"
    assert export_main(["--ckpt", str(run), "--format", "gguf", "--out", str(out), "--no-check"]) == 0
    ids = torch.randint(0, 40, (12,)).tolist()
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0].numpy()
    theirs = llamacpp.logits(llamacpp.open_gguf(out, n_ctx=16), ids)
    assert abs(theirs - ours).max() < 1.5e-2


def test_onnx_and_pt2_exports_take_every_option(tmp_path, capsys):
    from gpt.cli.export import main as export_main

    model, _, run = save_run(tmp_path, **OPTIONS["all"])
    assert export_main(["--ckpt", str(run), "--format", "pt2", "--out", str(tmp_path / "pt2")]) == 0
    program = torch.export.load(str(tmp_path / "pt2" / "model.pt2")).module()
    idx = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(program(idx), model(idx)[0], atol=1e-5, rtol=1e-5)
    ort = pytest.importorskip("onnxruntime")
    assert export_main(["--ckpt", str(run), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"idx": idx.numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(idx)[0], atol=1e-4, rtol=0)


@torch.no_grad()
def test_the_servers_batch_engine_computes_the_full_forwards_logits_with_every_option():
    from gpt.infer.batching import BatchEngine, Request
    from gpt.infer.sampling import SampleConfig

    model, tok, _ = save_run_model(**OPTIONS["all"])
    prompt = tok.encode("the cat")
    got = []
    engine = BatchEngine(model, tok, max_rows=2)
    seen, forward = [], engine._forward  # the engine's logits at each step (the head's: capped)
    engine._forward = lambda *args: seen.append(forward(*args)) or seen[-1]
    engine.submit(Request(prompt, SampleConfig(max_new_tokens=8, temperature=0, stop_at_eot=False), got.append))
    while engine.busy:
        engine.step()
    ids = torch.tensor([prompt])
    for _ in range(8):  # 7 + 8 tokens: within block_size
        ids = torch.cat([ids, model(ids)[0][:, -1, : tok.vocab_size].argmax(-1, keepdim=True)], 1)
    assert [i for piece in got for i in piece.ids] == ids[0, len(prompt) :].tolist()
    assert len(seen) == 8
    for k, logits in enumerate(seen):
        logits = logits[0] if isinstance(logits, tuple) else logits  # (logits, hidden) where prompts are scored
        torch.testing.assert_close(logits[0], model(ids[:, : len(prompt) + k])[0][0, -1], atol=1e-5, rtol=1e-5)

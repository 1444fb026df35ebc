"""Quantisation-aware training (gpt/model/qat.py): the forward multiplies by the grid inference uses, bit for bit;
the gradient passes straight through; runs record the scheme, resume exactly, work with LoRA and FSDP; the
mismatches warn and the impossible combinations are one line each."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, torchrun, train_run
from test_parallel import losses

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.errors import ConfigError
from gpt.model import grids, qat
from gpt.model.quantize import quantize
from gpt.train.flags import build_config

pytestmark = pytest.mark.usefixtures("one_thread")
WIDE = [*TINY, "--n-embd", "64", "--dtype", "float32", "--no-plot", "--eval-interval", "3", "--lr-decay-iters", "12"]


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**(dict(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=64) | kw)))


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int4", 128), ("q4_0", 32), ("int8", 32)])
def test_each_layer_multiplies_by_the_inference_grid(scheme, group):
    model = tiny(n_embd=128)
    names = qat.apply(model, scheme, group)
    x = torch.randn(3, 128)
    for name in ("transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"):
        m = model.get_submodule(name)
        w = grids.dequantized(m.weight, scheme, group)
        xq = qat.rows_on_grid(x) if scheme == "int8" else x
        assert name in names and torch.equal(m(x), F.linear(xq, w, m.bias))
    assert ("transformer.wte" in names) == (scheme == "q4_0")  # the GGUF's token_embd, tied to the head


def test_int8_qat_computes_what_the_int8_model_computes():
    model = tiny()
    int8 = quantize(copy.deepcopy(model).eval(), "int8")
    qat.apply(model.eval(), "int8")
    idx = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], int8(idx)[0], rtol=1e-5, atol=1e-5)  # integer vs float sums


def test_the_gradient_passes_the_rounding_straight_through():
    """d loss / d W under QAT is the float model's gradient at the grid's weights (the rounding's derivative
    taken as one)."""
    model, idx = tiny(untied_head=True), torch.randint(0, 40, (2, 16))  # (tied: int4 keeps the lookups float)
    reference = copy.deepcopy(model)
    qat.apply(model, "int4", 32)
    with torch.no_grad():
        for name in qat.layers(reference, "int4", 32):
            layer = reference.get_submodule(name)
            layer.weight.copy_(grids.dequantized(layer.weight, "int4", 32))
    model(idx, idx)[1].backward()
    reference(idx, idx)[1].backward()
    w = "transformer.h.0.mlp.c_fc.weight"
    grads = dict(model.named_parameters())[w].grad, dict(reference.named_parameters())[w].grad
    torch.testing.assert_close(*grads, rtol=1e-5, atol=1e-7)


def test_the_refusals_are_one_line_each():
    for argv, message in [
        (["--qat", "int2"], "--qat: 'int2' is not one of int8, int4, q4_0"),
        (["--qat", "int4", "--qat-group-size", "48"], "--qat-group-size: use one of 32, 64, 128, got 48"),
        (["--qat", "int8", "--qat-group-size", "64"], "--qat-group-size: the group of --qat int4; give --qat int4"),
        (["--qat", "int4", "--tp", "2"], "--qat: not with --tp in this version"),
    ]:
        with pytest.raises(ConfigError) as e:
            build_config(argv)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^--qat q4_0: not with sinusoidal positions"):
        qat.start(tiny(pos_encoding="sinusoidal"), "q4_0")


def test_a_mismatched_grid_warns_naming_both():
    trained = qat.meta("int4", 32)
    assert qat.mismatch(trained, "int4", 32) is None and qat.mismatch(trained, "none") is None
    assert qat.mismatch(trained, "f16", flag="--quant") is None
    assert qat.mismatch(trained, "int4", 64) == (
        "this checkpoint was trained for int4 (groups of 32) (--qat); --quantize int4 (groups of 64) quantises it "
        "on another grid, which QAT did not train for"
    )
    assert "--quant q4_k_m quantises" in qat.mismatch(qat.meta("q4_0"), "q4_k_m", flag="--quant")


def test_a_qat_run_records_its_scheme_resumes_exactly_and_samples_warned(char_data, tmp_path, capsys):
    common = [*WIDE, "--data", char_data, "--qat", "int4"]
    train_run(*common, "--max-iters", "6", "--out-dir", tmp_path / "whole")
    train_run(*common, "--max-iters", "3", "--out-dir", tmp_path / "part")
    train_run("--resume", tmp_path / "part", "--max-iters", "6")
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
    _, _, meta = load_checkpoint(tmp_path / "part")
    assert meta["qat"] == {"scheme": "int4", "group_size": 32}

    from gpt.cli import sample

    capsys.readouterr()
    argv = ["--ckpt", str(tmp_path / "part"), "--max-new-tokens", "4", "--prompt", "a", "--seed", "0"]
    assert sample.main([*argv, "--quantize", "int4"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert sample.main([*argv, "--quantize", "int8"]) == 0
    assert capsys.readouterr().err.startswith("warning: this checkpoint was trained for int4 (groups of 32) (--qat)")


def test_lora_qat_trains_the_merged_weights_grid(char_data, tmp_path):
    """With LoRA each adapted layer multiplies by the grid of W + scale B A: the run's checkpoint, merged and
    quantised to int4, computes what the merged weights on the QAT grid do."""
    train_run(*WIDE, "--data", char_data, "--max-iters", "3", "--out-dir", tmp_path / "base")
    train_run(
        *["--init-from", tmp_path / "base", "--data", char_data, "--max-iters", "3", "--out-dir", tmp_path / "lora"],
        *["--lora-rank", "4", "--qat", "int4", "--learning-rate", "1e-2", "--eval-interval", "3", "--no-plot"],
    )
    from gpt.checkpoints.loader import load_adapted

    merged, _, meta = load_checkpoint(tmp_path / "lora")
    assert meta["qat"]["scheme"] == "int4"
    adapters, _ = load_adapted(tmp_path / "lora")  # unmerged: frozen base + trained B A
    assert hasattr(adapters.get_submodule("transformer.h.0.attn.c_attn"), "lora_A")
    assert float(adapters.get_submodule("transformer.h.0.attn.c_attn").lora_B.abs().max()) > 0  # trained
    names = qat.apply(adapters, "int4", 32)
    assert "transformer.h.0.attn.c_attn" in names
    qat.apply(merged, "int4", 32)
    idx = torch.randint(0, 60, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(adapters.eval()(idx)[0], merged.eval()(idx)[0], rtol=1e-4, atol=1e-4)


def test_fsdp_qat_matches_one_process(char_data, tmp_path):
    common = [*WIDE, "--data", char_data, "--qat", "int4", "--max-iters", "3", "--grad-accum", "2", "--threads", "1"]
    torchrun(2, *common, "--out-dir", tmp_path / "fsdp", "--fsdp")
    train_run(*common, "--out-dir", tmp_path / "one")
    assert [x for _, x in losses(tmp_path / "fsdp")] == pytest.approx(
        [x for _, x in losses(tmp_path / "one")], rel=1e-5
    )

"""int4 inference (gpt/model/quantize.py's Int4Linear, gpt/model/grids.py's int4 grid): the layer multiplies by
its grid exactly, the trained model stays close, what the group does not divide stays float, the flags."""

import copy
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from test_quantize import val_loss

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.infer.sampling import complete
from gpt.model import grids
from gpt.model.quantize import Int4Linear, QuantizeError, quantize, summary

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("group", grids.GROUP_SIZES)
def test_an_int4_layer_multiplies_by_its_grid_exactly(group):
    """The kernel's weights are the grid's floats: the output is bf16(x) times the grid, rounded to bf16 as the
    kernel returns it, plus the bias, bit for bit (100 outputs: padded to 112 rows for the kernel)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 100)
    layer = Int4Linear(linear, group)
    x = torch.randn(3, 5, 256)
    grid = grids.dequantized(linear.weight, "int4", group)
    expected = (x.bfloat16().float() @ grid.t()).bfloat16().float() + linear.bias
    assert torch.equal(layer(x), expected.detach())
    q, scale = grids.int4(linear.weight, group)
    assert q.min() >= 0 and q.max() <= 15 and torch.equal(scale, scale.bfloat16().float())
    # within a step: half of one but at +8 steps, which the grid's 7 caps (the largest magnitude is exact at -8)
    step = scale.abs().repeat_interleave(group, dim=1)
    assert ((grid - linear.weight).abs() <= step * 1.05).all()


def test_int4_keeps_the_trained_model_close_and_generates(trained_run, shakespeare_text):
    model, tok, _ = load_checkpoint(trained_run)
    reference, _, _ = load_checkpoint(trained_run)
    quantize(model, "int4", 32)
    assert all(not isinstance(m, nn.Linear) for m in model.modules())  # every layer: the width 2^k divides
    assert isinstance(model.transformer.wte, nn.Embedding) and model.transformer.wte.weight.dtype == torch.float32
    held_out = torch.tensor(tok.encode(shakespeare_text[-20_000:]))
    fp32, int4 = val_loss(reference, held_out, 64), val_loss(model, held_out, 64)
    assert abs(int4 - fp32) / fp32 < 0.01, (fp32, int4)  # (measured: 2.5716 against 2.5737)
    assert int4 != fp32
    assert len(complete(model, tok, "ROMEO:", max_new_tokens=30, temperature=0)[0]) == 30


def test_layers_the_group_does_not_divide_stay_float_and_the_summary_says_so():
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=48))  # 48: not in groups of 32
    quantize(model, "int4", 32)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if "Linear" in type(m).__name__}
    assert kinds["transformer.h.0.mlp.c_proj"] == "Int4Linear"  # 4 x 48 = 192 inputs: 6 groups
    assert kinds["transformer.h.0.attn.c_attn"] == kinds["lm_head"] == "Linear"
    assert summary(model, "int4", 32) == "int4 Linear layers (groups of 32; 4 left in float32)"


def test_mistakes(trained_run):
    model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=32))
    with pytest.raises(QuantizeError, match="^--group-size 48: use one of 32, 64, 128$"):
        quantize(copy.deepcopy(model), "int4", 48)
    with pytest.raises(QuantizeError, match="^--quantize int4 starts from float32 weights, not bfloat16"):
        quantize(model.to(torch.bfloat16), "int4")
    res = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(trained_run), "--quantize", "int4", "--group-size", "48"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and res.stderr.startswith("error: argument --group-size: invalid choice: 48")
    assert res.stderr.count("\n") == 1


def test_sample_flag(trained_run, capsys):
    main = runpy.run_path(str(ROOT / "sample.py"), run_name="sample_script")["main"]
    model, tok, _ = load_checkpoint(trained_run)
    expected = complete(quantize(model, "int4", 64), tok, "ROMEO:", max_new_tokens=30, temperature=0)[0]
    argv = ["--ckpt", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "30", "--temperature", "0"]
    assert main([*argv, "--quantize", "int4", "--group-size", "64"]) == 0
    out, err = capsys.readouterr()
    assert out == "ROMEO:" + expected + "\n" and "cpu, float32 (int4 Linear layers (groups of 64))" in err

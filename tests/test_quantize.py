"""int8 inference (gpt/model/quantize.py): which layers change, how close the model stays, where it runs."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.infer.batching import BatchEngine, Request
from gpt.infer.sampling import SampleConfig, complete
from gpt.model.quantize import WEIGHT_LEVELS, Int8Linear, QuantizeError, dtype_flag, linear_names, quantize

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def val_loss(model, ids: torch.Tensor, block: int) -> float:
    """Mean next-token loss over consecutive windows of `ids`."""
    n = (len(ids) - 1) // block
    x = ids[: n * block].view(n, block)
    y = ids[1 : n * block + 1].view(n, block)
    with torch.no_grad():
        return model(x, y)[1].item()


def test_int8_changes_every_linear_layer_and_keeps_the_trained_model_within_one_percent(trained_run, shakespeare_text):
    model, tok, _ = load_checkpoint(trained_run)
    reference, _, _ = load_checkpoint(trained_run)
    names = linear_names(model)
    assert len(names) == 2 * 4 + 1  # per block c_attn, attn.c_proj, c_fc, mlp.c_proj; and lm_head
    quantize(model, "int8")
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n], Int8Linear) for n in names)
    assert all(modules[n].weight_int8.dtype == torch.int8 and not list(modules[n].parameters()) for n in names)
    assert isinstance(model.transformer.wte, nn.Embedding) and model.transformer.wte.weight.dtype == torch.float32
    held_out = torch.tensor(tok.encode(shakespeare_text[-20_000:]))
    fp32, int8 = val_loss(reference, held_out, 64), val_loss(model, held_out, 64)
    assert abs(int8 - fp32) / fp32 < 0.01, (fp32, int8)
    assert int8 != fp32  # the weights did change


def exact_product_error() -> float:
    """The largest difference between an Int8Linear's output and the exact product of its quantised rows and
    channels, relative to the output's scale (also run in a subprocess with oneDNN capped at AVX2)."""
    torch.manual_seed(0)
    linear = nn.Linear(40, 24)
    layer = Int8Linear(linear)
    x = torch.randn(2, 3, 40) * torch.tensor([1.0, 100.0, 1e-3]).view(1, 3, 1)  # rows of very different scales
    x[1, 2] = 0  # an all-zero row
    y = layer(x)
    w_scale = linear.weight.abs().amax(1) / WEIGHT_LEVELS
    w_q = torch.round(linear.weight / w_scale[:, None])
    rows = x.reshape(-1, 40)
    x_scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
    x_q = torch.round(rows / x_scale)
    assert x_q.abs().max() == 127 and w_q.abs().max() == WEIGHT_LEVELS
    expected = (x_q.double() @ w_q.double().t()) * x_scale.double() * w_scale.double() + linear.bias.double()
    assert torch.equal(y[1, 2], linear.bias.detach())  # zeros in, the bias out: no NaN
    error = (y.reshape(-1, 24).double() - expected).abs() / expected.abs().amax(1, keepdim=True)
    return error.max().item()


def test_an_int8_layer_is_the_exact_integer_product_of_its_quantised_rows_and_channels():
    assert exact_product_error() < 1e-6
    torch.manual_seed(0)
    linear, x = nn.Linear(40, 24), torch.randn(5, 40)
    assert ((Int8Linear(linear)(x) - linear(x)).abs() / linear(x).abs().amax(-1, keepdim=True)).max() < 0.03


def test_the_product_is_exact_on_a_cpu_without_vnni():
    """oneDNN's int8 kernel without VNNI saturates int16 pair sums: weights of up to 64 in magnitude keep it
    exact (with 127 this test failed)."""
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_quantize as t; print(t.exact_product_error())"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    assert float(out.stdout.split()[-1]) < 1e-6


def test_a_row_decodes_the_same_alone_or_in_a_batch(trained_run):
    model, _, _ = load_checkpoint(trained_run)
    quantize(model, "int8")
    torch.manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (4, 20))
    batch[1] *= 0  # rows of different activation ranges: each has its own scale
    with torch.no_grad():
        together = model(batch)[0]
        for i in range(4):
            assert torch.equal(model(batch[i : i + 1])[0], together[i : i + 1])


def test_int8_models_generate_and_batch(trained_run):
    model, tok, _ = load_checkpoint(trained_run)
    quantize(model, "int8")
    text = complete(model, tok, "ROMEO:", max_new_tokens=30, temperature=0)[0]
    assert len(text) == 30
    engine = BatchEngine(model, tok, max_rows=4)  # per-row positions, views of the cache pool
    out = []
    engine.submit(
        Request(tok.encode("ROMEO:"), SampleConfig(max_new_tokens=30, temperature=0), lambda p: out.append(p.text))
    )
    while engine.busy:
        engine.step()
    assert "".join(out) == text


def test_seq2seq_models_keep_cross_attention_in_float():
    from gpt.infer.translate import translate

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32, n_encoder_layer=2)).eval()
    src = torch.randint(0, 39, (2, 7))
    mask = torch.ones_like(src, dtype=torch.bool)
    tgt = torch.randint(0, 39, (2, 5))
    ref = model(tgt, src=src, src_mask=mask)[0]
    quantize(model, "int8")
    assert isinstance(model.transformer.h[0].cross_attn.c_attn, nn.Linear)  # slices its weight: kept
    assert not isinstance(model.transformer.h[0].attn.c_attn, nn.Linear)
    assert not isinstance(model.encoder.h[0].mlp.c_fc, nn.Linear)
    out = model(tgt, src=src, src_mask=mask)[0]
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()

    class Tok:
        vocab_size, eot_token = 40, 39

        def encode_batch(self, texts):
            return [[ord(c) % 39 for c in t] for t in texts]

        def decode(self, ids):
            return ",".join(map(str, ids))

    assert len(translate(model, Tok(), ["abc", "de"], 39, 39, max_new_tokens=5)) == 2


def test_mistakes():
    model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(QuantizeError, match="--quantize 'int4' is not one of none, int8"):
        quantize(model, "int4")
    assert quantize(model, "none") is model and isinstance(model.lm_head, nn.Linear)
    with pytest.raises(QuantizeError, match="starts from float32 weights, not bfloat16: use --dtype float32"):
        quantize(model.to(torch.bfloat16), "int8")


def test_sample_script_quantize_flag(trained_run, capsys):
    main = runpy.run_path(str(ROOT / "sample.py"), run_name="sample_script")["main"]
    model, tok, _ = load_checkpoint(trained_run)
    expected = complete(quantize(model, "int8"), tok, "ROMEO:", max_new_tokens=30, temperature=0)[0]
    assert (
        main(
            [
                "--ckpt",
                str(trained_run),
                "--prompt",
                "ROMEO:",
                "--max-new-tokens",
                "30",
                "--temperature",
                "0",
                "--quantize",
                "int8",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out == "ROMEO:" + expected + "\n" and "cpu, float32 (int8 Linear layers)" in err
    assert main(["--ckpt", str(trained_run), "--quantize", "int8", "--dtype", "bfloat16"]) == 2
    assert (
        capsys.readouterr().err == "error: --quantize int8 starts from float32 weights, not bfloat16: use "
        "--dtype float32\n"
    )


def test_evaluate_quantize_flag(tmp_path, capsys, monkeypatch):
    pytest.importorskip("sacrebleu")
    pytest.importorskip("rouge_score")  # (gpt evaluate scores BLEU and ROUGE by default)
    from gpt.checkpoints import loader, native
    from gpt.cli.evaluate import main
    from gpt.data.tokenizer import CharTokenizer
    from gpt.infer.translate import translate

    tok = CharTokenizer("abcdefgh ")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16, n_encoder_layer=1))
    eos = tok.eot_token
    meta = {
        "model_config": model.config.to_dict(),
        "tokenizer": tok.spec,
        "seq2seq": {"bos": eos, "eos": eos, "pad": eos},
    }
    native.save(tmp_path / "run" / "best.pt", {"model": model.state_dict()}, meta)
    sources = ["abc def", "gh a", "bad cafe"]
    (tmp_path / "src").write_text("\n".join(sources) + "\n")
    (tmp_path / "ref").write_text("\n".join(sources) + "\n")
    modes = []
    monkeypatch.setattr(loader, "quantize_model", lambda m, mode: (modes.append(mode), quantize(m, mode))[1])
    assert (
        main(
            [
                "--ckpt",
                str(tmp_path / "run"),
                "--source-file",
                str(tmp_path / "src"),
                "--reference",
                str(tmp_path / "ref"),
                "--device",
                "cpu",
                "--quantize",
                "int8",
                "--output",
                str(tmp_path / "hyp"),
            ]
        )
        == 0
    )
    assert modes == ["int8"] and capsys.readouterr().out.startswith("BLEU ")
    expected = translate(quantize(model.eval(), "int8"), tok, sources, eos, eos)
    assert (tmp_path / "hyp").read_text().splitlines() == [" ".join(t.splitlines()) for t in expected]


def test_int8_runs_from_float32_whatever_auto_would_pick():
    assert dtype_flag("auto", "int8") == "float32"  # also where auto means bf16 (a CPU with native bf16)
    assert dtype_flag("float32", "int8") == "float32"
    assert dtype_flag("auto", "none") == "auto" and dtype_flag("bfloat16", "none") == "bfloat16"
    with pytest.raises(QuantizeError, match="^--quantize int8 starts from float32 weights, not bfloat16"):
        dtype_flag("bfloat16", "int8")

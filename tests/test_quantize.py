"""int8 inference (gpt/model/quantize.py): which layers change, how close the model stays, where it runs."""

import copy
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.data.pairs import PairBatches
from gpt.infer.batching import BatchEngine, Request
from gpt.infer.sampling import SampleConfig, complete
from gpt.model.grids import INT8_LEVELS as WEIGHT_LEVELS
from gpt.model.quantize import TINY, Int8Linear, QuantizeError, dtype_flag, linear_names, quantize

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
    x_scale = rows.abs().amax(1, keepdim=True).clamp_min(TINY) / 127
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


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory):
    """A char dataset of Multi30k de -> en (300 training pairs, 8 validation pairs), prepared as
    `data/multi30k/prepare.py --tokenizer char` prepares it."""
    from conftest import MULTI30K

    from gpt.data.pairs import open_pairs, prepare_pairs

    d = tmp_path_factory.mktemp("multi30k")
    for split, n in (("train", 300), ("val", 8)):
        for lang in ("de", "en"):
            lines = (MULTI30K / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[:n]
            (d / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare_pairs(d / "train.de", d / "train.en", d / "ds", tokenizer="char", val_pairs=[d / "val.de", d / "val.en"])
    return open_pairs(d / "ds"), (d / "val.de").read_text(encoding="utf-8").splitlines()


class Rounded(nn.Module):
    """What int8 changes in a Linear layer, in float32 (the module notes of gpt/model/quantize.py): each weight
    rounded to 64 levels of its output channel's largest magnitude, each input row to 127 levels of its own.
    The product of these integers is exact in float32 too (|sums| <= 127 * 64 * 128 < 2^24), so the result is
    the int8 layer's bit for bit."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        scale = linear.weight.detach().abs().amax(dim=1).clamp_min(TINY) / WEIGHT_LEVELS
        self.weight = torch.round(linear.weight.detach() / scale[:, None])
        self.scale, self.bias = scale / 127, linear.bias

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        largest = rows.abs().amax(dim=1, keepdim=True).clamp_min(TINY)
        product = torch.round(rows * (127 / largest)) @ self.weight.t()
        scale = largest * self.scale
        y = product * scale if self.bias is None else torch.addcmul(self.bias, product, scale)
        return y.view(*x.shape[:-1], -1)


def test_int8_seq2seq_is_the_float_model_with_int8_roundings_and_float_cross_attention(multi30k):
    """On real sentences with a prepared tokenizer, the int8 encoder-decoder's logits and greedy translations
    equal those of the float model whose Linear layers, all but cross-attention's, round as int8 does
    (`Rounded`): no tolerance. Cross-attention stays float32 (it slices its c_attn weight), and a cross-attention
    dropped, quantised or fed another source's memory moves the logits by tenths (the last assert shows how
    much another source does)."""
    from gpt.infer.translate import translate

    ds, sources = multi30k
    tok = ds.tokenizer()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=2, n_head=2, n_embd=32, n_encoder_layer=2)
    model = GPT(config).eval()
    with torch.no_grad():  # large random weights: the source decides much of each logit
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    reference = copy.deepcopy(model)
    reference.lm_head.weight = nn.Parameter(reference.lm_head.weight.detach().clone())  # untied: wte stays float
    for name, m in list(reference.named_modules()):
        if isinstance(m, nn.Linear) and ".cross_attn." not in name:
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, Rounded(m))
    src, src_mask, tgt_in, _ = PairBatches(ds, "val", max_tokens=10_000).collate(np.arange(4))
    with torch.no_grad():
        float_logits = model(tgt_in, src=src, src_mask=src_mask)[0]
        quantize(model, "int8")
        logits = model(tgt_in, src=src, src_mask=src_mask)[0]
        expected = reference(tgt_in, src=src, src_mask=src_mask)[0]
        other = reference(tgt_in, src=src.roll(1, 0), src_mask=src_mask.roll(1, 0))[0]  # each row another's source
    cross = [m for b in model.transformer.h for m in (b.cross_attn.c_attn, b.cross_attn.c_proj)]
    assert all(type(m) is nn.Linear for m in cross)  # kept float32
    assert isinstance(model.transformer.h[0].attn.c_attn, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.encoder.h[0].mlp.c_fc, Int8Linear)
    assert torch.equal(logits, expected), (logits - expected).abs().amax()
    assert not torch.equal(logits, float_logits)  # int8 did change them
    meta = ds.seq2seq_meta()
    translations = translate(model, tok, sources, meta["bos"], meta["eos"], max_new_tokens=40)
    assert translations == translate(reference, tok, sources, meta["bos"], meta["eos"], max_new_tokens=40)
    assert len(set(translations)) > 1  # they follow their sources
    assert ((other - expected).abs().amax() / expected.abs().amax()).item() > 0.2


def test_mistakes():
    model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(QuantizeError, match="--quantize 'int2' is not one of none, int8, int4"):
        quantize(model, "int2")
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
    monkeypatch.setattr(
        loader, "quantize_model", lambda m, mode, group: (modes.append(mode), quantize(m, mode, group))[1]
    )
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

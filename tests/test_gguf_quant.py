"""4-bit GGUF (gpt/checkpoints/gguf.py): q4_0 holds gpt/model/grids.py's Q4_0 grid, bit for bit what llama.cpp's
own quantiser writes; llama.cpp runs q4_0 and the K-quants of a trained model close to ours; a model too narrow
for a K-quant is one line naming the quant that fits."""

import numpy as np
import pytest
import torch
from conftest import SHAKESPEARE, prepare
from conftest import train_run as train

from gpt import load_checkpoint
from gpt.checkpoints import gguf as ours_gguf
from gpt.cli.export import main
from gpt.infer import llamacpp
from gpt.model import grids

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_thread")


def export(ckpt, out, quant: str) -> None:
    assert main(["--ckpt", str(ckpt), "--format", "gguf", "--quant", quant, "--out", str(out), "--no-check"]) == 0


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def on_grid(model) -> torch.nn.Module:
    """`model` with every matrix the q4_0 file quantises (each Linear's weight and the tied embedding) on the grid."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "wpe" not in name and grids.fits(p.shape, "q4_0"):
                p.copy_(grids.dequantized(p, "q4_0"))
    return model


def test_a_q4_0_file_holds_the_grid_qat_trains_on(trained_run, tmp_path):
    export(trained_run, tmp_path / "m.gguf", "q4_0")
    model, tok, _ = load_checkpoint(trained_run)
    state = model.state_dict()
    names = {
        "token_embd.weight": "transformer.wte.weight",
        "blk.1.ffn_down.weight": "transformer.h.1.mlp.c_proj.weight",
    }
    found = tensors(tmp_path / "m.gguf")
    assert {t.tensor_type.name for t in found.values()} == {"F32", "Q4_0"}
    for theirs, mine in names.items():
        t = found[theirs]
        weight = state[mine][: tok.vocab_size] if theirs == "token_embd.weight" else state[mine]
        held = gguf.quants.dequantize(t.data, t.tensor_type).reshape(weight.shape)
        assert np.array_equal(held, grids.dequantized(weight, "q4_0").numpy())


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run builds it)")


def test_gguf_q4_0_is_llama_cpps_own_quantiser_bit_for_bit(llama_cpp, trained_run, tmp_path):
    export(trained_run, tmp_path / "f32.gguf", "f32")
    export(trained_run, tmp_path / "ours.gguf", "q4_0")
    ours_gguf.llama_quantize(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", "Q4_0")
    mine, theirs = tensors(tmp_path / "ours.gguf"), tensors(tmp_path / "theirs.gguf")
    both = [n for n, t in theirs.items() if t.tensor_type.name == "Q4_0"]
    assert len(both) >= 8  # every block matrix (llama.cpp keeps the embedding in another type)
    for name in both:
        assert mine[name].tensor_type.name == "Q4_0" and bytes(mine[name].data) == bytes(theirs[name].data), name


def agreement(model, tok, path) -> tuple[float, float]:
    """(top-1 agreement, mean |logits difference|) of llama.cpp on `path` and `model` over 48 tokens of the val text."""
    ids = tok.encode(SHAKESPEARE.read_text(encoding="utf-8")[-3000:])[:48]
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0, :, : tok.vocab_size].numpy()
    theirs = llamacpp.logits(llamacpp.open_gguf(path, n_ctx=64), ids)
    return float((theirs.argmax(-1) == ours.argmax(-1)).mean()), float(np.abs(theirs - ours).mean())


def test_llama_cpp_runs_q4_0_as_our_model_on_that_grid(llama_cpp, trained_run, tmp_path):
    """llama.cpp on the q4_0 file against our model with the same grid's weights (what is left: llama.cpp's
    8-bit activations in its products) and against our float model (what 4 bits cost)."""
    export(trained_run, tmp_path / "m.gguf", "q4_0")
    model, tok, _ = load_checkpoint(trained_run)
    top1, mean = agreement(model, tok, tmp_path / "m.gguf")
    grid_top1, grid_mean = agreement(on_grid(model), tok, tmp_path / "m.gguf")
    # measured: on the grid top-1 1.0, mean 0.0033; against float 0.96 and 0.051
    assert grid_mean < mean / 5 and grid_top1 >= 0.95 and top1 >= 0.9


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    """A 1-layer char model 256 wide (a K-quant's block), trained a few seconds."""
    d = tmp_path_factory.mktemp("wide")
    data = prepare(SHAKESPEARE, d / "char", "--tokenizer", "char")
    argv = ["--n-layer", "1", "--n-head", "2", "--n-embd", "256", "--block-size", "64", "--batch-size", "8"]
    argv += ["--learning-rate", "2e-3", "--warmup-iters", "5", "--max-iters", "60", "--eval-interval", "60"]
    argv += ["--eval-iters", "2", "--no-eval-train", "--device", "cpu", "--dtype", "float32", "--no-plot"]
    train("--data", data, "--out-dir", d / "run", *argv)
    return d / "run"


@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_m", "q6_k"])
def test_llama_cpp_runs_the_k_quants_of_a_trained_model(llama_cpp, wide_run, tmp_path, quant):
    export(wide_run, tmp_path / "m.gguf", quant)
    types = {t.tensor_type.name for t in tensors(tmp_path / "m.gguf").values()}
    assert types - {"F32"} <= {"Q4_K", "Q5_K", "Q6_K", "Q8_0"} and f"Q{quant[1]}_K" in types
    model, tok, _ = load_checkpoint(wide_run)
    llm = llamacpp.open_gguf(tmp_path / "m.gguf", n_ctx=64, logits_all=False)
    text = SHAKESPEARE.read_text(encoding="utf-8")[-500:]
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text)
    top1, mean = agreement(model, tok, tmp_path / "m.gguf")
    assert top1 >= 0.9  # measured 1.0, 0.98, 1.0 (mean |logits difference| 0.011, 0.009, 0.008)


def test_a_model_too_narrow_for_a_k_quant_is_one_line(trained_run, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["--ckpt", str(trained_run), "--format", "gguf", "--quant", "q4_k_m", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "error: --quant q4_k_m: K-quants store rows in blocks of 256, and this model's rows are 64 wide: use "
        "--quant q4_0 (blocks of 32) or q8_0\n"
    )
    assert not out.exists()

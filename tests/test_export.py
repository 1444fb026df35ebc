"""gpt export: ONNX (checked in onnxruntime) and torch.export .pt2, dynamic batch and sequence length."""

import errno
import json

import numpy as np
import pytest
import torch

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.checkpoints import loader, native
from gpt.cli.export import main
from gpt.infer import export as export_module
from gpt.infer.export import run_exported

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPES = [(1, 1), (1, 64), (3, 17), (7, 5), (2, 64)]  # batch x seq, seq up to block_size (64)


def export_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def onnx_dir(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    assert main(["--ckpt", str(trained_run), "--format", "onnx", "--out", str(out)]) == 0
    return out


def test_onnx_logits_match_pytorch_in_onnxruntime_at_any_batch_and_length(trained_run, onnx_dir):
    ort = pytest.importorskip("onnxruntime")
    model, tok, _ = load_checkpoint(trained_run)
    session = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    (inp,), (outp,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.type, inp.shape) == ("idx", "tensor(int64)", ["batch", "seq"])  # dynamic, named
    vocab = model.config.vocab_size  # the tokenizer's 66 ids, padded to a multiple of 64 by train.py
    assert (outp.name, outp.shape) == ("logits", ["batch", "seq", vocab])
    g = torch.Generator().manual_seed(1)
    for batch, seq in SHAPES:
        idx = torch.randint(0, tok.vocab_size, (batch, seq), generator=g)
        with torch.no_grad():
            expected = model(idx)[0].numpy()
        got = session.run(["logits"], {"idx": idx.numpy()})[0]
        assert got.shape == (batch, seq, vocab)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_export_writes_what_it_needs_to_run_and_reports_parity(trained_run, onnx_dir, capsys):
    meta = json.loads((onnx_dir / "gpt_export.json").read_text())
    assert meta["format"] == "onnx" and meta["block_size"] == 64 and meta["eot_token"] == 65
    assert meta["tokenizer"] == loader.read_meta(trained_run)["tokenizer"]
    code, _, err = export_cli(capsys, "--ckpt", trained_run, "--format", "onnx", "--out", onnx_dir)
    assert (
        code == 2
        and err == f"error: {onnx_dir / 'model.onnx'} exists already: choose another --out, or --force to replace it\n"
    )


def test_greedy_decoding_with_the_onnx_model_equals_ours(trained_run, onnx_dir):
    pytest.importorskip("onnxruntime")
    from gpt.infer.sampling import complete

    model, tok, _ = load_checkpoint(trained_run)
    ids = tok.encode("ROMEO:")
    for _ in range(20):  # recompute the window each step: the exported graph has no KV cache
        logits = run_exported(onnx_dir / "model.onnx", torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    assert tok.decode(ids[6:]) == complete(model, tok, "ROMEO:", max_new_tokens=20, temperature=0)[0]


def test_pt2_program_round_trips(trained_run, tmp_path, capsys):
    code, out, _ = export_cli(capsys, "--ckpt", trained_run, "--format", "pt2", "--out", tmp_path)
    assert code == 0 and f"to {tmp_path / 'model.pt2'}" in out
    assert float(out.split("max |logits - PyTorch's| = ")[1].split()[0]) < 1e-5
    model, _, _ = load_checkpoint(trained_run)
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    for batch, seq in SHAPES:
        idx = torch.randint(0, 66, (batch, seq))
        with torch.no_grad():
            torch.testing.assert_close(program(idx), model(idx)[0], atol=1e-5, rtol=1e-5)


def test_seq2seq_checkpoints_are_refused_in_one_line(tmp_path, capsys):
    cfg = GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=1, n_embd=8, n_encoder_layer=1)
    native.save(
        tmp_path / "run" / "best.pt",
        {"model": GPT(cfg).state_dict()},
        {"model_config": cfg.to_dict(), "tokenizer": {"kind": "char", "chars": "abcdefghijklmnopqrs"}},
    )
    code, _, err = export_cli(capsys, "--ckpt", tmp_path / "run", "--format", "pt2", "--out", tmp_path / "x")
    assert (
        code == 2
        and err == "error: this checkpoint is an encoder-decoder (seq2seq) model: export covers decoder-only models\n"
    )
    code, _, err = export_cli(capsys, "--ckpt", tmp_path / "none", "--format", "pt2", "--out", tmp_path / "x")
    assert code == 2 and err == f"error: no checkpoint at {tmp_path / 'none'}\n"


def test_any_file_of_an_earlier_export_needs_force(trained_run, tmp_path, capsys):
    (tmp_path / "gpt_export.json").write_text("{}")  # an export whose model file is gone: still not replaced
    code, _, err = export_cli(capsys, "--ckpt", trained_run, "--format", "pt2", "--out", tmp_path, "--no-check")
    assert code == 2 and err == (
        f"error: {tmp_path / 'gpt_export.json'} exists already: choose another --out, or --force to replace it\n"
    )
    assert (tmp_path / "gpt_export.json").read_text() == "{}" and not (tmp_path / "model.pt2").exists()


def test_an_out_that_is_a_file_or_a_full_disk_is_one_line(trained_run, tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    code, _, err = export_cli(capsys, "--ckpt", trained_run, "--format", "pt2", "--out", afile, "--no-check")
    assert code == 2 and err == f"error: --out {afile} is a file, not a directory; choose another --out\n"
    assert afile.read_text() == "mine"

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_module, "write_text", full)
    out = tmp_path / "out"
    code, _, err = export_cli(capsys, "--ckpt", trained_run, "--format", "pt2", "--out", out, "--no-check")
    assert code == 2 and err == (
        f"error: could not write the export to {out}: the disk is full; free some space; no file there is half-written\n"
    )
    assert [p.name for p in out.iterdir()] == ["model.pt2"]  # the model file whole; no temporary file left


def test_a_gguf_out_under_a_file_is_one_line(trained_run, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    out = afile / "model.gguf"
    code, _, err = export_cli(capsys, "--ckpt", trained_run, "--format", "gguf", "--out", out, "--no-check")
    assert code == 2 and err == f"error: --out {out}: {afile} is a file, not a directory; choose another --out\n"
    assert afile.read_text() == "mine"

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gpt import checkpoint
from gpt.model import GPT, GPTConfig
from gpt.trainer import Runtime, TrainingError, config_from_argv, train, train_step

from conftest import ROOT, SHAKESPEARE

# CPU float32 wherever the tests run (bit-identical results); tests/test_cuda.py covers CUDA
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
        "--eval-iters", "4", "--log-interval", "1", "--warmup-iters", "2", "--device", "cpu"]


def prepare(text_file, out, *extra):
    subprocess.run([sys.executable, "data/prepare.py", str(text_file), "--out", str(out), *extra],
                   cwd=ROOT, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    src = d / "shakespeare_head.txt"
    src.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    return prepare(src, d / "char", "--tokenizer", "char")


def run(*argv):
    cfg, explicit = config_from_argv([str(a) for a in argv])
    return train(cfg, explicit)


def records(out_dir, kind):
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_end_to_end_loss_falls_and_checkpoints_load(char_data, tmp_path):
    out = tmp_path / "run"
    summary = run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "60", "--eval-interval", "30",
                  "--learning-rate", "3e-3")
    evals = records(out, "eval")
    assert [e["step"] for e in evals] == [30, 60]
    assert summary["val_loss"] < 3.3 < 4.2  # from ~ln(66) = 4.19 at init
    assert evals[1]["val_loss"] < evals[0]["val_loss"]
    for name in ("last.pt", "best.pt", "config.json", "log.jsonl"):
        assert (out / name).exists()
    raw = torch.load(out / "last.pt", weights_only=True)  # nothing executed on load
    assert set(raw) >= {"model", "optimizer", "rng", "meta"}
    model, tok, meta = checkpoint.load_checkpoint(out)
    assert meta["step"] == 60 and tok.decode(tok.encode("ROMEO:")) == "ROMEO:"
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= tok.vocab_size
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["max_iters"] == 60 and config["model"]["n_embd"] == 32


def test_exact_resume_bit_identical(char_data, tmp_path):
    common = ["--data", char_data, *TINY, "--dropout", "0.1", "--grad-accum", "2", "--lr-decay-iters", "12",
              "--eval-interval", "6"]
    run(*common, "--out-dir", tmp_path / "full", "--max-iters", "12")
    run(*common, "--out-dir", tmp_path / "first", "--max-iters", "6")
    (tmp_path / "first").rename(tmp_path / "split")  # a run directory that moved resumes where it is now
    (tmp_path / "split" / "best.pt").unlink()  # a hard link to last.pt: unlink before writing
    (tmp_path / "split" / "best.pt").write_bytes(b"resume reads last.pt, never best.pt")
    run("--resume", tmp_path / "split", "--max-iters", "12")
    full = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "full", "train")]
    split = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "split", "train")]
    assert [s for s, *_ in split] == list(range(1, 13))
    assert split == full  # every loss after the resume equals the uninterrupted run's, bit for bit
    assert records(tmp_path / "split", "eval")[-1]["val_loss"] == records(tmp_path / "full", "eval")[-1]["val_loss"]


def test_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, 50, (8, 16))
    y = torch.randint(0, 50, (8, 16))
    rt = Runtime(torch.device("cpu"), torch.float32)
    grads = []
    for accum in (1, 4):
        torch.manual_seed(1)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters())
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        size = 8 // accum
        get = lambda step, micro: (x[micro * size:(micro + 1) * size], y[micro * size:(micro + 1) * size])  # noqa: E731
        loss, _, tokens = train_step(model, opt, scaler, get, 0, accum, rt, grad_clip=0.0)
        assert tokens.item() == 8 * 16
        grads.append((loss, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_nonfinite_loss_stops_before_the_step_and_keeps_the_checkpoint(char_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_loss, calls = GPT.loss, {"n": 0}

    def poisoned(self, logits, targets):
        calls["n"] += 1
        loss = real_loss(self, logits, targets)
        return loss * float("nan") if calls["n"] == 5 else loss  # the 5th training step (index 4)

    monkeypatch.setattr(GPT, "loss", poisoned)
    with pytest.raises(TrainingError, match="at step 4"):
        run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "10", "--eval-interval", "2")
    meta = checkpoint.read(out / "last.pt")["meta"]
    assert meta["step"] == 4  # the last good checkpoint stays

    calls["n"] = 0
    summary = run("--data", char_data, "--out-dir", tmp_path / "skip", *TINY, "--max-iters", "10",
                  "--eval-interval", "5", "--skip-nonfinite")
    assert summary["skipped_steps"] == 1 and summary["step"] == 10


def test_out_of_memory_is_one_line_naming_the_fix_and_keeps_the_checkpoint(char_data, tmp_path, monkeypatch):
    from gpt import trainer

    out = tmp_path / "run"
    run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2")
    before = (out / "last.pt").read_bytes()

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(trainer, "train_step", oom)
    with pytest.raises(TrainingError, match=r"out of memory at step 3 .*--batch-size 2 --grad-accum 2; the last "
                                            r"checkpoint in .* is intact"):
        run("--resume", out, "--max-iters", "4")
    monkeypatch.undo()
    monkeypatch.setattr(trainer, "estimate_loss", oom)
    with pytest.raises(TrainingError, match=r"while evaluating: .*--eval-batch-size 2"):
        run("--resume", out, "--max-iters", "4", "--eval-interval", "1")
    assert (out / "last.pt").read_bytes() == before


def test_out_dir_with_a_run_is_not_overwritten(char_data, tmp_path):
    out = tmp_path / "run"
    run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2")
    before = (out / "last.pt").read_bytes()
    with pytest.raises(ValueError, match="--resume"):
        run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2")
    assert (out / "last.pt").read_bytes() == before


def test_finetune_from_checkpoint(char_data, tmp_path):
    base = tmp_path / "base"
    run("--data", char_data, "--out-dir", base, *TINY, "--max-iters", "4", "--eval-interval", "4")
    summary = run("--data", char_data, "--out-dir", tmp_path / "ft", "--init-from", base, "--block-size", "16",
                  "--batch-size", "4", "--max-iters", "4", "--eval-interval", "4", "--eval-iters", "2")
    assert summary["step"] == 4
    meta = checkpoint.read(tmp_path / "ft")["meta"]
    assert meta["model_config"]["block_size"] == 16 and meta["model_config"]["n_embd"] == 32
    optimizer_state = checkpoint.read(tmp_path / "ft")["optimizer"]["state"]
    assert all(int(s["step"]) == 4 for s in optimizer_state.values())  # a fresh optimizer, not the base run's


def test_finetune_tokenizer_mismatch_is_an_error(char_data, tmp_path):
    base = tmp_path / "base"
    run("--data", char_data, "--out-dir", base, *TINY, "--max-iters", "2", "--eval-interval", "2")
    other_src = tmp_path / "other.txt"
    other_src.write_text("abc def " * 2000)
    other = prepare(other_src, tmp_path / "other", "--tokenizer", "char")
    with pytest.raises(TrainingError, match="tokenizer mismatch"):
        run("--data", other, "--out-dir", tmp_path / "ft", "--init-from", base, "--max-iters", "2")


def test_cli_errors_are_one_line(tmp_path):
    res = subprocess.run([sys.executable, "train.py", "--data", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o"),
                          "--max-itres", "3"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "max_itres: unknown option" in res.stderr
    res = subprocess.run([sys.executable, "train.py", "--data", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.startswith("error: ")
    res = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0 and "--max-iters" in res.stdout and "(default:" in res.stdout


def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(char_data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--data", str(char_data), "--out-dir", str(out), *TINY, "--max-iters", "100000",
         "--eval-interval", "100000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (out / "log.jsonl").exists() or len(records(out, "train")) < 3:
        time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert f"resume with: python train.py --resume {out}" in stdout
    meta = checkpoint.read(out / "last.pt")["meta"]
    assert meta["step"] == records(out, "train")[-1]["step"] >= 3
    summary = run("--resume", out, "--max-iters", str(meta["step"] + 2))
    assert summary["step"] == meta["step"] + 2


def test_wandb_logs_offline(char_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    summary = run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2",
                  "--wandb-project", "gpt-test", "--wandb-mode", "offline")
    assert summary["step"] == 2
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))  # the offline run's data file, ready to `wandb sync`


def test_wandb_failure_never_stops_training(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    def broken(*a, **k):
        raise RuntimeError("wandb is down")

    monkeypatch.setattr(wandb, "init", broken)
    summary = run("--data", char_data, "--out-dir", tmp_path / "a", *TINY, "--max-iters", "2", "--eval-interval", "2",
                  "--wandb-project", "gpt-test")
    assert summary["step"] == 2
    assert "warning: Weights & Biases disabled (RuntimeError: wandb is down)" in capsys.readouterr().err


def test_ddp_two_processes_match_one_and_resume_in_one(char_data, tmp_path):
    common = [*TINY, "--data", str(char_data), "--grad-accum", "4", "--lr-decay-iters", "6", "--eval-interval", "3",
              "--device", "cpu", "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          "29513", "train.py", *common, "--max-iters", "3", "--out-dir", str(tmp_path / "ddp")],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    run(*common, "--max-iters", "6", "--out-dir", tmp_path / "single")
    single = [r["loss"] for r in records(tmp_path / "single", "train")]
    ddp = [r["loss"] for r in records(tmp_path / "ddp", "train")]
    assert len(ddp) == 3 and ddp == pytest.approx(single[:3], rel=1e-5)  # same global batch, same losses
    assert checkpoint.read(tmp_path / "ddp")["meta"]["world_size"] == 2
    run("--resume", tmp_path / "ddp", "--max-iters", "6")  # the 2-process checkpoint, resumed in one process
    resumed = [r["loss"] for r in records(tmp_path / "ddp", "train")]
    assert resumed == pytest.approx(single, rel=1e-5)


@pytest.fixture(scope="session")
def reverse_pairs(tmp_path_factory):
    """A tiny translation task: lowercase words and their reverses, as a pairs dataset."""
    import random

    from gpt.pairs import prepare_pairs

    d = tmp_path_factory.mktemp("pairs")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 8))) for _ in range(1200)]
    (d / "src.txt").write_text("\n".join(words) + "\n")
    (d / "tgt.txt").write_text("\n".join(w[::-1] for w in words) + "\n")
    prepare_pairs(d / "src.txt", d / "tgt.txt", d / "rev", tokenizer="char", val_fraction=0.1, max_len=16)
    return d / "rev"


def test_seq2seq_trains_with_the_same_loop_and_resumes_exactly(reverse_pairs, tmp_path):
    s2s = ["--data", reverse_pairs, "--n-encoder-layer", "2", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
           "--block-size", "16", "--norm", "post", "--pos-encoding", "sinusoidal", "--label-smoothing", "0.1",
           "--max-tokens", "256", "--dropout", "0.1", "--grad-accum", "2", "--learning-rate", "3e-3",
           "--lr-decay-iters", "40", "--eval-interval", "20", "--log-interval", "1", "--eval-iters", "4",
           "--warmup-iters", "5"]
    full = run(*s2s, "--out-dir", tmp_path / "full", "--max-iters", "40")
    run(*s2s, "--out-dir", tmp_path / "split", "--max-iters", "20")
    run("--resume", tmp_path / "split", "--max-iters", "40")
    losses = lambda out: [(r["step"], r["loss"]) for r in records(out, "train")]  # noqa: E731
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    first, last = records(tmp_path / "full", "eval")[0]["val_loss"], full["val_loss"]
    assert last < first < 3.0  # learning: from ln(64) = 4.2 (padded vocab) at init
    meta = checkpoint.read(tmp_path / "full")["meta"]
    assert meta["seq2seq"]["eos"] == meta["seq2seq"]["bos"] and meta["model_config"]["n_encoder_layer"] == 2


def test_pairs_dataset_needs_an_encoder(reverse_pairs, tmp_path):
    with pytest.raises(ValueError, match="n_encoder_layer: a pairs dataset needs an encoder"):
        run("--data", reverse_pairs, "--out-dir", tmp_path / "o", "--n-layer", "1", "--block-size", "8")

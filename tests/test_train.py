import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, prepare, reversed_words, torchrun, train_run

from gpt.checkpoints import loader
from gpt.errors import ConfigError
from gpt.model.transformer import GPT, GPTConfig
from gpt.runtime import Runtime
from gpt.train.rundir import RunDir, RunDirError
from gpt.train.step import train_step
from gpt.train.stopping import StopSignal, TimeLimit
from gpt.train.trainer import TrainingError


def records(out_dir, kind):
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.precision
def test_end_to_end_loss_falls_and_checkpoints_load(char_data, tmp_path):
    out = tmp_path / "run"
    summary = train_run(
        "--data",
        char_data,
        "--out-dir",
        out,
        *TINY,
        "--max-iters",
        "60",
        "--eval-interval",
        "30",
        "--learning-rate",
        "3e-3",
    )
    evals = records(out, "eval")
    assert [e["step"] for e in evals] == [30, 60]
    assert summary["val_loss"] < 3.4 < 4.2  # from ~ln(66) = 4.19 at init; measured 3.28 float32, 3.29-3.30 bf16
    assert evals[1]["val_loss"] < evals[0]["val_loss"]
    for name in ("last.pt", "best.pt", "config.json", "log.jsonl"):
        assert (out / name).exists()
    raw = torch.load(out / "last.pt", weights_only=True)  # nothing executed on load
    assert set(raw) >= {"model", "optimizer", "rng", "meta"}
    model, tok, meta = loader.load_checkpoint(out)
    assert meta["step"] == 60 and tok.decode(tok.encode("ROMEO:")) == "ROMEO:"
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= tok.vocab_size
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["max_iters"] == 60 and config["model"]["n_embd"] == 32


@pytest.mark.precision
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_exact_resume_bit_identical(char_data, tmp_path, optimizer):
    common = [
        "--data",
        char_data,
        *TINY,
        "--dropout",
        "0.1",
        "--grad-accum",
        "2",
        "--lr-decay-iters",
        "12",
        "--eval-interval",
        "6",
        "--optimizer",
        optimizer,
    ]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "12")
    train_run(*common, "--out-dir", tmp_path / "first", "--max-iters", "6")
    (tmp_path / "first").rename(tmp_path / "split")  # a run directory that moved resumes where it is now
    (tmp_path / "split" / "best.pt").unlink()  # a hard link to last.pt: unlink before writing
    (tmp_path / "split" / "best.pt").write_bytes(b"resume reads last.pt, never best.pt")
    train_run("--resume", tmp_path / "split", "--max-iters", "12")
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
        get = lambda step, micro: (x[micro * size : (micro + 1) * size], y[micro * size : (micro + 1) * size])  # noqa: E731, B023
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
        train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "10", "--eval-interval", "2")
    meta = loader.read(out / "last.pt")["meta"]
    assert meta["step"] == 4  # the last good checkpoint stays

    calls["n"] = 0
    summary = train_run(
        "--data",
        char_data,
        "--out-dir",
        tmp_path / "skip",
        *TINY,
        "--max-iters",
        "10",
        "--eval-interval",
        "5",
        "--skip-nonfinite",
    )
    assert summary["skipped_steps"] == 1 and summary["step"] == 10


def test_out_of_memory_is_one_line_naming_the_fix_and_keeps_the_checkpoint(char_data, tmp_path, monkeypatch):
    from gpt.train import trainer

    out = tmp_path / "run"
    train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2")
    before = (out / "last.pt").read_bytes()

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(trainer, "train_step", oom)
    with pytest.raises(
        TrainingError,
        match=r"out of memory at step 3 .*--batch-size 2 --grad-accum 2; the last "
        r"checkpoint in .* is intact",
    ):
        train_run("--resume", out, "--max-iters", "4")
    monkeypatch.undo()
    monkeypatch.setattr(trainer, "estimate_loss", oom)
    with pytest.raises(TrainingError, match=r"while evaluating: .*--eval-batch-size 2"):
        train_run("--resume", out, "--max-iters", "4", "--eval-interval", "1")
    assert (out / "last.pt").read_bytes() == before


def test_out_dir_with_a_run_is_not_overwritten(char_data, tmp_path):
    out = tmp_path / "run"
    train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2")
    before = (out / "last.pt").read_bytes()
    with pytest.raises(RunDirError, match="--resume"):
        train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2")
    assert (out / "last.pt").read_bytes() == before
    (out / "last.pt").unlink()  # only best.pt (and the log) left: still a run
    with pytest.raises(RunDirError, match="already holds a run"):
        train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2")
    (out / "best.pt").unlink()  # only the log of a run whose saves failed (a full disk): nothing to --resume
    with pytest.raises(RunDirError, match="holds the log of a run that saved no checkpoint .* pass --force"):
        train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2")
    train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "1", "--eval-interval", "1", "--force")
    assert [r["step"] for r in records(out, "train")] == [1]  # --force starts over: the old log is gone


def test_unusable_out_dirs_are_one_line(char_data, tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    for out, message in ((a_file, "is a file, not a directory"), (a_file / "run", "a part of the path is a file")):
        with pytest.raises(RunDirError, match=message):
            train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "1")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    monkeypatch.setattr("gpt.train.rundir.os.access", lambda path, mode: False)  # (root may write anywhere)
    with pytest.raises(RunDirError, match="not writable"):
        train_run("--data", char_data, "--out-dir", read_only, *TINY, "--max-iters", "1")


def test_a_second_trainer_into_the_same_out_dir_is_refused(char_data, tmp_path):
    out = tmp_path / "run"
    with RunDir(out).claim(resume=False, force=False):  # a trainer holding the directory
        res = subprocess.run(
            [sys.executable, "train.py", "--data", str(char_data), "--out-dir", str(out), *TINY, "--max-iters", "1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert f"in use by another trainer (pid {os.getpid()} on " in res.stderr
        assert not (out / "log.jsonl").exists()
    train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "1")  # free again once it is released


@pytest.mark.skipif(sys.platform == "win32", reason="flock: POSIX only")
def test_a_released_lock_stays_one_lock(tmp_path):
    """A trainer B that opened .lock while A held it gets the flock once A lets go; a third trainer C must
    then be refused. (Had A unlinked .lock, C would create and lock a new file: two holders.)"""
    import fcntl

    with RunDir(tmp_path).claim(resume=False, force=False):  # A
        b = os.open(tmp_path / ".lock", os.O_RDWR)  # B, waiting on A's lock file
    try:
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)  # B holds it now
        with pytest.raises(RunDirError, match="in use by another trainer"):
            with RunDir(tmp_path).claim(resume=False, force=False):  # C
                pass
    finally:
        os.close(b)
    with RunDir(tmp_path).claim(resume=False, force=False):  # free again
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("not a lock\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(precious)
    with pytest.raises(RunDirError, match=r"\.lock is a symbolic link") as e:
        with RunDir(out).claim(resume=False, force=False):
            pass
    assert "\n" not in str(e.value) and precious.read_text() == "not a lock\n"


def test_a_lock_file_that_is_a_hard_link_is_refused_and_the_other_name_kept(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "best.pt").write_bytes(b"weights")
    os.link(out / "best.pt", out / ".lock")  # e.g. a run directory unpacked from someone's archive
    with pytest.raises(RunDirError, match=r"\.lock is a hard link to another file; remove it"):
        with RunDir(out).claim(resume=True, force=False):
            pass
    assert (out / "best.pt").read_bytes() == b"weights"


def test_nonfinite_val_loss_never_replaces_the_last_checkpoint(char_data, tmp_path):
    out = tmp_path / "run"
    train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2")
    with pytest.raises(TrainingError, match=r"non-finite .* not saved; .*last.pt still holds step (\d+)") as e:
        train_run(
            "--resume",
            out,
            "--learning-rate",
            "1e6",
            "--lr-schedule",
            "constant",
            "--warmup-iters",
            "0",
            "--eval-interval",
            "1",
            "--max-iters",
            "20",
            "--grad-clip",
            "0",
        )
    kept = int(re.search(r"still holds step (\d+)", str(e.value)).group(1))
    meta = loader.read(out / "last.pt")["meta"]
    assert meta["step"] == kept and math.isfinite(meta["val_loss"])  # the last good state, not the NaN one
    resumed = train_run("--resume", out, "--max-iters", kept + 1, "--learning-rate", "1e-3", "--lr-schedule", "cosine")
    assert resumed["step"] == kept + 1 and math.isfinite(resumed["val_loss"])  # the run goes on from there


def test_resume_refuses_another_tokenizer_or_architecture(char_data, tmp_path):
    out = tmp_path / "run"
    train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2")
    before = [(out / name).read_bytes() for name in ("last.pt", "config.json")]
    other_src = tmp_path / "other.txt"
    other_src.write_text("".join(chr(ord("A") + i % 60) for i in range(20000)))  # another char vocabulary
    other = prepare(other_src, tmp_path / "other", "--tokenizer", "char")
    with pytest.raises(TrainingError, match="tokenizer mismatch"):
        train_run("--resume", out, "--data", other, "--max-iters", "4")
    with pytest.raises(ConfigError, match=r"architecture of a run cannot change: --n-embd 64 \(the run has 32\)"):
        train_run("--resume", out, "--n-embd", "64", "--max-iters", "4")
    with pytest.raises(ConfigError, match=r"--n-layer 3 \(the run has 2\)"):
        train_run("--resume", out, "--n-layer", "3", "--max-iters", "4")
    with pytest.raises(ConfigError, match=r"trained with --optimizer adamw, not muon"):
        train_run("--resume", out, "--optimizer", "muon", "--max-iters", "4")
    assert [(out / name).read_bytes() for name in ("last.pt", "config.json")] == before
    assert train_run("--resume", out, "--dropout", "0.1", "--max-iters", "3")["step"] == 3  # dropout may change


def test_compile_is_announced_and_gets_the_cpu_settings(char_data, tmp_path, monkeypatch, capsys):
    """--compile: a line before the compiling first step, inductor's CPU options, the compiled step's kernels."""
    compiled, kernels, autocast = [], [], Runtime.autocast
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: (compiled.append(kwargs), model)[1])
    monkeypatch.setattr(Runtime, "autocast", lambda self: (kernels.append(self.compiled), autocast(self))[1])
    train_run(
        "--data",
        char_data,
        "--out-dir",
        tmp_path / "run",
        *TINY,
        "--max-iters",
        "1",
        "--eval-interval",
        "1",
        "--compile",
    )
    out = capsys.readouterr().out
    assert -1 < out.find("compiling the model for the first step") < out.find("step      1")
    assert compiled == [{"options": {"cpp.use_decompose_tanh": True}}] and kernels and all(kernels)


def test_init_from_says_which_flags_the_checkpoint_overrides(char_data, tmp_path, capsys):
    base = tmp_path / "base"
    train_run("--data", char_data, "--out-dir", base, *TINY, "--max-iters", "1", "--eval-interval", "1")
    train_run(
        "--data",
        char_data,
        "--out-dir",
        tmp_path / "ft",
        "--init-from",
        base,
        "--n-layer",
        "6",
        "--max-iters",
        "1",
        "--device",
        "cpu",
        "--eval-iters",
        "1",
    )
    assert f"init_from: the architecture comes from {base}; ignoring --n-layer 6" in capsys.readouterr().out
    assert loader.read(tmp_path / "ft")["meta"]["model_config"]["n_layer"] == 2


def test_device_mistakes_are_one_line(char_data, tmp_path):
    cases = [
        ("tpu", "is not a device"),
        ("meta", "not supported here"),
        ("cuda:x", "is not a device"),
        ("mps", "MPS is not available"),
    ]
    if not torch.cuda.is_available():
        cases.append(("cuda", "CUDA is not available"))
    for device, message in cases:
        res = subprocess.run(
            [
                sys.executable,
                "train.py",
                "--data",
                str(char_data),
                "--out-dir",
                str(tmp_path / device),
                "--device",
                device,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert not (tmp_path / device).exists()  # nothing written


def test_time_limit_leaves_room_for_the_final_evaluation():
    limit = TimeLimit(minutes=1, t_start=0.0, eval_tokens=10_000)
    # before any evaluation: estimated from throughput (a forward pass ~ half a step's cost, conservatively)
    assert not limit.out_of_time(now=40.0, step_seconds=1.0, tokens_per_s=1000.0)  # 40 + 1 + 5 < 60
    assert limit.out_of_time(now=54.5, step_seconds=1.0, tokens_per_s=1000.0)  # 54.5 + 1 + 5 >= 60
    assert limit.out_of_time(now=50.0, step_seconds=1.0, tokens_per_s=1000.0, eval_due=True)  # two evaluations
    limit.eval_seconds = 20.0  # then measured
    assert limit.out_of_time(now=40.0, step_seconds=1.0, tokens_per_s=1000.0)
    assert not TimeLimit(minutes=0, t_start=0.0, eval_tokens=1).out_of_time(1e9, 1.0, 1.0)  # no limit


def test_max_minutes_stops_with_an_evaluation_and_a_checkpoint(char_data, tmp_path):
    out = tmp_path / "run"
    summary = train_run(
        "--data",
        char_data,
        "--out-dir",
        out,
        *TINY,
        "--max-iters",
        "100000",
        "--eval-interval",
        "100000",
        "--max-minutes",
        "0.02",
    )
    assert 0 < summary["step"] < 100000
    assert records(out, "eval")[-1]["step"] == summary["step"] == loader.read(out / "last.pt")["meta"]["step"]


def test_a_slow_first_step_does_not_end_a_time_limited_run(char_data, tmp_path, monkeypatch):
    """The first step pays for warm-up (allocation, compiling; here a 6 s sleep): nothing is estimated from
    it, so an 18-second run trains on past it (the final evaluation's estimate was once taken from the first
    step's throughput, and a short --max-minutes run stopped at step 1)."""
    from gpt.train.trainer import Run

    real, calls = Run.train_one_step, []

    def slow_first(self):
        calls.append(self.step)
        if len(calls) == 1:
            time.sleep(6)
        return real(self)

    monkeypatch.setattr(Run, "train_one_step", slow_first)
    out = tmp_path / "run"
    args = ("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "100000", "--eval-interval", "100000")
    summary = train_run(*args, "--dtype", "float32", "--eval-iters", "2", "--max-minutes", "0.3")
    assert summary["step"] > 5, summary["step"]
    assert records(out, "eval")[-1]["step"] == summary["step"]
    limit = TimeLimit(minutes=1, t_start=0.0, eval_tokens=10**9)
    assert not limit.out_of_time(now=30.0, step_seconds=30.0, tokens_per_s=1.0, warming_up=True)
    assert limit.out_of_time(now=60.0, step_seconds=30.0, tokens_per_s=1.0, warming_up=True)  # past the limit


def test_a_second_ctrl_c_waits_for_the_checkpoint_being_written():
    stop = StopSignal()
    stop._handle(signal.SIGINT, None)  # the first: finish the step, save, stop
    written = []
    with pytest.raises(KeyboardInterrupt):
        with stop.deferred():
            stop._handle(signal.SIGINT, None)  # the second, mid-write: no exception inside the writer
            written.append("checkpoint")
    assert written == ["checkpoint"]
    with pytest.raises(KeyboardInterrupt):  # outside a write, the second one aborts at once
        stop._handle(signal.SIGINT, None)


def test_finetune_from_checkpoint(char_data, tmp_path):
    base = tmp_path / "base"
    train_run("--data", char_data, "--out-dir", base, *TINY, "--max-iters", "4", "--eval-interval", "4")
    summary = train_run(
        "--data",
        char_data,
        "--out-dir",
        tmp_path / "ft",
        "--init-from",
        base,
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--max-iters",
        "4",
        "--eval-interval",
        "4",
        "--eval-iters",
        "2",
    )
    assert summary["step"] == 4
    meta = loader.read(tmp_path / "ft")["meta"]
    assert meta["model_config"]["block_size"] == 16 and meta["model_config"]["n_embd"] == 32
    optimizer_state = loader.read(tmp_path / "ft")["optimizer"]["state"]
    assert all(int(s["step"]) == 4 for s in optimizer_state.values())  # a fresh optimizer, not the base run's


def test_finetune_tokenizer_mismatch_is_an_error(char_data, tmp_path):
    base = tmp_path / "base"
    train_run("--data", char_data, "--out-dir", base, *TINY, "--max-iters", "2", "--eval-interval", "2")
    other_src = tmp_path / "other.txt"
    other_src.write_text("abc def " * 2000)
    other = prepare(other_src, tmp_path / "other", "--tokenizer", "char")
    with pytest.raises(TrainingError, match="tokenizer mismatch") as e:
        train_run("--data", other, "--out-dir", tmp_path / "ft", "--init-from", base, "--max-iters", "2")
    assert str(e.value).endswith(f"(`gpt prepare ... --tokenizer-from {base}`)")
    same = prepare(other_src, tmp_path / "same", "--tokenizer-from", base)  # what the message says to do
    assert train_run("--data", same, "--out-dir", tmp_path / "ft", "--init-from", base, "--max-iters", "2")["step"] == 2


def test_cli_errors_are_one_line(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--data",
            str(tmp_path / "nope"),
            "--out-dir",
            str(tmp_path / "o"),
            "--max-itres",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--max-itres: unknown option" in res.stderr
    res = subprocess.run(
        [sys.executable, "train.py", "--data", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.startswith("error: ")
    res = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0 and "--max-iters" in res.stdout and "(default:" in res.stdout


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "SIGHUP", "closed stdout"])
def test_a_stop_finishes_the_step_saves_and_says_how_to_resume(char_data, tmp_path, stop):
    """Ctrl-C, SIGTERM, SIGHUP (the terminal closed) and a reader of stdout that went away (`train.py | head`)
    each end the run after its step with a checkpoint: no work lost; the exit status says it stopped."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "--data",
            str(char_data),
            "--out-dir",
            str(out),
            *TINY,
            "--max-iters",
            "100000",
            "--eval-interval",
            "100000",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def logged_steps():  # complete lines only: the trainer may be writing the next one
        log = out / "log.jsonl"
        return sum(
            line.endswith("\n") and '"train"' in line
            for line in (log.read_text().splitlines(keepends=True) if log.exists() else [])
        )

    deadline = time.time() + 60
    while time.time() < deadline and logged_steps() < 3:
        time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
    if stop == "closed stdout":
        proc.stdout.close()  # the next line the trainer prints finds no reader
        stdout, stderr = "", proc.stderr.read()
        proc.wait(60)
        signum = signal.SIGPIPE
    else:
        signum = getattr(signal, stop)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
        assert f"stopped by {stop} at step" in stdout and f"resume with: gpt train --resume {out}" in stdout
        assert "| not evaluated yet |" in stdout and "inf" not in stdout  # (--eval-interval 100000)
    # saved, but not done: the status a shell gives a killed command, so `train.py && sample.py` does not go on
    assert proc.returncode == 128 + signum and "Traceback" not in stderr, stderr
    assert records(out, "summary")[-1]["interrupted"] is True
    meta = loader.read(out / "last.pt")["meta"]
    assert meta["step"] == records(out, "train")[-1]["step"] >= 3
    summary = train_run("--resume", out, "--max-iters", str(meta["step"] + 2))
    assert summary["step"] == meta["step"] + 2


def test_wandb_logs_offline(char_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    summary = train_run(
        "--data",
        char_data,
        "--out-dir",
        out,
        *TINY,
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
        "--wandb-project",
        "gpt-test",
        "--wandb-mode",
        "offline",
    )
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
    summary = train_run(
        "--data",
        char_data,
        "--out-dir",
        tmp_path / "a",
        *TINY,
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
        "--wandb-project",
        "gpt-test",
    )
    assert summary["step"] == 2
    assert "warning: Weights & Biases disabled (RuntimeError: wandb is down)" in capsys.readouterr().err


@pytest.mark.precision
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ddp_two_processes_match_one_and_resume_in_one(char_data, tmp_path, optimizer):
    common = [
        *TINY,
        "--data",
        str(char_data),
        "--grad-accum",
        "4",
        "--lr-decay-iters",
        "6",
        "--eval-interval",
        "3",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--optimizer",
        optimizer,
    ]
    torchrun(2, *common, "--max-iters", "3", "--out-dir", tmp_path / "ddp")  # a free port, one thread each
    train_run(*common, "--max-iters", "6", "--out-dir", tmp_path / "single")
    single = [r["loss"] for r in records(tmp_path / "single", "train")]
    ddp = [r["loss"] for r in records(tmp_path / "ddp", "train")]
    assert len(ddp) == 3 and ddp == pytest.approx(single[:3], rel=1e-5)  # same global batch, same losses
    assert loader.read(tmp_path / "ddp")["meta"]["world_size"] == 2
    train_run("--resume", tmp_path / "ddp", "--max-iters", "6")  # the 2-process checkpoint, resumed in one process
    resumed = [r["loss"] for r in records(tmp_path / "ddp", "train")]
    assert resumed == pytest.approx(single, rel=1e-5)


@pytest.fixture(scope="session")
def reverse_pairs(tmp_path_factory):
    """A tiny translation task: lowercase words and their reverses, as a pairs dataset."""
    return reversed_words(tmp_path_factory.mktemp("pairs"), 1200)


@pytest.mark.precision
def test_seq2seq_trains_with_the_same_loop_and_resumes_exactly(reverse_pairs, tmp_path):
    s2s = [
        "--data",
        reverse_pairs,
        "--n-encoder-layer",
        "2",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "16",
        "--norm",
        "post",
        "--pos-encoding",
        "sinusoidal",
        "--label-smoothing",
        "0.1",
        "--max-tokens",
        "256",
        "--dropout",
        "0.1",
        "--grad-accum",
        "2",
        "--learning-rate",
        "3e-3",
        "--lr-decay-iters",
        "40",
        "--eval-interval",
        "20",
        "--log-interval",
        "1",
        "--eval-iters",
        "4",
        "--warmup-iters",
        "5",
    ]
    full = train_run(*s2s, "--out-dir", tmp_path / "full", "--max-iters", "40")
    train_run(*s2s, "--out-dir", tmp_path / "split", "--max-iters", "20")
    train_run("--resume", tmp_path / "split", "--max-iters", "40")
    losses = lambda out: [(r["step"], r["loss"]) for r in records(out, "train")]  # noqa: E731
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    first, last = records(tmp_path / "full", "eval")[0]["val_loss"], full["val_loss"]
    assert last < first < 3.0  # learning: from ln(64) = 4.2 (padded vocab) at init
    meta = loader.read(tmp_path / "full")["meta"]
    assert meta["seq2seq"]["eos"] == meta["seq2seq"]["bos"] and meta["model_config"]["n_encoder_layer"] == 2


def test_pad_to_trains_and_the_padded_length_must_fit_the_block(reverse_pairs, tmp_path):
    tiny = ["--data", reverse_pairs, "--n-encoder-layer", "1", "--n-layer", "1", "--n-head", "2", "--n-embd", "16"]
    tiny += ["--block-size", "16", "--max-tokens", "128", "--eval-iters", "1", "--log-interval", "1", "--no-plot"]
    out = train_run(*tiny, "--pad-to", "8", "--out-dir", tmp_path / "a", "--max-iters", "3")
    assert math.isfinite(out["val_loss"])
    with pytest.raises(ValueError, match=r"longest side \(9 tokens, 32 padded to a multiple of --pad-to 32\)"):
        train_run(*tiny, "--pad-to", "32", "--out-dir", tmp_path / "b", "--max-iters", "1")


def test_pairs_dataset_needs_an_encoder(reverse_pairs, tmp_path):
    with pytest.raises(ValueError, match="n_encoder_layer: a pairs dataset needs an encoder"):
        train_run("--data", reverse_pairs, "--out-dir", tmp_path / "o", "--n-layer", "1", "--block-size", "8")


def test_training_longer_says_what_the_lr_does():
    from gpt.train.config import TrainConfig
    from gpt.train.start import schedule_change

    saved = TrainConfig(max_iters=100).to_dict()
    tied = schedule_change(saved, TrainConfig(max_iters=300), step=100)
    assert "now ends at step 300; the LR at step 100 goes from 1.00e-04 to" in tied
    fixed = schedule_change(saved, TrainConfig(max_iters=300, lr_decay_iters=100), step=100)
    assert fixed.endswith(
        "steps 100..300 run at --min-lr 1.00e-04; pass --lr-decay-iters 300 to stretch the decay instead"
    )
    assert schedule_change(saved, TrainConfig(max_iters=100), step=50) is None
    assert schedule_change(saved, TrainConfig(max_iters=300, lr_schedule="constant"), step=100) is None


def test_evaluating_val_only(char_data, tmp_path):
    out = tmp_path / "run"
    summary = train_run(
        "--data", char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2", "--no-eval-train"
    )
    (evaluation,) = records(out, "eval")
    assert evaluation["train_loss"] is None and evaluation["val_loss"] == summary["val_loss"]
    assert "train_loss" not in summary


def test_tokens_seen_is_counted_at_saves_between_log_steps(char_data, tmp_path):
    out = tmp_path / "run"  # stops at its first evaluation, step 3; log lines only at step 1
    train_run(
        "--data",
        char_data,
        "--out-dir",
        out,
        *TINY,
        "--max-iters",
        "6",
        "--eval-interval",
        "3",
        "--log-interval",
        "100",
        "--target-val-loss",
        "100",
        "--no-plot",
    )
    per_step = 4 * 32  # batch x block, every target counts
    meta = loader.read(out / "last.pt")["meta"]
    assert (meta["step"], meta["tokens_seen"]) == (3, 3 * per_step)
    train_run(
        "--resume", out, "--max-iters", "5", "--eval-interval", "3", "--log-interval", "100", "--target-val-loss", "0"
    )
    assert loader.read(out / "last.pt")["meta"]["tokens_seen"] == 5 * per_step
    assert records(out, "train")[-1]["tokens"] == 5 * per_step


def test_a_diverged_run_names_best_pt_and_the_command_that_continues_from_it_exactly(char_data, tmp_path):
    import shlex
    import shutil

    out = tmp_path / "run"
    train_run("--data", char_data, "--out-dir", out, *TINY, "--max-iters", "4", "--eval-interval", "2")
    shutil.copytree(out, tmp_path / "twin")  # the same run, never diverged
    # a resume at an absurd LR saves a finite but diverged last.pt (step 5, val worse than best.pt's step 4)...
    train_run(
        "--resume",
        out,
        "--learning-rate",
        "1e6",
        "--lr-schedule",
        "constant",
        "--warmup-iters",
        "0",
        "--eval-interval",
        "1",
        "--max-iters",
        "5",
    )
    last, best = (loader.read_meta(out / name) for name in ("last.pt", "best.pt"))
    assert (last["step"], best["step"]) == (5, 4) and math.isfinite(last["val_loss"])
    assert last["val_loss"] > best["val_loss"]
    # ...and resuming that stops on non-finite values: the error says where the good state is, and how to go on
    with pytest.raises(TrainingError, match="non-finite") as e:
        train_run("--resume", out, "--max-iters", "8")
    message = str(e.value)
    assert "\n" not in message and "last.pt still holds step 5" in message
    assert (
        f"or go back to best.pt, an earlier and better state (step 4, val {best['val_loss']:.4f}; last.pt: step 5, "
        f"val {last['val_loss']:.4f}), and continue from it exactly with: gpt train --resume "
        f"{out / 'best.pt'} --max-iters 8"
    ) in message
    command = shlex.split(message.split("continue from it exactly with: ")[1])
    assert command[:2] == ["gpt", "train"]
    summary = train_run(*command[2:])
    assert summary["step"] == 8 and math.isfinite(summary["val_loss"])
    train_run("--resume", tmp_path / "twin", "--max-iters", "8")
    continued = [(r["step"], r["loss"], r["grad_norm"]) for r in records(out, "train")][-4:]
    twin = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "twin", "train")][-4:]
    assert [s for s, *_ in continued] == [5, 6, 7, 8] and continued == twin  # as if it had never diverged
    assert records(out, "eval")[-1]["val_loss"] == records(tmp_path / "twin", "eval")[-1]["val_loss"]


def test_with_a_time_limit_the_etas_count_to_the_limit_not_the_step_count(char_data, tmp_path, capsys):
    from gpt.train.preflight import eta_line

    limit = TimeLimit(minutes=20, t_start=0.0, eval_tokens=1)
    line = eta_line(0.012, 5, 99_994, limit, now=4.0)  # multi30k_cpu: 99,994 steps would take 20 minutes
    assert line == (
        "preflight: measured 12 ms/step over 5 steps: the run stops at the 20-minute limit (--max-minutes) "
        "in about 19m56s, after about 99,666 of the 99,994 steps left to --max-iters"
    )
    line = eta_line(1.0, 5, 99_994, limit, now=4.0)  # (it said "the remaining 99,994 steps take about 27h46m")
    assert "stops at the 20-minute limit (--max-minutes) in about 19m56s, after about 1,196 of the 99,994" in line
    assert eta_line(1.0, 5, 60, limit, now=4.0).endswith("the remaining 60 steps take about 1m00s")  # steps first
    assert eta_line(1.0, 5, 60) == eta_line(1.0, 5, 60, TimeLimit(0, 0.0, 1), now=4.0)

    train_run(
        "--data",
        char_data,
        "--out-dir",
        tmp_path / "run",
        *TINY,
        "--max-iters",
        "100000",
        "--eval-interval",
        "100000",
        "--max-minutes",
        "0.3",
    )
    out = capsys.readouterr().out
    assert re.search(
        r"^preflight: measured \d+ ms/step over 5 steps: the run stops at the 0.3-minute limit "
        r"\(--max-minutes\) in about \d+s, after about [\d,]+ of the 99,99\d steps left",
        out,
        re.M,
    ), out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert all(re.search(r"\| eta \d+s at the 0.3-minute limit \(~[\d,]+ steps\)", line) for line in steps), steps

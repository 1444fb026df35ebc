"""Run health and preflight: spike / explosion warnings, the update-to-weight ratio, the preflight
report, and `--batch-size auto` (its search on CPU with the probe injected; for real on CUDA)."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import BASE_CFG, ROOT, TRAIN, one_line_error, train_run, train_script

from gpt.errors import ConfigError
from gpt.model import lora
from gpt.model.transformer import GPT, GPTConfig
from gpt.train import preflight
from gpt.train.flags import build_config
from gpt.train.health import HealthMonitor


def base_config():
    return BASE_CFG.to_dict()


pytestmark = pytest.mark.usefixtures("one_thread")


def noisy(n, centre=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [centre + 0.05 * float(x) for x in torch.randn(n, generator=g)]


def test_a_loss_spike_warns_once_per_episode():
    health = HealthMonitor()
    losses = noisy(30) + [4.5, 4.6] + noisy(10, seed=1) + [4.4]
    warned = {step: w for step, loss in enumerate(losses, 1) for w in health.check(step, loss, 1.0)}
    assert list(warned) == [31, 43]  # the second spiking step is the same episode
    assert warned[31].startswith("loss spike at step 31: 4.5000, recent median 2.99")


def test_a_falling_or_noisy_loss_never_warns():
    health = HealthMonitor()
    falling = [4.0 - 0.02 * i + 0.1 * (i % 2) for i in range(150)]  # fast drift plus zig-zag noise
    assert not [w for i, loss in enumerate(falling) for w in health.check(i, loss, 1.0 + 0.3 * (i % 3))]


def test_a_gradient_norm_explosion_warns_before_it_is_nan():
    health = HealthMonitor()
    norms = [1.0 + 0.1 * (i % 3) for i in range(20)] + [2.0, 15.0, 80.0, float("nan")]
    warned = [(i, w) for i, g in enumerate(norms) for w in health.check(i, 3.0, g)]
    assert [i for i, _ in warned] == [21]
    assert "gradient norm exploding at step 21: 15, 14x the recent median" in warned[0][1]


def test_update_ratio_is_the_step_size_relative_to_the_weights():
    p = torch.nn.Parameter(torch.full((4,), 2.0))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(4)
    health = HealthMonitor()
    with health.measure_update(opt, enabled=False):
        opt.step()
    assert health.update_ratio is None
    with health.measure_update(opt):
        opt.step()
    assert health.update_ratio == pytest.approx(0.1 / 1.9)  # each weight moved by 0.1, from 1.9


def test_the_trainer_warns_on_a_spike_and_logs_the_update_ratio(base, tiny_char_data, tmp_path, monkeypatch, capsys):
    real, calls = GPT.loss, {"n": 0}

    def spiking(self, logits, targets):
        calls["n"] += 1
        loss = real(self, logits, targets)
        return loss * 3 if calls["n"] == 14 else loss  # the 14th training step's loss, three times too high

    monkeypatch.setattr(GPT, "loss", spiking)
    out = tmp_path / "run"
    train_run(
        "--data",
        tiny_char_data,
        "--out-dir",
        out,
        "--init-from",
        base,
        *TRAIN,
        "--max-iters",
        "16",
        "--eval-interval",
        "100",
        "--eval-iters",
        "1",
        "--log-interval",
        "4",
    )
    printed = capsys.readouterr().out
    assert "warning: loss spike at step 14: " in printed
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "health"] == [14]
    ratios = {r["step"]: r["update_ratio"] for r in records if r["kind"] == "train"}
    assert list(ratios) == [1, 4, 8, 12, 16] and all(0 < v < 1 for v in ratios.values())
    lines = [line for line in printed.splitlines() if line.startswith("preflight:")]
    n = GPT(GPTConfig(**{**base_config(), "block_size": 16})).num_params(non_embedding=False)
    assert lines[0] == f"preflight: {n:,} parameters, {n:,} trained (100.00%)"
    assert lines[1] == "preflight: 32 tokens per step (2 x 16 x 1 micro-batches); 16 steps = 512 tokens"
    assert lines[2].startswith("preflight: estimated memory per process weights ")
    assert lines[3].startswith("preflight: measured ") and "over 5 steps: the remaining 10 steps take about" in lines[3]

    # the same spike inside a 20-step warmup (whose first steps swing widely in healthy runs) is not judged
    calls["n"] = 0
    train_run(
        "--data",
        tiny_char_data,
        "--out-dir",
        tmp_path / "warm",
        "--init-from",
        base,
        *TRAIN,
        "--max-iters",
        "16",
        "--eval-interval",
        "100",
        "--eval-iters",
        "1",
        "--warmup-iters",
        "20",
        "--no-plot",
    )
    assert "warning:" not in capsys.readouterr().out


# ---- preflight: the memory estimate and --batch-size auto -------------------------------------------


def test_memory_estimate_counts_what_trains():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg)
    full = preflight.memory_estimate(model, 4, 16, autocast=False)
    n = model.num_params(non_embedding=False)
    assert full["weights"] == full["gradients"] == 4 * n and full["optimizer"] == 8 * n
    assert preflight.memory_estimate(model, 8, 16, autocast=False)["activations"] == 2 * full["activations"]
    assert preflight.memory_estimate(model, 4, 16, autocast=True)["activations"] < full["activations"]
    matrices = sum(p.numel() for n, p in model.named_parameters() if ".h." in n and p.dim() == 2)
    assert preflight.memory_estimate(model, 4, 16, False, "muon")["optimizer"] == 8 * n - 4 * matrices  # one buffer
    lora.apply(model, lora.LoRAConfig(2))
    adapted = preflight.memory_estimate(model, 4, 16, autocast=False)
    trained = lora.trainable_params(model)
    assert adapted["gradients"] == 4 * trained and adapted["optimizer"] == 8 * trained
    assert adapted["weights"] == 4 * (n + trained)


def test_preflight_counts_a_seq2seq_step_in_tokens_of_pairs():
    rt = SimpleNamespace(world_size=2, dtype=torch.float32, device=torch.device("cpu"))
    cfg = SimpleNamespace(
        batch_size=4, model=SimpleNamespace(block_size=16), max_tokens=48, max_iters=10, optimizer="adamw", tp=1, pp=1
    )
    lm = preflight.report(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)), cfg, rt, 3)
    assert lm[1] == "preflight: 384 tokens per step (4 x 16 x 3 micro-batches x 2 processes); 10 steps = 3,840 tokens"
    tp_pp = SimpleNamespace(**{**vars(cfg), "tp": 2, "pp": 2})  # 8 processes: 2 replicas of 4 (the trainer's data view)
    assert preflight.report(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)), tp_pp, rt, 3)[
        1
    ] == ("preflight: 384 tokens per step (4 x 16 x 3 micro-batches x 2 data replicas); 10 steps = 3,840 tokens")
    seq2seq = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, n_encoder_layer=1))
    lines = preflight.report(seq2seq, cfg, rt, 3)  # batches are --max-tokens of pairs, not batch x block
    assert lines[1] == (
        "preflight: up to 288 tokens per step (<= 48 tokens of pairs x 3 micro-batches x 2 processes); "
        "10 steps = 2,880 tokens"
    )
    cfg.max_tokens = 0  # 0: batch_size * block_size tokens
    assert preflight.report(seq2seq, cfg, rt, 1)[1].startswith("preflight: up to 128 tokens per step (<= 64 tokens")


def test_the_memory_estimate_of_pairs_is_that_of_max_tokens_and_on_cpu_adds_the_process():
    """A batch of pairs holds up to --max-tokens a side, whatever --batch-size says (Multi30k's estimate was
    0.31 GiB against a 1.6 GiB peak RSS when it counted batch_size x block_size tokens); on a CPU the estimate
    is comparable with the RSS: it adds what the process held before (torch's libraries, the data)."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, n_encoder_layer=1))
    cpu = SimpleNamespace(world_size=1, dtype=torch.float32, device=torch.device("cpu"))

    def estimated(max_tokens, rt=cpu):
        cfg = SimpleNamespace(
            batch_size=4,
            model=SimpleNamespace(block_size=16),
            max_tokens=max_tokens,
            max_iters=1,
            optimizer="adamw",
            tp=1,
            pp=1,
        )
        line = preflight.report(model, cfg, rt, 1)[2]
        return dict(re.findall(r"(\w+) ([\d.]+ [MG]iB)", line.split("process ", 1)[1]))

    one = preflight.memory_estimate(model, 1, 1, autocast=False)["activations"]
    assert estimated(1000)["activations"] == preflight.gib(1000 * one)  # not 4 x 16 tokens
    assert estimated(2000)["activations"] == preflight.gib(2000 * one)
    runtime = float(estimated(1000)["runtime"].split()[0]) * (2**30 if "GiB" in estimated(1000)["runtime"] else 2**20)
    assert 0.5 < runtime / preflight.resident_bytes() < 1.5  # torch is loaded here (the line rounds to 10 MiB)
    gpu = SimpleNamespace(world_size=1, dtype=torch.float32, device=torch.device("cuda"))
    assert "runtime" not in estimated(1000, gpu)  # GPU memory: the process's host memory is no part of it


def test_find_batch_size_is_the_largest_that_fits():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 37

    assert preflight.find_batch_size(fits, 512) == 37
    assert tried[:7] == [1, 2, 4, 8, 16, 32, 64] and len(tried) <= 13
    assert preflight.find_batch_size(lambda b: True, 24) == 24  # never past the global batch
    assert preflight.find_batch_size(lambda b: False, 24) == 0


@pytest.mark.parametrize(
    "global_batch, largest, world, expected",
    [
        (512, 45, 1, (32, 16)),  # 512 = 32 x 16 exactly
        (512, 1000, 1, (512, 1)),
        (13, 5, 1, (5, 3)),  # 13 is prime: 5 x 3 = 15 beats 1 x 13
        (96, 40, 2, (24, 4)),  # 2 processes x 24 x 2 micro-steps
    ],
)
def test_plan_batch_keeps_the_global_batch(global_batch, largest, world, expected):
    assert preflight.plan_batch(global_batch, largest, world) == expected


def test_batch_size_auto_keeps_the_global_batch_of_the_config():
    assert build_config(["--config", "gpt2_124m", "--batch-size", "auto"]).global_batch == 32 * 16
    cfg = build_config(["--batch-size", "auto", "--global-batch", "64"])
    assert (cfg.batch_size, cfg.global_batch) == (0, 64)
    with pytest.raises(ConfigError, match="--batch-size: must be >= 1 or auto, got 0"):
        build_config(["--batch-size", "0"])


def test_batch_size_auto_with_the_probe_injected(monkeypatch):
    monkeypatch.setattr(preflight, "_fits", lambda model, b, seq, held, rt: b <= 20)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: None)
    cfg = build_config(["--batch-size", "auto", "--global-batch", "64", "--block-size", "16"])
    said = []
    rt = SimpleNamespace(device=torch.device("cuda"), world_size=1, ddp=False)
    chosen = preflight.auto_batch_size(
        GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)), cfg, rt, said.append
    )
    assert chosen == (16, 4)
    assert said == [
        "batch size auto: micro-batches of up to 20 fit in 90% of cuda's memory; --batch-size 16 "
        "--grad-accum 4 = 64 sequences per step"
    ]


def test_batch_size_auto_on_a_cpu_is_one_line(base, tiny_char_data, tmp_path, capsys):
    err = one_line_error(
        capsys,
        train_script.main,
        "--data",
        tiny_char_data,
        "--out-dir",
        tmp_path / "x",
        "--init-from",
        base,
        "--batch-size",
        "auto",
        "--device",
        "cpu",
    )
    assert "--batch-size auto: measures GPU memory, CUDA only (this run is on cpu)" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: --batch-size auto probes GPU memory")
def test_batch_size_auto_on_cuda(tiny_char_data, tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--data",
            str(tiny_char_data),
            "--out-dir",
            str(tmp_path / "auto"),
            "--n-layer",
            "2",
            "--n-head",
            "2",
            "--n-embd",
            "64",
            "--block-size",
            "16",
            "--batch-size",
            "auto",
            "--global-batch",
            "4096",
            "--max-iters",
            "2",
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
            "--device",
            "cuda",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "batch size auto: micro-batches of up to " in res.stdout
    saved = json.loads((tmp_path / "auto" / "config.json").read_text())["train"]
    assert saved["batch_size"] * saved["grad_accum"] >= 4096 and saved["batch_size"] > 1


def test_a_cpu_run_is_held_under_the_estimate_plus_the_allocators_slack():
    """The resident limit (gpt.runtime.FreeMemoryCap's) is the estimate plus half the activations, at least
    preflight.MIN_SLACK: a step's activations are what the allocator frees and needs again."""
    big = {"weights": 1 << 20, "gradients": 1 << 20, "optimizer": 2 << 20, "activations": 1 << 30, "runtime": 3 << 20}
    assert preflight.resident_limit(big) == (sum(big.values()) + (512 << 20), 512 << 20)
    small = {**big, "activations": 1 << 20}
    assert preflight.resident_limit(small) == (sum(small.values()) + preflight.MIN_SLACK, preflight.MIN_SLACK)

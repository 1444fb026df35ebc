"""`gpt plan --depth N | --params P` (gpt/train/sizing.py): nanochat's sizing rules, the command
it prints is one train.py takes, and mistakes are one line."""

import shlex
from dataclasses import replace

import pytest
from conftest import one_line_error

from gpt.cli import plan as cli_plan
from gpt.train import sizing
from gpt.train.flags import build_config


@pytest.mark.parametrize(
    "depth, aspect, head_dim, width, heads",
    [(2, 64, 64, 128, 2), (4, 64, 64, 256, 4), (3, 64, 128, 256, 2), (20, 64, 128, 1280, 10), (5, 48, 64, 256, 4)],
)
def test_width_and_heads_follow_the_depth(depth, aspect, head_dim, width, heads):
    assert sizing.width_for(depth, aspect, head_dim) == (width, heads)  # 3 x 64 = 192 rounds up to 2 heads of 128


def test_block_size_and_params_rules():
    assert [sizing.block_for(c) for c in (32, 128, 192, 256, 1280, 4096)] == [64, 128, 256, 256, 1024, 1024]
    assert sizing.parse_count("10M") == 10_000_000 and sizing.parse_count("1.5b") == 1_500_000_000
    counts = {d: sizing.count_params(sizing.model_for(d, 128)) for d in (3, 4, 5)}
    assert sizing.depth_for_params(counts[4], 128) == 4
    assert sizing.depth_for_params(int(counts[4] * 1.05), 128) == 4


def test_batch_and_learning_rates_scale_as_nanochat(tmp_path):
    ref = sizing.reference()
    small = sizing.propose(sizing.model_for(2, 128), "d", 10**6, 1, 10_000.0)
    wide = sizing.propose(sizing.model_for(8, 128), "d", 10**6, 60, 10_000.0)
    # 60x the tokens: a batch 60^0.383 ~ 4.8x larger (a power of two), LRs by its square root, AdamW's by width too
    s, w = small.config, wide.config
    tokens = lambda c: c.batch_size * c.grad_accum * c.model.block_size  # noqa: E731
    assert tokens(w) / tokens(s) in (4, 8)
    assert w.muon_lr / s.muon_lr == pytest.approx((tokens(w) / tokens(s)) ** 0.5, rel=0.01)
    width = (w.model.n_embd / s.model.n_embd) ** -0.5
    assert w.learning_rate / s.learning_rate == pytest.approx(width * (tokens(w) / tokens(s)) ** 0.5, rel=0.01)
    assert w.max_iters * tokens(w) <= 10_000 * 60 * 60 * 0.9 < (w.max_iters + 1) * tokens(w)
    assert s.optimizer == ref.optimizer == "muon" and w.max_minutes == 0  # the steps are the budget


def test_the_printed_command_is_what_train_py_runs(capsys, char_data):
    argv = ["--depth", "2", "--data", char_data, "--minutes", "2", "--out-dir", "out/x y", "--tokens-per-second"]
    assert cli_plan.main([str(a) for a in argv] + ["20000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("width: n_embd 128 for depth 2") and out[2].startswith("throughput: 20,000 ")
    assert out[-1].startswith("gpt train ")
    cfg = build_config(shlex.split(out[-1])[2:])
    proposal = sizing.size(str(char_data), 2, depth=2, tokens_per_second=20000, out_dir="out/x y")
    assert cfg == proposal.config and cfg.out_dir == "out/x y" and cfg.data == str(char_data)
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size) == (2, 128, 2, 128)


def test_the_throughput_is_measured(char_data):
    cfg = sizing.reference()
    cfg = replace(cfg, model=replace(cfg.model, n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    assert 0 < sizing.measure_throughput(cfg, 2, "cpu", steps=1) < 1e9


def test_it_measures_again_at_the_micro_batch_it_chose(char_data, monkeypatch):
    seen = []
    monkeypatch.setattr(sizing, "measure_throughput", lambda cfg, micro, device: seen.append(micro) or 500.0)
    p = sizing.size(str(char_data), 1, params="400k")
    assert seen == [32, p.config.batch_size] and p.config.batch_size < 32  # 4096 tokens / block 128, then its own
    assert p.reasons[0] == "depth: 2, the depth whose model is nearest 400k parameters"
    assert p.reasons[3].endswith(f"(micro-batches of {p.config.batch_size})")


def test_short_runs_keep_the_reference_weight_decay_and_evaluations_fit_the_overhead():
    ref = sizing.reference()
    short = sizing.propose(sizing.model_for(2, 128), "d", 10**6, 1, 1000.0).config
    assert short.weight_decay == ref.weight_decay  # T_epoch alone would ask for ~6x
    long = sizing.propose(sizing.model_for(2, 128), "d", 10**6, 600, 50_000.0).config
    assert long.weight_decay < ref.weight_decay and long.eval_iters == 20
    for c in (short, long):  # 4 evaluations, the last at the end; both splits, a third of a step per batch
        assert -(-c.max_iters // c.eval_interval) == sizing.EVALS
        assert sizing.EVALS * 2 * c.eval_iters / 3 <= 0.11 * c.max_iters * c.grad_accum or c.eval_iters == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--depth", "0", "--minutes", "1"], "--depth: must be in [1, 64], got 0"),
        (["--depth", "2", "--params", "1M", "--minutes", "1"], "give one of --depth N or --params P"),
        (["--depth", "2"], "--minutes: must be > 0, got 0"),
        (["--params", "lots", "--minutes", "1"], "--params: expected a positive count such as 10M"),
        (["--params", "10", "--minutes", "1"], "--params: 10 is less than half of the smallest model"),
        (["--depth", "2", "--minutes", "0.0001", "--tokens-per-second", "10"], "--minutes: 0.0001 minutes at 10"),
        (["--depth", "2", "--minutes", "1", "--gpus", "8"], "--gpus: for the memory plan, not with --depth"),
        (["--depth", "2", "--minutes", "1", "--reserve", "0.2"], "--reserve: for the memory plan, not with"),
        (["--minutes", "1", "--head-dim", "32"], "--minutes, --head-dim: for sizing a run: give --depth N or"),
    ],
)
def test_mistakes_are_one_line(capsys, char_data, argv, message):
    data = ["--data", str(char_data)] if "--depth" in argv or "--params" in argv else []
    assert message in one_line_error(capsys, cli_plan.main, *argv, *data)


def test_a_missing_dataset_is_one_line(capsys, tmp_path):
    err = one_line_error(capsys, cli_plan.main, "--depth", "2", "--minutes", "1", "--data", tmp_path / "none")
    assert "no dataset directory" in err

"""Pipeline parallelism (gpt/train/pipeline.py): the stages together are the model, each holding its share;
--pp 2 under torchrun (CPU, gloo) equals one process with each schedule; its checkpoints resume in one
process and sample as the one-process run's do; bad layouts are one line."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY as TRAIN_TINY
from conftest import torchrun
from test_parallel import losses, runtime

from gpt.checkpoints import loader, native
from gpt.cli import dcp as cli_dcp
from gpt.cli import plan as cli_plan
from gpt.cli import sample
from gpt.errors import ConfigError
from gpt.model.transformer import GPT, GPTConfig
from gpt.train import parallel, pipeline, plan
from gpt.train.flags import build_config
from gpt.train.start import resolve_run
from gpt.train.trainer import train

TINY = [*TRAIN_TINY, "--threads", "1", "--n-layer", "4"]  # one thread per process; 4 layers: 2 stages of 2, or 4 of 1


def test_split_gives_each_stage_its_run_of_layers():
    assert pipeline.split(4, 2) == [range(0, 2), range(2, 4)]
    assert pipeline.split(5, 2) == [range(0, 3), range(3, 5)]
    assert pipeline.split(4, 4) == [range(i, i + 1) for i in range(4)]


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("pos", ["learned", "rope", "sinusoidal"])
def test_stages_in_order_are_the_model_and_keep_its_names(pos, untied):
    """Stage by stage, the forward is the whole model's (bit for bit); every parameter is held under its own
    name; each process of a 2-stage pipeline holds its layers only: about half the blocks (asserted by count)."""
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=4, n_head=2, n_embd=32, pos_encoding=pos, untied_head=untied)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    runs = pipeline.split(cfg.n_layer, 4)
    stages = [pipeline.Stage(model, runs[s], s == 0, s == 3) for s in range(4)]
    x = torch.randint(0, 50, (2, 16))
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(x)[0])

    whole = dict(model.named_parameters())
    held = {n: p for stage in stages for n, p in stage.named_parameters()}
    assert held.keys() == whole.keys() and all(held[n] is whole[n] for n in whole)

    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    emb = sum(p.numel() for n, p in whole.items() if n.startswith(("transformer.wte", "transformer.wpe")))
    head = model.lm_head.weight.numel() if untied else model.transformer.wte.weight.numel()  # the last's own or copy
    norm = sum(p.numel() for p in model.transformer.ln_f.parameters())
    first, last = (pipeline.Stage(model, r, i == 0, i == 1) for i, r in enumerate(pipeline.split(4, 2)))
    assert sum(p.numel() for p in first.parameters()) == emb + 2 * block
    assert sum(p.numel() for p in last.parameters()) == 2 * block + norm + head
    for stage in (first, last):  # Muon's matrices: the stage's blocks' Linear weights (never the head)
        muon = stage.param_groups(0.1, muon=True)[0]
        assert muon["muon"] and len(muon["params"]) == 2 * sum(
            isinstance(m, torch.nn.Linear) for m in model.transformer.h[0].modules()
        )
    assert [n for n, _ in last.named_parameters()][:1] == (
        ["transformer.h.2.ln_1.weight"] if untied else ["transformer.wte.weight"]
    )


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (["--pp", "8"], 8, "--pp 8: 8 stages need at least as many layers, the model has 4"),
        (
            ["--pp", "4", "--pp-schedule", "interleaved"],
            4,
            "--pp 4: 8 stages (4 processes x 2, interleaved) need at least as many layers, the model has 4",
        ),
        (["--pp", "2", "--lora-rank", "4", "--init-from", "base"], 2, "--pp: not with --lora-rank in this version"),
        (["--pp", "2", "--compile"], 2, "--pp: not with --compile in this version"),
        (["--pp", "2", "--x0-skip"], 2, "--pp: not with --x0-skip in this version"),
        (
            ["--pp", "2", "--grad-accum", "2"],
            4,
            "--grad-accum 2: a pipeline of 2 stages needs at least 2 micro-batches per data replica: pass "
            "--grad-accum 4 or more",
        ),
        (
            ["--pp", "2"],
            3,
            "--tp 1 x --pp 2 = 2 does not divide the 3 processes torchrun started: launch a multiple of 2 "
            "(torchrun --nproc-per-node N)",
        ),
    ],
)
def test_bad_layouts_are_one_line(argv, world, message):
    cfg = build_config(["--n-layer", "4", "--grad-accum", "8", *argv])
    with pytest.raises(ConfigError) as e:
        parallel.check(cfg, runtime(world_size=world))  # the layout, then what a pipeline takes (as the trainer asks)
        pipeline.check(cfg, runtime(world_size=world))
    assert str(e.value) == message


def test_pp_without_torchrun_stops_before_training(char_data, tmp_path, capsys):
    import train as train_script

    assert train_script.main(["--data", str(char_data), "--out-dir", str(tmp_path / "o"), *TINY, "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --tp / --pp split the model over the processes torchrun starts") and err.count("\n") == 1
    )
    assert not (tmp_path / "o").exists()


def common(char_data):
    return [
        *TINY,
        "--data",
        char_data,
        "--grad-accum",
        "8",
        "--lr-decay-iters",
        "12",
        "--eval-interval",
        "3",
        "--dtype",
        "float32",
    ]


@pytest.fixture(scope="module")
def one(char_data, tmp_path_factory):
    """The one-process run: 3 steps (its checkpoint kept apart), then resumed to 6."""
    out = tmp_path_factory.mktemp("pp") / "one"
    train(resolve_run([*map(str, common(char_data)), "--max-iters", "3", "--out-dir", str(out)]))
    shutil.copytree(out, out.with_name("one-at-3"))
    train(resolve_run(["--resume", str(out), "--max-iters", "6"]))
    return out


def weights(path) -> dict:
    return loader.read(path, names=native.LATEST)["model"]


def draw(capsys, ckpt) -> str:
    assert sample.main(["--ckpt", str(ckpt), "--prompt", "KING", "--max-new-tokens", "40", "--seed", "3"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "schedule,processes,fsdp,tp",
    [
        pytest.param("1f1b", 4, True, 1, marks=pytest.mark.slow),  # 4 processes: out of the default run's time
        pytest.param("gpipe", 4, False, 1, marks=pytest.mark.slow),
        pytest.param("1f1b", 4, False, 2, marks=pytest.mark.slow),
        ("interleaved", 2, False, 1),
    ],
)
def test_two_stages_match_one_process(schedule, processes, fsdp, tp, one, char_data, tmp_path, capsys):
    """--pp 2 against one process with the same --grad-accum 8: on 2 processes (interleaved: 4 stages, process
    0 holding layers 0 and 2), or 4: 2 stages x 2 data replicas of 4 micro-batches each, gradients averaged
    over the replicas (gpipe) or each stage FSDP-sharded over them (1f1b, --fsdp), or 2 stages x 2 tensor
    shards (1f1b, --tp 2: each stage split as tests/test_tensor_parallel.py splits a whole model).

    - The losses and gradient norms of the first 3 steps equal the one-process run's to rel 1e-5 (float32;
      on this CPU the losses are bit for bit, the norms to their last bits: the squares are summed per stage),
      and so do the weights after them, to 1e-6 (4e-6 under --tp); process 0 holds its share of them.
    - The sharded checkpoint resumes in one process and continues the one-process run's losses (rel 1e-5).
    - Converted to one file, it samples the same text as the one-process run's checkpoint of that step."""
    run = tmp_path / "pp"
    argv = [*common(char_data), "--max-iters", "3", "--out-dir", run, "--pp", "2", "--pp-schedule", schedule]
    argv += (["--fsdp"] if fsdp else []) + ["--tp", tp]
    res = torchrun(processes, *argv)
    held, total = map(int, re.search(r"process 0 holds (\d+) of (\d+)", res.stdout.replace(",", "")).groups())
    assert held < {1: 0.55, 2: 0.3}[tp] * total  # its stage (half the layers, the embeddings), split tp ways
    assert sorted(p.name for p in (run / "last.dcp").iterdir()) == [
        ".metadata",
        *(f"__{rank}_0.distcp" for rank in range(processes)),
        "meta.json",
        "train.pt",
    ]  # each process wrote its stages' shards (a replica's copies are written once: DCP keeps one of equal keys)
    ref = one.with_name("one-at-3")
    for key in ("loss", "grad_norm"):
        assert [x for _, x in losses(run, key)] == pytest.approx([x for _, x in losses(one, key)][:3], rel=1e-5)
    mine, theirs = weights(run), weights(ref)
    assert mine.keys() == theirs.keys()
    atol = 1e-6 if tp == 1 else 4e-6  # --tp: split products sum in another order, which AdamW's first steps
    assert [k for k in mine if not torch.allclose(mine[k], theirs[k], rtol=0, atol=atol)] == []  # magnify (1.1e-6)

    converted = tmp_path / "converted"
    shutil.copytree(run, converted, symlinks=True)
    cli_dcp.convert(converted)
    capsys.readouterr()
    assert draw(capsys, converted / "last.pt") == draw(capsys, ref / "last.pt")

    if schedule != "gpipe":  # (the resume reads the whole model's names, whatever the layout)
        train(resolve_run(["--resume", str(run), "--max-iters", "6", "--pp", "1", "--tp", "1", "--no-fsdp"]))
        assert [s for s, _ in losses(run)] == list(range(1, 7))
        assert [x for _, x in losses(run)] == pytest.approx([x for _, x in losses(one)], rel=1e-5)


def test_sigterm_saves_every_stage_and_the_run_resumes(char_data, tmp_path):
    """SIGTERM to torchrun (what a scheduler sends) reaches both stages: they stop at the same step, save
    together (one checkpoint, a shard each), and one process resumes it."""
    run = tmp_path / "pp"
    argv = [*common(char_data), "--max-iters", "100000", "--eval-interval", "100000", "--out-dir", run, "--pp", "2"]
    argv += ["--grad-accum", "2"]  # (the later flag wins: quicker steps)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
        + [str(a) for a in argv],
        cwd=Path(__file__).resolve().parents[1],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60
    while not (run / "log.jsonl").exists() or len(losses(run)) < 3:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    step = loader.read_meta(run / "last.dcp")["step"]
    assert f"stopped by SIGTERM at step {step}" in out and step >= 3
    assert sorted(p.name for p in (run / "last.dcp").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    train(resolve_run(["--resume", str(run), "--max-iters", str(step + 1), "--pp", "1"]))
    assert loader.read_meta(run, names=native.LATEST)["step"] == step + 1


def test_plan_counts_each_stage_and_the_bubble(capsys):
    """`gpt plan --pp`: one process is the plan's DDP figure term by term; the stages' weights add up to the
    model's plus the head's copy; 1F1B keeps fewer micro-batches than GPipe; the bubble as the docs say."""
    cfg = build_config(["--config", "gpt2_124m"])
    shape = plan.Shape.of(replace(cfg.model, vocab_size=50304), 4, cfg.model.block_size)
    for ac in (False, True):
        (one_process,) = plan.stage_memory(shape, 1, 8, "1f1b", checkpointed=ac)
        assert one_process == plan.memory(shape, 1, fsdp=False, checkpointed=ac)
    for schedule in pipeline.SCHEDULES:
        stages = plan.stage_memory(shape, 4, 8, schedule)
        assert sum(m.weights for m in stages) == 6 * (shape.params + shape.vocab_size * shape.n_embd)
    gpipe, one_f = (plan.stage_memory(shape, 4, 8, s)[0].activations for s in ("gpipe", "1f1b"))
    assert one_f == pytest.approx(gpipe / 2, rel=0.01)  # 4 micro-batches in flight instead of 8 (the ids aside)
    assert pipeline.bubble(2, 8, "1f1b") == pytest.approx(1 / 9)
    assert pipeline.bubble(2, 8, "interleaved") == pytest.approx(1 / 17)
    assert cli_plan.main(["--config", "gpt2_124m", "--gpus", "8", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline --pp 4 --pp-schedule 1f1b: 4 stages x 2 data replica(s)" in out and "| 3 |" in out
    assert cli_plan.main(["--config", "gpt2_124m", "--pp", "2"]) == 2  # three GPU counts: which one?
    assert capsys.readouterr().err == "error: --pp: for one config and one --gpus count, with N >= 1\n"

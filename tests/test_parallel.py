"""Beyond one process (gpt/train/parallel.py, gpt/checkpoints/dcp.py): activation checkpointing changes nothing but memory;
FSDP under torchrun (CPU, gloo) equals one process; its sharded checkpoints resume in another number of
processes, with or without --fsdp, losing nothing; misuse is one line."""

import json
import os
import shutil

import pytest
import torch
from conftest import TINY as TRAIN_TINY
from conftest import torchrun

from gpt.checkpoints import loader, native
from gpt.cli import dcp as cli_dcp
from gpt.errors import ConfigError
from gpt.model.transformer import GPT, GPTConfig
from gpt.runtime import Runtime
from gpt.train import parallel
from gpt.train.config import TrainConfig
from gpt.train.start import resolve_run
from gpt.train.trainer import train

TINY = [*TRAIN_TINY, "--threads", "1"]  # one thread per process


def losses(out_dir, key="loss"):
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [(r["step"], r[key]) for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.parametrize("encoder", [0, 2])
def test_activation_checkpointing_gives_identical_loss_and_gradients(encoder):
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.2, n_encoder_layer=encoder)
    x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    extra = (torch.randint(0, 50, (4, 12)), torch.ones(4, 12, dtype=torch.bool)) if encoder else ()
    runs = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg).train()
        if recompute:
            parallel.checkpoint_activations(model)
        saved = []  # what autograd keeps for the backward pass
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):  # noqa: B023
            with Runtime(torch.device("cpu"), torch.float32).autocast():  # the trainer's kernel choice
                loss = model(x, y, *extra)[1]
        loss.backward()  # outside that context, as in the trainer
        runs.append((loss, {n: p.grad for n, p in model.named_parameters()}, sum(saved)))
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in GPT(cfg).named_parameters()]
    (loss, grads, kept), (loss_ac, grads_ac, kept_ac) = runs
    assert torch.equal(loss, loss_ac)  # dropout masks are replayed exactly
    assert all(torch.equal(grads[n], grads_ac[n]) for n in grads)
    assert kept_ac < kept / 2  # the point of it


def runtime(**kw) -> Runtime:
    return Runtime(**{"device": torch.device("cpu"), "dtype": torch.float32, "ddp": True, "world_size": 2, **kw})


@pytest.mark.parametrize(
    "rt,message",
    [
        (
            runtime(ddp=False, world_size=1),
            "--fsdp shards the model over the processes torchrun starts: launch with "
            "`torchrun --nproc-per-node N -m gpt train ... --fsdp` (N = 1 for a single process), "
            "or pass --no-fsdp",
        ),
        (
            runtime(dtype=torch.float16),
            "--fsdp with float16: loss scaling is not supported with sharded gradients; use "
            "--dtype bfloat16 (or train without --fsdp)",
        ),
        (runtime(device=torch.device("mps")), "--fsdp runs on CUDA (nccl) or CPU (gloo), not mps"),
    ],
)
def test_fsdp_misuse_is_one_line(rt, message):
    with pytest.raises(ConfigError) as e:
        parallel.check(TrainConfig(fsdp=True), rt)
    assert str(e.value) == message
    parallel.check(TrainConfig(fsdp=False), rt)  # without --fsdp each of these runs


def test_fsdp_without_torchrun_stops_before_training(char_data, tmp_path, capsys):
    import train as train_script

    assert train_script.main(["--data", str(char_data), "--out-dir", str(tmp_path / "o"), *TINY, "--fsdp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --fsdp shards the model over the processes torchrun starts") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_mixed_precision_policy_matches_the_dtype():
    assert parallel.mixed_precision(torch.bfloat16).param_dtype == torch.bfloat16
    assert parallel.mixed_precision(torch.bfloat16).reduce_dtype == torch.float32
    assert parallel.mixed_precision(torch.float32).param_dtype is None  # float32 throughout


def state(path) -> dict:
    """A checkpoint's model and AdamW state as one flat dict of tensors (sharded ones read whole)."""
    ckpt = loader.read(path, names=native.LATEST)
    flat = {f"model.{k}": v for k, v in ckpt["model"].items()}
    flat.update({f"optimizer.{i}.{k}": v for i, s in ckpt["optimizer"]["state"].items() for k, v in s.items()})
    return flat


def twin(run, dst):
    """A copy of `run` whose latest checkpoint is the single file its last.dcp converts to."""
    shutil.copytree(run, dst, symlinks=True)
    cli_dcp.convert(dst)  # last.dcp and best.dcp as last.pt and best.pt (a run's own files: no --out)
    (dst / "last.dcp").unlink()
    (dst / "best.dcp").unlink()
    return dst


def assert_same_state(a, b):
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys() and [k for k in sa if not torch.equal(sa[k], sb[k])] == []


def test_fsdp_matches_one_process_and_resumes_in_any_number_of_processes(char_data, tmp_path):
    """FSDP + activation checkpointing in 2 processes, its sharded checkpoints resumed 2 -> 1 -> 2
    processes under FSDP, then in one plain process (reading the shards whole).

    Pinned to float32 (bf16 autocast rounds differently when the process count changes: on a CPU
    with native bf16 the 2 -> 1 resume was not bit for bit).
    - Every loss and gradient norm equals one uninterrupted process to rel 1e-5 (float32): the same
      global batch, but the gradients are summed over processes in another order, so not bit for bit.
    - Each change of process count continues bit for bit (model, AdamW moments, losses) as the same
      processes do from the same state written as one file: resharding loses nothing. No clipping:
      the clipped norm would be summed in another order over the shards."""
    common = [
        *TINY,
        "--data",
        char_data,
        "--grad-accum",
        "4",
        "--lr-decay-iters",
        "12",
        "--eval-interval",
        "3",
        "--grad-clip",
        "0",
        "--dtype",
        "float32",
    ]
    run = tmp_path / "fsdp"
    torchrun(2, *common, "--max-iters", "3", "--out-dir", run, "--fsdp", "--activation-checkpointing")
    assert os.readlink(run / "last.dcp") == "step-000003" and sorted(p.name for p in (run / "last.dcp").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.json",
        "train.pt",
    ]  # a shard per process

    ref = twin(run, tmp_path / "ref-2to1")
    torchrun(1, "--resume", run, "--max-iters", "6")  # 2 -> 1 (still --fsdp: the run's own config)
    train(resolve_run(["--resume", str(ref), "--max-iters", "6", "--no-fsdp"]))  # one process, one file
    assert losses(run)[3:] == losses(ref)[3:] and len(losses(run)) == 6
    assert_same_state(run, ref)

    ref = twin(run, tmp_path / "ref-1to2")
    torchrun(2, "--resume", run, "--max-iters", "9")  # 1 -> 2
    torchrun(2, "--resume", ref, "--max-iters", "9")  # 2 FSDP processes, each keeping its part of the file
    assert losses(run)[6:] == losses(ref)[6:] and len(losses(run)) == 9
    assert_same_state(run, ref)

    train(resolve_run(["--resume", str(run), "--max-iters", "12", "--no-fsdp"]))  # the shards read whole
    assert loader.resolve(run, native.LATEST).name == "last.pt"
    assert loader.read_meta(run / "last.dcp")["world_size"] == 2
    train(resolve_run([*map(str, common), "--max-iters", "12", "--out-dir", str(tmp_path / "one")]))
    assert [s for s, _ in losses(run)] == list(range(1, 13))
    for key in ("loss", "grad_norm"):
        assert [x for _, x in losses(run, key)] == pytest.approx(
            [x for _, x in losses(tmp_path / "one", key)], rel=1e-5
        )

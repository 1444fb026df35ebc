"""Tensor parallelism (gpt/train/tensor_parallel.py, --tp): under torchrun (CPU, gloo) a split model trains as one
process does, its DCP checkpoints resume in other layouts and convert for sampling; bad layouts are one line."""

import json
import re

import pytest
import torch
from conftest import TINY as TRAIN_TINY
from conftest import reversed_words, torchrun

from gpt.checkpoints import loader, native
from gpt.cli import dcp as cli_dcp
from gpt.cli import sample
from gpt.errors import ConfigError
from gpt.model.transformer import GPTConfig
from gpt.runtime import Runtime
from gpt.train import parallel, tensor_parallel
from gpt.train.config import TrainConfig
from gpt.train.start import resolve_run
from gpt.train.trainer import train

# 4 heads (so --tp 4 splits them too), float32, no clipping (a clipped norm sums in another order)
TINY = [*TRAIN_TINY, "--threads", "1", "--n-head", "4", "--dtype", "float32", "--grad-clip", "0"]
PROMPT = ["--prompt", "ROMEO:", "--no-stop-at-eot"]  # 40 characters whatever the untrained model draws
RTOL = 1e-5  # float32: the split matrix products and all-reduces sum in another order than one process
ATOL = 1e-6  # parameters and AdamW moments after a few steps (measured: 1e-7 and 4e-9)


def losses(out_dir) -> list[float]:
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def state(path) -> dict:
    """A checkpoint's model and AdamW state as one flat dict of tensors (a DCP checkpoint read whole)."""
    ckpt = loader.read(path, names=native.LATEST)
    flat = {f"model.{k}": v for k, v in ckpt["model"].items()}
    flat.update({f"optimizer.{i}.{k}": v for i, s in ckpt["optimizer"]["state"].items() for k, v in s.items()})
    return flat


def meta(run):
    return loader.read_meta(run, names=native.LATEST)


def assert_close_state(a, b):
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    worst = max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)
    assert worst <= ATOL, worst


def one_process(args, out):
    train(resolve_run([*map(str, args), "--out-dir", str(out)]))


def test_fused_order_gives_each_process_its_heads_q_k_and_v():
    C, tp = 8, 2  # 4 heads of 2: q rows 0-7, k rows 8-15, v rows 16-23
    grouped = torch.arange(3 * C)[tensor_parallel.fused_order(3 * C, tp)]
    first, second = grouped.chunk(tp)
    assert first.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]  # heads 0-1: q, k, v
    assert second.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]  # heads 2-3
    assert torch.equal(
        tensor_parallel._ungrouped(tensor_parallel._grouped(torch.arange(24.0), tp), tp), torch.arange(24.0)
    )


def runtime(world_size=2, **kw) -> Runtime:
    return Runtime(
        **{"device": torch.device("cpu"), "dtype": torch.float32, "ddp": True, "world_size": world_size, **kw}
    )


MODEL = dict(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.parametrize(
    "tp,model,rt,extra,message",
    [
        (3, {}, runtime(3), {}, "--tp 3: must divide the model's 4 attention heads (--n-head)"),
        (
            2,
            {},
            runtime(3),
            {},
            "--tp 2 x --pp 1 = 2 does not divide the 3 processes torchrun started: launch a multiple of 2 "
            "(torchrun --nproc-per-node N)",
        ),
        (
            2,
            {},
            runtime(1, ddp=False),
            {},
            "--tp / --pp split the model over the processes torchrun starts: launch with `torchrun "
            "--nproc-per-node N -m gpt train ...` (N a multiple of tp x pp)",
        ),
        (
            2,
            {"value_embeds": True},
            runtime(),
            {},
            "--tp 2: value_embeds is not split in this version; train without it or without --tp",
        ),
        (
            2,
            {},
            runtime(dtype=torch.float16),
            {},
            "--tp 2 with float16 (loss scaling's overflow check would differ between shards): use --dtype bfloat16",
        ),
        (
            2,
            {},
            runtime(),
            {"compile": True},
            "--tp 2 with --compile: not tried with split layers yet; pass --no-compile",
        ),
        (
            2,
            {},
            runtime(),
            {"optimizer": "muon"},
            "--tp 2 with --optimizer muon: its orthogonalisation needs whole matrices; use adamw",
        ),
    ],
)
def test_bad_layouts_are_one_line(tp, model, rt, extra, message):
    cfg = TrainConfig(model=GPTConfig(**{**MODEL, **model}), tp=tp, **extra)
    with pytest.raises(ConfigError) as e:
        parallel.check(cfg, rt)
    assert str(e.value) == message


def test_tp_without_torchrun_stops_before_training(char_data, tmp_path, capsys):
    import train as train_script

    assert train_script.main(["--data", str(char_data), "--out-dir", str(tmp_path / "o"), *TINY, "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --tp / --pp split the model over the processes torchrun starts") and err.count("\n") == 1
    )
    assert not (tmp_path / "o").exists()  # refused before anything was written


SPLIT = (
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
)


def rank0_share(name: str, shape: torch.Size, tp: int) -> int:
    """The elements of the one-process tensor `name` that process 0 of a tp group holds, as the layout says:
    1/tp of each split matrix (column- or row-wise), the first ceil(rows/tp) vocabulary rows of the embedding
    (the tied head is the same tensor), every other tensor whole."""
    if name == "lm_head.weight":
        return 0
    if name.endswith(SPLIT):
        return shape.numel() // tp
    if name == "transformer.wte.weight":
        return -(-shape[0] // tp) * shape[1]
    return shape.numel()


def held_line(res) -> tuple[int, int]:
    held, total = re.search(r"process 0 holds ([\d,]+) of ([\d,]+) parameters", res.stdout).groups()
    return int(held.replace(",", "")), int(total.replace(",", ""))


def test_tp2_matches_one_process_resumes_in_one_and_samples_the_same(char_data, tmp_path, capsys):
    """tp=2 (rotary positions, qk_norm, logit_softcap, x0_skip): the losses of 3 steps equal one process's (rel 1e-5), so do weights and AdamW moments (1e-6); rank 0
    holds its share of the split matrices (its heads, half the MLP, the first half of the vocabulary) and the whole
    of the rest; resumed in one process it continues that process's curve; converted, it samples the same text."""
    common = [*TINY, "--data", char_data, "--grad-accum", "2", "--lr-decay-iters", "12", "--eval-interval", "3"]
    common += [
        "--pos-encoding",
        "rope",
        "--qk-norm",
        "--logit-softcap",
        "15",
        "--x0-skip",
    ]  # the split loss, softcapped
    run, ref = tmp_path / "tp2", tmp_path / "one"
    res = torchrun(2, *common, "--max-iters", "3", "--out-dir", run, "--tp", "2")
    one_process([*common, "--max-iters", "3"], ref)
    assert losses(run) == pytest.approx(losses(ref), rel=RTOL) and len(losses(run)) == 3
    assert_close_state(run, ref)
    assert (run / "last.dcp").is_symlink() and not (run / "last.pt").exists()
    assert meta(run)["tokens_seen"] == meta(ref)["tokens_seen"] > 0  # a tp group's batch counted once

    expected = sum(rank0_share(name, t.shape, 2) for name, t in loader.read(ref / "last.pt")["model"].items())
    held, total = held_line(res)
    assert held == expected and held < 0.55 * total

    converted = tmp_path / "tp2.pt"
    assert cli_dcp.main(["convert", "--ckpt", str(run / "last.dcp"), "--out", str(converted)]) == 0
    texts = []
    for ckpt in (converted, ref / "last.pt"):
        capsys.readouterr()
        assert (
            sample.main(["--ckpt", str(ckpt), "--seed", "0", "--max-new-tokens", "40", "--threads", "1", *PROMPT]) == 0
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 40

    train(resolve_run(["--resume", str(run), "--max-iters", "6", "--tp", "1"]))  # the shards read whole
    train(resolve_run(["--resume", str(ref), "--max-iters", "6"]))
    assert losses(run)[3:] == pytest.approx(losses(ref)[3:], rel=RTOL) and len(losses(run)) == 6
    assert_close_state(run, ref)


@pytest.mark.slow  # 4 processes: out of the default run's time (README, "Tests")
def test_dp2_x_tp2_with_fsdp_matches_one_process_and_resumes_at_tp4(char_data, tmp_path):
    """4 processes, 2 data-parallel replicas (FSDP2 on the dp sub-mesh) x 2 tensor shards: the losses, weights
    and moments of 3 steps equal one process's; rank 0 holds less than under tp=2 alone; the checkpoint resumes
    at tp=4 (one replica, the heads split 4 ways) and continues the one-process curve."""
    common = [*TINY, "--data", char_data, "--grad-accum", "2", "--lr-decay-iters", "12", "--eval-interval", "3"]
    run, ref = tmp_path / "fsdp-tp2", tmp_path / "one"
    res = torchrun(4, *common, "--max-iters", "3", "--out-dir", run, "--tp", "2", "--fsdp")
    one_process([*common, "--max-iters", "3"], ref)
    assert losses(run) == pytest.approx(losses(ref), rel=RTOL) and len(losses(run)) == 3
    assert_close_state(run, ref)
    assert meta(run)["tokens_seen"] == meta(ref)["tokens_seen"] > 0
    held, total = held_line(res)
    assert held < 0.3 * total  # a quarter of the split matrices and half of the rest, roughly

    torchrun(4, "--resume", run, "--max-iters", "6", "--tp", "4", "--no-fsdp")
    train(resolve_run(["--resume", str(ref), "--max-iters", "6"]))
    assert losses(run)[3:] == pytest.approx(losses(ref)[3:], rel=RTOL) and len(losses(run)) == 6
    assert_close_state(run, ref)


def test_tp2_runs_the_other_options_as_one_process(char_data, tmp_path):
    """The positional encoding and recipe options the tests above leave out, the gathered-logits loss (label
    smoothing) and clipping under --tp 2: the first steps' losses equal one process's. (Rotary positions,
    qk_norm, logit_softcap and x0_skip: the tp=2 test; learned positions: the dp=2 x tp=2 one.)"""
    options = [
        *("--pos-encoding", "sinusoidal", "--activation", "relu2", "--norm", "post", "--untied-head"),
        *("--zero-init-proj", "--label-smoothing", "0.1", "--bias", "--activation-checkpointing", "--grad-clip", "1"),
    ]
    common = [*TINY, "--data", char_data, "--grad-accum", "2", "--max-iters", "2", "--no-plot", *options]
    torchrun(2, *common, "--out-dir", tmp_path / "tp2", "--tp", "2")
    one_process(common, tmp_path / "one")
    assert losses(tmp_path / "tp2") == pytest.approx(losses(tmp_path / "one"), rel=RTOL)
    assert len(losses(tmp_path / "tp2")) == 2


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory):
    """A tiny translation task (words and their reverses) as a pairs dataset, as tests/test_train.py's."""
    return reversed_words(tmp_path_factory.mktemp("pairs"), 300)


SEQ2SEQ = [
    *("--n-encoder-layer", "2", "--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "16"),
    *("--max-tokens", "128", "--threads", "1", "--dtype", "float32", "--grad-clip", "0", "--no-plot"),
    *("--warmup-iters", "2", "--lr-decay-iters", "12", "--eval-interval", "3"),
    *("--eval-iters", "2", "--log-interval", "1", "--grad-accum", "2"),
]


@pytest.mark.parametrize(
    "options",
    [
        ["--bias", "--qk-norm"],  # learned positions, pre-norm; the biases and normed keys of cross-attention
        ["--norm", "post", "--pos-encoding", "sinusoidal", "--label-smoothing", "0.1"],  # the paper's Transformer
    ],
)
def test_tp2_seq2seq_matches_one_process_and_resumes_in_one(pairs_data, tmp_path, options):
    """The encoder-decoder model at tp=2 (encoder blocks split as the decoder's, cross-attention by heads): the
    losses of 3 steps equal one process's (rel 1e-5), so do weights and AdamW moments (1e-6), whose names and
    order are a one-process run's (the fused cross-attention q|k|v too); resumed in one process it continues
    that process's curve."""
    common = [*SEQ2SEQ, "--data", pairs_data, *options]
    run, ref = tmp_path / "tp2", tmp_path / "one"
    res = torchrun(2, *common, "--max-iters", "3", "--out-dir", run, "--tp", "2")
    one_process([*common, "--max-iters", "3"], ref)
    assert losses(run) == pytest.approx(losses(ref), rel=RTOL) and len(losses(run)) == 3
    assert_close_state(run, ref)
    assert meta(run)["tokens_seen"] == meta(ref)["tokens_seen"] > 0
    held, total = held_line(res)
    assert held < 0.6 * total  # the encoder's and cross-attention's matrices are split too

    train(resolve_run(["--resume", str(run), "--max-iters", "6", "--tp", "1"]))
    train(resolve_run(["--resume", str(ref), "--max-iters", "6"]))
    assert losses(run)[3:] == pytest.approx(losses(ref)[3:], rel=RTOL) and len(losses(run)) == 6
    assert_close_state(run, ref)


@pytest.mark.parametrize(
    "data,options",
    [
        ("char", ["--pos-encoding", "rope", "--qk-norm", "--x0-skip", "--logit-softcap", "15", "--bias"]),
        # (the other recipe options: out of the default run's time, `-m slow`)
        pytest.param(
            "char",
            ["--norm", "post", "--pos-encoding", "sinusoidal", "--label-smoothing", "0.1", "--untied-head"],
            marks=pytest.mark.slow,
        ),
        pytest.param("char", ["--activation-checkpointing", "--grad-clip", "1"], marks=pytest.mark.slow),  # learned
        ("pairs", ["--norm", "post", "--pos-encoding", "sinusoidal", "--bias"]),  # seq2seq
    ],
)
def test_sequence_parallel_matches_tp_alone(char_data, pairs_data, tmp_path, data, options):
    """--sequence-parallel (norms, dropout and the residual stream on sequence shards) at tp=2: the losses of 3
    steps, the weights and the AdamW moments equal the tp=2 run without it (rel 1e-5, 1e-6); both resumed in
    one process (--tp 1, which drops the saved --sequence-parallel) continue alike."""
    common = [*TINY, "--data", char_data] if data == "char" else [*SEQ2SEQ, "--data", pairs_data]
    common += [*options, "--max-iters", "3", "--grad-accum", "2", "--no-plot", "--tp", "2"]
    sp, tp = tmp_path / "sp", tmp_path / "tp"
    res = torchrun(2, *common, "--out-dir", sp, "--sequence-parallel")
    assert "sequence parallel" in res.stdout
    torchrun(2, *common, "--out-dir", tp)
    assert losses(sp) == pytest.approx(losses(tp), rel=RTOL) and len(losses(sp)) == 3
    assert_close_state(sp, tp)
    for run in (sp, tp):
        train(resolve_run(["--resume", str(run), "--max-iters", "5", "--tp", "1"]))
    assert losses(sp)[3:] == pytest.approx(losses(tp)[3:], rel=RTOL) and len(losses(sp)) == 5


def test_sequence_parallel_needs_tp():
    line = "--sequence-parallel: shards what --tp splits; add --tp N (N > 1) or drop it"
    with pytest.raises(ConfigError) as e:
        TrainConfig(sequence_parallel=True)
    assert str(e.value) == line
    assert TrainConfig(sequence_parallel=True, tp=2).problems() == []

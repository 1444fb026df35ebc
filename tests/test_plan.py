"""gpt.train.plan: the activation formula against what autograd saves, the memory terms, the table."""

from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt.cli import plan as cli_plan
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT
from gpt.train import parallel, plan
from gpt.train.flags import build_config

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def saved_bytes(model: GPT, batch: int, seq: int) -> int:
    """Bytes of the tensors autograd keeps for the backward (each storage once), in bf16 autocast with the
    flash kernel, as training on a GPU runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, model.config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model(x, x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize(
    "shape",
    [dict(n_layer=2, n_head=4, n_embd=64, vocab_size=512), dict(n_layer=3, n_head=6, n_embd=96, vocab_size=256)],
)
def test_saved_activations_per_token_are_what_autograd_keeps(shape, checkpointed):
    cfg = GPTConfig(block_size=32, **shape)
    torch.manual_seed(0)
    model = GPT(cfg)
    if checkpointed:
        parallel.checkpoint_activations(model)
    # two batch sizes: what grows with the tokens (the weights' bf16 copies do not)
    measured = (saved_bytes(model, 4, 32) - saved_bytes(model, 2, 32)) / (2 * 32)
    s = plan.Shape.of(cfg, batch=1, seq=1)
    assert measured == plan.saved_activations(s, checkpointed)


def test_shape_counts_the_parameters_of_the_real_model():
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    s = plan.Shape.of(cfg, batch=1, seq=1024)
    one_layer = GPT(GPTConfig(**{**cfg.to_dict(), "n_layer": 1}))
    assert s.params == 124_475_904 == one_layer.num_params(non_embedding=False) + 11 * s.block_params
    assert s.flops_per_token == 6 * s.params - 6 * 1024 * 768 + 12 * 12 * 1024 * 768  # 6N (no wpe) + attention


def test_fsdp_divides_the_training_state_and_checkpointing_the_activations():
    cfg = build_config(["--config", "gpt2_1558m"])
    one, eight = (plan.plan(cfg, 50304, n, 80, 0.1)["rows"] for n in (1, 8))
    state = lambda m: m.weights + m.gradients + m.optimizer  # noqa: E731
    assert state(eight["FSDP"]) < 0.25 * state(eight["DDP"])
    assert state(one["DDP"]) == 18 * plan.Shape.of(replace(cfg.model, vocab_size=50304), 16, 1024).params
    assert eight["FSDP + AC"].activations == eight["DDP + AC"].activations < 0.5 * eight["DDP"].activations


def test_the_table_says_what_to_use(capsys):
    assert cli_plan.main(["--config", "gpt2_1558m", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "1,558M parameters, 10.28 GFLOPs per token" in out and out.rstrip().endswith("use: --fsdp")
    assert "global batch: --grad-accum 32 (524,288 tokens per step" in out
    assert "| DDP | " in out and "| no |" in out
    assert cli_plan.main([]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| gpt2_")]
    assert len(rows) == 12 and [r.split(" | ")[4] for r in rows[:3]] == ["1", "8", "64"]
    assert [r.split(" | ")[5] for r in rows[:3]] == ["0.5M", "0.5M", "2.0M"]  # 64 GPUs: grad_accum 16 -> 64
    assert rows[0].endswith("| (no flag) |") and rows[-1].endswith("| --fsdp |")  # 124M on 1 GPU, 1.5B on 64


def test_mistakes_are_one_line(capsys):
    assert cli_plan.main(["--gpus", "0"]) == 2
    assert capsys.readouterr().err == "error: --gpus: must be >= 1, got 0\n"
    assert cli_plan.main(["--config", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --config: no file 'nope' and no shipped config of that name")


def test_one_gpu_layout_is_the_formula_autograd_checks():
    s = plan.Shape.of(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=512, block_size=32), 2, 32)
    logits_grad = 4 * 2 * 32 * 512
    m = plan.layout_memory(s, pp=1, dp=1, tp=1, fsdp=False, checkpointed=False, micro_batches=4)
    assert m.activations == plan.saved_activations(s, False) + logits_grad
    assert m.weights + m.gradients + m.optimizer == 18 * s.params


def test_tensor_and_pipeline_parallelism_divide_what_they_split():
    s = plan.Shape.of(replace(build_config(["--config", "gpt2_350m"]).model, vocab_size=50304), 8, 1024)
    state = lambda m: m.weights + m.gradients + m.optimizer  # noqa: E731
    one = plan.layout_memory(s, 1, 1, 1, False, False, 8)
    tp2, pp2 = plan.layout_memory(s, 1, 1, 2, False, False, 8), plan.layout_memory(s, 2, 1, 1, False, False, 8)
    assert 0.45 * state(one) < state(tp2) < 0.55 * state(one)  # every matrix and the vocabulary halved
    assert state(pp2) < 0.6 * state(one)  # half the blocks, the embeddings on a stage
    assert one.activations > tp2.activations > 0.5 * one.activations  # the residual stream stays whole
    gpipe = plan.layout_memory(s, 2, 1, 1, False, False, 8, "gpipe")
    assert gpipe.activations > 3 * pp2.activations  # GPipe keeps all 8 micro-batches, 1F1B two


def test_layouts_that_fit_split_only_what_divides(capsys):
    cfg = build_config(["--config", "gpt2_774m"])  # 20 heads, 36 layers
    found = plan.layouts(cfg, 50304, 8, 24, 0.1)
    assert found and all(20 % x.tp == 0 and x.pp * x.dp * x.tp == 8 for x in found)
    assert all(x.memory.total <= 24e9 * 0.9 for x in found)
    assert found[0].flags() == "--tp 4"  # nothing fits with data parallelism alone but checkpointing
    assert not any(x.tp > 1 for x in plan.layouts(build_config(["--config", "gpt2_1558m"]), 50304, 8, 80, 0.1))
    assert cli_plan.main(["--config", "gpt2_774m", "--gpus", "8", "--gpu-memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "| 1 x 2 x 4 | no | no |" in out and out.rstrip().endswith("use: --tp 4")
    assert "data parallel alone: --fsdp --activation-checkpointing" in out

"""LoRA (gpt/model/lora.py): frozen base, trained adapters, small checkpoints that name their base, merging,
exact resume, and validation in one line."""

import collections
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import BASE_CFG, TRAIN, one_line_error, sample_script, train_run, train_script

from gpt.checkpoints import loader
from gpt.cli import lora as cli_lora
from gpt.errors import ConfigError
from gpt.model import lora
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT
from gpt.runtime import Runtime
from gpt.train.config import TrainConfig
from gpt.train.step import make_optimizer, train_step

pytestmark = pytest.mark.usefixtures("one_thread")

ALL_TARGETS = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "wte"]


def adapted(rank=4, targets=ALL_TARGETS, seed=0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(BASE_CFG)
    lora.apply(model, lora.LoRAConfig(rank, alpha=8.0, targets=targets))
    return model


def test_only_adapters_train_and_the_base_stays_bitwise_equal():
    model = adapted()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(weight_decay=0.5, learning_rate=1e-2)  # decay would move any frozen weight it reached
    opt = make_optimizer(model, cfg.optimizer_config(), torch.device("cpu"))
    optimized = {id(p) for g in opt.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in optimized}
    assert names and all(n.endswith(("lora_A", "lora_B")) for n in names)
    assert len(names) == 2 * (4 * BASE_CFG.n_layer + 1)  # A and B on four layers per block, and the tied head
    x = torch.randint(0, 64, (3, 16))
    rt = Runtime(torch.device("cpu"), torch.float32)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in range(3):
        train_step(model, opt, scaler, lambda s, m: (x, x), step, 1, rt, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = model.state_dict()
    for key, value in before.items():
        if key.endswith(("lora_A", "lora_B")):
            assert not torch.equal(after[key], value), f"{key} did not train"
        else:
            assert torch.equal(after[key], value), f"{key} changed"


def test_adapters_start_as_the_base_and_merged_logits_equal_adapter_logits():
    torch.manual_seed(0)
    plain = GPT(BASE_CFG).eval()
    model = GPT(BASE_CFG).eval()
    model.load_state_dict(plain.state_dict())
    lora.apply(model, lora.LoRAConfig(4, alpha=8.0, targets=ALL_TARGETS))
    x = torch.randint(0, 64, (2, 16))
    assert torch.equal(model(x)[0], plain(x)[0])  # B starts at zero: exactly the base model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.5)
    adapter_logits = model(x)[0]
    assert (adapter_logits - plain(x)[0]).abs().max() > 0.1  # the adapters do change the function
    lora.merge(model)
    assert not lora.is_adapted(model) and set(model.state_dict()) == set(plain.state_dict())
    assert type(model.transformer.wte) is torch.nn.Embedding and type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied: the update went in once
    torch.testing.assert_close(model(x)[0], adapter_logits, rtol=1e-5, atol=1e-5)


def test_lora_run_checkpoint_holds_only_adapters_and_loads_everywhere(base, tiny_char_data, tmp_path, capsys):
    out = tmp_path / "lora"
    train_run(
        "--data",
        tiny_char_data,
        "--out-dir",
        out,
        "--init-from",
        base,
        "--lora-rank",
        "2",
        "--lora-targets",
        "attn.c_attn,mlp.c_fc",
        *TRAIN,
        "--max-iters",
        "4",
        "--eval-interval",
        "4",
    )
    assert "lora: rank 2, alpha 16 on attn.c_attn, mlp.c_fc" in capsys.readouterr().out
    raw = loader.read(out / "last.pt")
    assert sorted(raw["model"]) == sorted(
        f"transformer.h.{i}.{t}.lora_{m}" for i in range(2) for t in ("attn.c_attn", "mlp.c_fc") for m in "AB"
    )
    info = raw["meta"]["lora"]
    assert info["base"] == str((base / "best.pt").resolve()) and info["rank"] == 2
    assert info["trainable"] == 2 * (2 * (16 + 48) + 2 * (16 + 64))
    assert sum(t.numel() for t in raw["model"].values()) == info["trainable"] < GPT(BASE_CFG).num_params() / 3

    model, meta = loader.load_adapted(out)  # separate adapters
    merged, tok, _ = loader.load_checkpoint(out)  # what sample.py, the HF export and --init-from get
    assert not lora.is_adapted(merged) and lora.is_adapted(model)
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(merged(x)[0], model(x)[0], rtol=1e-5, atol=1e-5)

    assert (
        sample_script.main(
            ["--ckpt", str(out), "--prompt", "ROMEO", "--max-new-tokens", "5", "--seed", "1", "--device", "cpu"]
        )
        == 0
    )
    assert cli_lora.main(["merge", "--ckpt", str(out), "--out", str(tmp_path / "merged.pt")]) == 0
    plain, _ = loader.load_model(tmp_path / "merged.pt")
    assert "lora" not in loader.read_meta(tmp_path / "merged.pt")
    torch.testing.assert_close(plain(x)[0], model(x)[0], rtol=1e-5, atol=1e-5)

    from gpt.checkpoints.hf import export_hf, read_weights

    export_hf(merged, tok, tmp_path / "hf")
    assert torch.equal(
        read_weights(tmp_path / "hf")["transformer.h.0.attn.c_attn.weight"], merged.transformer.h[0].attn.c_attn.weight
    )


@pytest.mark.precision
def test_exact_resume_of_a_lora_run(base, tiny_char_data, tmp_path):
    common = [
        "--data",
        tiny_char_data,
        "--init-from",
        base,
        "--lora-rank",
        "4",
        "--lora-dropout",
        "0.1",
        *TRAIN,
        "--grad-accum",
        "2",
        "--lr-decay-iters",
        "8",
        "--eval-interval",
        "4",
    ]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "8")
    train_run(*common, "--out-dir", tmp_path / "split", "--max-iters", "4")
    train_run("--resume", tmp_path / "split", "--max-iters", "8")

    def losses(out):
        return [
            (r["step"], r["loss"], r["grad_norm"])
            for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
            if r["kind"] == "train"
        ]

    assert [s for s, *_ in losses(tmp_path / "split")] == list(range(1, 9))
    assert losses(tmp_path / "split") == losses(tmp_path / "full")  # bit for bit


def test_a_resume_reads_each_checkpoints_meta_once(base, tiny_char_data, tmp_path, monkeypatch):
    """The command line is resolved once (gpt/train/start.py `resolve_run`): the resumed run's last.pt and its
    LoRA base are each located with their meta read once, and the trainer reads neither meta again."""
    common = ["--data", tiny_char_data, "--init-from", base, "--lora-rank", "2", *TRAIN, "--eval-interval", "2"]
    train_run(*common, "--out-dir", tmp_path / "run", "--max-iters", "2")
    reads, load_file = collections.Counter(), loader.load_file

    def counted(path, *args, mmap=False, **kwargs):  # the meta alone is read memory-mapped
        reads[Path(path).resolve()] += mmap
        return load_file(path, *args, mmap=mmap, **kwargs)

    monkeypatch.setattr(loader, "load_file", counted)
    assert train_run("--resume", tmp_path / "run", "--max-iters", "3")["step"] == 3
    assert reads == {(tmp_path / "run" / "last.pt").resolve(): 1, (base / "best.pt").resolve(): 1}


def test_resume_keeps_the_adapters_shape_and_the_base(base, tiny_char_data, tmp_path, capsys):
    out = tmp_path / "lora"
    train_run(
        "--data",
        tiny_char_data,
        "--out-dir",
        out,
        "--init-from",
        base,
        "--lora-rank",
        "2",
        *TRAIN,
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
    )
    err = one_line_error(capsys, train_script.main, "--resume", out, "--lora-rank", "4", "--max-iters", "3")
    assert "a LoRA run keeps its adapters' shape: --lora-rank 4 (the run has 2)" in err
    err = one_line_error(capsys, train_script.main, "--resume", out, "--lora-rank", "0", "--max-iters", "3")
    assert "is a LoRA run (rank 2)" in err

    # the base moves on (a best.pt replaced): the adapters no longer belong to it
    state = torch.load(base / "best.pt", weights_only=True)
    state["model"]["transformer.h.0.mlp.c_fc.weight"] += 1
    torch.save(state, base / "best.pt")
    err = one_line_error(capsys, train_script.main, "--resume", out, "--max-iters", "3")
    assert "has changed since the run started" in err
    err = one_line_error(capsys, sample_script.main, "--ckpt", out, "--device", "cpu")
    assert "has changed since the adapters were trained on it" in err


def test_base_moved_with_the_run_still_loads_and_a_missing_base_names_the_fix(base, tiny_char_data, tmp_path, capsys):
    out = tmp_path / "lora"
    train_run(
        "--data",
        tiny_char_data,
        "--out-dir",
        out,
        "--init-from",
        base,
        "--lora-rank",
        "2",
        *TRAIN,
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
    )
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(str(out), moved / "lora")
    shutil.move(str(base), moved / "base")  # same relative layout: found through base_relative
    loader.load_checkpoint(moved / "lora")
    shutil.move(str(moved / "base"), tmp_path / "gone")
    err = one_line_error(capsys, sample_script.main, "--ckpt", moved / "lora", "--device", "cpu")
    assert "whose base model" in err and "gpt lora merge --ckpt" in err and "--base PATH" in err
    assert (
        cli_lora.main(
            ["merge", "--ckpt", str(moved / "lora"), "--base", str(tmp_path / "gone"), "--out", str(tmp_path / "m")]
        )
        == 0
    )
    assert (tmp_path / "m" / "best.pt").is_file()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", "-1"], "error: --lora-rank: must be >= 0 (0 = full fine-tuning), got -1"),
        (["--lora-rank", "4", "--lora-targets", "attn.c_attn,attn.q"], "error: --lora-targets: 'attn.q' is not among "),
        (["--lora-rank", "4", "--lora-alpha", "0"], "error: --lora-alpha: must be > 0, got 0.0"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "error: --lora-dropout: must be in [0, 1), got 1.0"),
        (
            ["--lora-targets", "wte", "--lora-alpha", "8"],
            "error: --lora-alpha, --lora-targets: LoRA is off (--lora-rank 0 "
            "is full fine-tuning); give --lora-rank R to train adapters",
        ),
        (["--lora-rank", "4", "--fsdp"], "error: --lora-rank: not with --fsdp"),
        (
            ["--lora-rank", "17"],
            "error: --lora-rank: 17 exceeds the smallest adapted layer's 16 features; use at most 16",
        ),
    ],
)
def test_lora_settings_are_checked_in_one_line(base, tiny_char_data, tmp_path, capsys, flags, message):
    err = one_line_error(
        capsys,
        train_script.main,
        "--data",
        tiny_char_data,
        "--out-dir",
        tmp_path / "x",
        "--init-from",
        base,
        *flags,
        "--device",
        "cpu",
    )
    assert err.startswith(message), err


def test_lora_needs_a_pretrained_model(tiny_char_data, tmp_path, capsys):
    err = one_line_error(
        capsys, train_script.main, "--data", tiny_char_data, "--out-dir", tmp_path / "x", "--lora-rank", "8"
    )
    assert "--lora-rank: LoRA adapts a pretrained model: give --init-from RUN_OR_CHECKPOINT" in err
    with pytest.raises(ConfigError, match="not seq2seq"):
        TrainConfig(init_from="x", lora_rank=8, model=GPTConfig(n_encoder_layer=2))


def test_a_full_fine_tune_resumes_with_its_checkpoints_architecture(base, tiny_char_data, tmp_path):
    # the base is 2 x 16 wide, not the flags' defaults (4 x 128): a resume takes the run's architecture
    common = ["--data", tiny_char_data, "--init-from", base, *TRAIN, "--lr-decay-iters", "4", "--eval-interval", "2"]
    train_run(*common, "--out-dir", tmp_path / "full", "--max-iters", "4")
    train_run(*common, "--out-dir", tmp_path / "split", "--max-iters", "2")
    summary = train_run("--resume", tmp_path / "split", "--max-iters", "4")
    assert summary["val_loss"] == json.loads((tmp_path / "full" / "log.jsonl").read_text().splitlines()[-1])["val_loss"]


def test_the_hf_export_of_a_lora_run_is_base_plus_adapters_in_transformers(base, tiny_char_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from gpt.cli import hf as cli_hf

    out = tmp_path / "lora"
    train_run(
        "--data",
        tiny_char_data,
        "--out-dir",
        out,
        "--init-from",
        base,
        "--lora-rank",
        "2",
        "--lora-targets",
        "attn.c_proj,wte",
        *TRAIN,
        "--max-iters",
        "3",
        "--eval-interval",
        "3",
    )
    assert cli_hf.main(["export", "--ckpt", str(out), "--out", str(tmp_path / "hf")]) == 0
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    adapters, _ = loader.load_adapted(out)  # kept separate: the exported weights must compute the same
    plain, _ = loader.load_model(base)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        expected = adapters(x)[0]
        assert (expected - plain(x)[0]).abs().max() > 1e-3  # the trained adapters (wte's included) matter
        torch.testing.assert_close(theirs(x).logits[..., : expected.shape[-1]], expected, rtol=1e-5, atol=1e-5)


def test_merge_never_replaces_the_adapters_or_their_base_and_an_existing_out_needs_force(
    base, tiny_char_data, tmp_path, capsys
):
    """`--out BASE_RUN` once replaced the base's best.pt: the base weights were lost and the adapters no longer
    loaded. The base and the adapters are never a target (not even with --force); any other existing file only
    with --force."""
    out = tmp_path / "lora"
    train_run("--data", tiny_char_data, "--out-dir", out, "--init-from", base, "--lora-rank", "2", *TRAIN,
              "--max-iters", "2", "--eval-interval", "2")  # fmt: skip
    base_bytes, adapter_bytes = (base / "best.pt").read_bytes(), (out / "best.pt").read_bytes()
    for target in (base, base / "best.pt", base / "last.pt", out, out / "best.pt"):
        for force in ([], ["--force"]):
            err = one_line_error(capsys, cli_lora.main, "merge", "--ckpt", out, "--out", target, *force)
            assert "which this command reads" in err and "--force does not change this" in err, err
    assert (base / "best.pt").read_bytes() == base_bytes and (out / "best.pt").read_bytes() == adapter_bytes
    assert not (base / "last.pt").exists()
    loader.load_checkpoint(out)  # the adapters still load on their base

    merged = tmp_path / "merged.pt"
    merged.write_bytes(b"someone's file")
    err = one_line_error(capsys, cli_lora.main, "merge", "--ckpt", out, "--out", merged)
    assert err == f"error: {merged} exists already: choose another --out, or --force to replace it\n"
    assert merged.read_bytes() == b"someone's file"
    assert cli_lora.main(["merge", "--ckpt", str(out), "--out", str(merged), "--force"]) == 0
    assert "lora" not in loader.read_meta(merged)


def test_no_export_replaces_the_base_of_the_adapters_it_exports(base, tiny_char_data, tmp_path, capsys):
    """The rule of `gpt lora merge` holds for every command that loads adapters: gpt hf export and gpt export
    never write over (or into) the base the adapters load, here a Hugging Face directory."""
    from gpt.cli import export as cli_export
    from gpt.cli import hf as cli_hf

    hf_base = tmp_path / "hf-base"
    assert cli_hf.main(["export", "--ckpt", str(base), "--out", str(hf_base)]) == 0
    out = tmp_path / "lora"
    train_run("--data", tiny_char_data, "--out-dir", out, "--init-from", hf_base, "--lora-rank", "2", *TRAIN,
              "--max-iters", "2", "--eval-interval", "2")  # fmt: skip
    weights = (hf_base / "model.safetensors").read_bytes()
    names = sorted(p.name for p in hf_base.iterdir())
    capsys.readouterr()
    for main, argv in [
        (cli_hf.main, ["export", "--ckpt", out, "--out", hf_base, "--force"]),
        (cli_export.main, ["--ckpt", out, "--format", "pt2", "--out", hf_base, "--force", "--no-check"]),
        (cli_lora.main, ["merge", "--ckpt", out, "--out", hf_base / "merged.pt", "--force"]),
    ]:
        err = one_line_error(capsys, main, *argv)
        assert f"would replace a file of {hf_base}, which this command reads" in err, err
    assert (hf_base / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in hf_base.iterdir()) == names
    loader.load_checkpoint(out)


def test_a_lora_checkpoint_whose_bases_form_a_cycle_is_one_line(base, tiny_char_data, tmp_path, capsys):
    """A checkpoint naming itself (or another that names it) as its base: one line naming the cycle, before
    the recursion reads the same file again and again."""
    out = tmp_path / "lora"
    train_run(
        "--data", tiny_char_data, "--out-dir", out, "--init-from", base, "--lora-rank", "2", *TRAIN, "--max-iters", "1"
    )
    raw = torch.load(out / "last.pt", weights_only=True)
    capsys.readouterr()

    def names_as_base(path, base_path):
        meta = json.loads(raw["meta"])
        meta["lora"]["base"] = str(base_path)
        torch.save(dict(raw, meta=json.dumps(meta)), path)

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    names_as_base(a, a)
    err = one_line_error(capsys, sample_script.main, "--ckpt", a, "--prompt", "RO", "--max-new-tokens", "2")
    assert err.startswith(f"error: {a}: its LoRA bases form a cycle ({a} -> {a}); adapters need a base that ")
    names_as_base(a, b)
    names_as_base(b, a)
    with pytest.raises(lora.LoRAError, match=rf"^{a}: its LoRA bases form a cycle \({a} -> {b} -> {a}\)"):
        loader.load_model(a)
    with pytest.raises(lora.LoRAError, match=rf"cycle \({b} -> {a} -> {b}\)"):  # `merge --base` too
        loader.load_adapted(b, base=a)

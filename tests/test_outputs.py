"""A run directory's own files are never an output (gpt/checkpoints/outputs.py): no command that writes a path the
user names replaces a run's .lock, checkpoints, log or config, with --force or without, whichever checkpoint it
reads; a new file in a run directory is still allowed."""

import pytest
import torch
from conftest import BASE_CFG, TRAIN, one_line_error, save_random_lm, train_run

from gpt.checkpoints import dcp, native
from gpt.cli import attention, evaluate, export, hf, lora, plot
from gpt.cli import dcp as cli_dcp
from gpt.data.tokens import open_dataset
from gpt.model.transformer import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tiny_char_data, tmp_path_factory):
    """A run directory train.py wrote (.lock, log.jsonl, config.json, last.pt, best.pt), with a tensorboard/."""
    out = tmp_path_factory.mktemp("victim") / "run"
    train_run("--data", tiny_char_data, "--out-dir", out, *TRAIN, "--max-iters", "2", "--eval-interval", "2")
    (out / "tensorboard").mkdir()
    return out


@pytest.fixture(scope="module")
def other(tiny_char_data, tmp_path_factory):
    """What the commands read: another checkpoint (a directory holding best.pt only), LoRA adapters on a base, a
    sharded checkpoint of a later step than the run's, a text."""
    d = tmp_path_factory.mktemp("other")
    meta = native.read_file(save_random_lm(d / "src", "abc \n") / "best.pt")["meta"]
    model = GPT(GPTConfig(**meta["model_config"]))
    meta = native.build_meta(meta["model_config"], meta["tokenizer"], step=100, world_size=1, train_config={})
    dcp.save(d / "sharded" / "last.dcp", model, torch.optim.AdamW(model.parameters()), meta, None, [{}])
    spec = open_dataset(tiny_char_data).tokenizer_spec
    native.save(
        d / "base" / "best.pt", {"model": GPT(BASE_CFG).state_dict()}, native.build_meta(BASE_CFG.to_dict(), spec)
    )
    train_run("--data", tiny_char_data, "--out-dir", d / "lora", "--init-from", d / "base", "--lora-rank", "2", *TRAIN,
              "--max-iters", "2", "--eval-interval", "2")  # fmt: skip
    (d / "text.txt").write_text("abc abc\n")
    return d


# (main, argv, the run's file it would write) for every command that writes a path the user names
COMMANDS = {
    "export .lock": (export.main, ["--ckpt", "SRC", "--format", "gguf", "--out", "RUN/.lock", "--force"], ".lock"),
    "export best.pt": (export.main, ["--ckpt", "SRC", "--format", "gguf", "--out", "RUN/best.pt", "--force"], "best.pt"),
    "hf export": (hf.main, ["export", "--ckpt", "SRC", "--out", "RUN", "--force"], "config.json"),
    "lora merge": (lora.main, ["merge", "--ckpt", "LORA", "--out", "RUN", "--force"], "best.pt"),
    "dcp convert": (cli_dcp.main, ["convert", "--ckpt", "SHARDED", "--out", "RUN/last.pt", "--force"], "last.pt"),
    "plot log": (plot.main, ["RUN", "--out", "RUN/log.jsonl"], "log.jsonl"),
    "plot .lock": (plot.main, ["RUN", "--out", "RUN/.lock"], ".lock"),
    "attention": (attention.main, ["--ckpt", "SRC", "--text", "ab", "--out", "RUN/tensorboard/a.png"], "tensorboard/"),
    "evaluate": (evaluate.main, ["--ckpt", "SRC", "--text", "TEXT", "--json", "RUN/config.json"], "config.json"),
}  # fmt: skip


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_writes_a_file_of_a_run_directory_even_with_force(run, other, capsys, command):
    main, argv, own = COMMANDS[command]
    paths = {
        "SRC": other / "src",
        "LORA": other / "lora",
        "SHARDED": other / "sharded" / "last.dcp",
        "TEXT": other / "text.txt",
        "RUN": run,
    }
    argv = [str(paths[a.split("/")[0]]) + a[len(a.split("/")[0]) :] if a.split("/")[0] in paths else a for a in argv]
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert {".lock", "log.jsonl", "config.json", "best.pt", "last.pt"} <= set(before)
    err = one_line_error(capsys, main, *argv)
    assert f"the run {run}'s own {own}" in err and "--force does not change this" in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert list((run / "tensorboard").iterdir()) == []


def test_a_run_that_saved_nothing_gets_no_imported_best_pt(other, tmp_path, capsys):
    stopped = tmp_path / "stopped"  # a run stopped before its first save: .lock and an empty log
    stopped.mkdir()
    (stopped / ".lock").write_bytes(b"")
    (stopped / "log.jsonl").write_bytes(b"")
    hf_dir = tmp_path / "hf"
    assert hf.main(["export", "--ckpt", str(other / "src"), "--out", str(hf_dir)]) == 0
    err = one_line_error(capsys, hf.main, "import", "--hf-dir", hf_dir, "--out", stopped)
    assert f"is the run {stopped}'s own best.pt" in err, err
    assert sorted(p.name for p in stopped.iterdir()) == [".lock", "log.jsonl"]


def test_a_new_file_in_a_run_directory_and_its_figure_are_allowed(run, other, capsys):
    """Not a run's own files: an export beside its checkpoints, a figure, and run.png, which the trainer draws
    itself with `gpt plot RUN --out RUN/run.png` (redrawn from log.jsonl at each evaluation)."""
    argv = ["--ckpt", other / "src", "--format", "gguf", "--out", run / "model.gguf", "--no-check"]
    assert export.main([str(a) for a in argv]) == 0
    assert plot.main([str(run), "--out", str(run / "loss.png")]) == 0
    assert plot.main([str(run), "--out", str(run / "run.png")]) == 0
    assert all((run / name).stat().st_size > 0 for name in ("model.gguf", "loss.png", "run.png"))

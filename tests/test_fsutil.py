"""No planted link is followed (gpt/fsutil.py): every writer, run as a user runs it, into a directory whose names
are links to files outside; the files outside stay as they were and the names become the writer's own files.
And no temporary file is left after a failed write."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import BASE_CFG, ROOT, SHAKESPEARE, TRAIN, chat_rows, prepare, train_run, write_jsonl

from gpt.checkpoints import loader, native
from gpt.fsutil import appending, replacing, temp_name, write_text
from gpt.model.transformer import GPT

pytestmark = pytest.mark.usefixtures("one_thread")

OUTSIDE = b"not yours to change\n"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A run directory train.py wrote (2 steps of a tiny char model): what the export writers read."""
    d = tmp_path_factory.mktemp("small")
    (d / "text.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    data = prepare(d / "text.txt", d / "char", "--tokenizer", "char", "--block-size", "16")
    train_run("--data", data, "--out-dir", d / "run", *TRAIN, "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
              "--block-size", "16", "--max-iters", "2", "--eval-interval", "2")  # fmt: skip
    return d / "run"


def _train(tmp_path, out, tiny_char_data, small_run, base):
    train_run("--data", tiny_char_data, "--out-dir", out, *[a for a in TRAIN if a != "--no-plot"], "--tensorboard",
              "--max-iters", "2", "--eval-interval", "2")  # fmt: skip
    assert loader.read_meta(out)["step"] == 2 and (out / "run.png").stat().st_size > 0


def prepare_cli(*args):
    r = subprocess.run([sys.executable, "data/prepare.py", *map(str, args), "--quiet"], cwd=ROOT, capture_output=True)
    assert r.returncode == 0, r.stderr


def _prepare_text(tmp_path, out, *fixtures):
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question.\n" * 50)
    prepare(
        tmp_path / "t.txt", out, "--tokenizer", "char", "--block-size", "16", "--force"
    )  # (it holds "a dataset": the links)


def _prepare_pairs(tmp_path, out, *fixtures):
    de = write_jsonl(tmp_path / "p.de", [f"ein satz {i}" for i in range(40)])
    en = write_jsonl(tmp_path / "p.en", [f"a sentence {i}" for i in range(40)])
    prepare_cli("--pairs", de, en, "--out", out, "--tokenizer", "char", "--force")


def _prepare_chat(tmp_path, out, *fixtures):
    rows = write_jsonl(tmp_path / "c.jsonl", chat_rows(40, short=True))
    prepare_cli("--chat", rows, "--out", out, "--tokenizer", "gpt2", "--block-size", "128", "--force")


def _hf_export(tmp_path, out, tiny_char_data, small_run, base):
    from gpt.cli import hf

    assert hf.main(["export", "--ckpt", str(small_run), "--out", str(out), "--force"]) == 0


def _export(tmp_path, out, tiny_char_data, small_run, base):
    from gpt.cli import export

    assert export.main(["--ckpt", str(small_run), "--format", "pt2", "--out", str(out), "--force", "--no-check"]) == 0


def _lora_merge(tmp_path, out, tiny_char_data, small_run, base):
    from gpt.cli import lora

    adapters = tmp_path / "lora"
    train_run("--data", tiny_char_data, "--out-dir", adapters, "--init-from", base, "--lora-rank", "2", *TRAIN,
              "--max-iters", "2", "--eval-interval", "2")  # fmt: skip
    assert lora.main(["merge", "--ckpt", str(adapters), "--out", str(out), "--force"]) == 0


def _attention(tmp_path, out, tiny_char_data, small_run, base):
    from gpt.cli import attention

    assert attention.main(["--ckpt", str(small_run), "--text", "ROMEO:", "--out", str(out / "a.png")]) == 0


def _plot(tmp_path, out, tiny_char_data, small_run, base):
    from gpt.cli import plot

    assert plot.main([str(small_run), "--out", str(out / "p.png")]) == 0


# writer -> the names it writes into its output directory: (name, whether the planted link points nowhere)
WRITERS = {
    "train.py": (
        _train,
        [
            ("config.json", False),
            ("log.jsonl", True),
            ("run.png", False),
            ("last.pt", True),
            ("best.pt", True),
            ("tensorboard", "dir"),
        ],
    ),  # fmt: skip
    "prepare": (_prepare_text, [("train.bin", False), ("val.bin", False), ("meta.json", True)]),
    "prepare --pairs": (_prepare_pairs, [("train.bin", False), ("val.idx", False), ("meta.json", True)]),
    "prepare --chat": (_prepare_chat, [("train.bin", False), ("train.mask.bin", False), ("meta.json", True)]),
    "gpt hf export": (_hf_export, [("config.json", False), ("model.safetensors", True), ("gpt_tokenizer.json", False)]),
    "gpt export": (_export, [("model.pt2", False), ("gpt_export.json", True)]),
    "gpt lora merge": (_lora_merge, [("best.pt", False)]),
    "gpt attention": (_attention, [("a.png", False)]),
    "gpt plot": (_plot, [("p.png", True)]),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_link_planted_in_an_output_directory_is_replaced_never_followed(
    writer, tmp_path, tiny_char_data, small_run, base
):
    run, names = WRITERS[writer]
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    targets = {}
    for name, kind in names:
        target = outside / name
        if kind == "dir":
            target.mkdir()
            (target / "keep").write_bytes(OUTSIDE)
        elif not kind:  # a file outside (else: nothing there, a dangling link that must not create one)
            target.write_bytes(OUTSIDE)
        os.symlink(target, out / name)
        targets[name] = (target, kind)
    run(tmp_path, out, tiny_char_data, small_run, base)
    for name, (target, kind) in targets.items():
        assert not (out / name).is_symlink(), name
        assert (out / name).is_dir() if kind == "dir" else (out / name).is_file(), name
        if kind == "dir":
            assert [p.name for p in target.iterdir()] == ["keep"] and (target / "keep").read_bytes() == OUTSIDE
        elif kind:
            assert not os.path.lexists(target), f"{name}: the link's target was created"
        else:
            assert target.read_bytes() == OUTSIDE, name
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]


def test_a_resumed_run_appends_its_log_never_through_a_link(tiny_char_data, tmp_path):
    out = tmp_path / "run"
    train_run("--data", tiny_char_data, "--out-dir", out, *TRAIN, "--max-iters", "2", "--eval-interval", "2")
    log = (out / "log.jsonl").read_bytes()
    (tmp_path / "outside").write_bytes(log)
    (out / "log.jsonl").unlink()
    os.symlink(tmp_path / "outside", out / "log.jsonl")
    train_run("--resume", out, "--max-iters", "4")
    assert (tmp_path / "outside").read_bytes() == log and not (out / "log.jsonl").is_symlink()
    assert [json.loads(r)["step"] for r in (out / "log.jsonl").read_text().splitlines()][-1] == 4


def test_a_sharded_save_never_follows_a_link_at_its_step_directory(tmp_path):
    from gpt.checkpoints import dcp

    model = GPT(BASE_CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    os.symlink(tmp_path / "nowhere", tmp_path / "step-000003")  # dangling: a rename onto it would fail the save
    meta = native.build_meta(model_config=BASE_CFG.to_dict(), tokenizer={"kind": "char", "chars": "ab"}, step=3)
    dcp.save(tmp_path / "last.dcp", model, optimizer, meta, scaler=None, rng=[{"torch": torch.get_rng_state()}])
    assert not os.path.lexists(tmp_path / "nowhere") and loader.read_meta(tmp_path)["step"] == 3


# ---- the helpers themselves -------------------------------------------------------------------------


def test_temporary_names_cannot_be_guessed_and_a_planted_one_is_never_written(tmp_path):
    assert temp_name(tmp_path / "x") != temp_name(tmp_path / "x")
    assert temp_name(tmp_path / "x").name.startswith(f".x.tmp-{os.getpid()}-")


def test_appending_replaces_a_hard_linked_log_by_a_copy_and_refuses_a_fifo(tmp_path):
    (tmp_path / "elsewhere").write_text("one\n")
    os.link(tmp_path / "elsewhere", tmp_path / "log.jsonl")
    with appending(tmp_path / "log.jsonl") as f:
        f.write("two\n")
    assert (tmp_path / "elsewhere").read_text() == "one\n" and (tmp_path / "log.jsonl").read_text() == "one\ntwo\n"
    os.mkfifo(tmp_path / "fifo")
    start = time.time()
    with pytest.raises(OSError):
        appending(tmp_path / "fifo")  # never waits for a reader
    assert time.time() - start < 5


@pytest.mark.parametrize("fail", ["in the body", "at the rename"])
def test_a_failed_write_leaves_no_temporary_file_and_the_old_file(tmp_path, monkeypatch, fail):
    write_text(tmp_path / "config.json", "old")
    if fail == "at the rename":
        monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError):
        with replacing(tmp_path / "config.json") as tmp:
            tmp.write_text("half")
            if fail == "in the body":
                raise OSError(errno.ENOSPC, "No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"] and (tmp_path / "config.json").read_text() == "old"


def test_a_figure_process_stopped_mid_write_removes_its_temporary_png(small_run, tmp_path):
    """train.py's figure child gets the trainer's SIGTERM / SIGHUP (`timeout`, a closed terminal): it ends as on
    Ctrl-C, its temporary PNG removed, the old run.png kept."""
    (tmp_path / "run.png").write_bytes(OUTSIDE)
    code = (
        "import sys, time; from matplotlib.figure import Figure\n"
        "def slow(self, fname, **kw):\n"
        "    open(fname, 'wb').write(b'half'); print('writing', flush=True); time.sleep(60)\n"
        "Figure.savefig = slow\n"
        "from gpt.cli.plot import main; sys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", code, str(small_run), "--out", str(tmp_path / "run.png")],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130 and err.startswith("error: interrupted"), err
    assert [p.name for p in tmp_path.iterdir()] == ["run.png"] and (tmp_path / "run.png").read_bytes() == OUTSIDE


def test_the_trainer_removes_the_png_of_a_figure_process_that_was_killed(tmp_path):
    from gpt.train.plot import FigureWriter

    warnings = []
    writer = FigureWriter(tmp_path, warnings.append)
    writer.process = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"],
                                      stderr=subprocess.PIPE, text=True)  # fmt: skip
    (tmp_path / f".run.png.tmp-{writer.process.pid}-abcdef").write_bytes(b"half")  # what it was writing
    writer.close()
    assert list(tmp_path.iterdir()) == [] and len(warnings) == 1

"""Checkpoints: one meta builder and reader, one-line errors for files made by hand or by another tool,
atomic saves that survive a full disk, stale temporary files cleaned up, and the scripts' messages."""

import ast
import base64
import datetime
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import ROOT, SHAKESPEARE, one_line_error, sample_script, script, train_script  # noqa: F401

from gpt import GPT, GPTConfig
from gpt.checkpoints import loader, native
from gpt.checkpoints.native import CheckpointError
from gpt.data.tokenizer import CharTokenizer
from gpt.errors import StorageError

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TOK = CharTokenizer("\n abcdefgh")
CFG = GPTConfig(vocab_size=TOK.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=8)
TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--block-size",
    "16",
    "--batch-size",
    "2",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--warmup-iters",
    "1",
    "--device",
    "cpu",
]


def meta(**fields) -> dict:
    return native.build_meta(model_config=CFG.to_dict(), tokenizer=TOK.spec, **fields)


def save_tiny(path, model_meta=None, state=None):
    native.save(path, {"model": GPT(CFG).state_dict() if state is None else state}, model_meta or meta())
    return path


# ---- one meta: builder and reader ---------------------------------------------------------------------


def test_built_meta_round_trips_and_loads(tmp_path):
    m = meta(step=7, train_config={"lr": 1.0}, val_loss=None, seq2seq={"bos": 0, "eos": 0, "pad": 0})
    assert m["format"] == native.FORMAT_VERSION and "val_loss" not in m  # None is left out
    save_tiny(tmp_path / "last.pt", m)
    model, tok, read = loader.load_checkpoint(tmp_path)
    assert read == m and read["step"] == 7 and model.config == CFG and tok.spec == TOK.spec
    with pytest.raises(TypeError, match="no meta field.*'learning_rate'"):
        meta(learning_rate=1.0)  # an undocumented field is a bug in the caller, not a user error


def test_hf_import_has_no_import_circle():
    """gpt.checkpoints.native imports gpt.checkpoints.hf, never the other way (only hf's command line, gpt/cli/hf.py,
    loads a --ckpt)."""
    tree = ast.parse((ROOT / "gpt" / "checkpoints" / "hf.py").read_text())
    library = [node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name == "main")]
    imported = {
        alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
        for top in library
        for node in ast.walk(top)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not {name for name in imported if name.startswith("gpt.checkpoints.native")}, imported
    code = "import sys, gpt.checkpoints.hf; assert 'gpt.checkpoints.native' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


# ---- checkpoints made by hand or by another tool ------------------------------------------------------


def test_foreign_file_without_model_config(tmp_path, capsys):
    path = tmp_path / "foreign.pt"
    native.save(path, {"model": GPT(CFG).state_dict()}, {"step": 3, "tokenizer": TOK.spec})
    with pytest.raises(CheckpointError, match=f"^{path} is not a gpt checkpoint: missing model_config"):
        loader.load_checkpoint(path)
    err = one_line_error(capsys, sample_script.main, "--ckpt", path, "--prompt", "a")
    assert f"{path} is not a gpt checkpoint: missing model_config" in err


def test_a_file_with_no_meta_at_all_names_what_it_holds(tmp_path):
    path = tmp_path / "nanogpt.pt"
    torch.save({"model": GPT(CFG).state_dict(), "model_args": {"n_layer": 1}, "iter_num": 5}, path)
    with pytest.raises(CheckpointError, match=r"is not a gpt checkpoint: it has no meta \(it holds model, model_args"):
        loader.load_checkpoint(path)


def test_objects_torch_load_refuses_are_one_line(tmp_path, capsys):
    """weights_only refuses any class it does not know (its message spans lines, with terminal colours)."""
    torch.save({"model": GPT(CFG).state_dict(), "meta": "{}", "saved": datetime.date(2024, 1, 1)}, tmp_path / "x.pt")
    err = one_line_error(capsys, sample_script.main, "--ckpt", tmp_path / "x.pt")
    assert err == (
        f"error: {tmp_path / 'x.pt'} is not a gpt checkpoint: it holds objects other than tensors and "
        f"plain data, whose code loading would run; refused\n"
    )


@pytest.mark.parametrize(
    "model_config,message",
    [
        (
            dict(CFG.to_dict(), rope_theta=10000.0),
            r"invalid model config: unknown model config fields \['rope_theta'\]",
        ),
        (dict(CFG.to_dict(), n_embd=10, n_head=4), r"invalid model config: n_head: must divide n_embd \(10\), got 4"),
        (dict(CFG.to_dict(), dropout="none"), r"invalid model config: dropout: must be in \[0, 1\), got 'none'"),
        ([1, 2, 3], r"invalid model config: expected a JSON object, got list"),
    ],
)
def test_model_config_that_builds_no_model(tmp_path, model_config, message):
    path = save_tiny(tmp_path / "bad.pt", dict(meta(), model_config=model_config))
    with pytest.raises(CheckpointError, match=f"^{path}: {message}"):
        loader.load_checkpoint(path)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda sd: sd.pop("transformer.h.0.attn.c_attn.weight"), r"missing transformer\.h\.0\.attn\.c_attn\.weight"),
        (lambda sd: sd.update(extra=torch.zeros(1)), r"unexpected extra"),
        (
            lambda sd: sd.update({"transformer.wte.weight": torch.zeros(5, 8)}),
            rf"transformer\.wte\.weight is \(5, 8\), the config wants \({CFG.vocab_size}, 8\)",
        ),
    ],
)
def test_weights_that_do_not_match_the_config(tmp_path, capsys, change, message):
    state = GPT(CFG).state_dict()
    change(state)
    path = save_tiny(tmp_path / "run" / "best.pt", state=state)
    with pytest.raises(CheckpointError, match=f"^{path}: the weights do not match its model config: {message}"):
        loader.load_checkpoint(path)
    assert message.replace("\\", "") in one_line_error(capsys, sample_script.main, "--ckpt", tmp_path / "run")


@pytest.mark.parametrize("pattern", [r"((a+)+)\1b|.", r"(?<=a)"])  # seconds per encode; a panic on every encode
def test_a_tokenizer_pattern_gpt_does_not_know_is_one_line_naming_the_file(tmp_path, capsys, pattern):
    ranks = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    spec = {"kind": "bpe", "pattern": pattern, "ranks": ranks}
    path = save_tiny(tmp_path / "run" / "best.pt", dict(meta(), tokenizer=spec))
    with pytest.raises(CheckpointError, match=f"^{path}: pre-tokenizer pattern '.*' is not one gpt knows"):
        loader.load_checkpoint(path)
    err = one_line_error(capsys, sample_script.main, "--ckpt", tmp_path / "run", "--prompt", "a")
    assert f"{path}: pre-tokenizer pattern" in err


def test_resume_needs_a_training_checkpoint(tmp_path, capsys):
    save_tiny(tmp_path / "run" / "last.pt")  # model and tokenizer, no train_config: not written by train.py
    err = one_line_error(capsys, train_script.main, "--resume", tmp_path / "run")
    assert f"{tmp_path / 'run' / 'last.pt'} has no train_config: it was not written by `gpt train`" in err
    assert f"--init-from {tmp_path / 'run' / 'last.pt'}" in err


def test_init_from_a_checkpoint_without_model_config(tmp_path, tiny_char_data, capsys):
    path = tmp_path / "foreign.pt"
    native.save(path, {"model": GPT(CFG).state_dict()}, {"tokenizer": TOK.spec})
    err = one_line_error(
        capsys, train_script.main, "--init-from", path, "--data", tiny_char_data, "--out-dir", tmp_path / "out", *TINY
    )
    assert f"{path} is not a gpt checkpoint: missing model_config" in err


def test_a_dataset_directory_is_not_a_run(tiny_char_data, capsys):
    err = one_line_error(capsys, sample_script.main, "--ckpt", tiny_char_data, "--prompt", "a")
    assert f"{tiny_char_data} is a prepared dataset, not a training run" in err
    assert f"`gpt train --data {tiny_char_data} --out-dir out/char`" in err
    assert f"--out-dir {tiny_char_data}`" not in err  # the old hint: train into the dataset directory


# ---- Hugging Face directories -------------------------------------------------------------------------

GPT2_CONFIG = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4}


@pytest.mark.parametrize(
    "config,message",
    [
        ("[1, 2]", "{cfg} is not a Hugging Face config: expected a JSON object, got a list"),
        ('{"n_embd": 32,', "{cfg} is not valid JSON (Expecting property name"),
        (
            {k: v for k, v in GPT2_CONFIG.items() if k not in ("n_layer", "n_head")},
            "{cfg} lacks n_layer, n_head: a GPT-2 config.json gives the model's sizes",
        ),
        ({k: v for k, v in GPT2_CONFIG.items() if k != "n_positions"}, "{cfg} lacks n_positions"),
        (dict(GPT2_CONFIG, n_embd=30), "{cfg}: invalid model config: n_head: must divide n_embd (30), got 4"),
        (dict(GPT2_CONFIG, n_layer="2"), "{cfg}: invalid model config: n_layer: must be a positive integer, got '2'"),
        (
            dict(GPT2_CONFIG, layer_norm_epsilon="tiny"),
            "unsupported GPT-2 config: layer_norm_epsilon 'tiny' (only 1e-5)",
        ),
    ],
)
@pytest.mark.parametrize("how", ["sample --ckpt", "train --init-from"])
def test_broken_hugging_face_config(tmp_path, tiny_char_data, capsys, config, message, how):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    torch.save({"wte.weight": torch.zeros(1)}, hf / "pytorch_model.bin")
    if how == "sample --ckpt":
        err = one_line_error(capsys, sample_script.main, "--ckpt", hf, "--prompt", "a")
    else:
        err = one_line_error(
            capsys, train_script.main, "--init-from", hf, "--data", tiny_char_data, "--out-dir", tmp_path / "out", *TINY
        )
    assert message.format(cfg=hf / "config.json") in err


def test_resume_from_a_hugging_face_directory_suggests_init_from(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(GPT2_CONFIG))
    torch.save({}, hf / "pytorch_model.bin")
    err = one_line_error(capsys, train_script.main, "--resume", hf)
    assert (
        f"{hf} is a Hugging Face model directory: it holds weights but no training state; fine-tune "
        f"from it with `gpt train --init-from {hf}" in err
    )


# ---- saving: full disk, read-only or non-directory destinations, stale temporary files ----------------


class FullDisk:
    """A file whose writes fail with ENOSPC once `room` bytes are written, as on a full disk."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fail_writes(monkeypatch, make_error, calls_before: int = 0, on_failure=lambda: None):
    """Make gpt.checkpoints.native's file writes fail after `calls_before` good ones."""
    calls = {"n": 0}

    def fake_open(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        calls["n"] += 1
        if calls["n"] <= calls_before:
            return f
        on_failure()
        return make_error(f)

    monkeypatch.setattr(native, "open", fake_open, raising=False)


def test_full_disk_is_one_line_and_the_previous_checkpoint_is_intact(tmp_path, monkeypatch):
    path = save_tiny(tmp_path / "last.pt", meta(step=1))
    before = path.read_bytes()
    fail_writes(monkeypatch, lambda f: FullDisk(f, room=1000))  # torch's writer: "unexpected pos" underneath
    with pytest.raises(StorageError) as e:
        native.save(path, {"model": GPT(CFG).state_dict()}, meta(step=2))
    assert (
        str(e.value) == f"could not write checkpoint {path}: the disk is full; free some space; the previous "
        f"last.pt is intact"
    )
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temporary file left behind
    assert loader.read(path)["meta"]["step"] == 1


def test_file_size_limit_through_torch_save_in_a_real_process(tmp_path):
    """No monkeypatching: the kernel refuses the write (RLIMIT_FSIZE), torch.save sees it mid-stream."""
    path = save_tiny(tmp_path / "last.pt", meta(step=1))
    before = path.read_bytes()
    child = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from gpt.checkpoints import loader
        from gpt.checkpoints import native
        from gpt.cli import run_main
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 4096}, {len(before) + 4096}))
        state = {{"model": {{"w": torch.zeros(100_000)}}}}
        sys.exit(run_main(lambda: native.save({str(path)!r}, state, {{"step": 2}})))
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: could not write checkpoint {path}: File too large; the previous last.pt is intact\n"
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


@pytest.mark.parametrize(
    "error,reason",
    [
        (errno.EROFS, "the file system is read-only; choose a writable location"),
        (errno.EACCES, "permission denied; choose a writable location"),
    ],
)
def test_read_only_destination(tmp_path, monkeypatch, error, reason):
    def refuse(f):
        f.close()
        raise OSError(error, os.strerror(error))

    fail_writes(monkeypatch, refuse)
    with pytest.raises(
        StorageError, match=f"^could not write checkpoint {tmp_path / 'last.pt'}: {reason}; nothing was written$"
    ):
        native.save(tmp_path / "last.pt", {"model": GPT(CFG).state_dict()}, meta())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_for_real(tmp_path):
    save_tiny(tmp_path / "last.pt")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(StorageError, match="permission denied; choose a writable location; the previous last.pt"):
            save_tiny(tmp_path / "last.pt")
    finally:
        tmp_path.chmod(0o700)


def test_destination_under_a_file(tmp_path):
    (tmp_path / "out").write_text("a file, not a directory")
    for path in (tmp_path / "out" / "last.pt", tmp_path / "out" / "run" / "last.pt"):
        with pytest.raises(
            StorageError,
            match=f"^could not write checkpoint {path}: a part of the path is a file, "
            f"not a directory; nothing was written$",
        ):
            save_tiny(path)


def test_full_disk_during_training_is_one_line(tiny_char_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    seen = {}
    fail_writes(
        monkeypatch,
        lambda f: FullDisk(f, room=0),
        calls_before=1,
        on_failure=lambda: seen.setdefault("last.pt", (out / "last.pt").read_bytes()),
    )
    err = one_line_error(
        capsys,
        train_script.main,
        "--data",
        tiny_char_data,
        "--out-dir",
        out,
        *TINY,
        "--max-iters",
        "4",
        "--eval-interval",
        "2",
    )
    assert f"could not write checkpoint {out / 'last.pt'}: the disk is full" in err and "last.pt is intact" in err
    assert (out / "last.pt").read_bytes() == seen["last.pt"] and loader.read_meta(out / "last.pt")["step"] == 2


def test_stale_temporary_files_of_dead_processes_are_removed(tmp_path):
    """A save killed mid-write leaves `.last.pt.tmp-PID-RANDOM`; later saves remove it once that process is
    gone, never while it lives."""
    path = tmp_path / "last.pt"
    writer = textwrap.dedent(f"""
        import time, torch
        from gpt.checkpoints import native

        class Stall:  # pickled inside torch.save, after the temporary file is created
            def __reduce__(self):
                time.sleep(600)

        native.save({str(path)!r}, {{"model": {{"w": torch.zeros(1)}}, "stall": Stall()}}, {{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=ROOT)
    try:
        for _ in range(600):  # the child imports torch first
            temps = list(tmp_path.glob(f".last.pt.tmp-{proc.pid}-*"))
            if temps or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert temps, "the writer never started its save"
        temp = temps[0]
        save_tiny(path)
        assert temp.exists()  # its process is alive: never touched
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    save_tiny(path)
    assert not temp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


@pytest.mark.parametrize("error", [errno.EXDEV, errno.EPERM])
def test_link_or_copy_without_hard_links_syncs_the_copy(tmp_path, monkeypatch, error):
    """Where os.link fails the copy must be on the disk before the rename publishes it (then the directory)."""
    src = save_tiny(tmp_path / "last.pt", meta(step=1))

    def no_link(*args):
        raise OSError(error, os.strerror(error))

    synced = []  # (inode, is a directory) of each fsync'ed descriptor
    real_fsync = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        synced.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        real_fsync(fd)

    monkeypatch.setattr(native.os, "link", no_link)
    monkeypatch.setattr(os, "fsync", fsync)
    native.link_or_copy(src, tmp_path / "best.pt")
    best = tmp_path / "best.pt"
    assert best.read_bytes() == src.read_bytes() and best.stat().st_ino != src.stat().st_ino  # a copy, whole
    assert (best.stat().st_ino, False) in synced  # the copy itself, before its rename (the inode is kept)
    assert synced[-1] == (tmp_path.stat().st_ino, True)  # then the directory holding the rename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]

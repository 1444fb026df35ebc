"""Sharded checkpoints (gpt/checkpoints/dcp.py) in one process: round trips, atomic switches, failed and killed saves,
a .metadata that would run code, reading them wherever a checkpoint is read, conversion to one file.
Several processes: tests/test_parallel.py."""

import dataclasses
import errno
import os
import pickle
import shutil
import struct
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from conftest import ROOT, TRAIN, one_line_error, train_script
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from gpt.checkpoints import dcp, loader, native
from gpt.cli import dcp as cli_dcp
from gpt.errors import StorageError
from gpt.infer.sampling import complete
from gpt.model.transformer import GPT, GPTConfig
from gpt.train.rundir import RunDir, RunDirError

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
TOKENIZER = {"kind": "char", "chars": "".join(chr(97 + i % 26) for i in range(26))}


def trained(steps=2, seed=0):
    """A model and AdamW after a few steps (the optimizer has state), as the trainer builds them."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2, fused=True)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16))
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def save(run_dir, model, optimizer, step, name="last.dcp"):
    meta = native.build_meta(
        model_config=CFG.to_dict(), tokenizer=TOKENIZER, step=step, world_size=1, train_config={"max_iters": 10}
    )
    rng = [{"torch": torch.get_rng_state()}]
    dcp.save(run_dir / name, model, optimizer, meta, scaler=None, rng=rng)
    return rng


def assert_same(a, b):
    """Equal nested state dicts, tensor for tensor (bitwise)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):  # (betas come back as a list from DCP's state-dict helpers)
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_round_trip_whole_and_into_a_fresh_model(tmp_path):
    model, optimizer = trained()
    rng = save(tmp_path, model, optimizer, step=2)
    assert os.readlink(tmp_path / "last.dcp") == "step-000002"
    whole = loader.read(tmp_path, names=native.LATEST)  # what --resume without --fsdp reads
    assert_same(whole["model"], model.state_dict())  # the tied head included
    assert_same(whole["optimizer"], optimizer.state_dict())  # torch.optim's own format
    assert_same(whole["rng"], rng) and whole["scaler"] is None and whole["meta"]["step"] == 2
    fresh, fresh_opt = trained(steps=0, seed=1)
    rest = dcp.load(tmp_path / "last.dcp", fresh, fresh_opt)  # what --fsdp reads (here: whole tensors)
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(fresh_opt.state_dict(), optimizer.state_dict())
    assert rest["meta"]["step"] == 2 and fresh.lm_head.weight is fresh.transformer.wte.weight
    assert_same(rest["rng"], rng)


def test_a_single_file_loads_into_the_sharded_path_too(tmp_path):
    """A run that switches to --fsdp resumes its last.pt: each process keeps its part of the whole."""
    model, optimizer = trained()
    meta = native.build_meta(model_config=CFG.to_dict(), tokenizer=TOKENIZER, step=2)
    native.save(
        tmp_path / "last.pt",
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": [], "scaler": None},
        meta,
    )
    fresh, fresh_opt = trained(steps=0, seed=1)
    dcp.load(tmp_path / "last.pt", fresh, fresh_opt)
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(fresh_opt.state_dict(), optimizer.state_dict())


def test_links_move_atomically_and_unreferenced_steps_go(tmp_path):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    dcp.mark_best(tmp_path)
    save(tmp_path, model, optimizer, step=4)
    assert os.readlink(tmp_path / "best.dcp") == "step-000002" and os.readlink(tmp_path / "last.dcp") == "step-000004"
    save(tmp_path, model, optimizer, step=4)  # the same step again: a new directory, the old one dropped
    assert os.readlink(tmp_path / "last.dcp") == "step-000004.1"
    dcp.mark_best(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.dcp", "last.dcp", "step-000004.1"]
    assert loader.read_meta(tmp_path)["step"] == 4


def test_a_failed_save_is_one_line_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(StorageError) as e:
        save(tmp_path, model, optimizer, step=3)
    assert str(e.value) == (
        f"could not write checkpoint {tmp_path / 'step-000003'}: the disk is full; free some "
        f"space; the previous last.dcp is intact"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp", "step-000002"]  # nothing half-written left
    assert loader.read(tmp_path)["meta"]["step"] == 2


def test_a_killed_save_never_shows_and_is_cleaned_up_later(tmp_path):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)  # a process that no longer runs
    partial = tmp_path / f".step-000003.tmp-{pid}"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    os.symlink("step-000003", tmp_path / f".last.dcp.tmp-{pid}")  # killed between the link and its rename
    assert loader.read(tmp_path)["meta"]["step"] == 2  # readers never see it
    save(tmp_path, model, optimizer, step=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp", "step-000004"]


def test_a_metadata_file_that_would_run_code_is_refused(tmp_path):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / "last.dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(native.CheckpointError, match=r"not a readable DCP checkpoint: .*system is not allowed"):
        loader.read(tmp_path)
    assert not (tmp_path / "pwned").exists()


# ---- hostile .metadata pickles, written opcode by opcode: each would make the directory `marker` ----------

MOD = "torch.distributed.checkpoint.metadata"  # an admitted module, which imports os


def _u(text: str) -> bytes:  # SHORT_BINUNICODE
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _global(module: str, name: str) -> bytes:  # STACK_GLOBAL (protocol 4 resolves a dotted name)
    return _u(module) + _u(name) + b"\x93"


def _mkdir(marker) -> bytes:  # ... the callable on the stack, then: (marker,) REDUCE
    return _u(str(marker)) + b"\x85R"


EXT_CODE = 0xE7

HOSTILE = {
    "dotted STACK_GLOBAL + REDUCE": lambda m: _global(MOD, "os.mkdir") + _mkdir(m),
    "dotted GLOBAL + REDUCE": lambda m: f"c{MOD}\nos.mkdir\n".encode() + _mkdir(m),
    "INST": lambda m: b"(" + _u(str(m)) + f"i{MOD}\nos.mkdir\n".encode(),
    "OBJ": lambda m: b"(" + _global(MOD, "os.mkdir") + _u(str(m)) + b"o",
    "NEWOBJ of a foreign class": lambda m: _global("subprocess", "Popen") + b"(" + _u(str(m)) + b"t\x81",
    "NEWOBJ_EX of a dotted class": lambda m: _global(MOD, "os.PathLike") + b")}\x92",
    "EXT1 (copyreg extension registry)": lambda m: b"\x82" + bytes([EXT_CODE]) + _mkdir(m),
    "module attribute": lambda m: _global(MOD, "os"),
    "BytesStorageMetadata": lambda m: _global(MOD, "BytesStorageMetadata") + b")\x81",
    "a dtype's dotted attribute": lambda m: _global("torch", "float32.__class__"),
    "a plain GLOBAL": lambda m: _global("os", "mkdir") + _mkdir(m),
    "BINPERSID": lambda m: _u(str(m)) + b"Q",
    "PERSID": lambda m: b"P" + str(m).encode() + b"\n",
    "REDUCE of an admitted class: a path": lambda m: _global("pathlib", "PosixPath") + _mkdir(m),
    "REDUCE of an admitted function with a bad name": lambda m: (
        _global("torch.serialization", "_get_layout") + _u("nope") + b"\x85R"
    ),
    "REDUCE of Metadata holding a path": lambda m: (
        _global(MOD, "Metadata") + b"}" + _u("model.w") + _global("pathlib", "PosixPath") + _mkdir(m) + b"s\x85R"
    ),
    "BUILD setting Metadata's entries": lambda m: (
        _global(MOD, "Metadata") + b"})\x81}" + _u("state_dict_metadata") + b"}" + _u("k") + _u(str(m)) + b"ssb"
    ),
    "BUILD through TensorProperties.__setstate__": lambda m: (
        _global(MOD, "TensorProperties") + b")\x81(" + _u(str(m)) + b"tb"
    ),
    "BUILD on a class": lambda m: (
        _global(MOD, "Metadata") + b"N}" + _u("__init__") + _global("os", "mkdir") + b"s\x86b"
    ),
    "BUILD on an OrderedDict (torch's weights_only allows it)": lambda m: (
        _global("collections", "OrderedDict") + b")R}" + _u("x") + _u(str(m)) + b"sb"
    ),
    "BUILD of a field that is not the dataclass's": lambda m: (
        _global(MOD, "StorageMeta") + b")\x81}" + _u("__class__") + _u(str(m)) + b"sb"
    ),
    "NEWOBJ of an admitted class with arguments": lambda m: _global(MOD, "MetadataIndex") + _u(str(m)) + b"\x85\x81",
    "REDUCE of a dtype": lambda m: _global("torch", "float32") + b")R",
    "REDUCE of torch.Size with a path": lambda m: _global("torch", "Size") + _u(str(m)) + b"\x85R",
    "SETITEM into a list": lambda m: b"]" + _u("k") + _u(str(m)) + b"s",
    "a memo entry never stored": lambda m: b"h\x07",
    "DUP": lambda m: b"N2",
    "a lazily imported torch submodule": lambda m: _global("torch", "_dynamo"),
    "a deeply nested tuple as a dict key (hash() would overflow the C stack)": lambda m: (
        b"})" + b"\x85" * 500_000 + _u(str(m)) + b"s"
    ),
    "an index key whose offset is such a tuple": lambda m: (
        b"}"
        + _global(MOD, "MetadataIndex")
        + b")\x81}"
        + _u("fqn")
        + _u("k")
        + _u("offset")
        + b")"
        + b"\x85" * 500_000
        + b"ub"
        + _u(str(m))
        + b"s"
    ),
}


@pytest.mark.parametrize("trick", HOSTILE)
def test_a_hostile_metadata_pickle_is_one_line_and_runs_nothing(tmp_path, trick):
    """Every pickle route to a callable (sample.py, the server and --resume all read a run directory so)."""
    import copyreg

    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    marker = tmp_path / "marker"
    (tmp_path / "last.dcp" / ".metadata").write_bytes(b"\x80\x04" + HOSTILE[trick](marker) + b".")
    copyreg.add_extension(MOD, "os.mkdir", EXT_CODE)
    try:
        with pytest.raises(native.CheckpointError, match=r"^\S+ is not a readable DCP checkpoint: .+$") as e:
            loader.load_model(tmp_path)
        with pytest.raises(native.CheckpointError):
            dcp.load(tmp_path / "last.dcp", *trained(steps=0))  # --resume --fsdp
    finally:
        copyreg.remove_extension(MOD, "os.mkdir", EXT_CODE)
    assert "\n" not in str(e.value) and not marker.exists()


def _rewrite_metadata(step_dir, change) -> None:
    """Read a real .metadata (trusted here), let `change` edit it, write it back as DCP does."""
    with open(step_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    with open(step_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_an_entry_dcp_would_unpickle_whole_is_refused(tmp_path):
    """DCP reads a BytesStorageMetadata entry with torch.load(weights_only=False): a .metadata made only of
    DCP's own classes could name a shard that is any pickle."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    step_dir, marker = tmp_path / "step-000002", tmp_path / "marker"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save(Evil(), step_dir / "evil.distcp")
    key = "model.transformer.wpe.weight"

    def change(metadata):
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex(key)] = _StorageInfo(
            "evil.distcp", 0, (step_dir / "evil.distcp").stat().st_size
        )

    _rewrite_metadata(step_dir, change)
    with pytest.raises(native.CheckpointError, match="BytesStorageMetadata is not allowed"):
        dcp.load(tmp_path / "last.dcp", *trained(steps=0))
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", ".."])
def test_storage_outside_the_checkpoint_directory_is_refused(tmp_path, name):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    step_dir = tmp_path / "step-000002"
    shard = next(step_dir.glob("*.distcp"))
    (tmp_path / "outside.distcp").write_bytes(shard.read_bytes())

    def change(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = name

    _rewrite_metadata(step_dir, change)
    with pytest.raises(native.CheckpointError, match="is not a file in the checkpoint's directory"):
        loader.read(tmp_path)


def test_every_reader_takes_a_sharded_run_and_convert_writes_one_file(tmp_path, capsys):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    dcp.mark_best(tmp_path)
    loaded, tok, meta = loader.load_checkpoint(tmp_path)  # sample.py, --init-from, gpt hf export
    assert_same(loaded.state_dict(), model.eval().state_dict())
    (text,) = complete(loaded, tok, "abc", max_new_tokens=5, temperature=0, stop_at_eot=False)
    assert text  # five tokens of an untrained model
    assert cli_dcp.main(["convert", "--ckpt", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {tmp_path / 'last.pt'}", f"wrote {tmp_path / 'best.pt'}"]
    raw = torch.load(tmp_path / "best.pt", weights_only=True)  # a plain single-file checkpoint
    assert_same(raw["model"], model.state_dict()) and assert_same(raw["optimizer"], optimizer.state_dict())
    assert cli_dcp.main(["convert", "--ckpt", str(tmp_path / "last.dcp"), "--out", str(tmp_path / "m.pt")]) == 0
    assert_same(loader.read(tmp_path / "m.pt")["model"], model.state_dict())
    assert cli_dcp.main(["convert", "--ckpt", str(tmp_path / "last.dcp")]) == 2
    assert capsys.readouterr().err.startswith("error: --out: where to write")
    before = (tmp_path / "m.pt").read_bytes()
    for out in (tmp_path / "m.pt", tmp_path / "last.dcp" / "m.pt"):  # an existing file; the checkpoint converted
        assert cli_dcp.main(["convert", "--ckpt", str(tmp_path / "last.dcp"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (
            "exists already: choose another --out, or --force" in err
            if out.name == "m.pt" and out.parent == tmp_path
            else "--force does not change this" in err
        ) and err.count("\n") == 1, err
    assert (tmp_path / "m.pt").read_bytes() == before
    assert (
        cli_dcp.main(["convert", "--ckpt", str(tmp_path / "last.dcp"), "--out", str(tmp_path / "m.pt"), "--force"]) == 0
    )


def test_the_later_of_last_pt_and_last_dcp_is_resumed(tmp_path):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    meta = native.build_meta(model_config=CFG.to_dict(), tokenizer=TOKENIZER, step=5)
    native.save(tmp_path / "last.pt", {"model": model.state_dict()}, meta)
    assert loader.resolve(tmp_path, native.LATEST) == tmp_path / "last.pt"
    save(tmp_path, model, optimizer, step=7)
    assert loader.resolve(tmp_path, native.LATEST) == tmp_path / "last.dcp"


def test_locate_decides_a_paths_kind_once_reading_each_meta_once(tmp_path, monkeypatch):
    """One function says what a path is (gpt/checkpoints/loader.py `locate`): a run directory resolves to its
    checkpoint, the later of last.pt and last.dcp, each candidate's meta read once; then the kind's reader."""
    from gpt.checkpoints.hf import export_hf
    from gpt.data.tokenizer import get_tokenizer

    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=7)
    meta = native.build_meta(model_config=CFG.to_dict(), tokenizer=TOKENIZER, step=5)
    native.save(tmp_path / "last.pt", {"model": model.state_dict()}, meta)
    native.save(tmp_path / "lora.pt", {"model": {}}, dict(meta, lora={"base": str(tmp_path / "last.pt")}))
    hf_dir = export_hf(model, get_tokenizer(TOKENIZER), tmp_path / "hf")
    reads, read_meta, load_file = [], dcp.read_meta, loader.load_file
    monkeypatch.setattr(dcp, "read_meta", lambda p: (reads.append(p.name), read_meta(p))[1])
    monkeypatch.setattr(loader, "load_file", lambda p, **kw: (reads.append(p.name), load_file(p, **kw))[1])

    run = loader.locate(tmp_path, native.LATEST)
    assert (run.kind, run.path, run.meta["step"], run.sharded) == ("dcp", tmp_path / "last.dcp", 7, True)
    assert sorted(reads) == ["last.dcp", "last.pt"]  # both twins, once each
    assert [loader.locate(p).kind for p in (tmp_path / "last.pt", tmp_path / "lora.pt", hf_dir)] == ["pt", "lora", "hf"]
    assert loader.locate(hf_dir).meta is None  # its meta comes with its weights
    assert_same(loader.load_model(run)[0].state_dict(), loader.load_model(tmp_path / "last.pt")[0].state_dict())
    with pytest.raises(native.CheckpointError, match="Hugging Face model directory"):
        loader.read_meta(hf_dir)  # no training state: what --resume needs


def test_force_removes_a_sharded_run(tmp_path):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    dcp.mark_best(tmp_path)
    (tmp_path / "log.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("mine")
    with RunDir(tmp_path).claim(resume=False, force=True):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "notes.txt"]  # (the lock file stays)


def test_convert_mistakes_are_one_line(tmp_path, capsys):
    assert cli_dcp.main(["convert", "--ckpt", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err == f"error: no last.dcp or best.dcp in {tmp_path}: give the run directory of a "
        f"--fsdp run, or one of its checkpoint directories with --out\n"
    )
    model, optimizer = trained()
    meta = native.build_meta(model_config=CFG.to_dict(), tokenizer=TOKENIZER, step=5)
    native.save(tmp_path / "last.pt", {"model": model.state_dict()}, meta)
    assert cli_dcp.main(["convert", "--ckpt", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'last.pt'} is already a single-file checkpoint\n"
    save(tmp_path, model, optimizer, step=2)  # an older sharded checkpoint beside the newer last.pt
    before = (tmp_path / "last.pt").read_bytes()
    assert cli_dcp.main(["convert", "--ckpt", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'last.pt'} (step 5) is newer than ")
    assert (tmp_path / "last.pt").read_bytes() == before


# ---- a .metadata that rewrites what it may name (BUILD's setattr on a class or a function) -----------------


def _binunicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _setattr_on(named: bytes, attribute: str, value: bytes) -> bytes:
    """BUILD with the state (None, {attribute: value}) on the class or function `named`, then POP: Python's
    unpickler runs setattr on whatever is on the stack, and the real index after it still loads."""
    return named + b"N}" + _binunicode(attribute) + value + b"s\x86b0"


REWRITES = {  # each takes a folder inside the checkpoint (the plot child's PYTHONPATH, had parents[1] been it)
    "PosixPath.is_symlink": lambda folder: _setattr_on(
        b"cpathlib\nPosixPath\n", "is_symlink", b"ccollections\nOrderedDict\n"
    ),
    "_get_layout.cache": lambda folder: _setattr_on(
        b"ctorch.serialization\n_get_layout\n", "cache", b"}" + _binunicode("torch.strided") + b"ctorch\nfloat32\ns"
    ),
    "PosixPath.parents": lambda folder: _setattr_on(
        b"cpathlib\nPosixPath\n", "parents", b"](" + _binunicode(str(folder)) * 2 + b"e"
    ),
}


def _plant(step_dir, trick) -> None:
    """The rewrite between the real index's PROTO and its body (outside any frame)."""
    (step_dir / "evil" / "gpt").mkdir(parents=True)
    (step_dir / "evil" / "gpt" / "__init__.py").write_text("raise SystemExit('evil gpt imported')\n")
    data = (step_dir / ".metadata").read_bytes()
    (step_dir / ".metadata").write_bytes(data[:2] + REWRITES[trick](step_dir / "evil") + data[2:])


@contextmanager
def untouched():
    """Asserts that pathlib's path classes and torch's `_get_layout` end as they started (putting back whatever
    changed first, so that a failure here cannot spoil the tests after it)."""
    from pathlib import Path, PosixPath, PurePath, PurePosixPath

    from torch.serialization import _get_layout

    owners = (PurePath, PurePosixPath, Path, PosixPath, _get_layout)
    before = [dict(vars(o)) for o in owners]
    cache = dict(_get_layout.cache)
    try:
        yield
    finally:
        changed = []
        for owner, was in zip(owners, before):
            for key in [k for k in vars(owner) if k not in was or vars(owner)[k] is not was[k]]:
                changed.append(f"{getattr(owner, '__name__', owner)}.{key}")
                delattr(owner, key)
            for key in [k for k in was if k not in vars(owner)]:
                setattr(owner, key, was[key])
        if _get_layout.cache != cache:
            changed.append("_get_layout.cache's content")
            _get_layout.cache.clear()
            _get_layout.cache.update(cache)
    assert not changed, changed
    assert Path("/").is_symlink() is False and Path("/a/b/c").parents[1] == Path("/a")
    assert _get_layout("torch.strided") is torch.strided


@pytest.mark.parametrize("trick", REWRITES)
def test_a_metadata_that_rewrites_a_class_or_function_is_one_line_and_changes_nothing(tmp_path, trick):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    _plant(tmp_path / "step-000002", trick)
    with untouched():
        with pytest.raises(native.CheckpointError) as e:
            loader.load_model(tmp_path)  # sample.py, the server, --init-from, the HF export
        assert str(e.value).startswith(f"{tmp_path / 'last.dcp'} is not a readable DCP checkpoint: BUILD on ")
        assert "\n" not in str(e.value)
        with pytest.raises(native.CheckpointError):
            dcp.load(tmp_path / "last.dcp", *trained(steps=0))  # --resume --fsdp, in each process
    assert (tmp_path / "step-000002").is_dir()


@pytest.mark.parametrize("trick", REWRITES)
def test_init_from_such_a_checkpoint_is_one_line(tiny_char_data, tmp_path, capsys, trick):
    from gpt.data.tokens import open_dataset

    model, optimizer = trained()
    meta = native.build_meta(model_config=CFG.to_dict(), tokenizer=open_dataset(tiny_char_data).tokenizer_spec)
    (tmp_path / "base").mkdir()
    dcp.save(tmp_path / "base" / "last.dcp", model, optimizer, meta, scaler=None, rng=[])
    _plant(tmp_path / "base" / "step-000000", trick)
    argv = ["--data", tiny_char_data, "--out-dir", tmp_path / "out", "--init-from", tmp_path / "base", *TRAIN]
    with untouched():
        err = one_line_error(capsys, train_script.main, *argv, "--max-iters", "2")
    assert err.startswith(f"error: {tmp_path / 'base' / 'last.dcp'} is not a readable DCP checkpoint: ")


def test_resume_fsdp_from_such_a_checkpoint_is_one_line_and_keeps_the_run(char_data, tmp_path):
    """Under torchrun (where, rewritten, `is_symlink` made the next save delete every step-* of the run)."""
    from test_parallel import TINY, torchrun

    run = tmp_path / "run"
    torchrun(1, "--data", char_data, "--out-dir", run, *TINY, "--max-iters", "2", "--no-plot", "--fsdp")
    _plant(run / "step-000002", "PosixPath.is_symlink")
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "train.py"]
        + ["--resume", str(run), "--max-iters", "4"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
    )
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode != 0 and errors == [
        f"error: {run / 'last.dcp'} is not a readable DCP checkpoint: BUILD on pathlib.PosixPath is not allowed "
        f"in a checkpoint's .metadata"
    ], res.stderr[-3000:]
    ours = res.stderr.split("torch/distributed/elastic")[0]  # (then the launcher's own report, a traceback)
    assert "Traceback" not in ours and "(exitcode: 2)" in res.stderr
    assert os.readlink(run / "last.dcp") == "step-000002"
    assert native.is_sharded(run / "step-000002")


def test_a_refused_name_imports_nothing(tmp_path):
    """A name is looked up in a table, never with getattr: `torch._dynamo` would import torch's compiler."""
    model, optimizer = trained()
    good, hostile = tmp_path / "good", tmp_path / "hostile"
    for run in (good, hostile):
        run.mkdir()
        save(run, model, optimizer, step=2)
    data = (hostile / "step-000002" / ".metadata").read_bytes()
    (hostile / "step-000002" / ".metadata").write_bytes(data[:2] + b"ctorch\n_dynamo\n0" + data[2:])
    code = (
        "import sys; from gpt.checkpoints import loader, native; "
        f"loader.load_model({str(good)!r}); before = set(sys.modules)\n"  # (the first load imports DCP's readers)
        f"try: loader.load_model({str(hostile)!r})\n"
        "except native.CheckpointError as e: print(e)\n"
        "print(sorted(set(sys.modules) - before), 'torch._dynamo' in before)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.stdout.splitlines() == [
        f"{hostile / 'last.dcp'} is not a readable DCP checkpoint: torch._dynamo is not allowed in a checkpoint's "
        ".metadata",
        "[] False",
    ], res.stderr[-2000:]


def test_a_new_run_keeps_a_sharded_checkpoint_no_link_points_to(tmp_path):
    """A save killed after its directory's rename, before the link switch, or a checkpoint kept by hand: the
    first save of a new --fsdp run would have deleted it."""
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    (tmp_path / "last.dcp").unlink()
    with pytest.raises(RunDirError) as e, RunDir(tmp_path).claim(resume=False, force=False):
        pass
    assert str(e.value) == (
        f"--out-dir {tmp_path} holds the checkpoint step-000002/, which no last.dcp points to; move it elsewhere, "
        f"or pass --force to start over there (it is removed)"
    )
    assert native.is_sharded(tmp_path / "step-000002")
    (tmp_path / "step-000001").mkdir()  # not a checkpoint (no meta.json, no .metadata): no run
    shutil.move(tmp_path / "step-000002", tmp_path.parent / f"{tmp_path.name}-kept")
    with RunDir(tmp_path).claim(resume=False, force=False):
        pass
    save(tmp_path, model, optimizer, step=2)
    (tmp_path / "last.dcp").unlink()
    with RunDir(tmp_path).claim(resume=False, force=True):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncated", "storage '__0_0.distcp' is read past its end"),
        ("zeroed", "a shard holds objects other than tensors, or is damaged"),
    ],
)
def test_a_damaged_shard_is_one_line(tmp_path, damage, reason):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    shard = tmp_path / "step-000002" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2) if damage == "truncated" else f.write(bytes(size))
    message = f"{tmp_path / 'last.dcp'} is not a readable DCP checkpoint: {reason}"
    with pytest.raises(native.CheckpointError) as e:
        loader.load_model(tmp_path)
    assert str(e.value) == message
    with pytest.raises(native.CheckpointError) as e:
        dcp.load(tmp_path / "last.dcp", *trained(steps=0))
    assert str(e.value) == message


BAD_TRAIN_STATE = {
    "not a dict": lambda t: [1, 2],
    "no rng": lambda t: {k: v for k, v in t.items() if k != "rng"},
    "an alias of a parameter the shards lack": lambda t: dict(t, aliases={"lm_head.weight": "nope"}),
    "groups naming other parameters": lambda t: dict(t, param_groups=[dict(t["param_groups"][0], params=["x"])]),
}


@pytest.mark.parametrize("change", BAD_TRAIN_STATE)
def test_a_bad_train_state_is_one_line(tmp_path, change):
    """train.pt is read with weights_only, but what it holds is the file's to say: checked before it is used."""
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    path = tmp_path / "step-000002" / "train.pt"
    torch.save(BAD_TRAIN_STATE[change](torch.load(path, weights_only=True)), path)
    with pytest.raises(native.CheckpointError, match=f"^{tmp_path}/(last.dcp|step-000002)[^\n]*$"):
        loader.load_model(tmp_path)
    if "alias" in change:  # (--resume --fsdp ties the weights of the model it loads into, not train.pt's)
        return
    with pytest.raises(native.CheckpointError, match=f"^{tmp_path}/(last.dcp|step-000002)[^\n]*$"):
        dcp.load(tmp_path / "last.dcp", *trained(steps=0))


def _first_entry(metadata):
    return metadata.state_dict_metadata["model.transformer.wte.weight"]


def _a_chunk_twice(metadata) -> None:
    """The first chunk again (a new instance, its sizes shared): DCP would read and copy it twice."""
    chunks = _first_entry(metadata).chunks
    chunks.append(ChunkStorageMetadata(chunks[0].offsets, chunks[0].sizes))


def _the_largest_region_twice(metadata) -> None:
    """The smallest region of a shard made its largest: DCP would read those bytes twice (any number of times)."""
    infos = sorted(metadata.storage_data.values(), key=lambda info: info.length)
    infos[0].offset, infos[0].length = infos[-1].offset, infos[-1].length


def _stored_elsewhere(metadata) -> None:
    """The first entry's storage filed under another offset: its chunk is stored nowhere."""
    storage = metadata.storage_data
    (index,) = [i for i in storage if i.fqn == "model.transformer.wte.weight"]
    storage[dataclasses.replace(index, offset=torch.Size([1, 0]))] = storage.pop(index)


INDEX_CHANGES = {  # each keeps DCP's own classes: the index is well formed, what it says is not
    "a place outside the saved state": (
        lambda m: m.planner_data.update({"model.transformer.wte.weight": ("os", "system")}),
        "entry 'model.transformer.wte.weight' has no place in the saved state dict",
    ),
    "a tensor larger than its chunks (an allocation bomb)": (
        lambda m: setattr(_first_entry(m), "size", torch.Size([2**40, 16])),
        "entry 'model.transformer.wte.weight' has chunks holding less than the tensor",
    ),
    "a chunk outside its tensor": (
        lambda m: setattr(_first_entry(m).chunks[0], "offsets", torch.Size([64, 0])),
        "entry 'model.transformer.wte.weight' has a chunk outside the tensor",
    ),
    "chunks holding more than their tensor": (
        _a_chunk_twice,
        "entry 'model.transformer.wte.weight' has chunks holding more than the tensor",
    ),
    "chunks holding less than their tensor (a hole read as whatever memory held)": (
        lambda m: setattr(_first_entry(m).chunks[0], "sizes", torch.Size([1, 16])),
        "entry 'model.transformer.wte.weight' has chunks holding less than the tensor",
    ),
    "regions of a shard adding up to more than the shard": (
        _the_largest_region_twice,
        "storage '__0_0.distcp' has regions adding up to more than its ",
    ),
    "a chunk stored nowhere": (
        _stored_elsewhere,
        "entry 'model.transformer.wte.weight' has a chunk stored nowhere",
    ),
}


@pytest.mark.parametrize("change", INDEX_CHANGES)
def test_an_index_that_says_the_wrong_thing_is_one_line(tmp_path, change):
    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    edit, reason = INDEX_CHANGES[change]
    _rewrite_metadata(tmp_path / "step-000002", edit)
    with pytest.raises(native.CheckpointError) as e:
        loader.load_model(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'last.dcp'} is not a readable DCP checkpoint: {reason}")


def test_point_and_the_plot_child_do_not_trust_pathlib(tmp_path, monkeypatch):
    """Defence in depth, had anything rewritten pathlib after import: the links are read with os.path (no
    checkpoint a link names is deleted), and the drawing child's import root was fixed at import."""
    import pathlib

    from gpt.train import plot

    model, optimizer = trained()
    save(tmp_path, model, optimizer, step=2)
    dcp.mark_best(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "is_symlink", lambda self: False)
        save(tmp_path, model, optimizer, step=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.dcp", "last.dcp", "step-000002", "step-000004"]
    started = []
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "resolve", lambda self, strict=False: pathlib.Path("/elsewhere/gpt/train/plot.py"))
        m.setattr(plot.subprocess, "Popen", lambda *args, **kw: started.append(kw["env"]["PYTHONPATH"]))
        plot.FigureWriter(tmp_path, warn=print).update()
    import gpt

    assert started[0].split(os.pathsep)[0] == os.path.dirname(os.path.dirname(os.path.realpath(gpt.__file__)))

import errno
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, SHAKESPEARE, SHARED_DATA

import gpt.data.prepare
from gpt.data.prepare import prepare
from gpt.data.tokenizer import get_tokenizer
from gpt.data.tokens import Batches, DataError, open_dataset
from gpt.errors import UserError

# ---- round trips on tiny-shakespeare ----------------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt2", "char", "bpe"])
def shakespeare_ds(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "ds"
    summary = prepare(
        [SHAKESPEARE],
        out,
        request.param,
        vocab_size=1024 if request.param == "bpe" else None,
        chunk_bytes=1 << 16,
        progress=False,  # small chunks: many chunk boundaries in one file
    )
    return summary, open_dataset(out, verify=True)


def test_round_trip_decodes_to_the_source(shakespeare_ds, shakespeare_text):
    summary, ds = shakespeare_ds
    tok = get_tokenizer(ds.tokenizer_spec)
    train, val = ds.split("train"), ds.split("val")
    assert val[-1] == tok.eot_token and tok.eot_token not in train[:]  # one document: it ends in val
    train_text, val_text = tok.decode(train), tok.decode(val[:-1])
    assert train_text + val_text == shakespeare_text
    assert abs(len(val_text) / len(shakespeare_text) - 0.1) < 0.001 and train_text.endswith("\n")  # cut at a line start
    # chunked encoding gives exactly the ids of encoding each split's text whole
    assert np.array_equal(train, tok.encode(train_text)) and np.array_equal(val[:-1], tok.encode(val_text))
    meta = ds.meta
    assert meta["splits"]["train"]["tokens"] == len(train) and meta["splits"]["val"]["tokens"] == len(val)
    assert meta["tokens"] == len(train) + len(val) == sum(summary.tokens.values())
    assert meta["documents"] == 1 and meta["corpus"]["split_by"] == "tail"
    assert meta["corpus"]["bytes"] == SHAKESPEARE.stat().st_size and meta["corpus"]["replaced_bytes"] == 0
    assert meta["vocab_size"] == tok.vocab_size and meta["eot_token"] == tok.eot_token


def test_round_trip_windows_are_source_text(shakespeare_ds, shakespeare_text):
    _, ds = shakespeare_ds
    tok = ds.tokenizer()
    train = ds.split("train")
    b = Batches(train, block_size=64, batch_size=8, seed=1)
    x, y = b.get(5)
    for row_x, row_y, start in zip(x, y, b.window_starts(5)):
        assert tok.decode(row_x.tolist()) == tok.decode(train[start : start + 64])
        assert tok.decode(row_x.tolist()) in shakespeare_text
        assert tok.decode(row_x[:1].tolist() + row_y.tolist()) in shakespeare_text


def test_tokenizer_kinds_and_specs(shakespeare_ds, shakespeare_text, tmp_path):
    _, ds = shakespeare_ds
    kind = ds.meta["tokenizer"]["kind"]
    spec = json.loads(json.dumps(ds.tokenizer_spec))  # as a checkpoint would store it
    if kind == "gpt2":
        assert ds.vocab_size == 50257 and ds.meta["dtype"] == "uint16"
        assert (
            len(ds.split("train")) + len(ds.split("val")) == 338_026
        )  # nanoGPT's 301,966 + 36,059, +1 EOT, cut moved to a line start
    elif kind == "char":
        assert ds.meta["tokenizer"]["chars"] == "".join(sorted(set(shakespeare_text)))
        assert ds.vocab_size == 66 and len(ds.split("train")) + len(ds.split("val")) == len(shakespeare_text) + 1
    else:
        assert ds.vocab_size == 1024 and ds.meta["tokenizer"]["ranks_file"] == "tokenizer.tiktoken"
        assert "ranks" not in ds.meta["tokenizer"] and "ranks" in spec  # the file in the dir, inline in the spec
        # a checkpoint's copy of the spec rebuilds the tokenizer once the dataset directory is gone
        moved = shutil.copytree(ds.path, tmp_path / "moved")
        spec = json.loads(json.dumps(open_dataset(moved).tokenizer_spec))
        shutil.rmtree(moved)
        rebuilt = get_tokenizer(spec)
        assert np.array_equal(
            rebuilt.encode(shakespeare_text[:5000]), ds.split("train")[: len(rebuilt.encode(shakespeare_text[:5000]))]
        )
    assert get_tokenizer(spec).vocab_size == ds.vocab_size


# ---- corpora of many documents, big vocabularies ----------------------------------------------------


def test_directory_of_documents(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    text = SHAKESPEARE.read_text(encoding="utf-8")
    parts = [text[i * 20_000 : (i + 1) * 20_000] for i in range(20)]
    for i, part in enumerate(parts):
        (corpus / ("sub" if i >= 10 else "") / f"{i:02d}.txt").write_text(part, encoding="utf-8")
    (corpus / ".notes.txt").write_text("hidden")
    (corpus / "logo.png").write_bytes(b"\x89PNG\0\0")
    summary = prepare([corpus], tmp_path / "ds", "char", block_size=64, progress=False)
    ds = open_dataset(tmp_path / "ds")
    tok = ds.tokenizer()
    assert summary.documents == ds.meta["documents"] == 20 and ds.meta["corpus"]["split_by"] == "document"
    assert ds.meta["splits"]["val"]["documents"] == 2 and ds.meta["splits"]["train"]["documents"] == 18
    val_docs = tok.decode(ds.split("val")).split("<|endoftext|>")
    assert val_docs == [parts[9], parts[19], ""]  # every 10th document, each ending in end-of-text
    train_docs = tok.decode(ds.split("train")).split("<|endoftext|>")
    assert train_docs == [p for i, p in enumerate(parts) if i not in (9, 19)] + [""]


def test_vocabulary_over_65535_is_uint32(tmp_path):
    chars = "".join(chr(c) for c in range(0x20000, 0x20000 + 70_010))  # CJK extension planes
    (tmp_path / "wide.txt").write_text(chars + "\n" + chars[::-1], encoding="utf-8")
    prepare([tmp_path / "wide.txt"], tmp_path / "ds", "char", block_size=8, progress=False)
    ds = open_dataset(tmp_path / "ds", verify=True)
    assert ds.meta["dtype"] == "uint32" and ds.vocab_size == 70_012  # 70,010 + newline + end-of-text
    train = ds.split("train")
    assert train.dtype == np.uint32 and train[69_999] == 70_000 and int(train.max()) == 70_010
    assert ds.tokenizer().decode([70_000]) == chr(0x20000 + 70_000 - 1)  # id 0 is the newline
    assert ds.tokenizer().decode(train) + ds.tokenizer().decode(ds.split("val")[:-1]) == chars + "\n" + chars[::-1]


# ---- bad input: one error each, nothing written --------------------------------------------------------


def _nothing_written(parent, name="ds"):
    return not (parent / name).exists() and not list(parent.glob(f".{name}.tmp-*"))


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"no such file or directory: .*nope\.txt"):
        prepare([SHAKESPEARE, tmp_path / "nope.txt"], tmp_path / "ds", "char", progress=False)
    assert _nothing_written(tmp_path)


def test_empty_corpus(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    (tmp_path / "in" / ".hidden").write_text("text")
    with pytest.raises(DataError, match=r"empty corpus: no text in .*in \(only empty, hidden or binary files\)"):
        prepare([tmp_path / "in"], tmp_path / "ds", "gpt2", progress=False)
    assert _nothing_written(tmp_path)


def test_corpus_smaller_than_one_window(tmp_path):
    (tmp_path / "small.txt").write_text("To be, or not to be, that is the question.\n" * 100)
    with pytest.raises(
        DataError,
        match=r"corpus too small: the val split has [\d,]+ tokens, fewer than one training "
        r"window of block_size \+ 1 = 1,025.*--block-size or a larger --val-fraction",
    ):
        prepare([tmp_path / "small.txt"], tmp_path / "new" / "sub" / "ds", "gpt2", block_size=1024, progress=False)
    assert not (tmp_path / "new").exists()  # not even the parent directories it made
    prepare([tmp_path / "small.txt"], tmp_path / "ds", "gpt2", block_size=32, progress=False)  # fits


def test_bytes_that_are_not_utf8_are_replaced_and_counted(tmp_path, capsys):
    good = SHAKESPEARE.read_bytes()[:20_000]
    (tmp_path / "latin1.txt").write_bytes(good[:10_000] + "Crème brûlée\n".encode("latin-1") + good[10_000:])
    summary = prepare([tmp_path / "latin1.txt"], tmp_path / "ds", "char", block_size=32, progress=False)
    assert summary.replaced_bytes == 3 and "3 bytes that were not UTF-8 replaced by U+FFFD" in summary.line()
    assert "latin1.txt: 3 bytes that are not UTF-8 replaced by U+FFFD" in capsys.readouterr().err
    ds = open_dataset(tmp_path / "ds")
    assert ds.meta["corpus"]["replaced_bytes"] == 3
    assert "Cr\ufffdme br\ufffdl\ufffde" in ds.tokenizer().decode(ds.split("train"))
    with pytest.raises(DataError, match=r"latin1.txt: bytes at offset 10002 are not UTF-8"):
        prepare([tmp_path / "latin1.txt"], tmp_path / "strict", "char", block_size=32, strict_utf8=True, progress=False)
    assert _nothing_written(tmp_path, "strict")


def test_existing_dataset_is_refused_unless_force(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 500)
    (tmp_path / "b.txt").write_text("goodbye moon. " * 500)
    prepare([tmp_path / "a.txt"], tmp_path / "ds", "char", block_size=16, progress=False)
    before = (tmp_path / "ds" / "train.bin").read_bytes()
    with pytest.raises(DataError, match=r"ds already holds a dataset \(train.bin, val.bin, meta.json\): pass --force"):
        prepare([tmp_path / "b.txt"], tmp_path / "ds", "char", block_size=16, progress=False)
    assert (tmp_path / "ds" / "train.bin").read_bytes() == before
    (tmp_path / "ds" / "notes.md").write_text("mine")
    prepare([tmp_path / "b.txt"], tmp_path / "ds", "bpe", vocab_size=300, block_size=16, force=True, progress=False)
    ds = open_dataset(tmp_path / "ds", verify=True)
    assert ds.tokenizer().decode(ds.split("train")).startswith("goodbye moon.")
    prepare([tmp_path / "a.txt"], tmp_path / "ds", "char", block_size=16, force=True, progress=False)
    assert not (tmp_path / "ds" / "tokenizer.tiktoken").exists()  # the replaced BPE's ranks are gone
    assert (tmp_path / "ds" / "notes.md").read_text() == "mine"  # other files are never touched
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"could not write .*file: it is a file, not a directory; choose another --out"):
        prepare([tmp_path / "a.txt"], tmp_path / "file", "char", force=True, progress=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tokenizer": "sentencepiece"}, "unknown --tokenizer 'sentencepiece'"),
        ({"tokenizer": "char", "vocab_size": 100}, "--vocab-size is for --tokenizer bpe"),
        ({"tokenizer": "char", "tokenizer_file": "x"}, "--tokenizer-file is GPT-2's ranks file"),
        ({"tokenizer": "bpe", "vocab_size": 100}, "--vocab-size 100 is too small"),
        ({"tokenizer": "char", "val_fraction": 0}, "--val-fraction must be between 0 and 1"),
        ({"tokenizer": "gpt2", "tokenizer_file": "/no/gpt2.tiktoken"}, "GPT-2 ranks file not found: /no/gpt2.tiktoken"),
    ],
)
def test_bad_options(tmp_path, kwargs, message):
    with pytest.raises(DataError, match=message):
        prepare([SHAKESPEARE], tmp_path / "ds", progress=False, **kwargs)
    assert _nothing_written(tmp_path)


# ---- interruptions ----------------------------------------------------------------------------------


def _interrupt_after(monkeypatch, calls):
    real, count = gpt.data.prepare._SplitWriter.write, [0]

    def write(self, ids):
        count[0] += 1
        if count[0] > calls:
            raise KeyboardInterrupt
        real(self, ids)

    monkeypatch.setattr(gpt.data.prepare._SplitWriter, "write", write)


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
    _interrupt_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        prepare([SHAKESPEARE], tmp_path / "ds", "char", chunk_bytes=1 << 14, progress=False)
    assert _nothing_written(tmp_path)


def test_interrupted_force_keeps_the_old_dataset(tmp_path, monkeypatch):
    prepare([SHAKESPEARE], tmp_path / "ds", "char", progress=False)
    before = json.loads((tmp_path / "ds" / "meta.json").read_text())
    _interrupt_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        prepare([SHAKESPEARE], tmp_path / "ds", "gpt2", chunk_bytes=1 << 14, force=True, progress=False)
    assert open_dataset(tmp_path / "ds", verify=True).meta == before
    assert not list(tmp_path.glob(".ds.tmp-*"))


def test_interrupted_while_moving_into_place_does_not_look_complete(tmp_path, monkeypatch):
    prepare([SHAKESPEARE], tmp_path / "ds", "char", progress=False)
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("val.bin"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(gpt.data.prepare.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        prepare([SHAKESPEARE], tmp_path / "ds", "gpt2", force=True, progress=False)
    with pytest.raises(DataError, match="no meta.json in .*interrupted prepare"):
        open_dataset(tmp_path / "ds")


def test_leftovers_of_a_killed_prepare_are_removed(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".ds.tmp-{int(done.stdout)}-abc"
    (dead).mkdir()
    (dead / "train.bin").write_bytes(b"\0" * 10)
    alive = tmp_path / f".ds.tmp-{os.getpid()}-xyz"  # a prepare still running (this process)
    alive.mkdir()
    messages = []
    prepare([SHAKESPEARE], tmp_path / "ds", "char", progress=False, log=messages.append)
    assert not dead.exists() and alive.exists()
    assert messages == [f"removed {dead}, left by an interrupted prepare"]


# ---- command line -----------------------------------------------------------------------------------


def _run(script, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_cli_prepares_and_summarises(tmp_path):
    r = _run(
        "data/prepare.py",
        SHAKESPEARE,
        SHARED_DATA / "wikitext2-valid.txt",
        "--out",
        tmp_path / "ds",
        "--tokenizer",
        "gpt2",
        "--val-fraction",
        "0.5",
        "--tokenizer-file",
        SHARED_DATA / "gpt2.tiktoken",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"prepared {tmp_path / 'ds'}: 2 documents, ") and "MB/s" in r.stdout
    assert r.stdout.count("\n") == 1 and r.stderr == ""  # no progress bar when stderr is not a terminal
    ds = open_dataset(tmp_path / "ds", verify=True)
    assert ds.meta["corpus"]["split_by"] == "document" and ds.meta["splits"]["val"]["documents"] == 1


def test_cli_errors_are_one_line(tmp_path):
    r = _run("data/prepare.py", tmp_path / "missing.txt", "--out", tmp_path / "ds", "--tokenizer", "char")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: no such file or directory: {tmp_path / 'missing.txt'}\n"


def _recipe(name, argv, capsys):
    main = runpy.run_path(str(ROOT / "data" / name / "prepare.py"), run_name="recipe")["main"]
    code = main([str(a) for a in argv])
    return code, capsys.readouterr()


def test_recipes(tmp_path, capsys):
    code, out = _recipe("shakespeare_char", ["--input", SHAKESPEARE, "--out", tmp_path / "char"], capsys)
    assert code == 0 and "vocab 66 as uint16" in out.out
    code, out = _recipe("shakespeare", ["--input", SHAKESPEARE, "--out", tmp_path / "gpt2"], capsys)
    assert code == 0 and "gpt2 vocab 50,257" in out.out
    assert open_dataset(tmp_path / "char").meta["tokenizer"]["kind"] == "char"
    assert open_dataset(tmp_path / "gpt2").meta["splits"]["train"]["tokens"] == 301_968
    code, out = _recipe("shakespeare_char", ["--input", SHAKESPEARE, "--out", tmp_path / "char"], capsys)
    assert code == 2 and out.err.startswith("error: ") and "--force" in out.err and out.err.count("\n") == 1


def test_recipe_offline_without_input_says_what_to_do(tmp_path, capsys, monkeypatch):
    import urllib.request

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    main = runpy.run_path(str(ROOT / "data" / "shakespeare_char" / "prepare.py"), run_name="recipe")["main"]
    input_txt = ROOT / "data" / "shakespeare_char" / "input.txt"
    if input_txt.exists():
        pytest.skip("input.txt was already downloaded")
    assert main(["--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot download https://") and "pass --input FILE" in err and not input_txt.exists()


# ---- where the dataset goes: one line for each place it cannot be written, nothing left behind ------


def _one_line_error(r, expected):
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr == f"error: {expected}\n"


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_cli_out_that_is_or_lies_under_a_file(tmp_path, where):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    out = notes if where == "file" else notes / "ds"
    r = _run("data/prepare.py", SHAKESPEARE, "--out", out, "--tokenizer", "char", "--force")
    what = "it is a file" if where == "file" else f"{notes} is a file"
    _one_line_error(r, f"could not write {out}: {what}, not a directory; choose another --out")
    assert notes.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.fixture
def read_only_dir():
    """(a directory the prepare cannot write into, the command prefix that makes it so). Permissions do
    not bind root, so as root the prepare runs as `nobody` (setpriv), in a directory it can reach."""
    base = Path(tempfile.mkdtemp(prefix="gpt-read-only-"))
    base.chmod(0o755)
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot make a directory read-only for the prepare")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    (base / "ro").mkdir()
    (base / "ro" / "corpus.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:50_000])
    (base / "ro" / "s.txt").write_text("ein Haus\nzwei Hunde\n" * 10)
    (base / "ro" / "t.txt").write_text("a house\ntwo dogs\n" * 10)
    (base / "ro").chmod(0o555)
    yield base / "ro", prefix
    (base / "ro").chmod(0o755)
    shutil.rmtree(base)


@pytest.mark.parametrize("kind", ["text", "pairs"])
def test_cli_out_in_a_read_only_directory(read_only_dir, kind):
    ro, prefix = read_only_dir
    inputs = [ro / "corpus.txt", "--block-size", 64] if kind == "text" else ["--pairs", ro / "s.txt", ro / "t.txt"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [
            *prefix,
            sys.executable,
            str(ROOT / "data" / "prepare.py"),
            *map(str, inputs),
            "--out",
            str(ro / "ds"),
            "--tokenizer",
            "char",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    _one_line_error(
        r, f"could not write {ro / 'ds'}: permission denied; choose a writable location; nothing was written"
    )
    assert sorted(p.name for p in ro.iterdir()) == ["corpus.txt", "s.txt", "t.txt"]


def test_cli_full_disk_keeps_the_dataset_and_removes_the_temporary_directory(tmp_path, monkeypatch, capsys):
    prepare([SHAKESPEARE], tmp_path / "ds", "char", progress=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ds").iterdir()}
    real, calls = gpt.data.prepare._SplitWriter.write, [0]

    def write(self, ids):  # the disk fills up after a few chunks
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, ids)

    monkeypatch.setattr(gpt.data.prepare._SplitWriter, "write", write)
    main = runpy.run_path(str(ROOT / "data" / "prepare.py"), run_name="script")["main"]
    out = tmp_path / "ds"
    assert main([str(SHAKESPEARE), "--out", str(out), "--tokenizer", "gpt2", "--force", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"error: could not write {out}: the disk is full; free some space; the dataset in {out} was left as it was\n"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and sorted(os.listdir(tmp_path)) == ["ds"]
    calls[0] = 0
    assert main([str(SHAKESPEARE), "--out", str(tmp_path / "new" / "ds"), "--tokenizer", "char", "--quiet"]) == 2
    assert capsys.readouterr().err.endswith("the disk is full; free some space; nothing was written\n")
    assert sorted(os.listdir(tmp_path)) == ["ds"]


# ---- bad options: one line each ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, -2])
def test_cli_workers_below_one(tmp_path, workers):
    r = _run("data/prepare.py", SHAKESPEARE, "--out", tmp_path / "ds", "--tokenizer", "char", "--workers", workers)
    _one_line_error(r, f"--workers must be >= 1 (encoding threads), got {workers}; leave it out to use every core")
    assert not list(tmp_path.iterdir())


def test_cli_tokenizer_file_that_is_not_a_ranks_file(tmp_path):
    for args in ([SHAKESPEARE], ["--pairs", SHAKESPEARE, SHAKESPEARE]):
        r = _run("data/prepare.py", *args, "--out", tmp_path / "ds", "--tokenizer-file", SHAKESPEARE)
        _one_line_error(
            r,
            f"{SHAKESPEARE} (from --tokenizer-file) is not a tiktoken ranks file: line 1 is not "
            f"`base64-token rank`; point --tokenizer-file at GPT-2's ranks file, gpt2.tiktoken",
        )
    assert not list(tmp_path.iterdir())


def test_cli_gpt2_tiktoken_file_variable_that_is_not_a_ranks_file(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPT2_TIKTOKEN_FILE=str(SHAKESPEARE))
    r = subprocess.run(
        [sys.executable, str(ROOT / "data" / "prepare.py"), str(SHAKESPEARE), "--out", str(tmp_path / "ds")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    _one_line_error(
        r,
        f"{SHAKESPEARE} (from GPT2_TIKTOKEN_FILE) is not a tiktoken ranks file: line 1 is not "
        f"`base64-token rank`; point GPT2_TIKTOKEN_FILE at GPT-2's ranks file, gpt2.tiktoken",
    )


@pytest.mark.parametrize("unknown", ["refuse", "replace"])
def test_reused_char_vocabulary_in_any_order(tmp_path, unknown):
    """A reused char vocabulary need not be sorted (an edited meta.json): each character still gets its own id."""
    from gpt.data.vocab import Reused

    chars = "zyx ba\n?c"  # deliberately out of code point order
    text = "abc xyz?\n" * 300 + ("q" if unknown == "replace" else "")
    (tmp_path / "t.txt").write_text(text)
    prepare(
        [tmp_path / "t.txt"], tmp_path / "d", tokenizer_from=Reused({"kind": "char", "chars": chars}, "char"),
        unknown=unknown, replacement="?" if unknown == "replace" else None, block_size=8, log=lambda m: None,
    )  # fmt: skip
    ds = open_dataset(tmp_path / "d")
    ids = np.concatenate([ds.split("train")[:], ds.split("val")[:]]).tolist()
    assert "".join(chars[i] for i in ids if i < len(chars)) == text.replace("q", "?")

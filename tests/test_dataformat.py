"""gpt/data/format.py: one on-disk format for token and pairs datasets (meta.json's schema, the version
key, atomic publishing) that the data-preparation path reads and writes without importing torch."""

import copy
import errno
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, SHAKESPEARE

from gpt.data.format import DataError, read_meta, write_meta
from gpt.data.pairs import prepare_pairs
from gpt.data.prepare import prepare
from gpt.data.staging import staged
from gpt.errors import StorageError


@pytest.fixture(scope="module")
def metas(tmp_path_factory):
    """meta.json of a freshly prepared token dataset and pairs dataset, by kind."""
    d = tmp_path_factory.mktemp("metas")
    (d / "c.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(500)))
    prepare([d / "c.txt"], d / "tokens", "char", block_size=16, progress=False)
    (d / "s.txt").write_text("ein Haus\nzwei Hunde\ndrei Katzen\n")
    (d / "t.txt").write_text("a house\ntwo dogs\nthree cats\n")
    prepare_pairs(d / "s.txt", d / "t.txt", d / "pairs", tokenizer="char", val_pairs=(d / "s.txt", d / "t.txt"))
    return {kind: json.loads((d / kind / "meta.json").read_text()) for kind in ("tokens", "pairs")}


DELETE = object()


def _edited(meta, **edits):
    """A copy of `meta` with dotted fields (given as splits__train__file=...) set, or deleted with DELETE."""
    meta = copy.deepcopy(meta)
    for dotted, value in edits.items():
        *parents, key = dotted.split("__")
        obj = meta
        for p in parents:
            obj = obj[p]
        if value is DELETE:
            del obj[key]
        else:
            obj[key] = value
    return meta


def _read(tmp_path, meta, kind):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return read_meta(tmp_path, kind)


def test_prepared_datasets_pass_and_name_their_version_and_kind(metas, tmp_path):
    for kind, meta in metas.items():
        assert meta["format_version"] == 1 and meta["kind"] == kind and "format" not in meta  # one version key
        assert all(isinstance(meta["splits"][s]["max_id"], int) for s in ("train", "val"))
        assert _read(tmp_path, meta, kind) == meta


def test_datasets_of_older_versions_still_open(metas, tmp_path):
    old_tokens = _edited(metas["tokens"], kind=DELETE, splits__train__max_id=DELETE, splits__val__max_id=DELETE)
    assert _read(tmp_path, old_tokens, "tokens") == old_tokens  # token datasets had no kind and no max_id
    old_pairs = _edited(metas["pairs"], format_version=DELETE, format=1, splits__train__max_id=DELETE)
    assert _read(tmp_path, old_pairs, "pairs") == old_pairs  # pairs datasets named the version "format"


WRONG_TOKENS = [
    ({"vocab_size": "66"}, r': vocab_size is "66", expected a whole number >= 1'),
    ({"vocab_size": -3}, r": vocab_size is -3, expected a whole number >= 1"),
    ({"vocab_size": True}, r": vocab_size is true, expected a whole number >= 1"),
    ({"vocab_size": 70_000}, r": vocab_size 70000 does not fit dtype uint16"),
    ({"format_version": DELETE}, r" lacks format_version"),
    ({"format_version": "1"}, r': format_version is "1", expected 1, the version this gpt reads'),
    ({"kind": "images"}, r""": kind is "images", expected one of 'tokens', 'pairs'"""),
    ({"dtype": "float32"}, r""": dtype is "float32", expected one of 'uint16', 'uint32'"""),
    ({"eot_token": 10**6}, r": eot_token is 1000000, expected a whole number from 0 to \d+"),
    ({"tokenizer": "char"}, r': tokenizer is "char", expected an object'),
    ({"tokenizer__kind": DELETE}, r" lacks tokenizer.kind"),
    (
        {"tokenizer__kind": "sentencepiece"},
        r""": tokenizer.kind is "sentencepiece", expected one of 'gpt2', 'char', 'bpe'""",
    ),
    ({"tokenizer__chars": DELETE}, r" lacks tokenizer.chars"),
    ({"tokenizer__kind": "bpe"}, r" lacks tokenizer.ranks_file"),
    ({"splits": []}, r": splits is \[\], expected an object"),
    ({"splits__val": DELETE}, r" lacks splits.val"),
    ({"splits__train__file": DELETE}, r" lacks splits.train.file"),
    (
        {"splits__train__file": "../../etc/passwd"},
        r': splits.train.file is "../../etc/passwd", expected a file name in the dataset directory',
    ),
    ({"splits__val__tokens": -5}, r": splits.val.tokens is -5, expected a whole number >= 0"),
    ({"splits__val__sha256": DELETE}, r" lacks splits.val.sha256"),
    ({"splits__val__max_id": "7"}, r': splits.val.max_id is "7", expected a whole number >= 0'),
]


@pytest.mark.parametrize("edits, message", WRONG_TOKENS)
def test_every_wrong_field_of_a_token_dataset_is_one_line_naming_it(metas, tmp_path, edits, message):
    with pytest.raises(DataError) as e:
        _read(tmp_path, _edited(metas["tokens"], **edits), "tokens")
    text = str(e.value)
    assert text.startswith(str(tmp_path / "meta.json")) and "\n" not in text
    assert text.endswith(": prepare the dataset again with --force")
    assert e.match(message)


WRONG_PAIRS = [
    ({"bos": DELETE}, r" lacks bos"),
    ({"eos": 10**6}, r": eos is 1000000, expected a whole number from 0 to \d+"),
    ({"max_len": 1}, r": max_len is 1, expected a whole number >= 2"),
    ({"splits__train__pairs": 0}, r": splits.train.pairs is 0, expected a whole number >= 1"),
    ({"splits__val__max_src_len": "3"}, r': splits.val.max_src_len is "3", expected a whole number >= 0'),
    ({"format_version": DELETE, "format": 1, "kind": DELETE}, r" lacks kind"),
    ({"format_version": DELETE, "format": 2}, r": format is 2, expected 1, the version this gpt reads"),
]


@pytest.mark.parametrize("edits, message", WRONG_PAIRS)
def test_every_wrong_field_of_a_pairs_dataset_is_one_line_naming_it(metas, tmp_path, edits, message):
    with pytest.raises(DataError, match=message) as e:
        _read(tmp_path, _edited(metas["pairs"], **edits), "pairs")
    assert str(e.value).startswith(str(tmp_path / "meta.json")) and "\n" not in str(e.value)


@pytest.mark.parametrize("pattern", [r"((a+)+)\1b|.", r"(?<=a)"])  # seconds per encode; a panic on every encode
def test_a_tokenizer_pattern_gpt_does_not_know_is_one_line_naming_meta_json(metas, tmp_path, pattern):
    bpe = {"kind": "bpe", "pattern": pattern, "ranks_file": "tokenizer.tiktoken", "ranks_sha256": "0" * 64}
    (tmp_path / "tokenizer.tiktoken").write_text("")  # there: the pattern is what is wrong
    for spec in (bpe, {"kind": "specials", "base": bpe, "specials": ["<|end|>"]}):
        with pytest.raises(DataError, match="pre-tokenizer pattern '.*' is not one gpt knows") as e:
            _read(tmp_path, _edited(metas["tokens"], tokenizer=spec), "tokens")
        assert str(e.value).startswith(f"{tmp_path / 'meta.json'}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["tokens", "pairs"])
def test_meta_json_that_is_not_an_object(tmp_path, kind):
    for text, name in (("[]", "list"), ('"dataset"', "str"), ("null", "NoneType")):
        (tmp_path / "meta.json").write_text(text)
        with pytest.raises(DataError, match=rf"meta.json holds a JSON {name}, not an object of the dataset's fields"):
            read_meta(tmp_path, kind)


def test_the_wrong_kind_names_both_and_the_command(metas, tmp_path):
    with pytest.raises(DataError, match=r"holds translation pairs, not a token dataset: run `gpt prepare INPUT"):
        _read(tmp_path, metas["pairs"], "tokens")
    with pytest.raises(DataError, match=r"holds a token dataset, not translation pairs: run `gpt prepare --pairs"):
        _read(tmp_path, metas["tokens"], "pairs")


# ---- staging and publishing -------------------------------------------------------------------------


def _write_dataset_files(tmp, text):
    (tmp / "train.bin").write_text(text)
    write_meta(tmp, {"note": text})


def test_staged_publishes_meta_json_last_and_leaves_nothing_else(tmp_path):
    with staged(tmp_path / "ds") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".ds.tmp-{os.getpid()}-")
        _write_dataset_files(tmp, "one")
        assert not (tmp_path / "ds").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    assert json.loads((tmp_path / "ds" / "meta.json").read_text()) == {"note": "one"}


def test_a_full_disk_is_one_line_and_keeps_the_dataset(tmp_path):
    with staged(tmp_path / "ds") as tmp:
        _write_dataset_files(tmp, "old")
    with pytest.raises(StorageError) as e:
        with staged(tmp_path / "ds", force=True) as tmp:
            (tmp / "train.bin").write_text("new, half-written")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(e.value) == (
        f"could not write {tmp_path / 'ds'}: the disk is full; free some space; the dataset in "
        f"{tmp_path / 'ds'} was left as it was"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # the temporary directory is gone
    assert (tmp_path / "ds" / "train.bin").read_text() == "old"
    with pytest.raises(StorageError, match=r"the disk is full; free some space; nothing was written$"):
        with staged(tmp_path / "new" / "ds"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # nor the parent it made


def test_an_out_under_a_file_names_the_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "ds", tmp_path / "notes.txt" / "a" / "ds"):
        with pytest.raises(StorageError) as e:
            with staged(out):
                pytest.fail("a dataset cannot be written there")
        where = "it is a file" if out.name == "notes.txt" else f"{tmp_path / 'notes.txt'} is a file"
        assert str(e.value) == f"could not write {out}: {where}, not a directory; choose another --out"
    assert (tmp_path / "notes.txt").read_text() == "mine" and len(list(tmp_path.iterdir())) == 1


# ---- no torch on the data-preparation path -----------------------------------------------------------


def _prepare_without_torch(*args):
    """Run data/prepare.py's main in a fresh interpreter; report whether torch got imported."""
    code = (
        "import runpy, sys\n"
        f"main = runpy.run_path({str(ROOT / 'data' / 'prepare.py')!r}, run_name='prepare')['main']\n"
        "code = main(sys.argv[1:])\n"
        "print('exit', code, 'torch' if 'torch' in sys.modules else 'no torch')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr


def test_preparing_data_never_imports_torch(tmp_path):
    assert (
        _prepare_without_torch(
            SHAKESPEARE, "--out", tmp_path / "bpe", "--tokenizer", "bpe", "--vocab-size", 300, "--quiet"
        )
        == "exit 0 no torch"
    )
    (tmp_path / "s.txt").write_text("ein Haus\nzwei Hunde\n" * 20)
    (tmp_path / "t.txt").write_text("a house\ntwo dogs\n" * 20)
    assert (
        _prepare_without_torch(
            "--pairs",
            tmp_path / "s.txt",
            tmp_path / "t.txt",
            "--out",
            tmp_path / "pairs",
            "--tokenizer",
            "gpt2",
            "--val-fraction",
            0.1,
        )
        == "exit 0 no torch"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, gpt.data.format, gpt.data.prepare, gpt.data.pairs, gpt.data.tokenizer, "
            "gpt.data.bpe, gpt.data.corpus, gpt.data.records; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.stdout == "False\n", r.stderr

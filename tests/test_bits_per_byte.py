"""Bits per byte in training: prepare records each split's UTF-8 bytes, train.py logs the val loss in bits per
byte beside it (val_loss / ln 2 * tokens / bytes), and a dataset prepared before the count still trains."""

import json
import math
import shutil

import numpy as np
import pytest
from conftest import SHAKESPEARE, TRAIN, train_run

from gpt.data.prepare import prepare
from gpt.data.tokens import open_dataset

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", *TRAIN]


def text_bytes_by_decoding(dataset, split: str) -> int:
    tok, ids = dataset.tokenizer(), dataset.split(split)
    return len(tok.decode_bytes(ids[ids != tok.eot_token].tolist()))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two documents with non-ASCII characters (2- and 3-byte), and a record file of rows."""
    d = tmp_path_factory.mktemp("corpus")
    text = SHAKESPEARE.read_text(encoding="utf-8")
    (d / "a.txt").write_text(text[:6000] + "\nCaf\u00e9 na\u00efve \u2014 r\u00e9sum\u00e9.\n", encoding="utf-8")
    (d / "b.txt").write_text(text[6000:9000] + " \u00fcber \u20ac5", encoding="utf-8")
    rows = [{"text": f"row {i}: gr\u00fc\u00dfe, {text[i * 50 : i * 50 + 40]}"} for i in range(60)]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return d


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_prepare_records_the_bytes_of_each_split(corpus, tmp_path, tokenizer):
    files = [corpus / "a.txt", corpus / "b.txt"]
    meta = prepare(files, tmp_path / "ds", tokenizer, block_size=16, val_fraction=0.3, progress=False).meta
    splits = meta["splits"]
    # every byte of the two files is in one split or the other (UTF-8 without a BOM: text bytes = file bytes)
    assert splits["train"]["bytes"] + splits["val"]["bytes"] == sum(f.stat().st_size for f in files)
    ds = open_dataset(tmp_path / "ds")
    for split in ("train", "val"):
        assert splits[split]["bytes"] == text_bytes_by_decoding(ds, split) > 0
    if tokenizer == "char":  # one token per character: bytes exceed them by the 9 extra bytes of é ï — é é ü €
        chars = sum(int(np.count_nonzero(ds.split(s) != ds.tokenizer().eot_token)) for s in ("train", "val"))
        assert splits["train"]["bytes"] + splits["val"]["bytes"] == chars + 9

    rows = prepare([corpus / "rows.jsonl"], tmp_path / "rows", tokenizer, block_size=16, progress=False).meta
    ds = open_dataset(tmp_path / "rows")
    for split in ("train", "val"):  # rows: the text of each row, not the JSON around it
        assert rows["splits"][split]["bytes"] == text_bytes_by_decoding(ds, split) > 0


def without_bytes(dataset, to):
    """A copy of `dataset` as prepare wrote it before it recorded the bytes of each split."""
    shutil.copytree(dataset, to)
    meta = json.loads((to / "meta.json").read_text())
    for split in meta["splits"].values():
        del split["bytes"]
    (to / "meta.json").write_text(json.dumps(meta))
    return to


def test_an_old_dataset_counts_its_bytes_by_decoding_once(corpus, tmp_path):
    prepare([corpus / "a.txt", corpus / "b.txt"], tmp_path / "ds", "gpt2", block_size=16, progress=False)
    recorded = open_dataset(tmp_path / "ds").meta["splits"]["val"]["bytes"]
    old = open_dataset(without_bytes(tmp_path / "ds", tmp_path / "old"))
    assert "bytes" not in old.meta["splits"]["val"]
    assert old.text_bytes("val") == recorded


def eval_records(out):
    return [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


def test_train_logs_val_bits_per_byte(tiny_char_data, tmp_path, capsys):
    out = tmp_path / "run"
    train_run("--data", tiny_char_data, "--out-dir", out, *TINY, "--max-iters", "2", "--eval-interval", "2")
    meta = open_dataset(tiny_char_data).meta["splits"]["val"]
    (record,) = eval_records(out)
    want = record["val_loss"] / math.log(2) * meta["tokens"] / meta["bytes"]
    assert record["val_bpb"] == pytest.approx(want, rel=1e-12)
    # tiny-shakespeare is ASCII: one byte per character, so bits per byte is the loss in bits per token but for
    # the end-of-text id (a token of no bytes)
    ds = open_dataset(tiny_char_data)
    assert meta["bytes"] == int(np.count_nonzero(ds.split("val") != ds.tokenizer().eot_token))
    assert f"val bpb {record['val_bpb']:.4f}" in capsys.readouterr().out

    old = without_bytes(tiny_char_data, tmp_path / "old")  # prepared before the count: trains, bytes decoded
    train_run("--data", old, "--out-dir", tmp_path / "old-run", *TINY, "--max-iters", "2", "--eval-interval", "2")
    (again,) = eval_records(tmp_path / "old-run")
    assert again["val_loss"] == record["val_loss"] and again["val_bpb"] == pytest.approx(record["val_bpb"], rel=1e-12)


def test_no_bits_per_byte_where_the_bytes_cannot_be_counted(tiny_char_data, tmp_path, monkeypatch):
    from gpt.data.tokenizer import TokenizerError
    from gpt.data.tokens import TokenDataset

    def unbuildable(self):
        raise TokenizerError("GPT-2's BPE ranks are not here (offline)")

    old = without_bytes(tiny_char_data, tmp_path / "old")
    monkeypatch.setattr(TokenDataset, "tokenizer", unbuildable)
    train_run("--data", old, "--out-dir", tmp_path / "run", *TINY, "--max-iters", "2", "--eval-interval", "2")
    (record,) = eval_records(tmp_path / "run")
    assert record["val_bpb"] is None and math.isfinite(record["val_loss"])

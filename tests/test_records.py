"""Pretraining corpora as they ship: JSONL, gzip-compressed JSONL and Parquet, one document per row."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import GPT2_RANKS, ROOT, SHARED_DATA

from gpt.data.corpus import val_row
from gpt.data.prepare import prepare
from gpt.data.tokenizer import gpt2_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def rows():
    lines = (SHARED_DATA / "wikitext2-valid.txt").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip()][:600]


def write(path, texts, field="text"):
    if path.name.endswith(".parquet"):
        ids = list(range(len(texts)))
        pq.write_table(pa.table({"id": ids, field: texts}), path, row_group_size=64)  # many row groups
    else:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts))
    return path


def split_ids(out):
    meta = json.loads((out / "meta.json").read_text())
    return {s: np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]).tolist() for s in ("train", "val")}


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.parquet"])
def test_each_row_is_a_document_and_every_10th_goes_to_val(tmp_path, name):
    texts = rows()
    summary = prepare([write(tmp_path / name, texts)], tmp_path / "out", "gpt2", block_size=64, progress=False)
    tok = gpt2_tokenizer(str(GPT2_RANKS))
    want = {"train": [], "val": []}
    for i, t in enumerate(texts):
        want["val" if val_row(i, 0.1) else "train"] += tok.encode(t) + [tok.eot_token]
    assert split_ids(tmp_path / "out") == want
    assert summary.documents == 600 and summary.meta["splits"]["val"]["documents"] == 60


def test_record_files_mix_with_text_files_and_directories(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write(shards / "a.parquet", rows()[:300])
    write(shards / "b.jsonl.gz", rows()[300:])
    text = tmp_path / "notes.txt"
    text.write_text((SHARED_DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")[:50_000])
    summary = prepare([shards, text], tmp_path / "out", "gpt2", block_size=64, progress=False)
    assert summary.documents == 601  # the text file and 600 rows
    alone = prepare([write(tmp_path / "all.jsonl", rows())], tmp_path / "alone", "gpt2", block_size=64, progress=False)
    assert summary.tokens["val"] > alone.tokens["val"]  # the text file's tail joined val
    assert "record files: by row" in summary.meta["corpus"]["split_by"]


def prepare_cli(*args):
    r = subprocess.run(
        [sys.executable, "data/prepare.py", *map(str, args), "--quiet"], cwd=ROOT, capture_output=True, text=True
    )
    return r.returncode, r.stdout, r.stderr


def test_bad_rows_name_file_row_and_field_or_are_skipped_and_counted(tmp_path):
    good = [json.dumps({"text": t}) for t in rows()[:200]]
    bad = ["{broken", "[1, 2]", json.dumps({"body": "x"}), json.dumps({"text": 7})]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(good[:50] + bad + good[50:]) + "\n")
    code, out, err = prepare_cli(src, "--out", tmp_path / "o", "--block-size", "64")
    assert code == 2 and err.startswith(f"error: {src}, row 51: not JSON") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
    code, out, err = prepare_cli(src, "--out", tmp_path / "o", "--block-size", "64", "--skip-bad-rows")
    assert code == 0 and "4 bad rows skipped" in out, err
    assert f"skipped {src}, row 52: a JSON list, not an object with a 'text' field" in err
    assert "row 53: no field 'text' (its fields: body); name the field with --text-field" in err
    assert err.endswith("skipped 1 more bad rows\n")
    assert "prepared" in out and "200 documents" in out


def test_the_encode_bar_counts_skipped_rows_to_the_end(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("\n".join(rows()) + "\n")
    src = tmp_path / "b.jsonl"  # every row without the field: skipped, but read, so counted on the bar
    src.write_text("".join(json.dumps({"body": t}) + "\n" for t in rows()))
    prepare([text, src], tmp_path / "o", "gpt2", block_size=16, skip_bad_rows=True, progress=True)
    bars = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("encode")]
    assert bars and bars[-1].startswith("encode [########################] 100%"), bars[-1:]


def test_parquet_mistakes_are_one_line(tmp_path):
    src = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["a b c " * 50, None, "d e f " * 50] * 20, "n": list(range(60))}), src)
    code, _, err = prepare_cli(src, "--out", tmp_path / "o", "--block-size", "16")
    assert (code, err) == (2, f"error: {src}, row 2: column 'text' is null\n")
    code, out, _ = prepare_cli(src, "--out", tmp_path / "o", "--block-size", "16", "--skip-bad-rows")
    assert code == 0 and "20 bad rows skipped" in out and "40 documents" in out
    code, _, err = prepare_cli(src, "--out", tmp_path / "p", "--text-field", "n")
    assert (code, err) == (2, f"error: {src}: column 'n' holds int64, not strings\n")
    code, _, err = prepare_cli(src, "--out", tmp_path / "p", "--text-field", "body")
    assert (code, err) == (
        2,
        f"error: {src}: no column 'body' (its columns: text, n); name the column with --text-field\n",
    )
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    code, _, err = prepare_cli(broken, "--out", tmp_path / "p")
    assert code == 2 and err.startswith(f"error: cannot read {broken} as Parquet") and err.count("\n") == 1

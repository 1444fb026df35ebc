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


# ---- record-file bombs: a few KB that decode to GBs; bad rows of every kind ---------------------------------

RSS_BOUND_MB = 400  # these runs peak at 140-190 MB (the imports take ~130); before the fix they took GBs
LOREM = "lorem ipsum dolor sit amet "


def prepare_rss(*args, timeout=120):
    """(exit code, stdout, stderr, peak RSS in MB) of `data/prepare.py ARGS --quiet` in a child process, its
    peak read by a driver process of its own (RUSAGE_CHILDREN), not polluted by this test process."""
    driver = (
        "import json, resource, subprocess, sys\n"
        f"r = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout={timeout})\n"
        "print(json.dumps([r.returncode, r.stdout, r.stderr, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))"
    )
    cmd = [sys.executable, "-c", driver, sys.executable, "data/prepare.py", *map(str, args), "--quiet"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    code, out, err, kb = json.loads(r.stdout)
    return code, out, err, kb // 1024


def lorem(nbytes, unit=LOREM):
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def parquet_bomb(path, row_bytes, rows, unit=LOREM):
    """One string of `row_bytes` in every row, dictionary-encoded: a few KB on disk, rows x row_bytes decoded."""
    column = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([lorem(row_bytes, unit)]))
    pq.write_table(pa.table({"text": column}), path, compression="zstd", write_statistics=False)
    return path


def gzip_bomb(path, row_mb, good=()):
    """A .jsonl.gz whose first row is a text of `row_mb` MiB (each MiB one gzip member: built at once), then `good`."""
    member = gzip.compress(b"a" * (1 << 20), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"text": "'))
        f.write(member * row_mb)
        f.write(gzip.compress(b'"}\n' + "".join(json.dumps({"text": t}) + "\n" for t in good).encode()))
    return path


def test_a_gzip_bomb_row_is_one_line_or_skipped_in_bounded_memory(tmp_path):
    src = gzip_bomb(tmp_path / "bomb.jsonl.gz", 200, good=rows()[:300])
    assert src.stat().st_size < 1_000_000
    code, _, err, mb = prepare_rss(src, "--out", tmp_path / "o", "--block-size", "64")
    expected = f"error: {src}, row 1: {200 * 2**20 + 12:,} bytes, more than --max-row-bytes 67,108,864"
    assert code == 2 and err.startswith(expected) and err.count("\n") == 1, err
    assert mb < RSS_BOUND_MB
    code, out, err, mb = prepare_rss(src, "--out", tmp_path / "o", "--block-size", "64", "--skip-bad-rows")
    assert code == 0 and "300 documents" in out and "1 bad rows skipped" in out, err
    assert mb < RSS_BOUND_MB


def test_a_parquet_dictionary_bomb_is_never_decoded_whole(tmp_path):
    src = parquet_bomb(tmp_path / "bomb.parquet", 1 << 20, 4096)  # 4 GiB of text decoded
    assert src.stat().st_size < 100_000
    args = ("--block-size", "64", "--max-row-bytes", "1000000", "--out", tmp_path / "o")
    code, _, err, mb = prepare_rss(src, *args)
    assert (code, err) == (
        2,
        f"error: {src}, row 1: 1,048,576 bytes, more than --max-row-bytes 1,000,000 (raise it to read the row)\n",
    )
    assert mb < RSS_BOUND_MB
    good = write(tmp_path / "good.parquet", rows()[:300])
    code, out, err, mb = prepare_rss(src, good, *args, "--skip-bad-rows")
    assert code == 0 and "300 documents" in out and "4,096 bad rows skipped" in out, err
    assert mb < RSS_BOUND_MB


# ---- and bounded on disk: a dataset takes at most --max-output-bytes ------------------------------------------
# "a!" is one GPT-2 token a byte: the fastest text to tokenize into many ids


def test_a_523_byte_parquet_stops_at_the_default_output_limit_and_leaves_nothing(tmp_path):
    """The issue's file: 8,192 rows holding one 64 KiB string, 537 MB of text (1 GB of uint16 ids) from a few
    hundred bytes. The default --max-output-bytes (32 times the inputs' bytes, at least 16 MiB) stops it."""
    src = parquet_bomb(tmp_path / "bomb.parquet", 1 << 16, 8192, unit="a!")
    assert src.stat().st_size < 600
    code, _, err, mb = prepare_rss(src, "--out", tmp_path / "o", "--block-size", "64", timeout=60)
    assert (code, err) == (
        2,
        f"error: the dataset would take more than 16,777,216 bytes, the default --max-output-bytes (32 times the "
        f"inputs' {src.stat().st_size:,} bytes on disk, at least 16 MiB): a record file that decodes to far more "
        f"than it stores (a Parquet or gzip bomb)? If the corpus is real, pass a larger --max-output-bytes; "
        f"{tmp_path / 'o'} was left as it was\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.parquet"]  # no dataset, no temporary directory
    assert mb < RSS_BOUND_MB


def test_a_bomb_stops_at_max_output_bytes_and_the_dataset_it_would_replace_stays(tmp_path):
    good = write(tmp_path / "good.jsonl", rows()[:300])
    out = tmp_path / "o"
    code, _, err = prepare_cli(good, "--out", out, "--block-size", "16")
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    parquet = parquet_bomb(tmp_path / "bomb.parquet", 1 << 16, 8192, unit="a!")
    line = b'{"text": "' + b"a!" * (1 << 19) + b'"}\n'  # 1 MiB rows, 256 of them: 256 MiB from about 256 KB of gzip
    gz = tmp_path / "bomb.jsonl.gz"
    gz.write_bytes(gzip.compress(line, compresslevel=9) * 256)
    for bomb in (parquet, gz):
        code, _, err = prepare_cli(bomb, "--out", out, "--block-size", "16", "--force", "--max-output-bytes", 100_000)
        assert (code, err) == (
            2,
            f"error: the dataset would take more than --max-output-bytes 100,000 bytes; raise it if the corpus is "
            f"that large; {out} was left as it was\n",
        )
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.jsonl.gz", "bomb.parquet", "good.jsonl", "o"]


def test_max_output_bytes_is_the_most_train_bin_and_val_bin_may_take(tmp_path):
    good = write(tmp_path / "good.jsonl", rows()[:300])
    code, _, err = prepare_cli(good, "--out", tmp_path / "a", "--block-size", "16")
    assert code == 0, err
    size = sum((tmp_path / "a" / f"{s}.bin").stat().st_size for s in ("train", "val"))
    code, _, err = prepare_cli(good, "--out", tmp_path / "b", "--block-size", "16", "--max-output-bytes", size)
    assert code == 0, err
    code, _, err = prepare_cli(good, "--out", tmp_path / "c", "--block-size", "16", "--max-output-bytes", size - 1)
    assert code == 2 and f"more than --max-output-bytes {size - 1:,} bytes" in err, err
    code, _, err = prepare_cli(good, "--out", tmp_path / "c", "--max-output-bytes", 0)
    assert (code, err) == (2, "error: --max-output-bytes must be at least 1, got 0\n")


def test_rows_longer_than_a_chunk_are_encoded_in_pieces_with_the_ids_of_the_whole(tmp_path):
    src = parquet_bomb(tmp_path / "long.parquet", 5 << 19, 4)  # each row two and a half chunks long
    code, out, err, mb = prepare_rss(src, "--out", tmp_path / "o", "--block-size", "64", "--val-fraction", "0.5")
    assert code == 0 and "4 documents" in out, err
    assert mb < RSS_BOUND_MB
    tok = gpt2_tokenizer()
    row = tok.encode(lorem(5 << 19)) + [tok.eot_token]
    assert split_ids(tmp_path / "o") == {"train": row * 2, "val": row * 2}


def test_a_gzip_stream_damaged_in_the_middle_is_one_line_naming_how_far_it_was_read(tmp_path):
    data = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in rows() * 2).encode())
    src = tmp_path / "damaged.jsonl.gz"  # a second gzip member whose deflate stream starts with an invalid block
    src.write_bytes(data + data[:10] + b"\xff" * 8 + data[18:])
    for extra in ([], ["--skip-bad-rows"], ["--force"]):
        code, out, err = prepare_cli(src, "--out", tmp_path / "o", "--block-size", "16", *extra)
        assert code == 2 and err.startswith(f"error: cannot read {src} (damaged after line "), err
        assert "bytes of the file read)" in err and err.count("\n") == 1


def test_every_way_a_json_line_can_fail_is_a_bad_row(tmp_path):
    src = tmp_path / "c.jsonl"
    deep, digits = "[" * 100_000 + "]" * 100_000, '{"text": ' + "1" * 5000 + "}"
    src.write_text("\n".join([deep, digits, *(json.dumps({"text": t}) for t in rows()[:200])]) + "\n")
    code, _, err = prepare_cli(src, "--out", tmp_path / "o", "--block-size", "16")
    assert (code, err) == (2, f"error: {src}, row 1: not JSON this reader takes (nested too deeply)\n")
    code, out, err = prepare_cli(src, "--out", tmp_path / "o", "--block-size", "16", "--skip-bad-rows")
    assert code == 0 and "200 documents" in out and "2 bad rows skipped" in out, err
    assert f"skipped {src}, row 2: not JSON this reader takes (Exceeds the limit" in err


def test_a_text_with_a_whitespace_run_tiktoken_cannot_take_whole_prepares(tmp_path):
    text = "\n".join(rows()[:300])
    src = tmp_path / "spaces.txt"
    src.write_text(text + " " * 1_100_000 + text)
    jsonl = tmp_path / "spaces.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in [text + " " * 1_100_000 + "x"] + rows()[:30]))
    for source in (src, jsonl):
        code, out, err = prepare_cli(source, "--out", tmp_path / source.suffix[1:], "--block-size", "16")
        assert code == 0 and "prepared" in out, err
    tok = gpt2_tokenizer()
    ids = split_ids(tmp_path / "jsonl")
    assert tok.decode(ids["train"][: ids["train"].index(tok.eot_token)]) == text + " " * 1_100_000 + "x"

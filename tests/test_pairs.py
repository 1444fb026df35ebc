"""Pairs datasets: preparing (format, filtering, errors), opening, and the length-bucketed batcher."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt.cli.pairs import main
from gpt.data.format import DataError
from gpt.data.pairs import PairBatches, PairsError, open_pairs, prepare_pairs
from gpt.data.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]

SRC = ["ein Haus", "zwei Hunde laufen", "", "ein sehr langer Satz mit vielen Worten darin", "Katze", "Vogel\u2028singt"]
TGT = ["a house", "two dogs run", "nothing", "a very long sentence with many words in it", "", "bird sings"]


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def toy(tmp_path):
    """Tiny parallel files with an empty line on each side and one over-long pair."""
    return write(tmp_path, "train.de", SRC), write(tmp_path, "train.en", TGT)


def random_corpus(tmp_path, n=300, seed=0):
    rng = np.random.default_rng(seed)
    words = ["ab", "cd", "efg", "h", "ijkl", "mn"]
    src = [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(n)]
    tgt = [" ".join(reversed(s.split())) for s in src]
    return write(tmp_path, "s.txt", src), write(tmp_path, "t.txt", tgt)


def test_prepare_round_trip_and_format(toy, tmp_path):
    out = tmp_path / "ds"
    meta = prepare_pairs(*toy, out, tokenizer="char", val_pairs=toy, max_len=30)
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk == meta and meta["kind"] == "pairs" and meta["dtype"] == "uint16"
    tok = get_tokenizer(meta["tokenizer"])  # self-contained spec
    assert meta["bos"] == meta["eos"] == meta["pad"] == tok.eot_token
    stats = meta["splits"]["train"]
    assert (stats["lines"], stats["pairs"], stats["skipped_empty"], stats["skipped_long"]) == (6, 3, 2, 1)
    ds = open_pairs(out)
    kept = [(s, t) for s, t in zip(SRC, TGT) if s and t and len(s) < 30 and len(t) < 30]
    assert [(tok.decode(s), tok.decode(t)) for s, t in (ds.pair("train", i) for i in range(3))] == kept
    offsets = np.fromfile(out / "train.idx", dtype=np.int64)
    assert len(offsets) == 2 * 3 + 1 and offsets[-1] == (out / "train.bin").stat().st_size // 2
    assert list(ds.lengths("train")[0]) == [len(s) for s, _ in kept]
    assert not list(tmp_path.glob(".ds.*"))  # the temporary directory is gone


def test_line_separators_other_than_newline_do_not_split_pairs(toy, tmp_path):
    meta = prepare_pairs(*toy, tmp_path / "ds", tokenizer="char", val_pairs=toy, max_len=100)
    assert meta["splits"]["train"]["lines"] == 6  # "Vogel\u2028singt" is one line


def test_truncate_instead_of_skip(toy, tmp_path):
    meta = prepare_pairs(*toy, tmp_path / "ds", tokenizer="char", val_pairs=toy, max_len=30, truncate=True)
    s = meta["splits"]["train"]
    assert (s["pairs"], s["skipped_long"], s["truncated"], s["max_src_len"], s["max_tgt_len"]) == (4, 0, 1, 29, 29)


def test_gpt2_tokenizer_and_held_out_validation(tmp_path):
    src, tgt = random_corpus(tmp_path, n=200)
    meta = prepare_pairs(src, tgt, tmp_path / "ds", tokenizer="gpt2", val_fraction=0.1)
    assert meta["tokenizer"] == {"kind": "gpt2"} and meta["eos"] == 50256 and meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["pairs"] == 180 and meta["splits"]["val"]["pairs"] == 20
    prepare_pairs(src, tgt, tmp_path / "ds2", tokenizer="gpt2", val_fraction=0.1)
    assert (tmp_path / "ds" / "val.bin").read_bytes() == (tmp_path / "ds2" / "val.bin").read_bytes()


BPE_SRC = [
    "Ein Mann fährt Fahrrad.",
    "Zwei Hunde spielen im Schnee.",
    "Eine Frau liest ein Buch.",
    "Kinder spielen Fußball auf der Straße.",
    "Ein Hund läuft über die Wiese.",
    "Ünïcødé: 東京 🚲",
]
BPE_TGT = [
    "A man rides a bike.",
    "Two dogs play in the snow.",
    "A woman reads a book.",
    "Children play soccer in the street.",
    "A dog runs across the meadow.",
    "Unicode: Tokyo 🚲",
]


def test_bpe_round_trip_and_self_contained_spec(tmp_path):
    src, tgt = write(tmp_path, "train.de", BPE_SRC * 20), write(tmp_path, "train.en", BPE_TGT * 20)
    vsrc, vtgt = write(tmp_path, "val.de", BPE_SRC[:2]), write(tmp_path, "val.en", BPE_TGT[:2])
    out = tmp_path / "ds"
    meta = prepare_pairs(src, tgt, out, tokenizer="bpe", vocab_size=1000, val_pairs=(vsrc, vtgt))
    spec_on_disk = meta["tokenizer"]
    assert spec_on_disk["kind"] == "bpe" and spec_on_disk["ranks_file"] == "tokenizer.tiktoken"
    assert "ranks" not in spec_on_disk and (out / "tokenizer.tiktoken").is_file()
    ds = open_pairs(out)
    tok = ds.tokenizer()
    assert 257 < tok.vocab_size < 1000 and meta["vocab_size"] == tok.vocab_size  # all merges of a tiny corpus
    assert meta["bos"] == meta["eos"] == meta["pad"] == tok.eot_token == tok.vocab_size - 1
    # trained on both sides: words of each language are single tokens
    assert [len(tok.encode(w)) for w in (" Hunde", " dogs", " Fahrrad", " bike")] == [1, 1, 1, 1]
    decoded = [(tok.decode(s), tok.decode(t)) for s, t in (ds.pair("train", i) for i in range(ds.num_pairs("train")))]
    assert decoded == list(zip(BPE_SRC * 20, BPE_TGT * 20))
    assert [tok.decode(x) for x in ds.pair("val", 1)] == [BPE_SRC[1], BPE_TGT[1]]

    spec = ds.tokenizer_spec  # self-contained: rebuilds the same tokenizer with the dataset gone
    assert "ranks" in spec and "ranks_file" not in spec and json.loads(json.dumps(spec)) == spec
    shutil.rmtree(out)
    again = get_tokenizer(spec)
    texts = BPE_SRC + BPE_TGT + ["unseen words, Zeichen ß and 🚲🚲"]
    assert [again.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert again.vocab_size == tok.vocab_size and again.spec == tok.spec


def test_bpe_ranks_file_is_checked(tmp_path):
    src, tgt = write(tmp_path, "s.de", BPE_SRC), write(tmp_path, "t.en", BPE_TGT)
    prepare_pairs(src, tgt, tmp_path / "ds", tokenizer="bpe", vocab_size=280, val_pairs=(src, tgt))
    ranks = tmp_path / "ds" / "tokenizer.tiktoken"
    ranks.write_text(ranks.read_text().replace(" 256\n", " 999\n"), encoding="ascii")
    with pytest.raises(DataError, match="tokenizer.tiktoken does not match its checksum"):
        open_pairs(tmp_path / "ds").tokenizer()
    ranks.unlink()
    with pytest.raises(DataError, match=r"tokenizer.tiktoken is missing \(the BPE's ranks, named in meta.json\)"):
        open_pairs(tmp_path / "ds")


def test_large_vocabulary_uses_uint32(tmp_path, monkeypatch):
    import gpt.data.pairs

    class Big:
        vocab_size, eot_token, spec = 70000, 69999, {"kind": "fake"}

        def encode_batch(self, texts):
            return [[69998] * len(t.split()) for t in texts]

    monkeypatch.setattr(gpt.data.pairs, "make_tokenizer", lambda *a, **k: Big())
    src, tgt = random_corpus(tmp_path, n=20)
    meta = prepare_pairs(src, tgt, tmp_path / "ds", val_fraction=0.1)
    assert meta["dtype"] == "uint32"
    tokens = np.fromfile(tmp_path / "ds" / "train.bin", dtype=np.uint32)
    assert (tokens == 69998).all()


def test_bad_inputs_are_clear_errors(toy, tmp_path):
    short = write(tmp_path, "short.en", TGT[:4])
    with pytest.raises(PairsError, match="has 6 lines but .*short.en has 4"):
        prepare_pairs(toy[0], short, tmp_path / "a", tokenizer="char", val_pairs=toy)
    empty = write(tmp_path, "empty.txt", ["", ""])
    with pytest.raises(PairsError, match="no train pairs left out of 2 lines"):
        prepare_pairs(empty, empty, tmp_path / "b", tokenizer="char", val_pairs=toy)
    with pytest.raises(PairsError, match="no such file"):
        prepare_pairs(tmp_path / "missing", toy[1], tmp_path / "c", tokenizer="char", val_pairs=toy)
    with pytest.raises(PairsError, match="--vocab-size 100 is too small"):
        prepare_pairs(*toy, tmp_path / "d", tokenizer="bpe", vocab_size=100, val_pairs=toy)
    with pytest.raises(DataError, match="--vocab-size is for --tokenizer bpe"):
        prepare_pairs(*toy, tmp_path / "e", tokenizer="char", vocab_size=300, val_pairs=toy)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # failures leave no directories behind


def test_existing_output_is_refused_unless_forced(toy, tmp_path):
    out = tmp_path / "ds"
    prepare_pairs(*toy, out, tokenizer="char", val_pairs=toy, max_len=30)
    with pytest.raises(DataError, match=r"ds already holds a dataset \(train.bin, .*meta.json\): pass --force"):
        prepare_pairs(*toy, out, tokenizer="char", val_pairs=toy, max_len=100)
    assert open_pairs(out).meta["max_len"] == 30  # untouched
    (out / "notes.md").write_text("mine")
    prepare_pairs(*toy, out, tokenizer="char", val_pairs=toy, max_len=100, force=True)
    assert open_pairs(out).meta["max_len"] == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "train.de", "train.en"]
    assert (out / "notes.md").read_text() == "mine"  # --force replaces the dataset's files, nothing else


def test_open_pairs_errors(tmp_path):
    with pytest.raises(DataError, match="no meta.json in .*run `gpt prepare --pairs"):
        open_pairs(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format_version": 1, "kind": "tokens"}))
    with pytest.raises(DataError, match="holds a token dataset, not translation pairs: run `gpt prepare --pairs"):
        open_pairs(tmp_path)


@pytest.fixture
def corpus(tmp_path):
    src, tgt = random_corpus(tmp_path, n=300)
    prepare_pairs(src, tgt, tmp_path / "ds", tokenizer="char", val_fraction=0.1)
    return open_pairs(tmp_path / "ds")


def test_batches_are_teacher_forcing_triples(corpus):
    batches = PairBatches(corpus, "train", max_tokens=200, seed=0)
    bos, eos = corpus.bos, corpus.eos
    for step in range(5):
        src, src_mask, tgt_in, tgt_out = batches.get(step)
        B, S = src.shape
        assert src.dtype == tgt_in.dtype == tgt_out.dtype == torch.long and src_mask.dtype == torch.bool
        assert B * max(S, tgt_in.size(1)) <= 200
        n_src = src_mask.sum(1)
        assert (src[torch.arange(B), n_src - 1] == eos).all()  # source ends with the end token
        assert (src[~src_mask] == corpus.pad).all()
        assert (tgt_in[:, 0] == bos).all()
        real = tgt_out != -1
        assert torch.equal(tgt_in[:, 1:][real[:, 1:]], tgt_out[:, :-1][real[:, 1:]])  # labels = inputs shifted left
        n_tgt = real.sum(1)
        assert torch.equal(real, torch.arange(tgt_in.size(1))[None, :] < n_tgt[:, None])  # padding only at the end
        assert (tgt_out[torch.arange(B), n_tgt - 1] == eos).all()
        for row, i in enumerate(batches.indices(step)):  # the real tokens are the dataset's
            s, t = corpus.pair("train", i)
            assert src[row, : len(s)].tolist() == s.tolist() and tgt_out[row, : len(t)].tolist() == t.tolist()


def test_batches_are_a_pure_function_of_seed_step_and_rank(corpus):
    a = PairBatches(corpus, "train", max_tokens=200, seed=3)
    b = PairBatches(corpus, "train", max_tokens=200, seed=3)
    order = [a.get(s) for s in (7, 0, 150, 7)]  # any order, across epochs, as on resume
    for s, got in zip((7, 0, 150, 7), order):
        assert all(torch.equal(x, y) for x, y in zip(got, b.get(s)))
    c = PairBatches(corpus, "train", max_tokens=200, seed=4)
    assert not all(np.array_equal(a.indices(s), c.indices(s)) for s in range(3))


def test_ranks_and_micro_steps_cover_an_epoch_exactly_once(corpus):
    world, accum = 2, 3
    ranks = [
        PairBatches(corpus, "train", max_tokens=150, seed=0, rank=r, world_size=world, grad_accum=accum)
        for r in range(world)
    ]
    n = len(ranks[0])
    steps = n // (world * accum)
    seen = [i for s in range(steps) for m in range(accum) for r in ranks for i in r.indices(s, m)]
    assert len(seen) == len(set(seen))  # no pair twice within an epoch
    leftover = [i for j in range(steps * world * accum, n) for i in ranks[0].batches[ranks[0]._epoch_order[1][j]]]
    assert sorted(seen + leftover) == list(range(corpus.num_pairs("train")))
    assert ranks[0].epoch(steps) == pytest.approx(steps * world * accum / n)


def test_length_grouping_wastes_little_padding(corpus):
    batches = PairBatches(corpus, "train", max_tokens=200)
    assert batches.padding_fraction() < 0.1
    # the same batch sizes drawn at random would pad far more
    rng = np.random.default_rng(0)
    perm = rng.permutation(corpus.num_pairs("train"))
    sizes = np.cumsum([len(b) for b in batches.batches])[:-1]
    batches.batches = np.split(perm, sizes)
    assert batches.padding_fraction() > 0.3


def test_iteration_visits_every_pair_once(corpus):
    batches = PairBatches(corpus, "val", max_tokens=120)
    assert sum(len(src) for src, *_ in batches) == corpus.num_pairs("val")


def test_max_tokens_below_longest_pair_is_an_error(corpus):
    with pytest.raises(PairsError, match="max_tokens=10 is smaller than the longest train pair"):
        PairBatches(corpus, "train", max_tokens=10)


def test_cli_main(toy, tmp_path, capsys):
    out = tmp_path / "cli"
    assert (
        main(
            [
                "--pairs",
                *map(str, toy),
                "--out",
                str(out),
                "--tokenizer",
                "char",
                "--val-pairs",
                *map(str, toy),
                "--max-len",
                "30",
            ]
        )
        == 0
    )
    assert "train: 3 pairs of 6 lines" in capsys.readouterr().out
    assert main(["--pairs", str(toy[0]), str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no such file") and err.count("\n") == 1


def prepare_cli(*args):
    """`python data/prepare.py ...` in its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "data" / "prepare.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_data_prepare_pairs_cli(tmp_path):
    src, tgt = write(tmp_path, "train.de", BPE_SRC * 5), write(tmp_path, "train.en", BPE_TGT * 5)
    vsrc, vtgt = write(tmp_path, "val.de", BPE_SRC[:3]), write(tmp_path, "val.en", BPE_TGT[:3])
    out = tmp_path / "data" / "de-en"
    r = prepare_cli(
        "--pairs",
        src,
        tgt,
        "--val-pairs",
        vsrc,
        vtgt,
        "--out",
        out,
        "--tokenizer",
        "bpe",
        "--vocab-size",
        400,
        "--max-len",
        64,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out} (bpe tokenizer, vocab ") and "train: 30 pairs of 30 lines" in r.stdout
    ds = open_pairs(out)
    assert ds.meta["max_len"] == 64 and ds.meta["source"]["val"] == [str(vsrc), str(vtgt)]
    tok = ds.tokenizer()
    assert [[tok.decode(x) for x in ds.pair("val", i)] for i in range(3)] == [
        list(p) for p in zip(BPE_SRC[:3], BPE_TGT[:3])
    ]

    r = prepare_cli("--pairs", src, tgt, "--out", out, "--tokenizer", "char")  # the dataset is there now
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        f"error: {out} already holds a dataset (train.bin, train.idx, val.bin, val.idx, tokenizer.tiktoken, "
        f"meta.json): pass --force to replace it, or choose another --out\n"
    )
    r = prepare_cli("--pairs", src, tgt, "--out", out, "--tokenizer", "char", "--force", "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    assert open_pairs(out).meta["splits"]["val"]["pairs"] == 6  # 20% of 30 lines held out


def test_data_prepare_pairs_cli_errors_are_one_line(toy, tmp_path):
    short = write(tmp_path, "short.en", TGT[:4])
    r = prepare_cli("--pairs", toy[0], short, "--out", tmp_path / "a")
    assert (r.returncode, r.stdout) == (2, "") and "Traceback" not in r.stderr
    assert r.stderr == (
        f"error: {toy[0]} has 6 lines but {short} has 4: line i of the source must translate line i of the target\n"
    )
    r = prepare_cli("--pairs", toy[0], tmp_path / "missing.en", "--out", tmp_path / "b")
    assert (r.returncode, r.stderr) == (2, f"error: no such file: {tmp_path / 'missing.en'}\n")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--pairs", "s", "t", "corpus.txt"],
            "give one of INPUT files, --pairs SRC TGT, --chat FILE or --preferences FILE, not INPUT and --pairs (got INPUT corpus.txt)",
        ),
        (
            [],
            "nothing to prepare: give INPUT files and directories, --pairs SRC TGT for translation pairs, "
            "--chat FILE for chat conversations or --preferences FILE for preference pairs",
        ),
        (
            ["--pairs", "s", "t", "--block-size", "64"],
            "--block-size is for INPUT text, --chat and --preferences datasets, not --pairs",
        ),
        (
            ["corpus.txt", "--max-len", "64", "--truncate"],
            "--max-len, --truncate are for --pairs datasets, not INPUT text",
        ),
        (
            ["corpus.txt", "--unknown", "replace"],
            "--unknown: only with --tokenizer-from (the characters a reused char "
            "vocabulary lacks); a new vocabulary (--tokenizer) holds every character of its INPUT",
        ),
        (
            ["corpus.txt", "--tokenizer-from", "run", "--replacement", "_"],
            "--replacement: only with --unknown replace (the default refuses unknown characters)",
        ),
    ],
)
def test_data_prepare_rejects_mixed_modes(tmp_path, capsys, args, message):
    import runpy

    prepare_main = runpy.run_path(str(ROOT / "data" / "prepare.py"), run_name="script")["main"]
    assert prepare_main([*args, "--out", str(tmp_path / "x")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {message}\n"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,kind", [([], "bpe"), (["--tokenizer", "char"], "char")])
def test_multi30k_recipe(tmp_path, args, kind):
    for split in ("train", "val"):
        write(tmp_path, f"{split}.de", ["Ein Mann fährt Fahrrad.", "Zwei Hunde."])
        write(tmp_path, f"{split}.en", ["A man rides a bike.", "Two dogs."])
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data" / "multi30k" / "prepare.py"),
            "--input",
            str(tmp_path),
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    ds = open_pairs(out)
    tok = ds.tokenizer()
    assert ds.meta["tokenizer"]["kind"] == kind and f"({kind} tokenizer" in r.stdout
    assert [tok.decode(x) for x in ds.pair("val", 0)] == ["Ein Mann fährt Fahrrad.", "A man rides a bike."]


def test_non_utf8_input_is_a_clear_error(toy, tmp_path):
    bad = tmp_path / "latin1.de"
    bad.write_bytes("Ein Mann fährt.\n".encode("latin-1"))
    with pytest.raises(PairsError, match="latin1.de is not UTF-8 text .*convert it to UTF-8"):
        prepare_pairs(bad, bad, tmp_path / "ds", tokenizer="char", val_pairs=toy)


# ---- the shared dataset format: ids, older datasets, where a dataset can be written -------------------


def test_ids_outside_the_vocabulary_are_found_at_open(toy, tmp_path):
    out = tmp_path / "ds"
    meta = prepare_pairs(*toy, out, tokenizer="char", val_pairs=toy, max_len=30)
    for split in ("train", "val"):
        assert meta["splits"][split]["max_id"] == int(np.fromfile(out / f"{split}.bin", dtype=np.uint16).max())
    vocab = meta["vocab_size"]
    ids = np.memmap(out / "val.bin", dtype=np.uint16, mode="r+")
    ids[3] = vocab + 5  # damaged, in a dataset written before max_id was recorded
    ids.flush()
    for split in ("train", "val"):
        del meta["splits"][split]["max_id"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"^the val split holds id {vocab + 5}, outside the vocabulary of {vocab} ids"):
        open_pairs(out)


def test_the_version_key_is_format_version_and_older_datasets_still_open(toy, tmp_path):
    out = tmp_path / "ds"
    meta = prepare_pairs(*toy, out, tokenizer="char", val_pairs=toy, max_len=30)
    assert meta["format_version"] == 1 and "format" not in meta  # one key for token and pairs datasets
    old = {("format" if k == "format_version" else k): v for k, v in meta.items()}
    for split in old["splits"].values():
        del split["max_id"]
    (out / "meta.json").write_text(json.dumps(old))  # as pairs datasets were written before
    ds = open_pairs(out)
    tok = ds.tokenizer()
    assert [tok.decode(x) for x in ds.pair("train", 0)] == [SRC[0], TGT[0]]


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_an_out_that_is_or_lies_under_a_file_is_one_line_and_keeps_it(toy, tmp_path, where):
    notes = write(tmp_path, "notes.txt", ["mine"])
    out = notes if where == "file" else notes / "ds"
    r = prepare_cli("--pairs", *toy, "--out", out, "--tokenizer", "char", "--force")
    what = "it is a file" if where == "file" else f"{notes} is a file"
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"error: could not write {out}: {what}, not a directory; choose another --out\n"
    assert notes.read_text() == "mine\n"  # --force never replaces a file with a dataset
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "train.de", "train.en"]


def test_a_full_disk_is_one_line_and_keeps_the_dataset(toy, tmp_path, capsys, monkeypatch):
    import errno
    import runpy

    import gpt.data.pairs

    out = tmp_path / "ds"
    prepare_pairs(*toy, out, tokenizer="char", val_pairs=toy, max_len=30)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gpt.data.pairs, "write_split", full)
    prepare_main = runpy.run_path(str(ROOT / "data" / "prepare.py"), run_name="script")["main"]
    assert prepare_main(["--pairs", *map(str, toy), "--out", str(out), "--tokenizer", "char", "--force"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"error: could not write {out}: the disk is full; free some space; the dataset in {out} was left as it was\n"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "train.de", "train.en"]  # no temporary directory


@pytest.mark.parametrize("bad_id", ["vocab", "padded"])
def test_every_batch_is_checked_where_the_open_check_misses_damage(tmp_path, bad_id):
    src, tgt = random_corpus(tmp_path, n=20_000)
    out = tmp_path / "ds"
    meta = prepare_pairs(src, tgt, out, tokenizer="char", val_fraction=0.1)
    assert meta["splits"]["train"]["src_tokens"] + meta["splits"]["train"]["tgt_tokens"] > 500_000
    vocab = meta["vocab_size"]  # 12 ids, 64 in the model: an id of 40 was trained on silently before,
    bad = 40 if bad_id == "vocab" else 1000  # 1000 an IndexError from the embedding
    ids = np.memmap(out / "train.bin", dtype=np.uint16, mode="r+")
    gap = (len(ids) - 4096) / 63  # the spot check at open reads 64 runs of 4096 ids this far apart
    damaged = range(int(gap) + 4096 + 1, int(2 * gap))  # between its second and third run
    ids[damaged.start : damaged.stop] = bad  # meta.json untouched
    ids.flush()
    ds = open_pairs(out)
    message = (
        rf"^dataset {out}, train split: id {bad} at token offset ([\d,]+) of train.bin is outside the "
        rf"vocabulary of {vocab} ids \(the file was damaged after it was prepared"
    )
    with pytest.raises(DataError, match=message) as e:
        for _ in PairBatches(ds, "train", max_tokens=2000):
            pass
    assert int(re.search(message, str(e.value)).group(1).replace(",", "")) in damaged
    if bad_id == "padded":
        return
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--data",
            str(out),
            "--out-dir",
            str(tmp_path / "run"),
            "--device",
            "cpu",
            "--n-layer",
            "1",
            "--n-encoder-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "32",
            "--block-size",
            "64",
            "--max-tokens",
            "2000",
            "--max-iters",
            "40",
            "--eval-interval",
            "1000",
            "--log-interval",
            "1000",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 2 and re.match(message[1:].replace("^", ""), r.stderr[len("error: ") :]), r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1


def test_padding_to_a_multiple_repeats_shapes_and_keeps_the_loss(corpus):
    """pad_to=8: every batch's lengths are multiples of 8 (far fewer shapes), within max_tokens, every pair
    once; and an encoder-decoder's loss on the same pairs equals the unpadded batch's (the padding is masked
    in the source and ignored in the targets)."""
    from gpt import GPT, GPTConfig

    plain, padded = (PairBatches(corpus, "train", max_tokens=200, pad_to=p) for p in (1, 8))
    shapes = {p: {tuple(x.shape for x in b) for b in batches} for p, batches in ((1, plain), (8, padded))}
    assert all(s[0][1] % 8 == 0 and s[2][1] % 8 == 0 for s in shapes[8])
    assert len(shapes[8]) < len(shapes[1]) / 2
    assert all(src.size(0) * max(src.size(1), tgt_in.size(1)) <= 200 for src, _, tgt_in, _ in padded)
    assert sorted(i for b in padded.batches for i in b) == list(range(corpus.num_pairs("train")))
    assert padded.padding_fraction() > plain.padding_fraction()
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=corpus.vocab_size, block_size=64, n_layer=2, n_encoder_layer=2, n_head=2, n_embd=32)
    ).eval()
    grown = [b for b in padded.batches if plain.collate(b)[2].shape != padded.collate(b)[2].shape]
    assert len(grown) >= 4
    for idx in grown[:4]:
        (src, mask, tgt_in, tgt_out), (psrc, pmask, ptgt_in, ptgt_out) = plain.collate(idx), padded.collate(idx)
        with torch.no_grad():
            _, loss = model(tgt_in, tgt_out, src, mask)
            _, padded_loss = model(ptgt_in, ptgt_out, psrc, pmask)
        assert padded_loss.item() == pytest.approx(loss.item(), rel=1e-5)


def test_pad_to_below_one_is_an_error(corpus):
    with pytest.raises(ValueError, match="pad_to >= 1"):
        PairBatches(corpus, "train", max_tokens=200, pad_to=0)

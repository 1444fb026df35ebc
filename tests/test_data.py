import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from gpt.data.format import IdGuard, dtype_for_vocab
from gpt.data.prepare import prepare
from gpt.data.tokens import Batches, DataError, eval_batches, gather_windows, open_dataset


def _write_dataset(path, train, val, vocab_size, dtype="uint16", max_ids=None, **meta_overrides):
    """A dataset directory written by hand (no prepare), for loader tests: as an older gpt wrote it
    (no `kind`, no `max_id`) unless `max_ids` gives the splits' recorded largest ids."""
    path.mkdir(parents=True, exist_ok=True)
    splits = {}
    for name, ids in (("train", train), ("val", val)):
        if ids is not None:
            np.asarray(ids, dtype=dtype).tofile(path / f"{name}.bin")
        n = (path / f"{name}.bin").stat().st_size // np.dtype(dtype).itemsize
        splits[name] = {"file": f"{name}.bin", "tokens": n, "documents": 1, "sha256": "0" * 64}
        if max_ids:
            splits[name]["max_id"] = max_ids[name]
    meta = {
        "format_version": 1,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eot_token": vocab_size - 1,
        "tokenizer": {"kind": "gpt2"},
        "splits": splits,
        **meta_overrides,
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    src = tmp_path_factory.mktemp("corpus") / "c.txt"
    src.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(2000)))
    out = tmp_path_factory.mktemp("ds") / "char"
    prepare([src], out, "char", block_size=16, progress=False)
    return out


@pytest.fixture
def dataset_copy(prepared, tmp_path):
    return shutil.copytree(prepared, tmp_path / "copy")


# ---- opening and checking ---------------------------------------------------------------------------


def test_open_reads_meta_and_memmaps_read_only(prepared):
    ds = open_dataset(prepared, verify=True)
    train = ds.split("train")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    assert len(train) == ds.meta["splits"]["train"]["tokens"] and ds.vocab_size == ds.meta["vocab_size"]
    assert ds.tokenizer().decode(train[:7]) == "line 0:"
    with pytest.raises(ValueError):
        train[0] = 1  # read-only
    with pytest.raises(ValueError, match="unknown split 'test'"):
        ds.split("test")


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: shutil.rmtree(p),
            r"no dataset directory .*copy: run `gpt prepare INPUT\.\.\. --out .*copy",
        ),
        (
            lambda p: (p / "meta.json").unlink(),
            r"no meta.json in .*copy \(not prepared, or an interrupted prepare\): run `gpt prepare",
        ),
        (lambda p: (p / "train.bin").unlink(), r"no train.bin in .*copy: run `gpt prepare"),
        (lambda p: (p / "meta.json").write_text("{oops"), r"meta.json is not valid JSON"),
        (
            lambda p: _edit_meta(p, format_version=99),
            r"meta.json: format_version is 99, expected 1, the version this gpt reads",
        ),
        (
            lambda p: _edit_meta(p, dtype="float32"),
            r"meta.json: dtype is \"float32\", expected one of 'uint16', 'uint32'",
        ),
        (lambda p: _edit_meta(p, vocab_size=70_000), r"vocab_size 70000 does not fit dtype uint16"),
        (lambda p: _append(p / "val.bin", b"\x01"), r"val.bin is [\d,]+ bytes, not a whole number of uint16 tokens"),
        (lambda p: _append(p / "val.bin", b"\x01\x00"), r"val.bin holds [\d,]+ tokens but meta.json says"),
        (
            lambda p: _poke(p / "train.bin", 0, 999),
            r"the train split holds id 999, outside the vocabulary of \d+ ids \(.*train.bin is damaged",
        ),
        (lambda p: _poke(p / "val.bin", -1, 65535), r"the val split holds id 65535, outside the vocabulary"),
    ],
)
def test_open_rejects_damaged_datasets(dataset_copy, damage, message):
    damage(dataset_copy)
    with pytest.raises(DataError, match=message):
        open_dataset(dataset_copy)


def _edit_meta(path, **changes):
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, **changes}))


def _append(path, data):
    with open(path, "ab") as f:
        f.write(data)


def _poke(path, index, value):
    ids = np.memmap(path, dtype=np.uint16, mode="r+")
    ids[index] = value
    ids.flush()


def test_prepare_records_the_largest_id_of_each_split(prepared):
    ds = open_dataset(prepared)
    for name in ("train", "val"):
        assert ds.meta["splits"][name]["max_id"] == int(ds.split(name).max())
    assert ds.meta["splits"]["val"]["max_id"] == ds.vocab_size - 1  # the end-of-text closing the document


def test_an_id_outside_the_vocabulary_is_found_at_open_wherever_it_lies(tmp_path):
    ids = np.zeros(1 << 20, dtype=np.uint16)
    ids[5000] = 70  # between the windows a bounded sample reads: found only mid-training before
    _write_dataset(tmp_path / "old", ids, np.zeros(100), vocab_size=66)  # no max_id: every id is read once
    with pytest.raises(
        DataError, match=r"^the train split holds id 70, outside the vocabulary of 66 ids \(.*train.bin"
    ):
        open_dataset(tmp_path / "old")
    ids[5000] = 60  # in the vocabulary of 66, recorded as the largest id; then vocab_size is edited down to 50
    _write_dataset(tmp_path / "new", ids, np.zeros(100), vocab_size=50, max_ids={"train": 60, "val": 0})
    with pytest.raises(DataError, match=r"^the train split holds id 60, outside the vocabulary of 50 ids"):
        open_dataset(tmp_path / "new")
    _write_dataset(tmp_path / "new", ids, np.zeros(100), vocab_size=66, max_ids={"train": 60, "val": 0})
    assert open_dataset(tmp_path / "new").vocab_size == 66


def test_train_py_reports_a_wrong_meta_json_in_one_line(dataset_copy, tmp_path):
    _edit_meta(dataset_copy, vocab_size="66")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--data",
            str(dataset_copy),
            "--out-dir",
            str(tmp_path / "run"),
            "--max-iters",
            "1",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        f'error: {dataset_copy / "meta.json"}: vocab_size is "66", expected a whole number >= 1: '
        f"prepare the dataset again with --force\n"
    )


def test_full_checksum_only_on_request(dataset_copy):
    ids = np.memmap(dataset_copy / "train.bin", dtype=np.uint16, mode="r+")
    middle = len(ids) // 2 + 3
    ids[middle] = (ids[middle] + 1) % 10  # still a valid id: only the checksum can tell
    ids.flush()
    open_dataset(dataset_copy)
    with pytest.raises(DataError, match="train.bin does not match its checksum"):
        open_dataset(dataset_copy, verify=True)


def test_dtype_for_vocab():
    assert dtype_for_vocab(256) == dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == dtype_for_vocab(1 << 32) == "uint32"
    with pytest.raises(DataError):
        dtype_for_vocab((1 << 32) + 1)


# ---- batches ----------------------------------------------------------------------------------------

TOKENS = np.arange(10_000, dtype=np.uint32)  # token i at offset i: a window's first token is its start


def test_batch_shapes_and_targets():
    tokens = np.random.default_rng(0).integers(0, 50_000, size=5_000).astype(np.uint16)
    x, y = Batches(tokens, block_size=32, batch_size=4, seed=1).get(7)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        s = int(
            np.flatnonzero((tokens[: len(tokens) - 32] == row_x[0]) & (tokens[1 : len(tokens) - 31] == row_x[1]))[0]
        )
        assert np.array_equal(row_x, tokens[s : s + 32]) and np.array_equal(row_y, tokens[s + 1 : s + 33])


def test_random_batches_are_a_function_of_seed_and_step():
    a = Batches(TOKENS, 16, 8, seed=3)
    sequence = [a.get(step)[0] for step in range(5)]
    resumed = Batches(TOKENS, 16, 8, seed=3)  # a fresh process resuming at step 3
    assert torch.equal(resumed.get(3)[0], sequence[3]) and torch.equal(resumed.get(1)[0], sequence[1])
    assert not torch.equal(sequence[0], sequence[1])
    assert not torch.equal(Batches(TOKENS, 16, 8, seed=4).get(3)[0], sequence[3])
    starts = np.concatenate([s[:, 0].numpy() for s in sequence])
    assert starts.min() >= 0 and starts.max() <= len(TOKENS) - 17


@pytest.mark.parametrize("mode", ["random", "epoch"])
def test_global_batch_does_not_depend_on_ranks_and_micro_steps(mode):
    def windows(world_size, grad_accum, step):
        per = []
        for rank in range(world_size):
            b = Batches(TOKENS, 16, 4, seed=5, mode=mode, rank=rank, world_size=world_size, grad_accum=grad_accum)
            per += [b.get(step, m)[0][:, 0].tolist() for m in range(grad_accum)]
        return per

    for step in (0, 9):
        one = windows(1, 4, step)
        two = windows(2, 2, step)
        four = windows(4, 1, step)
        assert sorted(sum(one, [])) == sorted(sum(two, [])) == sorted(sum(four, []))
        flat = sum(two, [])
        assert len(set(flat)) == len(flat) == 16  # disjoint across ranks and micro-steps


def test_epoch_mode_visits_every_window_once_per_epoch():
    tokens = np.arange(1 + 16 * 10, dtype=np.uint16)  # exactly 10 non-overlapping windows of 16
    b = Batches(tokens, 16, batch_size=2, seed=0, mode="epoch", world_size=2)  # global batch 4: straddles epochs
    assert b.n_windows == 10 and b.steps_per_epoch == 2.5
    ranks = [Batches(tokens, 16, 2, seed=0, mode="epoch", rank=r, world_size=2) for r in range(2)]
    seen = [s for step in range(5) for b_r in ranks for s in b_r.get(step)[0][:, 0].tolist()]  # global order
    first, second = seen[:10], seen[10:]
    assert sorted(first) == sorted(second) == list(range(0, 160, 16))
    assert first != second  # a fresh permutation per epoch
    x, y = b.get(0)
    assert torch.equal(y[:, -1], x[:, -1] + 1)  # windows of block_size+1 tokens: y reaches the next window's x[0]


def test_epoch_mode_exact_cover_with_whole_global_batches():
    tokens = np.arange(16 * 64 + 5, dtype=np.uint32)
    b = Batches(tokens, 16, 8, seed=11, mode="epoch")
    assert b.n_windows == 64
    starts = np.concatenate([b.window_starts(step) for step in range(24)])  # 3 epochs
    for epoch in range(3):
        assert sorted(starts[64 * epoch : 64 * (epoch + 1)].tolist()) == list(range(0, 16 * 64, 16))
    assert not np.array_equal(starts[:64], starts[64:128])
    assert np.array_equal(Batches(tokens, 16, 8, seed=11, mode="epoch").window_starts(17), b.window_starts(17))


def test_small_splits_and_bad_arguments():
    with pytest.raises(DataError, match="fewer than one window of block_size \\+ 1 = 33"):
        Batches(np.arange(32), 32, 1)
    with pytest.raises(ValueError, match="unknown batch mode 'shuffle'"):
        Batches(TOKENS, 8, 1, mode="shuffle")
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        Batches(TOKENS, 8, 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="micro_step 2 is outside 0..1"):
        Batches(TOKENS, 8, 1, grad_accum=2).get(0, 2)
    # more windows per step than the split has: drawn with replacement instead of failing
    x, _ = Batches(np.arange(20), 8, 64).get(0)
    assert x.shape == (64, 8) and int(x[:, 0].max()) <= 11


def test_eval_batches_cover_consecutive_windows():
    batches = list(eval_batches(TOKENS[: 1 + 16 * 10], 16, 4))
    assert [len(x) for x, _ in batches] == [4, 4, 2]
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert torch.equal(x.flatten(), torch.arange(160)) and torch.equal(y.flatten(), torch.arange(1, 161))
    assert len(list(eval_batches(TOKENS, 16, 4, max_batches=2))) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, non_blocking copies)")
def test_cuda_batches():
    x, y = Batches(TOKENS, 16, 4, device="cuda").get(0)
    assert x.is_cuda and y.is_cuda and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x.cpu(), Batches(TOKENS, 16, 4).get(0)[0])
    xe, _ = next(eval_batches(TOKENS, 16, 4, device="cuda"))
    assert xe.is_cuda


# ---- 64-bit offsets ---------------------------------------------------------------------------------


def test_sparse_file_past_4_gib(tmp_path):
    n = (1 << 32) + 4096  # uint16 tokens: an 8 GiB sparse file, almost all holes
    far = (1 << 31) + 12_345  # token offset whose byte offset is past 2^32
    pattern = (np.arange(3000) % 50_000 + 1).astype(np.uint16)
    path = tmp_path / "big"
    path.mkdir()
    with open(path / "train.bin", "wb") as f:
        f.truncate(2 * n)
        f.seek(2 * far)
        f.write(pattern.tobytes())
    _write_dataset(path, None, np.arange(100), vocab_size=50_257, max_ids={"train": 50_000, "val": 99})  # no full scan
    train = open_dataset(path).split("train")
    assert len(train) == n and 2 * far > 1 << 32
    assert np.array_equal(train[far : far + 3000], pattern)
    windows = gather_windows(train, np.array([far, far + 100, 5], dtype=np.int64), 257)
    assert np.array_equal(windows[0], pattern[:257]) and np.array_equal(windows[1], pattern[100:357])
    assert not windows[2].any()

    # epoch mode: find the step that holds the window starting at `far` and read it through Batches
    block = 1 << 12
    far_window = (far // block) * block
    window = (np.arange(block + 1) % 50_000 + 7).astype(np.uint16)
    with open(path / "train.bin", "r+b") as f:
        f.seek(2 * far_window)
        f.write(window.tobytes())
    b = Batches(train, block, batch_size=8, seed=0, mode="epoch")
    position = int(np.flatnonzero(b._permutation(0) == far_window // block)[0])
    x, y = b.get(position // 8)
    assert np.array_equal(x[position % 8].numpy(), window[:-1]) and np.array_equal(y[position % 8].numpy(), window[1:])

    # random mode draws offsets past 2^31 tokens and reads them from the right place
    r = Batches(train, 256, batch_size=4, seed=0)
    starts = np.concatenate([r.window_starts(step) for step in range(20)])
    assert starts.dtype == np.int64 and starts.max() > 1 << 31
    x, y = r.get(3)
    with open(path / "train.bin", "rb") as f:
        direct = np.frombuffer(os.pread(f.fileno(), 2 * 257, 2 * int(r.window_starts(3)[0])), dtype=np.uint16)
    assert np.array_equal(x[0].numpy(), direct[:-1]) and np.array_equal(y[0].numpy(), direct[1:])


# ---- every batch's ids are checked ----------------------------------------------------------------


DAMAGED = slice(4296, 15670)  # between the windows the spot check at open reads in a ~1M-token split


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """A char dataset (28 ids, padded to 64 in the model) with ~1M tokens in each split."""
    rng = np.random.default_rng(0)
    src = tmp_path_factory.mktemp("corpus") / "words.txt"
    src.write_text(" ".join(rng.choice(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"], 420_000)))
    out = tmp_path_factory.mktemp("ds") / "large"
    prepare([src], out, "char", val_fraction=0.5, block_size=32, progress=False)
    return out


def _damage(dataset, split, bad_id, tmp_path):
    copy = shutil.copytree(dataset, tmp_path / "damaged")
    ids = np.memmap(copy / f"{split}.bin", dtype=np.uint16, mode="r+")
    ids[DAMAGED] = bad_id
    ids.flush()
    ds = open_dataset(copy)  # meta.json untouched: the spot check at open does not see it
    assert ds.vocab_size == 28
    return copy


def _train_py(data, out, *args):
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--data",
            str(data),
            "--out-dir",
            str(out),
            "--device",
            "cpu",
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "32",
            "--block-size",
            "32",
            "--batch-size",
            "64",
            "--eval-interval",
            "1000",
            "--log-interval",
            "1000",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


# 40: between the tokenizer's 28 ids and the model's padded 64 (trained on silently before); 1000: past the
# padded vocabulary (an IndexError from the embedding before)
@pytest.mark.parametrize("bad_id", [40, 1000])
def test_training_refuses_a_damaged_region_the_open_check_misses(large, tmp_path, bad_id):
    data = _damage(large, "train", bad_id, tmp_path)
    r = _train_py(data, tmp_path / "run", "--max-iters", "40", "--eval-iters", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(
        rf"error: dataset {re.escape(str(data))}, train split: id {bad_id} at token offset "
        rf"[\d,]+ of train.bin is outside the vocabulary of 28 ids \(the file was damaged after it "
        rf"was prepared.*--force\n",
        r.stderr,
    ), r.stderr
    offset = int(re.search(r"offset ([\d,]+)", r.stderr).group(1).replace(",", ""))
    assert DAMAGED.start <= offset < DAMAGED.stop


@pytest.mark.parametrize("bad_id", [40, 1000])
def test_evaluation_refuses_a_damaged_region_the_open_check_misses(large, tmp_path, bad_id):
    data = _damage(large, "val", bad_id, tmp_path)
    r = _train_py(
        data, tmp_path / "run", "--max-iters", "1", "--eval-iters", "0", "--eval-train", "false"
    )  # the whole val split
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    first = DAMAGED.start - DAMAGED.start % 32  # eval windows start at multiples of the block size...
    assert r.stderr.startswith(
        f"error: dataset {data}, val split: id {bad_id} at token offset {DAMAGED.start:,} of "
        f"val.bin is outside the vocabulary of 28 ids"
    ), r.stderr
    assert first < DAMAGED.start and r.stderr.count("\n") == 1  # ...but the offset is the first bad id's own


def test_batches_check_every_batch_and_name_the_first_bad_offset():
    ids = np.zeros(200, dtype=np.uint16)
    ids[[150, 120]] = [80, 70]
    guard = IdGuard(ids, 66, Path("ds"), "train", Path("ds/train.bin"))
    batches = eval_batches(ids, 10, 4, guard=guard)
    for _ in range(2):
        next(batches)  # windows 0..7, tokens 0..80: clean
    message = r"^dataset ds, train split: id 70 at token offset 120 of train.bin is outside the vocabulary of 66 ids"
    with pytest.raises(DataError, match=message):
        next(batches)
    with pytest.raises(DataError, match=message):  # one batch of every window: the first bad id in file order
        Batches(ids, 10, 19, guard=guard, mode="epoch").get(0)

"""bench/bench_seq2seq.py's pieces on a tiny checkpoint: snapshots of last.pt, the log's clock,
BLEU / speed of greedy and beam decoding, the markdown table. (The full benchmark trains for an hour.)"""

import importlib.util
import json
from pathlib import Path

import pytest
from test_sample_seq2seq import save_seq2seq

from gpt.checkpoints import loader, native
from gpt.infer.evaluate import evaluate

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_seq2seq", ROOT / "bench" / "bench_seq2seq.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def test_snapshot_schedule_and_parsing():
    assert bench.snapshot_times([45, 10, 60, 20], 60) == [10, 20, 45]  # 60 = the end of training, taken anyway
    assert bench.snapshot_times([10, 20], 1) == []
    args, extra = bench.parse_args(["--minutes", "1", "--at", "0.5,0.25,0.5", "--", "--eval-interval", "50"])
    assert (args.minutes, args.at, extra) == (1.0, [0.25, 0.5], ["--eval-interval", "50"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--at", "ten"])


def test_snapshot_log_evaluation_and_table(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert bench.take_snapshot(run, tmp_path / "snaps" / "1min.pt") is None  # no evaluation yet
    model, tok, meta = save_seq2seq(run)
    native.save(run / "last.pt", {"model": model.state_dict()}, dict(meta, step=500, val_loss=2.5))
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"kind": "train", "step": 450, "elapsed": 100.0},
        {"kind": "eval", "step": 500, "val_loss": 2.5, "elapsed": 123.0},
    ]) + '\n{"kind": "ev')  # a record being written is skipped
    snap = bench.take_snapshot(run, tmp_path / "snaps" / "1min.pt")
    assert snap == {"file": str(tmp_path / "snaps" / "1min.pt"), "step": 500, "val_loss": 2.5}
    native.save(run / "last.pt", {"model": model.state_dict()}, dict(meta, step=1000, val_loss=2.0))
    assert loader.read_meta(snap["file"])["step"] == 500  # the snapshot outlives last.pt's replacement
    records = bench.read_log(run)
    assert len(records) == 2 and bench.train_minutes(records, 500) == 2.05 and bench.train_minutes(records, 9) is None

    sources, references = ["abc", "hgf edc", "bad cafe", "a"], ["cba", "cde fgh", "efac dab", "a"]
    result = bench.evaluate_checkpoint(snap["file"], sources, references, beam_size=3, batch_size=2)
    eos = meta["seq2seq"]["eos"]
    for name, k in (("greedy", 1), ("beam", 3)):
        want = evaluate(model, tok, sources, references, eos, eos, beam_size=k, batch_size=2)
        got = result[name]
        assert got["bleu"] == round(want["bleu"], 2) and got["sample"] == want["hypotheses"][:3]
        assert got["sentences_per_s"] > 0 and got["signature"].startswith("nrefs:1")

    rows = [{"minutes": 0.5, "step": None},
            {"minutes": 1.02, "train_minutes": 2.05, "step": 500, "val_loss": 2.5, **result}]
    table = bench.markdown(rows, 3).splitlines()
    assert table[0].startswith("| minutes | trained (min) | step | val loss | BLEU greedy | BLEU beam 3 |")
    assert table[2] == "| 0.5 | - | no checkpoint yet | | | | | |"
    assert table[3].startswith(f"| 1.02 | 2.05 | 500 | 2.500 | {result['greedy']['bleu']:.2f} | ")

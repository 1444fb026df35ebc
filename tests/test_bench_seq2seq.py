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
    (run / "log.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"kind": "train", "step": 450, "elapsed": 100.0},
                {"kind": "eval", "step": 500, "val_loss": 2.5, "elapsed": 123.0},
            ]
        )
        + '\n{"kind": "ev'
    )  # a record being written is skipped
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
        assert (got["ratio"], got["bp"]) == (round(want["ratio"], 3), round(want["bp"], 3))
        hyp_len = sum(len(h.split()) for h in want["hypotheses"])  # these have no punctuation for 13a to split
        assert want["ratio"] == hyp_len / want["ref_len"] and want["hyp_len"] == hyp_len
        assert got["sentences_per_s"] > 0 and got["signature"].startswith("nrefs:1")
        assert [got[k] for k in ("rouge1", "rouge2", "rougeL")] == [
            round(want[k], 2) for k in ("rouge1", "rouge2", "rougeL")
        ]
        assert got["rouge_signature"].startswith("rouge-score ")

    rows = [
        {"minutes": 0.5, "step": None},
        {"minutes": 1.02, "train_minutes": 2.05, "step": 500, "val_loss": 2.5, **result},
    ]
    table = bench.markdown(rows, 3).splitlines()
    assert table[0].startswith(
        "| minutes | trained (min) | step | val loss | BLEU greedy | ratio greedy | BLEU beam 3 | ratio beam 3 |"
    )
    assert table[2] == "| 0.5 | - | no checkpoint yet | | | | | | | |"
    assert table[3].startswith(
        f"| 1.02 | 2.05 | 500 | 2.500 | {result['greedy']['bleu']:.2f} | "
        f"{result['greedy']['ratio']:.3f} | {result['beam']['bleu']:.2f} | "
    )
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_one_checkpoint_is_filed_under_decoding(tmp_path, monkeypatch):
    """--ckpt FILE --label L: no training; the row joins seq2seq.json's "decoding" (replacing one of the
    same label), the training table stays, and seq2seq.md shows both."""
    run = tmp_path / "run"
    model, _, meta = save_seq2seq(run)
    native.save(run / "last.pt", {"model": model.state_dict()}, dict(meta, step=700, val_loss=1.5))
    data = tmp_path / "m30k"
    data.mkdir()
    (data / "test_2016_flickr.de").write_text("abc\nhgf edc\n")
    (data / "test_2016_flickr.en").write_text("cba\ncde fgh\n")
    results = tmp_path / "results"
    results.mkdir()
    old = {
        "command": "train.py ...",
        "test_set": "test_2016_flickr",
        "sentences": 2,
        "beam_size": 3,
        "rows": [
            {
                "minutes": 1,
                "train_minutes": 1,
                "step": 500,
                "val_loss": 2.0,
                "greedy": {"bleu": 1.0, "sentences_per_s": 2.0},
                "beam": {"bleu": 3.0, "sentences_per_s": 4.0},
            }
        ],
    }
    (results / "seq2seq.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit):
        bench.parse_args(["--ckpt", str(run / "last.pt")])  # a row needs its label
    for label, alpha in (("before", "0.6"), ("after", "1.0"), ("before", "0.0")):
        assert (
            bench.main(
                [
                    "--ckpt",
                    str(run / "last.pt"),
                    "--label",
                    label,
                    "--length-penalty",
                    alpha,
                    "--beam-size",
                    "3",
                    "--input",
                    str(data),
                    "--results",
                    str(results),
                ]
            )
            == 0
        )
    result = json.loads((results / "seq2seq.json").read_text())
    assert result["rows"] == old["rows"]
    assert [(e["label"], e["length_penalty"], e["step"]) for e in result["decoding"]] == [
        ("after", 1.0, 700),
        ("before", 0.0, 700),
    ]
    assert {"bleu", "ratio", "bp", "rouge1", "rouge2", "rougeL", "sentences_per_s"} <= set(
        result["decoding"][0]["beam"]
    )
    md = (results / "seq2seq.md").read_text().splitlines()
    assert md[2].startswith("| minutes |") and md[3 + 1].startswith("| 1 | 1 | 500 | 2.000 | 1.00 | - | 3.00 | - |")
    assert md[-2].startswith("| after | 1 | 700 | 1.500 | ") and md[-1].startswith("| before | 0 | 700 | 1.500 | ")

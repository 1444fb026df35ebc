"""bench/bench_seq2seq.py's pieces on a tiny checkpoint: snapshots of last.pt, the log's clock,
BLEU / ROUGE / speed of greedy and beam decoding, the markdown tables, the length-penalty sweep on val.
(The full benchmark trains for an hour.)"""

import importlib.util
import json
import sys
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
tables = sys.modules["seq2seq_tables"]  # bench/, imported by bench_seq2seq.py (which puts bench/ on the path)


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
    table = tables.markdown(rows, 3).splitlines()
    assert table[0].startswith(
        "| minutes | trained (min) | step | val loss | BLEU greedy | ratio greedy | BLEU beam 3 | ratio beam 3 | "
        "ROUGE-1/2/L greedy | ROUGE-1/2/L beam 3 |"
    )
    assert table[2] == "| 0.5 | - | no checkpoint yet | | | | | | | | | |"
    g, b = result["greedy"], result["beam"]
    assert table[3].startswith(
        f"| 1.02 | 2.05 | 500 | 2.500 | {g['bleu']:.2f} | {g['ratio']:.3f} | {b['bleu']:.2f} | {b['ratio']:.3f} | "
        f"{g['rouge1']:.2f} / {g['rouge2']:.2f} / {g['rougeL']:.2f} | "
        f"{b['rouge1']:.2f} / {b['rouge2']:.2f} / {b['rougeL']:.2f} | "
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
        "length_penalty": 0.6,
        "note": "Alpha 0.6 here.",
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
    assert md[0].startswith("Multi30k de->en (test_2016_flickr, 2 sentences, beam length penalty 0.6), `train.py")
    assert md[2] == "Alpha 0.6 here." and md[4].startswith("| minutes |")
    assert md[6].startswith("| 1 | 1 | 500 | 2.000 | 1.00 | - | 3.00 | - |")
    assert md[-2].startswith("| after | 1 | 700 | 1.500 | ") and md[-1].startswith("| before | 0 | 700 | 1.500 | ")
    assert md[6].split(" | ")[8:10] == ["-", "-"]  # an old row without ROUGE
    beam = result["decoding"][0]["beam"]
    assert f"| {beam['rouge1']:.2f} / {beam['rouge2']:.2f} / {beam['rougeL']:.2f} |" in md[-2]


def test_the_length_penalty_is_chosen_on_val_and_only_then_is_test_decoded(tmp_path, monkeypatch):
    """--sweep: every alpha is scored on val.{de,en}; the test set is decoded twice, greedy and at the chosen
    alpha, after the choice; a different test set leaves the sweep and the choice alone."""
    run = tmp_path / "run"
    save_seq2seq(run)
    data = tmp_path / "m30k"
    data.mkdir()
    val = ["abc", "hgf edc", "bad cafe"], ["cba", "cde fgh", "efac dab"]
    test = ["gab", "fed"], ["bag", "def"]
    for split, (de, en) in (("val", val), ("test_2016_flickr", test)):
        (data / f"{split}.de").write_text("\n".join(de) + "\n")
        (data / f"{split}.en").write_text("\n".join(en) + "\n")
    calls = []
    real_score = bench.score

    def spy(loaded, sources, references, beam_size, alpha, batch_size):
        calls.append(("val" if (sources, references) == val else "test", beam_size, alpha))
        return real_score(loaded, sources, references, beam_size, alpha, batch_size)

    monkeypatch.setattr(bench, "score", spy)
    argv = ["--ckpt", str(run / "best.pt"), "--sweep", "2,0,0.6", "--beam-size", "3", "--input", str(data)]
    assert bench.main([*argv, "--results", str(tmp_path / "a")]) == 0
    result = json.loads((tmp_path / "a" / "seq2seq-val.json").read_text())
    chosen = result["chosen"]
    assert chosen == bench.choose_alpha(result["sweep"]) and result["split"] == "val" and result["sentences"] == 3
    assert calls == [("val", 3, 0.0), ("val", 3, 0.6), ("val", 3, 2.0), ("val", 1, 0.0)] + [
        ("test", 1, 0.0),
        ("test", 3, chosen),
    ]
    assert [r["length_penalty"] for r in result["sweep"]] == [0.0, 0.6, 2.0]
    assert {"bleu", "ratio", "bp", "rouge1", "rouge2", "rougeL"} <= set(result["sweep"][0])
    assert (result["test"]["test_set"], result["test"]["sentences"], result["test"]["length_penalty"]) == (
        "test_2016_flickr",
        2,
        chosen,
    )
    assert {"cpu", "capability", "native_bf16"} <= set(result["machine"])
    md = (tmp_path / "a" / "seq2seq-val.md").read_text()
    assert md.count("(chosen)") == 1 and result["machine"]["cpu"] in md and f"alpha {chosen:g}" in md
    assert "\nStopped early.\n" in tables.render_sweep(dict(result, note="Stopped early.")) and "Stopped" not in md

    (data / "test_2016_flickr.en").write_text("hhh hhh\nggg ggg\n")  # another test set: the choice does not move
    assert bench.main([*argv, "--results", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "seq2seq-val.json").read_text())
    keep = ("bleu", "ratio", "rouge1", "rouge2", "rougeL", "sample")
    assert [{k: r[k] for k in keep} for r in again["sweep"]] == [{k: r[k] for k in keep} for r in result["sweep"]]
    assert again["chosen"] == chosen and again["test"]["beam"]["ratio"] != result["test"]["beam"]["ratio"]


def test_sweep_settings_and_a_missing_split(tmp_path, monkeypatch, capsys):
    args, _ = bench.parse_args(["--ckpt", "x.pt", "--sweep", "1.5, 0,0.6"])
    assert (args.sweep, args.split, args.label) == ([0.0, 0.6, 1.5], "val", None)
    for argv in (
        ["--ckpt", "x.pt", "--sweep", "0,1", "--split", "test_2016_flickr"],  # tuning on the test set: refused
        ["--ckpt", "x.pt", "--sweep", "0,one"],
        ["--sweep", "0,1"],  # no checkpoint
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    assert bench.parse_args(["--ckpt", "x.pt", "--label", "l", "--split", "val"])[0].split == "val"
    assert bench.parse_args([])[0].split == "test_2016_flickr"

    run = tmp_path / "run"
    save_seq2seq(run)
    data = tmp_path / "m30k"
    data.mkdir()
    (data / "val.de").write_text("abc\n")
    (data / "val.en").write_text("cba\n")
    monkeypatch.setattr(bench, "score", lambda *a: pytest.fail("decoded before the test set was found"))
    argv = ["--ckpt", str(run / "best.pt"), "--sweep", "0,1", "--input", str(data), "--results", str(tmp_path)]
    capsys.readouterr()  # parse_args' usage lines above
    assert bench.run_main(lambda: bench.main(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no such file: ") and "test_2016_flickr.de" in err and err.count("\n") == 1
    assert not (tmp_path / "seq2seq-val.json").exists()


@pytest.mark.parametrize(
    "rows, chosen",
    [
        ([(0.0, 39.77, 0.958), (0.6, 40.23, 0.971), (1.5, 40.1, 1.0)], 0.6),  # the best BLEU, whatever its ratio
        ([(0.6, 40.23, 0.971), (1.0, 40.23, 0.99), (1.5, 40.23, 1.02)], 1.0),  # a tie: the ratio closest to 1
        ([(2.0, 40.23, 1.01), (1.5, 40.23, 0.99)], 1.5),  # and then the smaller alpha
        ([(1.0, 40.23, 0.98), (1.5, 40.23, 1.02), (0.6, 40.23, 1.03)], 1.0),  # 0.98 and 1.02: as far from 1
    ],
)
def test_choose_alpha(rows, chosen):
    assert bench.choose_alpha([{"length_penalty": a, "bleu": b, "ratio": r} for a, b, r in rows]) == chosen

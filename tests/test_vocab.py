"""Reusable vocabularies: data/prepare.py --tokenizer-from RUN_OR_DATASET, and its unknown-character policy."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, TRAIN, one_line_error, script, train_run

from gpt.data.prepare import prepare
from gpt.data.tokenizer import get_tokenizer
from gpt.data.tokens import open_dataset
from gpt.train.start import tokenizers_match

prepare_script = script("data/prepare")
NEW_TEXT = "Café — naïve ROMEO:\nhello there, friend.\n" * 30


@pytest.fixture
def new_text(tmp_path):
    path = tmp_path / "new.txt"
    path.write_text(NEW_TEXT, encoding="utf-8")
    return path


def test_unknown_characters_are_counted_and_refused_by_default(base, new_text, tmp_path, capsys):
    err = one_line_error(
        capsys,
        prepare_script.main,
        str(new_text),
        "--out",
        str(tmp_path / "new"),
        "--tokenizer-from",
        str(base),
        "--block-size",
        "8",
    )
    assert "the corpus has 90 characters (3 distinct): 'é' x30, '—' x30, 'ï' x30 that the vocabulary of" in err
    assert "pass --unknown replace to write them as '?'" in err
    assert not (tmp_path / "new").exists()


def test_replaced_characters_keep_the_runs_vocabulary_and_fine_tune(base, tiny_char_data, new_text, tmp_path, capsys):
    out = tmp_path / "new"
    assert (
        prepare_script.main(
            [
                str(new_text),
                "--out",
                str(out),
                "--tokenizer-from",
                str(base),
                "--unknown",
                "replace",
                "--block-size",
                "8",
                "--val-fraction",
                "0.2",
            ]
        )
        == 0
    )
    assert (
        "90 characters (3 distinct): 'é' x30, '—' x30, 'ï' x30 not in the vocabulary, written as '?'"
        in capsys.readouterr().out
    )
    ds = open_dataset(out)
    source = open_dataset(tiny_char_data)
    assert ds.tokenizer_spec == source.tokenizer_spec and ds.vocab_size == source.vocab_size
    tok = get_tokenizer(ds.tokenizer_spec)
    text = tok.decode(np.concatenate([ds.split("train"), ds.split("val")]))
    assert text.replace("<|endoftext|>", "") == NEW_TEXT.replace("é", "?").replace("—", "?").replace("ï", "?")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["corpus"]["unknown_chars"] == {
        "count": 90,
        "replaced_by": "?",
        "most_common": [["é", 30], ["—", 30], ["ï", 30]],
    }
    # the point of it all: the run's checkpoint fine-tunes on the new text
    summary = train_run(
        "--data",
        out,
        "--out-dir",
        tmp_path / "ft",
        "--init-from",
        base,
        *TRAIN,
        "--block-size",
        "8",
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
    )
    assert summary["step"] == 2


def test_a_chosen_replacement_must_be_in_the_vocabulary(base, new_text, tmp_path, capsys):
    err = one_line_error(
        capsys,
        prepare_script.main,
        str(new_text),
        "--out",
        str(tmp_path / "n"),
        "--tokenizer-from",
        str(base),
        "--unknown",
        "replace",
        "--replacement",
        "€",
        "--block-size",
        "8",
    )
    assert "--replacement '€': must be one character of the vocabulary" in err
    assert (
        prepare_script.main(
            [
                str(new_text),
                "--out",
                str(tmp_path / "n"),
                "--tokenizer-from",
                str(base),
                "--unknown",
                "replace",
                "--replacement",
                " ",
                "--block-size",
                "8",
            ]
        )
        == 0
    )


def test_a_bpe_vocabulary_is_reused_from_a_dataset_without_torch(tmp_path, new_text):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "README.md").read_text(encoding="utf-8") * 3, encoding="utf-8")
    bpe = prepare([corpus], tmp_path / "bpe", "bpe", vocab_size=400, block_size=8, progress=False).meta
    code = (
        f"import sys; from gpt.data.prepare import prepare; "
        f"prepare([{str(new_text)!r}], {str(tmp_path / 'reused')!r}, tokenizer_from={str(tmp_path / 'bpe')!r}, "
        f"block_size=8, progress=False); assert 'torch' not in sys.modules, 'imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    reused = open_dataset(tmp_path / "reused")
    assert tokenizers_match(reused.tokenizer_spec, open_dataset(tmp_path / "bpe").tokenizer_spec)
    assert (
        json.loads((tmp_path / "reused" / "meta.json").read_text())["tokenizer"]["ranks_sha256"]
        == bpe["tokenizer"]["ranks_sha256"]
    )
    tok = get_tokenizer(reused.tokenizer_spec)
    assert list(reused.split("train")[:20]) == tok.encode(NEW_TEXT)[:20]  # byte-level: nothing unknown
    assert json.loads((tmp_path / "reused" / "meta.json").read_text())["corpus"]["unknown_chars"]["count"] == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tokenizer", "char"], "--tokenizer char and --tokenizer-from {base} (a 'char' tokenizer): give one or"),
        (["--vocab-size", "300"], "--vocab-size 300 and --tokenizer-from {base} (a 'char' tokenizer): give one or"),
        (["--tokenizer-file", "x.tiktoken"], "--tokenizer-file is GPT-2's ranks file;"),
    ],
)
def test_options_that_do_not_go_with_a_reused_tokenizer(base, new_text, tmp_path, capsys, flags, message):
    err = one_line_error(
        capsys, prepare_script.main, str(new_text), "--out", str(tmp_path / "n"), "--tokenizer-from", str(base), *flags
    )
    assert message.format(base=base) in err and len(err) < 300  # the path and the kind, never the spec


def test_a_missing_source_and_pairs_are_one_line(new_text, tmp_path, capsys):
    err = one_line_error(
        capsys,
        prepare_script.main,
        str(new_text),
        "--out",
        str(tmp_path / "n"),
        "--tokenizer-from",
        str(tmp_path / "nothing"),
    )
    assert f"--tokenizer-from {tmp_path / 'nothing'}: no such run, checkpoint or dataset" in err
    err = one_line_error(
        capsys,
        prepare_script.main,
        "--pairs",
        str(new_text),
        str(new_text),
        "--out",
        str(tmp_path / "p"),
        "--tokenizer-from",
        str(tmp_path),
    )
    assert "--tokenizer-from is for INPUT text, --chat and --preferences datasets, not --pairs" in err

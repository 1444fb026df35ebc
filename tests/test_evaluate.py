"""`python -m gpt.evaluate`: settings and the output path are checked before anything is decoded, each
mistake one line with exit 2."""

import pytest
from test_sample_seq2seq import save_seq2seq

import gpt.infer.translate as decoding
from gpt.cli import evaluate as cli_evaluate

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A seq2seq run, sources and references; the decoders record each batch they decode."""
    save_seq2seq(tmp_path / "run")
    (tmp_path / "src.txt").write_text("abc\nhgf\n")
    (tmp_path / "ref.txt").write_text("cba\nfgh\n")
    decoded = []
    for name in ("generate", "beam_search"):
        real = getattr(decoding, name)
        monkeypatch.setattr(decoding, name, lambda *a, _real=real, **k: decoded.append(1) or _real(*a, **k))
    return tmp_path, decoded


def run(capsys, tmp_path, *argv):
    code = cli_evaluate.main(
        [
            "--ckpt",
            str(tmp_path / "run"),
            "--source-file",
            str(tmp_path / "src.txt"),
            "--reference",
            str(tmp_path / "ref.txt"),
            "--device",
            "cpu",
            *map(str, argv),
        ]
    )
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--output", "{tmp}/missing/h.txt"],
            "--output {tmp}/missing/h.txt: there is no directory {tmp}/missing; create it first",
        ),
        (["--output", "{tmp}/src.txt/h.txt"], "--output {tmp}/src.txt/h.txt: {tmp}/src.txt is a file, not a directory"),
        (["--output", "{tmp}/run"], "--output {tmp}/run is a directory: name a file"),
        (["--beam-size", "0"], "--beam-size must be an integer >= 1 (1 is greedy), got 0"),
        (["--beam-size", "-2"], "--beam-size must be an integer >= 1 (1 is greedy), got -2"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        (["--limit", "0"], "--limit must be an integer >= 1 (the first N lines), got 0"),
        (["--limit", "-3"], "--limit must be an integer >= 1 (the first N lines), got -3"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
        (["--max-new-tokens", "33"], "--max-new-tokens 33 is more than the model's block_size=32"),
        (["--beam-size", "6"], "--beam-size 6 is too large for a vocabulary of 11 ids: at most 5"),
    ],
)
def test_each_mistake_is_one_line_before_any_decoding(files, capsys, argv, message):
    tmp_path, decoded = files
    code, out, err = run(capsys, tmp_path, *(a.format(tmp=tmp_path) for a in argv))
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and message.format(tmp=tmp_path) in err and err.count("\n") == 1, err
    assert decoded == []


def test_a_good_run_writes_its_output(files, capsys):
    pytest.importorskip("sacrebleu")
    tmp_path, decoded = files
    code, out, err = run(capsys, tmp_path, "--output", tmp_path / "hyp.txt", "--limit", "1")
    assert code == 0 and out.startswith("BLEU ") and "| 1 sentences in" in out, err
    assert decoded == [1] and (tmp_path / "hyp.txt").read_text().count("\n") == 1

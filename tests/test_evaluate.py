"""`gpt evaluate`: settings and the output path are checked before anything is decoded, each
mistake one line with exit 2; BLEU and ROUGE are sacrebleu's and rouge-score's numbers on the outputs."""

import importlib.util
import json

import pytest
from test_sample_seq2seq import save_seq2seq

import gpt.infer.translate as decoding
from gpt.cli import evaluate as cli_evaluate
from gpt.infer.evaluate import corpus_rouge

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
        (["--json", "{tmp}/missing/r.json"], "--json {tmp}/missing/r.json: there is no directory {tmp}/missing"),
        (["--metric", "bleu,meteor"], "--metric 'bleu,meteor': expected a comma-separated list of bleu, rouge"),
        (["--metric", ","], "--metric ',': expected a comma-separated list of bleu, rouge"),
        (["--stride", "4"], "--stride: for --text"),
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
    pytest.importorskip("rouge_score")  # (gpt evaluate scores BLEU and ROUGE by default)
    tmp_path, decoded = files
    code, out, err = run(capsys, tmp_path, "--output", tmp_path / "hyp.txt", "--limit", "1")
    assert code == 0 and out.startswith("BLEU ") and "| 1 sentences in" in out, err
    assert decoded == [1] and (tmp_path / "hyp.txt").read_text().count("\n") == 1


def test_rouge_of_known_pairs():
    pytest.importorskip("rouge_score")
    # unigrams: 5 of 6 shared (the x2, cat, on, mat); bigrams: 3 of 5 (the cat, on the, the mat); LCS 5 of 6
    one = corpus_rouge(["the cat sat on the mat"], ["the cat is on the mat"])
    assert one == pytest.approx({"rouge1": 100 * 5 / 6, "rouge2": 60.0, "rougeL": 100 * 5 / 6})
    # the package's tokenizer: lower case, words of a-z0-9; F-measure = 2PR / (P + R), averaged over the pairs
    two = corpus_rouge(["the cat sat on the mat", "A dog!"], ["the cat is on the mat", "a dog runs fast"])
    f1 = 2 * 1 * 0.5 / (1 + 0.5)  # "a dog" unigrams: precision 2/2, recall 2/4
    f2 = 2 * 1 * (1 / 3) / (1 + 1 / 3)  # bigrams: "a dog", precision 1/1, recall 1/3
    assert two["rouge1"] == pytest.approx((100 * 5 / 6 + 100 * f1) / 2)
    assert two["rouge2"] == pytest.approx((60.0 + 100 * f2) / 2)


def test_the_printed_and_json_numbers_are_the_packages_on_the_models_outputs(files, capsys):
    pytest.importorskip("sacrebleu")
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    import sacrebleu

    tmp_path, _ = files
    code, out, err = run(capsys, tmp_path, "--output", tmp_path / "hyp.txt", "--metric", "bleu")
    assert code == 0 and "ROUGE" not in out, err
    hyps = (tmp_path / "hyp.txt").read_text().splitlines()
    # references sharing some of the outputs' words, so every score is neither 0 nor 100
    refs = [" ".join(h.split()[:2] + ["fgh", "cab"]) for h in hyps]
    (tmp_path / "ref.txt").write_text("".join(r + "\n" for r in refs))
    code, out, err = run(capsys, tmp_path, "--output", tmp_path / "hyp.txt", "--json", tmp_path / "r.json")
    assert code == 0, err
    assert (tmp_path / "hyp.txt").read_text().splitlines() == hyps  # the same outputs: greedy is deterministic
    got = json.loads((tmp_path / "r.json").read_text())
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    for key, label in (("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L")):
        want = 100 * sum(scorer.score(r, h)[key].fmeasure for h, r in zip(hyps, refs)) / len(hyps)
        assert 0 < want < 100 and got[key] == pytest.approx(want, rel=1e-12)
        assert f"{label} {want:.2f}" in out
    bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
    assert got["bleu"] == pytest.approx(bleu) and out.startswith(f"BLEU {bleu:.2f} | ROUGE-1 ")
    assert got["task"] == "translation" and got["sentences"] == 2 and "hypotheses" not in got

    code, out, err = run(capsys, tmp_path, "--metric", "rouge", "--json", tmp_path / "r.json")
    assert code == 0 and out.startswith("ROUGE-1 ") and "BLEU" not in out, err
    assert "bleu" not in json.loads((tmp_path / "r.json").read_text())


def test_a_missing_metric_package_is_one_line_before_decoding(files, capsys, monkeypatch):
    tmp_path, decoded = files
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rouge_score" else real(name, *a))
    code, out, err = run(capsys, tmp_path)
    assert (code, out) == (2, "") and decoded == [] and err.count("\n") == 1
    assert 'error: ROUGE needs rouge-score: pip install -e ".[seq2seq]"' in err and "or pass --metric bleu" in err

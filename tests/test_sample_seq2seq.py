"""sample.py --source / --source-file with a seq2seq checkpoint: one line per source, greedy by default,
beam 1 == greedy, seeded sampling, the length bound, and one-line errors for every mismatch."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_random_lm

from gpt import GPT, GPTConfig
from gpt.checkpoints import loader, native
from gpt.cli import sample  # what sample.py runs
from gpt.data.tokenizer import CharTokenizer
from gpt.infer.translate import DEFAULT_LENGTH_PENALTY, TranslateConfig, translate, translate_lines

ROOT = Path(__file__).resolve().parents[1]
CHARS = "\n abcdefgh"  # a newline in the vocabulary: a translation may contain one
SOURCES = ["abc", "", "hgf edc", "a", "abc", "bad cafe", "h h h h"]  # an empty line, a repeated one


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def save_seq2seq(path: Path, seq2seq: bool = True, seed: int = 0):
    """A tiny random encoder-decoder checkpoint, saved with the meta a trainer writes."""
    tok = CharTokenizer(CHARS)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_encoder_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():  # large random weights: peaked, varied next-token distributions
        for p in model.parameters():
            p.normal_(0, 0.5)
    eot = tok.eot_token
    meta = {"step": 0, "model_config": cfg.to_dict(), "tokenizer": tok.spec}
    if seq2seq:
        meta["seq2seq"] = {"bos": eot, "eos": eot, "pad": eot}
    native.save(path / "best.pt", {"model": model.state_dict()}, meta)
    return model.eval(), tok, meta


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("s2s")
    save_seq2seq(path)
    return path


@pytest.fixture(scope="module")
def loaded(run_dir):
    return loader.load_checkpoint(run_dir)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return save_random_lm(tmp_path_factory.mktemp("lm"), CHARS)


@pytest.fixture
def source_file(tmp_path):
    path = tmp_path / "src.txt"
    path.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    return path


def cli(capsys, *argv):
    """sample.py in this process, on CPU in float32 like the in-process references (flags may override): in
    bf16 the translations would differ from theirs, and a source's with its batch mates."""
    code = sample.main(["--device", "cpu", "--dtype", "float32", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_source_file_gives_one_line_per_input_line(run_dir, loaded, source_file, capsys):
    model, tok, meta = loaded
    eos = meta["seq2seq"]["eos"]
    raw = translate(model, tok, SOURCES, eos, eos)
    assert any("\n" in t for t in raw)  # the model does emit line breaks: the one-line rule is exercised
    code, out, err = cli(capsys, "--ckpt", run_dir, "--source-file", source_file, "--batch-size", 3)
    assert code == 0
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) - 1 == len(SOURCES)
    assert lines[:-1] == [" ".join(t.splitlines()) for t in raw]
    assert lines[0] == lines[4]  # the same source, the same translation, wherever it is in its batch
    assert cli(capsys, "--ckpt", run_dir, "--source-file", source_file)[1] == out  # batch size changes nothing
    assert err.startswith("7 sentence(s) in ") and "sentences/s; greedy; cpu, float32" in err


def test_repeated_source_flags(run_dir, source_file, capsys):
    code, out, _ = cli(capsys, "--ckpt", run_dir, "--source", "hgf edc", "--source", "abc")
    by_file = cli(capsys, "--ckpt", run_dir, "--source-file", source_file)[1].split("\n")
    assert code == 0 and out.split("\n") == [by_file[2], by_file[0], ""]


def test_greedy_is_the_default_and_beam_one_is_greedy(run_dir, loaded, source_file, capsys):
    model, tok, meta = loaded
    greedy = translate_lines(model, tok, meta, SOURCES, TranslateConfig())
    base = ["--ckpt", run_dir, "--source-file", source_file]
    default = cli(capsys, *base)[1]
    assert default == "".join(line + "\n" for line in greedy)
    assert cli(capsys, *base, "--temperature", 0)[1] == default
    assert cli(capsys, *base, "--beam-size", 1)[1] == default
    code, beam, err = cli(capsys, *base, "--beam-size", 3, "--length-penalty", 1.0)
    assert code == 0 and len(beam.split("\n")) == len(SOURCES) + 1 and "beam 3, length penalty 1" in err
    assert beam == "".join(line + "\n" for line in translate_lines(model, tok, meta, SOURCES, TranslateConfig(3, 1.0)))


def test_explicit_temperature_samples_reproducibly(run_dir, source_file, capsys):
    base = ["--ckpt", run_dir, "--source-file", source_file, "--temperature", 1.0]
    code, first, err = cli(capsys, *base, "--seed", 3)
    assert code == 0 and "sampling at temperature 1, top-k 200, top-p 1; seed 3" in err
    assert cli(capsys, *base, "--seed", 3)[1] == first
    assert cli(capsys, *base, "--seed", 4)[1] != first
    assert (
        cli(capsys, *base, "--seed", 3, "--top-k", 1)[1]
        == cli(capsys, "--ckpt", run_dir, "--source-file", source_file)[1]
    )


def test_max_new_tokens_bounds_each_translation(run_dir, source_file, capsys):
    full = cli(capsys, "--ckpt", run_dir, "--source-file", source_file)[1].split("\n")[:-1]
    assert max(map(len, full)) > 3  # char tokenizer: one token per character
    code, out, _ = cli(capsys, "--ckpt", run_dir, "--source-file", source_file, "--max-new-tokens", 3)
    cut = out.split("\n")[:-1]
    assert code == 0 and len(cut) == len(SOURCES)
    assert cut == [line[:3] for line in full]  # greedy: the same translations, cut at 3 tokens


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--prompt", "abc"],
            "is a seq2seq (encoder-decoder) checkpoint: translate with --source TEXT or "
            "--source-file FILE, not --prompt",
        ),
        ([], "is a seq2seq (encoder-decoder) checkpoint: translate with --source TEXT or --source-file FILE"),
        (
            ["--source", "abc", "--beam-size", "2", "--temperature", "1"],
            "--beam-size 2 searches deterministically: leave --temperature at 0 (got 1.0), or sample with --beam-size 1",
        ),
        (
            ["--source", "abc", "--num-samples", "2", "--stop", "x"],
            "--num-samples, --stop are for text sampling (--prompt), not translation",
        ),
        (["--source", "abc", "--beam-size", "0"], "--beam-size must be an integer >= 1"),
        (["--source", "abc", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
        (
            ["--source", "abc", "--max-new-tokens", "33"],
            "--max-new-tokens 33 is more than the model's block_size=32: the decoder has no positions beyond it",
        ),
        (["--source", "abc~"], "not in the char vocabulary: '~'"),
        (["--source-file", "/nonexistent/src.txt"], "no such file: /nonexistent/src.txt"),
    ],
)
def test_each_mistake_is_one_clear_line(run_dir, capsys, args, message):
    code, out, err = cli(capsys, "--ckpt", run_dir, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_source_with_a_decoder_only_checkpoint_and_translation_flags_with_prompt(lm_dir, capsys):
    code, out, err = cli(capsys, "--ckpt", lm_dir, "--source", "abc")
    assert (code, out) == (2, "")
    assert err == (
        f"error: --source needs a seq2seq (encoder-decoder) checkpoint; {lm_dir} is decoder-only: "
        f"continue text with --prompt instead\n"
    )
    code, out, err = cli(capsys, "--ckpt", lm_dir, "--prompt", "abc", "--beam-size", 4)
    assert (code, out, err) == (2, "", "error: --beam-size is for translation: give --source or --source-file\n")


def test_empty_source_file_and_missing_seq2seq_meta(tmp_path, capsys):
    save_seq2seq(tmp_path, seq2seq=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = cli(capsys, "--ckpt", tmp_path, "--source-file", empty)
    assert code == 2 and err == f"error: {empty} is empty: nothing to translate\n"
    code, _, err = cli(capsys, "--ckpt", tmp_path, "--source", "abc")
    assert code == 2 and 'checkpoint meta has no "seq2seq" entry' in err and err.count("\n") == 1


def test_script_translates_as_a_program(run_dir, source_file):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "sample.py"),
            "--ckpt",
            str(run_dir),
            "--source-file",
            str(source_file),
            "--beam-size",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == len(SOURCES) and "beam 2" in proc.stderr
    proc = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(run_dir), "--prompt", "abc"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_help_states_the_default_length_penalty(capsys):
    """--help is answered without importing torch, so it spells the default out: it must be the one used."""
    with pytest.raises(SystemExit):
        sample.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {DEFAULT_LENGTH_PENALTY:g}, gpt.infer.translate.DEFAULT_LENGTH_PENALTY" in text

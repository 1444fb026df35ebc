"""`gpt evaluate --text`: loss, perplexity and bits-per-byte over a text file in sliding windows,
equal to the same sums computed by hand from full forward passes; bits per byte compares char and BPE."""

import json
import math

import pytest
import torch
from test_sample_seq2seq import save_seq2seq

from gpt.checkpoints import loader, native
from gpt.cli import evaluate as cli_evaluate
from gpt.data.bpe import train_bpe
from gpt.data.tokenizer import CharTokenizer, get_tokenizer
from gpt.infer.perplexity import plan_windows
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ASCII = " \n.,abcdefghijklmnopqrstuvwxyz"
TEXT = "the quick brown fox jumps over the lazy dog.\nhow vexingly quick daft zebras jump, "  # 82 ASCII characters


def save_lm(path, tok, seed=0, block_size=16, **model):
    """A tiny random decoder-only checkpoint with tokenizer `tok`; large weights, so every token's
    probability differs and a wrong window shows."""
    cfg = GPTConfig(vocab_size=tok.vocab_size + 3, block_size=block_size, n_layer=2, n_head=2, n_embd=16, **model)
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    native.save(path / "best.pt", {"model": model.state_dict()}, {"model_config": cfg.to_dict(), "tokenizer": tok.spec})
    return path


def evaluate_text(capsys, tmp_path, ckpt, text, *argv):
    """The CLI on `text` (written as UTF-8 bytes): its exit code, printed table and JSON results."""
    (tmp_path / "text.txt").write_bytes(text.encode("utf-8"))
    out = tmp_path / "results.json"
    code = cli_evaluate.main(
        ["--ckpt", str(ckpt), "--text", str(tmp_path / "text.txt"), "--json", str(out), "--device", "cpu"]
        + ["--dtype", "float32", *map(str, argv)]
    )
    printed, err = capsys.readouterr()
    assert code == 0, err
    return printed, json.loads(out.read_text())


def by_hand(ckpt, text, windows):
    """Sum of -log p over the scored targets of each (first input, end, scored) window of [eot] + ids: one
    full forward of the window each, log-softmax over the tokenizer's ids."""
    _, model, tok, _, _ = loader.load_for_inference(ckpt, "cpu", "float32", 0, "none")
    seq = torch.tensor([[tok.eot_token, *tok.encode(text)]])
    nll = 0.0
    with torch.no_grad():
        for start, end, k in windows:
            logits, _ = model(seq[:, start:end])
            logp = torch.log_softmax(logits[0, :, : tok.vocab_size].double(), dim=-1)
            targets = seq[0, start + 1 : end + 1]
            nll -= logp[-k:].gather(1, targets[-k:, None]).sum().item()
    return nll


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_the_numbers_are_those_of_the_windows_computed_by_hand(tmp_path, capsys, pos_encoding):
    ckpt = save_lm(tmp_path / "run", CharTokenizer(ASCII), pos_encoding=pos_encoding)
    # 82 tokens after end-of-text, windows of 16, stride 5: the first scores its 16 targets, each next one the
    # 5 after them with 11 tokens of context; the last scores the 1 left, its window still 16 inputs long
    windows = [(0, 16, 16)] + [(end - 16, end, 5) for end in range(21, 82, 5)] + [(66, 82, 1)]
    assert sum(k for *_, k in windows) == len(TEXT) == 82
    nll = by_hand(ckpt, TEXT, windows)
    printed, r = evaluate_text(capsys, tmp_path, ckpt, TEXT, "--stride", 5, "--batch-size", 3)
    assert (r["tokens"], r["bytes"], r["windows"], r["stride"], r["window"]) == (82, 82, len(windows), 5, 16)
    assert r["nll"] == pytest.approx(nll, rel=1e-6)
    assert r["loss"] == pytest.approx(nll / 82, rel=1e-6)
    assert r["ppl"] == pytest.approx(math.exp(nll / 82), rel=1e-6)
    assert r["bpb"] == pytest.approx(nll / math.log(2) / 82, rel=1e-6)
    assert f"bits/byte   {r['bpb']:.4f}" in printed and f"perplexity  {r['ppl']:.3f}" in printed
    # deterministic: the same numbers again, in other batches too
    assert evaluate_text(capsys, tmp_path, ckpt, TEXT, "--stride", 5, "--batch-size", 7)[1]["nll"] == pytest.approx(
        r["nll"], rel=1e-9
    )
    assert evaluate_text(capsys, tmp_path, ckpt, TEXT, "--stride", 5, "--batch-size", 3)[1]["nll"] == r["nll"]


def test_the_default_stride_is_half_a_block_and_a_short_text_is_one_window(tmp_path, capsys):
    ckpt = save_lm(tmp_path / "run", CharTokenizer(ASCII))
    _, r = evaluate_text(capsys, tmp_path, ckpt, TEXT[:40])
    windows = [(0, 16, 16)] + [(end - 16, end, 8) for end in (24, 32, 40)]
    assert (r["stride"], r["windows"]) == (8, 4) and r["nll"] == pytest.approx(by_hand(ckpt, TEXT[:40], windows), 1e-6)
    _, r = evaluate_text(capsys, tmp_path, ckpt, "fox")  # shorter than a block: one forward of [eot] f o
    assert (r["tokens"], r["window"], r["windows"]) == (3, 3, 1)
    assert r["nll"] == pytest.approx(by_hand(ckpt, "fox", [(0, 3, 3)]), rel=1e-6)


@pytest.mark.parametrize(("n", "block", "stride"), [(1, 4, 2), (4, 4, 4), (5, 4, 4), (30, 8, 3), (31, 8, 8), (9, 8, 1)])
def test_every_token_is_scored_once_with_as_much_context_as_the_window_allows(n, block, stride):
    plan = plan_windows(n, block, stride)
    w = min(block, n)
    scored = [t for end, k in plan for t in range(end - k, end)]  # ids scored (index into the text's ids)
    assert scored == list(range(n))
    for i, (end, k) in enumerate(plan):
        assert end - w >= 0 and end <= n  # every window is W inputs long, inside [eot] + ids
        assert k == (w if i == 0 else min(stride, n - plan[i - 1][0]))
        # the least context a scored target gets: the window's inputs before it, itself included
        assert (end - k) - (end - w) + 1 >= (1 if i == 0 else w - stride + 1)
    if stride == block:  # lm-eval's rolling windows: disjoint blocks of `block` targets, the last ending at n
        assert [k for _, k in plan[:-1]] == [block] * (len(plan) - 1)


def test_bits_per_byte_compares_a_char_model_and_a_bpe_model(tmp_path, capsys):
    text = TEXT + "caf\u00e9 na\u00efve "  # two 2-byte characters: 93 characters, 95 bytes
    char = save_lm(tmp_path / "char", CharTokenizer(ASCII + "\u00e9\u00ef"))
    _, c = evaluate_text(capsys, tmp_path, char, text, "--stride", 8)
    assert (c["tokens"], c["bytes"]) == (93, 95)
    assert c["bpb"] == pytest.approx(c["loss"] * 93 / 95 / math.log(2), rel=1e-9)
    _, ascii_only = evaluate_text(capsys, tmp_path, char, TEXT, "--stride", 8)
    assert ascii_only["bpb"] == pytest.approx(ascii_only["loss"] / math.log(2), rel=1e-9)  # one byte per character

    for name, tok in [("gpt2", get_tokenizer({"kind": "gpt2"})), ("own", train_bpe([TEXT * 20], vocab_size=300))]:
        bpe = save_lm(tmp_path / name, tok, pos_encoding="rope")
        _, b = evaluate_text(capsys, tmp_path, bpe, text, "--stride", 8)
        assert b["bytes"] == 95 and b["tokens"] == len(tok.encode(text)) < 60
        assert b["bpb"] == pytest.approx(b["nll"] / math.log(2) / 95, rel=1e-9)
        assert b["bpb"] == pytest.approx(b["loss"] * b["tokens"] / 95 / math.log(2), rel=1e-9)
        n = b["tokens"]  # and the sum is the windows' by hand: the first 16 targets, then 8 at a time
        windows = [(0, 16, 16)] + [(min(e, n) - 16, min(e, n), min(8, n - e + 8)) for e in range(24, n + 8, 8)]
        assert b["nll"] == pytest.approx(by_hand(bpe, text, windows), rel=1e-6)


def test_a_chat_checkpoint_scores_plain_text(chat_run, tmp_path, capsys):
    _, _, tok, meta, _ = loader.load_for_inference(chat_run, "cpu", "float32", 0, "none")
    assert meta.get("chat_template")
    text = "A man is riding a bike.\n"
    _, r = evaluate_text(capsys, tmp_path, chat_run, text, "--stride", 4)
    n = len(tok.encode(text))
    assert r["tokens"] == n and r["window"] == n  # shorter than the model's block: one window
    assert r["nll"] == pytest.approx(by_hand(chat_run, text, [(0, n, n)]), rel=1e-5)


def run_error(capsys, tmp_path, *argv) -> str:
    code = cli_evaluate.main([*map(str, argv), "--device", "cpu"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        (None, [], "--text {tmp}/text.txt: no such file"),
        (b"", [], "--text {tmp}/text.txt is empty: nothing to score"),
        (b"ab\xff", [], "--text {tmp}/text.txt is not UTF-8 text (byte 2"),
        (b"abc", ["--stride", "0"], "--stride must be an integer >= 1, got 0"),
        (b"abc", ["--stride", "17"], "--stride must be from 1 to the model's block_size=16, got 17"),
        (b"abc", ["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
        (b"abc", ["--source-file", "{tmp}/text.txt"], "--source-file: for translations; --text scores a text file"),
        (b"abc", ["--metric", "bleu"], "--metric: for translations"),
        (b"abc", ["--json", "{tmp}/no/r.json"], "--json {tmp}/no/r.json: there is no directory {tmp}/no"),
        (b"ab\xc3\xa9", [], "--text {tmp}/text.txt: 1 character(s) not in the char vocabulary: '\u00e9'"),
    ],
)
def test_each_mistake_is_one_line(tmp_path, capsys, text, argv, message):
    save_lm(tmp_path / "run", CharTokenizer(ASCII))
    if text is not None:
        (tmp_path / "text.txt").write_bytes(text)
    argv = [a.format(tmp=tmp_path) for a in argv]
    err = run_error(capsys, tmp_path, "--ckpt", tmp_path / "run", "--text", tmp_path / "text.txt", *argv)
    assert message.format(tmp=tmp_path) in err


def test_a_seq2seq_checkpoint_and_a_missing_job_are_one_line(tmp_path, capsys):
    save_seq2seq(tmp_path / "s2s")
    (tmp_path / "text.txt").write_text("abc")
    err = run_error(capsys, tmp_path, "--ckpt", tmp_path / "s2s", "--text", tmp_path / "text.txt")
    assert "a seq2seq (translation) checkpoint" in err and "--text needs a language model" in err
    err = run_error(capsys, tmp_path, "--ckpt", tmp_path / "s2s")
    assert "give --text FILE" in err and "or --source-file and --reference" in err
    err = run_error(capsys, tmp_path, "--ckpt", tmp_path / "s2s", "--reference", tmp_path / "text.txt")
    assert "give --text FILE" in err


def test_a_progress_bar_with_an_eta(tmp_path, capsys):
    from gpt.infer.perplexity import score_text

    _, model, tok, _, _ = loader.load_for_inference(save_lm(tmp_path / "run", CharTokenizer(ASCII)), "cpu", "float32")
    r = score_text(model, tok, TEXT, stride=4, batch_size=2, progress=True)
    bar = capsys.readouterr().err
    assert f"score [{'#' * 24}] 100% {r['windows']}/{r['windows']} windows" in bar and "ETA 0s" in bar

"""sample.py: streaming output, separators and summary, reproducibility, one-line errors."""

import re
import subprocess
import sys

import pytest
import torch

from gpt import GPT, GPTConfig
from gpt.checkpoints import native
from gpt.cli import sample  # what sample.py runs
from gpt.cli.options import unescape
from gpt.data.tokenizer import CharTokenizer
from gpt.model import rowkernels

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CHARS = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with a tiny random char-level checkpoint (block_size 16)."""
    path = tmp_path_factory.mktemp("run")
    tok = CharTokenizer(CHARS)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1.0)
    native.save(
        path / "best.pt",
        {"model": model.state_dict()},
        {"step": 0, "model_config": cfg.to_dict(), "tokenizer": tok.spec},
    )
    return path


def cli(capsys, *argv):
    code = sample.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_samples_are_separated_and_summarised(run_dir, capsys):
    code, out, err = cli(
        capsys,
        "--ckpt",
        run_dir,
        "--prompt",
        "ROMEO:",
        "--num-samples",
        3,
        "--max-new-tokens",
        40,
        "--seed",
        1,
        "--no-stop-at-eot",
    )
    assert code == 0
    samples = out.split(sample.SEPARATOR)
    assert len(samples) == 3 and all(s.startswith("ROMEO:") for s in samples)
    assert all(len(s.rstrip("\n")) >= len("ROMEO:") + 40 for s in samples)  # 40 chars each (eot prints as text)
    assert "3 sample(s), 120 tokens" in err and "tokens/s" in err and "seed 1" in err


def test_fixed_seed_reproduces_and_greedy_ignores_the_seed(run_dir, capsys):
    args = ["--ckpt", run_dir, "--prompt", "KING", "--max-new-tokens", 30, "--temperature", 1.0, "--top-k", "none"]
    first = cli(capsys, *args, "--seed", 5)[1]
    assert first == cli(capsys, *args, "--seed", 5)[1]
    assert first != cli(capsys, *args, "--seed", 6)[1]
    greedy = ["--ckpt", run_dir, "--prompt", "KING", "--max-new-tokens", 30, "--temperature", 0]
    assert cli(capsys, *greedy, "--seed", 1)[1] == cli(capsys, *greedy, "--seed", 2)[1]


@pytest.mark.parametrize(  # int8 and int4's compiled steps are checked against eager in test_compile_decoding.py
    "quantize",
    [
        [],
        pytest.param(["--quantize", "int8"], marks=pytest.mark.slow),
        pytest.param(["--quantize", "int4"], marks=pytest.mark.slow),
    ],
)
def test_compile_prints_what_eager_prints(run_dir, capsys, quantize):
    """`--compile` (the compiled one-token step, tests/test_compile_decoding.py) through the script: two rows
    in one batch, past the 16-token context (window slides), the same greedy text as eager, in int8 and int4
    too (int4 at width 16: the MLP's down projection in int4, the layers the group does not divide float)."""
    args = ["--ckpt", run_dir, "--prompt", "KING", "--max-new-tokens", 30, "--num-samples", 2, "--temperature", 0]
    args += ["--no-stop-at-eot", *quantize]
    code, out, err = cli(capsys, *args, "--compile")
    assert code == 0 and out == cli(capsys, *args)[1] and len(out) > 2 * 30
    if quantize == ["--quantize", "int8"] and rowkernels.library() is not None:  # our C step: nothing to compile
        assert "nothing to compile" in err and "compiling" not in err
    else:
        assert re.search(r"tokens in [\d.]+ s: [\d.]+ s of it compiling, [\d.]+ tokens/s without", err)


def test_no_stream_prints_the_same_text(run_dir, capsys):
    args = ["--ckpt", run_dir, "--prompt", "A", "--num-samples", 2, "--max-new-tokens", 20, "--seed", 3]
    assert cli(capsys, *args)[1] == cli(capsys, *args, "--no-stream")[1]


def test_stop_string_ends_the_sample_and_is_not_printed(run_dir, capsys):
    base = ["--ckpt", run_dir, "--prompt", "A", "--max-new-tokens", 60, "--temperature", 0, "--no-stop-at-eot"]
    full = cli(capsys, *base)[1].rstrip("\n")
    stop = full[10:13]  # three characters: three tokens
    cut = full.index(stop)
    code, out, err = cli(capsys, *base, "--stop", stop)
    assert code == 0 and out == full[:cut] + "\n" and stop not in out


def test_prompt_file_and_long_prompt_warning(run_dir, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("To be, or not to be, that is the question", encoding="utf-8")
    code, out, err = cli(capsys, "--ckpt", run_dir, "--prompt-file", prompt, "--max-new-tokens", 5)
    assert code == 0 and out.startswith("To be, or not")
    assert "warning: the prompt has 41 tokens, more than the model's context of 16" in err


def test_bfloat16_on_cpu(run_dir, capsys):
    code, out, err = cli(
        capsys,
        "--ckpt",
        run_dir,
        "--prompt",
        "A",
        "--max-new-tokens",
        10,
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
        "--no-stop-at-eot",
    )
    assert code == 0 and out.startswith("A") and "1 sample(s), 10 tokens" in err and "cpu, bfloat16" in err


def test_empty_prompt_starts_from_end_of_text(run_dir, capsys):
    code, out, err = cli(capsys, "--ckpt", run_dir, "--max-new-tokens", 5, "--no-stop-at-eot")
    assert code == 0 and len(out) >= 5


@pytest.mark.parametrize(
    "args,message",
    [
        (["--top-k", "0"], "--top-k must be an integer >= 1"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
        (["--dtype", "float16", "--device", "cpu"], "float16 needs a CUDA device"),
        (["--dtype", "float64"], "--dtype 'float64' is not one of"),
        (["--prompt", "ROMEO~"], "not in the char vocabulary: '~'"),
        (
            ["--prompt-file", "/nonexistent/prompt.txt"],
            "could not read --prompt-file /nonexistent/prompt.txt: no such file",
        ),
    ],
)
def test_each_mistake_is_one_clear_line(run_dir, capsys, args, message):
    code, out, err = cli(capsys, "--ckpt", run_dir, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_missing_checkpoint_and_not_a_checkpoint(tmp_path, capsys):
    code, _, err = cli(capsys, "--ckpt", tmp_path / "nope")
    assert code == 2 and err == f"error: no checkpoint at {tmp_path / 'nope'}\n"
    code, _, err = cli(capsys, "--ckpt", tmp_path)
    assert code == 2 and err.startswith("error: no best.pt or last.pt in")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"definitely not a checkpoint")
    code, _, err = cli(capsys, "--ckpt", junk)
    assert code == 2 and err.startswith(f"error: {junk} is not a gpt checkpoint") and err.count("\n") == 1


def test_pickled_code_is_never_executed(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model": Evil(), "meta": "{}"}, tmp_path / "evil.pt")
    code, _, err = cli(capsys, "--ckpt", tmp_path / "evil.pt")
    assert code == 2 and "is not a gpt checkpoint" in err and not marker.exists()


def test_samples_from_a_hugging_face_gpt2_dir(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    code, out, err = cli(
        capsys, "--ckpt", tmp_path, "--prompt", "Hello", "--max-new-tokens", 8, "--no-stop-at-eot", "--seed", 0
    )
    assert code == 0 and out.startswith("Hello") and "8 tokens" in err


def test_script_runs_as_a_program_and_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(tmp_path / "missing"), "--top-p", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: invalid sampling settings: --top-p")  # settings checked before loading


def test_stop_takes_the_escapes_a_shell_passes(tmp_path, capsys):
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\\n") == "a\tb\\n" and unescape("é\\x") == "é\\x"
    # a model whose next token is a line break about one time in ten, whatever came before
    tok = CharTokenizer(CHARS)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=1, n_embd=8)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.bias.fill_(0.5)  # the hidden state, whatever the input
        model.transformer.wte.weight[tok.encode("\n")[0]].fill_(0.5)  # tied head: logit 2 for "\n", 0 elsewhere
    native.save(
        tmp_path / "best.pt",
        {"model": model.state_dict()},
        {"step": 0, "model_config": cfg.to_dict(), "tokenizer": tok.spec},
    )
    base = [
        "--ckpt",
        tmp_path,
        "--prompt",
        "A",
        "--max-new-tokens",
        200,
        "--temperature",
        1.0,
        "--top-k",
        "none",
        "--seed",
        7,
        "--no-stop-at-eot",
    ]
    text = cli(capsys, *base)[1][len("A") :]
    assert 0 < text.index("\n") < len(text) - 1  # a line break after some other characters
    stopped = cli(capsys, *base, "--stop", r"\n")[1]  # what `--stop "\n"` passes: a backslash and an n
    assert stopped == "A" + text[: text.index("\n")] + "\n"


def test_any_number_of_samples_decodes_in_bounded_batches(run_dir, monkeypatch):
    from gpt.checkpoints.loader import load_checkpoint
    from gpt.infer import sampling

    model, tok, _ = load_checkpoint(run_dir)
    per_row = 2 * 2 * 16 * 16 * 4 + 2 * 62 * 4  # keys and values of 2 layers x 16 positions x 16 wide; 2 logits rows
    assert sampling.batch_rows(model, budget=10 * per_row) == 10 >= sampling.batch_rows(model, budget=1) == 1
    batches = []
    real = sampling.Decoder

    def recording(model, idx, *args, **kwargs):
        batches.append(idx.size(0))
        return real(model, idx, *args, **kwargs)

    monkeypatch.setattr(sampling, "Decoder", recording)
    monkeypatch.setattr(sampling, "BATCH_BYTES", 10 * per_row)
    sampling.complete(model, tok, "A", num_samples=25, max_new_tokens=1, seed=0)
    assert batches == [10, 10, 5]  # (--num-samples 2000000 was one batch of 16 GB)
    monkeypatch.undo()
    monkeypatch.setattr(sampling, "Decoder", recording)
    settings = dict(max_new_tokens=12, temperature=1.0, top_k=None, seed=3, stop_at_eot=False)
    batches.clear()
    seven = sampling.complete(model, tok, "A", num_samples=7, batch_rows=3, **settings)
    assert batches == [3, 3, 1] and len(set(seven)) == 7
    assert seven == sampling.complete(model, tok, "A", num_samples=7, batch_rows=3, **settings)  # the same seed
    assert seven[:3] == sampling.complete(model, tok, "A", num_samples=3, **settings)  # the first batch: one batch


def test_many_samples_print_in_order_with_bounded_buffers(run_dir, capsys, monkeypatch):
    from gpt.infer import sampling

    monkeypatch.setattr(sampling, "BATCH_BYTES", 1)  # one sample per batch
    code, out, err = cli(
        capsys,
        "--ckpt",
        run_dir,
        "--prompt",
        "AB",
        "--num-samples",
        4,
        "--max-new-tokens",
        5,
        "--seed",
        2,
        "--no-stop-at-eot",
    )
    samples = out.split(sample.SEPARATOR)
    assert code == 0 and len(samples) == 4 and all(s.startswith("AB") for s in samples)
    assert samples[-1].endswith("\n") and "4 sample(s), 20 tokens" in err
    assert (
        out
        == cli(
            capsys,
            "--ckpt",
            run_dir,
            "--prompt",
            "AB",
            "--num-samples",
            4,
            "--max-new-tokens",
            5,
            "--seed",
            2,
            "--no-stop-at-eot",
            "--no-stream",
        )[1]
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--num-samples", "2000000", "--max-new-tokens", "1"],  # 5: the same, slower to start
        ["--num-samples", "3", "--max-new-tokens", "100000", "--no-stop-at-eot"],
    ],
)
def test_a_reader_that_quits_ends_sample_py_quietly(run_dir, args):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(run_dir), "--seed", "0", "--threads", "1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    head = proc.stdout.read(50)  # what `| head -c 50` reads, then it quits
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and len(head) == 50
    assert err == b""  # no traceback, no "Exception ignored", no summary


# ---- a terminal is shown control characters escaped; a pipe gets the text as it is -------------------------

SHOUTING = "ab[0;\t\n\x1b\x07\x9b"  # a char vocabulary with C0 and C1 controls


def save_parrot(path, says: str, chat: bool = False):
    """A checkpoint whose greedy output is always the character `says`, whatever it read: the final LayerNorm
    gives one constant vector (weight 0, bias 1), which the tied head scores highest for `says` alone."""
    from gpt.data.chat import ChatTemplate

    tok = CharTokenizer(SHOUTING)
    tok = ChatTemplate().tokenizer(tok) if chat else tok
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=1, n_embd=8)
    model = GPT(cfg)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[SHOUTING.index(says)] = 1.0
    meta = {"step": 0, "model_config": cfg.to_dict(), "tokenizer": tok.spec}
    if chat:
        meta["chat_template"] = ChatTemplate().spec
    path.mkdir()
    native.save(path / "best.pt", {"model": model.state_dict()}, meta)
    return path


def on_a_terminal(argv, typed: list[bytes] = (), stdin: bytes | None = None, timeout=60) -> str:
    """sample.py with stdout on a pseudo-terminal (stdin too, unless `stdin` is given: then a pipe);
    `typed` lines are typed at each `you> ` (input() prompts on stderr: then stderr is the terminal too).
    What the terminal received, its \\r\\n as \\n."""
    import os
    import pty
    import select
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "sample.py", *map(str, argv)], cwd=ROOT, stdout=slave, stderr=slave if typed else subprocess.DEVNULL,
        stdin=slave if stdin is None else subprocess.PIPE, close_fds=True,
    )  # fmt: skip
    os.close(slave)
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.close()
    seen, typed, deadline = b"", list(typed), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the program ended: the terminal's other side is gone
                break
            if not chunk:
                break
            seen += chunk
            if typed and seen.endswith(b"you> "):
                os.write(master, typed.pop(0) + b"\n")
    proc.wait(30)
    os.close(master)
    return seen.decode().replace("\r\n", "\n")


def test_a_terminal_is_shown_control_characters_escaped_a_pipe_gets_them_raw(tmp_path, capsys, monkeypatch):
    import io

    plain, chat = save_parrot(tmp_path / "p", "\x1b"), save_parrot(tmp_path / "c", "\x9b", chat=True)
    prompt = "a\x1b[0;b\x07\t\n\x9bb"  # e.g. ESC [ 0 ; ... would set the terminal's colours
    greedy = ["--temperature", "0", "--max-new-tokens", "3"]
    seen = on_a_terminal(["--ckpt", plain, "--prompt", prompt, *greedy])
    assert seen == "a\\x1b[0;b\\x07\t\n\\x9bb\\x1b\\x1b\\x1b\n"  # tab and newline are left as they are
    assert cli(capsys, "--ckpt", plain, "--prompt", prompt, *greedy)[1] == prompt + "\x1b\x1b\x1b\n"  # not a tty
    seen = on_a_terminal(["--ckpt", chat, "--chat", *greedy], typed=[b"ab", b"/exit"])
    assert "assistant> \\x9b\\x9b\\x9b\n" in seen and "\x9b" not in seen
    line = b'[{"role": "user", "content": "ab"}]\n'
    seen = on_a_terminal(["--ckpt", chat, "--chat", *greedy], stdin=line)  # JSON lines out, on a terminal
    assert seen == '{"role": "assistant", "content": "\\u009b\\u009b\\u009b"}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line)))
    assert cli(capsys, "--ckpt", chat, "--chat", *greedy)[1] == '{"role": "assistant", "content": "\x9b\x9b\x9b"}\n'


@pytest.mark.skipif(
    not __import__("os").path.exists("/dev/full"), reason="needs /dev/full (a disk that is always full)"
)
def test_output_to_a_full_disk_is_one_line(run_dir):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "sample.py", "--ckpt", run_dir, "--max-new-tokens", "5"], cwd=ROOT,
                           stdout=full, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert (
        r.returncode == 2
        and r.stderr == "error: could not write the output to stdout: the disk is full; free some space\n"
    )

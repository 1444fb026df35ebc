"""Chat checkpoints from the command line: sample.py --chat (a pipe, a terminal), --prompt, and gpt.evaluate."""

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from conftest import MULTI30K, ROOT

from gpt import load_checkpoint
from gpt.infer.chat import Chat, chat_template
from gpt.infer.sampling import SampleConfig

ASK = "Translate to English: Ein Hund rennt."


def sample(*args, stdin=""):
    r = subprocess.run(
        [sys.executable, "sample.py", *map(str, args)], cwd=ROOT, input=stdin, capture_output=True, text=True
    )
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def reference(chat_run):
    model, tok, meta = load_checkpoint(chat_run)

    def answer(messages, system=None, max_new_tokens=20):
        cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=0, top_k=None)
        return "".join(p.text for p in Chat(model, tok, chat_template(meta), system, cfg).answer(messages))

    return answer


def test_chat_through_a_pipe_answers_one_json_line_per_conversation(chat_run, reference):
    first = [{"role": "user", "content": ASK}]
    second = {"messages": [{"role": "user", "content": "Hallo"}, {"role": "assistant", "content": "Hi"}, *first]}
    deep = "[" * 100_000 + "]" * 100_000  # JSON's parser recurses per level: a RecursionError, not a ValueError
    lines = [
        json.dumps(first),
        "",
        "not json",
        deep,
        json.dumps(second),
        json.dumps([{"role": "assistant", "content": "x"}]),
    ]
    stdin = "\n".join(lines).encode() + b"\n\xff\xfe not UTF-8\n" + json.dumps(first).encode() + b"\n"
    r = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", chat_run, "--chat", "--temperature", "0", "--top-k", "none",
         "--max-new-tokens", "20", "--system", "Be brief."], cwd=ROOT, input=stdin, capture_output=True,
    )  # fmt: skip
    answers = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert r.returncode == 2 and len(answers) == 7, r.stderr.decode()
    assert answers[0] == answers[6] == {"role": "assistant", "content": reference(first, "Be brief.")}
    assert answers[1]["error"].startswith("line 3: not JSON")
    assert answers[2] == {"error": "line 4: not JSON this reader takes (nested too deeply)"}
    assert answers[3] == {"role": "assistant", "content": reference(second["messages"], "Be brief.")}
    assert answers[4] == {"error": "line 6: the last message is the assistant's; a prompt ends with the user's"}
    assert answers[5] == {"error": "line 7: not UTF-8 text"}


def test_chat_in_a_terminal_streams_answers_and_understands_reset_and_exit(chat_run, reference):
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "sample.py", "--ckpt", chat_run, "--chat", "--temperature", "0", "--top-k", "none",
         "--max-new-tokens", "20"],
        cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
    )  # fmt: skip
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, count=1, timeout=60):
        nonlocal seen
        deadline = time.monotonic() + timeout
        while seen.count(marker) < count and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        assert seen.count(marker) >= count, seen.decode(errors="replace")

    read_until(b"you> ")
    os.write(master, (ASK + "\n").encode())
    read_until(b"you> ", count=2)  # the answer, then the next prompt
    os.write(master, b"/rest\n")  # a typo: not sent to the model
    read_until(b"(unknown command /rest: /reset starts over, /exit ends)")
    os.write(master, b"/reset\n")
    read_until(b"(a new conversation)")
    os.write(master, b"/exit\n")
    proc.wait(30)
    os.close(master)
    text = seen.decode().replace("\r\n", "\n")
    assert proc.returncode == 0, text
    assert f"assistant> {reference([{'role': 'user', 'content': ASK}])}\n" in text and text.count("assistant> ") == 1


def test_prompt_on_a_chat_checkpoint_is_answered(chat_run, reference):
    code, out, err = sample("--ckpt", chat_run, "--prompt", ASK, "--temperature", "0", "--top-k", "none",
                            "--max-new-tokens", "20")  # fmt: skip
    assert code == 0, err
    assert out == reference([{"role": "user", "content": ASK}]) + "\n"


def test_chat_mistakes_are_one_line(chat_run, trained_run, tmp_path):
    from test_sample_seq2seq import save_seq2seq

    save_seq2seq(tmp_path / "s2s")
    for args, message in [
        (["--ckpt", trained_run, "--chat"], "is not a chat model (its checkpoint has no chat template)"),
        (["--ckpt", tmp_path / "s2s", "--chat"], "is a seq2seq (encoder-decoder) checkpoint: translate with --source"),
        (["--ckpt", chat_run, "--chat", "--num-samples", "2"], "--num-samples is not for --chat"),
        (["--ckpt", trained_run, "--prompt", "x", "--system", "y"], "--system is for chat checkpoints"),
        (
            ["--ckpt", chat_run, "--source", "x", "--system", "y"],
            "--system is for chat checkpoints (--chat or --prompt)",
        ),
    ]:
        code, out, err = sample(*args)
        assert code == 2 and out == "" and err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_evaluate_scores_a_chat_checkpoints_answers(chat_run, trained_run, tmp_path, reference):
    sources = (MULTI30K / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()[:6]
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("\n".join(sources) + "\n")
    ref.write_text("\n".join((MULTI30K / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()[:6]) + "\n")

    def evaluate(ckpt, *extra):
        r = subprocess.run(
            [sys.executable, "-m", "gpt", "evaluate", "--ckpt", str(ckpt), "--source-file", str(src), "--reference",
             str(ref), "--dtype", "float32", *map(str, extra)],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        return r.returncode, r.stdout, r.stderr

    out = tmp_path / "hyp.en"
    code, line, err = evaluate(
        chat_run, "--instruction", "Translate to English: {source}", "--output", out, "--json", tmp_path / "r.json"
    )
    assert code == 0 and line.startswith("BLEU ") and "6 sentences" in line, err
    hyps = out.read_text(encoding="utf-8").splitlines()
    from rouge_score.rouge_scorer import RougeScorer  # (the dev extra's) ROUGE of the answers: its mean F-measures

    got, refs = json.loads((tmp_path / "r.json").read_text()), ref.read_text().splitlines()
    scores = [RougeScorer(["rougeL"]).score(r, h)["rougeL"].fmeasure for h, r in zip(hyps, refs)]
    assert got["task"] == "chat" and got["rougeL"] == pytest.approx(100 * sum(scores) / 6, rel=1e-12)
    assert f"ROUGE-L {got['rougeL']:.2f}" in line
    tok = load_checkpoint(chat_run)[1]
    for source, hyp in zip(sources, hyps):  # the greedy answer the library gives, batched or not
        ask = [{"role": "user", "content": f"Translate to English: {source}"}]
        want = reference(ask, max_new_tokens=len(tok.encode(source)) + 50)
        assert hyp == " ".join(want.strip().split("\n"))
    for ckpt, extra, message in [
        (chat_run, ["--beam-size", "2"], "a chat checkpoint answers greedily"),
        (chat_run, ["--instruction", "Translate"], "--instruction must contain {source}"),
        (trained_run, [], "is a plain language model (no encoder, no chat template)"),
    ]:
        code, line, err = evaluate(ckpt, *extra)
        assert code == 2 and line == "" and message in err and err.count("\n") == 1, err


def test_a_chat_model_exported_to_hugging_face_still_chats(chat_run, tmp_path, reference):
    from gpt.cli.hf import main as hf_main

    assert hf_main(["export", "--ckpt", str(chat_run), "--out", str(tmp_path / "hf")]) == 0
    model, tok, meta = load_checkpoint(tmp_path / "hf")
    assert meta["chat_template"] == load_checkpoint(chat_run)[2]["chat_template"]
    code, out, err = sample("--ckpt", tmp_path / "hf", "--prompt", ASK, "--temperature", "0", "--top-k", "none",
                            "--max-new-tokens", "20")  # fmt: skip
    assert code == 0 and out == reference([{"role": "user", "content": ASK}]) + "\n", err


def test_an_exported_chat_model_carries_its_template(chat_run, tmp_path, reference):
    """gpt_export.json holds what a runtime needs to chat: the tokenizer with the template's tokens and the
    template. They render a conversation to the checkpoint's own ids, and the exported program gives the
    checkpoint's logits over it (so its greedy answer is the checkpoint's)."""
    import torch

    from gpt.cli.export import main as export_main
    from gpt.data.chat import ChatTemplate
    from gpt.data.tokenizer import get_tokenizer

    assert export_main(["--ckpt", str(chat_run), "--format", "pt2", "--out", str(tmp_path), "--no-check"]) == 0
    meta = json.loads((tmp_path / "gpt_export.json").read_text())
    template, tok = ChatTemplate.from_spec(meta["chat_template"]), get_tokenizer(meta["tokenizer"])
    model, ckpt_tok, ckpt_meta = load_checkpoint(chat_run)
    messages = [{"role": "user", "content": ASK}]
    answer = reference(messages)
    ids = template.prompt(messages, tok) + tok.encode(answer) + [tok.special(template.end)]
    assert ids == chat_template(ckpt_meta).prompt(messages, ckpt_tok) + ckpt_tok.encode(answer) + [ids[-1]]
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    with torch.no_grad():
        torch.testing.assert_close(program(torch.tensor([ids])), model(torch.tensor([ids]))[0], atol=1e-4, rtol=0)


def test_gpt_chat_is_the_same_conversation_as_sample_chat(chat_run, trained_run, reference):
    """`gpt chat` and `sample.py --chat` are two doors to one implementation (gpt/cli/chat.py)."""
    first = [{"role": "user", "content": ASK}]
    r = subprocess.run(
        [sys.executable, "-m", "gpt", "chat", "--ckpt", chat_run, "--temperature", "0", "--top-k", "none",
         "--max-new-tokens", "20", "--system", "Be brief."],
        cwd=ROOT, input=json.dumps(first) + "\n[]\n", capture_output=True, text=True,
    )  # fmt: skip
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 2 and len(answers) == 2, r.stderr
    assert answers[0] == {"role": "assistant", "content": reference(first, "Be brief.")}
    assert "error" in answers[1]
    r = subprocess.run([sys.executable, "-m", "gpt", "chat", "--ckpt", trained_run], cwd=ROOT, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and "is not a chat model" in r.stderr


def test_chat_through_a_pipe_speculates_to_the_same_answers(chat_run, reference):
    first = [{"role": "user", "content": ASK}]
    stdin = json.dumps(first) + "\n" + json.dumps([{"role": "user", "content": "Translate to English: Hallo."}]) + "\n"
    for extra in (["--speculate", "4"], ["--draft-ckpt", chat_run, "--speculate", "3"]):
        r = subprocess.run(
            [sys.executable, "-m", "gpt", "chat", "--ckpt", chat_run, "--temperature", "0", "--top-k", "none",
             "--max-new-tokens", "20", *extra], cwd=ROOT, input=stdin, capture_output=True, text=True,
        )  # fmt: skip
        answers = [json.loads(line) for line in r.stdout.splitlines()]
        assert r.returncode == 0, r.stderr
        assert answers[0] == {"role": "assistant", "content": reference(first)}
        assert answers[1]["content"] == reference([{"role": "user", "content": "Translate to English: Hallo."}])

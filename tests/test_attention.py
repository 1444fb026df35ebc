"""Attention weights: what GPT.attention_maps returns is the attention the forward computes, and
`gpt attention` draws it."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

from gpt.model.transformer import GPT, GPTConfig


@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_weights_are_softmax_qk_recomputed_by_hand_and_causal(pos_encoding):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16, pos_encoding=pos_encoding))
    model.eval()
    idx = torch.randint(0, 50, (2, 12))
    inputs = []  # what each layer's attention sees: ln_1 of the residual stream
    hooks = [b.ln_1.register_forward_hook(lambda m, a, out: inputs.append(out)) for b in model.transformer.h]
    logits, _ = model(idx)
    maps = model.attention_maps(idx)
    for h in hooks:
        h.remove()
    again, _ = model(idx)
    assert torch.equal(again, logits)  # recording changed nothing, and the fast path is back
    assert all(m.weights is None for m in model.modules() if hasattr(m, "weights"))
    for layer, (w, x) in enumerate(zip(maps["self"], inputs)):
        assert w.shape == (2, 2, 12, 12)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 12))
        assert (w.triu(1) == 0).all()  # nothing above the diagonal: causal
        attn = model.transformer.h[layer].attn
        q, k, _ = attn.c_attn(x).split(16, dim=2)
        q, k = attn._heads(q), attn._heads(k)
        if pos_encoding == "rope":
            from gpt.model.transformer import apply_rope

            rope = model.rope(0, 12, idx.device)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        scores = q @ k.transpose(-2, -1) / math.sqrt(8) + torch.full((12, 12), float("-inf")).triu(1)
        torch.testing.assert_close(w, F.softmax(scores, -1))


def test_seq2seq_gives_cross_attention_over_the_real_source_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_encoder_layer=2, n_head=2, n_embd=16))
    src = torch.randint(0, 40, (1, 7))
    mask = torch.tensor([[True] * 5 + [False] * 2])
    maps = model.attention_maps(torch.randint(0, 40, (1, 4)), src, mask)
    assert [len(maps[k]) for k in ("self", "cross", "encoder")] == [2, 2, 2]
    cross = maps["cross"][0]
    assert cross.shape == (1, 2, 4, 7) and (cross[..., 5:] == 0).all()  # padding gets no attention
    torch.testing.assert_close(cross.sum(-1), torch.ones(1, 2, 4))
    assert (maps["encoder"][0][..., 5:] == 0).all() and maps["encoder"][0][0, 0, 4, :5].min() > 0  # not causal


def draw(*args):
    r = subprocess.run(
        [sys.executable, "-m", "gpt", "attention", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )
    return r.returncode, r.stdout, r.stderr


def test_the_command_draws_pngs(trained_run, tmp_path):
    code, out, err = draw("--ckpt", trained_run, "--text", "ROMEO: what light", "--out", tmp_path / "a.png")
    assert code == 0 and out == f"wrote {tmp_path / 'a.png'}\n", err
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for args, message in [
        (["--out", tmp_path / "a.jpg"], "name a .png file"),
        (["--out", tmp_path / "no" / "a.png"], "there is no directory"),
        (["--out", tmp_path / "a.png", "--layers", "7"], "this model's layers are 0..1"),
        (["--out", tmp_path / "a.png", "--target", "x"], "--target is for seq2seq and chat checkpoints"),
    ]:
        code, out, err = draw("--ckpt", trained_run, "--text", "ROMEO:", *args)
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_seq2seq_checkpoint_gets_cross_and_encoder_maps(tmp_path):
    from test_sample_seq2seq import save_seq2seq

    save_seq2seq(tmp_path / "s2s")
    code, out, err = draw("--ckpt", tmp_path / "s2s", "--text", "bad cafe", "--out", tmp_path / "m.png")
    names = [tmp_path / n for n in ("m.png", "m-cross.png", "m-encoder.png")]
    assert code == 0 and out == f"wrote {', '.join(map(str, names))}\n", err
    assert all(n.read_bytes()[:4] == b"\x89PNG" for n in names)


def test_a_chat_checkpoint_draws_its_answer_over_the_templated_question(chat_run):
    from gpt import load_checkpoint
    from gpt.infer.attention import MAX_ANSWER, attention_for
    from gpt.infer.chat import answer_ids, chat_template, end_tokens

    model, tok, meta = load_checkpoint(chat_run)
    template, question = chat_template(meta), "Translate to English: Ein Hund rennt."
    prompt = template.prompt([{"role": "user", "content": question}], tok)
    given = attention_for(model, tok, meta, question, "A dog runs.")["self"]
    ids = [*prompt, *tok.encode("A dog runs."), tok.special(template.end)]
    assert given.queries == given.keys and len(given.keys) == len(ids)
    assert given.keys[0] == "<|user|>" and given.keys[-1] == "<|end|>" and "<|assistant|>" in given.keys
    for w in given.layers:
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    own = answer_ids(model, [prompt], end_tokens(template, tok), tok.vocab_size, MAX_ANSWER)[0]
    assert len(attention_for(model, tok, meta, question)["self"].keys) == len(prompt) + len(own) + 1


def draw_here(capsys, *args):
    """`gpt attention` in this process (no second torch import)."""
    from gpt.cli.attention import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_text_longer_than_the_context_is_drawn_as_its_last_tokens_and_says_so(trained_run, tmp_path, capsys):
    text = "ROMEO: " * 20  # 140 characters, block_size 64
    code, out, err = draw_here(capsys, "--ckpt", trained_run, "--text", text, "--out", tmp_path / "a.png")
    assert code == 0 and out == f"wrote {tmp_path / 'a.png'}\n", err
    assert err == "warning: the text has 140 tokens, more than the model's context of 64: only its last 64 are drawn\n"


def test_a_chat_map_always_holds_the_whole_answer(chat_run, tmp_path, capsys):
    from gpt import load_checkpoint
    from gpt.infer.attention import attention_for
    from gpt.infer.chat import chat_template

    model, tok, meta = load_checkpoint(chat_run)
    template, block = chat_template(meta), model.config.block_size  # 192
    for n, target, message in [
        (300, None, "the question takes 303 tokens in the chat template, which leaves no room for an answer"),
        (block - 4, None, "the question takes 191 tokens in the chat template, which leaves no room for an answer"),
        (20, "b" * 170, "the question (23 tokens in the chat template), the answer (170) and its end-of-turn token "
         "need 194 tokens, more than the model's context of 192: shorten --target or --text"),
    ]:  # fmt: skip
        code, out, err = draw_here(capsys, "--ckpt", chat_run, "--text", "a" * n,
                                   *(["--target", target] if target else []), "--out", tmp_path / "c.png")  # fmt: skip
        assert code == 2 and out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "c.png").exists()
    prompt = template.prompt([{"role": "user", "content": "a" * (block - 6)}], tok)  # 189: room for 2 answer tokens
    own = attention_for(model, tok, meta, "a" * (block - 6))["self"]
    assert len(own.keys) <= block and own.keys[-1] == "<|end|>" and len(own.keys) > len(prompt) + 1
    given = attention_for(model, tok, meta, "a" * (block - 6), "bc")["self"]
    assert len(given.keys) == block and given.keys[-3:] == ["b", "c", "<|end|>"]


def test_a_seq2seq_target_longer_than_the_context_says_what_is_drawn(tmp_path, capsys):
    from test_sample_seq2seq import save_seq2seq

    save_seq2seq(tmp_path / "s2s")  # block_size 32
    code, out, err = draw_here(capsys, "--ckpt", tmp_path / "s2s", "--text", "bad cafe", "--target", "abc " * 10,
                               "--out", tmp_path / "m.png")  # fmt: skip
    assert code == 0 and out.startswith("wrote "), err
    assert err == "warning: the target has 40 tokens, more than the 31 the model's context holds after the start " \
        "token: only its first 31 are drawn\n"  # fmt: skip

"""Speculative decoding (gpt/infer/speculative.py): greedy text equal to plain decoding's, token for token, with
prompt lookup and with a draft model; sampled tokens from the model's own distribution (the accept / reject
rule, checked by counting); `gpt sample --speculate / --draft-ckpt`."""

import pytest
import torch

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.checkpoints import native
from gpt.cli import sample as sample_cli
from gpt.data.tokenizer import CharTokenizer
from gpt.infer.sampling import SampleConfig
from gpt.infer.sampling import generate as plain
from gpt.infer.speculative import DraftModel, PromptLookup, Stats, accept, generate, probabilities
from tests.conftest import one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")


def text(pieces) -> str:
    return "".join(p.text for p in pieces)


@pytest.fixture(scope="module")
def trained(trained_run):
    return load_checkpoint(trained_run)


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_greedy_text_is_plain_decodings_past_the_block_too(trained, drafter):
    model, tok, _ = trained
    torch.manual_seed(0)
    small = GPT(GPTConfig(**{**model.config.to_dict(), "n_layer": 1, "n_embd": 32, "n_head": 2})).eval()
    guesser = PromptLookup(k=6) if drafter == "lookup" else DraftModel(small, k=4)
    prompt = "ROMEO:\nWhat say you? What say you, ROMEO?\n"
    cfg = SampleConfig(max_new_tokens=3 * model.config.block_size, temperature=0, top_k=None, stop_at_eot=False)
    stats = Stats()
    fast = text(generate(model, tok, prompt, cfg, guesser, stats=stats))
    assert fast == text(plain(model, tok, prompt, cfg))
    assert stats.drafted > 50 and 0 < stats.kept and stats.passes < cfg.max_new_tokens  # guesses were kept
    penalised = SampleConfig(**{**cfg.__dict__, "repetition_penalty": 1.3, "frequency_penalty": 0.2})
    assert text(generate(model, tok, prompt, penalised, PromptLookup(k=6))) == text(
        plain(model, tok, prompt, penalised)
    )


def test_a_rope_model_and_a_draft_of_its_own_shape_give_the_same_greedy_text():
    tok = CharTokenizer("abcdefgh \n")
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=96, n_layer=2, n_head=2, n_embd=48, pos_encoding="rope")
    model, draft = GPT(cfg).eval(), GPT(GPTConfig(**{**cfg.to_dict(), "n_layer": 1})).eval()
    settings = SampleConfig(max_new_tokens=80, temperature=0, top_k=None, stop_at_eot=False)
    for guesser in (PromptLookup(k=5), DraftModel(draft, k=3), DraftModel(model, k=3)):
        assert text(generate(model, tok, "abc abd abe", settings, guesser)) == text(
            plain(model, tok, "abc abd abe", settings)
        )
    stats = Stats()  # the model as its own draft: every guess is kept
    text(generate(model, tok, "abc abd abe", settings, DraftModel(model, k=3), stats=stats))
    assert stats.kept == stats.drafted > 0


@pytest.mark.parametrize("point_mass", [True, False])
def test_each_kept_or_redrawn_token_has_the_models_distribution(point_mass):
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    counts = torch.zeros(5)
    n = 40_000
    for _ in range(n):
        guess = 0 if point_mass else int(torch.multinomial(q, 1, generator=gen))
        _, token = accept(p, None if point_mass else q, guess, gen, greedy=False)
        counts[token] += 1
    assert (counts / n - p).abs().sum() / 2 < 0.01  # total variation: drawn from p, whatever the guesses


def test_sampled_text_has_plain_samplings_distribution():
    tok = CharTokenizer("abcd")
    torch.manual_seed(1)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model, draft = GPT(cfg).eval(), GPT(cfg).eval()
    settings = SampleConfig(max_new_tokens=3, temperature=1.0, top_k=3, stop_at_eot=False, num_samples=3000, seed=5)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("ab")]))[0][0, -1, : tok.vocab_size].float()
    first = probabilities(logits, settings, tok.encode("ab"), 0)
    pieces = list(generate(model, tok, "ab", settings, DraftModel(draft, k=2)))
    by_sample = {}
    for piece in pieces:
        by_sample.setdefault(piece.sample, []).extend(piece.ids)
    third = torch.zeros(tok.vocab_size)
    firsts = torch.zeros(tok.vocab_size)
    for ids in by_sample.values():
        firsts[ids[0]] += 1
        third[ids[2]] += 1
    assert (firsts / 3000 - first).abs().sum() / 2 < 0.03
    reference = torch.zeros(tok.vocab_size)
    for piece in plain(model, tok, "ab", settings):
        if len(piece.ids) and piece.finish is not None:
            reference[piece.ids[0]] += 1  # the last piece of each sample: its third token
    assert (third / 3000 - reference / 3000).abs().sum() / 2 < 0.05


def test_the_command_speculates_and_says_how_well(trained_run, tmp_path, capsys):
    args = ["--ckpt", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "60", "--temperature", "0"]
    args += ["--device", "cpu", "--seed", "1"]
    assert sample_cli.main(args) == 0
    plain_out = capsys.readouterr().out
    assert sample_cli.main([*args, "--speculate", "6"]) == 0
    out, err = capsys.readouterr()
    assert out == plain_out and "guesses kept" in err and "tokens a pass" in err
    assert sample_cli.main([*args, "--draft-ckpt", str(trained_run)]) == 0
    out, err = capsys.readouterr()
    assert out == plain_out and "100% of" in err  # the model as its own draft
    other = tmp_path / "other"
    tok = CharTokenizer("xyz")
    small = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)
    native.save(other / "best.pt", {"model": GPT(small).state_dict()}, native.build_meta(small.to_dict(), tok.spec))
    assert "another tokenizer" in one_line_error(capsys, sample_cli.main, *args, "--draft-ckpt", other)
    assert "leave out --compile" in one_line_error(capsys, sample_cli.main, *args, "--speculate", "4", "--compile")
    assert ">= 1" in one_line_error(capsys, sample_cli.main, *args, "--speculate", "0")

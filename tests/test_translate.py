"""Seq2seq decoding: cache equals recompute, beam search against a plain reference, beam 1 is greedy,
a reverse task learned to 100%, BLEU evaluation from a checkpoint."""

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F

from gpt import GPT, GPTConfig
from gpt.data.tokenizer import CharTokenizer
from gpt.infer.translate import TranslateError, beam_search, encode_sources, generate, length_penalty, translate

V, EOS = 20, 19


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def random_model(norm="pre", seed=0) -> GPT:
    """An untrained model with large random weights: peaked, varied next-token distributions."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=V, block_size=32, n_layer=2, n_encoder_layer=2, n_head=2, n_embd=16, norm=norm))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def random_sources(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    src = torch.randint(0, EOS, (len(lengths), S), generator=g)
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    return src.masked_fill(~mask, EOS), mask


def test_sampled_decoding_draws_through_next_token():
    """Sampling is gpt.infer.logits.next_token's: top-k 1 is greedy, a seeded generator reproduces, ids
    beyond the tokenizer's vocabulary (a padded embedding) are never drawn."""
    model = random_model()
    src, mask = random_sources([6, 3, 5])
    greedy = generate(model, src, mask, EOS, EOS, max_new_tokens=12)

    def sample(seed, **kw):
        return generate(
            model, src, mask, EOS, EOS, 12, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw
        )

    assert sample(0, top_k=1) == greedy and sample(0, top_p=1e-6) == greedy
    assert sample(3) == sample(3) and sample(3) != sample(4)
    torch.manual_seed(0)
    padded = GPT(GPTConfig(vocab_size=V + 12, block_size=32, n_layer=1, n_encoder_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():  # every final hidden state is all ones: the logit of v is sum(wte[v])
        padded.transformer.ln_f.weight.zero_()
        padded.transformer.ln_f.bias.fill_(1.0)
        padded.transformer.wte.weight[V:] = 1.0  # the padded rows win every draw if they may
        padded.transformer.wte.weight[EOS] = -1.0  # never the end token

    def draw(**kw):
        g = torch.Generator().manual_seed(0)
        return generate(padded.eval(), src, mask, EOS, EOS, 12, temperature=1.0, generator=g, **kw)

    assert all(i >= V for h in draw() for i in h)
    ids = draw(vocab_size=V)
    assert all(len(h) == 12 for h in ids) and all(0 <= i < EOS for h in ids for i in h)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_cached_decoding_equals_recompute(norm):
    model = random_model(norm)
    src, mask = random_sources([7, 3, 5])
    cached = generate(model, src, mask, EOS, EOS, max_new_tokens=15)
    full = generate(model, src, mask, EOS, EOS, max_new_tokens=15, use_cache=False)
    assert cached == full
    assert any(len(h) >= 5 for h in cached)  # long enough to exercise the cache
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    sampled = generate(model, src, mask, EOS, EOS, 15, temperature=1.0, generator=g1)
    assert sampled == generate(model, src, mask, EOS, EOS, 15, temperature=1.0, generator=g2, use_cache=False)


def test_batched_decoding_equals_one_sentence_at_a_time():
    model = random_model()
    src, mask = random_sources([8, 2, 5])
    batched = generate(model, src, mask, EOS, EOS, max_new_tokens=12)
    alone = [
        generate(model, src[i : i + 1, :n], mask[i : i + 1, :n], EOS, EOS, 12)[0]
        for i, n in enumerate(mask.sum(1).tolist())
    ]
    assert batched == alone
    assert beam_search(model, src, mask, EOS, EOS, 3, max_new_tokens=12) == [
        beam_search(model, src[i : i + 1, :n], mask[i : i + 1, :n], EOS, EOS, 3, max_new_tokens=12)[0]
        for i, n in enumerate(mask.sum(1).tolist())
    ]


def test_generation_stops_at_the_end_token_or_the_limit():
    model = random_model()
    src, mask = random_sources([4, 6])
    with torch.no_grad():  # every final hidden state becomes all ones: the logit of v is sum(wte[v])
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[EOS] = -10.0  # never the end token
    out = generate(model, src, mask, EOS, EOS, max_new_tokens=5)
    assert all(len(h) == 5 and EOS not in h for h in out)
    with torch.no_grad():
        model.transformer.wte.weight[EOS] = 10.0  # always the end token
    assert generate(model, src, mask, EOS, EOS, max_new_tokens=5) == [[], []]


@pytest.mark.parametrize("alpha", [0.0, -0.5])
def test_beam_size_one_is_greedy(alpha):
    """Without a reward for length, one beam is greedy (with alpha > 0 it may prefer a longer output)."""
    for seed in range(3):
        model = random_model(seed=seed)
        src, mask = random_sources([9, 4, 6, 1], seed=seed)
        greedy = generate(model, src, mask, EOS, EOS, max_new_tokens=20)
        assert beam_search(model, src, mask, EOS, EOS, beam_size=1, alpha=alpha, max_new_tokens=20) == greedy


def reference_beam(model, src, mask, eos, K, alpha, n):
    """Beam search for one sentence, spelled out: full recompute, Python lists, same rules."""
    memory = model.encode(src, mask)
    beams, finished = [(0.0, [])], []
    for t in range(n):
        cands = []
        for score, toks in beams:
            h = model.decode(memory, mask, torch.tensor([[eos] + toks]))
            logp = F.log_softmax(model.lm_head(h[0, -1]).float(), -1)
            cands += [(score + logp[v].item(), toks, v) for v in range(len(logp))]
        top = sorted(cands, key=lambda c: -c[0])[: 2 * K]
        finished += [(s / length_penalty(t + 1, alpha), toks) for s, toks, v in top[:K] if v == eos]
        beams = [(s, toks + [v]) for s, toks, v in top if v != eos][:K]
        finished = sorted(finished, key=lambda f: -f[0])[:K]
        # the best a live beam can still reach: its log-probability only falls; lp grows up to lp(n) if alpha > 0
        if len(finished) == K and finished[-1][0] >= beams[0][0] / length_penalty(n if alpha > 0 else t + 2, alpha):
            break
    else:
        finished += [(s / length_penalty(len(toks), alpha), toks) for s, toks in beams]
    return max(finished, key=lambda f: f[0])[1]


class ScriptedModel:
    """A stand-in for GPT whose next-token log-probabilities depend only on the output so far: `table` maps
    an output (a tuple of ids) to {id: log-probability}; ids not listed share what is left equally."""

    def __init__(self, table: dict, vocab_size: int):
        self.table, self.V = table, vocab_size
        self.config = GPTConfig(vocab_size=vocab_size, block_size=16)

    def encode(self, src, src_mask):
        return src.float()

    def cross_kv(self, memory):
        return [(memory, memory)]

    def new_caches(self, rows, max_len):
        return [ScriptedCache(rows)]

    def decode(self, kv, mask, tokens, caches):
        (cache,) = caches
        out = torch.empty(tokens.size(0), 1, self.V)
        for r, t in enumerate(tokens[:, 0].tolist()):
            cache.outputs[r].append(t)
            given = self.table.get(tuple(cache.outputs[r][1:]), {})  # (after the start token)
            out[r, 0] = math.log((1 - sum(math.exp(v) for v in given.values())) / (self.V - len(given)))
            for i, v in given.items():
                out[r, 0, i] = v
        return out

    def head(self, h):
        return h  # decode already returns log-probabilities


class ScriptedCache:
    def __init__(self, rows):
        self.outputs = [[] for _ in range(rows)]

    def reorder(self, index):
        self.outputs = [list(self.outputs[i]) for i in index.tolist()]


def test_beam_search_waits_for_a_longer_hypothesis_the_length_penalty_prefers():
    """Two short outputs finish first; the live beam B C is worse than both at its length, but its next
    tokens are near-certain, and finished at length 6 it beats them under GNMT's length penalty.
    Stopping as soon as the finished ones beat the live beam *at its current length* returned A."""
    A, B, C, eos = 0, 1, 2, 7
    log = math.log
    table = {
        (): {A: log(0.36), eos: log(0.34), B: log(0.25)},
        (A,): {eos: log(0.9)},
        **{(B,) + (C,) * i: {C: log(0.99)} for i in range(4)},
        (B, C, C, C, C): {eos: log(0.99)},
    }
    model = ScriptedModel(table, 8)
    src, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)

    def normalised(hyp, alpha):
        out, total = (), 0.0
        for t in hyp + [eos]:
            total += table.get(out, {}).get(t, float("nan"))
            out += (t,)
        return total / length_penalty(len(hyp) + 1, alpha)

    for alpha in (0.6, 1.0):
        assert normalised([B, C, C, C, C], alpha) > normalised([A], alpha) > normalised([], alpha)
        assert beam_search(model, src, mask, eos, eos, beam_size=2, alpha=alpha, max_new_tokens=10) == [[B, C, C, C, C]]
    # without a reward for length the shortest is best
    assert normalised([], 0.0) > normalised([A], 0.0) > normalised([B, C, C, C, C], 0.0)
    assert beam_search(model, src, mask, eos, eos, beam_size=2, alpha=0.0, max_new_tokens=10) == [[]]


def test_beam_search_arguments():
    model = random_model()
    src, mask = random_sources([3])
    with pytest.raises(ValueError, match="beam_size must be between 1 and vocab_size / 2 = 10, got 11"):
        beam_search(model, src, mask, EOS, EOS, beam_size=11)
    with pytest.raises(ValueError, match=r"max_new_tokens must be in \[1, block_size=32\], got 33"):
        generate(model, src, mask, EOS, EOS, max_new_tokens=33)
    assert length_penalty(7, 1.0) == 2.0 and length_penalty(7, 0.0) == 1.0


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(batch_size=0), "--batch-size must be an integer >= 1, got 0"),
        (dict(batch_size=-2), "--batch-size must be an integer >= 1, got -2"),
        (dict(beam_size=0), "--beam-size must be an integer >= 1 (1 is greedy), got 0"),
        (dict(beam_size=-1), "--beam-size must be an integer >= 1 (1 is greedy), got -1"),
        (dict(beam_size=11), "--beam-size 11 is too large for a vocabulary of 20 ids: at most 10"),
        (dict(max_new_tokens=0), "--max-new-tokens must be an integer >= 1, got 0"),
        (dict(max_new_tokens=33), "--max-new-tokens 33 is more than the model's block_size=32"),
        (dict(beam_size=2, temperature=1.0), "--beam-size 2 searches deterministically"),
    ],
)
def test_translate_checks_its_settings_before_decoding(settings, message):
    tok = CharTokenizer("abcdefghijklmnopqrs")  # 19 characters + the end token = V ids
    with pytest.raises(TranslateError, match=re.escape(message)):
        translate(random_model(), tok, ["abc"], EOS, EOS, **settings)


def test_over_long_sources_are_truncated_with_a_warning():
    tok = CharTokenizer("abc")
    with pytest.warns(UserWarning, match="1 source"):
        src, mask = encode_sources(tok, ["abcabcabc", "ab"], eos=3, max_len=5)
    assert src.tolist() == [[0, 1, 2, 0, 3], [0, 1, 3, 3, 3]] and mask.sum(1).tolist() == [5, 3]


# ---- a task learned end to end ----------------------------------------------------------------

CHARS = "abcdefghijk "  # 11 letters and the space + the end token: vocabulary 13


def reverse_batch(n, g, max_len=8):
    """Random strings of 1..max_len characters and their reversals, as teacher-forcing tensors."""
    eos = len(CHARS)
    lens = torch.randint(1, max_len + 1, (n,), generator=g)
    seq = torch.randint(0, eos, (n, max_len), generator=g)
    src = torch.full((n, max_len + 1), eos)
    tgt_in, tgt_out = src.clone(), torch.full((n, max_len + 1), -1)
    for i, L in enumerate(lens.tolist()):
        x = seq[i, :L]
        src[i, :L], src[i, L] = x, eos
        tgt_in[i, 1 : L + 1], tgt_out[i, :L], tgt_out[i, L] = x.flip(0), x.flip(0), eos
    mask = torch.arange(max_len + 1)[None, :] <= lens[:, None]
    return src, mask, tgt_in, tgt_out


@pytest.fixture(scope="module")
def reverser():
    """A post-norm encoder-decoder trained to reverse strings (~15 s on one CPU core), and a copy
    of it after 40 steps: unsure enough that beam search and greedy decoding differ."""
    torch.manual_seed(0)
    tok = CharTokenizer(CHARS)
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=16, n_layer=2, n_encoder_layer=2, n_head=4, n_embd=64, norm="post"
    )
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.param_groups(0.0), lr=3e-3, betas=(0.9, 0.98))
    g, steps = torch.Generator().manual_seed(1), 400
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        src, mask, tgt_in, tgt_out = reverse_batch(64, g)
        _, loss = model(tgt_in, tgt_out, src=src, src_mask=mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step + 1 == 40:
            halfway = copy.deepcopy(model).eval()
    return model.eval(), tok, halfway


def test_reverse_task_is_learned_exactly(reverser):
    model, tok, _ = reverser
    src, mask, _, tgt_out = reverse_batch(300, torch.Generator().manual_seed(123))  # unseen strings
    want = [[t for t in row.tolist() if t not in (-1, tok.eot_token)] for row in tgt_out]
    greedy = generate(model, src, mask, tok.eot_token, tok.eot_token, max_new_tokens=12)
    assert sum(h == w for h, w in zip(greedy, want)) == len(want)
    beam = beam_search(model, src, mask, tok.eot_token, tok.eot_token, beam_size=4, max_new_tokens=12)
    assert sum(h == w for h, w in zip(beam, want)) == len(want)


def test_translate_strings_keeps_order(reverser):
    model, tok, *_ = reverser
    texts = ["abc", "head", "k", "fed cbaj", "kk ja", " a"]
    eos = tok.eot_token
    assert translate(model, tok, texts, eos, eos, batch_size=2) == [t[::-1] for t in texts]
    assert translate(model, tok, texts, eos, eos, beam_size=3, batch_size=3) == [t[::-1] for t in texts]
    assert model.training is False


def test_evaluate_cli_from_a_checkpoint(reverser, tmp_path, capsys):
    pytest.importorskip("sacrebleu")
    pytest.importorskip("rouge_score")  # (gpt evaluate scores BLEU and ROUGE by default)
    from gpt.checkpoints import native
    from gpt.cli.evaluate import main

    model, tok, *_ = reverser
    sources = ["a b c d", "ab c d e", "h i j k", "fa e d c", "k ji h g"]  # 4-grams for BLEU
    (tmp_path / "src.txt").write_text("\n".join(sources) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(s[::-1] for s in sources) + "\n")
    meta = {
        "model_config": model.config.to_dict(),
        "tokenizer": tok.spec,
        "seq2seq": {"bos": tok.eot_token, "eos": tok.eot_token, "pad": tok.eot_token},
    }
    native.save(tmp_path / "run" / "last.pt", {"model": model.state_dict()}, meta)
    args = [
        "--ckpt",
        str(tmp_path / "run"),
        "--source-file",
        str(tmp_path / "src.txt"),
        "--reference",
        str(tmp_path / "ref.txt"),
    ]
    assert main([*args, "--beam-size", "2", "--output", str(tmp_path / "hyp.txt")]) == 0
    out = capsys.readouterr().out
    # sacrebleu tokenizes on spaces: reversed words of a reversed sentence score 100
    assert out.startswith("BLEU 100.00 | ROUGE-1 100.00 | ROUGE-2 100.00 | ROUGE-L 100.00 | beam 2 | 5 sentences in")
    assert "sentences/s" in out
    assert (tmp_path / "hyp.txt").read_text().split("\n")[:5] == [s[::-1] for s in sources]

    meta_space = dict(meta, tokenizer=CharTokenizer(CHARS + "z").spec)  # one id more than the model has
    native.save(tmp_path / "run" / "last.pt", {"model": model.state_dict()}, meta_space)
    assert main(args) == 2
    assert "tokenizer has 14 ids but the model only 13" in capsys.readouterr().err

    decoder_only = dict(meta, model_config=dict(meta["model_config"], n_encoder_layer=0))
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("encoder.") and "cross" not in k}
    native.save(tmp_path / "run" / "last.pt", {"model": sd}, decoder_only)
    assert main(args) == 2
    assert "is a plain language model (no encoder, no chat template)" in capsys.readouterr().err
    (tmp_path / "ref.txt").write_text("one line\n")
    native.save(tmp_path / "run" / "last.pt", {"model": model.state_dict()}, meta)
    assert main(args) == 2
    assert "5 source lines but 1 reference lines" in capsys.readouterr().err


def sequence_score(model, src, mask, eos, hyps, alpha):
    """log P(hyp + end token | source) / lp(length) under teacher forcing, per hypothesis."""
    out = []
    for i, h in enumerate(hyps):
        tgt = torch.tensor([[eos] + h])
        logits, _ = model(tgt, src=src[i : i + 1], src_mask=mask[i : i + 1])
        logp = F.log_softmax(logits[0].float(), -1)
        labels = h + [eos]
        out.append(logp[torch.arange(len(labels)), labels].sum().item() / length_penalty(len(labels), alpha))
    return torch.tensor(out)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_search_matches_a_plain_reference_and_beats_greedy(reverser, alpha):
    _, tok, model = reverser  # half-trained: beams genuinely compete
    eos = tok.eot_token
    src, mask, _, _ = reverse_batch(64, torch.Generator().manual_seed(7))
    got = beam_search(model, src, mask, eos, eos, beam_size=4, alpha=alpha, max_new_tokens=12)
    with torch.inference_mode():
        want = [
            reference_beam(model, src[i : i + 1, :n], mask[i : i + 1, :n], eos, 4, alpha, 12)
            for i, n in enumerate(mask.sum(1).tolist())
        ]
        assert got == want
        greedy = generate(model, src, mask, eos, eos, max_new_tokens=12)
        assert got != greedy  # a test where beam search changes nothing would prove little
        beam_scores = sequence_score(model, src, mask, eos, got, alpha)
        greedy_scores = sequence_score(model, src, mask, eos, greedy, alpha)
    assert (beam_scores >= greedy_scores - 1e-4).float().mean() >= 0.9 and beam_scores.mean() > greedy_scores.mean()

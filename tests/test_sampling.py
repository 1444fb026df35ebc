"""The sampling engine: KV cache == recompute, sampler properties, streaming text and stop strings."""

import re

import pytest
import torch

from gpt import GPT, GPTConfig, generate
from gpt.data.tokenizer import CharTokenizer, get_tokenizer
from gpt.infer.logits import apply_repetition_penalty, next_token, sample_probs, top_k_filter, top_p_filter
from gpt.infer.sampling import ContextWarning, Decoder, SampleConfig, SamplingError, complete
from gpt.infer.stream import StopMatcher
from gpt.model.cache import KVCache

CHARS = "abcdefghijklmnopqrstuvwxyz .,\n"


VOCAB = len(CHARS) + 1


def random_model(vocab=VOCAB, block=16, std=1.0, seed=0, **kw) -> GPT:
    """Random weights with a large spread, so greedy decoding does not collapse to one token."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=2, n_head=4, n_embd=32, **kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer("gpt2")


# ---- KV cache == recomputing the context --------------------------------------------------------


def reference_greedy(model, idx, steps, keep, repetition_penalty=1.0):
    """No cache: a full forward over the model's window at every step, the window defined as in
    gpt/infer/sampling.py's notes (last block_size tokens of the prompt; when appending makes it longer
    than block_size, it becomes the last `keep` tokens)."""
    block = model.config.block_size
    tokens, start, all_logits = idx, max(0, idx.size(1) - block), []
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = model(tokens[:, start:])
            logits = logits[:, -1]
            all_logits.append(logits)
            nxt = next_token(logits, temperature=0, prev_ids=tokens, repetition_penalty=repetition_penalty)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            if tokens.size(1) - start > block:
                start = tokens.size(1) - keep
    return tokens, torch.stack(all_logits, 1)


def cached_greedy(model, idx, steps, keep, repetition_penalty=1.0, graph=False):
    dec = Decoder(model, idx, keep, graph=graph)
    all_logits = []
    for step in range(steps):
        all_logits.append(dec.logits)
        nxt = next_token(dec.logits, temperature=0, prev_ids=dec.tokens, repetition_penalty=repetition_penalty)
        if step == steps - 1:
            return torch.cat([dec.tokens, nxt[:, None]], dim=1), torch.stack(all_logits, 1), dec
        dec.advance(nxt)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (device, graph): the dynamic cache, and the static one (on CUDA replayed as a CUDA graph)
DECODE_PATHS = [
    ("cpu", False),
    ("cpu", True),
    pytest.param("cuda", False, marks=CUDA),
    pytest.param("cuda", True, marks=CUDA),
]


@pytest.fixture
def no_tf32():
    """Full float32 matmuls on CUDA (the trainer switches TF32 on process-wide)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("device,graph", DECODE_PATHS)
@pytest.mark.parametrize("prompt_len", [3, 16, 21])  # short, exactly block_size, longer than block_size
@pytest.mark.parametrize("keep", [8, 1, 16])  # default block_size // 2, the smallest, nanoGPT's crop
def test_cached_greedy_equals_recompute_beyond_block_size(prompt_len, keep, device, graph, no_tf32):
    model = random_model(block=16).to(device)
    idx = torch.randint(0, model.config.vocab_size, (3, prompt_len)).to(device)  # three different prompts
    steps = 50  # several window slides
    ref_tokens, ref_logits = reference_greedy(model, idx, steps, keep, repetition_penalty=1.3)
    tokens, logits, dec = cached_greedy(model, idx, steps, keep, repetition_penalty=1.3, graph=graph)
    assert torch.equal(tokens, ref_tokens)  # token for token
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert dec.prefills >= 3 and dec.context_len <= 16
    assert len(set(tokens[:, prompt_len:].flatten().tolist())) > 5  # a non-trivial sequence


def test_cached_greedy_equals_recompute_without_penalty():
    model = random_model(block=16, seed=3)
    idx = torch.randint(0, model.config.vocab_size, (2, 4))
    ref_tokens, ref_logits = reference_greedy(model, idx, 40, keep=8)
    tokens, logits, _ = cached_greedy(model, idx, 40, keep=8)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_window_slides_in_large_steps():
    model = random_model(block=16)
    dec = Decoder(model, torch.zeros(1, 1, dtype=torch.long))  # keep = 8
    for _ in range(15 + 9 * 4):
        dec.advance(dec.logits.argmax(-1))
    # 1 + 15 fill the block; then a re-prefill of the last 8 tokens every 9 steps (8 -> 16 -> slide)
    assert dec.prefills == 1 + 4 and dec.context_len == 16


@pytest.mark.parametrize("device,graph", DECODE_PATHS)
def test_dropping_finished_rows_keeps_the_others_exact(device, graph, no_tf32):
    model = random_model(block=16).to(device)
    idx = torch.randint(0, model.config.vocab_size, (3, 5)).to(device)
    full_tokens, _ = reference_greedy(model, idx, 30, keep=8)
    dec = Decoder(model, idx, graph=graph)
    for step in range(29):
        nxt = dec.logits.argmax(-1)
        if step == 7:  # row 1 finishes: drop it (a static decoder records its graph again)
            dec.select(torch.tensor([0, 2]))
            nxt = nxt[[0, 2]]
        dec.advance(nxt)
    tokens = torch.cat([dec.tokens, dec.logits.argmax(-1)[:, None]], 1)
    assert torch.equal(tokens, full_tokens[[0, 2]])


def test_generate_greedy_matches_recompute_reference():
    model = random_model(block=16)
    tok = CharTokenizer(CHARS)
    prompt = tok.encode("the cat")
    ref_tokens, _ = reference_greedy(model, torch.tensor([prompt]), 40, keep=8)
    text = complete(model, tok, prompt, max_new_tokens=40, temperature=0, stop_at_eot=False)
    assert text == [tok.decode(ref_tokens[0, len(prompt) :].tolist())]


# ---- sampler properties, with an injected generator -------------------------------------------------


def draws(logits, n=4000, seed=0, **kw):
    """n independent draws from one row of logits (one batched call)."""
    g = torch.Generator().manual_seed(seed)
    return next_token(logits.expand(n, -1), generator=g, **kw)


def test_seeded_generator_reproduces_and_different_seeds_differ():
    logits = torch.randn(1, 50)
    a, b, c = draws(logits, 200, seed=1), draws(logits, 200, seed=1), draws(logits, 200, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_generate_seed_reproduces_text():
    model, tok = random_model(), CharTokenizer(CHARS)
    kw = dict(max_new_tokens=30, num_samples=3, temperature=1.0, top_k=None, stop_at_eot=False)
    first, again = complete(model, tok, "ab", seed=7, **kw), complete(model, tok, "ab", seed=7, **kw)
    other = complete(model, tok, "ab", seed=8, **kw)
    assert first == again and first != other
    assert len(set(first)) == 3  # the batch rows are independent samples


def test_temperature_zero_is_argmax_and_never_touches_the_generator():
    logits = torch.randn(4, 50)
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert torch.equal(next_token(logits, temperature=0, generator=g), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)
    model, tok = random_model(), CharTokenizer(CHARS)
    kw = dict(max_new_tokens=20, num_samples=2, temperature=0, stop_at_eot=False)
    assert complete(model, tok, "ab", seed=1, **kw) == complete(model, tok, "ab", seed=2, **kw)


def test_sample_probs_follows_the_distribution_and_never_draws_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])
    g = torch.Generator().manual_seed(0)
    out = sample_probs(probs.expand(20000, -1), g)
    counts = torch.bincount(out, minlength=6).float() / 20000
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts, probs[0], atol=0.02, rtol=0)
    edge = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # all mass on the first / last id
    assert sample_probs(edge.repeat(500, 1), g).view(500, 2).eq(torch.tensor([0, 1])).all()


def test_top_k_support_is_exactly_the_k_largest():
    logits = torch.randn(1, 50)
    out = draws(logits, top_k=5)
    assert set(out.tolist()) == set(logits[0].topk(5).indices.tolist())


def test_top_k_ties_never_let_more_through():
    logits = torch.zeros(2, 20)  # every id ties
    filtered = top_k_filter(logits, 3)
    assert (filtered.isfinite().sum(-1) == 3).all()
    assert len(set(draws(torch.zeros(1, 20), top_k=3).tolist())) == 3
    ties = torch.tensor([[5.0, 1.0, 5.0, 5.0, 0.0]])
    assert top_k_filter(ties, 2).isfinite().sum().item() == 2


def test_top_p_support_is_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    assert set(draws(logits, top_p=0.75).tolist()) == {1, 3}  # 0.5 + 0.3 >= 0.75
    assert set(draws(logits, top_p=0.85).tolist()) == {1, 3, 2}  # 0.8 < 0.85 <= 0.95
    assert set(draws(logits, top_p=0.4).tolist()) == {1}  # the top id always survives
    assert set(draws(logits, top_p=1.0).tolist()) == {0, 1, 2, 3}
    kept = torch.softmax(top_p_filter(logits, 0.75), -1)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]]))


def test_top_k_then_top_p_then_temperature_shape_the_distribution():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    cold = draws(logits, temperature=0.05)
    assert set(cold.tolist()) == {0}  # near-greedy
    hot = draws(logits, temperature=100.0)
    assert set(hot.tolist()) == {0, 1, 2, 3, 4}  # near-uniform
    assert set(draws(logits, temperature=100.0, top_k=3, top_p=0.5).tolist()) == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prev = torch.tensor([[0, 1, 1]])  # id 1 twice: penalised once
    out = apply_repetition_penalty(logits, prev, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
    assert torch.equal(apply_repetition_penalty(logits, prev, 1.0), logits)
    # the effect on sampling: a penalised favourite loses to an unpenalised runner-up
    assert (
        next_token(
            torch.tensor([[2.0, 1.5]]), temperature=0, prev_ids=torch.tensor([[0]]), repetition_penalty=2.0
        ).item()
        == 1
    )


def test_repetition_penalty_makes_greedy_text_less_repetitive():
    model, tok = random_model(std=0.5), CharTokenizer(CHARS)
    plain = complete(model, tok, "ab", max_new_tokens=40, temperature=0, stop_at_eot=False)[0]
    penalised = complete(model, tok, "ab", max_new_tokens=40, temperature=0, stop_at_eot=False, repetition_penalty=3.0)[
        0
    ]
    assert len(set(penalised)) > len(set(plain))


def test_padded_vocab_ids_are_never_sampled():
    logits = torch.zeros(1, 64)
    logits[0, 60:] = 100.0  # padded rows would win everything
    assert set(draws(logits, vocab_size=50).tolist()) == set(range(50))
    assert set(draws(logits, vocab_size=50, top_k=5).tolist()) <= set(range(50))
    assert next_token(logits, temperature=0, vocab_size=50).item() < 50
    # through generate: a model with 40 rows for a 31-id tokenizer, padded rows inflated
    model, tok = random_model(vocab=40), CharTokenizer(CHARS)
    with torch.no_grad():
        model.transformer.wte.weight[31:] *= 50
    d = Decoder(model, torch.tensor([tok.encode("ab")]))
    assert d.logits.argmax(-1).item() >= 31  # unmasked, a padded id would be chosen
    ids = [i for p in generate(model, tok, "ab", max_new_tokens=30, temperature=0, stop_at_eot=False) for i in p.ids]
    assert len(ids) == 30 and max(ids) < 31


# ---- streaming text, stop strings, end-of-text (a scripted model) ----------------------------------


class Scripted(torch.nn.Module):
    """Quacks like GPT for `Decoder`: its next token follows `script`, then end-of-text."""

    def __init__(self, script, vocab, eot, block=64):
        super().__init__()
        self.config = GPTConfig(vocab_size=vocab, block_size=block, n_layer=1, n_head=1, n_embd=1)
        self.script, self.eot = list(script), eot
        self.weight = torch.nn.Parameter(torch.zeros(1))  # device and dtype
        self.lm_head = torch.nn.Identity()
        self.head = self.lm_head  # GPT.head: the logits of hidden states
        self.prefills = []

    def cache_dtype(self):
        return torch.float32

    def new_caches(self, batch):
        return [KVCache(batch, 1, self.config.block_size, 1, "cpu", torch.float32)]

    def hidden(self, idx, caches):
        B, T = idx.shape
        start = caches[0].pos
        if start == 0:
            self.prompt_len = T
            self.prefills.append(idx.clone())
        for c in caches:
            c.append(torch.zeros(B, 1, T, 1), torch.zeros(B, 1, T, 1))
        k = start + T - self.prompt_len  # tokens generated so far
        nxt = self.script[k] if k < len(self.script) else self.eot
        h = torch.zeros(B, T, self.config.vocab_size)
        h[:, -1, nxt] = 10.0
        return h


def scripted_pieces(tok, text, prompt="x", **kw):
    model = Scripted(tok.encode(text), tok.vocab_size, tok.eot_token)
    return list(generate(model, tok, prompt, temperature=0, **kw))


def test_characters_split_across_tokens_stream_whole(gpt2):
    text = "a🚀b東 ok 👩‍👩‍👧!"
    pieces = scripted_pieces(gpt2, text, max_new_tokens=50)
    assert "".join(p.text for p in pieces) == text
    assert all("\ufffd" not in p.text for p in pieces)
    assert any(p.text == "" and p.ids for p in pieces)  # bytes held back mid-character
    assert pieces[-1].finish == "eot" and pieces[-1].ids == [gpt2.eot_token]
    assert [i for p in pieces for i in p.ids] == gpt2.encode(text) + [gpt2.eot_token]


def test_stop_string_across_token_boundaries_is_not_printed(gpt2):
    text = "Hello world. The end."
    assert len(gpt2.encode("d. T")) > 1 and "d. T" not in [gpt2.decode([i]) for i in gpt2.encode(text)]
    pieces = scripted_pieces(gpt2, text, max_new_tokens=50, stop=["d. T"])
    assert "".join(p.text for p in pieces) == "Hello worl"
    assert pieces[-1].finish == "stop"
    # the earliest of several stops wins; a stop inside a split character works too
    assert "".join(p.text for p in scripted_pieces(gpt2, text, max_new_tokens=50, stop=["end", "o w"])) == "Hell"
    assert "".join(p.text for p in scripted_pieces(gpt2, "a🚀b", max_new_tokens=9, stop=["🚀"])) == "a"


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["abc", "xyz"])
    assert m.push("hello a") == ("hello ", False)
    assert m.push("b") == ("", False)
    assert m.push("d") == ("abd", False)  # not a stop after all: released
    assert m.push("--ab") == ("--", False)
    assert m.push("c tail") == ("", True)
    assert StopMatcher().push("abc") == ("abc", False)


def test_end_of_text_and_length_limits(gpt2):
    pieces = scripted_pieces(gpt2, "one two", max_new_tokens=50)
    assert "".join(p.text for p in pieces) == "one two" and pieces[-1].finish == "eot"
    pieces = scripted_pieces(gpt2, "one two", max_new_tokens=50, stop_at_eot=False)
    assert len(pieces) == 50 and "<|endoftext|>" in "".join(p.text for p in pieces)
    pieces = scripted_pieces(gpt2, "one two three four", max_new_tokens=3)
    assert [p.finish for p in pieces] == [None, None, "length"]
    assert "".join(p.text for p in pieces) == "one two three"


def test_length_limit_mid_character_drops_the_incomplete_tail(gpt2):
    ids = gpt2.encode("a🚀")
    pieces = scripted_pieces(gpt2, "a🚀", max_new_tokens=len(ids) - 1)
    assert "".join(p.text for p in pieces) == "a"


def test_empty_prompt_starts_from_end_of_text(gpt2):
    model = Scripted(gpt2.encode("hi"), gpt2.vocab_size, gpt2.eot_token)
    list(generate(model, gpt2, "", temperature=0, max_new_tokens=5, num_samples=2))
    assert model.prefills[0].tolist() == [[gpt2.eot_token]] * 2


def test_each_sample_finishes_once_and_batch_rows_map_to_their_samples():
    model, tok = random_model(), CharTokenizer(CHARS)
    texts, ids, finish = {}, {}, {}
    for p in generate(
        model, tok, "ab", num_samples=6, max_new_tokens=25, temperature=1.5, top_k=None, stop=["e", "a"], seed=3
    ):
        assert p.sample not in finish  # nothing after a sample's last piece
        texts[p.sample] = texts.get(p.sample, "") + p.text
        ids[p.sample] = ids.get(p.sample, []) + p.ids
        if p.finish:
            finish[p.sample] = p.finish
    assert sorted(finish) == list(range(6)) and "stop" in finish.values()
    for s in range(6):
        full = tok.decode(ids[s])
        if finish[s] == "stop":
            cut = min(i for i in (full.find("e"), full.find("a")) if i >= 0)
            assert texts[s] == full[:cut] and cut == len(full) - 1  # ended at the stop's token
        elif finish[s] == "length":
            assert len(ids[s]) == 25 and texts[s] == full
        else:
            assert ids[s][-1] == tok.eot_token


def test_prompt_longer_than_context_keeps_its_tail_with_a_warning():
    model, tok = random_model(block=16), CharTokenizer(CHARS)
    prompt = "the quick brown fox jumps"
    with pytest.warns(ContextWarning, match="25 tokens, more than the model's context of 16"):
        out = complete(model, tok, prompt, max_new_tokens=5, temperature=0, stop_at_eot=False)
    tail = complete(model, tok, prompt[-16:], max_new_tokens=5, temperature=0, stop_at_eot=False)
    assert out == tail


# ---- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("top_k", 0, "--top-k"),
        ("top_p", 0.0, "--top-p"),
        ("top_p", 1.5, "--top-p"),
        ("temperature", -0.1, "--temperature"),
        ("max_new_tokens", 0, "--max-new-tokens"),
        ("num_samples", 0, "--num-samples"),
        ("repetition_penalty", 0.0, "--repetition-penalty"),
        ("stop", ("",), "--stop"),
        ("seed", 2**64, "--seed"),
    ],
)
def test_invalid_settings_name_the_flag_and_value(field, value, flag):
    with pytest.raises(SamplingError, match=re.escape(flag) + " must .*got " + re.escape(repr(value))):
        SampleConfig(**{field: value})


def test_encoder_decoder_models_are_refused_before_anything_runs():
    model = GPT(GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=2, n_embd=8, n_encoder_layer=1))
    with pytest.raises(SamplingError, match="has an encoder"):
        generate(model, CharTokenizer(CHARS), "ab")


def test_all_problems_are_reported_together():
    with pytest.raises(SamplingError) as e:
        SampleConfig(top_k=0, top_p=2.0, temperature=-1)
    assert all(flag in str(e.value) for flag in ("--top-k", "--top-p", "--temperature"))


def test_kv_cache_helper_shapes():
    cache = KVCache(2, 4, 8, 16, "cpu", torch.float32)
    k, v = cache.append(torch.ones(2, 4, 3, 16), torch.ones(2, 4, 3, 16))
    assert k.shape == (2, 4, 3, 16) and cache.pos == 3

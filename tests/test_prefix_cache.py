"""The prefix cache (gpt/infer/prefix.py): a prompt that starts as an earlier one prefills only what is new, and
the answer is the one without the cache; LRU within its budget; a second chat turn through the server hits it.

Scoring requests (echo + logprobs, as lm-evaluation-harness sends them) load the scores their blocks keep and
compute the rest: every token id and top table's ids equal the cache-less answer's, every log-probability
within 1e-5 (room for the float32 rounding of prefills of other lengths: none measured on these models). An
entry taken one position off is another token's: a different id. Requests that join at one step and share a
prefix wait for a second wave and load it (lm-eval's batches).
"""

import pytest
import torch

from gpt import load_checkpoint
from gpt.infer.batching import BatchEngine, Request
from gpt.infer.logprobs import TokenLogprob
from gpt.infer.prefix import BLOCK, PrefixCache, entry_bytes
from gpt.infer.sampling import SampleConfig, complete
from gpt.model import lora
from tests.test_batching import collect, random_model, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(trained_run):
    return load_checkpoint(trained_run)


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=0.9, top_k=20, seed=11, num_samples=2)])
def test_a_second_prompt_with_the_same_start_loads_it_and_answers_the_same(trained, settings):
    model, tok, _ = trained
    header = "ROMEO:\nBut soft, what light breaks?\n"  # 2 blocks and a bit (the model's block is 64)
    plain, cached = BatchEngine(model, tok, 8), BatchEngine(model, tok, 8, prefix_cache_bytes=64 << 20)
    for question in ("JULIET:\n", "NURSE:\nAnon"):
        ids = tok.encode(header + question)
        a, b = collect(plain, ids, **settings), collect(cached, ids, **settings)
        run(plain), run(cached)
        assert b["text"] == a["text"] == complete(model, tok, ids, **{"top_k": None, "max_new_tokens": 20, **settings})
    stats, n = cached.prefix.stats, settings.get("num_samples", 1)  # every row looks its prompt up
    assert (stats["lookups"], stats["hits"]) == (2 * n, n)  # the second prompt's rows found the header
    assert stats["tokens_reused"] == n * (len(tok.encode(header)) // BLOCK) * BLOCK > 0


def test_rows_that_start_at_different_positions_join_in_one_step():
    model = random_model(block=64, seed=2)
    prompts = [[i % 26 for i in range(n)] for n in (40, 40 + 3, 9, 33)]
    engine = BatchEngine(model, _Tok(), 8, prefix_cache_bytes=8 << 20)
    first = collect(engine, prompts[0], temperature=0)
    run(engine)
    outs = [collect(engine, ids, temperature=0) for ids in prompts[1:]]  # one step admits all three
    run(engine)
    alone = BatchEngine(model, _Tok(), 8)
    refs = [collect(alone, ids, temperature=0) for ids in prompts]
    run(alone)
    assert [o["text"] for o in [first, *outs]] == [r["text"] for r in refs]
    assert engine.prefix.stats["tokens_reused"] == 2 * BLOCK + 2 * BLOCK  # prompts 2 and 4 found 1's blocks


class _Tok:
    """The char tokenizer of tests/test_batching.py's random models."""

    def __new__(cls):
        from gpt.data.tokenizer import CharTokenizer
        from tests.test_batching import CHARS

        return CharTokenizer(CHARS)


def test_the_budget_keeps_the_most_recent_blocks():
    model = random_model(block=64)
    layers = model.new_caches(1)
    for layer in layers:
        layer.k.normal_(), layer.v.normal_()
    per_block = sum(2 * layer.k[0, :, :BLOCK].nbytes for layer in layers)
    cache = PrefixCache(budget_bytes=3 * per_block)
    a, b = list(range(48)), list(range(100, 148))
    cache.store(a, layers, 0)
    assert len(cache.blocks) == 3 and cache.bytes == 3 * per_block
    cache.store(b, layers, 0)  # three more: a's go
    assert len(cache.blocks) == 3 and cache.bytes <= cache.budget
    assert cache.load(a + [1], layers, 0) == 0 and cache.load(b + [1], layers, 0) == 3 * BLOCK
    assert cache.load(b[:20], layers, 0) == BLOCK  # whole blocks, one token left to prefill
    assert cache.load(b[:BLOCK], layers, 0) == 0
    windowed = random_model(block=64, attention_window="8")
    assert BatchEngine(windowed, _Tok(), 4, prefix_cache_bytes=1 << 20).prefix is None  # rings hold the last only
    entries = [TokenLogprob(i, -1.0, {i: -1.0, 99: -0.5}) for i in range(32)]
    scored = per_block + entry_bytes(entries[:BLOCK])  # a block with its entries
    cache = PrefixCache(budget_bytes=2 * scored + per_block - 1)
    cache.store(a, layers, 0)  # three blocks without entries
    cache.store(a[:32], layers, 0, entries=entries, top=1)  # the first two get theirs: the third goes
    assert [block.bytes for block in cache.blocks.values()] == [scored] * 2 and cache.bytes == 2 * scored
    assert cache.load(a + [1], layers, 0, top=1) == 2 * BLOCK and cache.entries(a, 2 * BLOCK, top=1) == entries
    assert cache.load(a + [1], layers, 0, top=2) == 0  # kept for top 1 only


def test_a_second_chat_turn_through_the_server_hits_the_cache(chat_run):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import httpx

    from gpt.serve.app import ServeConfig, create_app, running

    model, tok, meta = load_checkpoint(chat_run)
    turn = [{"role": "system", "content": "Translate what the user says into English, word for word."},
            {"role": "user", "content": "Translate to English: Ein Hund rennt durch den Park."}]  # fmt: skip
    answers = {}
    for mb in (0, 16):
        with running(create_app(model, tok, meta, ServeConfig(model_name="chat", prefix_cache_mb=mb))) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            first = client.chat.completions.create(model="chat", messages=turn, max_tokens=20, temperature=0)
            second = [*turn, {"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "Translate to English: Zwei Frauen lachen."}]  # fmt: skip
            again = client.chat.completions.create(model="chat", messages=second, max_tokens=20, temperature=0)
            answers[mb] = (first.choices[0].message.content, again.choices[0].message.content)
            health = httpx.get(url + "/health").json()
        if mb:
            assert health["prefix_cache"]["hits"] == 1 and health["prefix_cache"]["tokens_reused"] >= BLOCK
        else:
            assert "prefix_cache" not in health
    assert answers[16] == answers[0]
    assert torch.is_tensor(model.transformer.wte.weight)


def score(engine, ids, top=1, generate=False, adapter=0):
    """A scoring request as lm-eval sends it (echo, logprobs `top`; max_tokens 0, or 1 with `generate`): its
    first piece's entries, once the engine has run."""
    out = []
    cfg = SampleConfig(max_new_tokens=1, temperature=0)
    emit = lambda piece: out.append(piece.logprobs)  # noqa: E731
    request = Request(ids, cfg, emit, adapter=adapter, logprobs=top, echo=True, generate=generate)
    engine.submit(request)
    return out


def assert_same_scores(got, want):
    assert [e.id for e in got] == [e.id for e in want]
    assert [None if e.top is None else list(e.top) for e in got] == [
        None if e.top is None else list(e.top) for e in want
    ]
    for g, w in zip(got, want):
        assert (g.logprob is None) == (w.logprob is None)
        if w.logprob is not None:
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert list(g.top.values()) == pytest.approx(list(w.top.values()), abs=1e-5)


def lm_eval_like(seed=0):
    """Three contexts of 40 to 60 ids, each with 4 continuations of 3 to 9 ids: lm-eval's requests for a multiple
    choice task (the context repeated with each choice)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: torch.randint(0, 32, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    return [[context + rand(3, 10) for _ in range(4)] for context in (rand(40, 61) for _ in range(3))]


@pytest.mark.parametrize("generate", [False, True])
def test_scoring_requests_load_the_kept_scores_and_answer_as_without_the_cache(generate):
    model = random_model(block=96, seed=3)
    plain, cached = BatchEngine(model, _Tok(), 8), BatchEngine(model, _Tok(), 8, prefix_cache_bytes=8 << 20)
    for choices in lm_eval_like():
        for ids in choices:  # one at a time, as lm-eval's local-completions sends them by default
            want, got = score(plain, ids, generate=generate), score(cached, ids, generate=generate)
            run(plain), run(cached)
            assert len(got[0]) == len(ids) + generate
            assert_same_scores(got[0], want[0])
    stats = cached.prefix.stats  # each context's later 3 choices loaded its blocks (contexts are 2 blocks or more)
    assert stats["hits"] == 3 * 3 and stats["tokens_reused"] >= 3 * 3 * 2 * BLOCK


def test_generating_and_scoring_requests_and_adapters_share_the_cache_as_they_should():
    model = random_model(block=96, seed=4)
    g = torch.Generator().manual_seed(1)
    for name, linear in list(model.named_modules()):  # adapter 1: a random update of every attention input
        if name.endswith("attn.c_attn"):
            update = (torch.randn(2, 32, generator=g) * 0.3, torch.randn(96, 2, generator=g) * 0.3, 1.0)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, lora.MultiLoRALinear(linear, [update]))
    plain, cached = BatchEngine(model, _Tok(), 8), BatchEngine(model, _Tok(), 8, prefix_cache_bytes=8 << 20)
    context = lm_eval_like(seed=5)[0][0][:48]  # three whole blocks
    steps = [  # (ids, what to send): a generating request stores the blocks without scores ...
        (context + [1], "generate"),
        (context + [2, 3], "score"),  # ... which a scoring one cannot load, but gives them their scores
        (context + [4, 5], "score"),  # loaded
        (context + [4, 5], "top 2"),  # another top: not loaded
        (context + [6], "adapter 1"),  # another adapter: not loaded (its keys and scores differ)
        (context + [6, 7], "adapter 1"),  # loaded, its own
        (context + [8], "score"),  # the base's again
    ]
    hits = []
    for ids, what in steps:
        if what == "generate":
            for engine in (plain, cached):
                collect(engine, ids, temperature=0, max_new_tokens=5)
                run(engine)
            hits.append(cached.prefix.stats["tokens_reused"])
            continue
        kw = {"top": 2} if what == "top 2" else {"adapter": 1} if what == "adapter 1" else {}
        want, got = score(plain, ids, **kw), score(cached, ids, **kw)
        run(plain), run(cached)
        assert_same_scores(got[0], want[0])
        hits.append(cached.prefix.stats["tokens_reused"])
        if what == "adapter 1":
            base = score(plain, ids)
            run(plain)
            assert abs(base[0][-1].logprob - want[0][-1].logprob) > 1e-3  # the adapter changes the scores
    reused = [b - a for a, b in zip([0, *hits], hits)]
    assert reused == [0, 0, 3 * BLOCK, 0, 0, 3 * BLOCK, 3 * BLOCK]


def test_requests_that_join_together_wait_for_the_one_whose_prefix_they_share():
    model = random_model(block=96, seed=3)
    plain, cached = BatchEngine(model, _Tok(), 16), BatchEngine(model, _Tok(), 16, prefix_cache_bytes=8 << 20)
    requests = [ids for choices in lm_eval_like() for ids in choices]  # lm-eval with batch_size 12: one step
    answers = {}
    for engine in (plain, cached):
        scores = [score(engine, ids, generate=True) for ids in requests]
        text = collect(engine, requests[0][:40] + [5], temperature=0, max_new_tokens=3)  # generating: waits too
        assert run(engine) == 3  # all joined at the first step
        answers[engine] = scores, text["text"]
    for got, want in zip(answers[cached][0], answers[plain][0]):
        assert_same_scores(got[0], want[0])
    assert answers[cached][1] == answers[plain][1]
    stats = cached.prefix.stats  # every context's first choice prefilled in the first wave, the others loaded it
    assert stats["hits"] == 3 * 3 + 1 and stats["tokens_reused"] >= 3 * 3 * 2 * BLOCK + 2 * BLOCK

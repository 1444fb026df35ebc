"""The prefix cache (gpt/infer/prefix.py): a prompt that starts as an earlier one prefills only what is new, and
the answer is the one without the cache; LRU within its budget; a second chat turn through the server hits it."""

import pytest
import torch

from gpt import load_checkpoint
from gpt.infer.batching import BatchEngine
from gpt.infer.prefix import BLOCK, PrefixCache
from gpt.infer.sampling import complete
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

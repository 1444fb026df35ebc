"""Per-row positions in the KV cache, and the continuous-batching engine built on them (gpt/infer/batching.py)."""

import threading

import pytest
import torch

from gpt import GPT, GPTConfig
from gpt.data.tokenizer import CharTokenizer
from gpt.infer.batching import BatchEngine
from gpt.infer.engine import BatchWorker, QueueFull, Request
from gpt.infer.sampling import SampleConfig, complete, seeded_generator
from gpt.infer.seq2seq_engine import Seq2seqEngine

CHARS = "\n !,.?abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def random_model(block=32, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(CHARS) + 1, block_size=block, n_layer=2, n_head=2, n_embd=32) | kw
    return GPT(GPTConfig(**cfg)).eval()


@torch.no_grad()
def test_rows_at_different_positions_decode_as_if_each_were_alone():
    model = random_model()
    prompts = [torch.randint(0, 30, (n,)) for n in (7, 3, 12)]
    alone = []  # each row's logits over 6 greedy steps, with its own dynamic cache
    for p in prompts:
        caches = model.new_caches(1)
        logits = [model.lm_head(model.hidden(p[None], caches)[:, -1])]
        for _ in range(5):
            logits.append(model.lm_head(model.hidden(logits[-1].argmax(-1, keepdim=True), caches)[:, -1]))
        alone.append(torch.cat(logits))

    # one batch: the prompts right-padded into one prefill at per-row positions, then one token per row per step
    caches = model.new_caches(3)
    lengths = torch.tensor([len(p) for p in prompts])
    padded = torch.zeros(3, 12, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    pos = torch.zeros(3, dtype=torch.long)
    for c in caches:
        c.pos = pos
    h = model.hidden(padded, caches)
    logits = [model.lm_head(h[torch.arange(3), lengths - 1])]
    pos += lengths  # the padding written after each short prompt is masked, then overwritten
    for _ in range(5):
        logits.append(model.lm_head(model.hidden(logits[-1].argmax(-1, keepdim=True), caches)[:, 0]))
        pos += 1
    batched = torch.stack(logits, 1)  # (3, 6, V)
    for i in range(3):
        torch.testing.assert_close(batched[i], alone[i], atol=1e-5, rtol=1e-5)
        assert torch.equal(batched[i].argmax(-1), alone[i].argmax(-1))


def collect(engine, ids, **settings):
    """Submit a request whose pieces are gathered into per-sample texts and finish reasons."""
    cfg = SampleConfig(**{"max_new_tokens": 20, **settings})
    out = {"text": [""] * cfg.num_samples, "finish": [None] * cfg.num_samples, "tokens": 0}

    def emit(piece):
        out["text"][piece.sample] += piece.text
        out["tokens"] += len(piece.ids)
        out["finish"][piece.sample] = piece.finish or out["finish"][piece.sample]

    request = Request(ids, cfg, emit)
    engine.submit(request)
    out["request"] = request
    return out


def run(engine, max_steps=10_000):
    steps = 0
    while engine.busy and steps < max_steps:
        engine.step()
        steps += 1
    return steps


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0),
        dict(temperature=1.0, top_k=10, seed=7),
        dict(temperature=0.9, top_p=0.8, repetition_penalty=1.3, seed=3),
    ],
)
def test_requests_joining_a_running_batch_get_what_they_would_get_alone(settings):
    model, tok = random_model(), CharTokenizer(CHARS)
    prompts = ["the cat", "a", "so it goes on and on, and", ""]  # different lengths; "" starts at end-of-text
    engine = BatchEngine(model, tok, max_rows=8)
    results = [
        collect(
            engine,
            tok.encode(prompts[0]) or [tok.eot_token],
            max_new_tokens=30,
            num_samples=2,
            stop_at_eot=False,
            **settings,
        )
    ]
    for _ in range(5):  # the first request is 5 tokens ahead when the others join
        engine.step()
    results += [
        collect(engine, tok.encode(p) or [tok.eot_token], max_new_tokens=n, stop_at_eot=False, **settings)
        for p, n in zip(prompts[1:], (12, 25, 40))
    ]
    run(engine)
    assert engine.rows == [] and not engine.busy
    for p, r, n in zip(prompts, results, (30, 12, 25, 40)):
        expected = complete(
            model, tok, p, max_new_tokens=n, num_samples=r["request"].config.num_samples, stop_at_eot=False, **settings
        )
        assert r["text"] == expected
        assert r["finish"] == ["length"] * len(expected)


def test_requests_with_different_settings_share_a_batch():
    model, tok = random_model(), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=8)
    specs = [
        ("abc", dict(temperature=1.0, top_k=5, seed=1, num_samples=2)),  # one group: same settings ...
        ("hello", dict(temperature=1.0, top_k=5, seed=2)),  # ... another generator
        ("x", dict(temperature=0.7, top_p=0.9, seed=3)),
        ("so", dict(temperature=0)),
        ("we", dict(temperature=1.0, repetition_penalty=1.5, seed=4, num_samples=2)),
    ]
    results = [collect(engine, tok.encode(p), max_new_tokens=25, stop_at_eot=False, **kw) for p, kw in specs]
    run(engine)
    for (p, kw), r in zip(specs, results):
        assert r["text"] == complete(model, tok, p, max_new_tokens=25, stop_at_eot=False, **kw)


YARN = dict(pos_encoding="rope", rope_scaling="yarn", rope_factor=4.0, rope_original_block=4)  # (stretched angles)


@pytest.mark.parametrize(
    "pos", [dict(pos_encoding="learned"), dict(pos_encoding="rope"), YARN], ids=["learned", "rope", "yarn"]
)
def test_window_slides_per_row_like_generate(pos):  # rope: the cache rolls, no re-prefill
    model, tok = random_model(block=16, **pos), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=4)  # keep = 8, as generate's default
    # sampled, not greedy: this random model's greedy text is one repeated character whatever the context
    settings = dict(temperature=1.0, top_k=None, stop_at_eot=False, seed=3)
    long = collect(engine, tok.encode("hello there"), max_new_tokens=45, **settings)
    engine.step()
    short = collect(engine, tok.encode("x"), max_new_tokens=30, **settings)
    run(engine)
    assert long["text"] == complete(model, tok, "hello there", max_new_tokens=45, **settings)
    assert short["text"] == complete(model, tok, "x", max_new_tokens=30, **settings)


def test_stop_strings_and_end_of_text_end_a_sample_and_free_its_row():
    model, tok = random_model(), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=4)
    greedy = complete(model, tok, "ab", max_new_tokens=30, temperature=0, stop_at_eot=False)[0]
    stop = greedy[5:7]  # a stop string the greedy continuation is known to contain
    r = collect(engine, tok.encode("ab"), max_new_tokens=30, temperature=0, stop=(stop,))
    engine.step()
    assert len(engine.rows) == 1
    run(engine)
    assert r["text"] == [greedy[: greedy.index(stop)]] and r["finish"] == ["stop"]
    assert engine.rows == []

    eot_model = random_model()
    with torch.no_grad():  # a model that always says end-of-text
        eot_model.lm_head.weight.zero_()
        eot_model.lm_head.weight[tok.eot_token] = 1.0
        eot_model.transformer.wte.weight.zero_()
        eot_model.transformer.wte.weight[tok.eot_token] = 1.0
    eot_engine = BatchEngine(eot_model, tok, max_rows=2)
    r = collect(eot_engine, tok.encode("ab"), temperature=0)
    assert run(eot_engine) == 1 and r["finish"] == ["eot"] and r["text"] == [""] and r["tokens"] == 1


def test_rows_are_shared_first_come_first_served_and_a_cancelled_request_frees_its_rows():
    model, tok = random_model(), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=3)
    a = collect(engine, tok.encode("abc"), num_samples=2, max_new_tokens=50, temperature=0)
    b = collect(engine, tok.encode("xy"), num_samples=2, max_new_tokens=5, temperature=0)  # does not fit yet
    c = collect(engine, tok.encode("q"), max_new_tokens=5, temperature=0)  # would fit, but waits its turn
    engine.step()
    assert len(engine.rows) == 2 and len(engine.waiting) == 2
    a["request"].cancel()
    engine.step()  # a's rows are freed at this step, and b and c join
    assert [row.request for row in engine.rows] == [b["request"]] * 2 + [c["request"]] and not engine.waiting
    tokens_a = a["tokens"]
    run(engine)
    assert a["tokens"] == tokens_a  # nothing more for a cancelled request
    assert b["finish"] == ["length", "length"] and c["finish"] == ["length"]


def test_rows_that_leave_hand_their_cache_row_to_the_last_one():
    model, tok = random_model(), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=4)
    specs = [("one", 3), ("two words", 20), ("three", 6), ("four", 20)]
    results = [collect(engine, tok.encode(p), max_new_tokens=n, temperature=0, stop_at_eot=False) for p, n in specs]
    for _ in range(3):
        engine.step()
    # "one" ended at its third token: the last row ("four") moved into its cache row 0
    assert [row.request for row in engine.rows] == [results[i]["request"] for i in (3, 1, 2)]
    run(engine)
    for (p, n), r in zip(specs, results):
        assert r["text"] == complete(model, tok, p, max_new_tokens=n, temperature=0, stop_at_eot=False)


def test_worker_answers_on_its_thread_and_bounds_the_queue():
    model, tok = random_model(), CharTokenizer(CHARS)
    worker = BatchWorker(BatchEngine(model, tok, max_rows=2), max_waiting=2)
    done = threading.Event()
    pieces = []

    def emit(piece):
        pieces.append(piece)
        if piece.finish:
            done.set()

    blockers = [Request(tok.encode("a"), SampleConfig(max_new_tokens=5, temperature=0), emit) for _ in range(2)]
    worker.submit(blockers)  # not started yet: both wait
    with pytest.raises(QueueFull, match="2 requests are waiting already"):
        worker.submit([Request(tok.encode("b"), SampleConfig(max_new_tokens=5), emit)])
    blockers[1].cancel()  # a cancelled request no longer counts
    worker.submit([Request(tok.encode("b"), SampleConfig(max_new_tokens=5), emit)])
    worker.start()
    try:
        assert done.wait(30)
    finally:
        worker.stop()
    assert sum(p.finish is not None for p in pieces) >= 1


def test_worker_hands_a_failed_step_to_the_requests_in_it_and_goes_on():
    model, tok = random_model(), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=2)
    worker = BatchWorker(engine).start()
    results = []
    original = engine._decode_step

    def broken():
        raise RuntimeError("boom")

    engine._decode_step = broken
    got = threading.Event()
    first = Request(
        tok.encode("a"),
        SampleConfig(max_new_tokens=5, temperature=0),
        lambda item: (results.append(item), isinstance(item, Exception) and got.set()),
    )
    try:
        worker.submit([first])
        assert got.wait(30) and isinstance(results[-1], RuntimeError) and first.cancelled
        engine._decode_step = original
        got.clear()
        second = Request(
            tok.encode("a"),
            SampleConfig(max_new_tokens=3, temperature=0),
            lambda item: (results.append(item), item.finish and got.set()),
        )
        worker.submit([second])
        assert got.wait(30) and results[-1].finish == "length"
    finally:
        worker.stop()


def test_seq2seq_engine_translates_requests_together_as_translate_does():
    from gpt.infer.translate import translate

    tok = CharTokenizer(CHARS)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=len(CHARS) + 1, block_size=32, n_layer=2, n_head=2, n_embd=32, n_encoder_layer=2)
    ).eval()
    eos = tok.eot_token
    meta = {"model_config": model.config.to_dict(), "seq2seq": {"bos": eos, "eos": eos, "pad": eos}}
    engine = Seq2seqEngine(model, tok, meta, max_rows=8)
    sources = ["ein mann", "eine frau, die", ""]
    results = [collect(engine, tok.encode(s), temperature=0, max_new_tokens=n) for s, n in zip(sources, (10, 4, 32))]
    assert run(engine) == 1  # all three in one step
    expected = translate(model, tok, sources, eos, eos, max_new_tokens=32)
    for r, e, n in zip(results, expected, (10, 4, 32)):
        assert r["text"] == [e[:n]]
    assert results[1]["finish"] == ["length"]


def gathered_requests(tok, specs):
    """Requests whose pieces (or error) are gathered; `done[i]` is set when request i ends either way."""
    out = [
        {"text": [""] * kw.get("num_samples", 1), "error": None, "done": threading.Event(), "finished": 0}
        for _, kw in specs
    ]

    def emit_to(o):
        def emit(item):
            if isinstance(item, Exception):
                o["error"] = item
                o["done"].set()
                return
            o["text"][item.sample] += item.text
            o["finished"] += item.finish is not None
            if o["finished"] == len(o["text"]):
                o["done"].set()

        return emit

    return [
        Request(tok.encode(p), SampleConfig(stop_at_eot=False, **kw), emit_to(o)) for (p, kw), o in zip(specs, out)
    ], out


def test_a_request_whose_own_setup_fails_gets_the_error_alone_and_the_batch_goes_on(monkeypatch):
    import gpt.infer.batching

    class PickyStream(gpt.infer.batching.TextStream):
        def __init__(self, tokenizer, stops=()):
            if "boom" in stops:
                raise RuntimeError("this stop string breaks the setup")
            super().__init__(tokenizer, stops)

    def picky_generator(seed, device):  # (SampleConfig refuses seeds torch cannot take: this one is refused late)
        if seed == 666:
            raise RuntimeError("this seed breaks the setup")
        return seeded_generator(seed, device)

    monkeypatch.setattr(gpt.infer.batching, "TextStream", PickyStream)
    monkeypatch.setattr(gpt.infer.batching, "seeded_generator", picky_generator)
    model, tok = random_model(), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=8)
    specs = [
        ("running", dict(max_new_tokens=20, temperature=0)),  # decoding already when the others join
        ("bad seed", dict(max_new_tokens=5, temperature=1.0, seed=666)),  # its generator fails
        ("healthy", dict(max_new_tokens=6, temperature=1.0, seed=3, num_samples=2)),
        ("picky", dict(max_new_tokens=5, temperature=0, stop=("boom",))),
        ("last", dict(max_new_tokens=4, temperature=0)),
    ]
    requests, out = gathered_requests(tok, specs)
    engine.submit(requests[0])
    engine.step()
    for request in requests[1:]:  # admitted together, at the next step
        engine.submit(request)
    engine.step()
    assert [out[i]["done"].is_set() for i in range(5)] == [False, True, False, True, False]
    assert [row.request for row in engine.rows] == [requests[i] for i in (0, 2, 2, 4)]
    run(engine)
    assert all(o["done"].is_set() for o in out)
    assert isinstance(out[1]["error"], (ValueError, RuntimeError)) and isinstance(out[3]["error"], RuntimeError)
    assert requests[1].cancelled and requests[3].cancelled
    for i in (0, 2, 4):
        assert out[i]["error"] is None
        p, kw = specs[i]
        assert out[i]["text"] == complete(model, tok, p, stop_at_eot=False, **kw)
    assert not engine.busy and engine.taken == []


def test_a_failing_translation_step_answers_every_request_it_took(monkeypatch):
    tok = CharTokenizer(CHARS)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=len(CHARS) + 1, block_size=32, n_layer=2, n_head=2, n_embd=32, n_encoder_layer=2)
    ).eval()
    eos = tok.eot_token
    meta = {"model_config": model.config.to_dict(), "seq2seq": {"bos": eos, "eos": eos, "pad": eos}}
    engine = Seq2seqEngine(model, tok, meta, max_rows=8)
    translate = engine._translate

    def broken(group):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "_translate", broken)
    specs = [
        ("ein mann", dict(temperature=0)),
        ("eine frau", dict(temperature=0)),
        ("ein hund", dict(temperature=1.0, seed=1, num_samples=2)),
    ]
    requests, out = gathered_requests(tok, [(p, dict(max_new_tokens=8, **kw)) for p, kw in specs])
    worker = BatchWorker(engine)
    worker.submit(requests)  # all in one step
    worker.start()
    try:
        assert all(o["done"].wait(30) for o in out), "a request of the failed step got no answer"
        assert all(isinstance(o["error"], RuntimeError) for o in out) and engine.taken == []
        monkeypatch.setattr(engine, "_translate", translate)  # the engine goes on with new requests
        again, out = gathered_requests(tok, [("ein mann", dict(max_new_tokens=8, temperature=0))])
        worker.submit(again)
        assert out[0]["done"].wait(30) and out[0]["error"] is None
    finally:
        worker.stop()


def test_a_failed_prefill_answers_the_running_requests_and_every_joining_one():
    model, tok = random_model(), CharTokenizer(CHARS)
    engine = BatchEngine(model, tok, max_rows=8)
    requests, out = gathered_requests(tok, [(p, dict(max_new_tokens=50, temperature=0)) for p in ("a", "b", "c")])
    engine.submit(requests[0])
    engine.step()

    def broken(first):
        raise RuntimeError("boom")

    engine._prefill = broken
    worker = BatchWorker(engine)
    worker.submit(requests[1:])
    worker.start()
    try:
        assert all(o["done"].wait(30) for o in out), [o["done"].is_set() for o in out]
    finally:
        worker.stop()
    assert all(isinstance(o["error"], RuntimeError) for o in out) and not engine.rows and not engine.taken

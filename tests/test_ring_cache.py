"""The bounded KV cache of windowed layers (gpt/model/cache.py's ring): greedy decoding through it equals the
dense masked forward (GPT.forward over the whole sequence, gpt/model/windows.py's masks) token for token, in
every decoding path (the sampler's decoder, its static step, the batch engine, beam search, the compiled
step, int8), and its memory does not grow with the generated length."""

import pytest
import torch

from gpt import GPT, GPTConfig
from gpt.checkpoints import native
from gpt.cli import sample
from gpt.data.tokenizer import CharTokenizer
from gpt.infer.batching import BatchEngine, Request
from gpt.infer.sampling import Decoder, SampleConfig
from gpt.infer.translate import beam_search
from gpt.infer.translate import generate as translate
from gpt.model.compiled import AheadOfTimeStep, DynamoStep
from gpt.model.quantize import quantize

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

V = 23


def tiny(block=16, **kw) -> GPT:
    """An untrained model with large random matrices (no biases, LayerNorms at 1: their random offsets would
    make every step's argmax the same token): peaked, varied greedy tokens, so a key missing or seen wrongly
    changes them."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, block_size=block, n_layer=3, n_head=2, n_embd=32, pos_encoding="rope")
    model = GPT(GPTConfig(**cfg | dict(bias=False, untied_head=True) | kw))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def unbounded(model: GPT) -> GPT:
    """The same weights, caches of every position (the windows as masks only)."""
    twin = GPT.__new__(GPT)
    twin.__dict__ = dict(model.__dict__)
    twin.ring_cache = False
    return twin


def prompt(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (rows, length), generator=torch.Generator().manual_seed(seed))


def greedy(model: GPT, idx: torch.Tensor, n: int, graph: bool = False, check: bool = True, atol: float = 1e-4):
    """n greedy tokens through the Decoder; with `check`, each step's logits against GPT.forward over the whole
    sequence (the dense masked reference); returns the tokens and the decoder."""
    dec = Decoder(model, idx, graph=graph)
    for _ in range(n):
        if check:
            with torch.no_grad():
                full = model(dec.tokens[:, dec.start :])[0][:, -1].float()
            torch.testing.assert_close(dec.logits, full, atol=atol, rtol=atol)
            assert torch.equal(dec.logits.argmax(-1), full.argmax(-1))
        dec.advance(dec.logits.argmax(-1))
    return dec.tokens, dec


def rings(dec: Decoder) -> list[int]:
    return [c.max_len if c.ring else 0 for c in dec.caches]


@pytest.mark.parametrize("graph", [False, True], ids=["int-pos", "static"])
@pytest.mark.parametrize("length", [3, 11], ids=["prompt<W", "prompt>W"])
@pytest.mark.parametrize(
    "window, n_global, expect",
    [("6", 0, [6, 6, 6]), ("5,full,7", 0, [5, 0, 7]), ("5,7", 2, [7, 9, 7]), ("4,full", 3, [7, 0, 7])],
)
def test_greedy_through_the_ring_equals_the_dense_masked_forward(graph, length, window, n_global, expect):
    model = tiny(block=24, attention_window=window, global_tokens=n_global)
    _, dec = greedy(model, prompt(2, length), 24 - length, graph=graph)  # within block_size (full layers roll past)
    assert rings(dec) == expect  # the windowed layers keep W (+ G) slots, the full one every position


def test_learned_positions_keep_their_crop_and_prefill_past_block_size():
    """Learned positions have no row past block_size: the decoder crops and prefills again, as without a ring."""
    model = tiny(attention_window="4,6", global_tokens=1, pos_encoding="learned")
    tokens, dec = greedy(model, prompt(2, 5), 40)  # each step checked against the forward of the kept context
    assert dec.prefills > 1 and rings(dec) == [5, 7, 5]
    ring_tokens, _ = greedy(unbounded(model), prompt(2, 5), 40, check=False)
    assert torch.equal(tokens, ring_tokens)


def test_a_prompt_fed_in_chunks_equals_one_prefill():
    """A T > 1 append to a ring that already holds keys (some of which the new queries still see)."""
    model = tiny(attention_window="4,6", global_tokens=2)
    idx = prompt(2, 15)
    caches = model.new_caches(2)
    with torch.no_grad():
        model.hidden(idx[:, :6], caches)
        h = model.hidden(idx[:, 6:], caches)
        torch.testing.assert_close(model.head(h), model(idx)[0][:, 6:], atol=1e-4, rtol=1e-4)


def test_four_times_past_block_size_equals_the_full_forward_with_constant_memory():
    """All layers windowed, RoPE: generation goes on past block_size through the rings, equal to GPT.forward over
    the whole 4x sequence (RoPE has no table: the forward takes any length), and the caches never grow."""
    model = tiny(block=16, attention_window="5,7", global_tokens=2)
    idx = prompt(2, 9)
    dec = Decoder(model, idx)
    size = sum(c.nbytes for c in dec.caches)
    buffers = [(c.k.data_ptr(), c.v.data_ptr()) for c in dec.caches]
    for _ in range(4 * 16):
        dec.advance(dec.logits.argmax(-1))
        assert sum(c.nbytes for c in dec.caches) == size
    assert [(c.k.data_ptr(), c.v.data_ptr()) for c in dec.caches] == buffers  # the same tensors, written in place
    assert dec.tokens.size(1) == 9 + 64 and dec.prefills == 1  # one prefill: no crop, no recompute
    with torch.no_grad():
        full = model(dec.tokens)[0]  # every position's logits over the whole sequence, dense masks
    generated = dec.tokens[:, 9:]
    assert all(len(set(row)) > 5 for row in generated.tolist())  # varied tokens: each depends on the window
    assert torch.equal(full[:, 8:-1].argmax(-1), generated)  # each generated token is the forward's argmax
    torch.testing.assert_close(dec.logits, full[:, -1], atol=1e-4, rtol=1e-4)
    assert size == 2 * (7 + 9 + 7) * 2 * 2 * 16 * 4  # k and v, slots, rows, heads, head dim, float32


def test_gpt_sample_goes_four_times_past_block_size_as_the_full_forward(tmp_path, capsys):
    """`gpt sample --max-new-tokens 4*block` from a windowed RoPE checkpoint: the greedy text of the dense masked
    forward over the whole sequence, from caches of the window only."""
    tok = CharTokenizer(CHARS)
    model = tiny(block=16, attention_window="6", global_tokens=1, vocab_size=tok.vocab_size)
    native.save(
        tmp_path / "best.pt", {"model": model.state_dict()}, native.build_meta(model.config.to_dict(), tok.spec)
    )
    argv = ["--ckpt", tmp_path, "--prompt", "abc", "--max-new-tokens", 64, "--temperature", 0, "--no-stop-at-eot"]
    assert sample.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    ids = tok.encode("abc")
    with torch.no_grad():
        for _ in range(64):  # the reference: every token from a forward over the whole sequence so far
            ids.append(model(torch.tensor([ids]))[0][0, -1, : tok.vocab_size].argmax().item())
    assert out.rstrip("\n") == tok.decode(ids) and len(set(ids[3:])) > 3


def test_the_static_step_past_block_size_equals_the_int_step():
    model = tiny(attention_window="6,full", global_tokens=1)  # the full layer rolls past block_size
    eager, _ = greedy(model, prompt(2, 7), 50, check=False)
    static, _ = greedy(model, prompt(2, 7), 50, graph=True, check=False)
    assert torch.equal(eager, static)


CHARS = "abcdefghijklmnopqrstuv"


def test_batch_engine_rows_of_different_lengths_equal_each_alone():
    """Right-padded prompts (shorter and longer than the window) prefilled together into per-row rings, then
    decoded together: each request gets the greedy tokens of the dense forward of its own sequence."""
    model = tiny(block=24, attention_window="5,full,4", global_tokens=1, vocab_size=len(CHARS) + 1)
    tok = CharTokenizer(CHARS)
    prompts = [prompt(1, n, seed=n)[0].remainder(len(CHARS)).tolist() for n in (3, 13, 8)]
    engine = BatchEngine(model, tok, max_rows=4)
    out = {}
    for i, ids in enumerate(prompts):
        cfg = SampleConfig(max_new_tokens=30, temperature=0, stop_at_eot=False)
        engine.submit(Request(ids, cfg, lambda piece, i=i: out.setdefault(i, []).extend(piece.ids)))
    while engine.busy:
        engine.step()
    for i, ids in enumerate(prompts):  # rope: past block_size the full layer rolls, so compare within it
        alone, _ = greedy(model, torch.tensor([ids]), 30, check=False)
        ref = alone[0, len(ids) :].tolist()
        assert out[i] == ref  # (past block_size both roll the full layer alike)
        within = 24 - len(ids)  # and within it, the dense forward's argmax
        seq = torch.tensor([ids + out[i][:within]])
        with torch.no_grad():
            assert model(seq)[0][0, len(ids) - 1 : -1].argmax(-1).tolist() == out[i][:within]
    assert len({t for ids in out.values() for t in ids}) > 5  # varied tokens
    assert [c.max_len for c in engine.pool.layers] == [6, 24, 5]  # per-row rings: W + G slots


def seq2seq(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=20, block_size=32, n_layer=2, n_encoder_layer=2, n_head=2, n_embd=32, untied_head=True)
    model = GPT(GPTConfig(**cfg | kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1.0)  # (varied greedy tokens, and beams that differ from them)
    return model.eval()


def test_beam_search_and_greedy_translation_through_the_ring():
    model = seq2seq(attention_window="4", global_tokens=1, pos_encoding="rope")
    src = torch.randint(0, 19, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(src, dtype=torch.bool)
    mask[1, 6:] = False
    run = dict(bos=19, eos=19, max_new_tokens=20, vocab_size=19)  # (the end token never chosen: 20 tokens each)
    greedy_ring = translate(model, src, mask, **run)
    assert greedy_ring == translate(model, src, mask, **run, use_cache=False)  # the dense masked forward
    assert [len(h) for h in greedy_ring] == [20] * 3  # 4x the ring
    beams = beam_search(model, src, mask, beam_size=3, **run)
    assert beams == beam_search(unbounded(model), src, mask, beam_size=3, **run)
    assert beams != greedy_ring and len(set(greedy_ring[0])) > 2
    assert all(c.ring and c.max_len == 5 for c in model.new_caches(2, 20))  # (translate's caches: max_len 20)


def test_int8_greedy_through_the_ring_equals_int8_without_it():
    model = quantize(tiny(attention_window="5,full,7", global_tokens=1, pos_encoding="learned"), "int8")
    ring, dec = greedy(model, prompt(2, 9), 30, check=False)
    plain, plain_dec = greedy(unbounded(model), prompt(2, 9), 30, check=False)
    assert torch.equal(ring, plain) and len(set(ring[0].tolist())) > 3
    assert rings(dec) == [6, 0, 8] and rings(plain_dec) == [0, 0, 0]


def compiled_twin(model: GPT, compiled: bool) -> GPT:
    twin = GPT.__new__(GPT)
    twin.__dict__ = dict(model.__dict__)
    twin.decode_step = AheadOfTimeStep(twin, compiled=compiled)
    return twin


@pytest.mark.parametrize(
    "compiled, rows",
    [(False, 2), (False, 1), pytest.param(True, 1, marks=pytest.mark.slow)],  # AOTInductor's compile: -m slow
    ids=["exported-module-2-rows", "exported-module-1-row", "compiled-1-row"],
)
def test_the_compiled_step_through_the_ring_equals_eager(compiled, rows, monkeypatch):
    """The exported step module run eagerly (fast), and compiled ahead of time once, for one row (one compile,
    about 20 s on a quiet machine): rings attended whole, the full layer over its written slots; within
    block_size equal to the dense forward, past it (the full layer rolls) to eager decoding."""
    monkeypatch.setenv("GPT_COMPILE_CACHE", "off")
    model = tiny(attention_window="5,full", global_tokens=2, n_layer=2)
    twin = compiled_twin(model, compiled)
    greedy(twin, prompt(rows, 9), 7)  # within block_size: each step's logits those of the dense forward
    step, dec = greedy(twin, prompt(rows, 9), 40, check=False)  # past it
    eager, _ = greedy(model, prompt(rows, 9), 40, check=False)
    assert dec.compiled is not None and torch.equal(eager, step) and len(set(step[0].tolist())) > 3
    assert [c.max_len for c in dec.caches] == [7, 16]


@pytest.mark.slow
def test_the_dynamo_step_through_the_ring_equals_eager():
    """torch.compile's step (CUDA's `--compile`, built here on the CPU): rings whole, the full layer's views marked
    dynamic; about 30 s of compiling on a busy 2-core machine, hence slow."""
    torch._dynamo.reset()
    try:
        model = tiny(attention_window="5,full", global_tokens=2, n_layer=2)
        twin = GPT.__new__(GPT)
        twin.__dict__ = dict(model.__dict__)
        twin.decode_step = DynamoStep(twin)
        greedy(twin, prompt(2, 9), 7)  # within block_size: the dense forward's logits
        step, _ = greedy(twin, prompt(2, 9), 40, check=False)
        assert torch.equal(step, greedy(model, prompt(2, 9), 40, check=False)[0])
    finally:
        torch._dynamo.reset()

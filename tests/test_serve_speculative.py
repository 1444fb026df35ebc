"""Speculative decoding in the batch engine (gpt/infer/speculative_batch.py, `gpt serve --speculate / --draft-ckpt`):
greedy text equal to plain serving's, token for token, for rows that join mid-way, slide past the block, stop at a
stop string or at max_tokens, with penalties and logprobs; sampled tokens from plain sampling's distribution
(counted); through the server with /health's acceptance; bad settings one line."""

import pytest
import torch

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.data.tokenizer import CharTokenizer
from gpt.infer.batching import BatchEngine
from gpt.infer.sampling import SampleConfig
from gpt.infer.speculative import probabilities
from gpt.infer.speculative_batch import Speculator
from gpt.serve import ServeError
from gpt.serve.config import ServeConfig
from tests.conftest import one_line_error, save_random_lm
from tests.test_batching import collect, run

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "ROMEO:\nWhat say you? What say you, ROMEO?\n"


@pytest.fixture(scope="module")
def trained(trained_run):
    return load_checkpoint(trained_run)


def batch(model, tok, speculator=None, rows=8, prefix_cache_bytes=0):
    """Greedy requests of different lengths and endings, one joining after a few steps: their outputs and the
    engine's steps."""
    engine = BatchEngine(model, tok, rows, speculator=speculator, prefix_cache_bytes=prefix_cache_bytes)
    greedy = {"temperature": 0, "stop_at_eot": False}
    block = model.config.block_size
    outs = [
        collect(engine, tok.encode(PROMPT), max_new_tokens=2 * block + 5, **greedy),  # slides past the block
        collect(engine, tok.encode("KING"), max_new_tokens=17, **greedy),  # ends at max_tokens
        collect(engine, tok.encode("ROMEO:\nWhat say"), max_new_tokens=60, stop=("the",), **greedy),
        collect(engine, tok.encode(PROMPT), max_new_tokens=40, repetition_penalty=1.3, frequency_penalty=0.2, **greedy),
    ]
    logprobs = collect(engine, tok.encode("JULIET:\nO"), max_new_tokens=30, **greedy)
    logprobs["request"].logprobs = 2
    scores = []
    emit = logprobs["request"].emit
    logprobs["request"].emit = lambda piece: (scores.extend(piece.logprobs or []), emit(piece))
    for _ in range(3):
        engine.step()
    outs.append(collect(engine, tok.encode("What say you"), max_new_tokens=50, **greedy))  # joins mid-way
    steps = run(engine)
    assert not prefix_cache_bytes or engine.prefix.hits  # the second copy of PROMPT loaded the first's prefix
    texts = [o["text"][0] for o in outs + [logprobs]]
    return texts, [o["finish"][0] for o in outs], scores, steps


@pytest.mark.parametrize("drafter", ["lookup", "draft", "itself", "lookup, prefix cache"])
def test_greedy_text_is_plain_servings(trained, drafter):
    model, tok, _ = trained
    cache = 1 << 20 if "prefix" in drafter else 0  # rows that load a prefix speculate from it
    plain, finishes, scores, plain_steps = batch(model, tok, prefix_cache_bytes=cache)
    assert finishes == ["length", "length", "stop", "length", "length"]
    torch.manual_seed(0)
    small = GPT(GPTConfig(**{**model.config.to_dict(), "n_layer": 1, "n_embd": 32, "n_head": 2})).eval()
    draft = {"draft": small, "itself": model}.get(drafter)
    speculator = Speculator(k=6 if draft is None else 3, draft=draft)
    fast, _, fast_scores, steps = batch(model, tok, speculator, prefix_cache_bytes=cache)
    assert fast == plain
    assert [s.id for s in fast_scores] == [s.id for s in scores]  # logprobs of the same tokens, equal up to rounding
    for a, b in zip(fast_scores, scores):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.top.keys() == b.top.keys()
    stats = speculator.stats
    assert stats.drafted > 50 and stats.kept > 0 and steps < plain_steps  # guesses were kept: fewer steps
    if drafter == "itself":  # the model as its own draft: every guess is kept
        assert stats.kept == stats.drafted


def test_a_rope_batch_past_its_block_gives_plain_servings_greedy_text():
    """Rows whose cache rolls (RoPE past block_size) take their tokens from the plain forward beside the others."""
    tok = CharTokenizer("abcdefgh \n")
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, pos_encoding="rope")
    model = GPT(cfg).eval()
    with torch.no_grad():  # larger weights: a text that changes (random small ones repeat one letter)
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)

    def texts(speculator=None):
        engine = BatchEngine(model, tok, 4, speculator=speculator)
        greedy = {"temperature": 0, "stop_at_eot": False}
        outs = [collect(engine, tok.encode(p), max_new_tokens=n, **greedy) for p, n in (("abc abd abe", 70), ("h", 30))]
        run(engine)
        return [o["text"][0] for o in outs]

    speculator = Speculator(4)
    assert texts(speculator) == texts()
    assert speculator.stats.kept > 20


def test_rows_of_two_lora_adapters_speculate_each_with_its_own():
    """Adapters side by side (`gpt serve --lora`): each row's guesses are checked with its own adapter, in both the
    speculative forward and the plain one of the rows near their block's end."""
    import copy

    from gpt.model import lora
    from gpt.model.config import LoRAConfig

    tok = CharTokenizer("abcdefgh \n")
    torch.manual_seed(5)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    adapted = copy.deepcopy(model)
    lora.apply(adapted, LoRAConfig(rank=4))
    with torch.no_grad():
        for m in adapted.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_B.normal_(0, 0.5)
    lora.serve_side_by_side(model, [adapted])

    def texts(speculator=None):
        engine = BatchEngine(model, tok, 4, speculator=speculator)
        greedy = {"temperature": 0, "stop_at_eot": False, "max_new_tokens": 45}
        outs = [collect(engine, tok.encode(p), **greedy) for p in ("abc abd abe", "abc abd abe", "hag hag")]
        outs[1]["request"].adapter = outs[2]["request"].adapter = 1
        run(engine)
        return [o["text"][0] for o in outs]

    speculator = Speculator(4)
    plain = texts()
    assert texts(speculator) == plain and plain[0] != plain[1]  # (the adapter changes the text)
    assert speculator.stats.kept > 10


def exact_third(model, tok, prompt, cfg):
    """The distribution of the third sampled token, summed over every first and second one."""
    out = torch.zeros(tok.vocab_size)
    V = tok.vocab_size
    with torch.no_grad():
        for first in range(V):
            for second in range(V):
                ids = prompt + [first, second]
                logits = model(torch.tensor([ids]))[0][0, :, :V].float()
                n = len(prompt)
                path = probabilities(logits[n - 1], cfg, prompt, 0)[first]
                path *= probabilities(logits[n], cfg, prompt + [first], 1)[second]
                out += path * probabilities(logits[n + 1], cfg, ids, 2)
    return out


def test_sampled_tokens_have_plain_samplings_distribution():
    tok = CharTokenizer("abcd")
    torch.manual_seed(1)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model, draft = GPT(cfg).eval(), GPT(cfg).eval()
    prompt, n = tok.encode("abab"), 1536  # samples of each run, in requests of 64 rows
    settings = {"max_new_tokens": 4, "temperature": 1.0, "top_k": None, "num_samples": 64, "stop_at_eot": False}
    exact = exact_third(model, tok, prompt, SampleConfig(**settings))

    def third_tokens(speculator):
        engine = BatchEngine(model, tok, 64, speculator=speculator)
        counts = torch.zeros(tok.vocab_size)
        for seed in range(n // 64):
            ids = {}
            out = collect(engine, prompt, seed=seed, **settings)
            emit = out["request"].emit
            out["request"].emit = lambda piece, emit=emit, ids=ids: (
                ids.setdefault(piece.sample, []).extend(piece.ids),
                emit(piece),
            )
            run(engine)
            for row in ids.values():
                counts[row[2]] += 1
        return counts / n

    # total variation of n = 1536 draws from a 5-id distribution against it: ~0.03 typical; 0.06 a wide bound
    assert (third_tokens(None) - exact).abs().sum() / 2 < 0.06  # (the bound holds for plain sampling)
    for speculator in (Speculator(2), Speculator(2, draft=draft)):
        assert (third_tokens(speculator) - exact).abs().sum() / 2 < 0.06
        assert speculator.stats.drafted > 500 and 0 < speculator.stats.kept < speculator.stats.drafted


def test_the_server_speculates_with_plain_servings_text_and_says_how_well(trained_run, trained):
    httpx = pytest.importorskip("httpx")
    from gpt.serve.app import create_app, running

    model, tok, meta = trained
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 80, "temperature": 0}
    texts, healths = [], []
    for config in (ServeConfig(model_name="m"), ServeConfig(model_name="m", speculate=5)):
        with running(create_app(model, tok, meta, config)) as url:
            texts.append(httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
            healths.append(httpx.get(url + "/health").json())
    assert texts[0] == texts[1] and len(texts[0]) == 80
    assert "speculation" not in healths[0]
    spec = healths[1]["speculation"]
    assert spec["k"] == 5 and spec["drafter"] == "prompt lookup" and spec["drafted"] > 0
    assert spec["acceptance"] == pytest.approx(spec["kept"] / spec["drafted"], abs=1e-4)
    config = ServeConfig(model_name="m", speculate=3, draft_ckpt=str(trained_run))  # the model as its own draft
    with running(create_app(model, tok, meta, config)) as url:
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == texts[0]
        sampled = {**body, "temperature": 0.8, "n": 3, "seed": 1, "stop": ["\n\n"], "logprobs": 1}
        answer = httpx.post(url + "/v1/completions", json=sampled, timeout=60).json()
        spec = httpx.get(url + "/health").json()["speculation"]
    assert spec["drafter"] == "draft model" and spec["drafted"] > 0
    for choice in answer["choices"]:  # every choice whole: its tokens' logprobs, ended at the stop or max_tokens
        tokens = choice["logprobs"]["tokens"]
        assert len(tokens) == 80 if choice["finish_reason"] == "length" else choice["finish_reason"] == "stop"
        assert "\n\n" not in choice["text"] and len(choice["logprobs"]["token_logprobs"]) == len(tokens)


def test_bad_settings_are_one_line(trained_run, trained, tmp_path, capsys):
    from gpt.cli import serve as serve_cli
    from gpt.serve.service import Service

    base = ["--ckpt", str(trained_run), "--port", "0", "--device", "cpu"]
    assert ">= 1" in one_line_error(capsys, serve_cli.main, *base, "--speculate", "0")
    assert "from 1 to 32" in one_line_error(capsys, serve_cli.main, *base, "--speculate", "33")
    other = save_random_lm(tmp_path / "other", "xyz")
    assert "another tokenizer" in one_line_error(capsys, serve_cli.main, *base, "--draft-ckpt", other)
    with pytest.raises(ServeError, match="needs --speculate"):
        ServeConfig(model_name="m", draft_ckpt=str(trained_run))
    model, tok, meta = trained
    windowed = GPT(GPTConfig(**{**model.config.to_dict(), "attention_window": "8,full"})).eval()
    with pytest.raises(ServeError, match="windowed"):
        Service(windowed, tok, meta, ServeConfig(model_name="m", speculate=4))
    with pytest.raises(ServeError, match="do not fit a block of 16"):
        Service(*load_checkpoint(other), ServeConfig(model_name="m", speculate=15))

"""The completions API's logprobs and echo (what lm-evaluation-harness scores with), and the tokenizer
routes its remote tokenizer reads, through the official `openai` client on loopback."""

import math

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install -e '.[dev]'")
import httpx  # noqa: E402  (installed with openai)

from gpt import GPT, GPTConfig, load_checkpoint  # noqa: E402
from gpt.data.tokenizer import CharTokenizer  # noqa: E402
from gpt.infer.batching import BatchEngine, Request  # noqa: E402
from gpt.infer.sampling import SampleConfig  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

NAME = "shakespeare-char"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded(trained_run):
    return load_checkpoint(trained_run)


@pytest.fixture(scope="module")
def server(loaded):
    model, tok, meta = loaded
    with running(create_app(model, tok, meta, ServeConfig(model_name=NAME, max_batch=8))) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def by_hand(model, ids: list[int], vocab: int) -> torch.Tensor:
    """log-softmax of one full forward over `ids`, the tokenizer's ids only: (T, vocab)."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return torch.log_softmax(logits[0, :, :vocab].float(), dim=-1)


def test_echo_returns_every_prompt_token_with_its_logprob_as_lm_eval_asks(client, loaded):
    model, tok, _ = loaded
    texts = ["ROMEO: what light", "To be, or not"]
    ids = [tok.encode(t) for t in texts]
    # lm-eval's loglikelihood request, several prompts of token ids at once
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    for choice, prompt, text in zip(r.choices, ids, texts):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1 and "".join(lp.tokens[:-1]) == text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = by_hand(model, prompt, tok.vocab_size)
        expected = [want[t, prompt[t + 1]].item() for t in range(len(prompt) - 1)]
        assert lp.token_logprobs[1:-1] == pytest.approx(expected, abs=1e-4)
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        for t in range(1, len(prompt)):  # the most likely token, and the token itself
            top = lp.top_logprobs[t]
            best = want[t - 1].argmax().item()
            assert top[tok.decode([best])] == pytest.approx(want[t - 1, best].item(), abs=1e-4)
            assert top[lp.tokens[t]] == pytest.approx(lp.token_logprobs[t], abs=1e-6)
        assert choice.text.startswith(text)


def test_max_tokens_0_scores_the_prompt_only_with_top_n(client, loaded):
    model, tok, _ = loaded
    r = client.completions.create(model=NAME, prompt="First Citizen", max_tokens=0, logprobs=5, echo=True)
    (choice,) = r.choices
    assert choice.text == "First Citizen" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len("First Citizen")
    want = by_hand(model, tok.encode("First Citizen"), tok.vocab_size)
    for t in range(1, len(lp.tokens)):
        top5 = want[t - 1].topk(5)
        assert set(lp.top_logprobs[t]) >= {tok.decode([i]) for i in top5.indices.tolist()}
        assert len(lp.top_logprobs[t]) in (5, 6)  # the token itself joins when it is not among the 5


def test_generated_logprobs_are_the_raw_distribution_not_the_sampling_temperature(client, loaded):
    model, tok, _ = loaded
    r = client.completions.create(model=NAME, prompt="KING:", max_tokens=8, logprobs=2, temperature=0.5, seed=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 8
    ids = tok.encode("KING:" + r.choices[0].text)
    want = by_hand(model, ids, tok.vocab_size)
    n = len(tok.encode("KING:"))
    expected = [want[n - 1 + j, ids[n + j]].item() for j in range(8)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert sum(math.exp(v) for v in lp.top_logprobs[0].values()) < 1 + 1e-4


def test_prompt_scoring_is_one_batched_prefill_over_the_real_vocabulary():
    tok = CharTokenizer("abcdefgh ")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size + 6, block_size=16, n_layer=1, n_head=2, n_embd=16))  # padded
    engine = BatchEngine(model, tok, max_rows=4)
    got = []
    prompts = [tok.encode(t) for t in ("abc def", "hhh", "a b c d e f g h")]
    for ids in prompts:
        config = SampleConfig(max_new_tokens=1, temperature=0)
        engine.submit(Request(ids, config, got.append, logprobs=0, echo=True, generate=False))
    engine.step()
    assert engine.steps == 1 and not engine.busy and len(got) == 3  # one step, and the rows are free again
    for piece, ids in zip(got, prompts):
        assert piece.ids == [] and piece.finish == "length"
        want = by_hand(model, ids, tok.vocab_size)  # the padded rows' logits left out
        expected = [want[t, ids[t + 1]].item() for t in range(len(ids) - 1)]
        assert [e.logprob for e in piece.logprobs[1:]] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="at most 16 ids"):
        engine.submit(Request([1] * 17, SampleConfig(max_new_tokens=1), got.append, logprobs=0, echo=True))


@pytest.mark.parametrize(
    "kwargs,param,words",
    [
        (dict(max_tokens=0, echo=False, logprobs=1), "max_tokens", "needs 'echo': true"),
        (dict(max_tokens=0, echo=True, stream=True), "max_tokens", "is not streamed"),
        (dict(max_tokens=1, echo=True, logprobs=21), "logprobs", "less than or equal to 20"),
        (dict(prompt="x" * 65, echo=True, logprobs=1), "prompt", "more than this server's limit of 64"),
        (dict(prompt=[0, 66], echo=True, logprobs=1), "prompt", "ids must be in [0, 66)"),
    ],
)
def test_scoring_mistakes_are_openai_errors(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": NAME, "prompt": "ROMEO:", **kwargs})
    assert e.value.param == param and words in e.value.message, e.value.message


def test_tokenizer_routes_as_lm_eval_reads_them(server, loaded):
    _, tok, _ = loaded
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 64
    ids = httpx.post(server + "/tokenize", json={"prompt": "ROMEO:", "add_special_tokens": False}).json()["tokens"]
    assert ids == tok.encode("ROMEO:")
    eos = httpx.post(server + "/tokenize", json={"prompt": info["eos_token"] + "O"}).json()["tokens"]
    assert eos == [tok.eot_token, *tok.encode("O")]  # lm-eval's end-of-text id is tokenize(eos_token)[0]
    assert httpx.post(server + "/detokenize", json={"tokens": ids}).json() == {"prompt": "ROMEO:"}
    bad = httpx.post(server + "/detokenize", json={"tokens": [10_000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(server + "/tokenize", json={"prompt": "naïve €"})
    assert bad.status_code == 400 and "not in the char vocabulary" in bad.json()["error"]["message"]


def test_echo_with_max_tokens_0_and_no_logprobs_returns_the_prompt(client):
    r = client.completions.create(model=NAME, prompt=["ROMEO:", "KING"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in r.choices] == ["ROMEO:", "ROMEO:", "KING", "KING"]
    assert all(c.logprobs is None and c.finish_reason == "length" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (10, 0)

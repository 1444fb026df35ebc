import json
import time

import pytest
from conftest import SHARED_DATA

from gpt.data.bpe import byte_level_alphabet, merges_to_ranks, train_bpe
from gpt.data.tokenizer import get_tokenizer

SAMPLES = [
    "Hello, world!",
    "Crème brûlée à la française",
    "東京は日本の首都です",
    "emoji 🙂🚀👩‍👩‍👧",
    "  \n\n\tx",
    "<|endoftext|>",
]


@pytest.fixture(scope="module")
def corpus() -> str:
    return (SHARED_DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000]


@pytest.fixture(scope="module")
def trained(corpus):
    return train_bpe([corpus[i : i + 50_000] for i in range(0, len(corpus), 50_000)], vocab_size=512)


def test_alphabet_is_hf_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    table = byte_level_alphabet()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == 65 and table["Ġ"] == 32 and table["Ċ"] == 10  # space and newline are shifted


def test_ranks_are_dense_bytes_first_then_merges(trained):
    ranks = trained.enc._mergeable_ranks
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert trained.vocab_size == len(ranks) + 1 == 512
    assert trained.eot_token == len(ranks)
    # every merged token is the concatenation of two tokens of lower rank
    by_rank = sorted(ranks, key=ranks.get)
    for token in by_rank[256:]:
        assert any(
            token[:i] in ranks and token[i:] in ranks and max(ranks[token[:i]], ranks[token[i:]]) < ranks[token]
            for i in range(1, len(token))
        )


@pytest.mark.parametrize("text", SAMPLES)
def test_tiktoken_round_trips_any_text(trained, text):
    assert trained.decode(trained.encode(text)) == text


def test_tiktoken_tokenizes_exactly_as_the_hf_model(corpus):
    """The converted ranks replay HF's merges: same token boundaries on seen and unseen text."""
    from gpt.data.bpe import hf_merges, train_hf_bpe
    from gpt.data.tokenizer import bpe_tokenizer

    hf = train_hf_bpe([corpus], vocab_size=400)
    tok = bpe_tokenizer(merges_to_ranks(hf_merges(hf)))
    alphabet = byte_level_alphabet()
    unseen = (SHARED_DATA / "wikitext2-valid.txt").read_text(encoding="utf-8")[:50_000] + "".join(SAMPLES)
    for text in (corpus[:50_000], unseen):
        theirs = [bytes(alphabet[c] for c in t) for t in hf.encode(text).tokens]
        ours = [tok.enc.decode_single_token_bytes(i) for i in tok.encode(text)]
        assert ours == theirs


def test_duplicate_merge_keeps_ranks_dense():
    # "abc" can be made as "ab"+"c" and as "a"+"bc": the second merge adds nothing.
    ranks = merges_to_ranks([("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc"), ("c", "c")])
    assert ranks[b"bc"] == 256 and ranks[b"ab"] == 257 and ranks[b"abc"] == 258 and ranks[b"cc"] == 259
    assert sorted(ranks.values()) == list(range(260))


def test_spec_is_self_contained(trained):
    rebuilt = get_tokenizer(json.loads(json.dumps(trained.spec)))
    text = "To be, or not to be: that is the question."
    assert rebuilt.encode(text) == trained.encode(text) and rebuilt.vocab_size == 512


def test_vocab_too_small():
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(["abc"], vocab_size=256)


def test_a_long_whitespace_run_trains_in_seconds(corpus):
    """HF's trainer is quadratic in a word's length: a 400,000-space run took minutes before it was cut."""
    start = time.perf_counter()
    tok = train_bpe([corpus[:50_000] + " " * 400_000 + "\n" * 300_000 + corpus[50_000:100_000]], vocab_size=300)
    assert time.perf_counter() - start < 20
    assert tok.decode(tok.encode(" " * 400_000 + "x")) == " " * 400_000 + "x"

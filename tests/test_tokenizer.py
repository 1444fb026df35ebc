import json
import re

import pytest
from conftest import SHAKESPEARE

from gpt.data.tokenizer import (
    MAX_WHITESPACE_RUN,
    CharTokenizer,
    SpecialsTokenizer,
    StreamDecoder,
    TokenizerError,
    bpe_tokenizer,
    dump_ranks,
    get_tokenizer,
    safe_pieces,
)

SAMPLES = ["Hello, world!", "Crème brûlée à la française", "東京は日本の首都です", "emoji 🙂🚀👩‍👩‍👧", ""]


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer("gpt2")


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257 and gpt2.eot_token == 50256
    assert gpt2.decode([gpt2.eot_token]) == "<|endoftext|>"


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trips(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text
    char = CharTokenizer.from_text("".join(SAMPLES))
    assert char.decode(char.encode(text)) == text


@pytest.mark.parametrize("n", [0, 1, 64, 65, 1001])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_encode_batch_equals_encoding_each_text_in_order(gpt2, n, threads):
    texts = [f"{SAMPLES[i % len(SAMPLES)]} {i}" * (i % 7) for i in range(n)]  # uneven lengths, empty ones too
    assert gpt2.encode_batch(texts, num_threads=threads) == [gpt2.encode(t) for t in texts]


def test_split_multibyte_character_decodes_with_replacement_and_streams(gpt2):
    ids = gpt2.encode("🚀")
    assert len(ids) > 1  # the emoji's 4 bytes span several tokens
    assert "\ufffd" in gpt2.decode(ids[:1])  # a cut character never raises
    stream = StreamDecoder(gpt2)
    pieces = [stream.push([i]) for i in gpt2.encode("a🚀b東")] + [stream.flush()]
    assert "".join(pieces) == "a🚀b東"
    assert "\ufffd" not in "".join(pieces)


def test_stream_decoder_flushes_an_incomplete_tail(gpt2):
    stream = StreamDecoder(gpt2)
    assert stream.push(gpt2.encode("🚀")[:1]) == ""
    assert stream.flush() == "\ufffd"


def test_char_spec_round_trips_through_json():
    tok = CharTokenizer.from_text("hello wörld\n")
    rebuilt = get_tokenizer(json.loads(json.dumps(tok.spec)))
    assert rebuilt.encode("wörld") == tok.encode("wörld")
    assert rebuilt.vocab_size == tok.vocab_size == len(set("hello wörld\n")) + 1
    assert rebuilt.eot_token == tok.eot_token


def test_char_unknown_character_is_an_error():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="not in the char vocabulary: 'z'"):
        tok.encode("abz")


def test_bpe_spec_round_trips_through_json(gpt2):
    from gpt.data.tokenizer import bpe_tokenizer

    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"he"] = 256
    ranks[b"hel"] = 257
    tok = bpe_tokenizer(ranks)
    assert tok.encode("hello") == [257, ord("l"), ord("o")]
    rebuilt = get_tokenizer(json.loads(json.dumps(tok.spec)))
    assert rebuilt.encode("hello") == [257, ord("l"), ord("o")] and rebuilt.eot_token == 258


@pytest.fixture
def offline(monkeypatch):
    """No GPT2_TIKTOKEN_FILE and no network: tiktoken cannot get GPT-2's ranks."""
    import tiktoken

    monkeypatch.delenv("GPT2_TIKTOKEN_FILE", raising=False)

    def no_network(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)


def test_missing_gpt2_file_error_names_both_ways_out(offline, tmp_path):
    with pytest.raises(TokenizerError) as e:
        get_tokenizer("gpt2")
    assert "GPT2_TIKTOKEN_FILE" in str(e.value) and "internet" in str(e.value)
    with pytest.raises(TokenizerError, match="nope.tiktoken"):
        get_tokenizer("gpt2", ranks_file=str(tmp_path / "nope.tiktoken"))


def test_offline_hint_offers_tokenizer_file_only_where_the_script_has_it(offline, tmp_path):
    from gpt.data.format import DataError
    from gpt.data.pairs import make_tokenizer
    from gpt.data.prepare import prepare

    with pytest.raises(TokenizerError) as e:  # train.py and sample.py build it this way: they have no such flag
        get_tokenizer({"kind": "gpt2"})
    assert "set GPT2_TIKTOKEN_FILE=/path/to/gpt2.tiktoken (a local ranks file)" in str(e.value)
    assert "--tokenizer-file" not in str(e.value)
    (tmp_path / "c.txt").write_text("some text\n" * 100)
    for build in (
        lambda: prepare([tmp_path / "c.txt"], tmp_path / "ds", "gpt2", progress=False),
        lambda: make_tokenizer("gpt2", []),
    ):  # data/prepare.py, text and --pairs
        with pytest.raises(DataError) as e:
            build()
        assert (
            "set GPT2_TIKTOKEN_FILE=/path/to/gpt2.tiktoken or pass --tokenizer-file /path/to/gpt2.tiktoken "
            "(a local ranks file)"
        ) in str(e.value)
    assert not list(tmp_path.glob("*ds*"))


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"First Citizen:\nBefore we proceed any further, hear me speak.\n", "line 1 is not `base64-token rank`"),
        (b"IQ== 0\nIg== one\n", "line 2 is not `base64-token rank`"),
        (b"IQ== 0\nIg== 1\n", "it lacks some of the 256 single bytes every byte-level BPE ranks first"),
        (b"", "it lacks some of the 256 single bytes"),
    ],
)
def test_a_file_that_is_not_a_ranks_file_names_the_file_and_where_it_came_from(monkeypatch, tmp_path, content, problem):
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(content)
    with pytest.raises(TokenizerError) as e:
        get_tokenizer("gpt2", ranks_file=str(bad))
    assert str(e.value).startswith(f"{bad} (from ranks_file) is not a tiktoken ranks file: {problem}")
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(bad))
    with pytest.raises(TokenizerError) as e:
        get_tokenizer("gpt2")
    assert str(e.value).startswith(f"{bad} (from GPT2_TIKTOKEN_FILE) is not a tiktoken ranks file: {problem}")
    assert str(e.value).endswith("; point GPT2_TIKTOKEN_FILE at GPT-2's ranks file, gpt2.tiktoken")


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        get_tokenizer({"kind": "sentencepiece"})


# ---- any text encodes: tiktoken's limit on a whitespace run ------------------------------------------------

LIMIT = MAX_WHITESPACE_RUN


@pytest.fixture(scope="module")
def kinds(gpt2):
    """Every tokenizer kind, each able to encode whitespace and 'x' (own BPE: GPT-2's ranks, rebuilt as a bpe)."""
    bpe = bpe_tokenizer(dict(gpt2.enc._mergeable_ranks))
    char = CharTokenizer.from_text(" \n\t\u3000xyz.")
    return {"gpt2": gpt2, "bpe": bpe, "char": char, "specials": SpecialsTokenizer(gpt2, ["<|user|>", "<|end|>"])}


def test_tiktoken_still_panics_just_past_the_run_limit(gpt2):
    """The constant is tiktoken's real limit: one more whitespace character and tiktoken itself panics."""
    assert len(gpt2.enc.encode_ordinary("x" + " " * LIMIT + "x")) > 0
    with pytest.raises(BaseException) as caught:
        gpt2.enc.encode_ordinary("x" + " " * (LIMIT + 1) + "x")
    assert type(caught.value).__name__ == "PanicException"


@pytest.mark.parametrize(
    "text",
    [
        " " * LIMIT + "word",  # the longest run tiktoken encodes, then a word the last space joins
        "a\n" + "\n" * (LIMIT - 1) + "b" + "\u3000" * LIMIT,  # just under, at the start, middle and end
        ("Hello, wörld!  \t\n" * 40_000) + " \t\n" * (LIMIT // 3 - 2) + "東京 🙂 x" * 1000,  # mixed text around a run
        "\x1c" * (LIMIT + 5) + " x",  # not White_Space to tiktoken (Python's \s says it is): never cut
    ],
)
def test_text_tiktoken_encodes_whole_gets_exactly_its_ids(gpt2, text):
    assert safe_pieces(text) == [text]
    assert gpt2.encode(text) == gpt2.enc.encode_ordinary(text)
    assert gpt2.encode_to_numpy(text).tolist() == gpt2.enc.encode_ordinary(text)


def test_safe_pieces_cut_only_inside_runs_longer_than_the_limit():
    text = "abc " + " " * (2 * LIMIT + 10) + "def\n" + "\n" * 50 + "\t" * (LIMIT + 1)
    pieces = safe_pieces(text)
    assert "".join(pieces) == text
    assert len(pieces) == 4
    assert pieces[0] == "abc " + " " * (LIMIT - 1) and pieces[-1] == "\t" * 52  # the run from "def\n" on
    assert all(len(max(re.findall(r"[ \t\n]+", p), key=len)) <= LIMIT for p in pieces)


@pytest.mark.parametrize("kind", ["gpt2", "bpe", "char", "specials"])
def test_any_text_encodes_whatever_its_whitespace_runs(kinds, kind):
    tok = kinds[kind]
    text = "x" + " " * 1_100_000 + "y" + "\n\t\u3000" * 400_000 + "z."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch(["x", text]) == [tok.encode("x"), ids]


# ---- the pre-tokenizer pattern a spec names: GPT-2's only ------------------------------------------------

SLOW = r"((a+)+)\1b|."  # tiktoken's backtracking engine: 20,000 characters of "a" take seconds to encode
EMPTY = r"(?<=a)"  # a lone lookbehind matches empty text: tiktoken panics on every encode
BYTES = dump_ranks({bytes([b]): b for b in range(256)})


@pytest.mark.parametrize("pattern", [SLOW, EMPTY])
def test_a_spec_naming_a_pattern_gpt_does_not_know_builds_no_tokenizer(pattern):
    for spec in (
        {"kind": "bpe", "pattern": pattern, "ranks": BYTES},
        {"kind": "specials", "base": {"kind": "bpe", "pattern": pattern, "ranks": BYTES}, "specials": ["<|end|>"]},
    ):
        with pytest.raises(TokenizerError, match=r"^the bpe tokenizer spec: pre-tokenizer pattern '.*' is not one gpt"):
            get_tokenizer(spec)


def test_gpt2s_pattern_splits_alike_in_each_spelling_a_file_may_carry(gpt2):
    """The known patterns are GPT-2's as gpt, tiktoken and Hugging Face's ByteLevel (use_regex) write it: the
    same ids from GPT-2's ranks, the same words as ByteLevel's own regex splits."""
    import tiktoken_ext.openai_public
    from tokenizers import Regex, pre_tokenizers

    from gpt.data.tokenizer import KNOWN_PATTERNS

    assert tiktoken_ext.openai_public.r50k_pat_str in KNOWN_PATTERNS
    text = (
        SHAKESPEARE.read_text(encoding="utf-8")[:50_000]
        + "".join(SAMPLES)
        + " 'll 've 're 's 'd 'm 't 'x '\n\n  a\t\t\n b   "
    )
    words = [at for _, at in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)]
    ranks = dict(gpt2.enc._mergeable_ranks)
    for pattern in KNOWN_PATTERNS:
        assert get_tokenizer(bpe_tokenizer(ranks, pattern).spec).encode(text) == gpt2.encode(text)
        assert [at for _, at in pre_tokenizers.Split(Regex(pattern), "isolated").pre_tokenize_str(text)] == words

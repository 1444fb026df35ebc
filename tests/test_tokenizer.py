import json

import pytest

from gpt.tokenizer import CharTokenizer, StreamDecoder, TokenizerError, get_tokenizer

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
    from gpt.tokenizer import bpe_tokenizer

    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"he"] = 256
    ranks[b"hel"] = 257
    tok = bpe_tokenizer(ranks)
    assert tok.encode("hello") == [257, ord("l"), ord("o")]
    rebuilt = get_tokenizer(json.loads(json.dumps(tok.spec)))
    assert rebuilt.encode("hello") == [257, ord("l"), ord("o")] and rebuilt.eot_token == 258


def test_missing_gpt2_file_error_names_both_ways_out(monkeypatch, tmp_path):
    import tiktoken

    monkeypatch.delenv("GPT2_TIKTOKEN_FILE", raising=False)

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(TokenizerError) as e:
        get_tokenizer("gpt2")
    assert "GPT2_TIKTOKEN_FILE" in str(e.value) and "internet" in str(e.value)
    with pytest.raises(TokenizerError, match="nope.tiktoken"):
        get_tokenizer("gpt2", ranks_file=str(tmp_path / "nope.tiktoken"))


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        get_tokenizer({"kind": "sentencepiece"})

"""Structured outputs: response_format (json_object, json_schema), regex and grammar on both routes, through the
official openai client, every answer validated with `jsonschema`; `gpt sample --json-schema / --grammar / --regex`.
The model is a tiny random one on GPT-2's vocabulary: what it would say freely is noise, so every valid answer is
the constraint's doing."""

import json
import re

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("llguidance", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install -e '.[dev]'")
jsonschema = pytest.importorskip("jsonschema", reason="the dev extra is not installed: pip install -e '.[dev]'")

from gpt import GPT, GPTConfig  # noqa: E402
from gpt.cli import sample as sample_cli  # noqa: E402
from gpt.data.tokenizer import get_tokenizer  # noqa: E402
from gpt.infer.constrain import Grammar, GrammarError  # noqa: E402
from gpt.infer.sampling import complete  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402
from tests.conftest import SHARED_DATA, one_line_error  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt2_tok():
    path = SHARED_DATA / "gpt2.tiktoken"
    if not path.is_file():
        pytest.skip(f"GPT-2's BPE file is not at {path}")
    return get_tokenizer("gpt2", str(path))


@pytest.fixture(scope="module")
def random_model(gpt2_tok):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=gpt2_tok.vocab_size, block_size=256, n_layer=1, n_head=2, n_embd=32)
    return GPT(cfg).eval()


@pytest.fixture(scope="module")
def client(random_model, gpt2_tok):
    meta = {"model_config": random_model.config.to_dict(), "tokenizer": gpt2_tok.spec}
    app = create_app(random_model, gpt2_tok, meta, ServeConfig(model_name="tiny", max_batch=10, max_tokens=200))
    with running(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_answers_always_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    answers = []
    for seed in range(10):  # 100 seeded samples, 10 rows decoded together at a time
        r = client.completions.create(
            model="tiny",
            prompt="A person:",
            max_tokens=120,
            temperature=1.0,
            n=10,
            seed=seed,
            extra_body={"response_format": fmt},
        )
        answers += r.choices
    assert len(answers) == 100
    for choice in answers:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in answers}) > 50  # sampled, not one answer
    again = client.completions.create(
        model="tiny",
        prompt="A person:",
        max_tokens=120,
        temperature=1.0,
        n=10,
        seed=9,
        extra_body={"response_format": fmt},
    )
    assert [c.text for c in again.choices] == [c.text for c in answers[90:]]  # seeded: reproducible


def test_json_object_regex_and_grammars(client, random_model, gpt2_tok):
    closing = {str(gpt2_tok.encode(t)[0]): 8 for t in ('"', "}", '"}', '":', "1")}  # a random model's strings end
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=60,
        temperature=1.0,
        n=5,
        seed=1,
        logit_bias=closing,
        extra_body={"response_format": {"type": "json_object"}},
    )
    done = [c for c in r.choices if c.finish_reason == "stop"]  # an object of free keys may run to max_tokens
    assert done and all(isinstance(json.loads(c.text), dict) for c in done)
    r = client.completions.create(
        model="tiny", prompt="x", max_tokens=20, temperature=1.0, n=5, seed=2, extra_body={"regex": "[0-9]{3}-[a-z]{2}"}
    )
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c.text) for c in r.choices), [c.text for c in r.choices]
    for grammar in ('start: "yes" | "no" | "maybe"', 'root ::= "yes" | "no" | "maybe"'):  # Lark, then GBNF
        r = client.completions.create(
            model="tiny", prompt="x", max_tokens=10, temperature=1.0, n=8, seed=3, extra_body={"grammar": grammar}
        )
        assert {c.text for c in r.choices} <= {"yes", "no", "maybe"}
    stream = client.completions.create(
        model="tiny", prompt="x", max_tokens=20, temperature=0, stream=True, extra_body={"regex": "(ab|cd){2,4}"}
    )
    text = "".join(c.choices[0].text for c in stream)
    assert re.fullmatch("(ab|cd){2,4}", text), text
    free = complete(random_model, gpt2_tok, "x", max_new_tokens=20, temperature=0, top_k=None)[0]
    assert not re.fullmatch("(ab|cd){2,4}", free)  # without it, the model says something else


@pytest.mark.parametrize(
    "fields,param,words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
            "Invalid 'response_format'",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such-format"}},
                }
            },
            "response_format",
            "no-such-format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs its 'json_schema'"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "Invalid value"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "response_format", "send one of them"),
        ({"regex": "a(b"}, "regex", "Invalid 'regex'"),
        ({"grammar": "start: undefined_rule"}, "grammar", "Invalid 'grammar'"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_up_front(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=fields)
    assert e.value.param == param and words in e.value.message, e.value.message


def test_a_grammar_the_vocabulary_cannot_spell_fails_that_request_alone(trained_run):
    from gpt import load_checkpoint

    model, tok, meta = load_checkpoint(trained_run)  # shakespeare's characters: no braces
    with running(create_app(model, tok, meta, ServeConfig(model_name="c", max_batch=4))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model="c", prompt="A", max_tokens=5, extra_body={"response_format": {"type": "json_object"}}
            )
        assert "no token for what the grammar needs next" in e.value.message
        ok = client.completions.create(model="c", prompt="A", max_tokens=8, extra_body={"regex": "[a-z]{4}"})
        assert re.fullmatch("[a-z]{4}", ok.choices[0].text)


def test_sample_cli_takes_a_schema_a_grammar_or_a_regex(trained_run, tmp_path, capsys):
    args = ["--ckpt", str(trained_run), "--prompt", "A", "--max-new-tokens", "30", "--device", "cpu", "--seed", "1"]
    assert sample_cli.main([*args, "--regex", "[a-z]{3} [a-z]{2,5}"]) == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch("A[a-z]{3} [a-z]{2,5}", out), out
    lark = tmp_path / "yes.lark"
    lark.write_text('start: "yes" | "no"\n')
    assert sample_cli.main([*args, "--grammar", str(lark), "--num-samples", "4"]) == 0
    texts = [t.strip() for t in capsys.readouterr().out.split("---------------")]
    assert {t for t in texts} <= {"Ayes", "Ano"}, texts
    err = one_line_error(capsys, sample_cli.main, *args, "--json-schema", tmp_path / "missing.json")
    assert "--json-schema: cannot read" in err
    (tmp_path / "bad.json").write_text("{nope")
    assert "is not JSON" in one_line_error(capsys, sample_cli.main, *args, "--json-schema", tmp_path / "bad.json")
    assert sample_cli.main([*args, "--regex", "a(b"]) == 2  # refused before the prompt is printed, with the reason
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: regex") and "unclosed group" in err, err


def test_grammar_checks_name_the_problem(gpt2_tok):
    Grammar.json_schema(SCHEMA).check(gpt2_tok)
    with pytest.raises(GrammarError, match="json_schema"):
        Grammar.json_schema({"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}).check(
            gpt2_tok
        )


def test_the_chat_route_takes_response_format(chat_run, gpt2_tok):
    from gpt import load_checkpoint
    from gpt.data.tokenizer import SpecialsTokenizer

    _, chat_tok, chat_meta = load_checkpoint(chat_run)  # its chat template, over GPT-2's vocabulary here
    tok = SpecialsTokenizer(gpt2_tok, chat_tok.specials)
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=1, n_head=2, n_embd=32)).eval()
    meta = {"model_config": model.config.to_dict(), "tokenizer": tok.spec, "chat_template": chat_meta["chat_template"]}
    with running(create_app(model, tok, meta, ServeConfig(model_name="chat", max_batch=8, max_tokens=150))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        r = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "Who?"}],
            n=8,
            seed=4,
            temperature=1.0,
            max_tokens=120,
            response_format=fmt,
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)

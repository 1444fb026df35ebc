"""GPT-2 interoperability: import a Hugging Face directory, export one transformers loads."""

import json
import re

import pytest
import torch

from gpt import GPT, GPTConfig, load_checkpoint
from gpt.checkpoints.hf import HFError, export_hf, is_hf_dir
from gpt.checkpoints.native import CheckpointError
from gpt.cli.hf import main as hf_main
from gpt.data.bytelevel import bpe_merges
from gpt.data.tokenizer import CharTokenizer, get_tokenizer
from gpt.infer.sampling import complete

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def tiny_hf(vocab=50257, seed=0):
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # random everywhere, biases and LayerNorms included
        for p in hf.parameters():
            p.normal_(0, 0.3)
    return hf


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf()


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-gpt2")
    hf_model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer("gpt2")


def hf_logits(hf, idx):
    with torch.no_grad():
        return hf(idx).logits


def test_import_safetensors_dir_gives_equal_logits(hf_model, hf_dir):
    assert is_hf_dir(hf_dir)
    model, tok, meta = load_checkpoint(hf_dir)
    assert tok.spec == {"kind": "gpt2"} and tok.vocab_size == 50257
    assert meta["model_config"]["block_size"] == 32 and meta["tokenizer"] == {"kind": "gpt2"}
    assert GPTConfig.from_dict(meta["model_config"]).n_layer == 2  # usable by train.py --init-from
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        ours, _ = model(idx)
    torch.testing.assert_close(ours, hf_logits(hf_model, idx), atol=1e-4, rtol=1e-4)


def test_import_pytorch_model_bin_without_prefix_gives_equal_logits(hf_model, tmp_path):
    # the original GPT-2 files: pytorch_model.bin with keys like "h.0.attn.c_attn.weight", no lm_head
    sd = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    hf_model.config.to_json_file(tmp_path / "config.json")
    model, _, _ = load_checkpoint(tmp_path)
    idx = torch.randint(0, 50257, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf_logits(hf_model, idx), atol=1e-4, rtol=1e-4)


def test_greedy_continuation_equals_transformers_generate(hf_model, hf_dir, gpt2):
    model, tok, _ = load_checkpoint(hf_dir)
    prompt = tok.encode("Hello, my name is")
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=tok.eot_token,
        )[0, len(prompt) :].tolist()
    ours = [i for p in load_and_generate(model, tok, prompt) for i in p.ids]
    assert len(theirs) == 20 and ours == theirs
    assert len(set(ours)) > 3


def load_and_generate(model, tok, prompt):
    from gpt import generate

    return list(generate(model, tok, prompt, max_new_tokens=20, temperature=0, stop_at_eot=False))


@pytest.mark.parametrize("bias, activation", [(True, "gelu_tanh"), (False, "gelu_tanh"), (False, "gelu")])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, gpt2, bias, activation):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=50304, block_size=24, n_layer=2, n_head=2, n_embd=16, bias=bias, activation=activation)
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    out = export_hf(model, gpt2, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 50304 and config["n_positions"] == 24  # padded rows kept
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    idx = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, idx), model(idx)[0], atol=1e-4, rtol=1e-4)
    # and back: the re-imported model is the same model, with the same tokenizer
    again, tok, meta = load_checkpoint(out)
    assert tok.spec == {"kind": "gpt2"} and meta["model_config"]["vocab_size"] == 50304
    assert meta["model_config"]["activation"] == activation
    with torch.no_grad():
        torch.testing.assert_close(again(idx)[0], model(idx)[0], atol=1e-5, rtol=1e-5)


def test_exported_gpt2_tokenizer_files_match_tiktoken(tmp_path, gpt2):
    model = GPT(GPTConfig(vocab_size=50257, block_size=8, n_layer=1, n_head=1, n_embd=8))
    out = export_hf(model, gpt2, tmp_path / "export")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["Hello world", "  Crème brûlée, 東京 🚀!\n\tdon't stop 12345", "ROMEO:\nWhat light"]:
        assert hf_tok.encode(text) == gpt2.encode(text)
        assert hf_tok.decode(gpt2.encode(text)) == text
    assert hf_tok.eos_token_id == gpt2.eot_token


def test_bpe_merges_recovers_each_tokens_merge():
    tokens = [b"a", b"b", b"c", b"ab", b"abc", b"cc", b"ccab"]
    assert bpe_merges(tokens) == [(b"a", b"b"), (b"ab", b"c"), (b"c", b"c"), (b"cc", b"ab")]
    with pytest.raises(ValueError, match="not one merge"):
        bpe_merges([b"a", b"b", b"c", b"abc"])


def test_char_tokenizer_round_trips_through_an_exported_dir(tmp_path):
    tok = CharTokenizer("abc \n")
    model = GPT(GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=2, n_embd=8)).eval()
    out = export_hf(model, tok, tmp_path / "char")
    assert not (out / "vocab.json").exists()
    again, tok2, _ = load_checkpoint(out)
    assert tok2.spec == tok.spec
    kw = dict(max_new_tokens=10, temperature=0, stop_at_eot=False)
    assert complete(again, tok2, "ab", **kw) == complete(model, tok, "ab", **kw)


def test_export_cli_writes_a_loadable_dir(tmp_path, capsys):
    from gpt.checkpoints import native

    tok = CharTokenizer("abc \n")
    cfg = GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=2, n_embd=8)
    native.save(
        tmp_path / "run" / "best.pt",
        {"model": GPT(cfg).state_dict()},
        {"step": 0, "model_config": cfg.to_dict(), "tokenizer": tok.spec},
    )
    assert hf_main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").config.n_positions == 16
    capsys.readouterr()  # transformers' progress bar
    assert hf_main(["export", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_unsupported_hf_config_is_a_clear_error(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(HFError, match="config.json: unsupported GPT-2 config: activation_function 'relu'"):
        load_checkpoint(tmp_path)


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
    tiny_hf(vocab=100).save_pretrained(tmp_path)
    with pytest.raises(HFError, match="cannot tell which tokenizer .* vocab_size 100"):
        load_checkpoint(tmp_path)


def test_weights_that_do_not_match_config_json(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(
        CheckpointError,
        match=rf"^{tmp_path / 'config.json'}: the weights do not match its model "
        rf"config: missing transformer\.h\.2\.ln_1\.weight, ",
    ):
        load_checkpoint(tmp_path)


def test_export_refuses_what_gpt2_cannot_express(tmp_path, gpt2):
    model = GPT(GPTConfig(vocab_size=50257, block_size=8, n_layer=1, n_head=1, n_embd=8, norm="post"))
    with pytest.raises(ValueError, match="norm='post'"):
        export_hf(model, gpt2, tmp_path)


def test_weights_that_want_to_run_code_are_refused(hf_model, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"h.0.attn.c_attn.weight": Evil()}, tmp_path / "pytorch_model.bin")
    hf_model.config.to_json_file(tmp_path / "config.json")
    with pytest.raises(
        HFError,
        match="^cannot read the weights in .*: they hold objects other than tensors, whose "
        "code loading would run; refused$",
    ):
        load_checkpoint(tmp_path)
    assert not marker.exists()


def _sharded_hf_dir(hf_model, path, shard_names):
    """hf_model saved as safetensors shards under the given names (one per half of its tensors) + an index."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf_model.config.to_json_file(path / "config.json")
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(sd)
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2 :])
    weight_map = {}
    for name, part in zip(shard_names, halves):
        if not name.startswith("/"):
            save_file({k: sd[k] for k in part}, str(path / name))
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_a_sharded_safetensors_dir_loads(hf_model, tmp_path):
    path = _sharded_hf_dir(
        hf_model, tmp_path / "hf", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )
    model, _, _ = load_checkpoint(path)
    idx = torch.randint(0, 50257, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf_logits(hf_model, idx), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("outside", ["../x.safetensors", "/etc/passwd"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(hf_model, tmp_path, outside):
    path = _sharded_hf_dir(hf_model, tmp_path / "hf", ["model-00001-of-00002.safetensors", outside])
    with pytest.raises(
        HFError,
        match=rf"model.safetensors.index.json: \S+ is in '{re.escape(outside)}', which is not a file "
        rf"in .*; refused",
    ) as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)


def test_a_gpt2_dir_with_another_tokenizer_json_still_imports_with_gpt2s_bpe(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    wordpiece = {"model": {"type": "WordPiece", "vocab": {"[UNK]": 0}}, "added_tokens": []}
    (tmp_path / "tokenizer.json").write_text(json.dumps(wordpiece))
    _, tok, meta = load_checkpoint(tmp_path)
    assert tok.spec == {"kind": "gpt2"} and "chat_template" not in meta


def test_gpt2s_own_tokenizer_json_reads_back_as_gpt2(gpt2):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from gpt.checkpoints.hf_tokenizer import spec_from_tokenizer_json, vocabulary

    v = vocabulary(gpt2)  # GPT-2's tokenizer.json as the Hub has it: ByteLevel with its built-in regex
    hf = Tokenizer(models.BPE({t: i for i, t in enumerate(v.tokens[:-1])}, v.merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.add_special_tokens(["<|endoftext|>"])
    assert spec_from_tokenizer_json(json.loads(hf.to_str()), "tokenizer.json") == ({"kind": "gpt2"}, None)


def test_export_cli_replaces_an_export_only_with_force_and_never_its_source(tmp_path, capsys):
    from gpt.checkpoints import native

    tok = CharTokenizer("abc \n")
    cfg = GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=2, n_embd=8)
    native.save(
        tmp_path / "run" / "best.pt",
        {"model": GPT(cfg).state_dict()},
        {"step": 0, "model_config": cfg.to_dict(), "tokenizer": tok.spec},
    )
    hf = tmp_path / "hf"
    assert hf_main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(hf)]) == 0
    before = (hf / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert hf_main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(hf)]) == 2
    assert capsys.readouterr().err == (
        f"error: {hf / 'config.json'} exists already: choose another --out, or --force to replace it\n"
    )
    assert hf_main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(hf), "--force"]) == 0
    for ckpt, out in [(hf, hf), (tmp_path / "run", tmp_path / "run")]:  # an HF dir into itself; a run's config.json
        capsys.readouterr()
        assert hf_main(["export", "--ckpt", str(ckpt), "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert "which this command reads" in err and err.count("\n") == 1, err
    assert (hf / "model.safetensors").read_bytes() == before and not (tmp_path / "run" / "config.json").exists()

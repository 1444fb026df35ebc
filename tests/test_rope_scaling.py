"""Context extension of rope models (`rope_scaling` linear | yarn, gpt/model/positions.py `RopeScaling`): the
angles equal transformers' rope types of those names, exports carry them (Hugging Face's logits equal ours and
import takes them back; llama.cpp's too), the caches use them, and `gpt train --init-from CKPT --block-size 4B
--rope-scaling yarn --rope-factor 4` fine-tunes at the longer block, saved and sampled; bad combinations are
one-line errors."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import TRAIN, one_line_error, train_run

from gpt import GPT, GPTConfig, generate, load_checkpoint
from gpt.checkpoints import native
from gpt.checkpoints.hf import HFError, export_hf
from gpt.cli.hf import main as hf_main
from gpt.cli.sample import main as sample_main
from gpt.cli.train import main as train_main
from gpt.data.tokenizer import CharTokenizer
from gpt.errors import ConfigError
from gpt.infer.sampling import Decoder
from gpt.model.positions import ROPE_THETA, RopeScaling, rope_cos_sin

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?'\n-"


def scaled_model(kind="yarn", block=128, original=32, factor=4.0, seed=0) -> GPT:
    """A tiny rope model with wide random weights (biases and LayerNorms too) and the scaling asked for."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=len(CHARS) + 1,
        block_size=block,
        n_layer=2,
        n_head=2,
        n_embd=32,
        pos_encoding="rope",
        rope_scaling=kind,
        rope_factor=factor,
        rope_original_block=original,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def neox_config(kind, head_dim, original, factor):
    rope = {"rope_type": kind, "factor": factor, "rope_theta": ROPE_THETA, "partial_rotary_factor": 1.0}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = original
    return transformers.GPTNeoXConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        max_position_embeddings=int(original * factor),
        rope_parameters=rope,
    )


# ---- the angles: transformers' own rope types ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "yarn"])
@pytest.mark.parametrize("head_dim, original, factor", [(16, 32, 4.0), (64, 2048, 8.0), (32, 100, 2.5), (8, 4, 3.0)])
def test_cos_and_sin_equal_transformers(kind, head_dim, original, factor):
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    config = neox_config(kind, head_dim, original, factor)
    positions = torch.arange(0, int(original * factor) + 7)
    cos, sin = GPTNeoXRotaryEmbedding(config)(torch.zeros(1, 1, head_dim), positions[None])
    ours = rope_cos_sin(positions, head_dim, RopeScaling(kind, factor, original))
    # transformers computes its frequencies and angles in float32, we in float64: at position p the angle
    # differs by about p * 1e-7 (~2e-3 at 16k)
    atol = 1e-6 * len(positions)
    torch.testing.assert_close(ours[0], cos[0], atol=atol, rtol=0)
    torch.testing.assert_close(ours[1], sin[0], atol=atol, rtol=0)
    plain = rope_cos_sin(positions, head_dim)
    assert not torch.allclose(plain[0], ours[0], atol=1e-2)  # (the scaling changes them)


# ---- the caches compute the same angles --------------------------------------------------------------


@pytest.mark.parametrize("graph", [False, True])  # the dynamic cache; the static one (CUDA-graph steps)
def test_cached_decoding_equals_the_full_forward_past_the_original_block(graph):
    model = scaled_model("yarn", block=64, original=16)
    dec = Decoder(model, torch.randint(0, len(CHARS), (2, 5)), graph=graph)
    for _ in range(50):  # well past the 16 positions trained at
        with torch.no_grad():
            want = model(dec.tokens)[0][:, -1]
        torch.testing.assert_close(dec.logits, want, atol=1e-4, rtol=1e-4)
        dec.advance(dec.logits.argmax(-1))
    assert dec.prefills == 1


# ---- Hugging Face ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_hugging_faces_logits_equal_ours_and_import_takes_the_scaling_back(tmp_path, kind):
    pytest.importorskip("safetensors")
    tok = CharTokenizer(CHARS)
    model = scaled_model(kind)
    out = export_hf(model, tok, tmp_path / "hf")
    rope = json.loads((out / "config.json").read_text())["rope_scaling"]
    want = {"rope_type": kind, "factor": 4.0}
    if kind == "yarn":
        want |= {"original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}
    assert rope == want
    assert f"{kind} scaling x4" in (out / "README.md").read_text()

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.rope_parameters["rope_type"] == kind
    idx = torch.randint(0, tok.vocab_size, (2, 128))  # the whole stretched block
    with torch.no_grad():
        theirs, ours = hf(idx).logits, model(idx)[0]
        torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)
        unscaled = GPT(GPTConfig(**{**model.config.to_dict(), "rope_scaling": "", "rope_factor": 1.0,
                                     "rope_original_block": 0})).eval()  # fmt: skip
        unscaled.load_state_dict(model.state_dict())
        assert (unscaled(idx)[0] - ours).abs().max() > 0.1  # (so the equality above needs the scaling)

    assert hf_main(["import", "--hf-dir", str(out), "--out", str(tmp_path / "back")]) == 0
    again, _, _ = load_checkpoint(tmp_path / "back")
    assert again.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_a_transformers_yarn_config_imports_with_equal_logits(tmp_path):
    """A directory transformers saved itself (no gpt_model.json), yarn set on its side."""
    pytest.importorskip("safetensors")
    cfg = transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=96, use_parallel_residual=False, tie_word_embeddings=True, hidden_act="gelu",
        rope_parameters={"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.tie_weights()
    hf.save_pretrained(tmp_path / "neox")
    (tmp_path / "neox" / "gpt_tokenizer.json").write_text(json.dumps(CharTokenizer(CHARS + "0").spec))
    model, _, _ = load_checkpoint(tmp_path / "neox")
    assert (model.config.rope_scaling, model.config.rope_factor, model.config.rope_original_block) == ("yarn", 3.0, 32)
    idx = torch.randint(0, 64, (1, 96))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope scaling 'dynamic' (only plain RoPE, 'linear' or 'yarn')"),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 16},
            "yarn beta_fast 16 (only 32.0)",
        ),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.0},
            "yarn attention_factor 1.0 (only the default attention factor 0.1 ln(factor) + 1)",
        ),
    ],
)
def test_a_scaling_we_do_not_compute_is_refused_naming_it(tmp_path, capsys, rope, message):
    tok = CharTokenizer(CHARS)
    out = export_hf(scaled_model("yarn", block=64, original=32, factor=2.0), tok, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"rope_scaling": rope}))
    with pytest.raises(HFError, match="unsupported GPT-NeoX config: " + re.escape(message)):
        load_checkpoint(out)
    assert one_line_error(capsys, hf_main, "import", "--hf-dir", out, "--out", tmp_path / "run")


# ---- llama.cpp ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_llama_cpps_logits_equal_ours(tmp_path, kind):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from gpt.cli.export import main as export_main
    from gpt.infer import llamacpp

    tok = CharTokenizer(CHARS)
    model = scaled_model(kind)
    native.save(tmp_path / "m.pt", {"model": model.state_dict()}, native.build_meta(model.config.to_dict(), tok.spec))
    assert export_main(["--ckpt", str(tmp_path / "m.pt"), "--format", "gguf", "--out", str(tmp_path / "m.gguf"),
                        "--no-check"]) == 0  # fmt: skip
    ids = tok.encode(("ROMEO: But, soft! what light through yonder window breaks? " * 3)[:128])
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0, :, : tok.vocab_size].numpy()
    theirs = llamacpp.logits(llamacpp.open_gguf(tmp_path / "m.gguf", n_ctx=128), ids)
    # tests/test_gguf.py's f32 bounds (llama.cpp's GELU goes through a float16 table); past position 32 too
    diff = np.abs(theirs - ours)
    assert diff.max() < 1.5e-2 and diff.mean() < 1.5e-3, (diff.max(), diff.mean())
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


# ---- the model config and the training command line ----------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rope_scaling="yarn"), "rope_scaling: stretches rotary frequencies: it needs pos_encoding 'rope'"),
        (dict(pos_encoding="rope", rope_factor=2.0), "rope_factor: 2 needs a rope_scaling"),
        (dict(pos_encoding="rope", rope_scaling="yarn", rope_factor=0.5), "rope_factor: must be a number >= 1"),
        (dict(pos_encoding="rope", rope_scaling="ntk"), "rope_scaling: must be one of 'linear', 'yarn'"),
        (
            dict(pos_encoding="rope", rope_scaling="yarn", rope_factor=2.0, rope_original_block=32, block_size=128),
            "rope_factor: 2 stretches the 32 positions trained at to 64, fewer than block_size 128: raise it to 4",
        ),
    ],
)
def test_a_config_that_makes_no_sense_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**change)


@pytest.fixture(scope="module")
def base_run(char_data, tmp_path_factory):
    """A tiny rope char model trained at block 32 for a few steps."""
    out = tmp_path_factory.mktemp("rope") / "base"
    train_run("--data", char_data, "--out-dir", out, *TRAIN, "--pos-encoding", "rope", "--n-layer", "2",
              "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--max-iters", "4", "--eval-interval", "4")  # fmt: skip
    return out


def test_fine_tuning_at_four_times_the_block_with_yarn_saves_and_samples(base_run, char_data, tmp_path, capsys):
    out = tmp_path / "long"
    train_run("--data", char_data, "--init-from", base_run, "--out-dir", out, *TRAIN, "--block-size", "128",
              "--rope-scaling", "yarn", "--rope-factor", "4", "--max-iters", "4", "--eval-interval", "4")  # fmt: skip
    assert "init_from: block_size 32 -> 128 (yarn rope scaling x4 from 32)" in capsys.readouterr().out
    model, tok, meta = load_checkpoint(out)
    saved = meta["model_config"]
    assert (saved["block_size"], saved["rope_scaling"], saved["rope_factor"], saved["rope_original_block"]) == (
        128, "yarn", 4.0, 32)  # fmt: skip
    assert model.positions.scaling == RopeScaling("yarn", 4.0, 32)
    base, _, _ = load_checkpoint(base_run)
    assert base.positions.scaling is None
    ids = [i for p in generate(model, tok, tok.encode("ROMEO:"), max_new_tokens=100, stop_at_eot=False) for i in p.ids]
    assert len(ids) == 100
    assert sample_main(["--ckpt", str(out), "--max-new-tokens", "100", "--no-stop-at-eot", "--device", "cpu"]) == 0
    assert "1 sample(s), 100 tokens" in capsys.readouterr().err
    # going on from the fine-tuned run keeps its scaling (the command line does not repeat it)
    train_run("--data", char_data, "--init-from", out, "--out-dir", tmp_path / "more", *TRAIN, "--max-iters", "1",
              "--eval-interval", "1")  # fmt: skip
    assert load_checkpoint(tmp_path / "more")[0].positions.scaling == RopeScaling("yarn", 4.0, 32)


@pytest.mark.parametrize(
    "argv, message",
    [
        (  # the factor does not cover the block
            ["--block-size", "256", "--rope-scaling", "yarn", "--rope-factor", "4"],
            "error: --init-from {base}: --rope-factor: 4 stretches the 32 positions trained at to 128, fewer than "
            "block_size 256: raise it to 8",
        ),
        (["--rope-factor", "4"], "error: --rope-factor: 4 needs a rope_scaling ('linear' or 'yarn') to apply it"),
        (["--rope-scaling", "cubic"], "error: --rope-scaling: must be one of 'linear', 'yarn' (or empty)"),
    ],
)
def test_bad_combinations_are_one_line_errors(base_run, char_data, tmp_path, capsys, argv, message):
    err = one_line_error(capsys, train_main, "--data", char_data, "--init-from", base_run, "--out-dir",
                         tmp_path / "x", "--device", "cpu", "--max-iters", "1", *argv)  # fmt: skip
    assert err.startswith(message.format(base=base_run)), err


def test_scaling_a_model_with_a_position_table_is_a_one_line_error(char_data, tmp_path, capsys):
    train_run("--data", char_data, "--out-dir", tmp_path / "learned", *TRAIN, "--n-layer", "1", "--n-head", "2",
              "--n-embd", "16", "--block-size", "32", "--max-iters", "1", "--eval-interval", "1")  # fmt: skip
    err = one_line_error(capsys, train_main, "--data", char_data, "--init-from", tmp_path / "learned", "--out-dir",
                         tmp_path / "x", "--device", "cpu", "--block-size", "128", "--rope-scaling", "yarn",
                         "--rope-factor", "4", "--max-iters", "1")  # fmt: skip
    assert err.startswith(f"error: --rope-scaling yarn: {tmp_path / 'learned'} has pos_encoding 'learned'"), err
    err = one_line_error(capsys, train_main, "--data", char_data, "--out-dir", tmp_path / "y", "--device", "cpu",
                         "--rope-scaling", "yarn", "--rope-factor", "4", "--max-iters", "1")  # fmt: skip
    assert err == "error: --rope-scaling: stretches rotary frequencies: it needs pos_encoding 'rope', not 'learned'\n"


def test_gguf_refuses_a_fractional_original_block_in_one_line(tmp_path, capsys):
    pytest.importorskip("gguf")
    from gpt.cli.export import main as export_main

    model = scaled_model("yarn", block=100, original=0, factor=3.0)  # from 100 / 3 positions
    native.save(tmp_path / "m.pt", {"model": model.state_dict()}, native.build_meta(model.config.to_dict(),
                CharTokenizer(CHARS).spec))  # fmt: skip
    err = one_line_error(
        capsys, export_main, "--ckpt", tmp_path / "m.pt", "--format", "gguf", "--out", tmp_path / "m.gguf"
    )
    assert err.startswith("error: this checkpoint's yarn scaling starts from block_size / rope_factor = 33.3333")
    assert not (tmp_path / "m.gguf").exists()


def test_a_lora_run_at_the_longer_block_loads_and_resumes_with_its_scaling(base_run, char_data, tmp_path):
    out = tmp_path / "lora"
    train_run("--data", char_data, "--init-from", base_run, "--out-dir", out, *TRAIN, "--block-size", "128",
              "--rope-scaling", "yarn", "--rope-factor", "4", "--lora-rank", "4", "--max-iters", "2",
              "--eval-interval", "2")  # fmt: skip
    model, _, meta = load_checkpoint(out)  # the base (block 32, no scaling) rebuilt as the run built it
    assert model.config.block_size == 128 and model.positions.scaling == RopeScaling("yarn", 4.0, 32)
    train_run("--resume", out, "--max-iters", "3")
    again, _, _ = load_checkpoint(out / "last.pt")
    assert again.config.block_size == 128 and again.positions.scaling == RopeScaling("yarn", 4.0, 32)


def test_a_scaling_from_block_size_over_factor_keeps_its_angles_at_another_block(char_data, tmp_path):
    """rope_original_block 0 means block_size / rope_factor: a fine-tune at another block pins it first."""
    train_run("--data", char_data, "--out-dir", tmp_path / "a", *TRAIN, "--pos-encoding", "rope", "--n-layer", "1",
              "--n-head", "2", "--n-embd", "16", "--block-size", "64", "--rope-scaling", "yarn", "--rope-factor", "2",
              "--max-iters", "1", "--eval-interval", "1")  # fmt: skip
    assert load_checkpoint(tmp_path / "a")[0].positions.scaling == RopeScaling("yarn", 2.0, 32)
    train_run("--data", char_data, "--init-from", tmp_path / "a", "--out-dir", tmp_path / "b", *TRAIN, "--block-size",
              "48", "--max-iters", "1", "--eval-interval", "1")  # fmt: skip
    model = load_checkpoint(tmp_path / "b")[0]
    assert model.config.rope_original_block == 32 and model.positions.scaling == RopeScaling("yarn", 2.0, 32)

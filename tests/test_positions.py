"""The owners of two model facts: `Positions` (gpt/model/positions.py), every answer about the position scheme,
and `EXPORTS` (gpt/model/config.py), which export formats carry which option, read by every exporter for its
one-line refusals."""

import dataclasses
import math

import pytest
import torch

from gpt import GPT, GPTConfig
from gpt.checkpoints import native
from gpt.data.tokenizer import CharTokenizer
from gpt.model import config as model_config
from gpt.model.config import ACTIVATIONS, EVERY_EXPORT, EXPORTS, FORMATS, POS_ENCODINGS, carried_by, refusals
from gpt.model.positions import SCHEMES, Positions, sinusoidal_positions

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

SIZES = dict(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=8)


def tiny(**options) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SIZES, **options})).eval()


# ---- Positions: each scheme's answers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, adds, scaled, rotary, slides, hf, gguf",
    [
        ("learned", "wpe", False, False, False, "gpt2", "gpt2"),
        ("sinusoidal", "pe", True, False, False, "gpt2", "gpt2"),
        ("rope", None, False, True, True, "gpt_neox", "gptneox"),
    ],
)
def test_each_scheme_answers_what_the_model_and_its_users_ask(name, adds, scaled, rotary, slides, hf, gguf):
    model = tiny(pos_encoding=name)
    p = model.positions
    assert p == Positions.of(model.config) and p.name == name and (p.n_embd, p.head_dim) == (8, 4)
    assert (p.adds, p.scaled, p.rotary, p.slides, p.absolute) == (adds, scaled, rotary, slides, adds is not None)
    assert p.cache == ("slide" if slides else "crop")
    assert (p.family("hf"), p.family("gguf")) == (hf, gguf)
    # the model holds what the answers say: wpe a parameter, pe a buffer that is not saved, or neither
    assert ("wpe" in model.transformer) == (adds == "wpe")
    assert hasattr(model, "pe") == (adds == "pe") and "pe" not in model.state_dict()
    assert all(c.rolling == slides for c in model.new_caches(1))
    # what the embedding adds
    idx = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        tok = model.transformer.wte(idx)
        if adds == "wpe":
            expected = tok + model.transformer.wpe.weight[:5]
        else:
            expected = tok * math.sqrt(8) + sinusoidal_positions(16, 8)[:5] if adds == "pe" else tok
        torch.testing.assert_close(model.embed(idx), expected, rtol=0, atol=0)
    # what attention receives
    rot = model.rope(3, 5, "cpu")
    assert (rot is None) == (not rotary)
    if rotary:
        assert rot[0].shape == rot[1].shape == (5, 4)
        torch.testing.assert_close(rot[0][0], torch.cos(3 * 10000.0 ** (-torch.arange(0, 4, 2) / 4)).repeat(2))
        per_row = model.rope(torch.tensor([0, 3]), 5, "cpu")
        assert per_row[0].shape == (2, 1, 5, 4) and torch.equal(per_row[0][1, 0], rot[0])


@pytest.mark.parametrize("name", POS_ENCODINGS)
def test_cropping_keeps_the_first_rows_of_the_table_and_the_same_outputs(name):
    model = tiny(pos_encoding=name)
    idx = torch.randint(0, 40, (1, 10))
    with torch.no_grad():
        before = model(idx)[0]
        model.crop_block_size(10)
        torch.testing.assert_close(model(idx)[0], before, rtol=0, atol=0)
    assert model.config.block_size == 10
    if model.positions.adds == "wpe":
        assert model.transformer.wpe.weight.shape == (10, 8)
    if model.positions.adds == "pe":
        assert model.pe.shape == (10, 8)


def test_an_absolute_scheme_refuses_a_context_past_its_table_and_a_sliding_one_does_not():
    idx = torch.randint(0, 40, (1, 17))
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        tiny(pos_encoding="learned")(idx)
    assert tiny(pos_encoding="rope")(idx)[0].shape == (1, 17, 40)


def test_every_scheme_is_a_pos_encoding_the_config_accepts_and_named_finds_only_them():
    assert tuple(SCHEMES) == POS_ENCODINGS
    assert all(s.name == name for name, s in SCHEMES.items())
    assert Positions.named("rope") is SCHEMES["rope"] and Positions.named("alibi") is None
    assert Positions.named(["rope"]) is None  # (what a hand-edited gpt_model.json might hold)


def test_a_pipeline_stage_asks_the_same_object():
    from gpt.train.pipeline import Stage

    model = tiny(pos_encoding="sinusoidal")
    stage = Stage(model, range(1), first=True, last=True)
    assert stage.positions is model.positions and torch.equal(stage.pe, model.pe)
    idx = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(stage(idx), model(idx)[0], rtol=0, atol=0)


# ---- EXPORTS: one table of what each format carries ----------------------------------------------------------


def test_every_model_option_says_which_formats_carry_it():
    in_table = {row.field for row in EXPORTS}
    assert in_table | set(EVERY_EXPORT) == {f.name for f in dataclasses.fields(GPTConfig)}
    assert not in_table & set(EVERY_EXPORT)
    for field, values in (("pos_encoding", POS_ENCODINGS), ("activation", ACTIVATIONS)):  # a row per value
        assert sorted(row.value for row in EXPORTS if row.field == field) == sorted(values)
    assert all(set(row.refused) <= set(FORMATS) for row in EXPORTS)


def test_carried_by_reads_the_table():
    assert carried_by("pos_encoding", "rope") == carried_by("pos_encoding", "sinusoidal") == FORMATS
    assert carried_by("activation", "relu2") == ("hf", "onnx", "pt2")
    assert carried_by("qk_norm", True) == ("onnx", "pt2") and carried_by("qk_norm", False) == FORMATS
    assert carried_by("norm", "post") == ("onnx", "pt2") and carried_by("n_encoder_layer", 2) == ()
    assert carried_by("untied_head", True) == carried_by("bias", False) == FORMATS


def test_refusals_name_each_option_as_the_user_set_it():
    cfg = GPTConfig(**SIZES, qk_norm=True, logit_softcap=15.0, activation="relu2", norm="post")
    assert [r.text for r in refusals(cfg, "gguf")] == [
        "this checkpoint is post-norm (norm='post'): llama.cpp's gpt2 and gptneox graphs are pre-norm",
        "activation='relu2' (their MLP is GELU)",
        "qk_norm (no norm on queries and keys)",
        "logit_softcap=15 (no cap on the logits)",
    ]
    assert [r.option for r in refusals(cfg, "hf")] == ["norm='post'", "qk_norm", "logit_softcap=15"]
    assert refusals(cfg, "onnx") == [] and refusals(GPTConfig(**SIZES), "hf") == []


@pytest.fixture
def run(tmp_path):
    """A learned-positions checkpoint (tmp_path/run/best.pt) that every format carries today."""
    model = tiny()
    tok = CharTokenizer("".join(chr(97 + i) for i in range(26)) + " .,:;!?\n'-ABC")
    native.save(tmp_path / "run" / "best.pt", {"model": model.state_dict()}, native.build_meta(SIZES, tok.spec))
    return tmp_path / "run"


@pytest.fixture
def learned_refused(monkeypatch):
    """EXPORTS with learned positions carried by no format but ONNX's (as a new scheme's row would say)."""
    row = model_config.Export("pos_encoding", "learned", {"hf": "no learned table here", "gguf": "nor here"})
    rows = tuple(row if r.field == "pos_encoding" and r.value == "learned" else r for r in EXPORTS)
    monkeypatch.setattr(model_config, "EXPORTS", rows)


def test_the_hugging_face_export_refuses_what_the_table_says_it_cannot_carry(run, tmp_path, capsys, learned_refused):
    pytest.importorskip("safetensors")
    from gpt.cli.hf import main as hf_main

    assert hf_main(["export", "--ckpt", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == "error: cannot export to Hugging Face: pos_encoding='learned' (no learned table here)\n"
    assert not (tmp_path / "hf").exists()


def test_the_gguf_export_refuses_what_the_table_says_it_cannot_carry(run, tmp_path, capsys, learned_refused):
    pytest.importorskip("gguf")
    from gpt.cli.export import main as export_main

    code = export_main(["--ckpt", str(run), "--format", "gguf", "--out", str(tmp_path / "x.gguf")])
    assert code == 2 and capsys.readouterr().err == (
        "error: llama.cpp's gpt2 and gptneox graphs cannot compute pos_encoding='learned' (nor here): "
        "export it with `gpt export --format onnx` instead\n"
    )
    assert not (tmp_path / "x.gguf").exists()


def test_the_onnx_export_refuses_what_the_table_says_it_cannot_carry(run, tmp_path, capsys, monkeypatch):
    from gpt.cli.export import main as export_main

    row = model_config.Export("pos_encoding", "learned", {"onnx": "this checkpoint is learned: not here"})
    monkeypatch.setattr(model_config, "EXPORTS", (row,))
    code = export_main(["--ckpt", str(run), "--format", "onnx", "--out", str(tmp_path / "x")])
    assert code == 2 and capsys.readouterr().err == "error: this checkpoint is learned: not here\n"
    assert not (tmp_path / "x").exists()


# ---- a new scheme: two rows in the model room ------------------------------------------------------------------


def test_a_new_scheme_is_a_row_of_schemes_and_of_exports(monkeypatch, tmp_path, capsys):
    """NoPE (no positions at all) added as gpt/model/positions.py's SCHEMES row and gpt/model/config.py's
    POS_ENCODINGS name and EXPORTS row, nothing else: the model, the decoders and the exporters follow."""
    from gpt.cli.hf import main as hf_main
    from gpt.infer.batching import BatchEngine
    from gpt.infer.sampling import Decoder
    from gpt.model import positions

    nope = Positions("none", adds=None, scaled=False, rotary=False, cache="slide", families=())
    monkeypatch.setitem(positions.SCHEMES, "none", nope)
    monkeypatch.setattr(model_config, "POS_ENCODINGS", (*POS_ENCODINGS, "none"))
    row = model_config.Export("pos_encoding", "none", {"hf": "GPT-2 and GPT-NeoX add positions", "gguf": "nor"})
    monkeypatch.setattr(model_config, "EXPORTS", (*EXPORTS, row))

    model = tiny(pos_encoding="none")
    assert "wpe" not in model.transformer and not hasattr(model, "pe")
    assert model(torch.randint(0, 40, (1, 20)))[0].shape == (1, 20, 40)  # no table: no length limit
    dec = Decoder(model, torch.randint(0, 40, (1, 5)))
    for _ in range(15):  # past block_size (16) in the cache, without a second prefill
        dec.advance(dec.logits.argmax(-1))
    assert dec.rolling and dec.prefills == 1
    tok = CharTokenizer("".join(chr(97 + i) for i in range(26)) + " .,:;!?\n'-ABC")
    assert BatchEngine(model, tok, max_rows=1).rolling
    native.save(
        tmp_path / "run" / "best.pt",
        {"model": model.state_dict()},
        native.build_meta(model.config.to_dict(), tok.spec),
    )
    assert hf_main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == "error: cannot export to Hugging Face: pos_encoding='none' (GPT-2 and GPT-NeoX add positions)\n"

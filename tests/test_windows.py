"""Attention windows and global tokens without a cache (gpt/model/sparse.py): the linear-cost path equals the
dense per-layer masks of GPT.window_masks (the reference) in logits and gradients."""

import json

import pytest
import torch
from conftest import TINY, one_line_error, reversed_words, sample_script, torchrun, train_run, train_script

import gpt.model.sparse as sparse
from gpt.model.config import GPTConfig
from gpt.model.sparse import Band
from gpt.model.transformer import GPT
from gpt.train import pipeline

REL = 1e-5  # float32: |got - want| <= REL |want| (norms over the tensor: a bias gradient sums B T terms)


def tiny(**kw) -> GPT:
    base = dict(vocab_size=50, block_size=512, n_layer=3, n_head=2, n_embd=16, dropout=0.0, bias=True)
    return GPT(GPTConfig(**{**base, **kw})).eval()


def logits_and_grads(model: GPT, reference: bool, monkeypatch, **inputs):
    """Logits and every parameter's gradient of sum(logits * r), through the bands or the dense reference."""
    with monkeypatch.context() as m:
        if reference:  # what b165f84 computes: a dense (T, T) mask per window size
            m.setattr(GPT, "bands", lambda self, *a, **k: None)
        model.zero_grad()
        logits, _ = model(**inputs)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).norm() <= REL * want.norm())


def assert_same(model, monkeypatch, **inputs):
    got, grads = logits_and_grads(model, False, monkeypatch, **inputs)
    want, ref = logits_and_grads(model, True, monkeypatch, **inputs)
    assert close(got, want), (got - want).abs().max()
    assert grads.keys() == ref.keys()
    for name in ref:
        assert close(grads[name], ref[name]), f"{name}: {(grads[name] - ref[name]).norm() / ref[name].norm():.1e}"


@pytest.fixture
def chunks_always(monkeypatch):
    """The chunked kernel at any length (it runs only past DENSE_MAX positions otherwise)."""
    monkeypatch.setattr(sparse, "DENSE_MAX", 0)


@pytest.mark.parametrize("T", [1, 63, 64, 130, 200])
@pytest.mark.parametrize(
    "window,G,pos", [("5", 0, "learned"), ("5,70,full", 2, "rope"), ("1", 3, "learned"), ("64", 1, "rope")]
)
def test_decoder_equals_the_dense_reference(T, window, G, pos, chunks_always, monkeypatch, one_thread):
    model = tiny(attention_window=window, global_tokens=G, pos_encoding=pos)
    assert_same(model, monkeypatch, idx=torch.randint(0, 50, (2, T)))


def test_long_sequences_take_the_chunks_by_default_and_agree(monkeypatch, one_thread):
    calls = []
    real = sparse.chunked
    monkeypatch.setattr(sparse, "chunked", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny(attention_window="32,full", global_tokens=2, pos_encoding="rope", n_layer=2)
    assert_same(model, monkeypatch, idx=torch.randint(0, 50, (1, sparse.DENSE_MAX + 45)))
    assert len(calls) == 1  # one windowed layer, one forward (the reference made no call)


def test_no_t_by_t_mask_is_built_past_dense_max(monkeypatch, one_thread):
    """A long sequence, packed documents, every layer windowed: neither a band's dense mask nor the
    documents' (T, T) mask is made, forward or backward."""
    import gpt.model.transformer as transformer

    def refuse(*a, **k):
        raise AssertionError("a (T, T) mask was built")

    monkeypatch.setattr(Band, "dense", refuse)
    monkeypatch.setattr(transformer, "doc_mask", refuse)
    model = tiny(attention_window="8,40", pos_encoding="rope")
    doc = (torch.arange(sparse.DENSE_MAX + 100) // 90).unsqueeze(0)
    logits, _ = model(torch.randint(0, 50, doc.shape), doc=doc)
    logits.sum().backward()


def test_packed_documents_stay_in_their_document(chunks_always, monkeypatch, one_thread):
    model = tiny(attention_window="9", pos_encoding="rope")
    doc = torch.tensor([[0] * 40 + [1] * 70 + [2] * 20, [5] * 130])
    assert_same(model, monkeypatch, idx=torch.randint(0, 50, (2, 130)), doc=doc)


def test_global_tokens_with_packed_documents_are_refused_in_one_line(chunks_always):
    model = tiny(attention_window="9", global_tokens=2)
    with pytest.raises(ValueError, match="global tokens with packed documents"):
        model(torch.randint(0, 50, (1, 100)), doc=torch.zeros(1, 100, dtype=torch.long))


@pytest.mark.parametrize("S", [50, 141])
def test_encoder_windows_are_bidirectional_and_cross_attention_full(S, chunks_always, monkeypatch, one_thread):
    model = tiny(attention_window="7,full", global_tokens=2, n_encoder_layer=2, n_layer=2)
    src = torch.randint(0, 50, (2, S))
    src_mask = torch.ones(2, S, dtype=torch.bool)
    src_mask[1, S - 13 :] = False  # a padded source
    assert_same(model, monkeypatch, idx=torch.randint(0, 50, (2, 20)), src=src, src_mask=src_mask)
    enc = model.attention_maps(torch.randint(0, 50, (1, 5)), src[:1], src_mask[:1])
    assert (enc["encoder"][0][0, 0, 30] > 0).sum() == 13 + 2  # 24 .. 36 and the global 0, 1
    assert (enc["cross"][0][0, 0, 4] > 0).sum() == S  # cross-attention sees the whole source


def test_a_later_token_changes_no_earlier_logit(chunks_always, one_thread):
    model = tiny(attention_window="8,33", global_tokens=2, pos_encoding="rope")
    idx = torch.randint(0, 50, (1, 150))
    changed = idx.clone()
    changed[0, 100] = (idx[0, 100] + 1) % 50
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[0, :100], b[0, :100])
    assert not torch.allclose(a[0, 100], b[0, 100])


@pytest.mark.parametrize("W,G", [(6, 0), (6, 3), (70, 0)])
def test_a_one_layer_model_sees_exactly_its_window(W, G, chunks_always, one_thread):
    """The gradient of the last logit reaches the embeddings of exactly the W last tokens and the G first."""
    model = tiny(attention_window=str(W), global_tokens=G, n_layer=1, pos_encoding="rope")
    T = 150
    x = model.transformer.wte(torch.randint(0, 50, (1, T))).detach().requires_grad_(True)
    h = x
    rope = model.rope(0, T, x.device)
    band = model.bands(None, None, T, causal=True)[0]
    h = model.transformer.h[0](h, mask=band, causal=True, rope=rope)
    h[0, -1].sum().backward()
    seen = (x.grad[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert seen == list(range(G)) + list(range(T - W, T))


def test_band_dense_is_the_windows_reference():
    at = torch.arange(40)
    for causal in (True, False):
        band = Band(5, 2, causal)
        m = band.dense(40, "cpu")[0, 0]
        d = at[:, None] - at[None, :]
        want = (d.abs() < 5) | (at[None, :] < 2) | (at[:, None] < 2)
        if causal:
            want = ((d < 5) | (at[None, :] < 2)) & (d >= 0)
        assert torch.equal(m, want)


def test_pipeline_stages_carry_each_layers_window(chunks_always, one_thread):
    model = tiny(attention_window="6,full,20", global_tokens=1, n_layer=4, pos_encoding="rope")
    x = torch.randint(0, 50, (2, 140))
    h = x
    runs = pipeline.split(4, 2)
    for s in range(2):
        h = pipeline.Stage(model, runs[s], s == 0, s == 1)(h)
    assert torch.equal(h, model(x)[0])


# ---- training end to end: past DENSE_MAX positions, so the chunks run ---------------------------------------

LONG = [
    *TINY,
    "--threads",
    "1",
    "--dtype",
    "float32",
    "--grad-clip",
    "0",
    "--block-size",
    "300",
    "--batch-size",
    "2",
    "--grad-accum",
    "2",
]
WINDOWS = ["--attention-window", "16,full", "--global-tokens", "2", "--pos-encoding", "rope", "--no-plot"]


def losses(out_dir) -> list[float]:
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def one(char_data, tmp_path_factory):
    """One process, 2 steps of a windowed model: the run the parallel layouts must equal."""
    out = tmp_path_factory.mktemp("win") / "one"
    train_run(*LONG, *WINDOWS, "--data", char_data, "--max-iters", "2", "--out-dir", out)
    return out


def test_a_windowed_model_trains_saves_resumes_and_samples(one, capsys):
    assert json.loads((one / "config.json").read_text())["model"]["attention_window"] == "16,full"
    train_run("--resume", one, "--max-iters", "3")
    assert len(losses(one)) == 3
    capsys.readouterr()
    assert sample_script.main(["--ckpt", str(one), "--prompt", "KING", "--max-new-tokens", "20", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("KING")


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]])
def test_tensor_and_pipeline_parallel_windows_match_one_process(layout, one, char_data, tmp_path):
    out = tmp_path / "par"
    torchrun(2, *LONG, *WINDOWS, "--data", char_data, "--max-iters", "2", "--out-dir", out, *layout)
    assert losses(out) == pytest.approx(losses(one)[:2], rel=1e-5)


def test_a_seq2seq_model_with_encoder_windows_trains(tmp_path):
    data = reversed_words(tmp_path, 100)
    argv = ["--n-encoder-layer", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16"]
    argv += [
        "--max-tokens",
        "64",
        "--threads",
        "1",
        "--dtype",
        "float32",
        "--no-plot",
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
    ]
    summary = train_run(*argv, *WINDOWS[:4], "--data", data, "--max-iters", "3", "--out-dir", tmp_path / "run")
    assert summary["val_loss"] < 5 and len(losses(tmp_path / "run")) == 3


# ---- exports: ONNX and .pt2 carry the windows (a dense mask in the graph), HF and GGUF refuse in one line -----


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_onnx_and_pt2_carry_the_windows(fmt, one, tmp_path):
    from gpt.checkpoints import loader
    from gpt.infer.export import export, parity

    model, tok, _ = loader.load_checkpoint(one)
    path = export(model.eval(), tok, tmp_path / fmt, fmt)
    for seq in (5, 290):  # (290: the chunks in PyTorch, the dense mask in the graph)
        assert parity(model, path, batch=2, seq=seq) < 1e-5


def test_hf_and_gguf_refuse_windows_in_one_line(one, tmp_path, capsys):
    from gpt.cli import export, hf

    err = one_line_error(capsys, export.main, "--ckpt", one, "--format", "gguf", "--out", tmp_path / "m.gguf")
    assert "attention_window='16,full' (no sliding window there" in err and "global_tokens=2" in err
    err = one_line_error(capsys, hf.main, "export", "--ckpt", one, "--out", tmp_path / "hf")
    assert "attention_window='16,full' (GPT-2 and GPT-NeoX attend to the whole context" in err


# ---- --window-schedule: the windows grow over the run ---------------------------------------------------------


def test_the_window_schedule_grows_to_the_configured_windows_and_is_logged(char_data, tmp_path):
    out = tmp_path / "grow"
    argv = [*LONG, "--attention-window", "256,full", "--pos-encoding", "rope", "--no-plot", "--grad-accum", "1"]
    train_run(*argv, "--data", char_data, "--max-iters", "6", "--window-schedule", "64", "--out-dir", out)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    grown = [r["window"] for r in records if r["kind"] == "train"]
    assert grown == [64, 128, 192, 192, 256, 256]  # steps 0..5: 64 + 192 * step / 5, rounded up to 64s
    assert json.loads((out / "config.json").read_text())["model"]["attention_window"] == "256,full"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--window-schedule", "64"], "grows the windows of --attention-window; give one"),
        (["--attention-window", "128", "--window-schedule", "256"], "from 1 to --attention-window's largest (128)"),
    ],
)
def test_window_schedule_mistakes_are_one_line(argv, message, char_data, tmp_path, capsys):
    err = one_line_error(capsys, train_script.main, "--data", char_data, "--out-dir", tmp_path / "r", *argv)
    assert message in err


def test_chat_data_trains_with_windows_and_refuses_global_tokens_in_one_line(chat_data, tmp_path, capsys):
    from conftest import CHAT_TRAIN

    argv = ["--data", chat_data, *CHAT_TRAIN, "--block-size", "192", "--max-iters", "2", "--no-plot"]
    train_run(*argv, "--attention-window", "16", "--out-dir", tmp_path / "chat")
    assert len(losses(tmp_path / "chat")) == 2
    err = one_line_error(capsys, train_script.main, *argv, *WINDOWS[:4], "--out-dir", tmp_path / "g")
    assert "global_tokens: not with a chat dataset's packed conversations" in err

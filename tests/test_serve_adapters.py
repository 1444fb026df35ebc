"""Several LoRA adapters served over one base (`gpt serve --lora NAME=DIR`): the request's `model` picks the
adapter, rows of different adapters decode in one batch (gpt/model/lora.py's MultiLoRALinear), each answer the
one its merged checkpoint gives alone; /v1/models lists them; mistakes are one line or a 404."""

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the dev extra is not installed: pip install -e '.[dev]'")

from gpt import load_checkpoint  # noqa: E402
from gpt.checkpoints.loader import load_for_inference  # noqa: E402
from gpt.cli import serve as serve_cli  # noqa: E402
from gpt.infer.batching import BatchEngine  # noqa: E402
from gpt.infer.sampling import complete  # noqa: E402
from gpt.model import lora  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402
from tests.conftest import one_line_error, train_run  # noqa: E402
from tests.test_batching import collect, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ["--batch-size", "8", "--warmup-iters", "2", "--eval-interval", "12", "--eval-iters", "2", "--no-plot"]
FAST += ["--device", "cpu", "--dtype", "float32", "--lora-rank", "4", "--max-iters", "12", "--log-interval", "12"]


@pytest.fixture(scope="module")
def adapters(trained_run, tmp_path_factory):
    """Two LoRA runs on the trained char model, different enough to say different things."""
    data = trained_run.parent / "char"
    out = {}
    for name, seed, lr in (("bold", 1, "5e-2"), ("calm", 2, "3e-2")):
        d = tmp_path_factory.mktemp("adapters") / name
        train_run(
            "--init-from", trained_run, "--data", data, "--out-dir", d, "--learning-rate", lr, "--seed", seed, *FAST
        )
        out[name] = d
    return out


def test_rows_of_two_adapters_and_the_base_decode_in_one_batch(trained_run, adapters):
    rt, model, tok, meta, _ = load_for_inference(trained_run, "cpu", "float32", adapters=tuple(adapters.values()))
    engine = BatchEngine(model, tok, 8)
    prompt = tok.encode("ROMEO:")
    outs = {}
    for index, name in enumerate(["base", *adapters]):
        outs[name] = collect(engine, prompt, temperature=0, max_new_tokens=30)
        outs[name]["request"].adapter = index
    steps = run(engine)
    assert steps <= 31  # one batch: the three requests joined at the first step and decoded together
    merged = {name: load_checkpoint(path)[0] for name, path in adapters.items()}
    merged["base"] = load_checkpoint(trained_run)[0]
    texts = {name: complete(merged[name], tok, prompt, temperature=0, max_new_tokens=30)[0] for name in outs}
    assert {name: o["text"][0] for name, o in outs.items()} == texts
    assert len(set(texts.values())) == 3  # the adapters change what is said
    assert sum(isinstance(m, lora.MultiLoRALinear) for m in model.modules()) == 8  # each block's four


def test_the_request_model_picks_the_adapter(trained_run, adapters):
    rt, model, tok, meta, _ = load_for_inference(trained_run, "cpu", "float32", adapters=tuple(adapters.values()))
    config = ServeConfig(model_name="base", adapters=tuple(adapters), max_batch=8)
    with running(create_app(model, tok, meta, config)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["base", "bold", "calm"]
        for name, path in adapters.items():
            r = client.completions.create(model=name, prompt="KING:", max_tokens=25, temperature=0)
            alone = complete(load_checkpoint(path)[0], tok, "KING:", temperature=0, max_new_tokens=25)[0]
            assert r.choices[0].text == alone and r.model == name
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="loud", prompt="KING:", max_tokens=5)
        assert "'base', 'bold', 'calm'" in e.value.message


def test_adapters_of_another_base_and_bad_flags_are_one_line(trained_run, adapters, tmp_path, capsys):
    from tests.conftest import save_random_lm

    other = save_random_lm(tmp_path / "other", "abc")
    base = ["--ckpt", str(other), "--port", "0", "--device", "cpu"]
    err = one_line_error(capsys, serve_cli.main, *base, "--lora", f"bold={adapters['bold']}")
    assert "not the checkpoint served" in err or "base" in err
    err = one_line_error(capsys, serve_cli.main, "--ckpt", trained_run, "--lora", "bold", "--port", "0")
    assert "--lora takes NAME=DIR" in err
    err = one_line_error(
        capsys, serve_cli.main, "--ckpt", trained_run, "--lora", f"bold={adapters['bold']}", "--quantize", "int8"
    )
    assert "leave out --quantize" in err
    assert torch.is_tensor(torch.zeros(1))

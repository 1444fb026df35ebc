import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt.model.config import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout holds the offline corpora and GPT-2's BPE ranks file.
SHARED_DATA = Path(os.environ.get("GPT_SHARED_DATA", ROOT.parent / "shared" / "data"))
GPT2_RANKS = SHARED_DATA / "gpt2.tiktoken"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"

# Offline GPT-2 BPE for every test (the connected-machine path is tiktoken's own download).
if GPT2_RANKS.exists():
    os.environ.setdefault("GPT2_TIKTOKEN_FILE", str(GPT2_RANKS))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one torch thread avoids oversubscription stalls when the 2 cores are busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def shakespeare_text() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


def prepare(text_file, out, *extra):
    """`data/prepare.py TEXT_FILE --out OUT ...`, as a user runs it."""
    subprocess.run(
        [sys.executable, "data/prepare.py", str(text_file), "--out", str(out), "--quiet", *extra],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out


def script(name: str):
    """A top-level script (train.py, sample.py) as a module: main(argv) as the user runs it."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_script, sample_script = script("train"), script("sample")


def one_line_error(capsys, main, *argv) -> str:
    """Run a script's main; it must fail with exit 2 and exactly one `error: ...` line on stderr."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def train_run(*argv) -> dict:
    """train.py's config and training in this process: the summary `train()` returns."""
    from gpt.train.start import config_from_argv
    from gpt.train.trainer import train

    cfg, explicit = config_from_argv([str(a) for a in argv])
    return train(cfg, explicit)


# ---- datasets and checkpoints, made by the code a user runs ------------------------------------------


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """Char-level dataset of tiny-shakespeare's first 200k characters (training tests)."""
    d = tmp_path_factory.mktemp("data")
    src = d / "shakespeare_head.txt"
    src.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    return prepare(src, d / "char", "--tokenizer", "char")


@pytest.fixture(scope="session")
def tiny_char_data(tmp_path_factory):
    """Char-level dataset of tiny-shakespeare's first 20k characters, blocks of 16 (checkpoint and LoRA tests)."""
    d = tmp_path_factory.mktemp("tiny_data")
    (d / "text.txt").write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return prepare(d / "text.txt", d / "char", "--tokenizer", "char", "--block-size", "16")


BASE_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
TRAIN = [
    "--batch-size",
    "2",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--warmup-iters",
    "1",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--learning-rate",
    "1e-2",
    "--no-plot",
]  # tests/test_plot.py draws


@pytest.fixture
def base(tiny_char_data, tmp_path):
    """A 'pretrained' checkpoint to fine-tune: random weights with the tiny dataset's tokenizer."""
    from gpt import GPT
    from gpt.checkpoints import native
    from gpt.data.tokens import open_dataset

    torch.manual_seed(3)
    meta = native.build_meta(model_config=BASE_CFG.to_dict(), tokenizer=open_dataset(tiny_char_data).tokenizer_spec)
    path = tmp_path / "base" / "best.pt"
    native.save(path, {"model": GPT(BASE_CFG).state_dict()}, meta)
    return path.parent


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A run directory (`shakespeare-char`) that train.py wrote: a 2-layer char model trained for a few seconds
    on tiny-shakespeare, in float32 on one thread (the serving, int8 and export tests need a model that says
    something worth stopping at; random weights never do)."""
    d = tmp_path_factory.mktemp("trained")
    data = prepare(SHAKESPEARE, d / "char", "--tokenizer", "char")
    out = d / "shakespeare-char"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_run(
            "--data",
            data,
            "--out-dir",
            out,
            "--n-layer",
            "2",
            "--n-head",
            "2",
            "--n-embd",
            "64",
            "--block-size",
            "64",
            "--batch-size",
            "16",
            "--learning-rate",
            "3e-3",
            "--warmup-iters",
            "10",
            "--max-iters",
            "150",
            "--eval-interval",
            "150",
            "--eval-iters",
            "4",
            "--no-eval-train",
            "--log-interval",
            "150",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-plot",
            "--seed",
            "0",
        )
    finally:
        torch.set_num_threads(n)
    return out

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    subprocess.run([sys.executable, "data/prepare.py", str(text_file), "--out", str(out), *extra],
                   cwd=ROOT, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """Char-level dataset of tiny-shakespeare's first 200k characters (training tests)."""
    d = tmp_path_factory.mktemp("data")
    src = d / "shakespeare_head.txt"
    src.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    return prepare(src, d / "char", "--tokenizer", "char")


def train_char_run(out: Path, text: str, steps: int = 150, block_size: int = 64, seed: int = 0) -> dict:
    """Train a 2-layer char model (AdamW, batch 16) on `text` for a few seconds, save it to out/best.pt.

    The serving, int8 and export tests run against a trained checkpoint: random weights never say
    anything worth stopping at.
    """
    from gpt import GPT, GPTConfig
    from gpt.checkpoints import native
    from gpt.data.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text(text)
    data = torch.tensor(tok.encode(text[:300_000]))
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=64, bias=False)
    torch.manual_seed(seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(len(data) - block_size - 1, (16,), generator=g)
        x = torch.stack([data[s : s + block_size] for s in starts])
        y = torch.stack([data[s + 1 : s + block_size + 1] for s in starts])
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    meta = {"step": steps, "model_config": cfg.to_dict(), "tokenizer": tok.spec, "train_loss": loss.item()}
    native.save(out / "best.pt", {"model": model.state_dict()}, meta)
    return meta


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A run directory (`shakespeare-char`) with a char model trained for a few seconds on one thread."""
    out = tmp_path_factory.mktemp("trained") / "shakespeare-char"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_char_run(out, SHAKESPEARE.read_text(encoding="utf-8"))
    finally:
        torch.set_num_threads(n)
    return out

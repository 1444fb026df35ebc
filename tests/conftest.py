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

import os
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

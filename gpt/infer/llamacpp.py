"""Run a GGUF export in llama.cpp (through llama-cpp-python): what the export's check, its tests and
bench/bench_llamacpp.py compare our model against.

    llm = open_gguf("model.gguf", n_ctx=64)
    logits(llm, ids)                 # (len(ids), vocab) float32, one row per position
    greedy(llm, ids, 20)             # the next 20 ids at temperature 0

The KV cache is float32 unless asked otherwise (llama.cpp's default is float16), so an f32 file computes what
PyTorch does up to llama.cpp's float16 GELU table and summation order.
"""

from __future__ import annotations

import numpy as np
import torch

from gpt.errors import UserError

GGML_TYPE_F32 = 0  # ggml's type id of float32 (llama.cpp's KV cache type)


class LlamaCppError(UserError, RuntimeError):
    """llama-cpp-python is missing, or llama.cpp could not load a file."""


def open_gguf(
    path, n_ctx: int = 0, n_threads: int | None = None, logits_all: bool = True, kv_f32: bool = True, **kwargs
):
    """A `llama_cpp.Llama` over the GGUF file at `path` (n_ctx 0: the file's context length); `kv_f32=False`
    keeps llama.cpp's own default KV cache type (float16), as its users run it."""
    if kv_f32:
        kwargs.update(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    try:
        import llama_cpp  # optional: llama.cpp
    except ImportError:
        raise LlamaCppError(
            "running a GGUF file needs llama-cpp-python: pip install llama-cpp-python (built from source)"
        ) from None
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            logits_all=logits_all,
            verbose=False,
            **kwargs,
        )
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
        raise LlamaCppError(f"llama.cpp cannot load {path}: {e}") from None


def logits(llm, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits (len(ids), n_vocab) over `ids` from an empty context."""
    llm.reset()
    llm.eval(list(ids))
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def greedy(llm, ids: list[int], n: int) -> list[int]:
    """The `n` ids llama.cpp continues `ids` with at temperature 0 (argmax of each step's logits)."""
    llm.reset()
    llm.eval(list(ids))
    out = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    return out


def parity(model, path, seq: int | None = None, seed: int = 0) -> float:
    """The largest |llama.cpp's logits - PyTorch's| over random ids of length `seq` (the export's check),
    over the ids the file has (the tokenizer's)."""
    seq = seq or min(17, model.config.block_size)
    llm = open_gguf(path, n_ctx=seq)
    n_vocab = llm.n_vocab()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_vocab, (1, seq), generator=g)
    with torch.no_grad():
        expected = model(idx)[0][0, :, :n_vocab].float().numpy()
    return float(np.abs(logits(llm, idx[0].tolist()) - expected).max())

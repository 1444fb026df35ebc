"""Export a checkpoint's model to ONNX (for onnxruntime and friends) or to a torch.export program (.pt2).

    gpt export --ckpt out/shakespeare-char --format onnx --out export/shakespeare-char
    gpt export --ckpt out/shakespeare-char --format pt2 --out export/shakespeare-char

What the exported graph covers: the decoder-only model's whole forward pass,

    idx     int64   (batch, seq)              token ids, 1 <= seq <= block_size
    logits  float32 (batch, seq, vocab_size)  next-token logits at every position

with batch and seq dynamic. There is no KV cache (each call recomputes its whole window: fine for
scoring text, quadratic for long generations), no sampling (take `logits[:, -1]` and draw) and no
tokenizer (`gpt_export.json` beside the model holds our tokenizer spec, block_size, vocab_size and
end-of-text id, and for a chat model its template, `chat_template`: role markers and end-of-turn token,
see gpt/data/chat.py; `gpt.data.tokenizer.get_tokenizer(spec)` rebuilds the tokenizer). Positions are
learned and absolute, so a longer window must be cropped to its last block_size tokens by the caller.
Encoder-decoder checkpoints are not exported (gpt/model/config.py's `EXPORTS`, the table every exporter reads).

ONNX goes through `torch.onnx.export(..., dynamo=True)` (torch.export, then onnxscript's
translation; needs `pip install -e ".[export]"`) and writes the weights beside the graph
(`model.onnx.data`: keep the two files together); the .pt2 file is `torch.export.save` of the same
program, loaded with `torch.export.load(path).module()`. After writing, the command runs the
exported model (onnxruntime for ONNX) on a batch and reports its largest difference from PyTorch's
logits. Mistakes are one `error: ...` line, exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from gpt.checkpoints.outputs import check_targets
from gpt.errors import UserError, storage_error
from gpt.fsutil import replacing, write_text
from gpt.model.config import refusals

FORMATS = {"onnx": "model.onnx", "pt2": "model.pt2"}
META_FILE = "gpt_export.json"


class ExportError(UserError, ValueError):
    """A checkpoint or an output directory that cannot be exported to (the message says what to do)."""


class Logits(nn.Module):
    """The graph that is exported: ids (B, T) -> logits (B, T, V) (`GPT.forward` without the loss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]


def dynamic_shapes(block_size: int) -> dict:
    return {"idx": {0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("seq", min=1, max=block_size)}}


@contextlib.contextmanager
def quiet_exporter():
    """While exporting only: torch.onnx's notes that torchvision is absent and a FutureWarning from inside
    torch's pytree code say nothing about the user's model."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
            yield
    finally:
        registration.setLevel(level)


def targets(out_dir: str | Path, fmt: str) -> list[Path]:
    """The files `export` writes into `out_dir`."""
    return [Path(out_dir) / FORMATS[fmt], Path(out_dir) / META_FILE]


def export(
    model,
    tokenizer,
    out_dir: str | Path,
    fmt: str,
    force: bool = False,
    chat_template: dict | None = None,
    sources: tuple = (),
) -> Path:
    """Write the model (float32, CPU) as `fmt` ("onnx" or "pt2") to out_dir, with gpt_export.json (and a
    chat model's template in it); its path."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if found := refusals(model.config, fmt):  # (gpt/model/config.py's EXPORTS: an encoder-decoder)
        raise ExportError("; ".join(r.text for r in found))
    out_dir = Path(out_dir)
    path = out_dir / FORMATS[fmt]
    check_targets(targets(out_dir, fmt), force, sources)  # never over the checkpoint `sources` it exports
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir} is a file, not a directory; choose another --out")
    try:
        write_export(model, tokenizer, out_dir, fmt, chat_template)
    except OSError as e:  # a full disk, no permission: each file is whole or not there (replacing)
        if isinstance(e, UserError):
            raise
        raise storage_error(e, "write the export to", out_dir, "no file there is half-written") from None
    return path


def write_export(model, tokenizer, out_dir: Path, fmt: str, chat_template: dict | None) -> None:
    """The files of `export`, each written whole or not at all."""
    path = out_dir / FORMATS[fmt]
    out_dir.mkdir(parents=True, exist_ok=True)
    block = model.config.block_size
    graph = Logits(model.float().cpu()).eval()
    example = torch.zeros(2, min(8, block), dtype=torch.long)
    if fmt == "onnx":
        try:
            import onnxscript  # noqa: F401  (torch.onnx's dynamo exporter needs it)
        except ImportError:
            raise ExportError('ONNX export needs onnx and onnxscript: pip install -e ".[export]"') from None
        with quiet_exporter(), replacing(path) as tmp:  # (each file: a link there is replaced, not followed)
            torch.onnx.export(
                graph,
                (example,),
                str(tmp),
                dynamo=True,
                input_names=["idx"],
                output_names=["logits"],
                dynamic_shapes=dynamic_shapes(block),
                verbose=False,
            )
    else:
        program = torch.export.export(graph, (example,), dynamic_shapes=dynamic_shapes(block))
        with replacing(path) as tmp:
            torch.export.save(program, str(tmp))
    meta = {
        "format": fmt,
        "file": path.name,
        "block_size": block,
        "vocab_size": model.config.vocab_size,
        "inputs": {"idx": f"int64 (batch, seq), 1 <= seq <= {block}"},
        "outputs": {"logits": f"float32 (batch, seq, {model.config.vocab_size})"},
        "tokenizer": tokenizer.spec,
        "eot_token": tokenizer.eot_token,
        "model_config": model.config.to_dict(),
        **({"chat_template": chat_template} if chat_template else {}),
    }
    write_text(out_dir / META_FILE, json.dumps(meta, indent=2) + "\n")


def run_exported(path: str | Path, idx: torch.Tensor) -> torch.Tensor:
    """Logits of an exported model for ids `idx` (onnxruntime for .onnx, torch.export.load for .pt2)."""
    path = Path(path)
    if path.suffix == ".onnx":
        try:
            import onnxruntime  # optional: onnx
        except ImportError:
            raise ExportError('running an ONNX model needs onnxruntime: pip install -e ".[export]"') from None
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(["logits"], {"idx": idx.numpy()})[0])
    with torch.no_grad():
        return torch.export.load(str(path)).module()(idx)


def parity(model, path: str | Path, batch: int = 3, seq: int | None = None, seed: int = 0) -> float:
    """The largest |exported logits - PyTorch's| on random ids of shape (batch, seq)."""
    seq = seq or min(17, model.config.block_size)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    with torch.no_grad():
        expected = model(idx)[0]
    return (run_exported(path, idx) - expected).abs().max().item()

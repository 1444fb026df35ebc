"""`gpt export`: ONNX / torch.export of a checkpoint's logits graph, or a GGUF file for llama.cpp.

gpt export --ckpt out/run --format onnx --out export/run
gpt export --ckpt out/run --format gguf --out run.gguf --quant q8_0
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from gpt.checkpoints.gguf import QUANTS as GGUF_QUANTS
from gpt.checkpoints.outputs import check_targets, sources_of
from gpt.cli import ArgumentParser, run_main
from gpt.errors import storage_error
from gpt.infer.export import FORMATS, ExportError, export, parity, targets


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="gpt export",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Export a decoder-only checkpoint's logits graph (dynamic batch and "
        "sequence length, no KV cache) to ONNX or torch.export's .pt2, or the model with its tokenizer "
        "(and chat template) to one GGUF file that llama.cpp runs.",
    )
    p.add_argument(
        "--ckpt", required=True, help="run directory (best.pt, else last.pt), checkpoint file or HF GPT-2 dir"
    )
    p.add_argument(
        "--format",
        required=True,
        choices=[*FORMATS, "gguf"],
        help="onnx (onnxruntime), pt2 (torch.export) or gguf (llama.cpp)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="onnx / pt2: directory to write model.onnx / model.pt2 and gpt_export.json to; gguf: the .gguf "
        "file (a directory: DIR/model.gguf)",
    )
    p.add_argument(
        "--quant",
        choices=GGUF_QUANTS,
        default="f32",
        help="gguf only: the matrices' type (vectors, norms and positions stay f32; a matrix q8_0 or q4_0 "
        "cannot take falls back to f16); the K-quants q4_k_m, q5_k_m, q6_k run llama.cpp's own quantiser "
        "(llama-cpp-python) on models 256 wide or a multiple",
    )
    p.add_argument("--force", action="store_true", help="replace an exported model already in --out")
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip running the exported model against PyTorch after writing it (gguf: in llama.cpp, when "
        "llama-cpp-python is installed)",
    )
    return p


def run(args: argparse.Namespace) -> str:
    from gpt.checkpoints.loader import (
        load_checkpoint,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )

    if args.format != "gguf" and args.quant != "f32":
        raise ExportError(f"--quant is for --format gguf; {args.format} exports float32")
    sources = sources_of(args.ckpt)  # the checkpoint and, for LoRA adapters, their base
    out = [gguf_path(args.out)] if args.format == "gguf" else targets(args.out, args.format)
    check_targets(out, args.force, sources)  # before the checkpoint is loaded
    model, tokenizer, meta = load_checkpoint(args.ckpt, device="cpu")
    if args.format == "gguf":
        return run_gguf(args, model, tokenizer, meta)
    start = time.perf_counter()
    path = export(model, tokenizer, args.out, args.format, args.force, meta.get("chat_template"), tuple(sources))
    line = (
        f"exported {args.ckpt} ({model.num_params() / 1e6:.2f}M parameters) to {path} in "
        f"{time.perf_counter() - start:.1f} s: idx int64 (batch, seq <= {model.config.block_size}) -> logits "
        f"float32 (batch, seq, {model.config.vocab_size}), no KV cache"
    )
    if args.check:
        line += f"; max |logits - PyTorch's| = {parity(model, path):.1e} at batch 3"
    return line


def gguf_path(out: str) -> Path:
    """--out for gguf: the file, or DIR/model.gguf for a directory."""
    path = Path(out)
    return path / "model.gguf" if path.is_dir() else path


def run_gguf(args: argparse.Namespace, model, tokenizer, meta: dict) -> str:
    from gpt.checkpoints.gguf import write_gguf  # optional: GGUF
    from gpt.infer import llamacpp  # optional: llama.cpp
    from gpt.model import qat  # torch: after flags

    path = gguf_path(args.out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a part of the path is a file, no permission
        if path.parent.is_file():
            raise ExportError(
                f"--out {args.out}: {path.parent} is a file, not a directory; choose another --out"
            ) from None
        raise storage_error(e, "write", path) from None
    start = time.perf_counter()
    warning = qat.mismatch(meta.get("qat"), args.quant, flag="--quant")
    if warning:
        warnings.warn(warning, stacklevel=2)
    counts = write_gguf(model, tokenizer, path, args.quant, meta.get("chat_template"))
    types = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    line = (
        f"exported {args.ckpt} ({model.num_params() / 1e6:.2f}M parameters) to {path} "
        f"({path.stat().st_size / 1e6:.1f} MB: {types} tensors) in {time.perf_counter() - start:.1f} s"
    )
    if args.check:
        try:
            diff = llamacpp.parity(model, path)
        except llamacpp.LlamaCppError as e:
            return f"{line}; not checked in llama.cpp: {e}"
        line += f"; max |logits - PyTorch's| = {diff:.1e} in llama.cpp"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args), interrupted=f"{args.out} may hold a partial export")

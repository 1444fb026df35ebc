"""ONNX / torch.export of a checkpoint's logits graph: `python -m gpt.export`."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from gpt.checkpoints.outputs import check_targets, sources_of
from gpt.cli import ArgumentParser, run_main
from gpt.infer.export import FORMATS, export, parity, targets


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m gpt.export",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Export a decoder-only checkpoint's logits graph (dynamic batch and "
        "sequence length, no KV cache) to ONNX or torch.export's .pt2.",
    )
    p.add_argument(
        "--ckpt", required=True, help="run directory (best.pt, else last.pt), checkpoint file or HF GPT-2 dir"
    )
    p.add_argument("--format", required=True, choices=list(FORMATS), help="onnx (onnxruntime) or pt2 (torch.export)")
    p.add_argument("--out", required=True, help="directory to write model.onnx / model.pt2 and gpt_export.json to")
    p.add_argument("--force", action="store_true", help="replace an exported model already in --out")
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip running the exported model against PyTorch after writing it",
    )
    return p


def run(args: argparse.Namespace) -> str:
    from gpt.checkpoints.loader import (
        load_checkpoint,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )

    sources = sources_of(args.ckpt)  # the checkpoint and, for LoRA adapters, their base
    check_targets(targets(args.out, args.format), args.force, sources)  # before the checkpoint is loaded
    model, tokenizer, meta = load_checkpoint(args.ckpt, device="cpu")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args), interrupted=f"{args.out} may hold a partial export")


if __name__ == "__main__":
    raise SystemExit(main())

"""Hugging Face GPT-2 export: `python -m gpt.hf export`."""

from __future__ import annotations

from pathlib import Path

from gpt.checkpoints.hf import CHAT_TEMPLATE_FILE, TOKENIZER_SPEC_FILE, export_hf
from gpt.checkpoints.loader import load_checkpoint
from gpt.checkpoints.outputs import check_targets, sources_of
from gpt.cli import ArgumentParser, run_main

# What `export_hf` may write into --out (the tokenizer files only for GPT-2's tokenizer).
EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    TOKENIZER_SPEC_FILE,
    CHAT_TEMPLATE_FILE,
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
)


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m gpt.hf", description="Hugging Face GPT-2 import/export.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a directory transformers' GPT2LMHeadModel.from_pretrained loads")
    ex.add_argument("--ckpt", required=True, help="run directory, checkpoint file or HF GPT-2 directory")
    ex.add_argument("--out", required=True, help="output directory (created)")
    ex.add_argument(
        "--force", action="store_true", help="replace an export already in --out (never the checkpoint exported)"
    )
    args = p.parse_args(argv)

    def export() -> str:
        check_targets([Path(args.out) / name for name in EXPORT_FILES], args.force, sources_of(args.ckpt))
        model, tokenizer, meta = load_checkpoint(args.ckpt)
        out = export_hf(model, tokenizer, args.out, meta.get("chat_template"))
        return f"wrote {out} (load with transformers.GPT2LMHeadModel.from_pretrained({str(out)!r}))"

    return run_main(export)


if __name__ == "__main__":
    raise SystemExit(main())

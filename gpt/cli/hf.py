"""Hugging Face GPT-2 export: `python -m gpt.hf export`."""

from __future__ import annotations

from gpt.checkpoints.hf import export_hf
from gpt.checkpoints.loader import load_checkpoint
from gpt.cli import ArgumentParser, run_main


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m gpt.hf", description="Hugging Face GPT-2 import/export.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a directory transformers' GPT2LMHeadModel.from_pretrained loads")
    ex.add_argument("--ckpt", required=True, help="run directory, checkpoint file or HF GPT-2 directory")
    ex.add_argument("--out", required=True, help="output directory (created; existing files are replaced)")
    args = p.parse_args(argv)

    def export() -> str:
        model, tokenizer, meta = load_checkpoint(args.ckpt)
        out = export_hf(model, tokenizer, args.out, meta.get("chat_template"))
        return f"wrote {out} (load with transformers.GPT2LMHeadModel.from_pretrained({str(out)!r}))"

    return run_main(export)


if __name__ == "__main__":
    raise SystemExit(main())

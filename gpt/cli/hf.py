"""Hugging Face export and import: `gpt hf export | import`.

gpt hf export --ckpt out/NAME --out hf/NAME         # GPT2LMHeadModel or GPTNeoXForCausalLM + tokenizer
gpt hf import --hf-dir hf/NAME --out out/back       # a native checkpoint: out/back/best.pt
"""

from __future__ import annotations

from pathlib import Path

from gpt.checkpoints import native
from gpt.checkpoints.hf import EXPORT_FILES, HFError, architecture, export_hf, is_hf_dir
from gpt.checkpoints.loader import load_checkpoint
from gpt.checkpoints.outputs import check_targets, sources_of
from gpt.cli import ArgumentParser, run_main


def main(argv=None) -> int:
    p = ArgumentParser(prog="gpt hf", description="Hugging Face export and import.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a directory transformers' AutoModelForCausalLM and AutoTokenizer load")
    ex.add_argument("--ckpt", required=True, help="run directory, checkpoint file (LoRA: merged) or HF directory")
    ex.add_argument("--out", required=True, help="output directory (created)")
    ex.add_argument(
        "--force", action="store_true", help="replace an export already in --out (never the checkpoint exported)"
    )
    im = sub.add_parser("import", help="turn a Hugging Face GPT-2 / GPT-NeoX directory into a gpt checkpoint")
    im.add_argument("--hf-dir", required=True, help="directory with config.json and model weights")
    im.add_argument("--out", required=True, help="run directory to create (the checkpoint is OUT/best.pt)")
    args = p.parse_args(argv)

    def export() -> str:
        check_targets([Path(args.out) / name for name in EXPORT_FILES], args.force, sources_of(args.ckpt))
        model, tokenizer, meta = load_checkpoint(args.ckpt)
        out = export_hf(model, tokenizer, args.out, meta.get("chat_template"), meta)
        cls = architecture(model.config)
        return f"wrote {out} ({cls}; load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))"

    def import_() -> str:
        if not is_hf_dir(args.hf_dir):
            raise HFError(f"{args.hf_dir} is not a Hugging Face model directory (config.json and model weights)")
        target = Path(args.out) / "best.pt"
        check_targets([target], force=True)  # never a run's own best.pt (an existing file: refused below)
        if target.exists():
            raise HFError(f"{target} exists; choose another --out (nothing was written)")
        model, _, meta = load_checkpoint(args.hf_dir)
        native.save(target, {"model": model.state_dict()}, dict(meta))
        return f"wrote {target} (sample with `gpt sample --ckpt {args.out}`)"

    return run_main(export if args.command == "export" else import_)

"""LoRA checkpoints as plain ones: `gpt lora merge`."""

from __future__ import annotations

from pathlib import Path

from gpt.checkpoints import loader, native
from gpt.checkpoints.outputs import check_targets, sources_of
from gpt.cli import ArgumentParser, run_main


def merge_checkpoint(path, out, base=None, force: bool = False) -> Path:
    """Write base + adapters of the LoRA checkpoint `path` as one plain checkpoint (`out`: a .pt file, or a
    directory that gets best.pt): `gpt sample`, `--init-from` and the HF export read it like any other. An
    existing `out` is replaced only with `force`; the adapters' checkpoint and their base never are."""
    out = Path(out)
    target = out if out.suffix == ".pt" else out / "best.pt"
    check_targets([target], force, sources_of(path, base))  # before the work: a refusal costs nothing
    model, meta_ = loader.load_adapted(path, merge_adapters=True, base=base)
    keep = {k: meta_[k] for k in ("step", "val_loss", "dataset", "chat_template") if k in meta_}
    new_meta = native.build_meta(model_config=model.config.to_dict(), tokenizer=meta_["tokenizer"], **keep)
    native.save(target, {"model": model.state_dict()}, new_meta)
    return target


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="gpt lora",
        description="LoRA checkpoints: `merge` writes base + adapters as "
        "one plain checkpoint (for `gpt sample`, --init-from, `gpt hf export`).",
    )
    p.add_argument("command", choices=["merge"])
    p.add_argument("--ckpt", required=True, help="a LoRA run directory (best.pt, else last.pt) or checkpoint file")
    p.add_argument("--out", required=True, help="a .pt file, or a directory (it gets best.pt)")
    p.add_argument("--base", default=None, help="the base model, if not where the checkpoint says (default: there)")
    p.add_argument("--force", action="store_true", help="replace an existing --out (never the adapters or their base)")
    args = p.parse_args(argv)

    def run() -> str:
        target = merge_checkpoint(args.ckpt, args.out, args.base, args.force)
        return f"wrote {target} (base + adapters merged; sample with `gpt sample --ckpt {target}`)"

    return run_main(run)

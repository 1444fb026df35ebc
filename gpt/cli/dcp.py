"""Sharded (DCP) checkpoints as single files: `gpt dcp convert`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpt.checkpoints import loader, native
from gpt.checkpoints.dcp import CheckpointError, read, read_meta
from gpt.checkpoints.outputs import check_targets
from gpt.cli import ArgumentParser, run_main


def convert(ckpt: str | os.PathLike, out: str | os.PathLike | None = None, force: bool = False) -> list[Path]:
    """Write DCP checkpoints as single files: with `out`, the one `ckpt` names (a checkpoint directory,
    or a run directory's best, else last), an existing `out` replaced only with `force`; without, a run
    directory's last.dcp and best.dcp become last.pt and best.pt beside them. Returns the files written."""
    ckpt = Path(ckpt)
    if out is not None:
        source = loader.resolve(ckpt)
        if not native.is_sharded(source):
            raise CheckpointError(f"{source} is already a single-file checkpoint")
        check_targets([out], force, [source])
        pairs = [(source, Path(out))]
    elif native.is_sharded(ckpt):
        raise CheckpointError(f"--out: where to write {ckpt} as one file, e.g. --out {ckpt.parent / 'model.pt'}")
    else:
        pairs = [(ckpt / name, ckpt / pt) for pt, name in native.SHARDED.items() if (ckpt / name).is_dir()]
        if not pairs:
            raise CheckpointError(
                f"no last.dcp or best.dcp in {ckpt}: give the run directory of a --fsdp run, or "
                f"one of its checkpoint directories with --out"
            )
    for source, dst in pairs:  # a newer single file (the run went on without --fsdp) is never replaced
        if dst.is_file() and loader.read_meta(dst)["step"] > read_meta(source)["step"]:
            raise CheckpointError(
                f"{dst} (step {loader.read_meta(dst)['step']}) is newer than {source} (step "
                f"{read_meta(source)['step']}): not replaced; pass --out to write elsewhere"
            )
    written = {}
    for source, dst in pairs:
        same = next((done for src, done in written.items() if os.path.samefile(src, source)), None)
        if same is not None:  # best.dcp and last.dcp point to one checkpoint: one conversion, linked
            native.link_or_copy(same, dst)
        else:
            whole = read(source)
            native.save(dst, whole, json.loads(whole.pop("meta")))
        written[source] = dst
    return [dst for _, dst in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="gpt dcp", description="Sharded (FSDP) checkpoints as single files.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="write DCP checkpoints as .pt files")
    conv.add_argument(
        "--ckpt", required=True, help="the run directory of a --fsdp run, or one of its checkpoint directories"
    )
    conv.add_argument(
        "--out",
        default=None,
        help="the .pt file to write (default, for a run directory: last.pt and best.pt beside last.dcp and best.dcp)",
    )
    conv.add_argument("--force", action="store_true", help="replace an existing --out (never the checkpoint converted)")
    args = parser.parse_args(argv)
    return run_main(lambda: "\n".join(f"wrote {path}" for path in convert(args.ckpt, args.out, args.force)))

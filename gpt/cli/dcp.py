"""Sharded (DCP) checkpoints as single files: `python -m gpt.dcp convert`."""

from __future__ import annotations

from gpt.checkpoints.dcp import convert
from gpt.cli import ArgumentParser, run_main


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m gpt.dcp", description="Sharded (FSDP) checkpoints as single files.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="write DCP checkpoints as .pt files")
    conv.add_argument("--ckpt", required=True, help="the run directory of a --fsdp run, or one of its checkpoint "
                                                    "directories")
    conv.add_argument("--out", default=None, help="the .pt file to write (default, for a run directory: last.pt "
                                                  "and best.pt beside last.dcp and best.dcp)")
    args = parser.parse_args(argv)
    return run_main(lambda: "\n".join(f"wrote {path}" for path in convert(args.ckpt, args.out)))



if __name__ == "__main__":
    raise SystemExit(main())

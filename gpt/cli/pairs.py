"""Prepare a translation-pairs dataset: `gpt pairs` (and `data/prepare.py --pairs`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gpt.cli import ArgumentParser, run_main
from gpt.data.format import TOKENIZERS
from gpt.data.pairs import (
    DEFAULT_BPE_VOCAB,
    DEFAULT_MAX_LEN,
    DEFAULT_VAL_FRACTION,
    prepare_pairs,
    summary,
)


def add_pairs_options(p) -> None:
    """The options only a pairs dataset has (shared by `gpt pairs` and `data/prepare.py`).

    Defaults are None here so a caller can tell which were given; `run` fills them in.
    """
    p.add_argument(
        "--val-pairs",
        nargs=2,
        metavar=("SRC", "TGT"),
        help="validation files (default: hold out --val-fraction of the --pairs lines)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help=f"most tokens per side, the end/start token included (default: {DEFAULT_MAX_LEN})",
    )
    p.add_argument("--truncate", action="store_true", help="cut over-long pairs instead of skipping them")
    p.add_argument("--seed", type=int, default=None, help="seed of the held-out validation lines (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="gpt pairs",
        description="Tokenize parallel text (line i of SRC translates line i of TGT) into a pairs dataset "
        "(the same as `gpt prepare --pairs SRC TGT ...`).",
    )
    p.add_argument("--pairs", nargs=2, metavar=("SRC", "TGT"), required=True, help="training source and target files")
    p.add_argument("--out", required=True, help="output directory, e.g. data/NAME")
    p.add_argument(
        "--tokenizer", choices=TOKENIZERS, default="gpt2", help="one tokenizer for both sides (default: gpt2)"
    )
    p.add_argument("--vocab-size", type=int, help=f"bpe only: ids including end-of-text (default: {DEFAULT_BPE_VOCAB})")
    p.add_argument("--tokenizer-file", help="gpt2 only: local GPT-2 .tiktoken ranks file (else $GPT2_TIKTOKEN_FILE)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help=f"share of the --pairs lines held out without --val-pairs (default: {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    add_pairs_options(p)
    return p


def run(args: argparse.Namespace) -> str:
    """Prepare the dataset the parsed arguments describe (either CLI's); returns its summary."""
    meta = prepare_pairs(
        args.pairs[0],
        args.pairs[1],
        args.out,
        tokenizer=args.tokenizer,
        val_pairs=args.val_pairs,
        val_fraction=DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction,
        max_len=DEFAULT_MAX_LEN if args.max_len is None else args.max_len,
        truncate=args.truncate,
        vocab_size=args.vocab_size,
        tokenizer_file=args.tokenizer_file,
        seed=args.seed or 0,
        force=args.force,
    )
    return summary(meta, args.out)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry (`gpt pairs`): one `error: ...` line and exit status 2 on bad input."""
    args = build_parser().parse_args(argv)
    return run_cli(args)


def run_cli(args: argparse.Namespace) -> int:
    """`run` with the CLI's error handling (also used by `data/prepare.py --pairs`)."""
    return run_main(lambda: run(args), interrupted=f"{args.out} was left as it was")

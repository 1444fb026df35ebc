"""Prepare a memory-mapped token dataset from any text: files, directories, or a mix; or translation pairs.

    python data/prepare.py corpus/ notes.txt --out data/mine --tokenizer gpt2
    python data/prepare.py corpus/ --out data/mine --tokenizer bpe --vocab-size 8192
    python data/prepare.py input.txt --out data/mine_char --tokenizer char --block-size 256
    python data/prepare.py --pairs train.de train.en --val-pairs val.de val.en --out data/de-en --tokenizer bpe
    python data/prepare.py new.txt --out data/new --tokenizer-from out/shakespeare-char --unknown replace

Writes train.bin, val.bin and meta.json (plus tokenizer.tiktoken for bpe) into --out; see the README's
"Prepare data" section, gpt/data/prepare.py for the policies and gpt/data/format.py for the format. Never
imports torch. With --pairs (line i of
SRC translates line i of TGT; no INPUT) it writes a pairs dataset for the seq2seq model instead:
{train,val}.{bin,idx} and meta.json, see gpt/data/pairs.py.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gpt.cli import ArgumentParser, fail, run_main
from gpt.cli.pairs import add_pairs_options, run_cli
from gpt.data.pairs import DEFAULT_VAL_FRACTION
from gpt.data.prepare import TOKENIZERS, prepare
from gpt.data.vocab import UNKNOWN_POLICIES

DEFAULT_BLOCK_SIZE = 1024
TEXT_ONLY = {
    "block_size": "--block-size",
    "strict_utf8": "--strict-utf8",
    "workers": "--workers",
    "tokenizer_from": "--tokenizer-from",
    "unknown": "--unknown",
    "replacement": "--replacement",
}
PAIRS_ONLY = {"val_pairs": "--val-pairs", "max_len": "--max-len", "truncate": "--truncate", "seed": "--seed"}


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="text files and directories (all text files below them)")
    p.add_argument(
        "--pairs",
        nargs=2,
        metavar=("SRC", "TGT"),
        help="instead of INPUTs: parallel files for a seq2seq pairs dataset (line i of SRC translates line i of TGT)",
    )
    p.add_argument("--out", required=True, help="dataset directory to create, e.g. data/NAME")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=None, help="a new tokenizer (default: gpt2)")
    p.add_argument("--vocab-size", type=int, default=None, help="bpe only: ids including end-of-text (default 8192)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help=f"share of the corpus for val (default: 0.1; with --pairs and no --val-pairs: {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument(
        "--tokenizer-file",
        default=None,
        help="gpt2 only: local GPT-2 .tiktoken ranks file (else $GPT2_TIKTOKEN_FILE or tiktoken's download)",
    )
    p.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    text = p.add_argument_group("text datasets (INPUT ...)")
    text.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"each split must hold one window of this + 1 tokens (default: {DEFAULT_BLOCK_SIZE})",
    )
    text.add_argument(
        "--strict-utf8",
        action="store_true",
        help="stop at bytes that are not UTF-8 instead of replacing them by U+FFFD",
    )
    text.add_argument("--workers", type=int, default=None, help="encoding threads (default: all cores)")
    text.add_argument(
        "--tokenizer-from",
        metavar="RUN_OR_DATASET",
        default=None,
        help="encode with the tokenizer of this run, checkpoint, dataset or HF GPT-2 dir, so its models "
        "can be fine-tuned on the text (instead of --tokenizer)",
    )
    text.add_argument(
        "--unknown",
        choices=UNKNOWN_POLICIES,
        default=None,
        help="with --tokenizer-from a char vocabulary: characters it lacks are refused (counted, one "
        "error) or replaced (default: refuse)",
    )
    text.add_argument(
        "--replacement", default=None, help="--unknown replace: the character they become (default: '?', else a space)"
    )
    add_pairs_options(p.add_argument_group("pairs datasets (--pairs SRC TGT)"))
    return p.parse_args(argv)


def mode_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the mix of INPUTs, --pairs and the options of each, if anything."""
    if args.pairs and args.inputs:
        return f"give INPUT files or --pairs SRC TGT, not both (got INPUT {' '.join(args.inputs)})"
    if not args.pairs and not args.inputs:
        return "nothing to prepare: give INPUT files and directories, or --pairs SRC TGT for translation pairs"
    wrong = TEXT_ONLY if args.pairs else PAIRS_ONLY
    given = [flag for key, flag in wrong.items() if getattr(args, key) is not None and getattr(args, key) is not False]
    if given:
        return f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for " + (
            "INPUT text datasets, not --pairs" if args.pairs else "--pairs datasets, not INPUT text"
        )
    unknown = [
        flag for flag, value in (("--unknown", args.unknown), ("--replacement", args.replacement)) if value is not None
    ]
    if unknown and not args.pairs and not args.tokenizer_from:  # they would be ignored
        return (
            f"{', '.join(unknown)}: only with --tokenizer-from (the characters a reused char vocabulary lacks); "
            f"a new vocabulary (--tokenizer) holds every character of its INPUT"
        )
    if args.replacement is not None and args.unknown != "replace":
        return "--replacement: only with --unknown replace (the default refuses unknown characters)"
    return None


def reused(path):
    """--tokenizer-from: a dataset's vocabulary (read without torch), else a run's, checkpoint's or HF directory's."""
    if path is None:
        return None
    from gpt.data.vocab import dataset_spec

    found = dataset_spec(path)
    if found is None:
        from gpt.checkpoints.loader import tokenizer_source  # torch: only for a run, checkpoint or HF directory

        found = tokenizer_source(path)
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = mode_error(args)
    if problem:
        return fail(problem)
    if args.pairs:
        args.tokenizer = args.tokenizer or "gpt2"
        return run_cli(args)
    return run_main(
        lambda: prepare(
            args.inputs,
            args.out,
            args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=0.1 if args.val_fraction is None else args.val_fraction,
            block_size=DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size,
            tokenizer_file=args.tokenizer_file,
            tokenizer_from=reused(args.tokenizer_from),
            unknown=args.unknown or "refuse",
            replacement=args.replacement,
            strict_utf8=args.strict_utf8,
            workers=args.workers,
            force=args.force,
            progress=False if args.quiet else None,
        ).line(),
        interrupted=f"{args.out} was left as it was",
    )


if __name__ == "__main__":
    sys.exit(main())

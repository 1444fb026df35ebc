"""Prepare a memory-mapped token dataset from any text: files, directories, or a mix.

    python data/prepare.py corpus/ notes.txt --out data/mine --tokenizer gpt2
    python data/prepare.py corpus/ --out data/mine --tokenizer bpe --vocab-size 8192
    python data/prepare.py input.txt --out data/mine_char --tokenizer char --block-size 256

Writes train.bin, val.bin and meta.json (plus tokenizer.tiktoken for bpe) into --out; see the README's
"Prepare data" section and gpt/prepare.py for the format and the policies.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gpt.data import DataError  # noqa: E402
from gpt.prepare import TOKENIZERS, prepare  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files and directories (all text files below them)")
    p.add_argument("--out", required=True, help="dataset directory to create, e.g. data/NAME")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2", help="default: %(default)s")
    p.add_argument("--vocab-size", type=int, default=None, help="bpe only: ids including end-of-text (default 8192)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of the corpus for val (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=1024, help="each split must hold one window of this + 1 tokens (default: %(default)s)")
    p.add_argument("--tokenizer-file", default=None, help="gpt2 only: local GPT-2 .tiktoken ranks file (else $GPT2_TIKTOKEN_FILE or tiktoken's download)")
    p.add_argument("--strict-utf8", action="store_true", help="stop at bytes that are not UTF-8 instead of replacing them by U+FFFD")
    p.add_argument("--workers", type=int, default=None, help="encoding threads (default: all cores)")
    p.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        summary = prepare(
            args.inputs, args.out, args.tokenizer, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
            block_size=args.block_size, tokenizer_file=args.tokenizer_file, strict_utf8=args.strict_utf8,
            workers=args.workers, force=args.force, progress=False if args.quiet else None,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; {args.out} was left as it was", file=sys.stderr)
        return 130
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())

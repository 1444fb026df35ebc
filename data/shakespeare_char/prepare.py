"""Tiny Shakespeare as characters (nanoGPT's shakespeare_char): 1.1 MB, 65 characters + end-of-text.

    python data/shakespeare_char/prepare.py                                          # downloads when online
    python data/shakespeare_char/prepare.py --input ../shared/data/tinyshakespeare.txt  # offline copy

Writes train.bin, val.bin and meta.json next to this script (val = the last 10% of the text).
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without installing

from gpt.cli import ArgumentParser, run_main  # noqa: E402
from gpt.data.prepare import fetch, prepare  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", default=None, help=f"local copy of the corpus (default: download {URL} to input.txt here)"
    )
    p.add_argument("--out", default=str(HERE), help="dataset directory (default: this script's directory)")
    p.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    args = p.parse_args(argv)
    return run_main(
        lambda: prepare(
            [args.input or fetch(URL, HERE / "input.txt")], args.out, "char", block_size=256, force=args.force
        ).line(),
        interrupted=f"{args.out} was left as it was",
    )


if __name__ == "__main__":
    sys.exit(main())

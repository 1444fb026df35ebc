"""Multi30k (task 1) German-English translation pairs, tokenized for the seq2seq model.

    python data/multi30k/prepare.py                      # de -> en into data/multi30k/de-en, BPE 8192
    python data/multi30k/prepare.py --src en --tgt de    # the other direction, data/multi30k/en-de
    python data/multi30k/prepare.py --tokenizer gpt2     # GPT-2's BPE (50257 ids) instead

By default one byte-level BPE of 8192 ids is trained on both sides of the training pairs (a few
seconds); `--tokenizer gpt2` or `char` choose the others.

Reads {train,val,test_2016_flickr}.{de,en} from --input (default: the offline copy in
../shared/data/multi30k beside the checkout). train and val become the dataset's splits;
test_2016_flickr stays raw text for BLEU:

    gpt evaluate --ckpt out/multi30k --source-file ../shared/data/multi30k/test_2016_flickr.de \
        --reference ../shared/data/multi30k/test_2016_flickr.en
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gpt.cli import ArgumentParser, run_main  # noqa: E402
from gpt.data.format import TOKENIZERS  # noqa: E402
from gpt.data.pairs import DEFAULT_BPE_VOCAB, prepare_pairs, summary  # noqa: E402


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--input", default=str(ROOT.parent / "shared" / "data" / "multi30k"), help="directory of the raw files"
    )
    p.add_argument("--src", default="de", choices=("de", "en"), help="source language")
    p.add_argument("--tgt", default="en", choices=("de", "en"), help="target language")
    p.add_argument("--out", help="output directory (default: data/multi30k/SRC-TGT)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="bpe", help="one tokenizer for both languages")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"ids of the bpe tokenizer, end-of-text included (bpe only; default {DEFAULT_BPE_VOCAB})",
    )
    p.add_argument("--tokenizer-file", help="GPT-2 .tiktoken ranks file (offline)")
    p.add_argument("--max-len", type=int, default=256, help="most tokens per side, end/start token included")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    if args.src == args.tgt:
        p.error(f"--src and --tgt are both {args.src!r}")
    data = Path(args.input)
    out = Path(args.out or Path(__file__).resolve().parent / f"{args.src}-{args.tgt}")
    return run_main(
        lambda: summary(
            prepare_pairs(
                data / f"train.{args.src}",
                data / f"train.{args.tgt}",
                out,
                tokenizer=args.tokenizer,
                val_pairs=(data / f"val.{args.src}", data / f"val.{args.tgt}"),
                max_len=args.max_len,
                vocab_size=args.vocab_size,
                tokenizer_file=args.tokenizer_file,
                force=args.force,
            ),
            out,
        ),
        interrupted=f"{out} was left as it was",
    )


if __name__ == "__main__":
    raise SystemExit(main())

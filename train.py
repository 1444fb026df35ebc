"""Pretrain or fine-tune a GPT on a prepared dataset: the same as `gpt train` (gpt/cli/train.py).

    python data/shakespeare_char/prepare.py
    python train.py --config shakespeare_char_cpu --data data/shakespeare_char --out-dir out/shakespeare_char
    python train.py --resume out/shakespeare_char                       # continue after a stop
    python train.py --config finetune --data data/shakespeare --init-from out/wikitext --out-dir out/ft
    torchrun --nproc-per-node 2 train.py --data data/shakespeare_char --out-dir out/ddp

`python train.py --help` lists every option with its default.
"""

import sys

from gpt.cli.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python train.py"))

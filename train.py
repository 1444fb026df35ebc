"""Pretrain or fine-tune a GPT on a prepared dataset.

    python data/shakespeare_char/prepare.py
    python train.py --config shakespeare_char_cpu --data data/shakespeare_char --out-dir out/shakespeare_char
    python train.py --resume out/shakespeare_char                       # continue after a stop
    python train.py --config finetune --data data/shakespeare --init-from out/wikitext --out-dir out/ft
    torchrun --nproc-per-node 2 train.py --data data/shakespeare_char --out-dir out/ddp

`python train.py --help` lists every option with its default.
"""

import sys

from gpt.cli import run_main
from gpt.train.config import help_text
from gpt.train.start import resolve_run
from gpt.train.trainer import train


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0

    def body():
        train(resolve_run(argv))

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Pretrain or fine-tune a GPT on a prepared dataset: `gpt train` (train.py in a checkout).

    python data/shakespeare_char/prepare.py
    gpt train --config shakespeare_char_cpu --data data/shakespeare_char --out-dir out/shakespeare_char
    gpt train --resume out/shakespeare_char                       # continue after a stop
    gpt train --config finetune --data data/shakespeare --init-from out/wikitext --out-dir out/ft
    torchrun --nproc-per-node 2 -m gpt train --data data/shakespeare_char --out-dir out/ddp

`gpt train --help` lists every option with its default (gpt/train/config.py owns them; gpt/train/start.py
resolves a command line into a run once).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from gpt.cli import run_main
from gpt.train.flags import help_text


def main(argv: Sequence[str] | None = None, prog: str = "gpt train") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(prog))
        return 0

    stopped_by = []

    def body():
        from gpt.train.start import resolve_run  # torch: after --help
        from gpt.train.trainer import train  # torch: after --help

        stopped_by.append(train(resolve_run(argv))["stopped_by"])

    # a run stopped by a signal saved its work but is not done: 128 + the signal, as a shell reports a killed
    # command (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP, 141 a closed stdout), so `gpt train ... && gpt sample` waits
    status = run_main(body)
    return status or (128 + signal.Signals[stopped_by[0]] if stopped_by and stopped_by[0] else 0)

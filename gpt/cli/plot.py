"""Draw runs' loss curves: `gpt plot`."""

from __future__ import annotations

import signal

from gpt.cli import ArgumentParser, run_main
from gpt.train.plot import plot_runs


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="gpt plot",
        description="Draw training runs' loss curves, LR and gradient norms into one PNG (several runs overlaid).",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or their log.jsonl files)")
    p.add_argument("--out", required=True, help="the PNG file to write")
    args = p.parse_args(argv)
    # SIGTERM and SIGHUP as Ctrl-C: the PNG being written is removed and the old one kept (train.py's figure
    # process gets them with the trainer, e.g. from `timeout` or a closed terminal)
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    before = [signal.signal(s, signal.default_int_handler) for s in signals]
    try:
        return run_main(lambda: f"wrote {plot_runs(args.runs, args.out)}", interrupted=f"{args.out} was left as it was")
    finally:
        for s, handler in zip(signals, before):
            signal.signal(s, handler)

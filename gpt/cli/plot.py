"""Draw runs' loss curves: `python -m gpt.plot`."""

from __future__ import annotations

from gpt.cli import ArgumentParser, run_main
from gpt.train.plot import plot_runs


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m gpt.plot",
        description="Draw train.py runs' loss curves, LR and gradient norms into one PNG (several runs overlaid).",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or their log.jsonl files)")
    p.add_argument("--out", required=True, help="the PNG file to write")
    args = p.parse_args(argv)
    return run_main(lambda: f"wrote {plot_runs(args.runs, args.out)}")


if __name__ == "__main__":
    raise SystemExit(main())

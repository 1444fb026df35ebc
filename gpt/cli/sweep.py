"""A hyperparameter search over `gpt train` runs on Optuna: `gpt sweep` (gpt/train/sweep.py; the search space's
TOML is gpt/train/space.py).

    gpt sweep sweeps/lr.toml --dir sweeps/lr                   # its trials, then the best one; Ctrl-C and rerun goes on
    gpt sweep sweeps/lr.toml --dir sweeps/lr -- --max-iters 200 # `gpt train` options for every trial after `--`
    gpt sweep sweeps/lr.toml --storage journal:/shared/lr.log   # run this on several machines: one study
    gpt sweep sweeps/lr.toml --dir sweeps/lr --report           # the best trial so far, best.toml, sweep.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpt.cli import ArgumentParser, run_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = ArgumentParser(
        prog="gpt sweep",
        description="Search `gpt train` options with Optuna (TPE, median pruning): each trial a real run in its "
        "own directory under --dir; the study resumes where it was when rerun. `gpt train` options for every "
        "trial may follow `--`.",
    )
    p.add_argument("space", help="the search space: a TOML file with [study], [train], [space], [[enqueue]]")
    p.add_argument("--dir", help="the sweep's directory: trials, study.db, best.toml, sweep.png (default: sweeps/NAME)")
    p.add_argument(
        "--storage",
        default="",
        help="the study's Optuna storage: an RDB URL (sqlite:///FILE, postgresql://...) or journal:FILE, shared "
        "by every process of the study (default: SQLite in --dir)",
    )
    p.add_argument("--study", default="", help="the study's name (default: [study] name, else --dir's name)")
    p.add_argument(
        "--trials", type=int, default=0, help="trials in the study, all processes together (default: [study])"
    )
    p.add_argument(
        "--minutes", type=float, default=0.0, help="start no trial after this many minutes (default: no limit)"
    )
    p.add_argument("--no-plot", action="store_true", help="draw no sweep.png (its importances import scikit-learn)")
    p.add_argument("--report", action="store_true", help="run nothing: the best trial so far, best.toml and sweep.png")
    args = p.parse_args(own)

    def body():
        from gpt.train.space import read_space  # torch and Optuna: after --help
        from gpt.train.sweep import Sweep, report, run_sweep  # torch and Optuna: after --help

        space = read_space(args.space, extra)
        directory = Path(args.dir or Path("sweeps") / Path(args.space).stem)
        sweep = Sweep(space, directory, args.storage, args.study, args.trials, extra, args.minutes)
        if not args.report:
            print(run_sweep(sweep), flush=True)
        return "\n".join(report(sweep, with_summary=args.report, plot=not args.no_plot))

    return run_main(body, interrupted="the running trial was saved and recorded as interrupted; rerun to go on")

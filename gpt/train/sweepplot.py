"""See a sweep: its study as one PNG (`gpt sweep --report`, and at the end of every sweep).

    draw_study(study, "sweeps/lr/sweep.png")

Two panels: the objective of each trial against its number (complete trials as dots, pruned ones as crosses at
their last evaluation, the best so far as a step line; failed trials have no value and are not drawn), and each
parameter's importance to the objective (Optuna's `get_param_importances`, fANOVA, over the complete trials;
the panel says so when there are too few for it).

Footguns: matplotlib is imported only when drawing, with the Agg canvas, and the PNG is written atomically by
gpt/train/plot.py's `save_figure`, as `gpt plot` writes its figures.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from gpt.train.plot import save_figure


def draw_study(study, out: str | os.PathLike) -> Path:
    """Draw `study` (module notes) into the PNG `out`; returns its path."""
    from matplotlib.figure import Figure  # optional: plot
    from matplotlib.ticker import MaxNLocator  # optional: plot
    from optuna.trial import TrialState  # optional: the sweep extra (Optuna)

    fig = Figure(figsize=(13, 4.8), layout="constrained")
    by_trial, importance = fig.subplots(1, 2)
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    pruned = [t for t in trials if t.state == TrialState.PRUNED and t.intermediate_values]
    by_trial.set_title(f"study {study.study_name}: objective by trial")
    by_trial.set_xlabel("trial")
    by_trial.set_ylabel("objective (lower is better)")
    by_trial.grid(alpha=0.3)
    by_trial.xaxis.set_major_locator(MaxNLocator(integer=True))
    if done:
        by_trial.plot([t.number for t in done], [t.value for t in done], "o", color="C0", label="complete")
        best, xs, ys = math.inf, [], []
        for t in sorted(done, key=lambda t: t.number):
            best = min(best, t.value)
            xs.append(t.number)
            ys.append(best)
        by_trial.step(xs, ys, where="post", color="C1", label="best so far")
    if pruned:
        last = [t.intermediate_values[max(t.intermediate_values)] for t in pruned]
        by_trial.plot([t.number for t in pruned], last, "x", color="C7", label="pruned (last evaluation)")
    if by_trial.lines:
        by_trial.legend(fontsize=8)
    importance.set_title("parameter importance (fANOVA)")
    scores = _importances(study, done)
    if isinstance(scores, str):
        importance.text(0.5, 0.5, scores, ha="center", va="center", transform=importance.transAxes)
        importance.set_axis_off()
    else:
        names = list(scores)[::-1]
        importance.barh(names, [scores[n] for n in names], color="C0")
        importance.set_xlabel("share of the objective's variance")
    return save_figure(fig, out)


def _importances(study, done: list) -> dict[str, float] | str:
    """Each parameter's importance, or why there is none."""
    if len(done) < 2:
        return "too few complete trials for importances (2 or more)"
    import optuna  # optional: the sweep extra (Optuna)

    try:
        return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError) as e:  # e.g. every complete trial has the same values
        return f"no importances: {str(e)[:80]}"

"""See a run: loss curves and training signals from log.jsonl, as one PNG.

    gpt plot out/ft out/lora --out ft-vs-lora.png      # several runs overlaid, one colour each
    gpt plot out/run/log.jsonl --out run.png

Panels: train and val loss against step, against tokens seen and against training wall time; the
learning rate; the gradient norm (before clipping) and the update-to-weight ratio (log scales); the val
loss in bits per byte (`val_bpb`, token datasets), which compares runs of different tokenizers.
train.py draws the same figure for its own run into OUT_DIR/run.png at every evaluation (`--no-plot`
turns it off), in a separate low-priority process (`FigureWriter`): drawing takes about a second on a
quiet CPU, several on a busy one, and training never waits for it, except for the final figure.

How a log is read
- A resumed run appends to its log.jsonl; a step logged twice (by a process killed after its last
  checkpoint, then again after the resume) keeps its later record.
- Wall time is training time: each process's `elapsed` continues from where the previous process's
  log ended, so the gaps between a stop and a resume are not drawn.
- Tokens come from the train records' running total (`tokens`); evaluations take the total at their
  step. Logs written before that field existed draw no token panel points.
- matplotlib is imported only when drawing, with its non-interactive Agg canvas (no display, no
  global backend switch); reading logs needs neither it nor torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpt.checkpoints.outputs import check_targets
from gpt.errors import UserError, storage_error
from gpt.fsutil import remove_stale_temps, replacing

# The directory holding gpt/ (a checkout or site-packages), for the drawing child's PYTHONPATH: computed once,
# with os.path, so nothing done to pathlib after import (e.g. by a file being loaded) can move it.
_IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

FIGURE_NAME = "run.png"


class PlotError(UserError, ValueError):
    """A run that cannot be drawn (no log, a log that is not JSON lines)."""


@dataclass
class RunLog:
    name: str
    train: list[dict] = field(default_factory=list)  # sorted by step, one record per step
    evals: list[dict] = field(default_factory=list)

    def series(self, kind: str, x: str, y: str) -> tuple[list[float], list[float]]:
        """(xs, ys) of the records of `kind` ("train" or "eval") that have both values."""
        pairs = [
            (r[x], r[y])
            for r in (self.train if kind == "train" else self.evals)
            if r.get(x) is not None and r.get(y) is not None
        ]
        return [a for a, _ in pairs], [b for _, b in pairs]


def log_file(run: str | os.PathLike) -> Path:
    path = Path(run)
    file = path / "log.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise PlotError(
            f"no log.jsonl in {path}: give a run directory written by `gpt train`, or its log.jsonl"
            if path.is_dir()
            else f"no such run or log file: {path}"
        )
    return file


def read_log(run: str | os.PathLike, name: str | None = None) -> RunLog:
    """The train and eval records of a run directory (or its log.jsonl), as the module notes describe."""
    file = log_file(run)
    by_step = {"train": {}, "eval": {}}
    offset, last_elapsed = 0.0, 0.0
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"cannot read {file}: {e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue  # a last line cut short by a killed process
            raise PlotError(f"{file} line {number} is not JSON: not a `gpt train` log") from None
        if not isinstance(record, dict) or record.get("kind") not in by_step or "step" not in record:
            continue
        elapsed = record.get("elapsed")
        if isinstance(elapsed, (int, float)):
            if elapsed < last_elapsed:  # a new process (a resume): continue its clock
                offset += last_elapsed
            last_elapsed = elapsed
            record = dict(record, train_time=offset + elapsed)
        by_step[record["kind"]][record["step"]] = record
    log = RunLog(name or (file.parent.name if file.name == "log.jsonl" else file.stem))
    log.train = [by_step["train"][s] for s in sorted(by_step["train"])]
    log.evals = [by_step["eval"][s] for s in sorted(by_step["eval"])]
    steps, tokens = log.series("train", "step", "tokens")
    for record in log.evals:  # tokens at the evaluation's step, from the running total
        if steps and steps[0] <= record["step"] <= steps[-1]:
            record["tokens"] = _interpolate(record["step"], steps, tokens)
    return log


def _interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """y at `x` on the line through (xs, ys), xs sorted and xs[0] <= x <= xs[-1]."""
    i = next(i for i, v in enumerate(xs) if v >= x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# ---- drawing ----------------------------------------------------------------------------------------

PANELS = [  # (title, x key, x label, [(kind, y key, label suffix, style)], log y)
    ("loss by step", "step", "step", [("train", "loss", "train", "-"), ("eval", "val_loss", "val", "o-")], False),
    (
        "loss by tokens",
        "tokens",
        "tokens seen",
        [("train", "loss", "train", "-"), ("eval", "val_loss", "val", "o-")],
        False,
    ),
    (
        "loss by training time",
        "train_time",
        "seconds",
        [("train", "loss", "train", "-"), ("eval", "val_loss", "val", "o-")],
        False,
    ),
    ("learning rate", "step", "step", [("train", "lr", "", "-")], False),
    ("gradient norm (before clipping)", "step", "step", [("train", "grad_norm", "", "-")], True),
    ("update / weight ratio", "step", "step", [("train", "update_ratio", "", "o-")], True),
    # the one loss that compares across tokenizers (char, own BPE, GPT-2): runs that log no val_bpb draw none
    ("val bits per byte", "step", "step", [("eval", "val_bpb", "val", "o-")], False),
]


def draw(logs: list[RunLog]):
    """A matplotlib Figure of the runs (see PANELS); not saved."""
    from matplotlib.figure import Figure  # optional: plot

    fig = Figure(figsize=(20, 8.5), layout="constrained")
    axes = fig.subplots(2, 4).flatten()
    for ax in axes[len(PANELS) :]:
        fig.delaxes(ax)
    colours = [f"C{i % 10}" for i in range(len(logs))]
    for ax, (title, x, xlabel, lines, log_y) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        for log, colour in zip(logs, colours):
            for kind, y, suffix, style in lines:
                xs, ys = log.series(kind, x, y)
                if xs:
                    label = f"{log.name} {suffix}".strip()
                    ax.plot(
                        xs,
                        ys,
                        style,
                        color=colour,
                        label=label,
                        markersize=3,
                        alpha=0.45 if (kind == "train" and len(lines) > 1) else 1.0,
                        linewidth=1.2,
                    )
        if log_y and ax.lines:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=7)
    return fig


def save_figure(fig, out: str | os.PathLike) -> Path:
    """Write `fig` as a PNG atomically (a reader never sees half a file)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional: plot

    out = Path(out)
    try:
        FigureCanvasAgg(fig)
        with replacing(out) as tmp:
            fig.savefig(tmp, format="png", dpi=90)
    except OSError as e:
        raise storage_error(e, "write", out) from None
    return out


def plot_runs(runs: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Draw the runs (directories or log.jsonl files) into the PNG `out` (replaced if it exists, but never a run's
    own file: gpt/checkpoints/outputs.py)."""
    check_targets([out], force=True)
    logs = [read_log(run) for run in runs]
    names = [log.name for log in logs]
    for log, run in zip(logs, runs):
        if names.count(log.name) > 1:
            log.name = str(run)  # two runs of the same name: tell them apart by path
    return save_figure(draw(logs), out)


class FigureWriter:
    """OUT_DIR/run.png for the trainer, drawn by `gpt plot` in a child process at low priority.

    One drawing at a time: an evaluation that comes while one runs leaves it be (the next drawing reads
    the whole log anyway). `close()` waits for it and, if an evaluation came since it started, draws
    once more, so the final figure has every evaluation. A failure (matplotlib missing, a full disk) is
    one warning, and no more figures: it never stops training.
    """

    def __init__(
        self, out_dir: str | os.PathLike, warn: Callable[[str], None], enabled: bool = True, timeout: float = 120.0
    ):
        self.out_dir, self.warn, self.enabled, self.timeout = Path(out_dir), warn, enabled, timeout
        self.process: subprocess.Popen | None = None
        self.stale = False  # an evaluation came after the running drawing started

    def update(self) -> None:
        if not self.enabled:
            return
        if self.process is not None and self.process.poll() is None:
            self.stale = True
            return
        self._check()
        if self.enabled:
            self._start()

    def close(self) -> None:
        if not self.enabled or self.process is None:
            return
        self._wait()
        if self.stale and self.enabled:
            self._start()
            self._wait()

    def _start(self) -> None:
        # `python -c` puts the working directory first on sys.path, before PYTHONPATH: a folder holding a
        # package named gpt (a downloaded checkpoint's, say) would be imported instead of ours. The child's first
        # statement puts our root in that place.
        code = (
            f"import sys; sys.path[0] = {_IMPORT_ROOT!r}; import os; os.nice(10); from gpt.cli.plot import main; "
            f"sys.exit(main([{str(self.out_dir)!r}, '--out', {str(self.out_dir / FIGURE_NAME)!r}]))"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_IMPORT_ROOT, os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
        )
        self.stale = False

    def _wait(self) -> None:
        try:
            self.process.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._check()

    def _check(self) -> None:
        """Warn (once, then stop drawing) if the last drawing failed."""
        if self.process is None or self.process.returncode in (0, None):
            return
        remove_stale_temps(self.out_dir, FIGURE_NAME)  # the PNG a killed drawing was writing (it has exited)
        lines = (self.process.stderr.read() or "").strip().splitlines() or [f"exit status {self.process.returncode}"]
        self.enabled = False
        self.warn(
            f"warning: could not draw {self.out_dir / FIGURE_NAME} ({lines[-1][:200]}); training goes on without it"
        )

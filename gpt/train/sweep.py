"""A hyperparameter search over `gpt train` runs, on Optuna: the study behind `gpt sweep`.

    sweep = Sweep(read_space("sweeps/lr.toml"), Path("sweeps/lr"))
    run_sweep(sweep)          # trials until the study has its number of them; a rerun goes on where it was
    report(sweep)             # the best trial's command line, best.toml and sweep.png

Each trial is a real `gpt train` run in its own directory, SWEEP_DIR/trial-NNNN (its checkpoints, log.jsonl and
run.png kept; its console in SWEEP_DIR/trial-NNNN.log), in a child process: Optuna's TPE sampler picks its values
from the search space (gpt/train/space.py), and after each of its evaluations the child asks this process over
a pipe whether to go on: the value (val bits per byte when the run logs it, else val loss) is reported to the
trial and the pruner (median: worse than the median of earlier trials at that step) may stop it there, its
last.pt saved. The trial's objective is its best evaluation. A run that fails (a training error, a model the
values make invalid) is a failed trial with its error line, and the study goes on.

The study lives in its storage: an SQLite file, SWEEP_DIR/study.db, unless `storage` names another (any Optuna
RDB URL, e.g. postgresql://..., or `journal:PATH` for Optuna's journal file); every process given the same
storage and study name works on the same study, each asking for the next trial when it is free, until the
study holds its number of trials. Ctrl-C (SIGINT, SIGTERM, SIGHUP) stops the running trial as `gpt train` stops
(finish the step, save), records it as failed and interrupted (not counted: its values are tried no more), and
ends the sweep; running the same command again goes on with the trials still to do.

Footguns:
- A trial whose sweep process was killed outright (SIGKILL, a lost machine) stays RUNNING in the study and
  counts as one of its trials. A sweep started later on the same host records such a trial as failed (its
  process is gone); one on another host cannot tell, so that trial stays counted.
- Two processes may start a trial each when one is still to do: the one numbered past the study's count is
  recorded as failed and not counted (`surplus`), never run.
- W&B: trials log to it when the options give --wandb-project, grouped by the study's name (WANDB_RUN_GROUP),
  offline unless --wandb-mode or WANDB_MODE says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpt.errors import ConfigError, UserError, storage_error
from gpt.fsutil import replacing
from gpt.train.flags import build_config
from gpt.train.space import Space, as_flag_value

# The directory holding gpt/, first on the trial child's sys.path (as gpt/train/plot.py's FigureWriter does).
_IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
STOPPED = {128 + int(s) for s in SIGNALS}  # a trial's exit status when a signal stopped it (saved)


@dataclass
class Sweep:
    space: Space
    directory: Path
    storage: str = ""  # an Optuna storage URL or journal:PATH; "" = SQLite in `directory`
    study_name: str = ""  # "" = [study] name, else the directory's name
    trials: int = 0  # 0 = [study] trials
    extra: list[str] = field(default_factory=list)  # `gpt train` options from the command line (after `--`)
    minutes: float = 0.0  # start no trial after this many minutes (0 = no limit)
    echo: Callable[[str], None] = print

    def __post_init__(self):
        self.directory = Path(self.directory)
        self.study_name = self.study_name or self.space.study["name"] or self.directory.resolve().name
        self.trials = self.trials or self.space.study["trials"]
        if self.trials < 1:
            raise ConfigError(f"--trials: at least 1, got {self.trials}")


# ---- the study ------------------------------------------------------------------------------------------


def _optuna():
    try:
        import optuna  # optional: the sweep extra (Optuna)
    except ImportError:
        raise UserError('gpt sweep needs Optuna: pip install -e ".[sweep]"') from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def storage_for(sweep: Sweep):
    """The study's Optuna storage: `journal:PATH`, an RDB URL, or SQLite in the sweep's directory."""
    optuna = _optuna()
    url = sweep.storage or f"sqlite:///{(sweep.directory / 'study.db').resolve()}"
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend, JournalStorage  # optional: the sweep extra (Optuna)

            return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
        return optuna.storages.RDBStorage(url)
    except Exception as e:  # a bad URL, a missing driver, a database that is not there
        raise UserError(f"--storage: cannot open {url} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def open_study(sweep: Sweep, create: bool = True):
    """(study, storage): the study of the sweep's name, created (with the [[enqueue]] trials) if new."""
    optuna = _optuna()
    if not create and not sweep.storage and not (sweep.directory / "study.db").is_file():
        raise UserError(f"no sweep in {sweep.directory} (no study.db there): run it first, without --report")
    if create:
        try:
            sweep.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--dir: cannot create {sweep.directory} ({e.strerror or e})") from None
    storage = storage_for(sweep)
    s = sweep.space.study
    pruner = (
        optuna.pruners.MedianPruner(n_startup_trials=s["startup_trials"], n_warmup_steps=s["warmup_steps"])
        if s["pruner"] == "median"
        else optuna.pruners.NopPruner()
    )
    sampler = optuna.samplers.TPESampler(n_startup_trials=max(s["startup_trials"], 1), seed=s["seed"])
    if not create:
        try:
            return optuna.load_study(
                study_name=sweep.study_name, storage=storage, sampler=sampler, pruner=pruner
            ), storage
        except KeyError:
            raise UserError(
                f"no study {sweep.study_name!r} in {sweep.storage or sweep.directory / 'study.db'}"
            ) from None
    study = optuna.create_study(
        study_name=sweep.study_name,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        direction="minimize",
        load_if_exists=True,
    )
    if not study.get_trials(deepcopy=False):
        for values in sweep.space.enqueue:
            study.enqueue_trial(values, skip_if_exists=True)
    return study, storage


def counted(study) -> list:
    """The trials that count toward the study's number: running or finished, but not interrupted or surplus."""
    from optuna.trial import TrialState  # optional: the sweep extra (Optuna)

    states = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return [t for t in study.get_trials(deepcopy=False) if t.state in states and not t.user_attrs.get("not_counted")]


def fail_gone(study, storage) -> None:
    """Record as failed (interrupted) the RUNNING trials of this host whose sweep process is gone."""
    from optuna.trial import TrialState  # optional: the sweep extra (Optuna)

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("host") != socket.gethostname() or _alive(t.user_attrs.get("pid")):
            continue
        storage.set_trial_user_attr(t._trial_id, "not_counted", True)
        storage.set_trial_user_attr(t._trial_id, "error", "interrupted: its sweep process is gone")
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_sweep(sweep: Sweep) -> str:
    """Run trials until the study holds `sweep.trials` of them (or the time is up); the summary line.
    Raises KeyboardInterrupt after recording the trial a signal stopped."""
    from optuna.trial import TrialState  # optional: the sweep extra (Optuna)

    study, storage = open_study(sweep)
    fail_gone(study, storage)
    deadline = time.time() + 60 * sweep.minutes if sweep.minutes else None
    space = sweep.space
    distributions = {p.name: p.distribution() for p in space.params}
    ran = 0
    while len(counted(study)) < sweep.trials:
        if deadline and time.time() >= deadline:
            sweep.echo(f"time is up (--minutes {sweep.minutes:g}): no more trials from this process")
            break
        trial = study.ask(distributions)
        if sum(t.number < trial.number for t in counted(study)) >= sweep.trials:  # another process took the last
            trial.set_user_attr("not_counted", True)
            trial.set_user_attr("error", "surplus: the study had its trials")
            study.tell(trial, state=TrialState.FAIL)
            break
        run_trial(sweep, study, trial)
        ran += 1
    return summary(study, sweep, ran)


def summary(study, sweep: Sweep, ran: int | None = None) -> str:
    trials = counted(study)
    states = [t.state.name.lower() for t in trials]
    counts = ", ".join(f"{states.count(s)} {s}" for s in ("complete", "pruned", "fail", "running") if s in states)
    done = f"{ran} run by this process; " if ran is not None else ""
    return f"study {sweep.study_name}: {len(trials)} of {sweep.trials} trials ({done}{counts or 'none yet'})"


# ---- one trial: a `gpt train` child process --------------------------------------------------------------


def trial_argv(sweep: Sweep, number: int, values: dict) -> tuple[list[str], dict, int]:
    """A trial's `gpt train` options, the environment of its process (W&B's group and mode) and its last step."""
    out_dir = sweep.directory / f"trial-{number:04d}"
    argv = [*sweep.space.argv(values, sweep.extra), "--out-dir", str(out_dir)]
    env = dict(os.environ)
    cfg = build_config(argv)
    if cfg.wandb_project:
        env["WANDB_RUN_GROUP"] = sweep.study_name
        if not cfg.wandb_mode and "WANDB_MODE" not in env:
            argv += ["--wandb-mode", "offline"]
        if not cfg.wandb_run_name:
            argv += ["--wandb-run-name", f"{sweep.study_name}-trial-{number:04d}"]
    return argv, env, cfg.max_iters


def run_trial(sweep: Sweep, study, trial) -> None:
    """Run one trial to its end (complete, pruned or failed) and tell the study; KeyboardInterrupt after
    telling it when a signal stopped it."""
    from optuna.trial import TrialState  # optional: the sweep extra (Optuna)

    metric = sweep.space.study["metric"]
    values = dict(trial.params)
    shown = " ".join(f"{k}={as_flag_value(v) if not isinstance(v, float) else f'{v:.4g}'}" for k, v in values.items())
    sweep.echo(f"trial {trial.number}: {shown}")
    try:
        argv, env, last = trial_argv(sweep, trial.number, values)
    except ConfigError as e:  # values this model refuses (heads that do not divide the width): a failed trial
        return _fail(sweep, study, trial, str(e).splitlines()[0])
    for key, value in (("host", socket.gethostname()), ("pid", os.getpid()), ("argv", argv)):
        trial.set_user_attr(key, value)
    console = sweep.directory / f"trial-{trial.number:04d}.log"
    questions_in, questions_out = os.pipe()  # the child's questions (read here, written there): a JSON line each
    answers_in, answers_out = os.pipe()  # the answers (written here, read there): go | stop
    code = f"import sys; sys.path[0] = {_IMPORT_ROOT!r}; from gpt.train.sweep import child_main; sys.exit(child_main(sys.argv[1:]))"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_IMPORT_ROOT, env.get("PYTHONPATH")]))
    signals, procs = [], []

    def stop(signum, frame):  # the child stops as a signalled `gpt train` does: finish the step, save
        signals.append(signum)
        if procs and procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    before = {s: signal.signal(s, stop) for s in SIGNALS}  # before the child starts: it is never left behind
    try:
        with open(console, "w", encoding="utf-8") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, str(answers_in), str(questions_out), *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(answers_in, questions_out),
                    env=env,
                )
            )
    except BaseException:
        for s, handler in before.items():
            signal.signal(s, handler)
        raise
    finally:
        os.close(answers_in)  # the child's ends: its exit then ends the questions
        os.close(questions_out)
    proc = procs[0]
    if signals:  # a signal came while it started
        proc.send_signal(signal.SIGTERM)
    best, pruned_at, problem, used = math.inf, None, "", metric
    try:
        with os.fdopen(questions_in, encoding="utf-8") as questions, os.fdopen(answers_out, "w") as answers:
            for line in questions:
                record = json.loads(line)
                used = "val_loss" if metric == "val_loss" or record["val_bpb"] is None else "val_bpb"
                if used != metric and metric == "val_bpb":
                    problem = "the run logs no val bits per byte (metric = val_bpb): not a token dataset"
                value = record[used]
                best = min(best, value)
                trial.report(value, record["step"])
                # a run at its last step has ended anyway: complete, whatever the pruner says
                prune = bool(problem) or (not signals and record["step"] < last and trial.should_prune())
                pruned_at = record["step"] if prune and not problem else pruned_at
                try:
                    answers.write("stop\n" if prune else "go\n")
                    answers.flush()
                except OSError:  # the child has gone
                    break
        status = proc.wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if signals or status in STOPPED:
        trial.set_user_attr("not_counted", True)
        _fail(
            sweep,
            study,
            trial,
            f"interrupted (exit status {status}); its run is in {argv[argv.index('--out-dir') + 1]}",
        )
        raise KeyboardInterrupt
    if status != 0 or problem or not math.isfinite(best):
        return _fail(sweep, study, trial, problem or _last_error(console, status))
    trial.set_user_attr("metric", used)
    if pruned_at is not None:
        study.tell(trial, state=TrialState.PRUNED)
        sweep.echo(f"trial {trial.number}: pruned at step {pruned_at} (best {best:.4f}); {_best_so_far(study)}")
    else:
        study.tell(trial, best)
        sweep.echo(f"trial {trial.number}: {best:.4f}; {_best_so_far(study)}")


def _fail(sweep: Sweep, study, trial, error: str) -> None:
    from optuna.trial import TrialState  # optional: the sweep extra (Optuna)

    trial.set_user_attr("error", error)
    study.tell(trial, state=TrialState.FAIL)
    sweep.echo(f"trial {trial.number}: failed: {error}")


def _last_error(console: Path, status: int) -> str:
    try:
        lines = [line for line in console.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or [f"exit status {status}"])[-1][:300] + f" (exit status {status}; see {console})"


def _best_so_far(study) -> str:
    try:
        best = study.best_trial
    except ValueError:
        return "no trial complete yet"
    return f"best so far: trial {best.number}, {best.value:.4f}"


def child_main(argv: list[str]) -> int:
    """A trial's process: `gpt train` with the options argv[2:], asking the sweep over the pipes argv[0] (its
    answers) and argv[1] (its questions) after each evaluation whether to stop. The exit status of `gpt train`."""
    answers, questions = os.fdopen(int(argv[0]), encoding="utf-8"), os.fdopen(int(argv[1]), "w")

    def after_eval(step: int, val_loss: float, val_bpb: float | None) -> bool:
        try:
            questions.write(json.dumps({"step": step, "val_loss": val_loss, "val_bpb": val_bpb}) + "\n")
            questions.flush()
            return answers.readline().strip() == "stop"
        except OSError:  # the sweep has gone: train on
            return False

    try:
        from gpt.train.start import resolve_run  # torch: in the child only
        from gpt.train.trainer import train  # torch: in the trial process only

        stopped_by = train(dataclasses.replace(resolve_run(argv[2:]), after_eval=after_eval))["stopped_by"]
    except UserError as e:
        print(f"error: {e}".replace("\n", "\n  "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 128 + signal.Signals[stopped_by] if stopped_by else 0


# ---- the result -----------------------------------------------------------------------------------------


def report(sweep: Sweep, with_summary: bool = True, plot: bool = True) -> list[str]:
    """The best trial's command line; writes SWEEP_DIR/best.toml (its values) and SWEEP_DIR/sweep.png (if `plot`)."""
    study, _ = open_study(sweep, create=False)
    lines = [summary(study, sweep)] if with_summary else []
    png = None
    if plot:
        from gpt.train.sweepplot import draw_study  # matplotlib and scikit-learn: only when drawing

        png = draw_study(study, sweep.directory / "sweep.png")
    try:
        best = study.best_trial
    except ValueError:
        return [*lines, "no trial has completed yet", *([f"wrote {png}"] if png else [])]
    command = "gpt train " + shlex.join(best.user_attrs.get("argv") or sweep.space.argv(best.params, sweep.extra))
    metric = best.user_attrs.get("metric", sweep.space.study["metric"])
    toml = sweep.directory / "best.toml"
    body = [
        f"# gpt sweep {sweep.study_name}: the best trial, {best.number} ({metric} {best.value:.4f}); its values.",
        f"# It ran as: {command}",
        "",
        *(f"{k} = {_toml_value(v)}" for k, v in best.params.items()),
    ]
    try:
        with replacing(toml) as tmp:
            Path(tmp).write_text("\n".join(body) + "\n", encoding="utf-8")
    except OSError as e:
        raise storage_error(e, "write", toml) from None
    return [
        *lines,
        f"best: trial {best.number}, {metric} {best.value:.4f}",
        f"its command: {command}",
        f"wrote {toml} (its values)" + (f" and {png}" if png else ""),
    ]


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)

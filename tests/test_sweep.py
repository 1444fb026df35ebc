"""`gpt sweep`: a study of tiny `gpt train` runs runs to its end, prunes a bad trial at its first evaluation, records
a failed one and goes on, resumes after Ctrl-C without redoing a finished trial, and two processes on one storage
split its trials. Every trial is a real run in a child process (about 2-4 s each: importing torch)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, one_line_error

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402

from gpt.cli.sweep import main  # noqa: E402

TRAIN = """
[train]
data = "{data}"
n_layer = 1
n_head = 2
n_embd = 16
block_size = 16
batch_size = 2
eval_iters = 1
log_interval = 1
warmup_iters = 1
device = "cpu"
dtype = "float32"
threads = 1
plot = false
max_iters = {steps}
min_lr = 0.0
eval_interval = {every}
"""


def write_space(path, data, study="", space="", enqueue="", steps=8, every=2):
    path.write_text(
        f"[study]\n{study}\n{TRAIN.format(data=data, steps=steps, every=every)}\n[space]\n{space}\n{enqueue}",
        encoding="utf-8",
    )
    return path


def load(directory, name):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{directory / 'study.db'}")


def last_step(run) -> int:
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return max(r["step"] for r in records if r["kind"] == "train")


def sweep_process(*argv):
    return subprocess.Popen(
        [sys.executable, "-m", "gpt", "sweep", *map(str, argv)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_study_runs_to_its_end_prunes_a_bad_trial_and_survives_a_failed_one(tiny_char_data, tmp_path, capsys):
    # three trials in a fixed order: a good one, one whose run fails (no such dataset), one at a learning rate
    # too low to learn anything, which the median pruner stops at its first evaluation (step 2 of 8)
    space = write_space(
        tmp_path / "space.toml",
        tiny_char_data,
        study="trials = 3\nstartup_trials = 1",
        space=f'learning_rate = {{ low = 1e-6, high = 3e-2, log = true }}\ndata = {{ choices = ["{tiny_char_data}", '
        f'"{tmp_path / "missing"}"] }}',
        enqueue="".join(
            f'[[enqueue]]\nlearning_rate = {lr}\ndata = "{data}"\n'
            for lr, data in ((1e-2, tiny_char_data), (1e-2, tmp_path / "missing"), (1e-6, tiny_char_data))
        ),
    )
    directory = tmp_path / "sweep"
    assert main([str(space), "--dir", str(directory)]) == 0
    out = capsys.readouterr().out
    study = load(directory, "sweep")
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED]
    assert "no dataset" in trials[1].user_attrs["error"] or "missing" in trials[1].user_attrs["error"]
    assert last_step(directory / "trial-0002") == 2  # stopped at its first evaluation, not at step 8
    assert last_step(directory / "trial-0000") == 8
    assert (directory / "trial-0002" / "last.pt").is_file()  # the pruned run saved, as a stopped run does
    # the objective is the run's best val bits per byte, as its log says
    evals = [json.loads(line) for line in (directory / "trial-0000" / "log.jsonl").read_text().splitlines()]
    assert study.best_trial.number == 0
    assert study.best_value == pytest.approx(min(r["val_bpb"] for r in evals if r["kind"] == "eval"))
    assert "best: trial 0, val_bpb" in out and "--learning-rate 0.01 " in out
    assert "learning_rate = 0.01" in (directory / "best.toml").read_text()
    assert (directory / "sweep.png").stat().st_size > 0


def test_an_interrupted_sweep_resumes_without_redoing_a_finished_trial(tiny_char_data, tmp_path):
    space = write_space(
        tmp_path / "space.toml",
        tiny_char_data,
        study="trials = 2",
        space="learning_rate = { low = 1e-3, high = 3e-2, log = true }",
        steps=400,  # long enough to be stopped in the middle (a second or two), one evaluation at the end
        every=400,
    )
    directory = tmp_path / "sweep"
    first = sweep_process(space, "--dir", directory, "--no-plot")
    log = directory / "trial-0001" / "log.jsonl"
    deadline = time.time() + 60
    while not (log.is_file() and log.stat().st_size) and first.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    first.send_signal(signal.SIGINT)  # to the sweep only: it stops its trial as Ctrl-C would
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130, err
    assert err.count("\n") == 1 and "interrupted" in err, err
    study = load(directory, "sweep")
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE, TrialState.FAIL]
    assert study.get_trials()[1].user_attrs["not_counted"]
    assert 0 < last_step(directory / "trial-0001") < 400  # saved where it was stopped
    finished = (directory / "trial-0000" / "log.jsonl").stat().st_mtime_ns

    second = sweep_process(space, "--dir", directory, "--no-plot")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    trials = load(directory, "sweep").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert (directory / "trial-0000" / "log.jsonl").stat().st_mtime_ns == finished  # not run again
    assert "2 of 2 trials (1 run by this process; 2 complete)" in out


def test_two_processes_on_one_storage_split_the_trials(tiny_char_data, tmp_path):
    space = write_space(
        tmp_path / "space.toml",
        tiny_char_data,
        study="trials = 3",
        space="learning_rate = { low = 1e-3, high = 3e-2, log = true }",
        steps=4,
    )
    storage = f"journal:{tmp_path / 'study.journal'}"  # Optuna's journal file, as several machines would share
    runs = [
        sweep_process(space, "--dir", tmp_path / f"machine{i}", "--storage", storage, "--study", "s", "--no-plot")
        for i in (0, 1)
    ]
    outs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outs
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    study = optuna.load_study(
        study_name="s", storage=JournalStorage(JournalFileBackend(str(tmp_path / "study.journal")))
    )
    done = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert len(done) == 3  # each trial run once, by one of them
    ran = {i: sorted(p.name for p in (tmp_path / f"machine{i}").glob("trial-*") if p.is_dir()) for i in (0, 1)}
    assert sorted(ran[0] + ran[1]) == [f"trial-{t.number:04d}" for t in done]
    assert ran[0] and ran[1], ran  # both took part


@pytest.mark.parametrize(
    "space, needle",
    [
        ("learning_rat = { low = 1e-3, high = 1e-2 }", "learning_rat: not a `gpt train` option"),
        ("learning_rate = { low = 1e-2, high = 1e-3 }", "low must be below high"),
        ("learning_rate = { low = 0.0, high = 1e-3, log = true }", "log-scale range must be above 0"),
        ("n_layer = { low = 1.5, high = 4 }", "integer bounds"),
        ("out_dir = { choices = ['a', 'b'] }", "the sweep sets it"),
        ("learning_rate = [1, 2]", "expected { low"),
        ("learning_rate = { low = 1e-3 ", "not valid TOML"),
    ],
)
def test_a_bad_search_space_is_one_line(tiny_char_data, tmp_path, capsys, space, needle):
    path = write_space(tmp_path / "space.toml", tiny_char_data, space=space)
    err = one_line_error(capsys, main, path, "--dir", tmp_path / "sweep")
    assert needle in err, err
    assert not (tmp_path / "sweep").exists()  # nothing started


def test_a_missing_space_file_or_dataset_is_one_line(tiny_char_data, tmp_path, capsys):
    assert "cannot read the search space" in one_line_error(capsys, main, tmp_path / "nope.toml")
    path = write_space(
        tmp_path / "space.toml", tmp_path / "nodata", space="learning_rate = { low = 1e-3, high = 1e-2 }"
    )
    assert "no dataset directory" in one_line_error(capsys, main, path, "--dir", tmp_path / "sweep")


def test_a_report_of_no_sweep_or_a_bad_storage_is_one_line(tiny_char_data, tmp_path, capsys):
    path = write_space(tmp_path / "space.toml", tiny_char_data, space="learning_rate = { low = 1e-3, high = 1e-2 }")
    assert "no sweep in" in one_line_error(capsys, main, path, "--dir", tmp_path / "none", "--report")
    err = one_line_error(capsys, main, path, "--dir", tmp_path / "sweep", "--storage", "nosuch://x")
    assert "--storage: cannot open nosuch://x" in err


def test_a_trial_whose_sweep_process_is_gone_is_recorded_as_failed(tiny_char_data, tmp_path):
    # a sweep killed outright (SIGKILL) leaves its trial RUNNING; a later sweep on this host records it as failed
    import socket

    from gpt.train.space import read_space
    from gpt.train.sweep import Sweep, counted, fail_gone, open_study

    path = write_space(tmp_path / "space.toml", tiny_char_data, space="learning_rate = { low = 1e-3, high = 1e-2 }")
    sweep = Sweep(read_space(path), tmp_path / "sweep")
    study, storage = open_study(sweep)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for pid in (int(gone.stdout), os.getpid()):  # one process gone, one alive (this one)
        trial = study.ask()
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", pid)
    fail_gone(study, storage)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.RUNNING]
    assert [t.number for t in counted(study)] == [1]  # the failed one is not counted: another trial takes its place

"""See the run: gpt/train/plot.py reads train.py's log.jsonl (resumes included) and draws the PNG; training
draws it at each evaluation; --tensorboard writes event files."""

import json

import numpy as np
import pytest
from conftest import (
    TRAIN,
    one_line_error,
    train_run,
)

from gpt.cli import plot as cli_plot
from gpt.train import plot

pytestmark = pytest.mark.usefixtures("one_thread")


def write_log(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train(step, loss, elapsed, tokens, lr=1e-3, grad_norm=1.0, **extra):
    return dict(kind="train", step=step, loss=loss, lr=lr, grad_norm=grad_norm, elapsed=elapsed, tokens=tokens, **extra)


def evaluation(step, val, elapsed, **extra):
    return dict(kind="eval", step=step, train_loss=val - 0.1, val_loss=val, elapsed=elapsed, **extra)


@pytest.fixture
def resumed_run(tmp_path):
    """Steps 10..30, killed after step 30 with its last checkpoint at 20, resumed there."""
    return write_log(
        tmp_path / "a",
        [
            train(10, 3.0, 5.0, 1000),
            train(20, 2.5, 10.0, 2000, update_ratio=1e-3),
            evaluation(20, 2.6, 11.0),
            train(30, 9.9, 15.0, 3000),  # logged by the killed process: replaced after the resume
            {"kind": "summary", "step": 30},
            train(30, 2.2, 4.0, 3000),
            evaluation(30, 2.3, 5.0),
            train(40, 2.0, 8.0, 4000),
            evaluation(35, 2.25, 6.0),
        ],
    )


def test_a_resumed_log_reads_as_one_run(resumed_run):
    log = plot.read_log(resumed_run)
    assert log.name == "a"
    assert log.series("train", "step", "loss") == ([10, 20, 30, 40], [3.0, 2.5, 2.2, 2.0])  # the later step 30
    # the second process's clock continues from the first one's last record (15 s)
    assert log.series("train", "step", "train_time") == ([10, 20, 30, 40], [5.0, 10.0, 19.0, 23.0])
    # evaluations take the running token total at their step (35: between the records of 30 and 40)
    assert log.series("eval", "step", "tokens") == ([20, 30, 35], [2000, 3000, 3500.0])


def test_the_png_has_every_panel_and_run(resumed_run, tmp_path):
    other = write_log(tmp_path / "b", [train(10, 3.5, 2.0, 500, lr=2e-3), evaluation(10, 3.4, 3.0, val_bpb=1.7)])
    fig = plot.draw([plot.read_log(resumed_run), plot.read_log(other)])
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert list(panels) == [p[0] for p in plot.PANELS]

    def lines(title):
        return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in panels[title].lines}

    assert lines("loss by tokens")["a val"] == ([2000, 3000, 3500.0], [2.6, 2.3, 2.25])
    assert lines("loss by tokens")["b train"] == ([500], [3.5])
    assert lines("loss by training time")["a train"][0] == [5.0, 10.0, 19.0, 23.0]
    assert lines("learning rate")["b"] == ([10], [2e-3])
    assert lines("update / weight ratio") == {"a": ([20], [1e-3])}
    assert panels["gradient norm (before clipping)"].get_yscale() == "log"
    assert lines("val bits per byte") == {"b val": ([10], [1.7])}  # run a logged none (a log from before val_bpb)

    out = tmp_path / "runs.png"
    assert cli_plot.main([str(resumed_run), str(other / "log.jsonl"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(out)
    assert pixels.shape[:2] == (765, 1800)  # 20 x 8.5 inches at 90 dpi: 2 rows of 4 panels
    assert len(np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)) > 50  # drawn, not a blank canvas


def test_a_run_without_a_log_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, cli_plot.main, str(tmp_path / "empty"), "--out", str(tmp_path / "x.png"))
    assert f"no log.jsonl in {tmp_path / 'empty'}" in err


def test_training_draws_its_run_and_writes_tensorboard(base, tiny_char_data, tmp_path):
    out = tmp_path / "run"
    train_run(
        "--data",
        tiny_char_data,
        "--out-dir",
        out,
        "--init-from",
        base,
        *TRAIN,
        "--max-iters",
        "4",
        "--eval-interval",
        "2",
        "--tensorboard",
        "--plot",
    )
    assert (out / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert plot.read_log(out).series("eval", "step", "val_loss")[0] == [2, 4]
    assert plot.read_log(out).series("train", "step", "tokens") == ([1, 2, 3, 4], [32, 64, 96, 128])  # 2 x 16 a step

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/grad_norm", "eval/val_loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("eval/val_loss")] == [2, 4]


def test_a_figure_that_cannot_be_drawn_is_one_warning_and_training_goes_on(tmp_path):
    said = []
    writer = plot.FigureWriter(tmp_path / "no-run", said.append)  # no log.jsonl there: the drawing fails
    writer.update()
    writer.close()
    assert said == [
        f"warning: could not draw {tmp_path / 'no-run' / 'run.png'} (error: no such run or log file: "
        f"{tmp_path / 'no-run'}); training goes on without it"
    ]
    writer.update()  # no more attempts
    assert writer.process.returncode == 2 and len(said) == 1


def test_the_drawing_child_never_imports_a_gpt_package_from_the_working_directory(resumed_run, tmp_path, monkeypatch):
    """A trainer started in a folder that holds a package named `gpt` (say, inside a downloaded checkpoint) must
    not run it in the drawing child: `python -c` puts the working directory before PYTHONPATH."""
    planted = tmp_path / "cwd" / "gpt"
    planted.mkdir(parents=True)
    marker = tmp_path / "ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(planted.parent)
    said = []
    writer = plot.FigureWriter(resumed_run, said.append)
    writer.update()
    writer.close()
    assert said == [] and not marker.exists()
    assert (resumed_run / "run.png").is_file()

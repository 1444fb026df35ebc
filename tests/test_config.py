import pytest

from gpt.config import ConfigError, TrainConfig, build_config, help_text
from gpt.schedule import get_lr, noam_lr


def test_defaults_file_cli_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("max_iters = 50\nlearning_rate = 3e-4\n[model]\nn_layer = 2\n")
    cfg = build_config(["--config", str(f), "--max-iters", "100"])
    assert cfg.max_iters == 100  # CLI beats file
    assert cfg.learning_rate == 3e-4 and cfg.n_layer == 2  # file beats defaults
    assert cfg.n_head == TrainConfig().n_head  # defaults otherwise


@pytest.mark.parametrize("argv", [["--max-iters", "100"], ["--max_iters=100"], ["--max-iters=100"], ["--max_iters", "1e2"]])
def test_dash_and_underscore_spellings(argv):
    assert build_config(argv).max_iters == 100


def test_booleans():
    assert build_config(["--compile"]).compile is True
    assert build_config(["--compile", "false"]).compile is False
    assert build_config(["--no-compile"]).compile is False
    assert build_config(["--compile", "--max-iters", "3"]).max_iters == 3


def test_every_problem_reported_together(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('n_layers = 3\nbatch_size = "big"\n')
    with pytest.raises(ConfigError) as e:
        build_config(["--config", str(f), "--max-itres", "5", "--learning-rate", "fast", "--dropout", "0.5.1"])
    msg = str(e.value)
    for needle in ("n_layers: unknown option", "did you mean n_layer", "batch_size: expected an integer",
                   "max_itres: unknown option", "learning_rate: expected a number", "dropout: expected a number"):
        assert needle in msg
    assert len(msg.splitlines()) == 5


def test_invalid_values_named():
    with pytest.raises(ConfigError, match="lr_schedule: 'linear' is not one of"):
        build_config(["--lr-schedule", "linear"])
    with pytest.raises(ConfigError, match="batch_size: must be >= 1"):
        build_config(["--batch-size", "0"])
    with pytest.raises(ConfigError, match="max_iters: expected an integer"):
        build_config(["--max-iters", "2.5"])


def test_shipped_configs_load_by_name():
    for name in ("shakespeare_char_cpu", "shakespeare_char_gpu", "gpt2_124m", "finetune"):
        build_config(["--config", name])
    gpu = build_config(["--config", "shakespeare_char_gpu"])
    assert (gpu.n_layer, gpu.n_head, gpu.n_embd, gpu.block_size) == (6, 6, 384, 256)
    with pytest.raises(ConfigError, match="shipped: .*gpt2_124m"):
        build_config(["--config", "nope"])


def test_config_files_are_data_not_code(tmp_path):
    f = tmp_path / "evil.toml"
    f.write_text("import os\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(["--config", str(f)])


def test_help_lists_every_option_with_default():
    text = help_text()
    for name in TrainConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in text
    assert "(default: 2000)" in text


def test_lr_schedule_table():
    kw = dict(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    table = {  # step: (cosine, constant, wsd)
        0: (1 / 11, 1 / 11, 1 / 11),
        9: (10 / 11, 10 / 11, 10 / 11),
        10: (1.0, 1.0, 1.0),
        60: (0.55, 1.0, 1.0),
        88: (None, 1.0, 1.0),
        99: (None, 1.0, 1.0 - 0.9 * 11 / 22),
        110: (0.1, 1.0, 0.1),
        500: (0.1, 1.0, 0.1),
    }
    for step, expected in table.items():
        for schedule, value in zip(("cosine", "constant", "wsd"), expected):
            if value is not None:
                assert get_lr(step, schedule=schedule, **kw) == pytest.approx(value), (schedule, step)
    # cosine decays monotonically after warmup
    values = [get_lr(s, schedule="cosine", **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_noam_schedule_counts_the_first_step_as_the_papers_step_one():
    d, w = 512, 4000
    assert get_lr(w - 1, schedule="noam", lr=1.0, warmup_iters=w, d_model=d) == pytest.approx((d * w) ** -0.5)
    assert get_lr(99, schedule="noam", lr=2.0, warmup_iters=w, d_model=d) == pytest.approx(2 * noam_lr(100, d, w))

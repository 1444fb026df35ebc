import pytest

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig, LoRAConfig
from gpt.train.config import OptimizerConfig, TrainConfig
from gpt.train.flags import build_config, help_text


def test_defaults_file_cli_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("max_iters = 50\nlearning_rate = 3e-4\n[model]\nn_layer = 2\n")
    cfg = build_config(["--config", str(f), "--max-iters", "100"])
    assert cfg.max_iters == 100  # CLI beats file
    assert cfg.learning_rate == 3e-4 and cfg.model.n_layer == 2  # file beats defaults
    assert cfg.model.n_head == TrainConfig().model.n_head  # defaults otherwise


@pytest.mark.parametrize(
    "argv", [["--max-iters", "100"], ["--max_iters=100"], ["--max-iters=100"], ["--max_iters", "1e2"]]
)
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
    for needle in (
        f"n_layers: unknown option in {f} (did you mean n_layer?)",
        f"batch_size in {f}: expected an integer",
        "--max-itres: unknown option (did you mean --max-iters?)",
        "--learning-rate: expected a number",
        "--dropout: expected a number",
    ):
        assert needle in msg
    assert len(msg.splitlines()) == 5


def test_invalid_values_named():
    with pytest.raises(ConfigError, match="--lr-schedule: 'linear' is not one of"):
        build_config(["--lr-schedule", "linear"])
    with pytest.raises(ConfigError, match="--batch-size: must be >= 1"):
        build_config(["--batch-size", "0"])
    with pytest.raises(ConfigError, match="--max-iters: expected an integer"):
        build_config(["--max-iters", "2.5"])


def test_model_settings_are_validated_as_flags_all_at_once():
    with pytest.raises(ConfigError) as e:
        build_config(
            [
                "--n-layer",
                "0",
                "--block-size",
                "0",
                "--dropout",
                "1.5",
                "--seed",
                "-1",
                "--pos-encoding",
                "rotary",
                "--norm",
                "middle",
            ]
        )
    lines = str(e.value).splitlines()
    assert lines == [
        "--seed: must be >= 0, got -1",
        "--block-size: must be a positive integer, got 0",
        "--n-layer: must be a positive integer, got 0",
        "--dropout: must be in [0, 1), got 1.5",
        "--pos-encoding: must be one of 'learned', 'sinusoidal', 'rope', got 'rotary'",
        "--norm: must be 'pre' or 'post', got 'middle'",
    ]
    with pytest.raises(ConfigError, match=r"^--n-head: must divide n_embd \(64\), got 3$"):
        build_config(["--n-head", "3", "--n-embd", "64"])


def test_config_file_that_is_not_utf8_is_one_line(tmp_path):
    f = tmp_path / "latin1.toml"
    f.write_bytes("# café\nmax_iters = 5\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"--config: {f} is not UTF-8 text"):
        build_config(["--config", str(f)])
    with pytest.raises(ConfigError, match="is a directory, not a TOML file"):
        build_config(["--config", str(tmp_path)])


def test_shipped_configs_load_by_name():
    for name in ("shakespeare_char_cpu", "shakespeare_char_gpu", "gpt2_124m", "finetune"):
        build_config(["--config", name])
    gpu = build_config(["--config", "shakespeare_char_gpu"])
    assert (gpu.model.n_layer, gpu.model.n_head, gpu.model.n_embd, gpu.model.block_size) == (6, 6, 384, 256)
    with pytest.raises(ConfigError, match="shipped: .*gpt2_124m"):
        build_config(["--config", "nope"])


def test_config_files_are_data_not_code(tmp_path):
    f = tmp_path / "evil.toml"
    f.write_text("import os\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(["--config", str(f)])


def test_help_lists_every_option_with_default():
    text = help_text()
    for name in [*TrainConfig.__dataclass_fields__, *GPTConfig.__dataclass_fields__]:
        if name not in ("model", "vocab_size"):  # the model's fields are flags of their own; vocab from the data
            assert "--" + name.replace("_", "-") in text
    assert "(default: 2000)" in text


def test_the_training_config_builds_each_components_own_config():
    """The optimizer and LoRA take small configs of their own, which the training config builds from its flags
    (gpt/model/lora.py reads no training field names)."""
    cfg = build_config(
        ["--init-from", "out/base", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "attn.c_attn,wte"]
        + ["--optimizer", "muon", "--learning-rate", "3e-3", "--beta2", "0.95", "--weight-decay", "0"]
    )
    assert cfg.lora_config() == LoRAConfig(4, 8.0, 0.0, ["attn.c_attn", "wte"])
    assert cfg.optimizer_config() == OptimizerConfig("muon", 3e-3, (0.9, 0.95), 0.0)
    assert TrainConfig().lora_config() is None  # LoRA off

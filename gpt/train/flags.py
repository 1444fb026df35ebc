"""From TOML files and the command line to a `TrainConfig` (gpt/train/config.py): parsing `--key value` flags,
reading config files, typing every value, and `gpt train --help`.

    cfg = build_config(["--config", "shakespeare_char_cpu", "--max-iters", "100"])
    flags, config_name, problems = parse_cli(argv)
    print(help_text())

Precedence, stated once: command line > config file (`--config FILE_OR_NAME`) > defaults (the config's module
notes say the rest). Every problem (unknown key, wrongly typed value, invalid value) is collected and reported
together in one `ConfigError`.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import fields, replace
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig
from gpt.model.config import problems as check_model
from gpt.train.config import AUTO, CONFIG_DIR, MODEL_HELP, TrainConfig, default_model, flag

# ---- building a TrainConfig from files and the command line ----------------------------------------


def _coerce(name: str, kind: type, value):
    """A value of the field's type from TOML data or a CLI string; raises ValueError with the reason."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{name}: expected true/false, got {value!r}")
    if kind is int:
        try:
            number = float(value) if not isinstance(value, bool) else 0.5
        except (TypeError, ValueError):
            number = 0.5
        if not number.is_integer():
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        return int(number)
    if kind is float:
        if isinstance(value, bool):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {value!r}")
    return value


def defaults() -> dict:
    """Every option's default, flat (the model's fields beside the run's)."""
    return TrainConfig().to_dict()


def _field_types() -> dict[str, type]:
    """Every option's type, flat: the run's fields, then the model's."""
    kinds = {"int": int, "float": float, "bool": bool, "str": str}
    own = {f.name: kinds[str(f.type)] for f in fields(TrainConfig) if f.name != "model"}
    return own | {f.name: kinds[str(f.type)] for f in fields(GPTConfig) if f.name in MODEL_HELP}


def _unknown(key: str, valid, source: str = "") -> str:
    """`--max-itres: unknown option (did you mean --max-iters?)`, or for a config file's key
    `n_layers: unknown option in c.toml (did you mean n_layer?)`."""
    close = difflib.get_close_matches(key, valid, n=1)
    if source:
        return f"{key}: unknown option in {source}" + (f" (did you mean {close[0]}?)" if close else "")
    return f"{flag(key)}: unknown option" + (f" (did you mean {flag(close[0])}?)" if close else "")


def find_config(name: str) -> Path:
    """A config file path, or the shipped config of that short name."""
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"--config: {name} is a directory, not a TOML file")
    shipped = CONFIG_DIR / f"{name.removesuffix('.toml')}.toml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"--config: no file {name!r} and no shipped config of that name (shipped: {names})")


def read_toml(path: Path, prefix: str = "", what: str = "") -> dict:
    """The TOML file at `path` as a dict; a file that cannot be read or parsed is one ConfigError, starting with
    `prefix` (the flag that named it) and calling the file `what` where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{prefix}{path} is not valid TOML ({e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{prefix}{path} is not UTF-8 text (a TOML file must be)") from None
    except OSError as e:
        raise ConfigError(f"{prefix}cannot read {what}{path} ({e.strerror or e})") from None


def load_toml(path: Path) -> dict:
    data = read_toml(path, prefix="--config: ")
    flat = {}
    for key, value in data.items():  # optional [model] / [train] tables are flattened
        if isinstance(value, dict) and key in ("model", "train"):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def parse_cli(argv: list[str]) -> tuple[dict[str, str], str | None, list[str]]:
    """`--key value` / `--key=value` / `--flag` / `--no-flag` pairs, the --config value, and problems."""
    types = _field_types()
    values, config, problems = {}, None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            problems.append(f"{arg}: unexpected argument (options look like --key value)")
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key.startswith("no_") and key[3:] in types and types[key[3:]] is bool and not eq:
            values[key[3:]] = "false"
            continue
        if key != "config" and key not in types:
            problems.append(_unknown(key, list(types)))
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                i += 1  # skip its value too
            continue
        if not eq:
            if key != "config" and types[key] is bool and (i >= len(argv) or argv[i].startswith("--")):
                value = "true"  # a bare --flag
            elif i < len(argv):
                value = argv[i]
                i += 1
            else:
                problems.append(f"{flag(key)}: missing value")
                continue
        if key == "config":
            config = value
        else:
            values[key] = value
    return values, config, problems


def build_config(argv: list[str] | None = None, base: dict | None = None) -> TrainConfig:
    """Defaults, then `base` (e.g. a resumed run's config), then the config file, then the CLI."""
    types = _field_types()
    cli, config_name, problems = parse_cli(list(argv or []))
    merged = {key: (value, key) for key, value in (base or {}).items() if key in types}  # value, how to name it
    if config_name:
        for key, value in load_toml(find_config(config_name)).items():
            if key not in types:
                problems.append(_unknown(key, list(types), source=config_name))
            else:
                merged[key] = (value, f"{key} in {config_name}")
    merged.update({key: (value, flag(key)) for key, value in cli.items()})
    auto = {key: merged.pop(key) for key in AUTO if str(merged.get(key, ("",))[0]).lower() == "auto"}
    typed = {}
    for key, (value, name) in merged.items():
        try:
            typed[key] = _coerce(name, types[key], value)
        except ValueError as e:
            problems.append(str(e))
    if "batch_size" in auto and not problems:  # keep the global batch of the batch size auto replaced
        replaced = base_value(base, config_name, "batch_size")
        typed.setdefault("global_batch", replaced * typed.get("grad_accum", TrainConfig.grad_accum))
    typed.update({key: AUTO[key] for key in auto})
    if problems:
        raise ConfigError("\n".join(problems))
    model = {key: typed.pop(key) for key in list(typed) if key in MODEL_HELP}
    if model.get("rope_scaling") and typed.get("init_from") and "pos_encoding" not in model:
        model["pos_encoding"] = "rope"  # the checkpoint's scheme (gpt/train/start.py checks that it is)
    model_problems = [f"{flag(name)}: {why}" for name, why in check_model(default_model().to_dict() | model)]
    try:  # the run's problems first, then the model's, all in one error
        cfg = TrainConfig(**typed, model=default_model() if model_problems else replace(default_model(), **model))
    except ConfigError as e:
        raise ConfigError("\n".join([str(e), *model_problems])) from None
    if model_problems:
        raise ConfigError("\n".join(model_problems))
    return cfg


def base_value(base: dict | None, config_name: str | None, key: str):
    """What `key` is before the command line: the config file's value, else `base`'s, else the default."""
    if config_name:
        data = load_toml(find_config(config_name))
        if key in data and str(data[key]).lower() != "auto":
            return _coerce(key, _field_types()[key], data[key])
    if base and key in base:
        return base[key]
    return defaults()[key]


def help_text(prog: str = "gpt train") -> str:
    lines = [
        f"usage: {prog} --data data/NAME --out-dir out/NAME [--config FILE_OR_NAME] [--key value ...]",
        "",
        "Precedence: command line > config file > defaults. Keys take dashes or underscores;",
        "booleans take true/false, or --flag / --no-flag.",
        "",
        f"  --config FILE_OR_NAME  a TOML file, or a shipped config: "
        f"{', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.toml')))}",
    ]
    helps = {f.name: f.metadata["help"] for f in fields(TrainConfig)} | MODEL_HELP
    for name, default in defaults().items():
        lines.append(f"  {flag(name):<22} {helps[name]} (default: {default if default != '' else chr(34) * 2})")
    return "\n".join(lines)

"""A sweep's search space: a TOML file of `gpt train` options, each a range or a choice, read and checked
once (`gpt sweep`; the study itself is gpt/train/sweep.py).

    space = read_space("sweeps/lr.toml")           # every problem found up front, one ConfigError
    space.argv(params)                              # a trial's `gpt train` options, base then its values

The file:

    [study]                    # all optional
    trials = 20                # trials in the study (all processes together)
    metric = "auto"            # auto: val bits per byte when the run logs it, else val loss | val_loss | val_bpb
    pruner = "median"          # median | none: stop a trial whose evaluation is worse than the median so far
    startup_trials = 3         # trials never pruned, and trials TPE samples at random before it models
    warmup_steps = 0           # steps before the pruner judges a trial
    seed = 0                   # the sampler's seed

    [train]                    # `gpt train` options every trial has (--config, --data, the budget ...)
    config = "shakespeare_char_fast_cpu"
    data = "data/shakespeare_char"

    [space]                    # the options searched
    learning_rate = { low = 1e-3, high = 3e-2, log = true }   # a float range, log scale
    warmup_iters = { low = 0, high = 100 }                    # an integer range (both bounds integers)
    n_head = { choices = [2, 4] }                             # a choice

    [[enqueue]]                # trials to run first, with these values (e.g. today's), then TPE's
    learning_rate = 0.01
    warmup_iters = 50
    n_head = 4

Keys take dashes or underscores, as `gpt train` does. Footguns:
- `out_dir`, `resume` and `force` belong to the sweep (each trial's run directory is its own), so the file
  cannot set them.
- Values are checked for their option's type, and the base options with each range's low end (a choice's
  first value) are checked as `gpt train` would; a combination the model refuses (heads that do not divide
  the width) is found when its trial starts, and that trial fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from gpt.errors import ConfigError
from gpt.train.config import flag
from gpt.train.flags import _coerce, _field_types, _unknown, build_config, read_toml

SWEEP_OWNS = ("out_dir", "resume", "force")  # a trial's run directory is the sweep's to give
STUDY_KEYS = {  # [study] key -> (type, default)
    "name": (str, ""),
    "trials": (int, 20),
    "metric": (str, "auto"),
    "pruner": (str, "median"),
    "startup_trials": (int, 3),
    "warmup_steps": (int, 0),
    "seed": (int, 0),
}
METRICS = ("auto", "val_loss", "val_bpb")
PRUNERS = ("median", "none")


@dataclass(frozen=True)
class Param:
    """One searched option: a range (`low`..`high`, integers when both bounds are, `log` scale) or `choices`."""

    name: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    choices: tuple = ()

    def distribution(self):
        """Optuna's distribution of this parameter."""
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )  # optional: the sweep extra (Optuna)

        if self.choices:
            return CategoricalDistribution(self.choices)
        if isinstance(self.low, int) and isinstance(self.high, int):
            return IntDistribution(self.low, self.high, log=self.log)
        return FloatDistribution(float(self.low), float(self.high), log=self.log)

    def first(self):
        return self.choices[0] if self.choices else self.low


@dataclass(frozen=True)
class Space:
    path: Path
    study: dict  # STUDY_KEYS' values
    base: dict  # [train]: option -> value
    params: list[Param]
    enqueue: list[dict] = field(default_factory=list)

    def argv(self, values: dict | None = None, extra: list[str] = ()) -> list[str]:
        """`gpt train` options: the base (--config first), `extra` (the sweep's command line after `--`), then
        `values` (a trial's); the last of a repeated flag wins in `gpt train`."""
        base = dict(self.base)
        out = ["--config", str(base.pop("config"))] if "config" in base else []
        for key, value in base.items():
            out += [flag(key), as_flag_value(value)]
        out += list(extra)
        for key, value in (values or {}).items():
            out += [flag(key), as_flag_value(value)]
        return out


def as_flag_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def read_space(path: str | Path, extra: list[str] = ()) -> Space:
    """The search space in `path`, checked (module notes) with `extra` `gpt train` options (the sweep's command
    line after `--`); every problem in one ConfigError."""
    path = Path(path)
    data = read_toml(path, what="the search space ")
    problems = []
    for key in data:
        if key not in ("study", "train", "space", "enqueue"):
            problems.append(f"{key}: unknown table in {path} (the tables: [study], [train], [space], [[enqueue]])")
    study = _study(data.get("study", {}), path, problems)
    types = _field_types()
    base = {}
    for key, value in _table(data, "train", path, problems).items():
        key = key.replace("-", "_")
        if key == "config":
            base[key] = str(value)
        elif _option(key, types, f"[train] of {path}", problems):
            try:
                base[key] = _coerce(f"{key} in [train] of {path}", types[key], value)
            except ValueError as e:
                problems.append(str(e))
    params = []
    for key, spec in _table(data, "space", path, problems).items():
        key = key.replace("-", "_")
        if _option(key, types, f"[space] of {path}", problems):
            param = _param(key, spec, types[key], path, problems)
            if param:
                params.append(param)
    if not params and not problems:
        problems.append(
            f"{path}: [space] names no option to search (e.g. learning_rate = {{ low = 1e-3, high = 3e-2 }})"
        )
    enqueue = _enqueue(data.get("enqueue", []), {p.name: p for p in params}, path, problems)
    if problems:
        raise ConfigError("\n".join(problems))
    space = Space(path, study, base, params, enqueue)
    cfg = build_config(space.argv({p.name: p.first() for p in params}, extra))  # as `gpt train` checks it
    if not cfg.data:
        raise ConfigError(f'{path}: no dataset: give data = "data/NAME" in [train] (every trial trains on it)')
    if not Path(cfg.data).is_dir():
        raise ConfigError(f"--data: no dataset directory {cfg.data} (prepare one with gpt prepare)")
    return space


def _table(data: dict, name: str, path: Path, problems: list) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        problems.append(f"{name} in {path}: expected a table [{name}]")
        return {}
    return table


def _option(key: str, types: dict, source: str, problems: list) -> bool:
    if key in SWEEP_OWNS:
        problems.append(f"{key} in {source}: the sweep sets it (each trial's run directory is its own)")
        return False
    if key not in types:
        problems.append(
            _unknown(key, list(types), source=source).replace(": unknown option", ": not a `gpt train` option", 1)
        )
        return False
    return True


def _study(table, path: Path, problems: list) -> dict:
    if not isinstance(table, dict):
        problems.append(f"study in {path}: expected a table [study]")
        table = {}
    study = {key: default for key, (_, default) in STUDY_KEYS.items()}
    for key, value in table.items():
        key = key.replace("-", "_")
        if key not in STUDY_KEYS:
            problems.append(_unknown(key, list(STUDY_KEYS), source=f"[study] of {path}"))
            continue
        kind = STUDY_KEYS[key][0]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{key} in [study] of {path}: expected an integer, got {value!r}")
        elif kind is str and not isinstance(value, str):
            problems.append(f"{key} in [study] of {path}: expected a string, got {value!r}")
        else:
            study[key] = value
    if study["trials"] < 1:
        problems.append(f"trials in [study] of {path}: at least 1, got {study['trials']}")
    if study["metric"] not in METRICS:
        problems.append(f"metric in [study] of {path}: one of {', '.join(METRICS)}, got {study['metric']!r}")
    if study["pruner"] not in PRUNERS:
        problems.append(f"pruner in [study] of {path}: one of {', '.join(PRUNERS)}, got {study['pruner']!r}")
    if study["startup_trials"] < 0 or study["warmup_steps"] < 0:
        problems.append(f"startup_trials and warmup_steps in [study] of {path}: 0 or more")
    return study


def _param(key: str, spec, kind: type, path: Path, problems: list) -> Param | None:
    where = f"{key} in [space] of {path}"
    if not isinstance(spec, dict):
        problems.append(f"{where}: expected {{ low = ..., high = ... }} or {{ choices = [...] }}, got {spec!r}")
        return None
    unknown = set(spec) - {"low", "high", "log", "choices"}
    if unknown:
        problems.append(f"{where}: unknown key {sorted(unknown)[0]!r} (the keys: low, high, log, choices)")
        return None
    if "choices" in spec:
        choices = spec["choices"]
        if set(spec) != {"choices"}:
            problems.append(f"{where}: choices, or low and high, not both")
        elif not isinstance(choices, list) or not choices:
            problems.append(f"{where}: choices must be a non-empty list")
        else:
            try:
                return Param(key, choices=tuple(_coerce(where, kind, c) for c in choices))
            except ValueError as e:
                problems.append(str(e))
        return None
    if "low" not in spec or "high" not in spec:
        problems.append(f"{where}: a range needs low and high (or give choices = [...])")
        return None
    low, high, log = spec["low"], spec["high"], spec.get("log", False)
    if kind not in (int, float):
        problems.append(f"{where}: a {kind.__name__} option takes choices = [...], not a range")
        return None
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    if not numbers or not all(math.isfinite(v) for v in (low, high)):
        problems.append(f"{where}: low and high must be finite numbers, got {low!r} and {high!r}")
        return None
    if kind is int and not (isinstance(low, int) and isinstance(high, int)):
        problems.append(f"{where}: an integer option's range takes integer bounds, got {low!r} and {high!r}")
        return None
    if not isinstance(log, bool):
        problems.append(f"{where}: log must be true or false, got {log!r}")
        return None
    if not low < high:
        problems.append(f"{where}: low must be below high, got {low!r} and {high!r}")
        return None
    if log and low <= 0:
        problems.append(f"{where}: a log-scale range must be above 0, got low = {low!r}")
        return None
    if kind is float:
        low, high = float(low), float(high)
    return Param(key, low, high, log)


def _enqueue(rows, params: dict, path: Path, problems: list) -> list[dict]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        problems.append(f"enqueue in {path}: expected [[enqueue]] tables")
        return []
    out = []
    for i, row in enumerate(rows, 1):
        values = {}
        for key, value in row.items():
            key = key.replace("-", "_")
            where = f"{key} in [[enqueue]] number {i} of {path}"
            if key not in params:
                problems.append(f"{where}: not an option of [space]")
                continue
            p = params[key]
            try:
                value = _coerce(where, type(p.first()), value)
            except ValueError as e:
                problems.append(str(e))
                continue
            if p.choices and value not in p.choices or not p.choices and not p.low <= value <= p.high:
                problems.append(f"{where}: {value!r} is outside the space")
            values[key] = value
        out.append(values)
    return out

"""The checkable rewards of GRPO (gpt/train/grpo.py): a completion's text and its prompt row in, a number out.

    reward = load_reward("exact")             # or "json", "bleu", "my_rewards:score" (module:function)
    reward.check(row)                         # the row's problem for this reward as a line, or None
    reward(completion_text, row)              # -> float

| name | the row needs | the reward |
| --- | --- | --- |
| `exact` | `answer` (a text or number, or a list of them) | 1 when the completion, stripped of surrounding whitespace, is one of the answers (each stripped), else 0 |
| `json` | nothing (`schema`: a JSON Schema, optional) | 1 when the completion parses as JSON (and validates against the row's `schema`), else 0 |
| `bleu` | `reference` (a text, or a list of texts) | sacrebleu's sentence BLEU against the references, divided by 100 (0..1) |
| `module:function` | what the function reads | `function(completion, row)`, a number; the module is imported (the working directory is on the path) |

Footguns
- `exact` compares texts, not numbers: "19.0" is not "19".
- A `module:function` reward that raises stops the run (its traceback is the function's bug, not a user mistake
  the run can name in one line); one that returns something other than a finite number is a one-line error.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from collections.abc import Callable

from gpt.errors import ConfigError

BUILT_IN = ("exact", "json", "bleu")


def _texts(value) -> list[str] | None:
    """A text, a number or a list of them, as texts; None for anything else."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
        return None
    return [str(v) for v in items]


class Reward:
    """A named reward: `check(row)` says what a row lacks for it, `__call__(completion, row)` scores one."""

    def __init__(self, name: str, score: Callable[[str, dict], float], needs: str | None = None):
        self.name, self.score, self.needs = name, score, needs

    def check(self, row: dict) -> str | None:
        if self.needs is None:
            return None
        if self.needs not in row:
            return f"--reward {self.name} needs {self.needs!r} in each row (its keys: {', '.join(sorted(row))})"
        if _texts(row[self.needs]) is None:
            return f"{self.needs!r} is {type(row[self.needs]).__name__}, not a text, a number or a list of them"
        return None

    def __call__(self, completion: str, row: dict) -> float:
        value = self.score(completion, row)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"--reward {self.name}: returned {value!r}, not a finite number")
        return float(value)


def _optional(module: str, reward: str):
    """An optional package a reward needs, imported on first use (a missing one is one line)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--reward {reward} needs {module}: pip install {module} (or the gpt[grpo] extra)") from None


def exact(completion: str, row: dict) -> float:
    return float(completion.strip() in {a.strip() for a in _texts(row["answer"])})


def json_valid(completion: str, row: dict) -> float:
    try:
        value = json.loads(completion)
    except ValueError:
        return 0.0
    schema = row.get("schema")
    if schema is None:
        return 1.0
    jsonschema = _optional("jsonschema", "json")  # (only for rows with a schema)

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return 0.0
    except jsonschema.SchemaError as e:
        raise ConfigError(f"--reward json: a row's 'schema' is not a JSON Schema: {e.message}") from None
    return 1.0


def bleu(completion: str, row: dict) -> float:
    sacrebleu = _optional("sacrebleu", "bleu")

    return sacrebleu.sentence_bleu(completion.strip(), _texts(row["reference"])).score / 100


def load_reward(spec: str) -> Reward:
    """The reward `spec` names: a built-in one, or `module:function`; anything else is one ConfigError line."""
    if spec == "exact":
        return Reward(spec, exact, "answer")
    if spec == "json":
        return Reward(spec, json_valid)
    if spec == "bleu":
        _optional("sacrebleu", "bleu")  # (missing: refused before the run starts)
        return Reward(spec, bleu, "reference")
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(
            f"--reward {spec!r}: not one of {', '.join(BUILT_IN)}, nor a Python callable as module:function"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # (`gpt` as a console script does not put it there)
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"--reward {spec}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ConfigError(f"--reward {spec}: module {module!r} has no {name!r}") from None
    if not callable(fn):
        raise ConfigError(f"--reward {spec}: {module}.{name} is not callable")
    return Reward(spec, fn)

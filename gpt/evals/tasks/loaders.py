"""Data loaders for the task YAMLs beside this file (lm-eval imports this file by path through `!function`).

lm-eval calls a task's `custom_dataset` with the run's `--metadata` (and the task's dataset_kwargs) as keyword
arguments, and uses what it returns as the dataset: a `datasets.DatasetDict`.
"""

import json
import os
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


class MissingData(FileNotFoundError):
    """A task's data file is not there (gpt evaluate turns it into one `error:` line)."""


def text_file(text_file=None, **_):
    """The whole text file as one document {"page": text}: `text_file` from --metadata, else
    $GPT_SHARED_DATA/wikitext2-test.txt."""
    if text_file is None:
        shared = os.environ.get("GPT_SHARED_DATA")
        if not shared:
            raise MissingData(
                'gpt_wikitext2 needs a text file: pass --metadata \'{"text_file": "PATH"}\' '
                "(e.g. wikitext2-test.txt) or set GPT_SHARED_DATA to the directory that holds wikitext2-test.txt"
            )
        text_file = Path(shared) / "wikitext2-test.txt"
    path = Path(text_file)
    if not path.is_file():
        raise MissingData(f"gpt_wikitext2: no text file {path}: give an existing one as text_file in --metadata")
    text = path.read_bytes().decode("utf-8")  # byte for byte: bits per byte counts the file's own bytes
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"page": text}])})


def next_line(**_):
    """The committed items of gpt_shakespeare_next_line."""
    rows = [
        json.loads(line) for line in (HERE / "shakespeare_next_line.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

"""Data loaders for the task YAMLs beside this file (lm-eval imports this file by path through `!function`).

lm-eval calls a task's `custom_dataset` with the run's `--metadata` (and the task's dataset_kwargs) as keyword
arguments, and uses what it returns as the dataset: a `datasets.DatasetDict`.
"""

import json
import os
import random
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


class MissingData(FileNotFoundError):
    """A task's data file is not there (gpt evaluate turns it into one `error:` line)."""


def _text_path(text_file, task: str, default: str) -> Path:
    """`text_file` from --metadata, else $GPT_SHARED_DATA/`default`; MissingData names `task` when neither is."""
    if text_file is None:
        shared = os.environ.get("GPT_SHARED_DATA")
        if not shared:
            raise MissingData(
                f'{task} needs a text file: pass --metadata \'{{"text_file": "PATH"}}\' '
                f"(e.g. {default}) or set GPT_SHARED_DATA to the directory that holds {default}"
            )
        text_file = Path(shared) / default
    path = Path(text_file)
    if not path.is_file():
        raise MissingData(f"{task}: no text file {path}: give an existing one as text_file in --metadata")
    return path


def text_file(text_file=None, **_):
    """The whole text file as one document {"page": text}: `text_file` from --metadata, else
    $GPT_SHARED_DATA/wikitext2-test.txt."""
    path = _text_path(text_file, "gpt_wikitext2", "wikitext2-test.txt")
    text = path.read_bytes().decode("utf-8")  # byte for byte: bits per byte counts the file's own bytes
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"page": text}])})


def next_line(**_):
    """The committed items of gpt_shakespeare_next_line."""
    rows = [
        json.loads(line) for line in (HERE / "shakespeare_next_line.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def next_sentence(text_file=None, context_chars=2500, **_):
    """Items of gpt_wikitext2_next_sentence from a WikiText-style text file (`text_file` in --metadata, else
    $GPT_SHARED_DATA/wikitext2-valid.txt): a passage of whole sentences, at least `context_chars` characters,
    then which of 4 sentences comes next (the true one and 3 drawn from elsewhere, seed 1234). Headings are
    left out; sentences end at " . "; the passages follow each other through the file, one item each."""
    path = _text_path(text_file, "gpt_wikitext2_next_sentence", "wikitext2-valid.txt")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    sentences = [s.strip() for line in lines if line and not line.startswith("=") for s in line.split(" . ")]
    sentences = [s if s.endswith(".") else s + " ." for s in sentences if len(s) >= 20]
    rng = random.Random(1234)
    rows, start = [], 0
    while True:
        end, size = start, 0
        while end < len(sentences) and size < context_chars:
            size += len(sentences[end]) + 1
            end += 1
        if end + 1 >= len(sentences):
            break
        answer = sentences[end]
        others = [s for s in rng.sample(sentences, 6) if s != answer][:3]
        label = rng.randrange(4)
        rows.append(
            {
                "context": " ".join(sentences[start:end]),
                "choices": others[:label] + [answer] + others[label:],
                "label": label,
            }
        )
        start = end + 1
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

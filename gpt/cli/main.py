"""The `gpt` command (and `python -m gpt`): one verb per workflow, each verb's `main(argv)` in gpt/cli/<verb>.py.

    gpt --help                      # every verb with one line each
    gpt prepare corpus/ --out data/mine --tokenizer bpe
    gpt train --config shakespeare_char_cpu --data data/mine --out-dir out/mine
    gpt sample --ckpt out/mine --prompt "ROMEO:"
    gpt serve --help                # each verb answers --help with its own options

Only the verb that runs is imported, so `gpt --help` and a mistyped verb answer at once (no torch).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence

from gpt.cli import fail

# verb -> what it does, in one line (`gpt --help`); the module gpt.cli.<verb> holds its main(argv)
VERBS = {
    "prepare": "tokenize text, translation pairs or chat conversations into a dataset (data/NAME)",
    "train": "pretrain or fine-tune a model on a prepared dataset (a run directory out/NAME)",
    "sample": "generate text from a checkpoint, or translate with a seq2seq one",
    "chat": "talk with a chat checkpoint in the terminal (JSON lines when stdin is a pipe)",
    "serve": "serve a checkpoint over OpenAI's completions and chat API, with a playground",
    "evaluate": "BLEU/ROUGE of translations, perplexity of a text, or lm-evaluation-harness tasks",
    "export": "a checkpoint as ONNX, a torch.export program, or a GGUF file for llama.cpp",
    "hf": "export to, or import from, a Hugging Face transformers directory",
    "lora": "merge a LoRA run's adapters into one plain checkpoint",
    "plan": "memory per GPU for a config, or a whole run sized from --depth / --params",
    "plot": "draw runs' loss curves, learning rate and gradient norms into a PNG",
    "sweep": "search `gpt train` options with Optuna: trials as runs, pruned early, resumable",
    "attention": "draw what a checkpoint attends to over a text",
    "dcp": "convert a sharded (DCP) checkpoint to a single file",
    "pairs": "tokenize parallel text into a translation-pairs dataset",
}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [
        "usage: gpt <verb> [options]      (or: python -m gpt <verb> [options])",
        "",
        "Pretrain, fine-tune and sample GPT models. Verbs:",
        *(f"  {verb:<{width}}  {line}" for verb, line in VERBS.items()),
        "",
        "`gpt <verb> --help` lists a verb's options with their defaults.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv:  # no verb is a mistake: the usage on stderr, and a status a script can test
        print(f"{usage()}\n\nerror: no verb given: `gpt <verb> ...`", file=sys.stderr)
        return 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        close = difflib.get_close_matches(verb, VERBS, n=1)
        hint = f"did you mean `gpt {close[0]}`?" if close else "`gpt --help` lists them"
        return fail(f"unknown verb {verb!r} ({hint}); the verbs: {', '.join(VERBS)}")
    module = importlib.import_module(f"gpt.cli.{verb}")  # lazy: only the verb that runs pays its imports
    return module.main(rest)

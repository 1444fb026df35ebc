"""Prepare a memory-mapped token dataset from any text: files, directories, or a mix; or translation pairs.
`gpt prepare` (data/prepare.py in a checkout).

    gpt prepare corpus/ notes.txt --out data/mine --tokenizer gpt2
    gpt prepare corpus/ --out data/mine --tokenizer bpe --vocab-size 8192
    gpt prepare shards/*.parquet more.jsonl.gz --out data/web --text-field text --skip-bad-rows
    gpt prepare input.txt --out data/mine_char --tokenizer char --block-size 256
    gpt prepare --pairs train.de train.en --val-pairs val.de val.en --out data/de-en --tokenizer bpe
    gpt prepare new.txt --out data/new --tokenizer-from out/shakespeare-char --unknown replace
    gpt prepare --chat chats.jsonl --out data/chat --tokenizer-from out/base --block-size 256
    gpt prepare --preferences pairs.jsonl --out data/prefs --tokenizer-from out/chat --block-size 256

Writes train.bin, val.bin and meta.json (plus tokenizer.tiktoken for bpe) into --out; see docs/data.md,
gpt/data/prepare.py for the policies and gpt/data/format.py for the format. Never
imports torch. With --pairs (line i of
SRC translates line i of TGT; no INPUT) it writes a pairs dataset for the seq2seq model instead:
{train,val}.{bin,idx} and meta.json, see gpt/data/pairs.py. With --chat (rows of OpenAI messages,
prompt/completion or Alpaca instruction/input/output) it writes a chat dataset to fine-tune on: the
conversations rendered by a chat template, and a loss mask on the assistant's tokens (gpt/data/sft.py).
With --preferences (rows of prompt, chosen and rejected) it writes a preference dataset for `gpt train
--objective dpo | orpo`: both sequences of each pair and a mask on the answers (gpt/data/preferences.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gpt.cli import ArgumentParser, fail, run_main
from gpt.cli.pairs import add_pairs_options, run_cli
from gpt.data.chat import FORMATS
from gpt.data.pairs import DEFAULT_VAL_FRACTION
from gpt.data.preferences import DEFAULT_VAL_FRACTION as DEFAULT_PREFERENCE_VAL_FRACTION
from gpt.data.preferences import prepare_preferences
from gpt.data.prepare import TOKENIZERS, prepare
from gpt.data.records import DEFAULT_MAX_ROW_BYTES
from gpt.data.sft import DEFAULT_VAL_FRACTION as DEFAULT_CHAT_VAL_FRACTION
from gpt.data.sft import LONG_POLICIES, prepare_chat
from gpt.data.staging import OUTPUT_FLOOR, OUTPUT_RATIO
from gpt.data.vocab import UNKNOWN_POLICIES, dataset_spec

DEFAULT_BLOCK_SIZE = 1024
MODES = {"text": "INPUT text", "pairs": "--pairs", "chat": "--chat", "preferences": "--preferences"}
ROWS = {"text", "chat", "preferences"}  # the modes that read rows of record files
# The options that belong to some modes only: argument name -> (flag, the modes it is for).
ONLY_FOR = {
    "block_size": ("--block-size", ROWS),
    "strict_utf8": ("--strict-utf8", {"text"}),
    "workers": ("--workers", {"text"}),
    "tokenizer_from": ("--tokenizer-from", ROWS),
    "unknown": ("--unknown", {"text"}),
    "replacement": ("--replacement", {"text"}),
    "skip_bad_rows": ("--skip-bad-rows", ROWS),
    "max_row_bytes": ("--max-row-bytes", ROWS),
    "max_output_bytes": ("--max-output-bytes", ROWS),
    "vocab_size": ("--vocab-size", {"text", "pairs"}),
    "text_field": ("--text-field", {"text"}),
    "val_pairs": ("--val-pairs", {"pairs"}),
    "max_len": ("--max-len", {"pairs"}),
    "truncate": ("--truncate", {"pairs"}),
    "seed": ("--seed", {"pairs", "chat"}),
    "val_chat": ("--val-chat", {"chat"}),
    "chat_format": ("--chat-format", {"chat"}),
    "long": ("--long", {"chat", "preferences"}),
    "val_preferences": ("--val-preferences", {"preferences"}),
}


def parse_args(argv: Sequence[str] | None = None, prog: str = "gpt prepare") -> argparse.Namespace:
    p = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="text files, record files (.jsonl, .jsonl.gz, .parquet: one document per row) and directories "
        "(all such files below them)",
    )
    p.add_argument(
        "--pairs",
        nargs=2,
        metavar=("SRC", "TGT"),
        help="instead of INPUTs: parallel files for a seq2seq pairs dataset (line i of SRC translates line i of TGT)",
    )
    p.add_argument(
        "--chat",
        nargs="+",
        metavar="FILE",
        help="instead of INPUTs: chat files (.jsonl, .jsonl.gz, .parquet or a .json list; one conversation per row) "
        "for a chat dataset to fine-tune on, the loss on the assistant's answers",
    )
    p.add_argument(
        "--preferences",
        nargs="+",
        metavar="FILE",
        help="instead of INPUTs: preference files (.jsonl, .jsonl.gz, .parquet or a .json list; rows of prompt, "
        "chosen and rejected, as TRL's or Anthropic HH's) for --objective dpo | orpo (gpt/data/preferences.py)",
    )
    p.add_argument("--out", required=True, help="dataset directory to create, e.g. data/NAME")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=None, help="a new tokenizer (default: gpt2)")
    p.add_argument("--vocab-size", type=int, default=None, help="bpe only: ids including end-of-text (default 8192)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help=f"share of the corpus for val (default: 0.1; with --pairs and no --val-pairs: {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument(
        "--tokenizer-file",
        default=None,
        help="gpt2 only: local GPT-2 .tiktoken ranks file (else $GPT2_TIKTOKEN_FILE or tiktoken's download)",
    )
    p.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    text = p.add_argument_group("text datasets (INPUT ...)")
    text.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"each split must hold one window of this + 1 tokens (default: {DEFAULT_BLOCK_SIZE})",
    )
    text.add_argument(
        "--strict-utf8",
        action="store_true",
        help="stop at bytes that are not UTF-8 instead of replacing them by U+FFFD",
    )
    text.add_argument("--workers", type=int, default=None, help="encoding threads (default: all cores)")
    text.add_argument(
        "--tokenizer-from",
        metavar="RUN_OR_DATASET",
        default=None,
        help="encode with the tokenizer of this run, checkpoint, dataset or HF GPT-2 dir, so its models "
        "can be fine-tuned on the text (instead of --tokenizer)",
    )
    text.add_argument(
        "--unknown",
        choices=UNKNOWN_POLICIES,
        default=None,
        help="with --tokenizer-from a char vocabulary: characters it lacks are refused (counted, one "
        "error) or replaced (default: refuse)",
    )
    text.add_argument(
        "--replacement", default=None, help="--unknown replace: the character they become (default: '?', else a space)"
    )
    text.add_argument(
        "--text-field",
        default=None,
        metavar="NAME",
        help="the field of each JSONL row / the Parquet column that holds a document's text (default: text)",
    )
    text.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="rows of a record file (JSONL, Parquet, a --chat file) that are malformed, lack the field or are "
        "not text / not a conversation are skipped and counted, instead of stopping at the first",
    )
    text.add_argument(
        "--max-row-bytes",
        type=int,
        default=None,
        metavar="N",
        help="a row of a record file (a --chat file too) longer than this (JSONL: its line; Parquet: its decoded "
        f"strings) is a bad row: an error, or skipped with --skip-bad-rows (default: {DEFAULT_MAX_ROW_BYTES:,})",
    )
    text.add_argument(
        "--max-output-bytes",
        type=int,
        default=None,
        metavar="N",
        help="the dataset's files (a --chat dataset's too) may take at most N bytes: past it the prepare stops, "
        f"writes nothing and says so (default: {OUTPUT_RATIO} times the inputs' bytes on disk, at least "
        f"{OUTPUT_FLOOR >> 20} MiB; real text never nears it, a Parquet or gzip file that decodes to GBs stops "
        "there). Give N to cap a big corpus, or to pass one that compresses better than text does",
    )
    add_pairs_options(p.add_argument_group("pairs datasets (--pairs SRC TGT)"))
    chat = p.add_argument_group("chat datasets (--chat FILE ...; also --block-size, --tokenizer-from, --seed)")
    chat.add_argument(
        "--val-chat", nargs="+", metavar="FILE", help="held-out conversations (default: --val-fraction 0.05 of --chat)"
    )
    chat.add_argument(
        "--chat-format",
        choices=FORMATS,
        default=None,
        help="the rows' shape: OpenAI messages, prompt + completion, Alpaca instruction (+ input) + output, or "
        "ShareGPT conversations (from human / gpt) (default: recognised row by row from its keys)",
    )
    chat.add_argument(
        "--long",
        choices=LONG_POLICIES,
        default=None,
        help="conversations longer than --block-size + 1 tokens are cut to it or left out, and counted "
        "(default: truncate)",
    )
    prefs = p.add_argument_group(
        "preference datasets (--preferences FILE ...; also --block-size, --tokenizer-from, --long, --val-fraction)"
    )
    prefs.add_argument(
        "--val-preferences",
        nargs="+",
        metavar="FILE",
        help="held-out pairs (default: every 20th pair of --preferences)",
    )
    return p.parse_args(argv)


def mode(args: argparse.Namespace) -> str:
    return "pairs" if args.pairs else "chat" if args.chat else "preferences" if args.preferences else "text"


def mode_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the mix of INPUTs, --pairs, --chat and the options of each, if anything."""
    given_modes = [
        flag
        for flag, given in (
            ("INPUT", args.inputs),
            ("--pairs", args.pairs),
            ("--chat", args.chat),
            ("--preferences", args.preferences),
        )
        if given
    ]
    if len(given_modes) > 1:
        got = f" (got INPUT {' '.join(args.inputs)})" if args.inputs else ""
        return (
            f"give one of INPUT files, --pairs SRC TGT, --chat FILE or --preferences FILE, not "
            f"{' and '.join(given_modes)}{got}"
        )
    if not given_modes:
        return (
            "nothing to prepare: give INPUT files and directories, --pairs SRC TGT for translation pairs, "
            "--chat FILE for chat conversations or --preferences FILE for preference pairs"
        )
    this = mode(args)
    wrong = {}
    for key, (flag, modes) in ONLY_FOR.items():
        if this not in modes and getattr(args, key) not in (None, False):
            names = [MODES[m] for m in MODES if m in modes]
            wrong.setdefault(", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1], []).append(flag)
    for modes, flags in wrong.items():
        return f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for {modes} datasets, not {MODES[this]}"
    unknown = [
        flag for flag, value in (("--unknown", args.unknown), ("--replacement", args.replacement)) if value is not None
    ]
    if unknown and not args.tokenizer_from:  # they would be ignored
        return (
            f"{', '.join(unknown)}: only with --tokenizer-from (the characters a reused char vocabulary lacks); "
            f"a new vocabulary (--tokenizer) holds every character of its INPUT"
        )
    if args.replacement is not None and args.unknown != "replace":
        return "--replacement: only with --unknown replace (the default refuses unknown characters)"
    held_out = args.val_chat or args.val_pairs or args.val_preferences
    ignored = [
        flag for flag, value in (("--val-fraction", args.val_fraction), ("--seed", args.seed)) if value is not None
    ]
    if held_out and ignored:
        given = "--val-chat" if args.val_chat else "--val-pairs" if args.val_pairs else "--val-preferences"
        return f"{', '.join(ignored)}: only without {given} (they choose the share held out for val; {given} is it)"
    if args.max_row_bytes is not None and args.max_row_bytes < 1:
        return f"--max-row-bytes must be at least 1, got {args.max_row_bytes}"
    if args.max_output_bytes is not None and args.max_output_bytes < 1:
        return f"--max-output-bytes must be at least 1, got {args.max_output_bytes}"
    return None


def reused(path):
    """--tokenizer-from: a dataset's vocabulary (read without torch), else a run's, checkpoint's or HF directory's."""
    if path is None:
        return None
    found = dataset_spec(path)
    if found is None:
        from gpt.checkpoints.loader import tokenizer_source  # torch: only for a run, checkpoint or HF directory

        found = tokenizer_source(path)
    return found


def main(argv: Sequence[str] | None = None, prog: str = "gpt prepare") -> int:
    args = parse_args(argv, prog)
    problem = mode_error(args)
    if problem:
        return fail(problem)
    if args.pairs:
        args.tokenizer = args.tokenizer or "gpt2"
        return run_cli(args)
    if args.preferences:
        return run_main(
            lambda: prepare_preferences(
                args.preferences,
                args.out,
                val_inputs=args.val_preferences,
                tokenizer_from=reused(args.tokenizer_from),
                tokenizer=args.tokenizer,
                tokenizer_file=args.tokenizer_file,
                block_size=DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size,
                long=args.long or "truncate",
                val_fraction=DEFAULT_PREFERENCE_VAL_FRACTION if args.val_fraction is None else args.val_fraction,
                skip_bad_rows=args.skip_bad_rows,
                max_row_bytes=args.max_row_bytes or DEFAULT_MAX_ROW_BYTES,
                max_output_bytes=args.max_output_bytes,
                force=args.force,
                progress=False if args.quiet else None,
            ).line(),
            interrupted=f"{args.out} was left as it was",
        )
    if args.chat:
        return run_main(
            lambda: prepare_chat(
                args.chat,
                args.out,
                val_inputs=args.val_chat,
                tokenizer_from=reused(args.tokenizer_from),
                tokenizer=args.tokenizer,
                tokenizer_file=args.tokenizer_file,
                fmt=args.chat_format,
                block_size=DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size,
                long=args.long or "truncate",
                val_fraction=DEFAULT_CHAT_VAL_FRACTION if args.val_fraction is None else args.val_fraction,
                seed=args.seed or 0,
                skip_bad_rows=args.skip_bad_rows,
                max_row_bytes=args.max_row_bytes or DEFAULT_MAX_ROW_BYTES,
                max_output_bytes=args.max_output_bytes,
                force=args.force,
                progress=False if args.quiet else None,
            ).line(),
            interrupted=f"{args.out} was left as it was",
        )
    return run_main(
        lambda: prepare(
            args.inputs,
            args.out,
            args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=0.1 if args.val_fraction is None else args.val_fraction,
            block_size=DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size,
            tokenizer_file=args.tokenizer_file,
            tokenizer_from=reused(args.tokenizer_from),
            unknown=args.unknown or "refuse",
            replacement=args.replacement,
            strict_utf8=args.strict_utf8,
            text_field=args.text_field or "text",
            skip_bad_rows=args.skip_bad_rows,
            max_row_bytes=args.max_row_bytes or DEFAULT_MAX_ROW_BYTES,
            max_output_bytes=args.max_output_bytes,
            workers=args.workers,
            force=args.force,
            progress=False if args.quiet else None,
        ).line(),
        interrupted=f"{args.out} was left as it was",
    )

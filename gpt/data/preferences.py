"""Turn preference files into a preference dataset: each prompt with a chosen and a rejected answer, as ids
and a mask on the answers' tokens (the data of DPO and ORPO, gpt/train/prefer.py).

    gpt prepare --preferences pairs.jsonl --out data/prefs --tokenizer-from out/chat

    from gpt.data.preferences import prepare_preferences
    print(prepare_preferences(["pairs.jsonl"], "data/prefs", tokenizer_from=reused).line())

A row of a `.jsonl` / `.jsonl.gz` / `.parquet` file (or of a `.json` file holding one list of rows) is one
pair, in TRL's shapes or Anthropic HH's:

| row                                                                   | prompt                      |
|-----------------------------------------------------------------------|-----------------------------|
| `{"prompt": P, "chosen": C, "rejected": R}`, P text or OpenAI messages, C and R text, an assistant message or a list of one | P |
| `{"chosen": [messages...], "rejected": [messages...]}` (TRL's implicit prompt) | the messages both share |
| `{"chosen": "\\n\\nHuman: ... \\n\\nAssistant: A", "rejected": ...}` (Anthropic HH) | the text both share, up to its last `\\n\\nAssistant:` |

Rendering: with a chat template (the base's tokenizer has one, a chat checkpoint's; or the first pair's
prompt is a list of messages, and then the template's tokens are added after the base's vocabulary as
`gpt prepare --chat` does) the prompt is `ChatTemplate.prompt` of its messages (a text prompt is one user
message) and each answer its content and the end-of-turn token, exactly what `gpt prepare --chat` would
render for the conversation prompt + answer. Without one, the prompt's text and each answer's text then the
end-of-text token (TRL adds the EOS likewise), each encoded on its own.

The dataset (format in gpt/data/format.py, kind `preferences`) stores per split two sequences per pair,
prompt + chosen then prompt + rejected, one after the other (`{split}.bin`), one mask byte per token
(`{split}.mask.bin`, 1 on the answer's tokens) and where each sequence starts (`{split}.idx`, int64, 2 x
pairs + 1 entries).

Policies
- Rows are read, encoded and written one at a time (memory stays bounded by a row, `max_row_bytes`).
- A bad row (not JSON, not a pair, an empty answer, a character a char vocabulary lacks) is one error naming
  file and row, or skipped and counted with `skip_bad_rows`.
- A pair longer than a window (`block_size + 1` tokens for its longer sequence) loses the start of its prompt
  (`long="truncate"`: at least one prompt token is kept) or is left out (`long="skip"`); both are counted. A
  pair whose answer alone fills the window is left out (counted as skipped).
- Without `val_inputs`, every round(1 / val_fraction)-th pair goes to val (no pass ahead of the writing).

Footguns: a truncated prompt loses its start, the chat template's first markers included; the answers are
never cut.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpt.data import vocab
from gpt.data.chat import ChatError, ChatTemplate, check_conversation, openai_messages
from gpt.data.corpus import BadRowError, CorpusError
from gpt.data.format import SPLITS, DataError, dtype_for_vocab, new_meta, store_ranks, write_meta
from gpt.data.records import DEFAULT_MAX_ROW_BYTES
from gpt.data.sft import LONG_POLICIES, MaskedSplit, base_tokenizer, file_rows
from gpt.data.staging import OutputBudget, staged
from gpt.data.tokenizer import CharTokenizer, SpecialsTokenizer
from gpt.progress import Progress

DEFAULT_VAL_FRACTION = 0.05
HH_MARKER = "\n\nAssistant:"


@dataclass
class Pair:
    """One preference: the prompt (text, or messages) and the two answers' texts."""

    prompt: str | list[dict]
    chosen: str
    rejected: str


def _answer(value, key: str) -> str:
    """An answer's text: a string, an assistant message, or a list holding one assistant message."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        if value.get("role", "assistant") != "assistant":
            raise ChatError(f"{key!r} is a {value.get('role')!r} message; an answer is the assistant's")
        value = value.get("content")
    if not isinstance(value, str):
        raise ChatError(f"{key!r} is {type(value).__name__}, not a text or an assistant message")
    if not value:
        raise ChatError(f"{key!r} is empty")
    return value


def _implicit(chosen, rejected) -> Pair:
    """A pair with the prompt inside both answers: the messages both share, or HH's shared text up to its
    last "\\n\\nAssistant:" marker (else all the text both share)."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise ChatError("'chosen' and 'rejected' share no prompt message (give 'prompt')")
        return Pair(openai_messages(chosen[:n]), _answer(chosen[n:], "chosen"), _answer(rejected[n:], "rejected"))
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = len(os.path.commonprefix([chosen, rejected]))
        cut = chosen.rfind(HH_MARKER, 0, n)
        n = cut + len(HH_MARKER) if cut >= 0 else n
        if n == 0:
            raise ChatError("'chosen' and 'rejected' share no prompt text (give 'prompt')")
        return Pair(chosen[:n], _answer(chosen[n:], "chosen"), _answer(rejected[n:], "rejected"))
    raise ChatError("'chosen' and 'rejected' are neither both texts nor both lists of messages")


def preference(row) -> Pair:
    """The pair of one row (see the module's table); ChatError naming what is wrong."""
    if not isinstance(row, dict):
        raise ChatError(f"a row is a JSON {type(row).__name__}, not an object")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise ChatError(f"the row lacks {' and '.join(map(repr, missing))} (its keys: {keys})")
    if "prompt" not in row or row["prompt"] is None:
        return _implicit(row["chosen"], row["rejected"])
    prompt = row["prompt"]
    if isinstance(prompt, list):
        prompt = openai_messages(prompt)
        check_conversation(prompt, for_prompt=True)
    elif not isinstance(prompt, str):
        raise ChatError(f"'prompt' is {type(prompt).__name__}, not a text or a list of messages")
    return Pair(prompt, _answer(row["chosen"], "chosen"), _answer(row["rejected"], "rejected"))


class Renderer:
    """A pair as (prompt ids, chosen ids, rejected ids): through the chat template, or as plain text."""

    def __init__(self, tok, template: ChatTemplate | None):
        self.tok, self.template = tok, template
        base = getattr(tok, "base", tok)
        self.chars = frozenset(base.chars) if isinstance(base, CharTokenizer) else None

    def _check(self, text: str, what: str) -> None:
        if self.chars is not None:
            missing = set(text) - self.chars
            if missing:
                raise ChatError(f"{what} holds {min(missing)!r}, a character the vocabulary lacks")

    def __call__(self, pair: Pair) -> tuple[list[int], list[int], list[int]]:
        tok, template = self.tok, self.template
        messages = pair.prompt if isinstance(pair.prompt, list) else None
        for n, text in enumerate([m["content"] for m in messages] if messages else [pair.prompt]):
            self._check(text, f"prompt message {n}" if messages else "the prompt")
        self._check(pair.chosen, "'chosen'")
        self._check(pair.rejected, "'rejected'")
        if template is None:
            if messages is not None:
                raise ChatError("the prompt is a list of messages, but the tokenizer has no chat template")
            end = [tok.eot_token] if tok.eot_token is not None else []
            return tok.encode(pair.prompt), tok.encode(pair.chosen) + end, tok.encode(pair.rejected) + end
        end = [tok.special(template.end)]
        prompt = template.prompt(messages or [{"role": "user", "content": pair.prompt}], tok)
        return prompt, tok.encode(pair.chosen) + end, tok.encode(pair.rejected) + end


def fit(prompt: list[int], chosen: list[int], rejected: list[int], block_size: int, long: str):
    """The pair cut to a window of block_size + 1 tokens: (prompt, how) with how None (it fits), "truncated"
    (the prompt's start cut off) or "skipped" (None for the prompt)."""
    room = block_size + 1 - max(len(chosen), len(rejected))
    if len(prompt) <= room:
        return prompt, None
    if long == "skip" or room < 1:
        return None, "skipped"
    return prompt[len(prompt) - room :], "truncated"


class _Split(MaskedSplit):
    """The .bin, .mask.bin and .idx of one split, filled one pair (two sequences: prompt + chosen, prompt +
    rejected, the mask on the answers) at a time."""

    def add(self, prompt: list[int], chosen: list[int], rejected: list[int]) -> None:
        for answer in (chosen, rejected):
            super().add(prompt + answer, [0] * len(prompt) + [1] * len(answer))

    @property
    def pairs(self) -> int:
        return (len(self.starts) - 1) // 2

    def close(self, tmp: Path) -> dict:
        out = super().close(tmp)
        del out["conversations"], out["targets"]
        return {**out, "pairs": self.pairs}


@dataclass
class PreferenceSummary:
    path: Path
    pairs: dict  # split -> kept
    truncated: int
    skipped_long: int
    bad_rows: int
    seconds: float
    meta: dict = field(repr=False)

    def line(self) -> str:
        chat = " through the chat template" if self.meta.get("chat_template") else ""
        text = (
            f"prepared {self.path}: {sum(self.pairs.values()):,} preference pairs (train {self.pairs['train']:,}, "
            f"val {self.pairs['val']:,}){chat}, vocab {self.meta['vocab_size']:,} as {self.meta['dtype']}, in "
            f"{self.seconds:.1f} s"
        )
        notes = [
            f"{n:,} {what}"
            for n, what in (
                (self.truncated, "longer than the block with their prompt's start cut"),
                (self.skipped_long, "longer than the block skipped"),
                (self.bad_rows, "bad rows skipped"),
            )
            if n
        ]
        return text + ("; " + ", ".join(notes) if notes else "")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def read_pairs(paths, skip_bad_rows: bool, on_skip, progress, max_row_bytes: int) -> Iterator[tuple[Pair, str, int]]:
    """(pair, file, row) of each good row of the preference files in order; a bad row raises BadRowError (file
    and row), or with `skip_bad_rows` goes to `on_skip` and is left out."""
    for path in paths:
        for row, value, problem in file_rows(Path(path), progress, max_row_bytes):
            try:
                if problem is not None:
                    raise ChatError(problem)
                yield preference(value), str(path), row
            except ChatError as e:
                error = BadRowError(path, row, str(e))
                if not skip_bad_rows:
                    raise error from None
                on_skip(error)


def choose_template(base, first: Pair | None) -> ChatTemplate | None:
    """The chat template of the pairs: the base's (a chat checkpoint's tokenizer), the default one when the
    first pair's prompt is messages, else None (plain text)."""
    if isinstance(base, SpecialsTokenizer):
        markers = dict(zip(("system", "user", "assistant", "end"), base.specials))
        try:
            return ChatTemplate.from_spec(markers, "--tokenizer-from's special tokens")
        except ChatError as e:
            raise DataError(str(e)) from None
    if first is not None and isinstance(first.prompt, list):
        return ChatTemplate()
    return None


def prepare_preferences(
    inputs: list[str | os.PathLike],
    out: str | os.PathLike,
    *,
    val_inputs: list[str | os.PathLike] | None = None,
    tokenizer_from: vocab.Reused | str | os.PathLike | None = None,
    tokenizer: str | None = None,
    tokenizer_file: str | None = None,
    block_size: int = 1024,
    long: str = "truncate",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    skip_bad_rows: bool = False,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    max_output_bytes: int | None = None,
    force: bool = False,
    progress: bool | None = None,
    log: Callable[[str], None] = _stderr,
) -> PreferenceSummary:
    """Encode the pairs of `inputs` (and `val_inputs`, else every round(1 / val_fraction)-th pair) into the
    preference dataset `out`. Raises DataError for a user mistake (one line), StorageError for a disk that
    fails."""
    t0 = time.perf_counter()
    if long not in LONG_POLICIES:
        raise DataError(f"--long must be one of {', '.join(LONG_POLICIES)}, got {long!r}")
    if block_size < 2:
        raise DataError(f"--block-size must be >= 2, got {block_size}")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if tokenizer not in (None, "gpt2"):
        raise DataError(
            f"--tokenizer {tokenizer}: preference pairs are encoded with the model's tokenizer: give "
            f"--tokenizer-from RUN_OR_DATASET (or --tokenizer gpt2 for GPT-2's)"
        )
    base = base_tokenizer(tokenizer_from, tokenizer, tokenizer_file)
    files = [Path(p) for p in [*inputs, *(val_inputs or [])]]
    input_bytes = sum(p.stat().st_size for p in files if p.is_file())
    bad: list[BadRowError] = []
    counts = {"truncated": 0, "skipped_long": 0}
    period = max(2, round(1 / val_fraction))
    with staged(out, force, log) as tmp, Progress("read", input_bytes, enabled=progress) as bar:
        read = (skip_bad_rows, bad.append, bar.update, max_row_bytes)
        try:
            train = read_pairs(inputs, *read)
            first = next(train, None)
            template = choose_template(base, first[0] if first else None)
            tok = template.tokenizer(base) if template else base
            render, budget = Renderer(tok, template), OutputBudget(out, input_bytes, max_output_bytes)
            splits = {s: _Split(tmp, s, dtype_for_vocab(tok.vocab_size), budget) for s in SPLITS}
            streams = [("train", itertools.chain([first] if first else [], train))]
            if val_inputs:
                streams.append(("val", read_pairs(val_inputs, *read)))
            for name, stream in streams:
                for i, (pair, path, row) in enumerate(stream):
                    try:
                        ids = render(pair)
                    except ChatError as e:
                        if not skip_bad_rows:
                            raise BadRowError(path, row, str(e)) from None
                        bad.append(BadRowError(path, row, str(e)))
                        continue
                    prompt, how = fit(*ids, block_size, long)
                    if how is not None:
                        counts["truncated" if how == "truncated" else "skipped_long"] += 1
                    if prompt is not None:
                        held = not val_inputs and (i + 1) % period == 0
                        splits["val" if held else name].add(prompt, *ids[1:])
        except CorpusError as e:
            raise DataError(str(e)) from None
        done = {s: splits[s].close(tmp) for s in SPLITS}
        for s in SPLITS:
            if not done[s]["pairs"]:
                why = (
                    f" ({len(bad)} bad rows, {counts['skipped_long']} too long)"
                    if bad or counts["skipped_long"]
                    else ""
                )
                fix = "give --val-preferences, or a larger --val-fraction" if s == "val" else "see --long, --block-size"
                raise DataError(f"no {s} pair to write{why}: {fix}")
        for error in bad[:3]:
            log(f"skipped {error}")
        if len(bad) > 3:
            log(f"skipped {len(bad) - 3:,} more bad rows")
        meta = new_meta(
            "preferences",
            tok.vocab_size,
            store_ranks(tmp, tok.spec),
            eot_token=tok.eot_token,
            chat_template=template.spec if template else None,
            block_size=block_size,
            splits=done,
            corpus={
                "inputs": [str(i) for i in inputs],
                "val_inputs": [str(i) for i in val_inputs or []],
                "tokenizer_from": None
                if tokenizer_from is None
                else str(getattr(tokenizer_from, "source", tokenizer_from)),
                "long": long,
                "bad_rows_skipped": len(bad),
                **counts,
            },
        )
        write_meta(tmp, meta)
    pairs = {s: done[s]["pairs"] for s in SPLITS}
    return PreferenceSummary(
        Path(out), pairs, counts["truncated"], counts["skipped_long"], len(bad), time.perf_counter() - t0, meta
    )

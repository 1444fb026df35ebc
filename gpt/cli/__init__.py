"""The command-line room: the `gpt` command (`python -m gpt`), every verb's `main`, and their shared
convention: a user's mistake is one `error: ...` line, never a traceback.

`main.py` is the command: it lists the verbs (`gpt --help`) and imports only the one that runs. One module per
verb, each with `main(argv)` and its own parser (prog `gpt VERB`): `prepare.py`, `train.py`, `sample.py`,
`chat.py`, `serve.py`, `evaluate.py`, `export.py`, `hf.py`, `lora.py`, `plan.py`, `plot.py`, `attention.py`,
`dcp.py`, `pairs.py`, `sweep.py`; beside them `options.py` (the flags sample and chat share) and `lmeval.py` (evaluate's
lm-eval mode). May import every
other room; nothing imports it (gpt/__main__.py, and train.py, sample.py and data/prepare.py at the top
of the checkout, are its callers).

    def main(argv=None) -> int:
        args = parser.parse_args(argv)
        return run_main(lambda: prepare(...).line(), interrupted=f"{args.out} was left as it was")

Every entry point (each verb, and the recipes' data/*/prepare.py) runs its body through `run_main`. A
`gpt.errors.UserError` becomes its message (exit 2); anything else is a bug and keeps its traceback. Ctrl-C prints one line and exits 130. A reader that closes stdout early
(`gpt sample ... | head`) ends the script quietly, as it ends `cat`: no traceback, no "Exception
ignored" at exit, status 141 (128 + SIGPIPE, what a shell shows for `cat` killed by the broken pipe).
Text a model wrote goes to a terminal through `for_terminal`: its escape sequences are shown, never run.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable

from gpt.errors import UserError, storage_error


def run_main(body: Callable[[], str | None], interrupted: str = "") -> int:
    """Run a script's body; print what it returns (if anything) and return the exit status. Warnings
    show as one `warning: ...` line each."""
    warnings.showwarning = lambda message, *args, **kwargs: print(f"warning: {message}", file=sys.stderr)
    try:
        message = body()
        if message:
            print(message)
    except BrokenPipeError:
        return closed_stdout()
    except UserError as e:
        print(f"error: {e}".replace("\n", "\n  "), file=sys.stderr)  # a multi-problem message stays indented
        return 2
    except KeyboardInterrupt:
        print("error: interrupted" + (f"; {interrupted}" if interrupted else ""), file=sys.stderr)
        return 130
    return 0


def writing(body, args):
    """`body(args)`, a failed write to stdout (a full disk behind `> out.txt`) one error line: the only
    OSError left without a file name (reading the checkpoint and --prompt-file name theirs)."""
    try:
        return body(args)
    except OSError as e:
        if isinstance(e, (BrokenPipeError, UserError)) or e.filename is not None:
            raise
        closed_stdout()  # what is still buffered goes nowhere: no second error at exit
        raise storage_error(e, "write the output to", "stdout") from None


CLOSED_STDOUT = 141  # 128 + SIGPIPE


def closed_stdout() -> int:
    """The reader of stdout went away: point stdout at /dev/null, so the flush at exit of what is still
    buffered cannot fail again (Python would print "Exception ignored ... BrokenPipeError"), and return
    the status to exit with."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return CLOSED_STDOUT


CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0, DEL and C1: every control but tab and newline


def for_terminal(stream, form: str = "\\x{:02x}") -> Callable[[str], str]:
    """How text goes to `stream`: on a terminal, each control character other than newline and tab is
    written as `form` of its code point (ESC as `\\x1b`, CR as `\\x0d`, U+009B as `\\x9b`), so output
    cannot move the cursor, retitle the window or reach the clipboard; elsewhere (a pipe, a file) the text
    is left as it is. JSON lines pass `form="\\u{:04x}"`: the same JSON, its raw DEL and C1 escaped too."""
    if not stream.isatty():
        return lambda text: text
    return lambda text: CONTROLS.sub(lambda m: form.format(ord(m.group())), text)


def fail(message: str) -> int:
    """A mistake found before the body runs (e.g. flags that do not go together): one line, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line mistakes: `error: argument --tokenizer: invalid choice: 'wat' (choose from
    ...); see --help` and exit 2, instead of a usage block."""

    def error(self, message: str):
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(2)

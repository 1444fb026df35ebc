"""Chat with a chat checkpoint (fine-tuned on a `gpt prepare --chat` dataset): `gpt chat`, and the same
conversation behind `gpt sample --chat` (one implementation, two doors).

    gpt chat --ckpt out/chat --system "Answer in English."         # a conversation in the terminal
    echo '[{"role": "user", "content": "Hallo"}]' | gpt chat --ckpt out/chat   # JSON lines

On a terminal: type a message, the answer streams; `/reset` starts over (the `--system` message stays),
`/exit` or Ctrl-D ends. The oldest turns leave the context when it is full (gpt/infer/chat.py). With stdin
not a terminal, each input line is one conversation as JSON (a list of messages, or an object with
"messages", ending in the user's) and each output line the answer as {"role": "assistant", "content": ...},
or {"error": ...} for a line that is not one (exit status 2 at the end). On a terminal, control characters
other than newline and tab are shown escaped (gpt.cli.for_terminal).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from gpt.cli import ArgumentParser, for_terminal, run_main, writing
from gpt.cli.options import (
    add_model_options,
    add_sampling_options,
    add_speculation_options,
    sample_config,
    speculation,
)
from gpt.errors import UserError

CHAT_DEFAULTS = {"temperature": 0.7, "max_new_tokens": 256}


def chat(args: argparse.Namespace) -> int | None:
    """--chat: a conversation on a terminal, or one JSON conversation per line of a pipe."""
    from gpt.checkpoints.loader import load_for_inference  # torch: after flags
    from gpt.infer.chat import Chat, chat_template, conversation_line  # torch: after flags
    from gpt.infer.sampling import SamplingError  # torch: after flags

    cfg = sample_config(args, CHAT_DEFAULTS)
    rt, model, tokenizer, meta, _ = load_for_inference(
        args.ckpt, args.device, args.dtype, args.threads, args.quantize, single_stream=True, group_size=args.group_size
    )
    template = chat_template(meta)
    if template is None and model.config.n_encoder_layer:
        raise SamplingError(f"{args.ckpt} is a seq2seq (encoder-decoder) checkpoint: translate with --source TEXT")
    if template is None:
        raise SamplingError(
            f"{args.ckpt} is not a chat model (its checkpoint has no chat template): fine-tune it on a chat "
            f"dataset (gpt prepare --chat, then gpt train --config sft --init-from it), or continue text "
            f"with --prompt"
        )
    drafter, _ = speculation(args, model, tokenizer)
    session = Chat(model, tokenizer, template, args.system, cfg, drafter)
    if not sys.stdin.isatty():
        failed, safe = 0, for_terminal(sys.stdout, "\\u{:04x}")  # (JSON escapes C0 itself)
        for number, line in enumerate(sys.stdin.buffer, 1):  # bytes: a line that is not UTF-8 is one error
            if not line.strip():
                continue
            try:
                answer = "".join(p.text for p in session.answer(conversation_line(line.decode("utf-8"))))
                out = {"role": "assistant", "content": answer}
            except UnicodeDecodeError:
                failed, out = failed + 1, {"error": f"line {number}: not UTF-8 text"}
            except UserError as e:
                failed, out = failed + 1, {"error": f"line {number}: {e}"}
            print(safe(json.dumps(out, ensure_ascii=False)), flush=True)
        return 2 if failed else None
    safe = for_terminal(sys.stdout)
    print(
        f"chatting with {args.ckpt} ({rt.device}, {rt.precision()}); /reset starts over, /exit or Ctrl-D ends",
        file=sys.stderr,
    )
    while True:
        try:
            text = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return None
        if text.strip() in ("/exit", "/quit"):
            return None
        if text.strip() == "/reset":
            session.reset()
            print("(a new conversation)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        if text.strip().startswith("/") and len(text.split()) == 1:  # a mistyped command is not a message
            print(f"(unknown command {text.strip()}: /reset starts over, /exit ends)", file=sys.stderr)
            continue
        sys.stdout.write("assistant> ")
        try:
            for piece in session.say(text):
                sys.stdout.write(safe(piece.text))
                sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n(interrupted: the answer is left out of the conversation)", file=sys.stderr)
            continue
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        if session.dropped:
            print(f"(the {session.dropped} oldest turn(s) left the context)", file=sys.stderr)


def parse_args(argv: Sequence[str] | None = None, prog: str = "gpt chat") -> argparse.Namespace:
    p = ArgumentParser(
        prog=prog,
        description="Chat with a chat checkpoint: a conversation in the terminal, or one JSON conversation per "
        "line when stdin is not a terminal.",
    )
    p.add_argument("--ckpt", required=True, help="run directory (best.pt, else last.pt) or checkpoint file")
    p.add_argument("--system", default=None, metavar="TEXT", help="the system message of the conversation")
    add_sampling_options(
        p,
        max_new_tokens=f"{CHAT_DEFAULTS['max_new_tokens']}, fewer when the context is nearly full",
        temperature=str(CHAT_DEFAULTS["temperature"]),
    )
    add_speculation_options(p)
    add_model_options(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "gpt chat") -> int:
    args = parse_args(argv, prog)
    status = []
    code = run_main(lambda: status.append(writing(chat, args)))
    return code or (status[0] if status and status[0] else 0)

"""The sample.py command: flags, streamed printing, and the translation mode (the script stays thin).

    python sample.py --ckpt out/shakespeare-char --prompt "ROMEO:" --num-samples 3 --max-new-tokens 300
    python sample.py --ckpt path/to/hf-gpt2-dir --prompt-file prompt.txt --temperature 0 --stop "\\n\\n"
    python sample.py --ckpt out/multi30k --source "Ein Mann fährt Fahrrad." --beam-size 4
    python sample.py --ckpt out/multi30k --source-file test.de --batch-size 64 > test.hyp.en
    python sample.py --ckpt out/chat --chat --system "Answer in English."      # a conversation in the terminal
    echo '[{"role": "user", "content": "Hallo"}]' | python sample.py --ckpt out/chat --chat   # JSON lines

Samples are generated in batches (as many as 1 GiB of KV cache holds: gpt.sampling.batch_rows), so any
--num-samples runs in bounded memory; the first sample streams live, each later one as soon as those
before it are done. A separator line goes between samples; a summary (tokens/s, time to first token, the
seed that reproduces the run) goes to stderr. Mistakes print one `error: ...` line and exit 2; a reader
that closes stdout early (`| head`) ends the command quietly (gpt/cli/__init__.py).

Translation (`--source`, repeatable, or `--source-file`, one sentence per line) needs a checkpoint
whose meta has "seq2seq" (trained on a pairs dataset) and prints exactly one line per source, in
order (line breaks inside a translation become spaces); sentences are decoded in batches of similar
length. It is greedy by default: `--temperature` defaults to 0 here (0.8 when sampling text), and
`--beam-size N` > 1 is beam search with `--length-penalty` alpha. An explicit `--temperature` > 0
samples (with `--top-k`, `--top-p`, `--seed`). `--max-new-tokens` bounds each translation (default:
its batch's longest source + 50 tokens, at most the model's block_size). Text-only flags (`--prompt`,
`--num-samples`, `--stop`, ...) with a seq2seq checkpoint, or `--source` with a decoder-only one, are
errors. `--stop` understands the escapes \\n, \\t, \\r and \\\\ (a shell passes them as two characters).

Chat (checkpoints fine-tuned on a `--chat` dataset, whose meta holds the chat template): `--chat` on a
terminal is a conversation: type a message, the answer streams; `/reset` starts over (the `--system`
message stays), `/exit` or Ctrl-D ends. The oldest turns leave the context when it is full
(gpt/infer/chat.py). With stdin not a terminal, each input line is one conversation as JSON (a list of
messages, or an object with "messages", ending in the user's) and each output line the answer as
{"role": "assistant", "content": ...}, or {"error": ...} for a line that is not one (exit status 2 at
the end). `--prompt` on a chat checkpoint is the user's message, answered (the template applied).
On a terminal, control characters other than newline and tab are shown escaped, ESC as `\\x1b`
(gpt.cli.for_terminal); a pipe or a file gets the text exactly as generated.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import sys
import time
import warnings

from gpt.cli import ArgumentParser, closed_stdout, fail, for_terminal, run_main
from gpt.errors import UserError, storage_error

SEPARATOR = "\n---------------\n"
LM_DEFAULTS = {"temperature": 0.8, "max_new_tokens": 500}
# flags of one mode given in the other: dest -> (flag, the default that means "not given")
TEXT_ONLY = {
    "num_samples": ("--num-samples", 1),
    "stop": ("--stop", []),
    "stop_at_eot": ("--no-stop-at-eot", True),
    "repetition_penalty": ("--repetition-penalty", 1.0),
    "compile": ("--compile", False),
    "cuda_graph": ("--no-cuda-graph", True),
}
TRANSLATION_ONLY = {
    "beam_size": ("--beam-size", None),
    "length_penalty": ("--length-penalty", None),
    "batch_size": ("--batch-size", None),
}


def _top_k(value: str) -> int | None:
    return None if value.strip().lower() in ("none", "off") else int(value)


_top_k.__name__ = "top-k"  # argparse's message: "invalid top-k value: 'x'"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Sample from a gpt checkpoint (run directory or .pt file) or a Hugging Face GPT-2 directory."
    )
    p.add_argument(
        "--ckpt", required=True, help="run directory (best.pt, else last.pt), checkpoint file, or HF GPT-2 dir"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (default: empty, which starts from end-of-text)")
    src.add_argument("--prompt-file", help="read the prompt from this UTF-8 file instead")
    src.add_argument(
        "--source",
        action="append",
        metavar="TEXT",
        help="seq2seq checkpoints: a sentence to translate; repeatable, one output line each",
    )
    src.add_argument("--source-file", help="seq2seq checkpoints: translate each line of this UTF-8 file")
    src.add_argument(
        "--chat",
        action="store_true",
        help="chat checkpoints: a conversation in the terminal (/reset, /exit); stdin not a terminal: one "
        "JSON conversation per line in, one answer per line out",
    )
    p.add_argument(
        "--system", default=None, metavar="TEXT", help="chat checkpoints: the system message of the conversation"
    )
    p.add_argument(
        "--num-samples", type=int, default=1, help="samples, generated together in batches that fit 1 GiB (default: 1)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens generated per sample at most (default: 500; translation: source length + 50, at most block_size)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="softmax temperature; 0 is greedy (default: 0.8; translation: 0)",
    )
    p.add_argument(
        "--top-k", type=_top_k, default=200, help="keep the k most likely tokens; 'none' keeps all (default: 200)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 is off (default: 1)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="CTRL-style penalty on tokens already present; 1 is off (default: 1)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample at this text, which is not printed; repeatable (default: none)",
    )
    p.add_argument(
        "--no-stop-at-eot",
        dest="stop_at_eot",
        action="store_false",
        help="keep generating after the end-of-text token (default: stop there)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed (default: a fresh one, printed in the summary to reproduce the run)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps (default: auto)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on a capable GPU or a CPU with native bf16, else "
        "float32), float32, bfloat16, float16 (CUDA only) (default: auto)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for PyTorch; 0 = one for small models or a busy machine, else PyTorch's default (default: 0)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8"],
        help="int8: dynamic int8 Linear layers, CPU and float32 only (gpt/model/quantize.py) (default: none)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the one-token decode step (prefill stays eager; on CUDA it replaces the CUDA-graph "
        "steps). The second token waits for the compile: 15-20 s on one CPU core, for the char model as for "
        "GPT-2 124M (1-4 s once torch's on-disk cache holds the code). Then it decodes ~1.3x eager for small "
        "float32 models and as fast as eager (0.98-1.01x) for GPT-2-sized ones, whose matrix products "
        "dominate: worth it only for long generations of small models (default: off)",
    )
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="on CUDA, launch each decode step's kernels one by one instead of replaying a "
        "recorded CUDA graph (default: graphs on)",
    )
    p.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="print everything at the end (default: stream as generated)",
    )
    t = p.add_argument_group("translation (--source / --source-file, seq2seq checkpoints)")
    t.add_argument("--beam-size", type=int, default=None, help="beams; 1 is greedy (or sampling) (default: 1)")
    t.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        help="GNMT length penalty alpha for beam search; larger favours longer output (default: 1, "
        "gpt.infer.translate.DEFAULT_LENGTH_PENALTY, chosen on Multi30k's val split)",
    )
    t.add_argument("--batch-size", type=int, default=None, help="sentences decoded together (default: 64)")
    return p.parse_args(argv)


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """`\\n`, `\\t`, `\\r`, `\\\\` typed in a shell (two characters each) as the characters they name."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


def _given(value, default):
    """A flag's value, or the mode's default when it was not given (0 is a value, not "not given")."""
    return default if value is None else value


def mode_error(args: argparse.Namespace) -> str | None:
    """Flags of text sampling given for translation (--source), or the other way round; flags a chat
    conversation cannot take."""
    if args.chat:
        given = [
            flag
            for dest, (flag, unset) in {**TEXT_ONLY, **TRANSLATION_ONLY}.items()
            if dest != "stop" and getattr(args, dest) != unset
        ]
        if given:
            return f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not for --chat (one answer per message)"
        return None
    if args.system is not None and (args.source or args.source_file):
        return "--system is for chat checkpoints (--chat or --prompt), not translation"
    translating = bool(args.source or args.source_file)
    wrong = TEXT_ONLY if translating else TRANSLATION_ONLY
    given = [flag for dest, (flag, unset) in wrong.items() if getattr(args, dest) != unset]
    if not given:
        return None
    if translating:
        return f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for text sampling (--prompt), not translation"
    return f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for translation: give --source or --source-file"


def sample_config(args: argparse.Namespace, defaults: dict, **fields):
    """The sampling flags as a SampleConfig, the mode's `defaults` for the flags not given; without --seed
    a fresh seed, which the summary prints so the run can be reproduced."""
    from gpt.infer.sampling import SampleConfig  # torch: after flags

    return SampleConfig(
        max_new_tokens=_given(args.max_new_tokens, defaults["max_new_tokens"]),
        temperature=_given(args.temperature, defaults["temperature"]),
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(map(unescape, args.stop)),
        seed=args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1,
        **fields,
    )


class OrderedPrinter:
    """Prints samples in order: sample i streams live once samples before it are finished. Only the
    samples still waiting their turn are held (in memory as large as the batch decoded at once)."""

    def __init__(self, n: int, prompt: str, write):
        self.n, self.prompt, self.write = n, prompt, write
        self.buffers: dict[int, list[str]] = {}
        self.done: set[int] = set()
        self.current = 0
        self.write(prompt)

    def add(self, sample: int, text: str, finished: bool) -> None:
        if sample == self.current:
            self.write(text)
        else:
            self.buffers.setdefault(sample, []).append(text)
        if finished:
            self.done.add(sample)
        while self.current in self.done:
            self.done.discard(self.current)
            self.current += 1
            if self.current < self.n:
                self.write(SEPARATOR + self.prompt + "".join(self.buffers.pop(self.current, ())))
            else:
                self.write("\n")


def run(args: argparse.Namespace) -> None:
    import torch  # torch: after flags

    from gpt.checkpoints.loader import (
        load_for_inference,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )
    from gpt.infer.chat import chat_template, end_tokens, fit  # torch: after flags
    from gpt.infer.sampling import ContextWarning, SamplingError, generate  # torch: after flags

    if args.source or args.source_file:
        return translate(args)
    if args.chat:
        return chat(args)
    cfg = sample_config(
        args,
        LM_DEFAULTS,
        num_samples=args.num_samples,
        stop_at_eot=args.stop_at_eot,
        cuda_graph=args.cuda_graph and not args.compile,
    )  # validated before anything slow happens
    seed = cfg.seed
    prompt = args.prompt or ""
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except UnicodeDecodeError:
            raise SamplingError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
        except OSError as e:
            raise storage_error(e, "read --prompt-file", args.prompt_file) from None

    rt, model, tokenizer, meta, _ = load_for_inference(
        args.ckpt, args.device, args.dtype, args.threads, args.quantize, single_stream=True
    )
    device = rt.device
    if model.config.n_encoder_layer:
        raise SamplingError(
            f"{args.ckpt} is a seq2seq (encoder-decoder) checkpoint: translate with --source TEXT "
            f"or --source-file FILE{', not --prompt' if args.prompt is not None or args.prompt_file else ''}"
        )
    template = chat_template(meta)
    shown = prompt  # what is printed before each sample: the prompt a plain model continues
    if template is not None:  # a chat model answers the prompt as the user's message
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt, budget, _ = fit(template, tokenizer, [*messages, {"role": "user", "content": prompt}],
                                model.config.block_size, cfg.max_new_tokens)  # fmt: skip
        cfg = dataclasses.replace(cfg, max_new_tokens=budget, end_tokens=end_tokens(template, tokenizer))
        shown = ""
    elif args.system is not None:
        raise SamplingError(
            f"--system is for chat checkpoints; {args.ckpt} is a plain language model (no chat template)"
        )
    if args.compile:
        model.compile_decoding()

    out, safe = (sys.stdout if args.stream else io.StringIO()), for_terminal(sys.stdout)

    def write(text: str) -> None:
        out.write(safe(text))
        if args.stream:
            out.flush()

    start = time.perf_counter()
    first = None
    n_tokens = 0
    with warnings.catch_warnings():
        warnings.simplefilter("always", ContextWarning)
        pieces = generate(model, tokenizer, prompt, cfg)  # checks the prompt before anything is printed
        printer = OrderedPrinter(cfg.num_samples, shown, write)
        try:
            for piece in pieces:
                if first is None:
                    first = time.perf_counter() - start
                n_tokens += len(piece.ids)
                printer.add(piece.sample, piece.text, piece.finish is not None)
        except torch.cuda.OutOfMemoryError:
            raise SamplingError(
                f"CUDA out of memory generating {cfg.num_samples} samples at once: ask for fewer "
                f"--num-samples (or use --device cpu)"
            ) from None
    elapsed = time.perf_counter() - start
    if not args.stream:
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()
    print(
        f"{cfg.num_samples} sample(s), {n_tokens} tokens in {elapsed:.2f} s: {n_tokens / elapsed:.1f} tokens/s "
        f"(first token after {1000 * (first or 0):.0f} ms); seed {seed}, {device}, {rt.precision()}"
        + (f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""),
        file=sys.stderr,
    )


CHAT_DEFAULTS = {"temperature": 0.7, "max_new_tokens": 256}


def chat(args: argparse.Namespace) -> int | None:
    """--chat: a conversation on a terminal, or one JSON conversation per line of a pipe."""
    from gpt.checkpoints.loader import load_for_inference  # torch: after flags
    from gpt.infer.chat import Chat, chat_template, conversation_line  # torch: after flags
    from gpt.infer.sampling import SamplingError  # torch: after flags

    cfg = sample_config(args, CHAT_DEFAULTS)
    rt, model, tokenizer, meta, _ = load_for_inference(
        args.ckpt, args.device, args.dtype, args.threads, args.quantize, single_stream=True
    )
    template = chat_template(meta)
    if template is None and model.config.n_encoder_layer:
        raise SamplingError(f"{args.ckpt} is a seq2seq (encoder-decoder) checkpoint: translate with --source TEXT")
    if template is None:
        raise SamplingError(
            f"{args.ckpt} is not a chat model (its checkpoint has no chat template): fine-tune it on a chat "
            f"dataset (data/prepare.py --chat, then train.py --config sft --init-from it), or continue text "
            f"with --prompt"
        )
    session = Chat(model, tokenizer, template, args.system, cfg)
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


def translate(args: argparse.Namespace) -> None:
    """--source / --source-file: one translated line per source on stdout, a summary on stderr."""
    from gpt.checkpoints.loader import (
        load_for_inference,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )
    from gpt.data.pairs import read_lines  # torch: after flags
    from gpt.infer.translate import (  # torch: after flags
        DEFAULT_LENGTH_PENALTY,
        TranslateConfig,
        TranslateError,
        is_seq2seq,
        translate_lines,
    )

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    cfg = TranslateConfig(
        beam_size=_given(args.beam_size, 1),
        length_penalty=_given(args.length_penalty, DEFAULT_LENGTH_PENALTY),
        temperature=_given(args.temperature, 0.0),
        top_k=args.top_k,
        top_p=args.top_p,
        batch_size=_given(args.batch_size, 64),
        max_new_tokens=args.max_new_tokens,
        seed=seed,
    )  # validated before anything slow happens
    sources = args.source or read_lines(args.source_file)
    if not sources:
        raise TranslateError(f"{args.source_file} is empty: nothing to translate")
    rt, model, tokenizer, meta, _ = load_for_inference(args.ckpt, args.device, args.dtype, args.threads, args.quantize)
    device = rt.device
    if not is_seq2seq(meta):
        raise TranslateError(
            f"--source needs a seq2seq (encoder-decoder) checkpoint; {args.ckpt} is decoder-only: "
            f"continue text with --prompt instead"
        )
    start = time.perf_counter()
    lines = translate_lines(model, tokenizer, meta, sources, cfg)
    elapsed = time.perf_counter() - start
    sys.stdout.write(for_terminal(sys.stdout)("".join(line + "\n" for line in lines)))
    sys.stdout.flush()
    print(
        f"{len(lines)} sentence(s) in {elapsed:.2f} s: {len(lines) / elapsed:.1f} sentences/s; {cfg.describe()}"
        f"{f'; seed {seed}' if cfg.sampling else ''}; {device}, {rt.precision()}",
        file=sys.stderr,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character never raises
    problem = mode_error(args)
    if problem:
        return fail(problem)
    status = []
    code = run_main(lambda: status.append(writing(run, args)))
    return code or (status[0] if status and status[0] else 0)


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

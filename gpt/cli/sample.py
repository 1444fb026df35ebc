"""`gpt sample` (sample.py in a checkout): flags, streamed printing, and the translation mode.

    gpt sample --ckpt out/shakespeare-char --prompt "ROMEO:" --num-samples 3 --max-new-tokens 300
    gpt sample --ckpt path/to/hf-gpt2-dir --prompt-file prompt.txt --temperature 0 --stop "\\n\\n"
    gpt sample --ckpt out/multi30k --source "Ein Mann fährt Fahrrad." --beam-size 4
    gpt sample --ckpt out/multi30k --source-file test.de --batch-size 64 > test.hyp.en
    gpt sample --ckpt out/chat --chat --system "Answer in English."      # the conversation of `gpt chat`
    echo '[{"role": "user", "content": "Hallo"}]' | gpt sample --ckpt out/chat --chat   # JSON lines

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

Chat (checkpoints fine-tuned on a `--chat` dataset, whose meta holds the chat template; gpt/cli/chat.py): `--chat` on a
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
import io
import sys
import time
import warnings

from gpt.cli import ArgumentParser, fail, for_terminal, run_main, writing
from gpt.cli.chat import chat
from gpt.cli.options import (
    add_model_options,
    add_sampling_options,
    add_speculation_options,
    fresh_seed,
    given,
    sample_config,
    speculation,
)
from gpt.errors import storage_error

SEPARATOR = "\n---------------\n"
LM_DEFAULTS = {"temperature": 0.8, "max_new_tokens": 500}
COMPILE_NOTE = (
    "--compile: the second token waits for the compile (seconds for a small model, tens of seconds for GPT-2 124M "
    "on a CPU), or for loading it when an earlier run compiled these weights (GPT_COMPILE_CACHE)"
)
COMPILED_ALREADY = (
    "--compile: nothing to compile: this int8 model decodes through our C kernels on this CPU, which are faster "
    'than a compiled int8 step (bench/README.md, "Against llama.cpp")'
)
# flags of one mode given in the other: dest -> (flag, the default that means "not given")
TEXT_ONLY = {
    "num_samples": ("--num-samples", 1),
    "stop": ("--stop", []),
    "stop_at_eot": ("--no-stop-at-eot", True),
    "repetition_penalty": ("--repetition-penalty", 1.0),
    "min_p": ("--min-p", 0.0),
    "presence_penalty": ("--presence-penalty", 0.0),
    "frequency_penalty": ("--frequency-penalty", 0.0),
    "logit_bias": ("--logit-bias", []),
    "json_schema": ("--json-schema", None),
    "grammar": ("--grammar", None),
    "regex": ("--regex", None),
    "compile": ("--compile", False),
    "speculate": ("--speculate", None),
    "draft_ckpt": ("--draft-ckpt", None),
    "cuda_graph": ("--no-cuda-graph", True),
}
# text-only flags a chat conversation takes too (gpt/cli/chat.py reads them through sample_config)
CHAT_TOO = {"stop", "min_p", "presence_penalty", "frequency_penalty", "logit_bias", "json_schema", "grammar", "regex"}
CHAT_TOO |= {"speculate", "draft_ckpt"}
TRANSLATION_ONLY = {
    "beam_size": ("--beam-size", None),
    "length_penalty": ("--length-penalty", None),
    "batch_size": ("--batch-size", None),
}


def parse_args(argv=None, prog: str = "gpt sample") -> argparse.Namespace:
    p = ArgumentParser(
        prog=prog,
        description="Sample from a gpt checkpoint (run directory or .pt file) or a Hugging Face GPT-2 directory.",
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
    add_sampling_options(
        p, max_new_tokens="500; translation: source length + 50, at most block_size", temperature="0.8; translation: 0"
    )
    p.add_argument(
        "--no-stop-at-eot",
        dest="stop_at_eot",
        action="store_false",
        help="keep generating after the end-of-text token (default: stop there)",
    )
    add_model_options(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the one-token decode step (prefill stays eager): on the CPU ahead of time into one C++ "
        "function with the weights inside (a second copy of them in memory), torch.compile's graph on CUDA (it "
        "replaces the CUDA-graph steps). The second token waits for the compile; later runs on the same weights "
        "load it from a disk cache (GPT_COMPILE_CACHE=DIR, or off). On the CPU it gains most for small models; "
        "with --quantize int8, where our own C kernels take the whole step (a C compiler, GPT-2's block shape), "
        'there is nothing to compile: they decode faster (compile times and tokens/s: bench/README.md, "Against '
        'llama.cpp"). Worth it for long generations (default: off)',
    )
    add_speculation_options(p)
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


def mode_error(args: argparse.Namespace) -> str | None:
    """Flags of text sampling given for translation (--source), or the other way round; flags a chat
    conversation cannot take."""
    if args.chat:
        named = [
            flag
            for dest, (flag, unset) in {**TEXT_ONLY, **TRANSLATION_ONLY}.items()
            if dest not in CHAT_TOO and getattr(args, dest) != unset
        ]
        if named:
            return f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} not for --chat (one answer per message)"
        return None
    if args.system is not None and (args.source or args.source_file):
        return "--system is for chat checkpoints (--chat or --prompt), not translation"
    if args.speculate is not None and args.speculate < 1:
        return f"--speculate must be a number of tokens >= 1, got {args.speculate}"
    if args.compile and (args.speculate is not None or args.draft_ckpt is not None):
        return "--speculate and --draft-ckpt decode eagerly: leave out --compile"
    translating = bool(args.source or args.source_file)
    wrong = TEXT_ONLY if translating else TRANSLATION_ONLY
    named = [flag for dest, (flag, unset) in wrong.items() if getattr(args, dest) != unset]
    if not named:
        return None
    if translating:
        return f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} for text sampling (--prompt), not translation"
    return f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} for translation: give --source or --source-file"


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
    from gpt.infer import speculative  # torch: after flags
    from gpt.infer.chat import chat_prompt, chat_template  # torch: after flags
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
        args.ckpt,
        args.device,
        args.dtype,
        args.threads,
        args.quantize,
        single_stream=True,
        compile_step=args.compile,
        group_size=args.group_size,
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
        messages = [{"role": "user", "content": prompt}]
        prompt, cfg, _, _ = chat_prompt(template, tokenizer, messages, cfg, model.config.block_size, args.system)
        shown = ""
    elif args.system is not None:
        raise SamplingError(
            f"--system is for chat checkpoints; {args.ckpt} is a plain language model (no chat template)"
        )

    out, safe = (sys.stdout if args.stream else io.StringIO()), for_terminal(sys.stdout)

    def write(text: str) -> None:
        out.write(safe(text))
        if args.stream:
            out.flush()

    if args.compile:
        print(COMPILE_NOTE if model.decode_step is not None else COMPILED_ALREADY, file=sys.stderr)
    start = time.perf_counter()
    first = None
    n_tokens = 0
    with warnings.catch_warnings():
        warnings.simplefilter("always", ContextWarning)
        drafter, stats = speculation(args, model, tokenizer)
        if drafter is None:
            pieces = generate(model, tokenizer, prompt, cfg)  # checks the prompt before anything is printed
        else:
            pieces = speculative.generate(model, tokenizer, prompt, cfg, drafter, stats=stats)
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
    compiling = getattr(model.decode_step, "compile_seconds", 0.0)  # the CPU's compiled step times its compile
    rate = f"{n_tokens / elapsed:.1f} tokens/s"
    if compiling:
        what = "loading the compiled step" if getattr(model.decode_step, "cache_hits", 0) else "compiling"
        rate = f"{compiling:.1f} s of it {what}, {n_tokens / max(elapsed - compiling, 1e-9):.1f} tokens/s without"
    if drafter is not None:
        rate += f", {stats.acceptance:.0%} of {stats.drafted} guesses kept ({n_tokens / max(stats.passes, 1):.2f} tokens a pass)"
    print(
        f"{cfg.num_samples} sample(s), {n_tokens} tokens in {elapsed:.2f} s: {rate} "
        f"(first token after {1000 * (first or 0):.0f} ms); seed {seed}, {device}, {rt.precision()}"
        + (f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""),
        file=sys.stderr,
    )


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

    seed = fresh_seed(args)
    cfg = TranslateConfig(
        beam_size=given(args.beam_size, 1),
        length_penalty=given(args.length_penalty, DEFAULT_LENGTH_PENALTY),
        temperature=given(args.temperature, 0.0),
        top_k=args.top_k,
        top_p=args.top_p,
        batch_size=given(args.batch_size, 64),
        max_new_tokens=args.max_new_tokens,
        seed=seed,
    )  # validated before anything slow happens
    sources = args.source or read_lines(args.source_file)
    if not sources:
        raise TranslateError(f"{args.source_file} is empty: nothing to translate")
    rt, model, tokenizer, meta, _ = load_for_inference(
        args.ckpt, args.device, args.dtype, args.threads, args.quantize, group_size=args.group_size
    )
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


def main(argv=None, prog: str = "gpt sample") -> int:
    args = parse_args(argv, prog)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character never raises
    problem = mode_error(args)
    if problem:
        return fail(problem)
    status = []
    code = run_main(lambda: status.append(writing(run, args)))
    return code or (status[0] if status and status[0] else 0)

"""Sample text from a trained checkpoint or a Hugging Face GPT-2 directory, streamed as it comes.

    python sample.py --ckpt out/shakespeare-char --prompt "ROMEO:" --num-samples 3 --max-new-tokens 300
    python sample.py --ckpt path/to/hf-gpt2-dir --prompt-file prompt.txt --temperature 0 --stop "\\n\\n"

Samples are generated as one batch; the first streams live, each later one as soon as those before
it are done. A separator line goes between samples; a summary (tokens/s, time to first token, the
seed that reproduces the run) goes to stderr. Mistakes print one `error: ...` line and exit 2.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import warnings

SEPARATOR = "\n---------------\n"


def _top_k(value: str) -> int | None:
    return None if value.strip().lower() in ("none", "off") else int(value)


_top_k.__name__ = "top-k"  # argparse's message: "invalid top-k value: 'x'"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Sample from a gpt checkpoint (run directory or .pt file) or a Hugging Face GPT-2 directory."
    )
    p.add_argument("--ckpt", required=True, help="run directory (best.pt, else last.pt), checkpoint file, or HF GPT-2 dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="", help="prompt text (default: empty, which starts from end-of-text)")
    src.add_argument("--prompt-file", help="read the prompt from this UTF-8 file instead")
    p.add_argument("--num-samples", type=int, default=1, help="samples, generated as one batch (default: 1)")
    p.add_argument("--max-new-tokens", type=int, default=500, help="tokens generated per sample at most (default: 500)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=_top_k, default=200,
                   help="keep the k most likely tokens; 'none' keeps all (default: 200)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 is off (default: 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="CTRL-style penalty on tokens already present; 1 is off (default: 1)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sample at this text, which is not printed; repeatable (default: none)")
    p.add_argument("--no-stop-at-eot", dest="stop_at_eot", action="store_false",
                   help="keep generating after the end-of-text token (default: stop there)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed (default: a fresh one, printed in the summary to reproduce the run)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps "
                   "(default: auto)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a capable GPU, else float32), float32, "
                   "bfloat16, float16 (CUDA only) (default: auto)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward (default: off)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="print everything at the end (default: stream as generated)")
    return p.parse_args(argv)


class OrderedPrinter:
    """Prints samples in order: sample i streams live once samples before it are finished."""

    def __init__(self, n: int, prompt: str, write):
        self.n, self.prompt, self.write = n, prompt, write
        self.buffers = [[] for _ in range(n)]
        self.done = [False] * n
        self.current = 0
        self.write(prompt)

    def add(self, sample: int, text: str, finished: bool) -> None:
        if sample == self.current:
            self.write(text)
        else:
            self.buffers[sample].append(text)
        self.done[sample] = self.done[sample] or finished
        while self.current < self.n and self.done[self.current]:
            self.current += 1
            if self.current < self.n:
                self.write(SEPARATOR + self.prompt + "".join(self.buffers[self.current]))
            else:
                self.write("\n")


def run(args: argparse.Namespace) -> None:
    import torch

    from gpt import generate, load_checkpoint
    from gpt.sampling import ContextWarning, SampleConfig, resolve_device, resolve_dtype

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    cfg = SampleConfig(
        num_samples=args.num_samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty, stop=tuple(args.stop),
        stop_at_eot=args.stop_at_eot, seed=seed,
    )  # validated before anything slow happens
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()

    model, tokenizer, _ = load_checkpoint(args.ckpt, device=device)
    model.to(dtype)
    if args.compile:
        model.hidden = torch.compile(model.hidden, dynamic=True)

    out = sys.stdout if args.stream else io.StringIO()

    def write(text: str) -> None:
        out.write(text)
        if args.stream:
            out.flush()

    start = time.perf_counter()
    first = None
    n_tokens = 0
    with warnings.catch_warnings():
        warnings.simplefilter("always", ContextWarning)
        warnings.showwarning = lambda message, *a, **k: print(f"warning: {message}", file=sys.stderr)
        pieces = generate(model, tokenizer, prompt, cfg)  # checks the prompt before anything is printed
        printer = OrderedPrinter(cfg.num_samples, prompt, write)
        for piece in pieces:
            if first is None:
                first = time.perf_counter() - start
            n_tokens += len(piece.ids)
            printer.add(piece.sample, piece.text, piece.finish is not None)
    elapsed = time.perf_counter() - start
    if not args.stream:
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()
    print(
        f"{cfg.num_samples} sample(s), {n_tokens} tokens in {elapsed:.2f} s: {n_tokens / elapsed:.1f} tokens/s "
        f"(first token after {1000 * (first or 0):.0f} ms); seed {seed}, {device}, {str(dtype).replace('torch.', '')}",
        file=sys.stderr,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character never raises
    try:
        run(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:  # CheckpointError and SamplingError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

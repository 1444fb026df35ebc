"""BLEU of a translation checkpoint (seq2seq, or a chat model answering an instruction): `python -m gpt.evaluate`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from gpt.cli import ArgumentParser, run_main
from gpt.data.pairs import read_lines
from gpt.errors import storage_error
from gpt.fsutil import write_text
from gpt.infer.chat import chat_template
from gpt.infer.evaluate import EvaluateError, evaluate, evaluate_chat
from gpt.infer.translate import DEFAULT_LENGTH_PENALTY, TranslateConfig, check_vocab, one_line, seq2seq_ids


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m gpt.evaluate",
        description="Corpus BLEU (sacrebleu) of a seq2seq checkpoint, or of a chat checkpoint's answers to "
        "--instruction, and sentences/s.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ckpt", required=True, help="run directory (best.pt, else last.pt) or checkpoint file")
    p.add_argument("--source-file", required=True, help="source sentences, one per line")
    p.add_argument("--reference", required=True, help="reference translations, line i for source line i")
    p.add_argument("--beam-size", type=int, default=1, help="1 = greedy (chat checkpoints: greedy only)")
    p.add_argument(
        "--instruction",
        default="{source}",
        help="chat checkpoints: the user's message, {source} replaced by each source line, e.g. "
        "'Translate to English: {source}'",
    )
    p.add_argument("--system", default=None, help="chat checkpoints: a system message before each instruction")
    p.add_argument("--length-penalty", type=float, default=DEFAULT_LENGTH_PENALTY, help="GNMT alpha for beam search")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together")
    p.add_argument("--max-new-tokens", type=int, help="output length limit (default: source length + 50)")
    p.add_argument("--limit", type=int, help="evaluate only the first N lines")
    p.add_argument("--output", help="write the translations here, one per line")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on a capable GPU or a CPU with native bf16, else "
        "float32), float32, bfloat16, float16 (CUDA only)",
    )
    p.add_argument("--threads", type=int, default=0, help="CPU threads for PyTorch; 0 = its default")
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8"],
        help="int8: dynamic int8 Linear layers, CPU only (gpt/model/quantize.py)",
    )
    return p


def check_output(path: str) -> None:
    """--output must name a file that can be created, checked before hours of decoding."""
    out = Path(path)
    parent = out.parent
    if out.is_dir():
        raise EvaluateError(f"--output {path} is a directory: name a file")
    if parent.exists() and not parent.is_dir():
        raise EvaluateError(f"--output {path}: {parent} is a file, not a directory")
    if not parent.exists():
        raise EvaluateError(f"--output {path}: there is no directory {parent}; create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK):
        raise EvaluateError(f"--output {path}: {parent} is not writable; choose another place")


def run(args: argparse.Namespace) -> str:
    from gpt.checkpoints.loader import (
        load_for_inference,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )

    # the ranges and the output path before anything is read; translate() checks what depends on the model
    TranslateConfig(
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    if args.limit is not None and args.limit < 1:
        raise EvaluateError(f"--limit must be an integer >= 1 (the first N lines), got {args.limit}")
    if args.output:
        check_output(args.output)
    sources, references = read_lines(args.source_file), read_lines(args.reference)
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]
    rt, model, tok, meta, _ = load_for_inference(args.ckpt, args.device, args.dtype, args.threads, args.quantize)
    check_vocab(tok, model)
    template = chat_template(meta)
    if template is not None:
        if args.beam_size != 1:
            raise EvaluateError(f"--beam-size {args.beam_size}: a chat checkpoint answers greedily (--beam-size 1)")
        result = evaluate_chat(
            model,
            tok,
            template,
            sources,
            references,
            args.instruction,
            args.system,
            args.batch_size,
            args.max_new_tokens,
        )
    elif not model.config.n_encoder_layer:
        raise EvaluateError(
            f"{args.ckpt} is a plain language model (no encoder, no chat template): BLEU needs a seq2seq checkpoint "
            f"(a pairs dataset) or a chat checkpoint (a --chat dataset)"
        )
    else:
        bos, eos = seq2seq_ids(meta)
        result = evaluate(
            model,
            tok,
            sources,
            references,
            bos,
            eos,
            args.beam_size,
            args.length_penalty,
            args.batch_size,
            args.max_new_tokens,
        )
    if args.output:
        try:
            write_text(args.output, "".join(one_line(h) + "\n" for h in result["hypotheses"]))
        except OSError as e:
            raise storage_error(e, "write", args.output) from None
    return (
        f"BLEU {result['bleu']:.2f} | beam {args.beam_size} | {result['sentences']} sentences in "
        f"{result['seconds']:.1f} s = {result['sentences_per_s']:.1f} sentences/s | {rt.device}, {rt.precision()} | "
        f"{result['bleu_text']} | "
        f"{result['signature']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())

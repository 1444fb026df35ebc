"""BLEU of a seq2seq checkpoint on a test set (corpus BLEU with sacrebleu) and decoding speed.

    python -m gpt.evaluate --ckpt out/multi30k \
        --source-file ../shared/data/multi30k/test_2016_flickr.de \
        --reference ../shared/data/multi30k/test_2016_flickr.en --beam-size 4

Prints one line: BLEU, sentences, seconds, sentences/s (decoding only, model loading excluded),
and sacrebleu's signature; `--output F` also writes the translations, one per source line.
Mistakes print one `error: ...` line and exit 2.

The checkpoint must describe a seq2seq model: `meta["model_config"]` with `n_encoder_layer > 0`,
`meta["tokenizer"]` (the dataset's spec) and `meta["seq2seq"] = {"bos": .., "eos": .., "pad": ..}`,
which a trainer copies from the pairs dataset (`PairDataset.seq2seq_meta()`).
Needs sacrebleu: `pip install -e ".[seq2seq]"`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Sequence

from gpt.errors import UserError, storage_error
from gpt.pairs import read_lines
from gpt.translate import DEFAULT_LENGTH_PENALTY, TranslateConfig, check_vocab, one_line, seq2seq_ids, translate


class EvaluateError(UserError, ValueError):
    """A checkpoint or input files that cannot be evaluated."""


def corpus_bleu(hypotheses: list[str], references: list[str]):
    try:
        import sacrebleu
    except ImportError:
        raise EvaluateError("BLEU needs sacrebleu: pip install -e \".[seq2seq]\" (or pip install sacrebleu)") from None
    metric = sacrebleu.metrics.BLEU()
    return metric.corpus_score(hypotheses, [references]), metric.get_signature()


def evaluate(
    model,
    tok,
    sources: list[str],
    references: list[str],
    bos: int,
    eos: int,
    beam_size: int = 1,
    alpha: float = DEFAULT_LENGTH_PENALTY,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
) -> dict:
    """Translate `sources`, score them against `references`; BLEU, the length ratio (sacrebleu's
    hypothesis / reference length after its tokenization, and the brevity penalty BP it costs), timing
    and the translations."""
    if len(sources) != len(references):
        raise EvaluateError(f"{len(sources)} source lines but {len(references)} reference lines: they must pair up")
    if not sources:
        raise EvaluateError("no source sentences to translate")
    t0 = time.perf_counter()
    hyps = translate(model, tok, sources, bos, eos, beam_size=beam_size, alpha=alpha, batch_size=batch_size,
                     max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - t0
    bleu, signature = corpus_bleu(hyps, references)
    return {
        "bleu": bleu.score, "bleu_text": str(bleu), "signature": str(signature), "sentences": len(sources),
        "ratio": bleu.ratio, "bp": bleu.bp, "hyp_len": bleu.sys_len, "ref_len": bleu.ref_len,
        "seconds": seconds, "sentences_per_s": len(sources) / seconds, "hypotheses": hyps,
    }


def build_parser() -> argparse.ArgumentParser:
    from gpt.cli import ArgumentParser

    p = ArgumentParser(
        prog="python -m gpt.evaluate", description="Corpus BLEU (sacrebleu) of a seq2seq checkpoint, and sentences/s.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ckpt", required=True, help="run directory (best.pt, else last.pt) or checkpoint file")
    p.add_argument("--source-file", required=True, help="source sentences, one per line")
    p.add_argument("--reference", required=True, help="reference translations, line i for source line i")
    p.add_argument("--beam-size", type=int, default=1, help="1 = greedy")
    p.add_argument("--length-penalty", type=float, default=DEFAULT_LENGTH_PENALTY, help="GNMT alpha for beam search")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together")
    p.add_argument("--max-new-tokens", type=int, help="output length limit (default: source length + 50)")
    p.add_argument("--limit", type=int, help="evaluate only the first N lines")
    p.add_argument("--output", help="write the translations here, one per line")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a capable GPU or a CPU with native bf16, else "
                   "float32), float32, bfloat16, float16 (CUDA only)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for PyTorch; 0 = its default")
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: dynamic int8 Linear layers, CPU only (gpt/quantize.py)")
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
    from gpt.checkpoint import load_for_inference

    # the ranges and the output path before anything is read; translate() checks what depends on the model
    TranslateConfig(beam_size=args.beam_size, length_penalty=args.length_penalty, batch_size=args.batch_size,
                    max_new_tokens=args.max_new_tokens)
    if args.limit is not None and args.limit < 1:
        raise EvaluateError(f"--limit must be an integer >= 1 (the first N lines), got {args.limit}")
    if args.output:
        check_output(args.output)
    sources, references = read_lines(args.source_file), read_lines(args.reference)
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]
    _, model, tok, meta, _ = load_for_inference(args.ckpt, args.device, args.dtype, args.threads, args.quantize)
    bos, eos = seq2seq_ids(meta)
    check_vocab(tok, model)
    result = evaluate(model, tok, sources, references, bos, eos, args.beam_size, args.length_penalty,
                      args.batch_size, args.max_new_tokens)
    if args.output:
        try:
            Path(args.output).write_text("".join(one_line(h) + "\n" for h in result["hypotheses"]), encoding="utf-8")
        except OSError as e:
            raise storage_error(e, "write", args.output) from None
    return (
        f"BLEU {result['bleu']:.2f} | beam {args.beam_size} | {result['sentences']} sentences in "
        f"{result['seconds']:.1f} s = {result['sentences_per_s']:.1f} sentences/s | {result['bleu_text']} | "
        f"{result['signature']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    from gpt.cli import run_main

    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())

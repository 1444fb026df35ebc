"""`gpt evaluate`: BLEU and ROUGE of a translation checkpoint (seq2seq, or a chat model answering
an instruction), or loss, perplexity and bits-per-byte of a language model over a text file.

    gpt evaluate --ckpt out/multi30k --source-file test.de --reference test.en --json results.json
    gpt evaluate --ckpt out/shakespeare-char --text ../shared/data/wikitext-2/test.txt --json results.json
    gpt evaluate --ckpt out/shakespeare-char --lm-eval gpt_shakespeare_next_line,gpt_wikitext2 --limit 100

The numbers are printed as a table (text) or one line (translation); `--json F` also writes them, with the
settings, to F. Scoring and greedy or beam decoding are deterministic (no sampling, no seed to set).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from gpt.checkpoints.outputs import check_targets
from gpt.cli import ArgumentParser, options, run_main
from gpt.cli.lmeval import DEFAULT_SEED, run_lm_eval
from gpt.data.pairs import read_lines
from gpt.data.tokenizer import TokenizerError
from gpt.errors import storage_error
from gpt.fsutil import replacing, write_text
from gpt.infer.chat import chat_template
from gpt.infer.evaluate import (
    ROUGE_TYPES,
    EvaluateError,
    check_metrics_installed,
    evaluate,
    evaluate_chat,
    parse_metrics,
)
from gpt.infer.perplexity import score_text
from gpt.infer.translate import DEFAULT_LENGTH_PENALTY, TranslateConfig, check_vocab, one_line, seq2seq_ids

TEXT_BATCH, SENTENCE_BATCH = 8, 64  # --batch-size's defaults: windows of block_size tokens / sentences


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="gpt evaluate",
        description="Corpus BLEU (sacrebleu) and ROUGE-1/2/L (rouge-score) of a seq2seq checkpoint, or of a chat "
        "checkpoint's answers to --instruction, and sentences/s; or, with --text, a language model's loss, "
        "perplexity and bits per byte over a text file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ckpt", required=True, help="run directory (best.pt, else last.pt) or checkpoint file")
    p.add_argument("--source-file", help="translation: source sentences, one per line")
    p.add_argument("--reference", help="translation: reference translations, line i for source line i")
    p.add_argument(
        "--text",
        help="score this UTF-8 text file as one document: loss per token, perplexity, bits per byte "
        "(any decoder-only checkpoint: char, BPE, GPT-2, RoPE, chat; see gpt/infer/perplexity.py)",
    )
    p.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="run lm-evaluation-harness on these comma-separated tasks through the server (gpt/cli/lmeval.py): "
        "this repository's gpt_shakespeare_next_line, gpt_wikitext2 (which scores --text, default "
        "$GPT_SHARED_DATA/wikitext2-test.txt) and gpt_wikitext2_next_sentence (passages of --text, default "
        "$GPT_SHARED_DATA/wikitext2-valid.txt), or lm-eval's own",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="--lm-eval: the server's prefix cache, so that the choices of one context share its prefill "
        "(the scores equal those without it; 0 = off)",
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="--lm-eval: lm-eval's random seed")
    p.add_argument(
        "--stride",
        type=int,
        help="--text: tokens each sliding window moves on; each scores that many new tokens with the rest of "
        "its block_size window as context (default: block_size // 2; block_size = lm-eval's disjoint windows)",
    )
    p.add_argument(
        "--metric",
        help="translation: comma-separated metrics, bleu and / or rouge (default: bleu,rouge)",
    )
    p.add_argument("--json", help="also write the numbers and settings to this JSON file")
    p.add_argument("--beam-size", type=int, default=1, help="1 = greedy (chat checkpoints: greedy only)")
    p.add_argument(
        "--instruction",
        default="{source}",
        help="chat checkpoints: the user's message, {source} replaced by each source line, e.g. "
        "'Translate to English: {source}'",
    )
    p.add_argument("--system", default=None, help="chat checkpoints: a system message before each instruction")
    p.add_argument("--length-penalty", type=float, default=DEFAULT_LENGTH_PENALTY, help="GNMT alpha for beam search")
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"sentences decoded together (default {SENTENCE_BATCH}); --text: windows scored together "
        f"(default {TEXT_BATCH})",
    )
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
    options.add_quantize(p)
    return p


def check_output(path: str, flag: str = "--output") -> None:
    """--output (--json) must name a file that can be created, checked before hours of decoding."""
    out = Path(path)
    parent = out.parent
    if out.is_dir():
        raise EvaluateError(f"{flag} {path} is a directory: name a file")
    if parent.exists() and not parent.is_dir():
        raise EvaluateError(f"{flag} {path}: {parent} is a file, not a directory")
    if not parent.exists():
        raise EvaluateError(f"{flag} {path}: there is no directory {parent}; create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK):
        raise EvaluateError(f"{flag} {path}: {parent} is not writable; choose another place")
    check_targets([out], force=True, flag=flag)  # replaced if it exists, but never a run's own file


def check_mode(args: argparse.Namespace) -> None:
    """--text, --lm-eval, or --source-file with --reference: one of the jobs, and only its own flags."""
    translation = [f for f in ("source_file", "reference") if getattr(args, f) is not None]
    if args.lm_eval is not None:
        given = [
            f"--{f.replace('_', '-')}"
            for f in (*translation, "metric", "output", "max_new_tokens", "stride")
            if getattr(args, f) is not None
        ]
        if given:
            raise EvaluateError(f"{' and '.join(given)}: not for --lm-eval (the harness's tasks through the server)")
        return
    if args.text is not None:
        given = [
            f"--{f.replace('_', '-')}"
            for f in (*translation, "metric", "output", "limit", "max_new_tokens")
            if getattr(args, f) is not None
        ]
        if given:
            raise EvaluateError(
                f"{' and '.join(given)}: for translations; --text scores a text file (loss, perplexity, bits per "
                f"byte): give one job or the other"
            )
        return
    if args.stride is not None:
        raise EvaluateError("--stride: for --text (the sliding windows over a text file)")
    if len(translation) != 2:
        raise EvaluateError(
            "give --text FILE (loss, perplexity and bits per byte of a language model) or --source-file and "
            "--reference (BLEU and ROUGE of translations)"
        )


def read_text(path: str) -> str:
    """The whole --text file, strictly UTF-8 and byte for byte (no newline translation: bits per byte
    counts the file's own bytes)."""
    file = Path(path)
    if file.is_dir():
        raise EvaluateError(f"--text {path} is a directory: name a text file")
    if not file.is_file():
        raise EvaluateError(f"--text {path}: no such file")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise storage_error(e, "read", path) from None
    if not data:
        raise EvaluateError(f"--text {path} is empty: nothing to score")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvaluateError(f"--text {path} is not UTF-8 text (byte {e.start}: {e.reason}): convert it first") from None


def write_json(path: str, results: dict) -> None:
    try:
        with replacing(path) as tmp:
            tmp.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        raise storage_error(e, "write", path) from None


def text_table(args: argparse.Namespace, r: dict, where: str) -> str:
    return "\n".join(
        [
            f"text        {args.text} ({r['bytes']:,} bytes, {r['tokens']:,} tokens, "
            f"{r['tokens_per_byte']:.3f} per byte)",
            f"loss        {r['loss']:.4f} nats per token",
            f"perplexity  {r['ppl']:.3f}",
            f"bits/byte   {r['bpb']:.4f}",
            f"windows     {r['windows']:,} of {r['window']} tokens, stride {r['stride']} | {r['seconds']:.1f} s, "
            f"{r['tokens_per_s']:,.0f} tokens/s | {where}",
        ]
    )


def run_text(args: argparse.Namespace) -> str:
    from gpt.checkpoints.loader import (
        load_for_inference,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )

    batch = TEXT_BATCH if args.batch_size is None else args.batch_size
    if batch < 1:
        raise EvaluateError(f"--batch-size must be an integer >= 1, got {batch}")
    if args.stride is not None and args.stride < 1:
        raise EvaluateError(f"--stride must be an integer >= 1, got {args.stride}")
    if args.json:
        check_output(args.json, "--json")
    text = read_text(args.text)
    rt, model, tok, meta, _ = load_for_inference(
        args.ckpt, args.device, args.dtype, args.threads, args.quantize, group_size=args.group_size
    )
    check_vocab(tok, model)
    try:
        result = score_text(model, tok, text, args.stride, batch, autocast=rt.autocast)
    except TokenizerError as e:  # a char vocabulary without some of the text's characters
        raise EvaluateError(f"--text {args.text}: {e}: the checkpoint's tokenizer cannot encode this text") from None
    where = f"{rt.device}, {rt.precision()}"
    if args.json:
        settings = {"ckpt": str(args.ckpt), "text": str(args.text), "batch_size": batch, "device": str(rt.device)}
        write_json(args.json, {"task": "text", **settings, "precision": rt.precision(), **result})
    return text_table(args, result, where)


def run(args: argparse.Namespace) -> str:
    check_mode(args)
    if args.lm_eval is not None:
        return run_lm_eval(args, write_json, check_output)
    if args.text is not None:
        return run_text(args)
    from gpt.checkpoints.loader import (
        load_for_inference,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )

    # the ranges and the output path before anything is read; translate() checks what depends on the model
    metrics = parse_metrics(args.metric)
    batch = SENTENCE_BATCH if args.batch_size is None else args.batch_size
    TranslateConfig(
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        batch_size=batch,
        max_new_tokens=args.max_new_tokens,
    )
    if args.limit is not None and args.limit < 1:
        raise EvaluateError(f"--limit must be an integer >= 1 (the first N lines), got {args.limit}")
    for path, flag in ((args.output, "--output"), (args.json, "--json")):
        if path:
            check_output(path, flag)
    check_metrics_installed(metrics)
    sources, references = read_lines(args.source_file), read_lines(args.reference)
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]
    rt, model, tok, meta, _ = load_for_inference(
        args.ckpt, args.device, args.dtype, args.threads, args.quantize, group_size=args.group_size
    )
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
            batch,
            args.max_new_tokens,
            metrics,
        )
    elif not model.config.n_encoder_layer:
        raise EvaluateError(
            f"{args.ckpt} is a plain language model (no encoder, no chat template): BLEU and ROUGE need a seq2seq "
            f"checkpoint (a pairs dataset) or a chat checkpoint (a --chat dataset); score a language model on a text "
            f"file with --text FILE"
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
            batch,
            args.max_new_tokens,
            metrics,
        )
    if args.output:
        try:
            write_text(args.output, "".join(one_line(h) + "\n" for h in result["hypotheses"]))
        except OSError as e:
            raise storage_error(e, "write", args.output) from None
    if args.json:
        settings = dict(
            ckpt=str(args.ckpt),
            source_file=str(args.source_file),
            reference=str(args.reference),
            limit=args.limit,
            beam_size=args.beam_size,
            length_penalty=args.length_penalty,
            instruction=args.instruction if template is not None else None,
            device=str(rt.device),
            precision=rt.precision(),
        )
        numbers = {k: v for k, v in result.items() if k != "hypotheses"}  # (those: --output)
        write_json(args.json, {"task": "chat" if template is not None else "translation", **settings, **numbers})
    scores = [f"BLEU {result['bleu']:.2f}"] if "bleu" in result else []
    scores += [f"{label} {result[key]:.2f}" for key, label in ROUGE_TYPES.items() if key in result]
    return " | ".join(
        [
            *scores,
            f"beam {args.beam_size}",
            f"{result['sentences']} sentences in {result['seconds']:.1f} s = "
            f"{result['sentences_per_s']:.1f} sentences/s",
            f"{rt.device}, {rt.precision()}",
            *([result["bleu_text"], result["signature"]] if "bleu" in result else []),
            *([result["rouge_signature"]] if "rouge_signature" in result else []),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args))

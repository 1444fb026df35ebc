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

import time

from gpt.errors import UserError
from gpt.infer.translate import DEFAULT_LENGTH_PENALTY, translate


class EvaluateError(UserError, ValueError):
    """A checkpoint or input files that cannot be evaluated."""


def corpus_bleu(hypotheses: list[str], references: list[str]):
    try:
        import sacrebleu
    except ImportError:
        raise EvaluateError('BLEU needs sacrebleu: pip install -e ".[seq2seq]" (or pip install sacrebleu)') from None
    metric = sacrebleu.metrics.BLEU()
    return metric.corpus_score(hypotheses, [references]), metric.get_signature()


def evaluate_chat(
    model,
    tok,
    template,
    sources: list[str],
    references: list[str],
    instruction: str = "{source}",
    system: str | None = None,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
) -> dict:
    """`evaluate` for a chat checkpoint: each source becomes the user's message (`instruction` with
    `{source}` replaced), the greedy answer is the translation."""
    from gpt.infer.chat import answer_ids, end_tokens, fit

    check_pairs(sources, references)
    if "{source}" not in instruction:
        raise EvaluateError(
            f"--instruction must contain {{source}} where the source sentence goes, got {instruction!r}"
        )
    t0 = time.perf_counter()
    prompts, budgets = [], []
    for source in sources:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": instruction.replace("{source}", source)})
        ids, budget, _ = fit(
            template, tok, messages, model.config.block_size, max_new_tokens or len(tok.encode(source)) + 50
        )
        prompts.append(ids)
        budgets.append(budget)
    answers = answer_ids(model, prompts, end_tokens(template, tok), tok.vocab_size, max(budgets), batch_size)
    hyps = [tok.decode(ids[:budget]).strip() for ids, budget in zip(answers, budgets)]
    return scored(hyps, references, time.perf_counter() - t0)


def check_pairs(sources: list[str], references: list[str]) -> None:
    if len(sources) != len(references):
        raise EvaluateError(f"{len(sources)} source lines but {len(references)} reference lines: they must pair up")
    if not sources:
        raise EvaluateError("no source sentences to translate")


def scored(hyps: list[str], references: list[str], seconds: float) -> dict:
    """BLEU of `hyps` against `references`, the length ratio (sacrebleu's hypothesis / reference length
    after its tokenization, and the brevity penalty BP it costs), timing and the translations."""
    bleu, signature = corpus_bleu(hyps, references)
    return {
        "bleu": bleu.score,
        "bleu_text": str(bleu),
        "signature": str(signature),
        "sentences": len(hyps),
        "ratio": bleu.ratio,
        "bp": bleu.bp,
        "hyp_len": bleu.sys_len,
        "ref_len": bleu.ref_len,
        "seconds": seconds,
        "sentences_per_s": len(hyps) / seconds,
        "hypotheses": hyps,
    }


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
    """Translate `sources` and score them against `references` (see `scored`)."""
    check_pairs(sources, references)
    t0 = time.perf_counter()
    hyps = translate(
        model,
        tok,
        sources,
        bos,
        eos,
        beam_size=beam_size,
        alpha=alpha,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
    )
    return scored(hyps, references, time.perf_counter() - t0)

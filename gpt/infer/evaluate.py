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
    seconds = time.perf_counter() - t0
    bleu, signature = corpus_bleu(hyps, references)
    return {
        "bleu": bleu.score,
        "bleu_text": str(bleu),
        "signature": str(signature),
        "sentences": len(sources),
        "ratio": bleu.ratio,
        "bp": bleu.bp,
        "hyp_len": bleu.sys_len,
        "ref_len": bleu.ref_len,
        "seconds": seconds,
        "sentences_per_s": len(sources) / seconds,
        "hypotheses": hyps,
    }

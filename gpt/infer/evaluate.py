"""BLEU and ROUGE of a seq2seq checkpoint on a test set, and decoding speed.

    gpt evaluate --ckpt out/multi30k \
        --source-file ../shared/data/multi30k/test_2016_flickr.de \
        --reference ../shared/data/multi30k/test_2016_flickr.en --beam-size 4

Prints one line: BLEU, ROUGE-1/2/L, sentences, seconds, sentences/s (decoding only, model loading
excluded), and sacrebleu's signature; `--output F` also writes the translations, one per source line,
`--json F` the numbers. `--metric bleu` or `--metric rouge` computes only one of them.
Mistakes print one `error: ...` line and exit 2.

Metrics
- BLEU: sacrebleu's corpus BLEU, its defaults (13a tokenization), signature printed.
- ROUGE-1, ROUGE-2, ROUGE-L: Google's `rouge-score` package (what Hugging Face `evaluate` runs), each
  pair scored by `RougeScorer(["rouge1", "rouge2", "rougeL"]).score(reference, hypothesis)` with the
  package's defaults (no stemming; its tokenizer lowercases and keeps words of a-z and 0-9 only, so
  it suits English targets: other scripts lose their non-ASCII letters), and the F-measures averaged
  over the sentences, x 100. No bootstrap: the numbers are deterministic.

The checkpoint must describe a seq2seq model: `meta["model_config"]` with `n_encoder_layer > 0`,
`meta["tokenizer"]` (the dataset's spec) and `meta["seq2seq"] = {"bos": .., "eos": .., "pad": ..}`,
which a trainer copies from the pairs dataset (`PairDataset.seq2seq_meta()`).
Needs sacrebleu and rouge-score: `pip install -e ".[seq2seq]"`.
"""

from __future__ import annotations

import time

from gpt.errors import UserError
from gpt.infer.translate import DEFAULT_LENGTH_PENALTY, translate


class EvaluateError(UserError, ValueError):
    """A checkpoint or input files that cannot be evaluated."""


METRICS = ("bleu", "rouge")
ROUGE_TYPES = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}


def parse_metrics(text: str | None) -> tuple[str, ...]:
    """`--metric bleu,rouge` -> ("bleu", "rouge"); None (not given) is every metric."""
    if text is None:
        return METRICS
    names = [m.strip().lower() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise EvaluateError(
            f"--metric {text!r}: expected a comma-separated list of {', '.join(METRICS)} (e.g. --metric bleu,rouge)"
        )
    return tuple(m for m in METRICS if m in names)


def corpus_rouge(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """The mean F-measure x 100 of ROUGE-1, ROUGE-2 and ROUGE-L over the pairs (rouge-score's defaults)."""
    check_metrics_installed(("rouge",))
    from rouge_score import rouge_scorer  # lazily: an optional package (the seq2seq extra)

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES))
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for hyp, ref in zip(hypotheses, references):
        scores = scorer.score(ref, hyp)  # (target, prediction)
        for name in ROUGE_TYPES:
            totals[name] += scores[name].fmeasure
    return {name: 100 * total / len(hypotheses) for name, total in totals.items()}


def corpus_bleu(hypotheses: list[str], references: list[str]):
    check_metrics_installed(("bleu",))
    import sacrebleu  # lazily: an optional package (the seq2seq extra)

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
    metrics: tuple[str, ...] = METRICS,
) -> dict:
    """`evaluate` for a chat checkpoint: each source becomes the user's message (`instruction` with
    `{source}` replaced), the greedy answer is the translation."""
    from gpt.infer.chat import answer_ids, end_tokens, fit  # lazy: chat only

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
    return scored(hyps, references, time.perf_counter() - t0, metrics)


def check_pairs(sources: list[str], references: list[str]) -> None:
    if len(sources) != len(references):
        raise EvaluateError(f"{len(sources)} source lines but {len(references)} reference lines: they must pair up")
    if not sources:
        raise EvaluateError("no source sentences to translate")


def check_metrics_installed(metrics: tuple[str, ...]) -> None:
    """Each metric's package is importable: checked before any decoding, so a missing one costs no time."""
    import importlib.util  # lazy: one check

    for metric, module, package in (("bleu", "sacrebleu", "sacrebleu"), ("rouge", "rouge_score", "rouge-score")):
        if metric in metrics and importlib.util.find_spec(module) is None:
            other = " or ".join(f"--metric {m}" for m in METRICS if m != metric)
            raise EvaluateError(
                f'{metric.upper()} needs {package}: pip install -e ".[seq2seq]" (or pip install {package}), '
                f"or pass {other}"
            )


def scored(hyps: list[str], references: list[str], seconds: float, metrics: tuple[str, ...] = METRICS) -> dict:
    """The `metrics` of `hyps` against `references`: for BLEU its length ratio too (sacrebleu's hypothesis /
    reference length after its tokenization, and the brevity penalty BP it costs); for ROUGE `rouge1`,
    `rouge2`, `rougeL`; timing and the translations."""
    result = {"metrics": list(metrics)}
    if "bleu" in metrics:
        bleu, signature = corpus_bleu(hyps, references)
        result.update(
            bleu=bleu.score,
            bleu_text=str(bleu),
            signature=str(signature),
            ratio=bleu.ratio,
            bp=bleu.bp,
            hyp_len=bleu.sys_len,
            ref_len=bleu.ref_len,
        )
    if "rouge" in metrics:
        from importlib.metadata import version  # (only here: the package's version for the signature)

        result.update(corpus_rouge(hyps, references))
        result["rouge_signature"] = f"rouge-score {version('rouge-score')}|F-measure mean x 100|no stemming"
    return {
        **result,
        "sentences": len(hyps),
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
    metrics: tuple[str, ...] = METRICS,
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
    return scored(hyps, references, time.perf_counter() - t0, metrics)

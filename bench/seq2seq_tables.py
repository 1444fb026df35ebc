"""The markdown tables of bench/bench_seq2seq.py, rendered from its JSON results (pure: no torch).

seq2seq.md      render(result)        BLEU / ratio / ROUGE against training time, and --ckpt rows
seq2seq-val.md  render_sweep(result)  --sweep: the length penalty chosen on val, then its test figure
"""

from __future__ import annotations


def rouge(d: dict) -> str:
    """ROUGE-1 / ROUGE-2 / ROUGE-L of one decoding, "-" where it was not measured (rows older than it)."""
    return " / ".join(f"{d[k]:.2f}" for k in ("rouge1", "rouge2", "rougeL")) if "rougeL" in d else "-"


def _scores(r: dict) -> str:
    """BLEU and ratio greedy, BLEU and ratio beam, ROUGE greedy, ROUGE beam, sent/s greedy, beam ("-": not measured)."""
    g, b = r["greedy"], r["beam"]
    ratio = [f"{d['ratio']:.3f}" if d.get("ratio") is not None else "-" for d in (g, b)]
    return (
        f"{g['bleu']:.2f} | {ratio[0]} | {b['bleu']:.2f} | {ratio[1]} | {rouge(g)} | {rouge(b)} | "
        f"{g['sentences_per_s']:.1f} | {b['sentences_per_s']:.1f}"
    )


SCORE_COLUMNS = 8  # in _scores


def _score_header(beam_size: int) -> str:
    return (
        f"BLEU greedy | ratio greedy | BLEU beam {beam_size} | ratio beam {beam_size} | ROUGE-1/2/L greedy | "
        f"ROUGE-1/2/L beam {beam_size} | greedy sent/s | beam {beam_size} sent/s"
    )


def markdown(rows: list[dict], beam_size: int) -> str:
    lines = [
        f"| minutes | trained (min) | step | val loss | {_score_header(beam_size)} |",
        "|---" * (4 + SCORE_COLUMNS) + "|",
    ]
    for r in rows:
        if r.get("step") is None:
            lines.append(f"| {r['minutes']:g} | - | no checkpoint yet |" + " |" * (SCORE_COLUMNS + 1))
            continue
        val = f"{r['val_loss']:.3f}" if r.get("val_loss") is not None else "-"
        trained = f"{r['train_minutes']:g}" if r.get("train_minutes") is not None else "-"
        lines.append(f"| {r['minutes']:g} | {trained} | {r['step']} | {val} | {_scores(r)} |")
    return "\n".join(lines) + "\n"


def decoding_markdown(entries: list[dict]) -> str:
    """The --ckpt rows: one checkpoint scored by different decoders (label, length penalty, step)."""
    lines = [
        f"| decoding | length penalty | step | val loss | {_score_header(entries[0]['beam_size'])} | note |",
        "|---" * (5 + SCORE_COLUMNS) + "|",
    ]
    for e in entries:
        val = f"{e['val_loss']:.3f}" if e.get("val_loss") is not None else "-"
        lines.append(
            f"| {e['label']} | {e['length_penalty']:g} | {e['step']} | {val} | {_scores(e)} | {e.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def render(result: dict) -> str:
    """seq2seq.md from seq2seq.json: the training table, then the --ckpt rows if there are any."""
    text = ""
    if result.get("rows"):
        text = (
            f"Multi30k de->en ({result['test_set']}, {result['sentences']} sentences"
            + (f", beam length penalty {result['length_penalty']:g}" if "length_penalty" in result else "")
            + f"), `{result['command']}`\n\n"
            + (f"{result['note']}\n\n" if result.get("note") else "")
            + markdown(result["rows"], result["beam_size"])
        )
    for test_set, entries in _by_test(result.get("decoding", [])):
        text += (
            ("\n" if text else "") + f"Decoding compared on one checkpoint ({test_set}), "
            f"`bench/bench_seq2seq.py --ckpt FILE --label LABEL`:\n\n" + decoding_markdown(entries)
        )
    return text


def _by_test(entries: list[dict]) -> list[tuple[str, list[dict]]]:
    groups: dict[str, list[dict]] = {}
    for e in entries:
        groups.setdefault(f"{e['test_set']}, {e['sentences']} sentences, {e['checkpoint']}", []).append(e)
    return list(groups.items())


def _row(name: str, alpha, d: dict) -> str:
    return (
        f"| {name} | {alpha} | {d['bleu']:.2f} | {d['ratio']:.3f} | {d['bp']:.3f} | {d['rouge1']:.2f} | "
        f"{d['rouge2']:.2f} | {d['rougeL']:.2f} | {d['sentences_per_s']:.1f} |"
    )


SWEEP_HEADER = (
    "| decoding | length penalty | BLEU | ratio | BP | ROUGE-1 | ROUGE-2 | ROUGE-L | sent/s |\n" + "|---" * 9 + "|\n"
)


def render_sweep(result: dict) -> str:
    """seq2seq-val.md from seq2seq-val.json: the val sweep, the choice, then the test set at that choice."""
    m, k, test = result["machine"], result["beam_size"], result["test"]
    lines = [
        f"Length penalty (GNMT alpha) of beam search chosen on Multi30k {result['split']} "
        f"({result['sentences']} sentences), never on a test set: `{result['command']}`",
        "",
        f"Checkpoint {result['checkpoint']} (step {result['step']}, val loss {_loss(result['val_loss'])}); "
        f"{m['cpu']} ({m['capability']}, {'native' if m['native_bf16'] else 'no native'} bf16), "
        f"{m['cores']} cores, {m['torch_threads']} torch threads, load {m['load_avg'][0]:g}; decoding float32.",
        "",
        *([result["note"], ""] if result.get("note") else []),
        SWEEP_HEADER + _row("greedy", "-", result["greedy"]),
    ]
    for r in result["sweep"]:
        chosen = r["length_penalty"] == result["chosen"]
        lines.append(_row(f"beam {k}" + (" (chosen)" if chosen else ""), f"{r['length_penalty']:g}", r))
    lines += [
        "",
        f"Chosen: alpha {result['chosen']:g} ({result['rule']}).",
        "",
        f"{test['test_set']} ({test['sentences']} sentences), decoded only after the choice, greedy and at "
        f"alpha {result['chosen']:g}:",
        "",
        SWEEP_HEADER + _row("greedy", "-", test["greedy"]),
        _row(f"beam {k}", f"{result['chosen']:g}", test["beam"]),
    ]
    return "\n".join(lines) + "\n"


def _loss(v) -> str:
    return f"{v:.3f}" if v is not None else "-"

"""Preference tuning measured: DPO on an SFT translation chat model against the SFT model itself, and ORPO
(from the base, no SFT) against SFT + DPO at equal wall time, on Multi30k German to English as chat turns.

    python bench/bench_dpo.py                       # the sizes below, one seed
    python bench/bench_dpo.py --smoke               # tiny sizes: checks it runs

1. base: a 4-layer x 128 char model on both sides of --pairs Multi30k training pairs (--base-steps steps).
2. SFT: `--config sft` on "Translate to English: DE" -> EN chat turns of the same pairs (--sft-steps).
3. preferences: for --prefs other training pairs, chosen = the reference translation, rejected = the SFT
   model's own greedy answer (pairs where they are equal left out).
4. DPO from the SFT checkpoint (--dpo-steps, beta 0.1); ORPO from the base on the same pairs for the wall
   time SFT + DPO took (`--max-minutes`), lambda 0.1.
5. held-out: --eval Multi30k val pairs, greedy answers of each model (the batch engine), corpus BLEU against the
   references (sacrebleu), and DPO's win rate against SFT: the share of prompts whose sentence BLEU is higher
   with DPO, ties counted half.

Results: `dpo.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402

M30K = ROOT.parent / "shared" / "data" / "multi30k"
COMMON = ["--device", "cpu", "--dtype", "float32", "--no-plot", "--threads", "2", "--seed", "0"]


def gpt(*argv, reuse: Path | None = None) -> float:
    """Run `gpt ARGV...` to the end; its wall seconds (a run directory `reuse` that has a log already: the
    seconds it took then, not run again)."""
    if reuse is not None and (reuse / "log.jsonl").is_file():
        rows = [json.loads(line) for line in (reuse / "log.jsonl").read_text().splitlines()]
        done = [r for r in rows if r["kind"] == "summary"]
        if done:
            return done[-1]["elapsed"]
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "gpt", *map(str, argv)], cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"gpt {' '.join(map(str, argv))} failed:\n{run.stderr[-3000:]}")
    return time.perf_counter() - start


def pairs(split: str, start: int, n: int) -> list[tuple[str, str]]:
    de = (M30K / f"{split}.de").read_text(encoding="utf-8").splitlines()[start : start + n]
    en = (M30K / f"{split}.en").read_text(encoding="utf-8").splitlines()[start : start + n]
    return list(zip(de, en))


def ask(de: str) -> list[dict]:
    return [{"role": "user", "content": f"Translate to English: {de}"}]


def answers(run: Path, prompts: list[list[dict]], max_new: int = 60) -> list[str]:
    """Greedy answers of the chat checkpoint in `run`, decoded together by the batch engine."""
    import torch

    from gpt import load_checkpoint
    from gpt.errors import UserError
    from gpt.infer.batching import BatchEngine, Request
    from gpt.infer.chat import chat_prompt, chat_template
    from gpt.infer.sampling import SampleConfig

    torch.set_num_threads(2)
    model, tok, meta = load_checkpoint(run)
    template, engine = chat_template(meta), BatchEngine(model, tok, 64)
    out = [""] * len(prompts)
    for i, messages in enumerate(prompts):
        cfg = SampleConfig(max_new_tokens=max_new, temperature=0, top_k=None)
        try:
            p = chat_prompt(template, tok, messages, cfg, model.config.block_size)
        except UserError:  # a source too long for the context, or a character the vocabulary lacks: no answer
            continue

        def emit(piece, i=i):
            if not isinstance(piece, Exception):
                out[i] += piece.text

        engine.submit(Request(p.ids, p.config, emit))
        if i % 64 == 63:
            while engine.busy:
                engine.step()
    while engine.busy:
        engine.step()
    return [a.strip() for a in out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--prefs", type=int, default=1500)
    p.add_argument("--eval", type=int, default=300)
    p.add_argument("--base-steps", type=int, default=1500)
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--dpo-steps", type=int, default=150)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_dpo"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if args.smoke:
        args.pairs, args.prefs, args.eval, args.base_steps, args.sft_steps, args.dpo_steps = 300, 60, 20, 150, 60, 5
    import sacrebleu

    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    train = pairs("train", 0, args.pairs)
    (w / "text.txt").write_text("\n".join(f"Translate to English: {d} {e}" for d, e in train), encoding="utf-8")
    rows = [{"messages": [*ask(d), {"role": "assistant", "content": e}]} for d, e in train]
    (w / "chat.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    model = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128"]
    times = {}
    times["prepare"] = gpt("prepare", w / "text.txt", "--out", w / "base-data", "--tokenizer", "char", "--force")
    times["base"] = gpt("train", "--data", w / "base-data", "--out-dir", w / "base", "--force", *model, *COMMON,
                        "--block-size", "192", "--batch-size", "16", "--max-iters", args.base_steps,
                        "--learning-rate", "2e-3", "--eval-interval", args.base_steps, reuse=w / "base")  # fmt: skip
    gpt("prepare", "--chat", w / "chat.jsonl", "--out", w / "chat-data", "--tokenizer-from", w / "base",
        "--block-size", "192", "--force")  # fmt: skip
    times["sft"] = gpt("train", "--config", "sft", "--init-from", w / "base", "--data", w / "chat-data",
                       "--out-dir", w / "sft", "--force", *COMMON, "--max-iters", args.sft_steps,
                       "--eval-interval", args.sft_steps, reuse=w / "sft")  # fmt: skip
    others = pairs("train", args.pairs, args.prefs)
    rejected = answers(w / "sft", [ask(d) for d, _ in others])
    prefs = [
        {"prompt": ask(d), "chosen": [{"role": "assistant", "content": e}], "rejected": [{"role": "assistant", "content": r}]}
        for (d, e), r in zip(others, rejected)
        if r and r != e
    ]  # fmt: skip
    (w / "prefs.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in prefs), encoding="utf-8")
    gpt("prepare", "--preferences", w / "prefs.jsonl", "--out", w / "pref-data", "--tokenizer-from", w / "sft",
        "--block-size", "192", "--force", "--skip-bad-rows")  # fmt: skip
    times["dpo"] = gpt("train", "--objective", "dpo", "--init-from", w / "sft", "--data", w / "pref-data",
                       "--out-dir", w / "dpo", "--force", *COMMON, "--beta", "0.1", "--learning-rate", "1e-4",
                       "--min-lr", "1e-5", "--warmup-iters", "10", "--batch-size", "8", "--max-iters", args.dpo_steps,
                       "--eval-interval", args.dpo_steps)  # fmt: skip
    minutes = (times["sft"] + times["dpo"]) / 60
    times["orpo"] = gpt("train", "--objective", "orpo", "--init-from", w / "base", "--data", w / "pref-data",
                        "--out-dir", w / "orpo", "--force", *COMMON, "--orpo-lambda", "0.1", "--learning-rate", "3e-4",
                        "--min-lr", "3e-5", "--warmup-iters", "10", "--batch-size", "8", "--max-iters", "100000",
                        "--eval-interval", "100", "--max-minutes", f"{minutes:.3f}")  # fmt: skip
    held = pairs("val", 0, args.eval)
    refs = [e for _, e in held]
    out = {"machine": harness.machine(), "commit": harness.commit(), "date": time.strftime("%Y-%m-%d")}
    out["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out["settings"]["preference_pairs"] = len(prefs)
    out["wall_s"] = times
    scores, sentence = {}, {}
    for name in ("sft", "dpo", "orpo"):
        hyps = answers(w / name, [ask(d) for d, _ in held])
        scores[name] = sacrebleu.corpus_bleu(hyps, [refs]).score
        sentence[name] = [sacrebleu.sentence_bleu(h, [r]).score for h, r in zip(hyps, refs)]
        out.setdefault("samples", {})[name] = hyps[:5]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(sentence["dpo"], sentence["sft"]))
    orpo_wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(sentence["orpo"], sentence["dpo"]))
    out["bleu"] = scores
    out["dpo_win_rate_vs_sft"] = wins / len(refs)
    out["orpo_win_rate_vs_sft_dpo"] = orpo_wins / len(refs)
    args.results.mkdir(parents=True, exist_ok=True)
    name = "dpo-smoke.json" if args.smoke else "dpo.json"
    (args.results / name).write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({"bleu": scores, "dpo_win_rate_vs_sft": out["dpo_win_rate_vs_sft"], "wall_s": times}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative decoding against plain decoding, greedy, one sequence, eager, on the CPU: tokens/s and how many
guesses were kept (gpt/infer/speculative.py).

    python bench/bench_speculative.py                 # 5 rounds
    python bench/bench_speculative.py --rounds 1 --tokens 64 --steps 20    # a smoke run

Cases (each plain and speculative in turn, interleaved, --rounds times; medians and spread):
1. `char copy`: a char model trained here on tiny-shakespeare (4 layers x 128, --steps steps), a prompt that
   is a val passage followed by its first line again, so the continuation copies the passage (where prompt
   lookup shines: summaries, translations and edits copy their input the same way); prompt lookup, K 8.
2. `char free`: the same model on a plain prompt (no passage to copy); prompt lookup, K 8.
3. `char draft`: the same model with a 1-layer x 64 draft trained alongside it; K 4.
4. `gpt2-124m loop`: GPT-2 124M's shape with random weights, whose greedy text falls into loops that prompt
   lookup predicts: the cost of checking K guesses in one pass at that width, with the acceptance stated.
Greedy texts are checked equal to plain decoding's in every round (the run stops if not).

Results: `speculative.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def train_char(work: Path, name: str, layers: int, embd: int, steps: int) -> Path:
    import subprocess

    data = work / "char"
    if not (data / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "gpt", "prepare", str(SHAKESPEARE), "--out", str(data), "--tokenizer",
                        "char", "--quiet"], cwd=ROOT, check=True)  # fmt: skip
    out = work / name
    if not (out / "best.pt").is_file():
        cmd = [sys.executable, "-m", "gpt", "train", "--data", str(data), "--out-dir", str(out), "--force"]
        cmd += ["--n-layer", str(layers), "--n-head", "4" if embd >= 128 else "2", "--n-embd", str(embd)]
        cmd += ["--block-size", "256", "--batch-size", "16", "--max-iters", str(steps), "--eval-interval", str(steps)]
        cmd += ["--learning-rate", "2e-3", "--device", "cpu", "--dtype", "float32", "--no-plot"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return out


def timed(pieces) -> tuple[float, list[int]]:
    """Seconds to draw every piece of `pieces` (a generator), and the ids they carry."""
    start = time.perf_counter()
    ids = [i for piece in pieces for i in piece.ids]
    return time.perf_counter() - start, ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=200, help="tokens generated per case and round")
    p.add_argument("--steps", type=int, default=600, help="training steps of the char models")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_speculative"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    import torch

    from gpt import GPT, GPTConfig, load_checkpoint
    from gpt.infer import speculative
    from gpt.infer.sampling import SampleConfig, generate

    args.work.mkdir(parents=True, exist_ok=True)
    target, tok, _ = load_checkpoint(train_char(args.work, "target", 4, 128, args.steps))
    draft = load_checkpoint(train_char(args.work, "draft", 1, 64, args.steps))[0]
    torch.set_num_threads(args.threads)
    val = SHAKESPEARE.read_text(encoding="utf-8")[-3000:]
    passage = val[val.index("\n\n") + 2 :][:180]
    copy_prompt = passage + "\n\n" + passage.split("\n")[0] + "\n"
    torch.manual_seed(0)
    big = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
    cases = {
        "char copy": (target, copy_prompt, lambda: speculative.PromptLookup(k=8)),
        "char free": (target, "ROMEO:\n", lambda: speculative.PromptLookup(k=8)),
        "char draft": (target, "ROMEO:\n", lambda: speculative.DraftModel(draft, k=4)),
        "gpt2-124m loop": (big, "ROMEO:\n", lambda: speculative.PromptLookup(k=8)),
    }
    cfg = SampleConfig(max_new_tokens=args.tokens, temperature=0, top_k=None, stop_at_eot=False)
    results = {}
    for name, (model, prompt, drafter) in cases.items():
        plain_s, spec_s, kept = [], [], []
        for _ in range(args.rounds):
            t, ref = timed(generate(model, tok, prompt, cfg))
            stats = speculative.Stats()
            s, out = timed(speculative.generate(model, tok, prompt, cfg, drafter(), stats=stats))
            if out != ref:
                raise SystemExit(f"{name}: speculative greedy text differs from plain decoding's")
            plain_s.append(args.tokens / t)
            spec_s.append(args.tokens / s)
            kept.append(stats.acceptance)
        results[name] = {
            "plain_tokens_per_s": harness.spread(plain_s),
            "speculative_tokens_per_s": harness.spread(spec_s),
            "speedup": harness.spread([b / a for a, b in zip(plain_s, spec_s)]),
            "acceptance": harness.spread(kept),
        }
        print(f"{name:16s} plain {results[name]['plain_tokens_per_s']['median']:7.1f} tok/s, speculative "
              f"{results[name]['speculative_tokens_per_s']['median']:7.1f} ({results[name]['speedup']['median']:.2f}x), "
              f"{results[name]['acceptance']['median']:.0%} of guesses kept")  # fmt: skip
    out = {"machine": harness.machine(), "commit": harness.commit(), "date": time.strftime("%Y-%m-%d")}
    out["settings"] = {"rounds": args.rounds, "tokens": args.tokens, "steps": args.steps, "threads": args.threads}
    out["results"] = results
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "speculative.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.results / 'speculative.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

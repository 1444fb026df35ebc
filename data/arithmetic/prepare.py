"""Two-digit additions for the GRPO worked example (docs/grpo.md): a char corpus to pretrain on and prompt rows
to reinforce on, from disjoint problems.

    python data/arithmetic/prepare.py --out data/arithmetic          # corpus.jsonl, prompts.jsonl
    gpt prepare data/arithmetic/corpus.jsonl --out data/arithmetic/chars --tokenizer char --block-size 16
    gpt train --data data/arithmetic/chars --out-dir out/add ...                      # the SFT model
    gpt train --objective grpo --init-from out/add --data data/arithmetic/prompts.jsonl --reward exact ...

Every problem a + b with a, b in 0..99 (10,000 of them) is shuffled with --seed; the first --corpus of them
become corpus.jsonl rows {"text": "12+7=19"} (each a document: `gpt prepare` ends it with the end-of-text
token, so the model learns to stop after the sum), the rest prompts.jsonl rows {"prompt": "12+7=", "answer":
"19"}. GRPO holds out every 20th prompt row (gpt/train/prompts.py): problems neither phase trains on.

--period P ends a share P of the corpus's sums with a full stop ("12+7=19."): a model trained on it ends
about that share of its answers so, which the `exact` reward (the answer alone) scores 0; GRPO's reward
teaches it to stop after the sum. --wrong P writes a share P of the corpus's sums wrong, off by 1 to 10 either way (never below 0): a model
trained on it learns the arithmetic and the noise, and samples a wrong sum about that often; the prompts'
answers are always right, so GRPO's exact reward can teach it to stop making the noise's mistakes.
"""

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def problems(seed: int) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    return pairs


def write(out: Path, corpus: int, seed: int, wrong: float = 0.0, period: float = 0.0) -> tuple[Path, Path]:
    """corpus.jsonl (the first `corpus` problems, solved, a share `wrong` of them wrongly, a share `period`
    ending with a full stop) and prompts.jsonl (the rest) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    pairs = problems(seed)
    rng = random.Random(seed + 1)
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for a, b in pairs[:corpus]:
            total = a + b
            if rng.random() < wrong:
                total = max(0, total + rng.choice([-1, 1]) * rng.randint(1, 10))
                total = total if total != a + b else a + b + 1
            end = "." if rng.random() < period else ""
            f.write(json.dumps({"text": f"{a}+{b}={total}{end}"}) + "\n")
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for a, b in pairs[corpus:]:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return out / "corpus.jsonl", out / "prompts.jsonl"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE, help="where to write (default: this script's directory)")
    p.add_argument("--corpus", type=int, default=7000, help="problems in the corpus; the rest are prompts")
    p.add_argument("--seed", type=int, default=0, help="the shuffle of the 10,000 problems")
    p.add_argument("--wrong", type=float, default=0.0, help="the share of the corpus's sums written wrong")
    p.add_argument("--period", type=float, default=0.0, help="the share of the corpus's sums ending with '.'")
    args = p.parse_args(argv)
    if not 0 < args.corpus < 10_000:
        print(f"error: --corpus must be in 1..9999, got {args.corpus}", file=sys.stderr)
        return 2
    for name in ("wrong", "period"):
        if not 0 <= getattr(args, name) < 1:
            print(f"error: --{name} must be in [0, 1), got {getattr(args, name)}", file=sys.stderr)
            return 2
    corpus, prompts = write(args.out, args.corpus, args.seed, args.wrong, args.period)
    print(f"wrote {corpus} ({args.corpus:,} solved problems) and {prompts} ({10_000 - args.corpus:,} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

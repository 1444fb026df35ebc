"""Write the `gpt_shakespeare_next_line` items: `python -m gpt.evals.make_next_line ../shared/data/tinyshakespeare.txt`.

Each item is two consecutive non-empty lines of context (each ending in a newline) and four candidates for the
line that follows, one the true line, three other distinct lines drawn from elsewhere in the same part of the text; `label` is
the index of the true one. Lines come from the last tenth of the file. The same corpus, `--items` and `--seed`
give the same file (Python's `random.Random(seed)`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from gpt.evals import TASKS_DIR

OUT = TASKS_DIR / "shakespeare_next_line.jsonl"


def make_items(text: str, items: int = 300, seed: int = 1234) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    lines = lines[len(lines) * 9 // 10 :]
    rng = random.Random(seed)
    starts = rng.sample(range(len(lines) - 2), items)
    out = []
    for s in starts:
        gold = lines[s + 2]
        others: list[str] = []
        while len(others) < 3:  # three distinct lines, none the true one or the context
            line = rng.choice(lines)
            if line != gold and line not in others and line not in lines[s : s + 2]:
                others.append(line)
        choices = [*others, gold]
        rng.shuffle(choices)
        out.append({"context": lines[s] + "\n" + lines[s + 1] + "\n", "choices": choices, "label": choices.index(gold)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt.evals.make_next_line", description=__doc__.splitlines()[0])
    p.add_argument("corpus", help="tinyshakespeare.txt")
    p.add_argument("--items", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    rows = make_items(Path(args.corpus).read_text(encoding="utf-8"), args.items, args.seed)
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} items -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

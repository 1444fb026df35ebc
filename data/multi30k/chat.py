"""Multi30k as an instruction dataset: each German-English pair as one chat row, ready for
`data/prepare.py --chat` (the demonstration in docs/chat.md and bench/bench_sft.py).

    python data/multi30k/chat.py                     # data/multi30k/chat/{train,val}.jsonl
    python data/prepare.py --chat data/multi30k/chat/train.jsonl --val-chat data/multi30k/chat/val.jsonl \\
        --out data/multi30k/chat-ds --tokenizer-from BASE_RUN_OR_DATASET --block-size 128

Each row is {"messages": [{"role": "user", "content": "Translate to English: DE"},
{"role": "assistant", "content": "EN"}]}; --instruction changes the user's words ({source} is the
German sentence). Reads {train,val}.{de,en} from --input (default: ../shared/data/multi30k beside the
checkout). Written atomically; an existing file is replaced only with --force.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from gpt.cli import ArgumentParser, run_main  # noqa: E402
from gpt.data.format import DataError  # noqa: E402
from gpt.data.pairs import read_lines  # noqa: E402
from gpt.fsutil import replacing  # noqa: E402

INSTRUCTION = "Translate to English: {source}"


def write_chat(src: Path, tgt: Path, out: Path, instruction: str = INSTRUCTION, force: bool = False) -> int:
    """Rows of `src` -> `tgt` pairs as chat JSONL in `out`; the number of rows."""
    if "{source}" not in instruction:
        raise DataError(f"--instruction must contain {{source}}, got {instruction!r}")
    if out.exists() and not force:
        raise DataError(f"{out} exists: pass --force to replace it")
    sources, targets = read_lines(src), read_lines(tgt)
    if len(sources) != len(targets):
        raise DataError(f"{src} has {len(sources)} lines but {tgt} {len(targets)}: they must pair up")
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for s, t in zip(sources, targets):
            user = instruction.replace("{source}", s)
            row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": t}]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(sources)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", default=str(ROOT.parent / "shared" / "data" / "multi30k"), help="the raw files")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "chat"), help="output directory")
    p.add_argument("--instruction", default=INSTRUCTION, help="the user's message; {source} is the German sentence")
    p.add_argument("--force", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    data, out = Path(args.input), Path(args.out)

    def run() -> str:
        counts = {
            split: write_chat(
                data / f"{split}.de", data / f"{split}.en", out / f"{split}.jsonl", args.instruction, args.force
            )
            for split in ("train", "val")
        }
        return f"wrote {out}/train.jsonl ({counts['train']:,} conversations) and {out}/val.jsonl ({counts['val']:,})"

    return run_main(run)


if __name__ == "__main__":
    raise SystemExit(main())

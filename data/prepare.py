"""Prepare a token dataset from any text, translation pairs or chat conversations: the same as `gpt prepare`
(gpt/cli/prepare.py, where the options and their policies are).

    python data/prepare.py corpus/ notes.txt --out data/mine --tokenizer gpt2
    python data/prepare.py --pairs train.de train.en --val-pairs val.de val.en --out data/de-en --tokenizer bpe
    python data/prepare.py --chat chats.jsonl --out data/chat --tokenizer-from out/base --block-size 256

`python data/prepare.py --help` lists every option. Never imports torch.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gpt.cli.prepare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python data/prepare.py"))

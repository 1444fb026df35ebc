"""`python -m gpt <verb> ...`: the same command as `gpt <verb> ...` (gpt/cli/main.py)."""

import sys

from gpt.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

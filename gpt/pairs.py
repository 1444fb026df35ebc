"""`python -m gpt.pairs`: the command lives in gpt/cli/pairs.py."""

from gpt.cli.pairs import main

if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m gpt.plot`: the command lives in gpt/cli/plot.py."""

from gpt.cli.plot import main

if __name__ == "__main__":
    raise SystemExit(main())

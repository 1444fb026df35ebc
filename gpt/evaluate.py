"""`python -m gpt.evaluate`: the command lives in gpt/cli/evaluate.py."""

from gpt.cli.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m gpt.attention`: the command lives in gpt/cli/attention.py."""

from gpt.cli.attention import main

if __name__ == "__main__":
    raise SystemExit(main())

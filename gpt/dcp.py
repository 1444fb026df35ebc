"""`python -m gpt.dcp`: the command lives in gpt/cli/dcp.py."""

from gpt.cli.dcp import main

if __name__ == "__main__":
    raise SystemExit(main())

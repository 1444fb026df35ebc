"""`python -m gpt.export`: the command lives in gpt/cli/export.py."""

from gpt.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())

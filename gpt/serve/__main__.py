"""`python -m gpt.serve`: the command lives in gpt/cli/serve.py."""

from gpt.cli.serve import main

if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m gpt.hf`: the command lives in gpt/cli/hf.py."""

from gpt.cli.hf import main

if __name__ == "__main__":
    raise SystemExit(main())

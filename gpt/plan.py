"""`python -m gpt.plan`: the command lives in gpt/cli/plan.py."""

from gpt.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())

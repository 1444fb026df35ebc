"""`python -m gpt.lora`: the command lives in gpt/cli/lora.py."""

from gpt.cli.lora import main

if __name__ == "__main__":
    raise SystemExit(main())

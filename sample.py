"""Sample text from a trained checkpoint or a Hugging Face GPT-2 directory, streamed as it comes;
or translate with a seq2seq (encoder-decoder) checkpoint; or chat. The same as `gpt sample` (gpt/cli/sample.py).

    python sample.py --ckpt out/shakespeare-char --prompt "ROMEO:" --num-samples 3 --max-new-tokens 300
    python sample.py --ckpt path/to/hf-gpt2-dir --prompt-file prompt.txt --temperature 0 --stop "\\n\\n"
    python sample.py --ckpt out/multi30k --source "Ein Mann fährt Fahrrad." --beam-size 4

`python sample.py --help` lists every flag.
"""

import sys

from gpt.cli.sample import SEPARATOR, main  # noqa: F401 (the command lives in the package)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python sample.py"))

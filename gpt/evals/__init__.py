"""lm-evaluation-harness task files over local data (no download): `TASKS_DIR` is lm-eval's `--include_path`.

    lm_eval --model local-completions --include_path gpt/evals/tasks --tasks gpt_shakespeare_next_line,gpt_wikitext2 \
        --metadata '{"text_file": "../shared/data/wikitext2-test.txt"}' --model_args base_url=...

- `gpt_wikitext2` (`loglikelihood_rolling`): one text file as one document, scored in rolling windows: word and
  byte perplexity and bits per byte. The file is `text_file` in `--metadata` (any UTF-8 text), else
  `$GPT_SHARED_DATA/wikitext2-test.txt`; it is never shipped here.
- `gpt_shakespeare_next_line` (`multiple_choice`, acc and acc_norm): 300 items of tiny-shakespeare, two lines of
  context and the true next line among 4 (the 3 others drawn from elsewhere in the text), from the last tenth of
  the file (the char datasets' validation part). `shakespeare_next_line.jsonl` is committed;
  `make_next_line.py` (`python -m gpt.evals.make_next_line CORPUS`) writes it again, the same for the same
  corpus (seed 1234).
- `gpt_wikitext2_next_sentence` (`multiple_choice`, acc and acc_norm): a passage of WikiText-2 (about 2500
  characters of whole sentences), then which of 4 sentences comes next (the 3 others drawn from elsewhere, seed
  1234); one item per passage, in file order. Every choice repeats the long passage: the server's prefix cache
  saves its prefill (bench/bench_prefix_cache.py measures it). It reads `text_file` in `--metadata`, else
  `$GPT_SHARED_DATA/wikitext2-valid.txt` (never shipped here); not one of `TASKS` (the tests' pair).

The tasks' data loaders (`tasks/loaders.py`) are plain files that lm-eval imports by path (`!function`); they
import `datasets` only, never this package.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASKS = ("gpt_wikitext2", "gpt_shakespeare_next_line")
LOCAL_TASKS = (*TASKS, "gpt_wikitext2_next_sentence")  # every task in TASKS_DIR

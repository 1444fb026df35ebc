"""The prompts GRPO samples from (--objective grpo, gpt/train/grpo.py): a `.jsonl` file read at the start of the
run, each row a prompt and what its reward needs, encoded with the policy's own tokenizer.

    gpt train --objective grpo --init-from out/sft --data problems.jsonl --reward exact
    task = PromptTask(cfg.data, plan)             # the tokenizer (and chat template) of the checkpoint
    task.start(cfg, rt, accum)                    # rows read, checked and encoded; every 20th held out
    batch = task.train_batch(step, micro_step)    # `Prompts`: --batch-size rows of this process

A row is `{"prompt": P, ...}`, P a text or a list of OpenAI messages, beside the fields its reward reads
(`answer` for exact, `reference` for bleu, `schema` for json: gpt/train/rewards.py); a `.jsonl.gz`, `.parquet`
or `.json` list is read the same way (gpt/data/sft.py's `file_rows`). With a chat checkpoint (its meta holds a
chat template) the prompt is rendered as `gpt chat` renders a conversation waiting for the assistant (a text is
one user message), and a completion ends at the end-of-turn token; otherwise the prompt is the end-of-text
token (where `gpt prepare` starts every document of a stream) then its text, and a completion ends at the
end-of-text token.

Why no prepare step: the rows carry whatever their reward reads (answers, references, schemas)
as JSON, which a token dataset would have to keep beside its ids anyway, and the tokenizer is the policy
checkpoint's by construction, so no prepared dataset can disagree with the policy. Rows are read one at a
time (memory per row bounded by --max-row-bytes' default); the encoded prompts are kept in memory.

Policies
- A bad row (not an object, no or an empty prompt, a missing reward field, a character a char vocabulary
  lacks, a prompt whose tokens plus --grpo-max-new-tokens exceed the block size) is one error naming file
  and row; `--skip-bad-rows` skips it, and the run's log counts them.
- Every 20th good row is held out for evaluation (the greedy completions' mean reward); a file of fewer than
  20 rows is evaluated on its train rows.
- Batches are pure functions of (seed, step // --grpo-updates, place in the global batch): a resumed run
  draws the same prompts, and N processes those of one accumulating N times more.

Footguns: the prompts are kept in memory, encoded (a few million short prompts fit; a corpus does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpt.checkpoints import loader
from gpt.data.chat import ChatError, ChatTemplate, check_conversation, openai_messages
from gpt.data.corpus import BadRowError, CorpusError
from gpt.data.sft import file_rows
from gpt.data.tokenizer import TokenizerError, get_tokenizer
from gpt.errors import ConfigError
from gpt.train.rewards import load_reward
from gpt.train.tasks import Counted

VAL_PERIOD = 20


@dataclass
class Prompts:
    """A batch of prompts: each row's ids and its JSON row; `tokens` is filled in by the loss (what it read)."""

    ids: list[list[int]]
    rows: list[dict]
    step: int = 0  # the step and micro step that drew them (the loss keeps its completions by them)
    micro: int = 0  # (its place in the global batch)
    tokens: int = field(default=0)


class PromptTask:
    """Rows of prompts for --objective grpo, in the trainer's task shape (gpt/train/tasks.py)."""

    kind = "prompts"

    def __init__(self, path: str, plan, log=print):
        located = plan.resume or plan.init
        if located is None:
            raise ConfigError("--objective grpo: needs a model to start from: --init-from CKPT (or --resume RUN)")
        meta = located.meta
        if meta is None:  # a Hugging Face directory: its meta comes with its weights
            meta = loader.load_model(located)[1]
        self.path, self.log = Path(path), log
        self.tokenizer_spec = dict(meta["tokenizer"])
        self.vocab_size = int(meta["model_config"]["vocab_size"])
        spec = meta.get("chat_template")
        self.template = ChatTemplate.from_spec(spec, "the checkpoint's chat_template") if spec else None
        base = get_tokenizer(self.tokenizer_spec)
        self.tokenizer = self.template.tokenizer(base) if self.template else base
        stop = self.tokenizer.special(self.template.end) if self.template else self.tokenizer.eot_token
        self.stops = [stop] if stop is not None else []
        self.checkpoint_meta = {"chat_template": self.template.spec} if self.template else {}
        if self.path.is_dir() or self.path.suffix not in (".jsonl", ".gz", ".json", ".parquet"):
            raise ConfigError(
                f"--data {path}: --objective grpo reads a file of prompt rows (.jsonl, .jsonl.gz, .json, .parquet), "
                f'each {{"prompt": ..., and what --reward reads}}'
            )

    def check_model(self, cfg) -> None:
        if cfg.model.n_encoder_layer:
            raise ConfigError("n_encoder_layer: GRPO trains a decoder-only model (no encoder)")

    def encode(self, row) -> list[int]:
        """The prompt's ids; ChatError naming what is wrong with the row."""
        if not isinstance(row, dict):
            raise ChatError(f"a row is a JSON {type(row).__name__}, not an object")
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            prompt = openai_messages(prompt)
            check_conversation(prompt, for_prompt=True)
            if self.template is None:
                raise ChatError("the prompt is a list of messages, but the checkpoint has no chat template")
        elif not isinstance(prompt, str) or not prompt:
            raise ChatError(f"'prompt' is {type(prompt).__name__ if prompt != '' else 'empty'}, not a text or messages")
        try:
            if self.template is not None:
                messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                return self.template.prompt(messages, self.tokenizer)
            start = [] if self.tokenizer.eot_token is None else [self.tokenizer.eot_token]
            return start + self.tokenizer.encode(prompt)
        except TokenizerError as e:
            raise ChatError(f"the prompt: {e}") from None

    def start(self, cfg, rt, accum: int) -> None:
        """Read, check and encode every row; split off the held-out ones."""
        self.cfg, self.rt, self.accum = cfg, rt, accum
        reward = load_reward(cfg.reward)
        room = cfg.model.block_size - cfg.grpo_max_new_tokens
        splits: dict[str, tuple[list, list]] = {"train": ([], []), "val": ([], [])}
        bad, good = [], 0
        try:
            for row, value, problem in file_rows(self.path):
                try:
                    if problem is not None:
                        raise ChatError(problem)
                    ids = self.encode(value)
                    problem = reward.check(value)
                    if problem:
                        raise ChatError(problem)
                    if len(ids) > room:
                        raise ChatError(
                            f"the prompt's {len(ids)} tokens and --grpo-max-new-tokens {cfg.grpo_max_new_tokens} "
                            f"exceed the block size {cfg.model.block_size}"
                        )
                except ChatError as e:
                    error = BadRowError(self.path, row, str(e))
                    if not cfg.skip_bad_rows:
                        raise ConfigError(str(error)) from None
                    bad.append(error)
                    continue
                good += 1
                ids_rows = splits["val" if good % VAL_PERIOD == 0 else "train"]
                ids_rows[0].append(ids)
                ids_rows[1].append(value)
        except CorpusError as e:
            raise ConfigError(f"--data: {e}") from None
        if not splits["train"][0]:
            raise ConfigError(f"--data {self.path}: no prompt to train on ({len(bad)} bad rows skipped)")
        if not splits["val"][0]:
            splits["val"] = splits["train"]
        self.splits = splits
        if bad:
            self.log(f"skipped {len(bad):,} bad rows; the first: {bad[0]}")
        self.log(
            f"prompts: {len(splits['train'][0]):,} to train on, {len(splits['val'][0]):,} held out, from {self.path}"
            + (" through the chat template" if self.template else "")
        )

    def train_batch(self, step: int, micro_step: int) -> Prompts:
        """--batch-size prompts, drawn without replacement, the same for the --grpo-updates steps of a batch.
        They depend on the micro-batch's place in the global batch (rank x accumulation + micro step), not on
        how it is split: N processes draw what one process accumulating N times as many micro-batches does."""
        ids, rows = self.splits["train"]
        cfg = self.cfg
        micro = self.rt.rank * self.accum + micro_step
        seq = np.random.SeedSequence([cfg.seed, step // cfg.grpo_updates, micro])
        pick = np.random.default_rng(seq).choice(len(ids), cfg.batch_size, replace=len(ids) < cfg.batch_size)
        return Prompts([ids[i] for i in pick], [rows[i] for i in pick], step, micro)

    @staticmethod
    def tokens(batch: Prompts) -> int:
        """Every position the loss's forward read (prompts and completions, padding included)."""
        return batch.tokens

    def describe_batch(self, cfg) -> str:
        return f"{cfg.batch_size * cfg.grad_accum} prompts x {cfg.group_size} completions"

    def _eval_prompts(self, split: str) -> tuple[list, list]:
        ids, rows = self.splits[split]
        n = len(self.splits["val"][0]) if self.cfg.eval_iters == 0 else min(len(ids), self.cfg.eval_iters)
        rank, world = self.rt.rank, self.rt.world_size
        return ids[:n][rank::world], rows[:n][rank::world]

    def eval_tokens(self) -> int:
        n = len(self._eval_prompts("val")[0]) * (2 if self.cfg.eval_train else 1)
        return n * self.cfg.model.block_size

    def eval_batches(self, split: str):
        """The split's first --eval-iters prompts (every held-out one with 0), this process's share, in
        batches of --batch-size."""
        ids, rows = self._eval_prompts(split)
        bs = self.cfg.batch_size
        batches = [Prompts(ids[i : i + bs], rows[i : i + bs]) for i in range(0, len(ids), bs)]
        return Counted(len(batches), batches)

    def val_bits_per_byte(self, val_loss: float) -> None:
        """None: the loss is minus a reward, not one on running text."""
        return None

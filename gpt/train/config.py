"""Training configuration: one typed dataclass, TOML files and `--key value` overrides.

Precedence, stated once: command line > config file (`--config FILE_OR_NAME`) > defaults.
Config files are plain TOML data, never executed. Keys may use dashes or underscores
(`--max-iters 100`, `--max_iters=100`). Every problem (unknown key, wrongly typed value, invalid
value) is collected and reported together in one `ConfigError`.

Reading them is gpt/train/flags.py's (`build_config`, `parse_cli`, `help_text`). Shipped configs live in `gpt/train/configs/` and are usable by short name: `--config shakespeare_char_cpu`.
The model's fields (`n_layer`, `n_embd`, ...) share the flat namespace of the flags and files (a TOML
`[model]` table may group them) and land in `TrainConfig.model`, a `GPTConfig` that checks them itself;
`vocab_size` always comes from the dataset. A config is never changed once built: the trainer makes a
new one with `dataclasses.replace` (e.g. the model of an `--init-from` checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from gpt.errors import ConfigError
from gpt.model.config import LORA_DEFAULT_TARGETS, LORA_TARGETS, POS_ENCODINGS, GPTConfig, LoRAConfig
from gpt.model.grids import GROUP_SIZES, SCHEMES
from gpt.model.windows import parse as parse_windows

CONFIG_DIR = Path(__file__).parent / "configs"


MODEL_HELP = {  # the flags of the model's fields (GPTConfig, gpt/model/config.py), but vocab_size
    "n_layer": "transformer blocks",
    "n_head": "attention heads",
    "n_embd": "embedding width",
    "block_size": "context length in tokens",
    "dropout": "dropout probability",
    "bias": "biases in Linear and LayerNorm layers",
    "n_encoder_layer": "encoder blocks (seq2seq); 0 = decoder-only GPT",
    "pos_encoding": f"position encoding: {' | '.join(POS_ENCODINGS)} (rope = rotary)",
    "norm": "residual norm placement: pre | post",
    "label_smoothing": "label smoothing of the cross-entropy",
    "activation": "MLP activation: gelu_tanh (GPT-2) | gelu (exact erf, faster on CPU) | relu2 (ReLU squared)",
    "qk_norm": "RMSNorm on each head's queries and keys (nanochat's QK norm)",
    "zero_init_proj": "start attention's and the MLP's output projections at zero",
    "logit_softcap": "cap the logits smoothly at +-c: c * tanh(logits / c); 0 = off",
    "untied_head": "an output head of its own instead of the token embedding's matrix",
    "x0_skip": "each block's input mixes in the embedding output: resid_lambdas[i] * x + x0_lambdas[i] * x0, "
    "learned scalars at --scalar-lr / --resid-lr",
    "value_embeds": "token embeddings of their own added, gated per head, to every other layer's attention values",
    "attention_window": "sliding-window attention: each layer's window in tokens, a pattern cycled over the layers "
    "(64 | 128,128,512,full); empty = full attention",
    "global_tokens": "with --attention-window: the first G tokens see and are seen by every token (Longformer)",
    "rope_scaling": "rope context extension: linear (position interpolation) | yarn; with --init-from a rope "
    "checkpoint and a longer --block-size",
    "rope_factor": "how far --rope-scaling stretches the rotary frequencies (at least --block-size over the block "
    "trained at)",
    "rope_original_block": "the block the model was trained at (0 = --init-from's block, else --block-size / "
    "--rope-factor)",
}


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's own settings (gpt/train/trainer.py `make_optimizer`); `TrainConfig.optimizer_config`
    builds it from the flags."""

    name: str = "adamw"  # adamw | muon
    lr: float = 1e-3  # the peak LR (the schedule sets each step's)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1  # matrices only
    cautious_wd: bool = False  # Muon's matrices: decay only where the update and the weight agree in sign


def default_model() -> GPTConfig:
    """The model a run trains unless told otherwise: small enough for a laptop CPU (GPTConfig's own defaults
    are GPT-2 124M's). vocab_size is a placeholder until the dataset's is known."""
    return GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, bias=False)


AUTO = {"batch_size": 0}  # fields that take `auto`, and the number that stands for it


OBJECTIVES = ("lm", "dpo", "orpo", "grpo")
OBJECTIVE_OPTIONS = {  # the options of an objective, and the objectives they do something for
    "reference": ("dpo", "grpo"),
    "beta": ("dpo", "grpo"),
    "dpo_loss": ("dpo",),
    "reference_cache": ("dpo",),
    "orpo_lambda": ("orpo",),
    **dict.fromkeys(
        (
            "reward",
            "group_size",
            "grpo_max_new_tokens",
            "grpo_temperature",
            "grpo_updates",
            "grpo_loss",
            "epsilon",
            "skip_bad_rows",
        ),
        ("grpo",),
    ),
}


def opt(default, help: str):
    return field(default=default, metadata={"help": help})


def flag(name: str) -> str:
    """A field's command-line spelling: max_iters -> --max-iters."""
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    # data and run directories
    data: str = opt("", "prepared dataset directory (from gpt prepare)")
    out_dir: str = opt("out/run", "run directory for checkpoints, config.json and log.jsonl")
    init_from: str = opt("", "fine-tune: start from the weights of a run dir, checkpoint file or HF GPT-2 dir")
    resume: str = opt(
        "",
        "continue a run exactly from its last.pt (a run dir), or from a checkpoint file of it "
        "(RUN/best.pt: back to its best state)",
    )
    force: bool = opt(False, "allow writing into an out_dir that already holds a run")
    # the model: its fields are flags of their own (`--n-layer 6`) and a TOML [model] table; vocab_size
    # always comes from the dataset
    model: GPTConfig = field(default_factory=lambda: default_model(), metadata={"help": "the model's shape"})
    # batch
    batch_size: int = opt(
        12,
        "sequences per micro-batch (per process); auto (CUDA only): the largest that fits, "
        "with --grad-accum set to keep the global batch",
    )
    global_batch: int = opt(
        0, "--batch-size auto: sequences per optimizer step to keep (0 = the batch size auto replaced x --grad-accum)"
    )
    grad_accum: int = opt(
        1, "micro-batches per optimizer step, over all processes (global batch = batch_size * grad_accum)"
    )
    max_tokens: int = opt(0, "seq2seq: tokens per micro-batch, pairs grouped by length (0 = batch_size * block_size)")
    pad_to: int = opt(1, "seq2seq: pad batches' lengths to a multiple of this, so that shapes repeat (1 = off)")
    sampling: str = opt(
        "random",
        "token datasets' training windows: random (with replacement) | epoch (each window once per epoch); pairs "
        "are batched by length and chat conversations packed once per epoch either way",
    )
    loss_on: str = opt(
        "assistant",
        "chat datasets: the loss on the assistant's tokens only, or on every token (all) of the conversations",
    )
    # optimizer and schedule
    max_iters: int = opt(2000, "optimizer steps")
    learning_rate: float = opt(1e-3, "peak learning rate")
    min_lr: float = opt(1e-4, "final learning rate of the cosine / wsd decay")
    lr_schedule: str = opt("cosine", "cosine | constant | wsd (warmup-stable-decay) | noam")
    warmup_iters: int = opt(100, "linear warmup steps")
    lr_decay_iters: int = opt(0, "steps over which the LR decays (0 = max_iters)")
    decay_fraction: float = opt(0.2, "wsd: fraction of lr_decay_iters spent decaying")
    optimizer: str = opt(
        "adamw",
        "adamw | muon (Muon for the blocks' weight matrices, AdamW for embeddings and norms; gpt/train/muon.py)",
    )
    muon_lr: float = opt(
        0.05, "--optimizer muon: peak LR of the blocks' weight matrices (the schedule of --learning-rate, scaled)"
    )
    scalar_lr: float = opt(0.5, "--x0-skip: peak LR of the x0 scalars x0_lambdas (AdamW, no decay; nanochat's)")
    resid_lr: float = opt(0.005, "--x0-skip: peak LR of the residual scalars resid_lambdas (AdamW, no decay)")
    weight_decay: float = opt(0.1, "decoupled weight decay (matrices only)")
    window_schedule: int = opt(
        0,
        "--attention-window: grow the windows linearly from this many tokens at step 0 (the largest layer's; the "
        "others in proportion) to --attention-window's at the last step, in at most 4 sizes (0 = off)",
    )
    wd_schedule: str = opt(
        "constant",
        "weight decay over the run: constant | linear (to 0 at the LR's decay end) | cosine (to 0 likewise)",
    )
    muon_cautious_wd: bool = opt(
        False, "--optimizer muon: cautious weight decay, only where the update and the weight agree in sign"
    )
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.99, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the gradient norm to this (0 = off)")
    # evaluation, logging, stopping
    eval_interval: int = opt(250, "evaluate (and checkpoint) every N steps; also at the end")
    eval_iters: int = opt(20, "batches per evaluation (0 = the whole split)")
    eval_batch_size: int = opt(0, "sequences per eval batch (0 = batch_size)")
    eval_train: bool = opt(True, "evaluate the train split too (as many tokens as val), not only val")
    log_interval: int = opt(10, "print and log every N steps")
    max_minutes: float = opt(0.0, "stop cleanly (evaluate, save) after this many minutes of wall time (0 = off)")
    target_val_loss: float = opt(0.0, "stop at the first evaluation with val loss <= this (0 = off)")
    skip_nonfinite: bool = opt(False, "skip (and count) steps with a non-finite loss or gradient instead of stopping")
    wandb_project: str = opt("", "log to Weights & Biases under this project (off when empty)")
    wandb_run_name: str = opt("", "W&B run name (default: the out_dir name)")
    wandb_mode: str = opt("", "W&B mode: online | offline (default: wandb's own)")
    plot: bool = opt(
        True, "draw OUT_DIR/run.png (loss curves, LR, gradient norm) at each evaluation, in the background"
    )
    tensorboard: bool = opt(False, "also write TensorBoard event files into OUT_DIR/tensorboard")
    # LoRA (gpt/model/lora.py): frozen base weights, trained low-rank adapters
    lora_rank: int = opt(0, "LoRA adapter rank (0 = off: full fine-tuning); needs --init-from")
    lora_alpha: float = opt(16.0, "LoRA scaling: the adapters' update is multiplied by alpha / rank")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input")
    lora_targets: str = opt(
        ",".join(LORA_DEFAULT_TARGETS),
        "comma-separated layers to adapt: each block's projections, "
        "and wte, the token embedding tied to the output head",
    )
    # quantisation-aware training (gpt/model/qat.py)
    qat: str = opt(
        "",
        "quantisation-aware training for int8 | int4 | q4_0: the forward multiplies by the weights "
        "--quantize (int8, int4) or gguf --quant q4_0 will hold (off when empty)",
    )
    qat_group_size: int = opt(32, "--qat int4: input features sharing a scale, 32 | 64 | 128 (as --group-size)")
    # knowledge distillation (gpt/train/distill.py)
    distill_from: str = opt("", "distil from a teacher: a run dir, checkpoint or HF dir with the dataset's tokenizer")
    distill_alpha: float = opt(0.5, "--distill-from: the KL term's weight; (1 - alpha) weighs the usual loss")
    distill_temperature: float = opt(2.0, "--distill-from: softmax temperature of the KL term (scaled by T^2)")
    # preference tuning (gpt/train/prefer.py): a dataset of `gpt prepare --preferences`
    objective: str = opt(
        "lm",
        "lm (the next tokens) | dpo | orpo (preference pairs: gpt prepare --preferences) | grpo (prompts and a --reward)",
    )
    reference: str = opt("", "--objective dpo | grpo: the frozen reference model (default: the --init-from checkpoint)")
    beta: float = opt(
        0.1, "--objective dpo | grpo: how far from the reference the policy may move (higher: less; grpo: 0 = no KL)"
    )
    dpo_loss: str = opt("sigmoid", "--objective dpo: sigmoid (DPO) | ipo | hinge")
    reference_cache: bool = opt(
        False, "--objective dpo: the reference's log-probs of every pair computed once, kept in OUT_DIR for the run"
    )
    orpo_lambda: float = opt(0.1, "--objective orpo: the odds-ratio term's weight beside the chosen answers' NLL")
    # GRPO (gpt/train/grpo.py): --data is a file of prompt rows (gpt/train/prompts.py)
    reward: str = opt("", "--objective grpo: exact | json | bleu | module:function (gpt/train/rewards.py)")
    group_size: int = opt(8, "--objective grpo: completions sampled per prompt (G)")
    grpo_max_new_tokens: int = opt(64, "--objective grpo: the longest completion, in tokens")
    grpo_temperature: float = opt(1.0, "--objective grpo: the sampling temperature of the completions")
    grpo_updates: int = opt(1, "--objective grpo: policy updates (steps) on each sampled batch")
    grpo_loss: str = opt("grpo", "--objective grpo: grpo (per completion) | bnpo (per token) | dr_grpo")
    epsilon: float = opt(0.2, "--objective grpo: the policy ratio's clip range, 1 +- epsilon")
    skip_bad_rows: bool = opt(False, "--objective grpo: skip bad prompt rows (counted) instead of stopping")
    # system
    seed: int = opt(1337, "seed for initialisation, dropout and data order")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps")
    dtype: str = opt(
        "auto",
        "auto (bf16, else fp16, on CUDA; on CPU bf16 only where native, else float32) | float32 | bfloat16 | float16",
    )
    compile: bool = opt(False, "torch.compile the model (the uncompiled module is what gets saved)")
    fsdp: bool = opt(
        False,
        "torchrun: shard parameters, gradients and optimizer state over the processes (FSDP2; sharded checkpoints)",
    )
    tp: int = opt(1, "torchrun: tensor parallelism, each layer's matrices split over N processes (Megatron-style)")
    sequence_parallel: bool = opt(
        False, "--tp: norms, dropout and the residual stream on sequence shards (less activation memory)"
    )
    pp: int = opt(1, "torchrun: pipeline parallelism, the layers split into N stages that micro-batches flow through")
    pp_schedule: str = opt("1f1b", "--pp's schedule: gpipe | 1f1b | interleaved (two stages per process)")
    activation_checkpointing: bool = opt(
        False, "recompute each block's activations in the backward pass (less memory, ~1 more forward per step)"
    )
    deterministic: bool = opt(
        False, "deterministic kernels: bit-identical reruns and resumes on CUDA too (a little slower)"
    )
    threads: int = opt(0, "CPU threads for PyTorch (0 = its default)")
    peak_flops: float = opt(0.0, "device peak FLOP/s for MFU (0 = look it up / estimate)")

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ConfigError("\n".join(problems))

    def problems(self) -> list[str]:
        """Every invalid value, as `--flag: what is wrong` lines (the model checks its own fields)."""
        out = []
        choices = {
            "sampling": ("random", "epoch"),
            "loss_on": ("assistant", "all"),
            "lr_schedule": ("cosine", "constant", "wsd", "noam"),
            "optimizer": ("adamw", "muon"),
            "wd_schedule": ("constant", "linear", "cosine"),
            "dtype": ("auto", "float32", "bfloat16", "float16"),
            "wandb_mode": ("", "online", "offline", "disabled"),
            "pp_schedule": ("gpipe", "1f1b", "interleaved"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                out.append(f"{flag(name)}: {getattr(self, name)!r} is not one of {', '.join(map(repr, allowed))}")
        for name in ("grad_accum", "max_iters", "eval_interval", "log_interval", "tp", "pp", "pad_to"):
            if getattr(self, name) < 1:
                out.append(f"{flag(name)}: must be >= 1, got {getattr(self, name)}")
        if self.batch_size < 0 or (self.batch_size == 0 and not self.global_batch):  # 0 + a global batch = auto
            out.append(f"--batch-size: must be >= 1 or auto, got {self.batch_size}")
        for name in (
            "warmup_iters",
            "lr_decay_iters",
            "eval_iters",
            "eval_batch_size",
            "threads",
            "max_tokens",
            "max_minutes",
            "seed",
            "global_batch",
        ):
            if getattr(self, name) < 0:
                out.append(f"{flag(name)}: must be >= 0, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            out.append(f"--learning-rate: must be > 0, got {self.learning_rate}")
        if not 0 <= self.min_lr <= self.learning_rate:
            out.append(f"--min-lr: must be in [0, --learning-rate={self.learning_rate}], got {self.min_lr}")
        for name in ("muon_lr", "scalar_lr", "resid_lr"):
            if getattr(self, name) <= 0:
                out.append(f"{flag(name)}: must be > 0, got {getattr(self, name)}")
        if self.sequence_parallel and self.tp <= 1:
            out.append("--sequence-parallel: shards what --tp splits; add --tp N (N > 1) or drop it")
        if self.muon_cautious_wd and self.optimizer != "muon":
            out.append("--muon-cautious-wd: Muon's weight decay; give --optimizer muon, or drop it")
        if self.optimizer == "muon" and self.fsdp:
            out.append(
                "--optimizer muon: not with --fsdp (Muon orthogonalises whole matrices, FSDP shards them): "
                "use DDP (torchrun without --fsdp) or --optimizer adamw"
            )
        if not 0 < self.decay_fraction <= 1:
            out.append(f"--decay-fraction: must be in (0, 1], got {self.decay_fraction}")
        if self.resume and self.init_from:
            out.append(
                "--resume and --init-from: give one or the other (resume continues a run, init_from starts a new one)"
            )
        out += self.lora_problems() + self.qat_problems() + self.distill_problems() + self.objective_problems()
        out += self.window_problems()
        return out

    def objective_problems(self) -> list[str]:
        if self.objective not in OBJECTIVES:
            return [f"--objective: {self.objective!r} is not one of {', '.join(map(repr, OBJECTIVES))}"]
        given = {f.name for f in fields(self) if f.name in OBJECTIVE_OPTIONS and getattr(self, f.name) != f.default}
        out = [
            f"{flag(name)}: does nothing with --objective {self.objective}; it is for --objective "
            + " | ".join(OBJECTIVE_OPTIONS[name])
            for name in sorted(given)
            if self.objective not in OBJECTIVE_OPTIONS[name]
        ]
        if self.objective == "lm":
            return out
        out += [
            f"--objective {self.objective}: not with {flag(n)} in this version"
            for n in ("pp", "tp")
            if getattr(self, n) > 1
        ]
        if self.distill_from:
            out.append(f"--objective {self.objective}: not with --distill-from")
        if self.model.n_encoder_layer:
            out.append(f"--objective {self.objective}: decoder-only models only (no --n-encoder-layer)")
        if self.objective == "dpo":
            if self.beta <= 0:
                out.append(f"--beta: must be > 0, got {self.beta}")
            if self.dpo_loss not in ("sigmoid", "ipo", "hinge"):
                out.append(f"--dpo-loss: {self.dpo_loss!r} is not one of 'sigmoid', 'ipo', 'hinge'")
            if not (self.reference or self.init_from or self.resume):
                out.append(
                    "--objective dpo: needs a reference model: --init-from CKPT (the reference is its weights) or --reference CKPT"
                )
        if self.objective == "orpo" and self.orpo_lambda < 0:
            out.append(f"--orpo-lambda: must be >= 0, got {self.orpo_lambda}")
        if self.objective == "grpo":
            out += self.grpo_problems()
        return out

    def grpo_problems(self) -> list[str]:
        out = []
        if not self.reward:
            out.append("--objective grpo: needs --reward exact | json | bleu | module:function")
        if not (self.init_from or self.resume):
            out.append("--objective grpo: needs a model to start from: --init-from CKPT (or --resume RUN)")
        if self.beta < 0:
            out.append(f"--beta: must be >= 0, got {self.beta}")
        if self.group_size < 2:
            out.append(
                f"--group-size: must be >= 2 (the advantage compares completions of a prompt), got {self.group_size}"
            )
        for name in ("grpo_max_new_tokens", "grpo_updates"):
            if getattr(self, name) < 1:
                out.append(f"{flag(name)}: must be >= 1, got {getattr(self, name)}")
        if self.grpo_temperature <= 0:
            out.append(f"--grpo-temperature: must be > 0, got {self.grpo_temperature}")
        if not 0 < self.epsilon < 1:
            out.append(f"--epsilon: must be in (0, 1), got {self.epsilon}")
        if self.grpo_loss not in ("grpo", "bnpo", "dr_grpo"):
            out.append(f"--grpo-loss: {self.grpo_loss!r} is not one of 'grpo', 'bnpo', 'dr_grpo'")
        if self.fsdp:
            out.append("--objective grpo: not with --fsdp in this version (use DDP: torchrun without --fsdp)")
        return out

    def window_problems(self) -> list[str]:
        if not self.window_schedule:
            return []
        pattern = parse_windows(self.model.attention_window) if isinstance(self.model.attention_window, str) else ()
        if not pattern:
            return ["--window-schedule: grows the windows of --attention-window; give one, or drop it"]
        if not 1 <= self.window_schedule <= max(pattern):
            return [
                f"--window-schedule: the starting window in tokens, from 1 to --attention-window's largest "
                f"({max(pattern)}); got {self.window_schedule}"
            ]
        return ["--window-schedule: not with --pp in this version"] if self.pp > 1 else []

    def distill_problems(self) -> list[str]:
        if not self.distill_from:
            names = ("distill_alpha", "distill_temperature")
            given = [flag(f.name) for f in fields(self) if f.name in names and getattr(self, f.name) != f.default]
            return [f"{', '.join(given)}: give --distill-from TEACHER, or drop them"] if given else []
        out = [f"--distill-from: not with {flag(n)} in this version" for n in ("pp", "tp") if getattr(self, n) > 1]
        if self.model.n_encoder_layer:
            out.append("--distill-from: decoder-only models only, not seq2seq (--n-encoder-layer), in this version")
        if not 0 <= self.distill_alpha <= 1:
            out.append(f"--distill-alpha: must be in [0, 1], got {self.distill_alpha}")
        if self.distill_temperature <= 0:
            out.append(f"--distill-temperature: must be > 0, got {self.distill_temperature}")
        return out

    def qat_problems(self) -> list[str]:
        if self.qat not in ("", *SCHEMES):
            return [f"--qat: {self.qat!r} is not one of {', '.join(SCHEMES)}"]
        if self.qat_group_size not in GROUP_SIZES:
            return [f"--qat-group-size: use one of {', '.join(map(str, GROUP_SIZES))}, got {self.qat_group_size}"]
        if self.qat_group_size != 32 and self.qat != "int4":
            return ["--qat-group-size: the group of --qat int4; give --qat int4, or drop it"]
        refused = {
            "--tp": self.tp > 1,
            "--pp": self.pp > 1,
            "--lora-dropout (the grid is of the merged weight)": (self.lora_rank and self.lora_dropout > 0),
        }
        return [f"--qat: not with {name} in this version" for name, on in refused.items() if self.qat and on]

    def lora_problems(self) -> list[str]:
        if self.lora_rank < 0:
            return [f"--lora-rank: must be >= 0 (0 = full fine-tuning), got {self.lora_rank}"]
        if not self.lora_rank:  # LoRA off: its settings would be silently ignored
            given = [
                flag(f.name)
                for f in fields(self)
                if f.name in ("lora_alpha", "lora_dropout", "lora_targets") and getattr(self, f.name) != f.default
            ]
            return (
                [
                    f"{', '.join(given)}: LoRA is off (--lora-rank 0 is full fine-tuning); give --lora-rank R to "
                    f"train adapters, or drop {'it' if len(given) == 1 else 'them'}"
                ]
                if given
                else []
            )
        out = []
        if not self.init_from and not self.resume:
            out.append("--lora-rank: LoRA adapts a pretrained model: give --init-from RUN_OR_CHECKPOINT")
        if self.model.n_encoder_layer:
            out.append("--lora-rank: LoRA adapts decoder-only models here, not seq2seq (--n-encoder-layer)")
        if self.fsdp:
            out.append("--lora-rank: not with --fsdp (only the adapters train, so there is little to shard: use DDP)")
        if self.lora_alpha <= 0:
            out.append(f"--lora-alpha: must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            out.append(f"--lora-dropout: must be in [0, 1), got {self.lora_dropout}")
        targets = self.lora_target_list()
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            out.append(
                f"--lora-targets: {', '.join(map(repr, unknown)) or 'none given'} "
                f"{'is' if len(unknown) == 1 else 'are'} not among {', '.join(LORA_TARGETS)}"
            )
        return out

    def lora_target_list(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]

    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(
            self.optimizer, self.learning_rate, (self.beta1, self.beta2), self.weight_decay, self.muon_cautious_wd
        )

    def lora_config(self) -> LoRAConfig | None:
        """The adapters --lora-rank / --lora-alpha / --lora-dropout / --lora-targets ask for (None: LoRA off)."""
        if not self.lora_rank:
            return None
        return LoRAConfig(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_target_list())

    def to_dict(self) -> dict:
        """Flat, as the flags and config files spell it (config.json, a checkpoint's train_config, W&B): the
        model's fields beside the run's, without vocab_size."""
        flat = {}
        for f in fields(self):
            if f.name == "model":
                flat.update((k, v) for k, v in self.model.to_dict().items() if k in MODEL_HELP)
            else:
                flat[f.name] = getattr(self, f.name)
        return flat

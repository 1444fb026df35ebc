"""The flags `gpt sample` and `gpt chat` share: how to sample (temperature, top-k, ...), where to run the model
(device, dtype, threads, int8), and the SampleConfig they build. One definition, so the two verbs cannot drift."""

from __future__ import annotations

import argparse
import os
import re


def _top_k(value: str) -> int | None:
    return None if value.strip().lower() in ("none", "off") else int(value)


_top_k.__name__ = "top-k"  # argparse's message: "invalid top-k value: 'x'"


def add_sampling_options(p: argparse.ArgumentParser, max_new_tokens: str, temperature: str) -> None:
    """--max-new-tokens, --temperature (their defaults, which depend on the verb, as `max_new_tokens` and
    `temperature` say them), --top-k, --top-p, --repetition-penalty, --stop and --seed."""
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens generated per sample at most (default: {max_new_tokens})",
    )
    p.add_argument(
        "--temperature", type=float, default=None, help=f"softmax temperature; 0 is greedy (default: {temperature})"
    )
    p.add_argument(
        "--top-k", type=_top_k, default=200, help="keep the k most likely tokens; 'none' keeps all (default: 200)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 is off (default: 1)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="CTRL-style penalty on tokens already present; 1 is off (default: 1)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample at this text, which is not printed; repeatable (default: none)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed (default: a fresh one, printed in the summary to reproduce the run)",
    )


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--device, --dtype, --threads and --quantize: how the checkpoint is loaded to run."""
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps (default: auto)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on a capable GPU or a CPU with native bf16, else "
        "float32), float32, bfloat16, float16 (CUDA only) (default: auto)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for PyTorch; 0 = one for small models or a busy machine, else PyTorch's default (default: 0)",
    )
    add_quantize(p)


def add_quantize(p: argparse.ArgumentParser) -> None:
    """--quantize and --group-size: the Linear layers in int8 or int4 for CPU inference."""
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8", "int4"],
        help="int8: int8 Linear layers (weights and activations); int4: int4 weights in groups of --group-size; "
        "CPU and float32 only (gpt/model/quantize.py) (default: none)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=32,
        choices=[32, 64, 128],
        help="--quantize int4: input features sharing a scale (default: 32)",
    )


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """`\\n`, `\\t`, `\\r`, `\\\\` typed in a shell (two characters each) as the characters they name."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


def given(value, default):
    """A flag's value, or the mode's default when it was not given (0 is a value, not "not given")."""
    return default if value is None else value


def fresh_seed(args: argparse.Namespace) -> int:
    """--seed, else a fresh one (which the summary prints, so the run can be reproduced)."""
    return args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1


def sample_config(args: argparse.Namespace, defaults: dict, **fields):
    """The sampling flags as a SampleConfig, the mode's `defaults` for the flags not given."""
    from gpt.infer.sampling import SampleConfig  # torch: after flags

    return SampleConfig(
        max_new_tokens=given(args.max_new_tokens, defaults["max_new_tokens"]),
        temperature=given(args.temperature, defaults["temperature"]),
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(map(unescape, args.stop)),
        seed=fresh_seed(args),
        **fields,
    )

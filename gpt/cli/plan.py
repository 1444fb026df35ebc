"""The planner, `gpt plan`: memory per GPU for a config (gpt/train/plan.py), or with `--depth N` /
`--params P` a whole run sized for a corpus and a time budget on this machine (gpt/train/sizing.py).

    gpt plan --config gpt2_1558m --gpus 8
    gpt plan --depth 4 --data data/shakespeare_char --minutes 10
"""

from __future__ import annotations

from gpt.cli import ArgumentParser, run_main
from gpt.train.flags import build_config
from gpt.train.pipeline import SCHEDULES
from gpt.train.plan import GPUS, SIZES, PlanError, detail, layout_table, layouts, plan, plan_lines, summary
from gpt.train.sizing import ASPECT_RATIO, HEAD_DIM, size

SIZING = (
    "depth",
    "params",
    "data",
    "minutes",
    "out_dir",
    "aspect_ratio",
    "head_dim",
    "block_size",
    "tokens_per_second",
    "device",
)
MEMORY = ("config", "gpus", "gpu_memory", "reserve", "vocab_size", "batch_size", "pp", "pp_schedule")
MEMORY_DEFAULTS = {"gpu_memory": 80.0, "reserve": 0.1, "vocab_size": 50304}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(
        prog="gpt plan",
        description="Memory per GPU under DDP / FSDP / activation checkpointing, and which flags fit (GiB; a ✗ "
        "does not fit); for one config and GPU count also the tensor x pipeline x data parallel layouts that fit; or, with --depth / --params, a whole training run sized for a corpus and a time budget.",
    )
    ap.add_argument(
        "--config",
        action="append",
        help=f"a training config, shipped name or TOML file, repeatable (default: {', '.join(SIZES)})",
    )
    ap.add_argument("--gpus", type=int, action="append", help="GPUs, repeatable (default: 1, 8, 64)")
    ap.add_argument("--gpu-memory", type=float, help="GB per GPU (default: 80)")
    ap.add_argument(
        "--reserve",
        type=float,
        help="share of each GPU kept free for the CUDA context and allocator slack (default: 0.1)",
    )
    ap.add_argument("--vocab-size", type=int, help="embedding rows (default: 50304, GPT-2 padded)")
    ap.add_argument("--batch-size", type=int, default=None, help="micro-batch per GPU (default: the config's)")
    ap.add_argument("--pp", type=int, help="also each pipeline process's memory and the bubble with --pp N stages")
    ap.add_argument(
        "--pp-schedule",
        choices=SCHEDULES,
        help="the pipeline's schedule, for --pp and the layouts (default: the config's)",
    )
    sizing = ap.add_argument_group(
        "sizing a run from one number (nanochat's --depth): the whole `gpt train` command for a corpus and a time "
        "budget on this machine, from its measured throughput"
    )
    sizing.add_argument("--depth", type=int, help="transformer blocks; the rest follows from it")
    sizing.add_argument("--params", help="or a parameter count (10M, 1.5B): the nearest depth")
    sizing.add_argument("--data", help="the prepared token dataset (its vocabulary and size)")
    sizing.add_argument("--minutes", type=float, help="the time budget of the training run")
    sizing.add_argument("--out-dir", help="the run directory to put in the command (default: out/run)")
    sizing.add_argument("--aspect-ratio", type=int, help=f"width per block (default: {ASPECT_RATIO})")
    sizing.add_argument("--head-dim", type=int, help=f"attention head size (default: {HEAD_DIM})")
    sizing.add_argument("--block-size", type=int, help="context length (default: from the width)")
    sizing.add_argument("--tokens-per-second", type=float, help="the throughput to plan with (default: measured)")
    sizing.add_argument("--device", help="where to measure and train (default: auto)")
    args = ap.parse_args(argv)

    def sized() -> str:
        memory_flags = [f"--{k.replace('_', '-')}" for k in MEMORY if getattr(args, k) is not None]
        if memory_flags:
            raise PlanError(f"{', '.join(memory_flags)}: for the memory plan, not with --depth / --params")
        p = size(
            args.data or "",
            0.0 if args.minutes is None else args.minutes,
            depth=args.depth,
            params=args.params or "",
            aspect_ratio=ASPECT_RATIO if args.aspect_ratio is None else args.aspect_ratio,
            head_dim=HEAD_DIM if args.head_dim is None else args.head_dim,
            block_size=args.block_size or 0,
            tokens_per_second=args.tokens_per_second or 0.0,
            out_dir=args.out_dir or "out/run",
            device=args.device or "auto",
        )
        return "\n".join([*p.reasons, "", p.command()])

    def body() -> str:
        if args.depth is not None or args.params is not None:
            return sized()
        given = [f"--{k.replace('_', '-')}" for k in SIZING if getattr(args, k) is not None]
        if given:
            raise PlanError(f"{', '.join(given)}: for sizing a run: give --depth N or --params P too")
        for key, default in MEMORY_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        problems = [f"--gpus: must be >= 1, got {n}" for n in args.gpus or () if n < 1]
        if args.gpu_memory <= 0 or not 0 <= args.reserve < 1 or args.vocab_size < 1:
            problems.append("--gpu-memory and --vocab-size must be > 0, --reserve in [0, 1)")
        if problems:
            raise PlanError("; ".join(problems))
        plans = []
        for name in args.config or SIZES:
            cfg = build_config(["--config", name] + (["--batch-size", str(args.batch_size)] if args.batch_size else []))
            plans += [(name, plan(cfg, args.vocab_size, n, args.gpu_memory, args.reserve)) for n in args.gpus or GPUS]
        if args.pp is not None:
            if len(plans) != 1 or args.pp < 1:
                raise PlanError("--pp: for one config and one --gpus count, with N >= 1")
            p, schedule = plans[0][1], args.pp_schedule or cfg.pp_schedule
            return "\n".join(
                [detail(*plans[0]), *plan_lines(p["shape"], p["gpus"], args.pp, cfg.grad_accum, schedule, p["budget"])]
            )
        if len(plans) == 1:
            name, p = plans[0]
            found = layouts(
                cfg, args.vocab_size, p["gpus"], args.gpu_memory, args.reserve, args.pp_schedule or cfg.pp_schedule
            )
            return detail(name, p) + "\n\n" + layout_table(name, found, p["gpus"])
        return summary(plans)

    return run_main(body)

"""The memory planner: `gpt plan`."""

from __future__ import annotations

from gpt.cli import ArgumentParser, run_main
from gpt.train.config import build_config
from gpt.train.plan import GPUS, SIZES, PlanError, detail, plan, summary


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(
        prog="gpt plan",
        description="Memory per GPU under DDP / FSDP / activation "
        "checkpointing, and which flags fit (GiB; a ✗ does not fit).",
    )
    ap.add_argument(
        "--config",
        action="append",
        help=f"a training config, shipped name or TOML file, repeatable (default: {', '.join(SIZES)})",
    )
    ap.add_argument("--gpus", type=int, action="append", help="GPUs, repeatable (default: 1, 8, 64)")
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU (default: 80)")
    ap.add_argument(
        "--reserve",
        type=float,
        default=0.1,
        help="share of each GPU kept free for the CUDA context and allocator slack (default: 0.1)",
    )
    ap.add_argument("--vocab-size", type=int, default=50304, help="embedding rows (default: 50304, GPT-2 padded)")
    ap.add_argument("--batch-size", type=int, default=None, help="micro-batch per GPU (default: the config's)")
    args = ap.parse_args(argv)

    def body() -> str:
        problems = [f"--gpus: must be >= 1, got {n}" for n in args.gpus or () if n < 1]
        if args.gpu_memory <= 0 or not 0 <= args.reserve < 1 or args.vocab_size < 1:
            problems.append("--gpu-memory and --vocab-size must be > 0, --reserve in [0, 1)")
        if problems:
            raise PlanError("; ".join(problems))
        plans = []
        for name in args.config or SIZES:
            cfg = build_config(["--config", name] + (["--batch-size", str(args.batch_size)] if args.batch_size else []))
            plans += [(name, plan(cfg, args.vocab_size, n, args.gpu_memory, args.reserve)) for n in args.gpus or GPUS]
        if len(plans) == 1:
            return detail(*plans[0])
        return summary(plans)

    return run_main(body)

"""Where training progress goes: the console, `log.jsonl` in the run directory, and W&B and / or
TensorBoard (OUT_DIR/tensorboard, `--tensorboard`) if asked.

One logger object; the loop never asks "is wandb on?" (`NullTracker` stands in when no tracker is,
`Trackers` when several are). A tracker's failure (not installed, no network, bad key) prints one
warning and training goes on without it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

import torch

from gpt.fsutil import appending, own_dir

# Dense bf16 peak FLOP/s of common accelerators (vendor datasheets), matched against the device name.
GPU_PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
]


def peak_flops(device: torch.device) -> float | None:
    """The device's peak FLOP/s for MFU: a datasheet table for GPUs, an estimate for CPUs."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((f for key, f in GPU_PEAK_FLOPS if key in name), None)
    if device.type == "cpu":  # threads x clock x fp32 FLOPs per cycle (2 FMA units x vector width)
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
        mhz = [float(m) for m in re.findall(r"cpu MHz\s*:\s*([\d.]+)", info)]
        per_cycle = 64 if " avx512f" in info else 32 if " fma" in info else 8
        return torch.get_num_threads() * (max(mhz) if mhz else 2000.0) * 1e6 * per_cycle if mhz else None
    return None


class NullTracker:
    def log(self, data: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    name = "Weights & Biases"

    def __init__(self, project: str, name: str, config: dict, mode: str, out_dir: str):
        import wandb  # lazily: only when asked for

        own_dir(Path(out_dir) / "wandb")  # wandb writes under OUT_DIR/wandb: never into a link planted there
        self.run = wandb.init(
            project=project,
            name=name,
            config=config,
            dir=out_dir,
            mode=mode or None,
            settings=wandb.Settings(init_timeout=60, silent=True),
        )

    def log(self, data: dict, step: int) -> None:
        self.run.log(data, step=step)

    def finish(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    name = "TensorBoard"

    def __init__(self, out_dir: str):
        from torch.utils.tensorboard import (
            SummaryWriter,  # lazily: needs the `tensorboard` package
        )

        # a link planted at tensorboard/ is replaced, and the event file's name gets a random part (it is
        # opened by tensorboard, without O_NOFOLLOW): nothing there can be planted in advance
        log_dir = own_dir(Path(out_dir) / "tensorboard")
        self.writer = SummaryWriter(log_dir=str(log_dir), filename_suffix=f".{secrets.token_hex(6)}")

    def log(self, data: dict, step: int) -> None:
        for key, value in data.items():
            self.writer.add_scalar(key, value, step)

    def finish(self) -> None:
        self.writer.close()


class Trackers:
    """Several trackers as one; one that fails is dropped with a warning."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, data: dict, step: int) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(data, step)
            except Exception as e:
                print(f"warning: {tracker.name} logging failed, disabled ({type(e).__name__}: {e})", file=sys.stderr)
                self.trackers.remove(tracker)

    def finish(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.finish()
            except Exception:
                pass


class RunLogger:
    """Console lines, JSONL records and the tracker, for the master process only."""

    def __init__(self, out_dir: str, enabled: bool = True, tracker=None):
        self.enabled = enabled
        self.tracker = tracker or NullTracker()
        self.path = Path(out_dir) / "log.jsonl"
        self.file = appending(self.path) if enabled else None  # never through a link planted there
        self.console_closed = False

    @classmethod
    def create(
        cls,
        out_dir: str,
        enabled: bool,
        wandb_project: str,
        wandb_name: str,
        wandb_mode: str,
        config: dict,
        tensorboard: bool = False,
    ):
        trackers = []
        if enabled and wandb_project:
            try:
                trackers.append(
                    WandbTracker(wandb_project, wandb_name or Path(out_dir).name, config, wandb_mode, out_dir)
                )
            except Exception as e:  # never let logging stop training
                print(f"warning: Weights & Biases disabled ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        if enabled and tensorboard:
            try:
                trackers.append(TensorBoardTracker(out_dir))
            except Exception as e:
                print(
                    f"warning: TensorBoard disabled ({type(e).__name__}: {str(e)[:200]}; pip install -e "
                    f'".[tensorboard]")',
                    file=sys.stderr,
                )
        return cls(out_dir, enabled, Trackers(trackers) if trackers else None)

    def print(self, line: str) -> None:
        """A console line. When stdout's reader has gone (`train.py | head`, a closed terminal) the line
        and the ones after it go nowhere and `console_closed` is set: the loop then saves and stops."""
        if not self.enabled or self.console_closed:
            return
        try:
            print(line, flush=True)
        except OSError as e:  # BrokenPipeError; EIO from a terminal that was closed
            if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:
                raise
            self.console_closed = True
            devnull = os.open(os.devnull, os.O_WRONLY)  # so no later write (or the flush at exit) fails again
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)

    def record(self, kind: str, step: int, **values) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"kind": kind, "step": step, "time": round(time.time(), 3), **values}) + "\n")
        self.tracker.log({f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        try:
            self.tracker.finish()
        except Exception:
            pass

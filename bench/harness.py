"""What every benchmark needs: the machine it ran on, timestamped child processes, nanoGPT's own code
copied to a scratch directory (never imported, never copied into the project).

    from harness import machine, launch, nanogpt_copy, SHARED_DATA   # ../shared/data, or $GPT_SHARED_DATA
    as_avx2()          # this process again, as a CPU without AVX-512 or native bf16 runs it (AS_AVX2)
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GPT_SHARED_DATA", ROOT.parent / "shared" / "data"))  # as tests/conftest.py
if (SHARED_DATA / "gpt2.tiktoken").exists():  # offline: GPT-2's BPE ranks for this process and its children
    os.environ.setdefault("GPT2_TIKTOKEN_FILE", str(SHARED_DATA / "gpt2.tiktoken"))
# --compile timings are compiles, not loads of a step an earlier run kept (gpt/model/stepcache.py)
os.environ.setdefault("GPT_COMPILE_CACHE", "off")


# A CPU without AVX-512 and without native bf16 (an AVX2-only EPYC or Core), approximated on this one: each
# library's own switch to its AVX2 code, and our kernels built for x86-64-v3. The memory, caches and clock stay
# this machine's, so it tells what the code paths do, not what such a machine measures.
AS_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's vectorised kernels
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's (float32 products)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's
    "GPT_CPU_BF16": "0",  # our precision policy: a CPU without native bf16
    "GPT_ROW_KERNELS": "x86-64-v3",  # our C kernels: the AVX2 build
}


def as_avx2() -> dict:
    """Run this process as `AS_AVX2` says: re-executed with those variables (they act at start-up), then
    PyTorch's oneDNN bf16 products off (PyTorch picks them by the CPU's flags, which no variable hides; a CPU
    without AVX-512 runs its own bf16 GEMM). Returns what was set, for the results file."""
    if any(os.environ.get(k) != v for k, v in AS_AVX2.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AS_AVX2})
    import torch

    torch.backends.mkldnn.enabled = False
    return {**AS_AVX2, "torch.backends.mkldnn.enabled": False}


def machine() -> dict:
    """The CPU (model, capability, native bf16, the vector flags that pick kernels), cores, threads, torch
    and Python, the load, the commit measured and the date: what every results file records."""
    import torch

    sys.path.insert(0, str(ROOT))
    from gpt.runtime import cpu_has_native_bf16, cpu_name

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cpu_family_model": cpu_family_model(),
        "cpu_flags": cpu_flags(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _cpuinfo() -> str:
    """/proc/cpuinfo's text, or "" where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> list[str]:
    """The CPU's vector-instruction flags that decide which kernels run (AVX2, AVX-512 and its BF16 / VNNI,
    AMX), from /proc/cpuinfo; empty where there is none."""
    found = re.search(r"^flags\s*:(.*)$", _cpuinfo(), re.M)
    flags = found.group(1).split() if found else []
    return sorted({f for f in flags if re.fullmatch(r"avx2|fma|f16c|avx512\w*|avx_vnni\w*|amx\w*", f)})


def cpu_family_model() -> str:
    """`family F model M` from /proc/cpuinfo (a VM often names its CPU only "AMD EPYC"; the family tells Zen 4
    from Zen 5), or "" where there is none."""
    fields = dict(re.findall(r"^(cpu family|model)\s*:\s*(\S+)$", _cpuinfo(), re.M))
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}" if fields else ""


def commit() -> str:
    """The checkout's commit, with `+dirty` when it has uncommitted changes to tracked files."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "gpt", "bench", ":!bench/results"], cwd=ROOT
        ).returncode
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else "unknown"


def spread(values) -> dict:
    """The median of `values` with its min, max and count: how a results file states a repeated figure."""
    values = sorted(values)
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "n": len(values)}


def launch(cmd: list, cwd: Path, log_path: Path, timeout: float, stop_when=None, env=None, on_start=None) -> dict:
    """Run a command; every output line is kept with its time since launch. `stop_when(line)` ends the
    run early (SIGTERM to its process group). Returns lines, return code, seconds, t0 (epoch)."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    lines, stopped = [], False
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        if on_start:
            on_start(proc)
        timer = threading.Timer(timeout, lambda: kill(proc))
        timer.start()
        for line in proc.stdout:
            t = time.time() - t0
            lines.append((t, line.rstrip("\n")))
            f.write(f"{t:8.2f} {line}")
            if stop_when and not stopped and stop_when(line):
                stopped = True
                kill(proc, signal.SIGTERM)
        proc.wait()
        timer.cancel()
    return {
        "lines": lines,
        "returncode": proc.returncode,
        "seconds": time.time() - t0,
        "t0": t0,
        "stopped_early": stopped,
        "timed_out": time.time() - t0 >= timeout,
    }


def kill(proc, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def tail(run: dict, n: int = 15) -> str:
    return "\n".join(line for _, line in run["lines"][-n:])


def nanogpt_copy(work: Path, shared: Path = SHARED_DATA.parent) -> Path:
    """A scratch copy of nanoGPT (`<shared>/baselines/nanoGPT`) with its shakespeare_char dataset prepared
    offline by its own prepare.py from the shared tiny-shakespeare (its README's recipe, minus the
    download)."""
    dst = work / "nanoGPT"
    if not dst.exists():
        shutil.copytree(shared / "baselines" / "nanoGPT", dst)
        char_dir = dst / "data" / "shakespeare_char"
        shutil.copy(shared / "data" / "tinyshakespeare.txt", char_dir / "input.txt")
        subprocess.run([sys.executable, "prepare.py"], cwd=char_dir, check=True, capture_output=True)
    return dst

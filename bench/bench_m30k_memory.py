"""Peak memory and kernel time of the Multi30k recipe on a CPU against the run's own preflight estimate.

    python bench/bench_m30k_memory.py                     # one 15-minute multi30k_cpu run, quiet machine
    python bench/bench_m30k_memory.py --minutes 2 --out /tmp/m30k   # a quick check that it runs

Runs `/usr/bin/time -v python train.py --config multi30k_cpu --data DIR --max-minutes M` (Multi30k de-en,
byte-level BPE of 8192 ids, prepared by data/multi30k/prepare.py unless --data is given) and records what
/usr/bin/time measures of the whole process: the peak resident set, user and system seconds, minor page
faults; and from the run's own log: its preflight memory estimate, the resident limit the allocator holds it
under, the steps made and the trims. The goals (issue 44): peak within 1.5x of the estimate, system time
under 5% of CPU time.

Writes bench/results/m30k-memory.{json,md} (or --out).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

GIB = 2**30
TIME_FIELDS = {
    "max_rss_kib": "Maximum resident set size (kbytes)",
    "user_s": "User time (seconds)",
    "sys_s": "System time (seconds)",
    "minor_faults": "Minor (reclaiming a frame) page faults",
    "wall": "Elapsed (wall clock) time (h:mm:ss or m:ss)",
}


def prepare(work: Path) -> Path:
    out = work / "multi30k-de-en"
    cmd = [
        sys.executable,
        str(ROOT / "data" / "multi30k" / "prepare.py"),
        "--input",
        str(harness.SHARED_DATA / "multi30k"),
    ]
    subprocess.run([*cmd, "--out", str(out), "--tokenizer", "bpe", "--vocab-size", "8192"], cwd=ROOT, check=True)
    return out


def gib(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"GiB": 1, "MiB": 1 / 1024, "KiB": 1 / 2**20}[unit]


def measure(data: Path, minutes: float, out_dir: Path) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "train.py", "--config", "multi30k_cpu", "--data", str(data)]
    cmd += ["--out-dir", str(out_dir), "--no-plot", "--max-minutes", str(minutes)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"the run failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    got = {}
    for key, label in TIME_FIELDS.items():
        value = re.search(re.escape(label) + r": (\S+)", res.stderr).group(1)
        got[key] = value if key == "wall" else float(value)
    estimate = re.search(r"estimated memory per process .* = ([\d.]+ [KMG]iB)", res.stdout).group(1)
    limit = re.search(r"held under ([\d.]+ [KMG]iB) resident", res.stdout)
    trims = re.search(r"allocator: (\d+) trims", res.stdout)
    steps = [int(m) for m in re.findall(r"^step +(\d+)", res.stdout, re.M)]
    got |= {
        "estimate_gib": gib(estimate),
        "limit_gib": gib(limit.group(1)) if limit else None,
        "trims": int(trims.group(1)) if trims else 0,
        "last_logged_step": steps[-1] if steps else 0,
        "peak_gib": got["max_rss_kib"] * 1024 / GIB,
    }
    got["peak_over_estimate"] = got["peak_gib"] / got["estimate_gib"]
    got["sys_share"] = got["sys_s"] / (got["user_s"] + got["sys_s"])
    got["faults_per_step"] = got["minor_faults"] / max(got["last_logged_step"], 1)
    return got


def markdown(r: dict, info: dict) -> str:
    m = info["machine"]
    return (
        "\n".join(
            [
                f"`multi30k_cpu` for {info['minutes']} minutes under /usr/bin/time -v; {m['cpu']} ({m['cpu_family_model']}),"
                f" native bf16 {m['native_bf16']}, torch {m['torch']}, commit {m['commit']}, {m['date']}, load "
                f"{m['load_avg']}.",
                "",
                "| steps | peak RSS | estimate | peak / estimate | resident limit | trims | system / CPU time | faults/step |",
                "|---|---|---|---|---|---|---|---|",
                f"| {r['last_logged_step']} | {r['peak_gib']:.2f} GiB | {r['estimate_gib']:.2f} GiB | "
                f"{r['peak_over_estimate']:.2f}x | {r['limit_gib']:.2f} GiB | {r['trims']} | {100 * r['sys_share']:.2f}% | "
                f"{r['faults_per_step']:,.0f} |",
            ]
        )
        + "\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0, help="the run's --max-minutes")
    p.add_argument("--data", help="a prepared Multi30k pairs dataset (default: prepared here)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "m30k-memory"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data) if args.data else prepare(Path(tmp))
        result = measure(data, args.minutes, Path(tmp) / "run")
    info = {"machine": harness.machine(), "minutes": args.minutes, "data": args.data or "prepared here"}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"info": info, "run": result}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result, info))
    print(markdown(result, info))


if __name__ == "__main__":
    main()

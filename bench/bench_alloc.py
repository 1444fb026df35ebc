"""The allocator tax: each long-running command with glibc's malloc tuned (the default, gpt/runtime.py's
tune_allocator) against glibc's own settings ($GPT_MALLOC=default), interleaved in one run: wall, user and
system seconds and peak RSS of each command's process (wait4's rusage).

    python bench/bench_alloc.py                 # 2 rounds, 5 jobs x 2 settings: ~8-10 min, quiet 2 cores
    python bench/bench_alloc.py --short         # shorter jobs, 1 round: a check on a busy machine

Jobs: the main job (shakespeare_char_cpu), a BPE job (tinyshakespeare, an own 4k BPE, 4x4x128), the
translation job (multi30k_cpu on Multi30k de-en, a fixed number of steps), sampling (sample.py on the main
job's checkpoint) and the server (gpt.serve under concurrent completions). Results: bench/results/alloc.md
and .json, with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, SHARED_DATA, machine

SETTINGS = {"tuned": "fast", "glibc default": "default"}  # $GPT_MALLOC


def run(cmd: list, env: dict, during=None) -> dict:
    """Run `cmd` to its end (or, with `during(proc)`, until that returns; then SIGINT): wall, user,
    system, peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE if during else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if during else subprocess.PIPE,
        text=True,
    )
    try:
        if during:
            try:
                during(proc)
            finally:
                proc.send_signal(signal.SIGINT)
            err = ""
        else:
            err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # the bench stopped (Ctrl-C, a timeout): its command with it
        proc.kill()
        raise
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, -signal.SIGINT, 130) and not during:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{err[-2000:]}")
    return {
        "wall_s": round(wall, 2),
        "user_s": round(usage.ru_utime, 2),
        "sys_s": round(usage.ru_stime, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
    }


def serve_load(requests: int, clients: int, max_tokens: int):
    """`during` for the server: wait for its address, send `requests` completions from `clients` threads."""

    def during(proc):
        line = ""
        while not line.startswith("serving "):
            line = proc.stdout.readline()
            if not line:
                raise SystemExit("the server stopped before it served")
        url = line.split(" at ", 1)[1].split("/ ", 1)[0]
        body = {"model": "bench", "prompt": "ROMEO:", "max_tokens": max_tokens, "temperature": 1.0}
        errors = []

        def client(n):
            try:
                for _ in range(n):
                    data = json.dumps(body).encode()
                    req = urllib.request.Request(url + "/v1/completions", data, {"Content-Type": "application/json"})
                    urllib.request.urlopen(req, timeout=300).read()
            except OSError as e:  # urllib's HTTPError and URLError included
                errors.append(f"{e}: {getattr(e, 'read', lambda: b'')()[:200]!r}")

        threads = [threading.Thread(target=client, args=(requests // clients,)) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit(f"the server answered {errors[0]}")

    return during


def prepare(work: Path, only=None) -> dict:
    """The datasets (`only`: those these jobs need), as a user prepares them."""
    py, tiny = sys.executable, SHARED_DATA / "tinyshakespeare.txt"
    data = {"char": work / "char", "bpe": work / "bpe", "pairs": work / "de-en"}
    steps = [
        [py, "data/shakespeare_char/prepare.py", "--input", tiny, "--out", data["char"]],
        [py, "data/prepare.py", tiny, "--out", data["bpe"], "--tokenizer", "bpe", "--vocab-size", "4096", "--quiet"],
        [py, "data/multi30k/prepare.py", "--input", SHARED_DATA / "multi30k", "--out", data["pairs"]],
    ]
    need = {"BPE job": "bpe", "translation job": "pairs"}
    for name, cmd in zip(data, steps):
        if only and name != "char" and name not in {need.get(job) for job in only}:
            continue
        subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, capture_output=True)
    return data


def jobs(data: dict, work: Path, short: bool) -> dict:
    """name -> (command for an output directory, `during` or None)."""
    py, n = sys.executable, (lambda full, brief: brief if short else full)
    common = ["--no-plot", "--force"]
    main_ckpt = work / "main-ckpt"
    return {
        "main job": (
            lambda out: (
                [py, "train.py", "--config", "shakespeare_char_cpu", "--data", data["char"]]
                + ["--out-dir", out, "--max-iters", n(400, 150), "--lr-decay-iters", n(400, 150), *common]
            ),
            None,
        ),
        "BPE job": (
            lambda out: (
                [py, "train.py", "--data", data["bpe"], "--out-dir", out, "--n-layer", 4, "--n-head", 4]
                + ["--n-embd", 128, "--block-size", 128, "--batch-size", 16, "--max-iters", n(60, 30)]
                + ["--eval-interval", 1000, "--eval-iters", 10, "--log-interval", 50, *common]
            ),
            None,
        ),
        "translation job": (
            lambda out: (
                [py, "train.py", "--config", "multi30k_cpu", "--data", data["pairs"], "--out-dir", out]
                + ["--max-iters", n(25, 10), "--eval-interval", 1000, "--eval-iters", 5, "--max-minutes", 10, *common]
            ),
            None,
        ),
        "sampling": (
            lambda out: (
                [py, "sample.py", "--ckpt", main_ckpt, "--prompt", "ROMEO:", "--seed", 0]
                + ["--num-samples", n(8, 2), "--max-new-tokens", 500]
            ),
            None,
        ),
        "server": (
            lambda out: (
                [py, "-m", "gpt", "serve", "--ckpt", main_ckpt, "--model-name", "bench", "--port", 0]
                + ["--log-level", "warning"]
            ),
            serve_load(n(32, 8), 4, 200),
        ),
    }


def table(rows: list[dict]) -> str:
    """Per job: each setting's median figures, and tuned / default ratios."""
    out = ["| job | setting | runs | wall s | user s | sys s | peak RSS MiB |", "|---|---|---|---|---|---|---|"]
    ratios = ["", "| job | wall | user | sys | peak RSS |", "|---|---|---|---|---|"]
    for job in dict.fromkeys(r["job"] for r in rows):
        med = {}
        for setting in SETTINGS:
            rs = [r for r in rows if r["job"] == job and r["setting"] == setting]
            med[setting] = {
                k: statistics.median(r[k] for r in rs) for k in ("wall_s", "user_s", "sys_s", "peak_rss_mib")
            }
            spread = " / ".join(f"{r['wall_s']:.1f}" for r in rs)
            m = med[setting]
            out.append(
                f"| {job} | {setting} | {len(rs)} | {m['wall_s']:.1f} ({spread}) | {m['user_s']:.1f} | "
                f"{m['sys_s']:.1f} | {m['peak_rss_mib']:.0f} |"
            )
        t, d = med["tuned"], med["glibc default"]
        ratio = [f"{t[k] / d[k]:.2f}" if d[k] else "-" for k in ("wall_s", "user_s", "sys_s", "peak_rss_mib")]
        ratios.append(f"| {job} | {' | '.join(ratio)} |")
    return "\n".join(out + ratios) + "\n\n(ratios: tuned / glibc default, medians)\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 2; 1 with --short)")
    p.add_argument("--short", action="store_true", help="shorter jobs: a check on a busy machine")
    p.add_argument("--only", nargs="*", help="these jobs only (names as in the table, e.g. 'main job')")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "alloc"), help="results, .md and .json")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.short else 2)
    env_clean = {k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"}
    if env_clean:
        raise SystemExit(f"unset {', '.join(sorted(env_clean))}: they would decide for both settings")
    info = machine()
    print(json.dumps(info), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_alloc_") as tmp:
        work = Path(tmp)
        data = prepare(work, args.only)
        todo = jobs(data, work, args.short)
        if {"sampling", "server"} & set(args.only or todo):  # a checkpoint to sample from and serve
            run(todo["main job"][0](work / "main-ckpt"), {})
        for rnd in range(rounds):
            for job, (command, during) in todo.items():
                if args.only and job not in args.only:
                    continue
                order = (
                    list(SETTINGS) if rnd % 2 == 0 else list(SETTINGS)[::-1]
                )  # interleaved, alternating who goes first
                for setting in order:
                    r = run(command(work / "out"), {"GPT_MALLOC": SETTINGS[setting]}, during)
                    rows.append({"job": job, "setting": setting, "round": rnd, **r})
                    print(json.dumps(rows[-1]), flush=True)
    text = (
        f"# The allocator tax ({'short' if args.short else 'full'} run, {rounds} round(s))\n\n"
        f"{info['cpu']} ({info['capability']}, native bf16: {info['native_bf16']}, mkldnn bf16: "
        f"{info['mkldnn_bf16']}), {info['cores']} cores, torch {info['torch']}, load {info['load_avg']}\n\n"
        + table(rows)
    )
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"machine": info, "short": args.short, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

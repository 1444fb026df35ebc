"""Multi30k de->en as an instruction dataset: a decoder-only model pretrained from scratch, fine-tuned on
"Translate to English: ..." -> reference with the loss on the answers (masked) and on every token
(unmasked), against the encoder-decoder `multi30k_cpu` at about the same CPU time. BLEU on test_2016_flickr.

    python bench/bench_sft.py --work /tmp/sft                          # everything: about 1 h 40 min
    python bench/bench_sft.py --work W --base RUN --base-cpu S --encdec RUN --encdec-cpu S   # reuse runs

1. data: the base's text is both sides of the Multi30k training pairs, one 8192-id byte-level BPE
   (`data/prepare.py train.de train.en --tokenizer bpe`); the chat dataset renders each training
   pair as {"messages": [user "Translate to English: DE", assistant EN]} (`data/prepare.py --chat
   --tokenizer-from BASE_DATA`), val the same of the val pairs; the encoder-decoder has its own pairs
   dataset (`data/multi30k/prepare.py`).
2. runs, one thread each: base (6 layers x 256, block 128, `--base-minutes`), then the two SFTs
   (`--config sft` from the base, `--loss-on assistant` and `--loss-on all`, `--sft-iters` steps) side
   by side; the encoder-decoder (`--config multi30k_cpu`, `--encdec-minutes`). Each process's CPU
   seconds (user + sys, from the kernel's rusage) are recorded: CPU time, not wall time, is what the
   comparison holds equal, as runs that share the 2 cores get less of them per wall minute.
3. BLEU (`gpt evaluate`, sacrebleu 13a): the SFT models greedy, with --instruction
   "Translate to English: {source}"; the encoder-decoder greedy and beam 4.

Results: `sft.json` and `sft.md` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

MULTI30K = harness.SHARED_DATA / "multi30k"
INSTRUCTION = "Translate to English: {source}"
BASE_MODEL = ["--n-layer", "6", "--n-head", "4", "--n-embd", "256", "--block-size", "128", "--dropout", "0.1"]
BASE_OPTS = ["--batch-size", "32", "--learning-rate", "1e-3", "--min-lr", "1e-4", "--warmup-iters", "50"]
BASE_OPTS += ["--max-iters", "800", "--lr-decay-iters", "800", "--eval-interval", "200", "--eval-iters", "20"]


def run(cmd: list, log: Path) -> float:
    """Run a command to the end, output to `log`; its CPU seconds (user + sys of it and its children)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))} (see {log})")
    return usage.ru_utime + usage.ru_stime


def side_by_side(cmds: dict, work: Path) -> dict:
    """Run the commands at once; name -> CPU seconds of each. A run already done (its CPU seconds in
    WORK/cpu.json) is not run again, so an interrupted benchmark goes on where it stopped."""
    done_file = work / "cpu.json"
    done = json.loads(done_file.read_text()) if done_file.exists() else {}
    cmds = {name: cmd for name, cmd in cmds.items() if name not in done}
    procs = {}
    for name, cmd in cmds.items():
        f = open(work / f"{name}.log", "w")
        procs[name] = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    by_pid = {p.pid: n for n, p in procs.items()}
    while by_pid:
        pid, status, usage = os.wait4(-1, 0)
        if pid in by_pid:
            name = by_pid.pop(pid)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"failed: {name} (see {work / name}.log)")
            done[name] = usage.ru_utime + usage.ru_stime
            done_file.write_text(json.dumps(done, indent=1) + "\n")
    return done


def bleu(ckpt: Path, *extra) -> dict:
    cmd = [sys.executable, "-m", "gpt", "evaluate", "--ckpt", ckpt, "--threads", "2", "--dtype", "float32"]
    cmd += ["--source-file", MULTI30K / "test_2016_flickr.de", "--reference", MULTI30K / "test_2016_flickr.en"]
    r = subprocess.run([str(c) for c in [*cmd, *extra]], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"evaluate {ckpt} failed: {r.stderr.strip()}")
    line = r.stdout.strip()
    return {"bleu": float(line.split()[1]), "line": line}


def steps_and_val(run_dir: Path) -> dict:
    records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    return {"steps": evals[-1]["step"], "best_val": min(r["val_loss"] for r in evals)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="directory for the datasets, runs and logs")
    p.add_argument("--base", help="reuse this pretrained base run (with --base-cpu)")
    p.add_argument("--base-cpu", type=float, help="CPU seconds the reused base took")
    p.add_argument("--encdec", help="reuse this encoder-decoder run (with --encdec-cpu)")
    p.add_argument("--encdec-cpu", type=float, help="CPU seconds the reused encoder-decoder took")
    p.add_argument("--base-minutes", type=float, default=25)
    p.add_argument("--encdec-minutes", type=float, default=35)
    p.add_argument("--sft-iters", type=int, default=600)
    p.add_argument("--results", default=str(ROOT / "bench" / "results"))
    p.add_argument("--only-train", action="store_true", help="stop after training (run again to evaluate)")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    py, t0 = sys.executable, time.time()
    train = [py, "train.py", "--threads", "1", "--log-interval", "50"]

    base_data = work / "base-data"
    if not base_data.exists():
        run([py, "data/prepare.py", MULTI30K / "train.de", MULTI30K / "train.en", "--out", base_data, "--tokenizer",
             "bpe", "--vocab-size", "8192", "--block-size", "128", "--quiet"], work / "prepare-base.log")  # fmt: skip
    chat = work / "chat"
    if not chat.exists():
        rows = work / "chat-rows"
        run([py, "data/multi30k/chat.py", "--input", MULTI30K, "--out", rows, "--instruction", INSTRUCTION, "--force"],
            work / "chat-rows.log")  # fmt: skip
        run([py, "data/prepare.py", "--chat", rows / "train.jsonl", "--val-chat", rows / "val.jsonl", "--out", chat,
             "--tokenizer-from", base_data, "--block-size", "128"], work / "prepare-chat.log")  # fmt: skip
    pairs = work / "de-en"
    if not pairs.exists():
        run([py, "data/multi30k/prepare.py", "--input", MULTI30K, "--out", pairs], work / "prepare-pairs.log")

    base, cpu = Path(args.base or work / "base"), {}
    if args.base:
        cpu["base"] = args.base_cpu
    if args.encdec:
        cpu["encdec"] = args.encdec_cpu
    encdec = Path(args.encdec or work / "encdec")
    todo = {}
    if not args.base:
        todo["base"] = [*train, "--data", base_data, "--out-dir", base, *BASE_MODEL, *BASE_OPTS, "--max-minutes",
                        args.base_minutes]  # fmt: skip
    if not args.encdec:
        todo["encdec"] = [*train, "--config", "multi30k_cpu", "--data", pairs, "--out-dir", encdec, "--max-minutes",
                          args.encdec_minutes]  # fmt: skip
    cpu.update({k: v for k, v in side_by_side(todo, work).items() if k in todo} if todo else {})
    sft = {
        f"sft-{on}": [*train, "--config", "sft", "--init-from", base, "--data", chat, "--out-dir", work / f"sft-{on}",
                      "--loss-on", on, "--max-iters", args.sft_iters, "--max-minutes", "0"]
        for on in ("assistant", "all")
    }  # fmt: skip
    cpu.update({k: v for k, v in side_by_side(sft, work).items() if k.startswith("sft")})
    if args.only_train:
        return 0

    results = {"machine": harness.machine(), "settings": vars(args), "cpu_seconds": cpu, "runs": {}}
    for name in ("base", "encdec", "sft-assistant", "sft-all"):
        results["runs"][name] = steps_and_val(encdec if name == "encdec" else base if name == "base" else work / name)
    scores = {
        "sft-assistant": bleu(work / "sft-assistant", "--instruction", INSTRUCTION),
        "sft-all": bleu(work / "sft-all", "--instruction", INSTRUCTION),
        "encdec greedy": bleu(encdec),
        "encdec beam 4": bleu(encdec, "--beam-size", "4"),
    }
    results["bleu"] = scores
    results["wall_seconds"] = time.time() - t0
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "sft.md").write_text(report(results))
    print(report(results))
    return 0


def report(r: dict) -> str:
    m, cpu, runs, b = r["machine"], r["cpu_seconds"], r["runs"], r["bleu"]
    sft_cpu = {k: cpu["base"] + cpu[k] for k in ("sft-assistant", "sft-all")}
    lines = [
        "# Multi30k de->en: chat SFT of a decoder-only model vs the encoder-decoder",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, capability {m['capability']}, native bf16 {m['native_bf16']}; "
        f"torch {m['torch']}. Every run one thread; CPU seconds are the process's user + sys.",
        "",
        "| model | training | CPU min | steps | best val loss | BLEU test_2016_flickr |",
        "|---|---|---|---|---|---|",
        f"| SFT, loss on the answers | base + `--config sft --loss-on assistant` | {sft_cpu['sft-assistant'] / 60:.1f} "
        f"| {runs['base']['steps']} + {runs['sft-assistant']['steps']} | {runs['sft-assistant']['best_val']:.4f} "
        f"(masked) | **{b['sft-assistant']['bleu']:.2f}** (greedy) |",
        f"| SFT, loss on every token | base + `--config sft --loss-on all` | {sft_cpu['sft-all'] / 60:.1f} "
        f"| {runs['base']['steps']} + {runs['sft-all']['steps']} | {runs['sft-all']['best_val']:.4f} (all tokens) "
        f"| {b['sft-all']['bleu']:.2f} (greedy) |",
        f"| encoder-decoder | `--config multi30k_cpu` | {cpu['encdec'] / 60:.1f} | {runs['encdec']['steps']} "
        f"| {runs['encdec']['best_val']:.4f} (smoothed) | {b['encdec greedy']['bleu']:.2f} greedy, "
        f"{b['encdec beam 4']['bleu']:.2f} beam 4 |",
        "",
        f"Base: {runs['base']['steps']} steps, best val {runs['base']['best_val']:.4f}, "
        f"{cpu['base'] / 60:.1f} CPU min. Evaluation lines:",
        "",
        *(f"- {k}: `{v['line']}`" for k, v in b.items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

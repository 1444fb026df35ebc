"""Multi30k de->en: BLEU of the encoder-decoder Transformer against wall-clock training time.

    python bench/bench_seq2seq.py                                    # 60 minutes; BLEU at 10/20/30/45/60
    python bench/bench_seq2seq.py --minutes 1 --at 0.5 --limit 50    # smoke test, a few minutes in all
    python bench/bench_seq2seq.py --minutes 30 -- --eval-interval 250   # after --: more train.py options
    python bench/bench_seq2seq.py --ckpt RUN/last.pt --label "after"    # one checkpoint, no training
    python bench/bench_seq2seq.py --ckpt RUN/last.pt --sweep 0,0.6,1,1.5,2   # choose alpha on val

1. prepare: `data/multi30k/prepare.py` (byte-level BPE of 8192 ids over both languages) into a
   temporary directory (or `--data DIR`, an existing pairs dataset).
2. train: `train.py --config multi30k_cpu --data DIR --out-dir RUN --max-minutes M`, which stops
   cleanly after M minutes (evaluates, saves last.pt). While it runs, the benchmark polls the run
   directory and, at each time of `--at` (minutes since launch), hard-links the current `last.pt`
   (the checkpoint of the latest evaluation) aside; the time it was trained for is read from the
   run's log.jsonl. The checkpoint at the end of training is always taken. If the trainer is still
   running 5 minutes past its budget, it gets SIGTERM (it saves and stops on it).
3. evaluate, after training (nothing competes with it for the CPU): corpus BLEU (sacrebleu's
   default 13a tokenization, the same as `gpt evaluate`) of each checkpoint on
   test_2016_flickr (1000 sentences, `--limit N` for fewer), greedy and beam search (`--beam-size`,
   GNMT length penalty `--length-penalty`), the length ratio (sacrebleu's hypothesis / reference
   length; below 1 costs the brevity penalty BP), ROUGE-1/2/L (rouge-score's F-measures, mean over the
   sentences, as `gpt evaluate`; in seq2seq.json) and decoding speed in sentences/s.

`--ckpt FILE --label TEXT` skips 1 and 2: it scores one existing checkpoint the same way and files
the result under "decoding" in the existing seq2seq.json, replacing an entry of the same label (how
a change to the decoder is compared before / after on the same checkpoint).

`--ckpt FILE --sweep ALPHAS` chooses the length penalty on the validation split, never on a test set
(a setting tuned on the test set flatters the figure reported on it): beam search at each alpha on
val (BLEU, length ratio, ROUGE-1/2/L), the best val BLEU wins (ties: the length ratio closest to 1,
then the smaller alpha), and only then is the test set decoded, greedy and at the chosen alpha.
Into `seq2seq-val.{json,md}`; gpt.infer.translate.DEFAULT_LENGTH_PENALTY is that choice.

Results: `bench/results/seq2seq.json` (everything, the val-loss curve included) and
`bench/results/seq2seq.md` (the tables); `--results DIR` writes them elsewhere. `--split val`
scores the validation split instead of the test set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))  # harness.py, also when this file is loaded by path (tests)

import harness  # noqa: E402
from seq2seq_tables import render, render_sweep  # noqa: E402

from gpt import fsutil  # noqa: E402
from gpt.cli import run_main  # noqa: E402
from gpt.infer.translate import DEFAULT_LENGTH_PENALTY  # noqa: E402

SHARED = harness.SHARED_DATA
MULTI30K = SHARED / "multi30k"
TEST = "test_2016_flickr"
VAL = "val"
GRACE_S = 300  # past the budget before the trainer is sent SIGTERM


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60, help="training budget, train.py --max-minutes (default: 60)")
    p.add_argument(
        "--at",
        default="10,20,30,45,60",
        help="minutes after launch at which to take the latest checkpoint; those at or past --minutes "
        "are the end of training (default: 10,20,30,45,60)",
    )
    p.add_argument("--config", default="multi30k_cpu", help="train.py --config (default: multi30k_cpu)")
    p.add_argument("--data", help="an existing pairs dataset (default: prepare Multi30k de-en, bpe 8192, in --work)")
    p.add_argument("--input", default=str(MULTI30K), help=f"raw Multi30k files (default: {MULTI30K})")
    p.add_argument(
        "--work", help="directory for the dataset, run and checkpoints (default: a temporary one, removed at the end)"
    )
    p.add_argument(
        "--split",
        choices=(TEST, VAL),
        help=f"the Multi30k split to score (default: {TEST}; {VAL} with --sweep, which refuses a test set)",
    )
    p.add_argument("--limit", type=int, help="evaluate on the first N sentences of each split (default: all)")
    p.add_argument("--beam-size", type=int, default=4, help="beam size of the beam-search column (default: 4)")
    p.add_argument(
        "--length-penalty",
        type=float,
        default=DEFAULT_LENGTH_PENALTY,
        help=f"GNMT alpha for beam search (default: {DEFAULT_LENGTH_PENALTY:g})",
    )
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together (default: 64)")
    p.add_argument("--eval-threads", type=int, default=None, help="torch threads for evaluation (default: torch's)")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"), help="where seq2seq.{json,md} go")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between looks at the run directory")
    p.add_argument("--ckpt", help='evaluate this checkpoint only (no training) into seq2seq.json\'s "decoding"')
    p.add_argument(
        "--label", help="with --ckpt: the row's name, e.g. what the decoder is (required with --ckpt, but for --sweep)"
    )
    p.add_argument("--note", default="", help="with --ckpt: a remark kept with the row (machine, load)")
    p.add_argument(
        "--sweep",
        help="with --ckpt: length penalties (alphas, comma-separated) to compare on the val split; writes "
        "seq2seq-val.{json,md} with the chosen one and its test figure",
    )
    args = p.parse_args(argv)
    try:
        args.at = sorted({float(a) for a in args.at.split(",") if a.strip()})
    except ValueError:
        p.error(f"--at must be minutes separated by commas, got {args.at!r}")
    if args.minutes <= 0 or any(a <= 0 for a in args.at):
        p.error("--minutes and the --at times must be > 0")
    if args.sweep is not None:
        try:
            args.sweep = sorted({float(a) for a in args.sweep.split(",") if a.strip()})
        except ValueError:
            p.error(f"--sweep must be length penalties separated by commas, e.g. 0,0.6,1,1.5,2, got {args.sweep!r}")
        if not args.sweep or not args.ckpt:
            p.error("--sweep needs --ckpt FILE and at least one length penalty, e.g. --sweep 0,0.6,1,1.5,2")
        if args.split not in (None, VAL):
            p.error(f"--sweep chooses the length penalty on --split {VAL}, never on a test set ({args.split})")
        args.split = VAL
    elif bool(args.ckpt) != bool(args.label):
        p.error("--ckpt and --label go together: the checkpoint to evaluate and the name of its row")
    args.split = args.split or TEST
    return args, extra


# ---- pieces (importable: tests run them on tiny checkpoints) ---------------------------------------


def snapshot_times(at: list[float], minutes: float) -> list[float]:
    """The times to snapshot while training runs; the end of training is always taken too."""
    return [a for a in sorted(at) if a < minutes]


def take_snapshot(run_dir: Path, dest: Path) -> dict | None:
    """Hard-link (or copy) the run's last.pt to `dest`; its step and val loss, or None if there is none yet.

    last.pt is replaced by an atomic rename, so the link is always a whole checkpoint.
    """
    from gpt.checkpoints import loader, native

    src = run_dir / "last.pt"
    if not src.is_file():
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    native.link_or_copy(src, dest)
    meta = loader.read_meta(dest)
    return {"file": str(dest), "step": meta["step"], "val_loss": meta.get("val_loss")}


def read_log(run_dir: Path) -> list[dict]:
    path = run_dir / "log.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return records


def train_minutes(records: list[dict], step: int) -> float | None:
    """Minutes of training behind the checkpoint of `step` (the trainer's own clock, from log.jsonl)."""
    evals = [r for r in records if r.get("kind") == "eval" and r.get("step") == step and "elapsed" in r]
    return round(evals[-1]["elapsed"] / 60, 2) if evals else None


def read_split(input_dir, split: str, limit: int | None = None) -> tuple[list[str], list[str]]:
    """The first `limit` (German source, English reference) lines of a Multi30k split."""
    from gpt.data.pairs import read_lines

    return read_lines(Path(input_dir) / f"{split}.de")[:limit], read_lines(Path(input_dir) / f"{split}.en")[:limit]


def load(path, device: str = "cpu") -> tuple:
    """(model, tokenizer, bos, eos) of a seq2seq checkpoint."""
    from gpt.checkpoints.loader import load_checkpoint
    from gpt.infer.translate import check_vocab, seq2seq_ids

    model, tok, meta = load_checkpoint(path, device=device)
    check_vocab(tok, model)
    return (model, tok, *seq2seq_ids(meta))


def score(loaded: tuple, sources: list[str], references: list[str], beam_size: int, alpha: float, batch_size: int):
    """BLEU, length ratio, ROUGE-1/2/L and sentences/s of one decoding (beam_size 1: greedy)."""
    from gpt.infer.evaluate import evaluate

    model, tok, bos, eos = loaded
    r = evaluate(model, tok, sources, references, bos, eos, beam_size=beam_size, alpha=alpha, batch_size=batch_size)
    return {
        "bleu": round(r["bleu"], 2),
        "ratio": round(r["ratio"], 3),
        "bp": round(r["bp"], 3),
        "sentences_per_s": round(r["sentences_per_s"], 1),
        "seconds": round(r["seconds"], 1),
        "signature": r["signature"],
        **{k: round(r[k], 2) for k in ("rouge1", "rouge2", "rougeL")},  # rouge-score's mean F-measures x 100
        "rouge_signature": r["rouge_signature"],
        "sample": r["hypotheses"][:3],
    }


def evaluate_checkpoint(
    path,
    sources: list[str],
    references: list[str],
    beam_size: int = 4,
    alpha: float = DEFAULT_LENGTH_PENALTY,
    batch_size: int = 64,
    device: str = "cpu",
) -> dict:
    """BLEU, ROUGE-1/2/L and sentences/s of one checkpoint: greedy, then beam search."""
    loaded = load(path, device)
    return {
        name: score(loaded, sources, references, k, alpha, batch_size)
        for name, k in (("greedy", 1), ("beam", beam_size))
    }


def evaluate_one(args, sources: list[str], references: list[str], results: Path) -> dict:
    """--ckpt: score one checkpoint and file it under "decoding" in results/seq2seq.json (same label replaced)."""
    from gpt.checkpoints import loader

    meta = loader.read_meta(args.ckpt)
    entry = {
        "label": args.label,
        "checkpoint": str(args.ckpt),
        "step": meta.get("step"),
        "val_loss": meta.get("val_loss"),
        "test_set": args.split,
        "sentences": len(sources),
        "beam_size": args.beam_size,
        "length_penalty": args.length_penalty,
        "note": args.note,
        **evaluate_checkpoint(args.ckpt, sources, references, args.beam_size, args.length_penalty, args.batch_size),
    }
    path = results / "seq2seq.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result["decoding"] = [e for e in result.get("decoding", []) if e["label"] != args.label] + [entry]
    return result


CHOICE_RULE = "the best val BLEU; ties: the length ratio closest to 1, then the smaller alpha"


def choose_alpha(rows: list[dict]) -> float:
    """The length penalty of the sweep row that CHOICE_RULE picks (BLEU as reported, to 2 decimals)."""

    def key(r):  # the ratio's distance from 1 as reported, to 3 decimals: 0.98 and 1.02 tie
        return r["bleu"], -round(abs(r["ratio"] - 1), 3), -r["length_penalty"]

    return max(rows, key=key)["length_penalty"]


def sweep(args, argv=None) -> dict:
    """--sweep: beam search at each alpha on the val split, the choice, then the test set at that alpha only."""
    from gpt.checkpoints import loader

    meta = loader.read_meta(args.ckpt)
    loaded = load(args.ckpt)
    sources, references = read_split(args.input, args.split, args.limit)  # parse_args: always val
    test_sources, test_references = read_split(args.input, TEST, args.limit)  # read now: a missing file fails fast
    k, batch = args.beam_size, args.batch_size
    print(f"sweeping alpha {args.sweep} at beam {k} on {len(sources)} {args.split} sentences ...", flush=True)
    rows = []
    for a in args.sweep:
        rows.append({"length_penalty": a, **score(loaded, sources, references, k, a, batch)})
        print(f"  alpha {a:g}: BLEU {rows[-1]['bleu']:.2f}, length ratio {rows[-1]['ratio']:.3f}", flush=True)
    chosen = choose_alpha(rows)  # before the test set is decoded at all
    print(f"chose alpha {chosen:g}; decoding {len(test_sources)} {TEST} sentences ...", flush=True)
    argv = sys.argv[1:] if argv is None else argv
    return {
        "benchmark": "Multi30k de->en, beam search's length penalty chosen on the validation split",
        "command": " ".join(["bench/bench_seq2seq.py", *argv]),
        "checkpoint": str(args.ckpt),
        "step": meta.get("step"),
        "val_loss": meta.get("val_loss"),
        "split": args.split,
        "sentences": len(sources),
        "beam_size": k,
        "greedy": score(loaded, sources, references, 1, 0.0, batch),
        "sweep": rows,
        "rule": CHOICE_RULE,
        "chosen": chosen,
        "test": {
            "test_set": TEST,
            "sentences": len(test_sources),
            "length_penalty": chosen,
            "greedy": score(loaded, test_sources, test_references, 1, 0.0, batch),
            "beam": score(loaded, test_sources, test_references, k, chosen, batch),
        },
        "machine": harness.machine(),
    }


def write_sweep(result: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    fsutil.write_text(results / "seq2seq-val.json", json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    text = render_sweep(result)
    fsutil.write_text(results / "seq2seq-val.md", text)
    print(text, end="")
    print(f"wrote {results / 'seq2seq-val.json'} and {results / 'seq2seq-val.md'}")


# ---- the run ------------------------------------------------------------------------------------------


def prepare(args, work: Path) -> tuple[Path, float]:
    if args.data:
        return Path(args.data), 0.0
    out = work / "multi30k-de-en"
    t0 = time.time()
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "data" / "multi30k" / "prepare.py"),
            "--input",
            args.input,
            "--out",
            str(out),
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "8192",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if res.returncode:
        raise SystemExit(f"error: preparing Multi30k failed: {res.stderr.strip()}")
    print(res.stdout.strip(), flush=True)
    return out, time.time() - t0


def train(args, extra: list[str], data: Path, work: Path) -> tuple[list[dict], dict, list[str]]:
    """Run train.py for the budget, snapshotting last.pt on schedule; (snapshots, timing, command)."""
    run_dir, snaps_dir = work / "run", work / "snapshots"
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        args.config,
        "--data",
        str(data),
        "--out-dir",
        str(run_dir),
        "--max-minutes",
        f"{args.minutes:g}",
        *extra,
    ]
    print("$ " + " ".join(cmd[1:]), flush=True)
    log = open(work / "train.out", "w")
    t0 = time.time()
    proc = subprocess.Popen([*cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    pending, snaps, termed = snapshot_times(args.at, args.minutes), [], False
    try:
        while proc.poll() is None:
            elapsed = time.time() - t0
            while pending and elapsed >= 60 * pending[0]:
                at = pending.pop(0)
                snap = take_snapshot(run_dir, snaps_dir / f"{at:g}min.pt") or {"step": None}
                snaps.append({"minutes": at, "wall_s": round(elapsed, 1), **snap})
                print(
                    f"  {at:g} min: " + (f"step {snap['step']}" if snap["step"] is not None else "no checkpoint yet"),
                    flush=True,
                )
            if not termed and elapsed > 60 * args.minutes + GRACE_S:
                print(f"  the trainer is {GRACE_S} s past its budget: SIGTERM", flush=True)
                proc.send_signal(signal.SIGTERM)  # it finishes the step, saves last.pt and stops
                termed = True
            time.sleep(args.poll)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise
    finally:
        log.close()
    wall = time.time() - t0
    if proc.returncode:
        tail = (work / "train.out").read_text()[-3000:]
        raise SystemExit(f"error: train.py exited with {proc.returncode}:\n{tail}")
    final = take_snapshot(run_dir, snaps_dir / "end.pt")
    if final is None:
        raise SystemExit(f"error: train.py left no last.pt in {run_dir}; see {work / 'train.out'}")
    snaps.append({"minutes": round(wall / 60, 2), "wall_s": round(wall, 1), "end": True, **final})
    return snaps, {"train_wall_s": round(wall, 1)}, cmd[1:]


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    import torch

    results = Path(args.results)
    if args.sweep:
        if args.eval_threads:
            torch.set_num_threads(args.eval_threads)
        write_sweep(sweep(args, argv), results)
        return 0
    sources, references = read_split(args.input, args.split, args.limit)
    if args.ckpt:
        if args.eval_threads:
            torch.set_num_threads(args.eval_threads)
        write_results(evaluate_one(args, sources, references, results), results)
        return 0
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_seq2seq-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        data, prepare_s = prepare(args, work)
        snaps, timing, cmd = train(args, extra, data, work)
        records = read_log(work / "run")
        if args.eval_threads:
            torch.set_num_threads(args.eval_threads)
        rows, done = [], {}
        for snap in snaps:
            row = dict(snap)
            if snap.get("step") is not None:
                row["train_minutes"] = train_minutes(records, snap["step"])
                if snap["step"] not in done:  # the same checkpoint twice (no eval in between): evaluate once
                    print(f"evaluating step {snap['step']} on {len(sources)} sentences ...", flush=True)
                    done[snap["step"]] = evaluate_checkpoint(
                        snap["file"], sources, references, args.beam_size, args.length_penalty, args.batch_size
                    )
                row.update(done[snap["step"]])
            row.pop("file", None)
            rows.append(row)
        result = {
            "benchmark": "Multi30k de->en, BLEU against wall-clock training time",
            "command": " ".join(cmd),
            "config": args.config,
            "minutes": args.minutes,
            "test_set": args.split,
            "sentences": len(sources),
            "beam_size": args.beam_size,
            "length_penalty": args.length_penalty,
            "prepare_s": round(prepare_s, 1),
            **timing,
            "rows": rows,
            "val_curve": [
                (r["step"], round(r["val_loss"], 4), round(r.get("elapsed", 0) / 60, 2))
                for r in records
                if r.get("kind") == "eval"
            ],
            "train_summary": next((r for r in reversed(records) if r.get("kind") == "summary"), None),
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "eval_threads": torch.get_num_threads(),
                "load_average": os.getloadavg(),
            },
        }
        write_results(result, results)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def write_results(result: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    fsutil.write_text(results / "seq2seq.json", json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    text = render(result)
    fsutil.write_text(results / "seq2seq.md", text)
    print(text, end="")
    print(f"wrote {results / 'seq2seq.json'} and {results / 'seq2seq.md'}")


if __name__ == "__main__":
    sys.exit(run_main(main))  # a missing file or a bad checkpoint: one `error: ...` line

"""A sweep of the main job's learning rate, warm-up and weight decay for a fixed budget of CPU minutes, with
the best found against today's preset (issue 44): `gpt sweep` as a user runs it.

    python bench/bench_sweep.py --minutes 30        # the measurement (quiet machine): bench/results/sweep.{json,md}
    python bench/bench_sweep.py --minutes 1 --quick # a smoke run: short jobs, results in a scratch file

The study: `--config shakespeare_char_fast_cpu` (today's preset of the main job) on tiny-shakespeare's
characters, its own 325-step schedule, evaluating every 65 steps over the whole val split so the median pruner
can stop a bad trial early; the objective is a trial's best val loss. Searched: learning_rate (log, 1e-3..3e-2;
the AdamW parameters, Muon's matrices keep muon_lr), warmup_iters (0..100) and weight_decay (0..0.3). Trial 0 is
the preset's own values ([[enqueue]]), so the study's best is measured against it under the same conditions.
No trial starts after `--minutes` (the one running then finishes). Then both the best and the preset train
again with `--seeds` other seeds (one final evaluation over the whole val split, as the preset runs), so the
gain is not one seed's luck. Results: the machine, the space, every trial (state, values, val loss, seconds),
the best against the preset, the confirmation runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = harness.ROOT
RESULTS = ROOT / "bench" / "results" / "sweep"
PRESET = "shakespeare_char_fast_cpu"
PRESET_VALUES = {"learning_rate": 6e-3, "warmup_iters": 20, "weight_decay": 0.1}  # the preset's, as its TOML says
SPACE = {
    "learning_rate": "{ low = 1e-3, high = 3e-2, log = true }",
    "warmup_iters": "{ low = 0, high = 100 }",
    "weight_decay": "{ low = 0.0, high = 0.3 }",
}
QUICK = {"max_iters": 30, "lr_decay_iters": 30, "eval_interval": 10, "eval_iters": 4}  # --quick: short jobs


def space_toml(data: Path, quick: bool) -> str:
    train = {"config": PRESET, "data": str(data), "plot": False, "eval_interval": 65, **(QUICK if quick else {})}
    lines = ["[study]", "trials = 1000", 'metric = "val_loss"', "startup_trials = 5", "seed = 0", "", "[train]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in train.items()]
    lines += ["", "[space]", *(f"{k} = {v}" for k, v in SPACE.items()), "", "[[enqueue]]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in PRESET_VALUES.items()]
    return "\n".join(lines) + "\n"


def confirm(data: Path, work: Path, values: dict, seed: int, quick: bool) -> float:
    """One clean run of the preset with `values` at `seed`: its final val loss (whole val split)."""
    out = work / f"confirm-{'-'.join(f'{v:.4g}' for v in values.values())}-{seed}"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**(QUICK if quick else {}), **values}.items()]
    cmd = [sys.executable, "train.py", "--config", PRESET, "--data", data, "--out-dir", out, "--seed", seed]
    run = harness.launch([*cmd, *flags, "--no-plot", "--force"], ROOT, out.with_suffix(".log"), timeout=1800)
    if run["returncode"]:
        raise SystemExit(f"error: {' '.join(map(str, cmd))} failed:\n{harness.tail(run)}")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return round([r for r in records if r["kind"] == "eval"][-1]["val_loss"], 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="the sweep's budget: no trial starts after it")
    p.add_argument("--seeds", type=int, nargs="*", default=[1, 2], help="confirmation seeds (default 1 2)")
    p.add_argument("--quick", action="store_true", help="short jobs, results in a scratch file")
    p.add_argument("--out", help=f"results, .md and .json (default {RESULTS}; with --quick a scratch file)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    data = work / "char"
    tiny = harness.SHARED_DATA / "tinyshakespeare.txt"
    subprocess.run(
        [sys.executable, "data/shakespeare_char/prepare.py", "--input", tiny, "--out", data], cwd=ROOT, check=True
    )
    space = work / "space.toml"
    space.write_text(space_toml(data, args.quick), encoding="utf-8")
    info = harness.machine()
    t0 = time.time()
    cmd = [sys.executable, "-m", "gpt", "sweep", space, "--dir", work / "sweep", "--minutes", args.minutes]
    run = harness.launch(cmd, ROOT, work / "sweep.log", timeout=60 * args.minutes + 1800)
    if run["returncode"]:
        raise SystemExit(f"error: the sweep failed:\n{harness.tail(run)}")
    sweep_seconds = time.time() - t0
    sys.path.insert(0, str(ROOT))
    import optuna

    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{work / 'sweep' / 'study.db'}")
    trials = [
        {
            "number": t.number,
            "state": t.state.name.lower(),
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in t.params.items()},
            "val_loss": round(t.value, 4) if t.value is not None else None,
            "last_step": max(t.intermediate_values) if t.intermediate_values else None,
            "seconds": round(t.duration.total_seconds(), 2) if t.duration else None,
        }
        for t in study.get_trials()
    ]
    best = study.best_trial
    preset = next(t for t in trials if t["number"] == 0)
    result = {
        "machine": info,
        "budget_minutes": args.minutes,
        "quick": args.quick,
        "sweep_seconds": round(sweep_seconds, 1),
        "config": PRESET,
        "space": SPACE,
        "trials": trials,
        "counts": {s: sum(t["state"] == s for t in trials) for s in ("complete", "pruned", "fail")},
        "preset": {**PRESET_VALUES, "val_loss": preset["val_loss"]},
        "best": {"number": best.number, **best.params, "val_loss": round(best.value, 4)},
    }
    if args.seeds:
        both = {"preset": PRESET_VALUES, "best": dict(best.params)}
        rows = {name: {s: confirm(data, work, v, s, args.quick) for s in args.seeds} for name, v in both.items()}
        result["confirm"] = {
            name: {"seeds": list(args.seeds), "val_loss": list(r.values()), "median": statistics.median(r.values())}
            for name, r in rows.items()
        }
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}, indent=1), flush=True)
    out = Path(args.out or (Path(tempfile.gettempdir()) / "sweep-quick" if args.quick else RESULTS))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(report(result))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def report(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"# A sweep of the main job ({r['config']}): learning rate, warm-up, weight decay",
        "",
        f"{m['date']}, {m['cpu']} ({m['cores']} cores, {m['capability']}), load {m['load_avg']}, commit {m['commit']}; "
        f"budget {r['budget_minutes']:g} min, the sweep took {r['sweep_seconds']:g} s"
        + (" (--quick: short jobs, not a measurement)" if r["quick"] else ""),
        "",
        f"Trials: {r['counts']['complete']} complete, {r['counts']['pruned']} pruned, {r['counts']['fail']} failed.",
        "",
        "| run | learning_rate | warmup_iters | weight_decay | val loss |",
        "|---|---|---|---|---|",
    ]
    for name in ("preset", "best"):
        v = r[name]
        lines.append(
            f"| {name} | {v['learning_rate']:.4g} | {v['warmup_iters']} | {v['weight_decay']:.4g} | {v['val_loss']} |"
        )
    if "confirm" in r:
        lines += ["", "Again at other seeds (one final evaluation, as the preset runs):", ""]
        lines += ["| run | seeds | val loss | median |", "|---|---|---|---|"]
        for name, c in r["confirm"].items():
            lines.append(
                f"| {name} | {' / '.join(map(str, c['seeds']))} | {' / '.join(map(str, c['val_loss']))} | {c['median']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

"""The modern small-GPT recipe, measured here (issue 35): each option alone and all of them together
against today's `shakespeare_char_cpu`, and the fast preset against today's config, interleaved runs.

    python bench/bench_recipe.py --final     # the preset's goal, both CPU classes, nanoGPT, samples (~8 min quiet)
    python bench/bench_recipe.py             # the options table: main job + BPE job, 3 seeds (~15 min quiet)
    python bench/bench_recipe.py --quick     # a smoke run: 1 seed, short jobs, results in a scratch file

Options (the table): each variant is `--config shakespeare_char_cpu` plus its flags (OPTIONS below; an
option is one line there), seeds interleaved with the variants' order rotating each round.
- main job, steps to target: a search run that evaluates every 25 steps over a fixed val subset (4 x 256
  sequences, `--eval-iters 4`; batches are a function of the seed and step, so evaluating does not change
  training) over the config's own 400-step schedule; the first evaluation at or under 1.88. Load-free.
- main job, val at a fixed time budget: the same schedule cut by `--max-minutes` (train.py stops cleanly and
  evaluates the whole val split), so a variant with cheaper steps gets further down the schedule.
- BPE job: tiny-shakespeare with an own 4k BPE (`data/prepare.py --tokenizer bpe --vocab-size 4096`), the
  same config and flags cut by `--max-minutes`; val bits per byte from log.jsonl.
Final (the preset's goal): clean runs, one process each, that train the config's fixed step count and
evaluate once at the end over the whole val split, timed from launch to that evaluation (bench_train.py's
method): today's config with glibc's own allocator (GPT_MALLOC=default: the baseline), today's config
tuned, and the preset, 3 seeds, on this CPU and as a CPU without native bf16 (GPT_CPU_BF16=0: auto ->
float32, float32 Newton-Schulz). Then nanoGPT's own CPU recipe once (bench_train.py's speedrun) for the
ratio, and a sample of each config (seed 1337 runs, same prompt, same sampling seed).
Results: bench/results/recipe.{json,md} with the machine (CPU, capability, native/mkldnn bf16, load).
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
RESULTS = ROOT / "bench" / "results" / "recipe"
TARGET = 1.88
TODAY, PRESET = "shakespeare_char_cpu", "shakespeare_char_fast_cpu"
SEEDS = (1337, 1, 2)
OPTIONS = {  # name -> extra train.py flags; a new option is one line here
    "relu2": ["--activation", "relu2"],
    "qk_norm": ["--qk-norm", "true"],
    "zero_init_proj": ["--zero-init-proj", "true"],
    "logit_softcap": ["--logit-softcap", "15"],
    "untied_head": ["--untied-head", "true"],
    "x0_skip": ["--x0-skip", "true"],
    "value_embeds": ["--value-embeds", "true"],
    "muon_cautious_wd": ["--muon-cautious-wd", "true"],
    "wd_schedule": ["--wd-schedule", "linear"],
}
SEARCH = ["--eval-interval", "25", "--eval-iters", "4", "--eval-batch-size", "256"]
COMMON = ["--no-plot", "--force"]
QUICK = ["--max-iters", "30", "--lr-decay-iters", "30", "--warmup-iters", "5"]  # --quick: short jobs
CLASSES = {"native bf16 (this CPU)": {}, "no native bf16 (GPT_CPU_BF16=0)": {"GPT_CPU_BF16": "0"}}


def prepare(work: Path, bpe: bool = True) -> dict[str, Path]:
    """The main job's characters and the BPE job's own 4k BPE, prepared as a user does."""
    py, tiny = sys.executable, harness.SHARED_DATA / "tinyshakespeare.txt"
    data = {"char": work / "char", "bpe": work / "bpe"}
    steps = [[py, "data/shakespeare_char/prepare.py", "--input", tiny, "--out", data["char"]]]
    if bpe:
        steps.append([py, "data/prepare.py", tiny, "--out", data["bpe"], "--tokenizer", "bpe", "--vocab-size", 4096])
        steps[-1].append("--quiet")
    for cmd in steps:
        subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, capture_output=True)
    return data


def train(data: Path, out: Path, flags: list, env: dict | None = None) -> dict:
    """One train.py process: its evaluations (step, val loss, val bpb, seconds since launch), seconds from
    launch to the last evaluation and to the process's end, and the load average when it ended."""
    cmd = [sys.executable, "train.py", "--data", data, "--out-dir", out, *flags, *COMMON]
    run = harness.launch(cmd, ROOT, out.with_suffix(".log"), timeout=1200, env=env)
    if run["returncode"]:
        raise SystemExit(f"error: {' '.join(map(str, cmd))} failed:\n{harness.tail(run)}")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evals = [
        (r["step"], r["val_loss"], r.get("val_bpb"), r["time"] - run["t0"]) for r in records if r["kind"] == "eval"
    ]
    return {
        "evals": [(s, round(v, 4), round(b, 4) if b else None, round(t, 2)) for s, v, b, t in evals],
        "seconds_to_last_eval": round(evals[-1][3], 2),
        "process_seconds": round(run["seconds"], 2),
        "load_1min": round(os.getloadavg()[0], 2),
    }


def steps_to_target(run: dict) -> int | None:
    return next((step for step, val, _, _ in run["evals"] if val <= TARGET), None)


def variants(only: list | None) -> dict[str, list]:
    """today, each option alone, and all of them together: name -> flags."""
    chosen = {k: v for k, v in OPTIONS.items() if not only or k in only}
    combined = [flag for flags in chosen.values() for flag in flags]
    return {"today": [], **chosen, **({"all options": combined} if len(chosen) > 1 else {})}


def options_table(data: dict, work: Path, seeds, budget_min: float, bpe_budget_min: float, quick: bool, only) -> list:
    """Rows: variant, seed, job, measurement. Interleaved: each seed runs every variant, in a rotated order."""
    base = ["--config", TODAY] + (QUICK if quick else [])
    todo = variants(only)
    rows = []
    for i, seed in enumerate(seeds):
        names = list(todo)[i % len(todo) :] + list(todo)[: i % len(todo)]
        for name in names:
            flags = [*base, *todo[name], "--seed", str(seed)]
            out = work / f"{name.replace(' ', '_')}-{seed}"
            search = train(data["char"], out.with_name(out.name + "-search"), [*flags, *SEARCH])
            budget = train(data["char"], out.with_name(out.name + "-budget"), [*flags, "--max-minutes", budget_min])
            bpe = train(data["bpe"], out.with_name(out.name + "-bpe"), [*flags, "--max-minutes", bpe_budget_min])
            rows.append(
                {
                    "variant": name,
                    "flags": todo[name],
                    "seed": seed,
                    "steps_to_target": steps_to_target(search),
                    "search_final_val_subset": search["evals"][-1][1],
                    "val_at_budget": budget["evals"][-1][1],
                    "steps_at_budget": budget["evals"][-1][0],
                    "bpe_val_bpb_at_budget": bpe["evals"][-1][2],
                    "bpe_steps_at_budget": bpe["evals"][-1][0],
                    "load_1min": [search["load_1min"], budget["load_1min"], bpe["load_1min"]],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def final(data: dict, work: Path, seeds, quick: bool, nanogpt: bool) -> dict:
    """Clean runs to the config's fixed step count (one final evaluation), interleaved per seed and class."""
    extra = QUICK if quick else []
    runs = {
        "today, GPT_MALLOC=default": (TODAY, {"GPT_MALLOC": "default"}),
        "today": (TODAY, {}),
        "preset": (PRESET, {}),
    }
    rows = []
    for cls, cls_env in CLASSES.items():
        for i, seed in enumerate(seeds):
            order = list(runs) if i % 2 == 0 else list(runs)[::-1]
            for name in order:
                config, env = runs[name]
                out = work / f"final-{len(rows)}"
                r = train(data["char"], out, ["--config", config, "--seed", str(seed), *extra], {**cls_env, **env})
                step, val = r["evals"][-1][:2]
                rows.append({"class": cls, "run": name, "seed": seed, "step": step, "val_loss": val, "dir": str(out)})
                rows[-1].update(seconds=r["seconds_to_last_eval"], process_seconds=r["process_seconds"])
                rows[-1]["load_1min"] = r["load_1min"]
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for cls in CLASSES:
        med = {n: statistics.median(r["seconds"] for r in rows if r["class"] == cls and r["run"] == n) for n in runs}
        preset_vals = [r["val_loss"] for r in rows if r["class"] == cls and r["run"] == "preset"]
        summary[cls] = {
            "median_seconds": {n: round(s, 2) for n, s in med.items()},
            "preset_over_baseline": round(med["preset"] / med["today, GPT_MALLOC=default"], 3),
            "today_tuned_over_baseline": round(med["today"] / med["today, GPT_MALLOC=default"], 3),
            "preset_all_seeds_at_target": all(v <= TARGET for v in preset_vals),
            "preset_over_baseline_by_seed": by_seed(rows, cls, seeds),  # neighbours in time: less drift
        }
    result = {"runs": rows, "summary": summary}
    if nanogpt:
        import bench_train  # the speedrun's nanoGPT method (imported here: it pulls in gpt.runtime at import)

        nano = bench_train.nanogpt_time_to_target(harness.nanogpt_copy(work), work)
        theirs = nano["seconds_to_target"] or nano["seconds_to_last_eval"]
        result["nanogpt"] = {k: v for k, v in nano.items() if k != "evals"}
        for cls in CLASSES:
            med = summary[cls]["median_seconds"]
            summary[cls]["speedup_vs_nanogpt"] = {n: round(theirs / s, 2) for n, s in med.items()}
    first = {r["run"]: r["dir"] for r in rows if r["seed"] == seeds[0] and r["class"] == next(iter(CLASSES))}
    result["samples"] = {n: sample(Path(first[n])) for n in ("today", "preset")}
    return result


def by_seed(rows: list, cls: str, seeds) -> list:
    """preset / baseline seconds of each seed's interleaved runs."""
    sec = {(r["run"], r["seed"]): r["seconds"] for r in rows if r["class"] == cls}
    return [round(sec["preset", s] / sec["today, GPT_MALLOC=default", s], 3) for s in seeds]


def sample(ckpt: Path, prompt: str = "ROMEO:") -> str:
    cmd = [sys.executable, "sample.py", "--ckpt", ckpt, "--prompt", prompt, "--seed", "1337"]
    cmd += ["--num-samples", "1", "--max-new-tokens", "300"]
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def spread(values: list) -> str:
    """median (min-max); "-" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):g} ({min(values):g}-{max(values):g})"


def markdown(info: dict, rows: list, fin: dict | None, budgets: tuple) -> str:
    head = (
        f"{info['cpu']} ({info['capability']}, native bf16: {info['native_bf16']}, mkldnn bf16: "
        f"{info['mkldnn_bf16']}), {info['cores']} cores, {info.get('torch_threads', '?')} torch thread(s), torch {info['torch']}, load before {info['load_avg']}; "
        f"shared machine unless the lead's rerun says otherwise. Medians (min-max) over seeds.\n\n"
    )
    text = ["# The recipe, measured\n", head]
    if rows:
        text += [
            f"## Options against today's `{TODAY}` (val <= {TARGET}; budgets {budgets[0]:g} / {budgets[1]:g} min)\n",
            "| variant | steps to target | main val at budget | steps in budget | BPE val bpb at budget | "
            "BPE steps | seeds missing target |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in dict.fromkeys(r["variant"] for r in rows):
            rs = [r for r in rows if r["variant"] == name]
            text.append(
                f"| {name} | {spread([r['steps_to_target'] for r in rs])} | {spread([r['val_at_budget'] for r in rs])}"
                f" | {spread([r['steps_at_budget'] for r in rs])} | {spread([r['bpe_val_bpb_at_budget'] for r in rs])}"
                f" | {spread([r['bpe_steps_at_budget'] for r in rs])} | "
                f"{sum(r['steps_to_target'] is None for r in rs)} |"
            )
        text.append("")
    if fin:
        text += [
            f"## The preset `{PRESET}` against today's config (clean runs, launch to the final evaluation)\n",
            "| CPU class | run | seconds | val loss | over baseline |",
            "|---|---|---|---|---|",
        ]
        for cls, s in fin["summary"].items():
            base = s["median_seconds"]["today, GPT_MALLOC=default"]
            for name, sec in s["median_seconds"].items():
                rs = [r for r in fin["runs"] if r["class"] == cls and r["run"] == name]
                text.append(
                    f"| {cls} | {name} | {spread([r['seconds'] for r in rs])} | "
                    f"{spread([r['val_loss'] for r in rs])} | {sec / base:.2f}x |"
                )
        text.append(
            "\nPreset / baseline by seed (each seed's runs are neighbours in time): "
            + "; ".join(f"{cls}: {s.get('preset_over_baseline_by_seed')}" for cls, s in fin["summary"].items())
        )
        if "nanogpt" in fin:
            nano = fin["nanogpt"]
            text.append(
                f"\nnanoGPT's CPU recipe: {nano['seconds_to_target'] or nano['seconds_to_last_eval']} s "
                f"({'to' if nano['seconds_to_target'] else 'never reached'} val <= {TARGET}; best "
                f"{nano['best_val_loss']}); speed-up of each run: "
                + "; ".join(f"{cls}: {s['speedup_vs_nanogpt']}" for cls, s in fin["summary"].items())
            )
        text += ["\n## Samples (seed 1337 runs, `sample.py --seed 1337 --prompt ROMEO:`)\n"]
        for name, out in fin["samples"].items():
            text += [f"{name}:\n\n```\n{out}\n```\n"]
    return "\n".join(text) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--final", action="store_true", help="the preset against today's config (the goal), only")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, 30-step jobs, no nanoGPT")
    p.add_argument("--options", nargs="*", help=f"these options only (of {', '.join(OPTIONS)})")
    p.add_argument("--budget", type=float, default=0.1, help="main job's time budget, minutes (default 0.1)")
    p.add_argument("--bpe-budget", type=float, default=0.2, help="BPE job's time budget, minutes (default 0.2)")
    p.add_argument("--seeds", help="comma-separated seeds (default 1337,1,2; --quick: 1337)")
    p.add_argument("--no-nanogpt", action="store_true", help="--final without nanoGPT's run (~3 min)")
    p.add_argument("--out", help=f"results, .md and .json (default {RESULTS}; with --quick a scratch file)")
    args = p.parse_args(argv)
    unknown = set(args.options or ()) - set(OPTIONS)
    if unknown:
        p.error(f"unknown option(s) {', '.join(sorted(unknown))}: choose from {', '.join(OPTIONS)}")
    try:
        seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else SEEDS[:1] if args.quick else SEEDS
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    budgets = (args.budget / 3, args.bpe_budget / 3) if args.quick else (args.budget, args.bpe_budget)
    info = harness.machine()
    print(json.dumps(info), flush=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_recipe_") as tmp:
        work = Path(tmp)
        data = prepare(work, bpe=not args.final)
        rows = [] if args.final else options_table(data, work, seeds, *budgets, args.quick, args.options)
        fin = final(data, work, seeds, args.quick, not (args.quick or args.no_nanogpt)) if args.final else None
    result = {"machine": info, "minutes": round((time.time() - t0) / 60, 1), "quick": args.quick}
    result.update(budgets_min=budgets, options=rows, final=fin, load_after=os.getloadavg())
    text = markdown(info, rows, fin, budgets)
    print(text)
    out = Path(args.out or (Path(tempfile.gettempdir()) / "recipe-quick" if args.quick else RESULTS))
    if out.with_suffix(".json").exists():  # keep the other part (options table / final) of an earlier run
        old = json.loads(out.with_suffix(".json").read_text())
        part = "options" if args.final else "final"
        if not result[part] and old.get(part):
            result[part], result[f"{part}_machine"] = old[part], old.get(f"{part}_machine", old["machine"])
            budgets = tuple(old["budgets_min"]) if args.final else budgets
            result["budgets_min"] = budgets
        text = markdown(info, result["options"], result["final"], budgets)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Knowledge distillation on the main job: a student of the main job's size (`--config shakespeare_char_cpu`,
2 layers x 128) distilled from a teacher about 3.7x its parameters trained here, against the same student
trained alone for the same steps and for the same wall time. Val loss and bits per byte over the whole val
split (the main job's single final evaluation), seeds 0..2.

    python bench/bench_distill.py                 # teacher 1000 steps, students 400 (the main job's), 3 seeds
    python bench/bench_distill.py --quick         # teacher 300 steps, students 100, 3 seeds: a few minutes

1. data: tiny-shakespeare's characters (`data/shakespeare_char/prepare.py`), as bench_recipe.py.
2. the teacher: the main job's config at 4 layers x 176 (4 heads), --teacher-steps steps, seed 0.
3. per seed, one after another: the student alone (--steps steps); distilled (`--distill-from` the
   teacher, --alpha / --temperature); alone again for as many steps as the distilled run's training time
   would have given it (its steps x the distilled run's ms/step / the lone run's, the LR schedule
   stretched to them): the same wall time, in training steps.
Wall times are each run's launch to exit (the teacher's load and the final evaluation included) on a
machine shared with other work: they are noisy; ms/step is the train log's median over the run.

Results: `distill.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

STUDENT = ["--config", "shakespeare_char_cpu"]
TEACHER = ["--config", "shakespeare_char_cpu", "--n-layer", "4", "--n-head", "4", "--n-embd", "176"]
QUIET = ["--no-plot", "--log-interval", "10", "--device", "cpu", "--threads", "1"]
# one thread: on the 2 shared cores, 2 threads under load stalled each step by 10-20x (probe: 1-2.5 s/step
# at 2 threads against 90 ms at 1, load average 7)


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def train(data: Path, out: Path, flags: list, steps: int, seed: int) -> dict:
    """One `gpt train` run to the end: its final val loss and bits per byte, wall seconds, ms/step, params."""
    cmd = [sys.executable, "-m", "gpt", "train", "--data", data, "--out-dir", out, "--force", *QUIET, *flags]
    cmd += ["--max-iters", steps, "--lr-decay-iters", steps, "--eval-interval", steps, "--seed", seed]
    run = harness.launch(cmd, ROOT, out.parent / f"{out.name}.log", timeout=3600, env={"OMP_NUM_THREADS": "1"})
    if run["returncode"] != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{harness.tail(run)}")
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    final = [r for r in rows if r["kind"] == "eval"][-1]
    ms = [r["ms_per_step"] for r in rows if r["kind"] == "train" and r["step"] > 1]
    params = next((line for _, line in run["lines"] if "M parameters |" in line), "")
    return {
        "steps": steps,
        "val_loss": final["val_loss"],
        "val_bpb": final["val_bpb"],
        "wall_s": round(run["seconds"], 2),
        "ms_per_step": round(statistics.median(ms), 1) if ms else None,
        "params_m": float(params.split("M parameters")[0].split()[-1]) if params else None,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_distill"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--quick", action="store_true", help="teacher 300 steps, students 100")
    p.add_argument("--teacher-steps", type=int, default=1000)
    p.add_argument("--steps", type=int, default=400, help="the students' steps (the main job's 400)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=2.0)
    args = p.parse_args(argv)
    if args.quick:
        args.teacher_steps, args.steps = 300, 100
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "char"
    tiny = harness.SHARED_DATA / "tinyshakespeare.txt"
    cmd = [sys.executable, "data/shakespeare_char/prepare.py", "--input", tiny, "--out", data]
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, capture_output=True)

    teacher_dir = args.work / "teacher"
    teacher = train(data, teacher_dir, TEACHER, args.teacher_steps, 0)
    print(f"teacher: {teacher}", flush=True)
    distill = ["--distill-from", teacher_dir, "--distill-alpha", args.alpha, "--distill-temperature", args.temperature]
    seeds = {}
    for seed in args.seeds:
        alone = train(data, args.work / f"alone-{seed}", STUDENT, args.steps, seed)
        distilled = train(data, args.work / f"distilled-{seed}", STUDENT + distill, args.steps, seed)
        steps = round(args.steps * distilled["ms_per_step"] / alone["ms_per_step"])
        same_wall = train(data, args.work / f"alone-same-wall-{seed}", STUDENT, steps, seed)
        seeds[seed] = {"alone": alone, "distilled": distilled, "alone_same_wall": same_wall}
        print(f"seed {seed}: {json.dumps(seeds[seed])}", flush=True)

    def summary(key: str) -> dict:
        runs = {name: [s[name][key] for s in seeds.values()] for name in ("alone", "distilled", "alone_same_wall")}
        out = {name: harness.spread(values) for name, values in runs.items()}
        for other in ("alone", "alone_same_wall"):  # per seed: distilled minus the other (negative: better)
            out[f"distilled_minus_{other}"] = harness.spread([d - o for d, o in zip(runs["distilled"], runs[other])])
        return out

    machine = harness.machine()
    result = {
        "machine": {**machine, "lscpu_model": lscpu_model()},
        "note": "one thread per run, on a 2-core machine shared with other work (load_avg): wall times are noisy",
        "threads": 1,
        "settings": {
            "quick": args.quick,
            "student": STUDENT,
            "teacher": TEACHER,
            "teacher_steps": args.teacher_steps,
            "steps": args.steps,
            "seeds": args.seeds,
            "alpha": args.alpha,
            "temperature": args.temperature,
            "same_wall": "alone for steps x distilled ms/step / alone ms/step (the LR schedule stretched to them)",
        },
        "teacher": teacher,
        "params_ratio": round(teacher["params_m"] / seeds[args.seeds[0]]["alone"]["params_m"], 2),
        "seeds": seeds,
        "summary": {key: summary(key) for key in ("val_loss", "val_bpb", "wall_s", "ms_per_step", "steps")},
    }
    args.results.mkdir(parents=True, exist_ok=True)
    name = "distill-quick.json" if args.quick else "distill.json"
    (args.results / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()

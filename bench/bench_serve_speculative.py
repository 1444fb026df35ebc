"""`gpt serve --speculate 8` against plain `gpt serve`, through the official `openai` client: the same greedy
texts, and how much faster they come on text that copies its prompt.

    python bench/bench_serve_speculative.py               # 5 rounds; trains its models first if not cached
    python bench/bench_serve_speculative.py --rounds 1 --clients 1 --prompts 2 --tokens 32   # a smoke run

Two servers of each model run side by side as their own processes on free loopback ports (bench_serve.py's
`start_server`: the precision `--dtype auto` picks), one plain and one with `--speculate 8` (prompt lookup),
`--threads` each (they take turns: only one is ever asked at a time).
Each round sends every prompt to each server in turn (which one goes first alternates), `--clients` at once
(threads, one `openai.OpenAI` client each), greedy, `--tokens` new tokens (no end-of-text stop). Measured:
completion tokens / wall time of the round's requests at each server; the texts must be equal (the run stops
if not). Acceptance: the speculating server's `/health` counters over the whole run. Cases (the models and
prompts of bench/bench_speculative.py, trained and cached by it):
1. `code edit`: the code model (Python's standard library), the first function of each held-out file followed
   by its first line again (the rest is copied, as an edit that keeps most of a function does).
2. `char copy`: the char model (tiny-shakespeare), a val passage followed by its first line again.

Results: `serve-speculative.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
from bench_serve import start_server  # noqa: E402
from bench_speculative import SHAKESPEARE, first_functions, train_char, train_text  # noqa: E402


def ask(url: str, prompts: list[str], tokens: int, clients: int) -> tuple[float, list[str], int]:
    """(seconds, texts, completion tokens) of every prompt sent greedily, `clients` at a time."""
    import openai

    def one(prompt: str):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        r = client.completions.create(model="bench", prompt=prompt, max_tokens=tokens, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(one, prompts))
    return time.perf_counter() - start, [text for text, _ in answers], sum(n for _, n in answers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", default="1,4", help="concurrency levels")
    p.add_argument("--prompts", type=int, default=4, help="prompts per case")
    p.add_argument("--tokens", type=int, default=100, help="new tokens per request")
    p.add_argument("--steps", type=int, default=600, help="the char model's training steps (bench_speculative's)")
    p.add_argument("--text-steps", type=int, default=400, help="the code model's (bench_speculative's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    from gpt import load_checkpoint

    code = train_text("code", args.text_steps, args.threads)
    code_tok = load_checkpoint(code)[1]
    edits = [src + "\n\n" + src.split("\n")[0] + "\n" for _, src in first_functions(code_tok, args.prompts)]
    val = SHAKESPEARE.read_text(encoding="utf-8")[-3000:]
    passages = [chunk[:120] for chunk in val.split("\n\n")[1:] if len(chunk) >= 120][: args.prompts]
    copies = [passage + "\n\n" + passage.split("\n")[0] + "\n" for passage in passages]
    cases = {"code edit": (code, edits), "char copy": (train_char("char-target", 4, 128, args.steps), copies)}
    levels = [int(c) for c in args.clients.split(",")]
    results = {}
    for name, (run, prompts) in cases.items():
        settings = {"max_tokens": args.tokens, "threads": args.threads}  # bench_serve.py's server, speculating or not
        servers = {k: start_server(run, argparse.Namespace(**settings, speculate=k)) for k in (0, 8)}
        try:
            rates = {(k, c): [] for k in servers for c in levels}
            for r in range(args.rounds):
                for c in levels:
                    texts = {}
                    for k in (0, 8) if r % 2 == 0 else (8, 0):
                        seconds, texts[k], n = ask(servers[k][1], prompts, args.tokens, c)
                        rates[k, c].append(n / seconds)
                    if texts[0] != texts[8]:
                        raise SystemExit(f"{name}: the speculating server's greedy text differs from plain serving's")
            with urllib.request.urlopen(servers[8][1] + "/health") as h:
                speculation = json.load(h)["speculation"]
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait()
        results[name] = {
            "prompts": len(prompts),
            "speculation": speculation,
            **{
                f"{c} clients": {
                    "plain_tokens_per_s": harness.spread(rates[0, c]),
                    "speculative_tokens_per_s": harness.spread(rates[8, c]),
                    "speedup": harness.spread([b / a for a, b in zip(rates[0, c], rates[8, c])]),
                }
                for c in levels
            },
        }
        for c in levels:
            row = results[name][f"{c} clients"]
            print(f"{name:10s} {c} clients: plain {row['plain_tokens_per_s']['median']:7.1f} tok/s, speculating "
                  f"{row['speculative_tokens_per_s']['median']:7.1f} ({row['speedup']['median']:.2f}x); "
                  f"{speculation['acceptance']:.0%} of guesses kept", flush=True)  # fmt: skip
    out = {"machine": harness.machine(), "commit": harness.commit(), "date": time.strftime("%Y-%m-%d")}
    out["settings"] = {k: v for k, v in vars(args).items() if k != "results"} | {"speculate": 8}
    out["results"] = results
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "serve-speculative.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.results / 'serve-speculative.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

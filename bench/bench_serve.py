"""Load test of `gpt serve` on loopback: 1, 8 and 32 concurrent clients x 20 requests each.

    python bench/bench_serve.py                       # both models; writes bench/results/serve.{json,md}
    python bench/bench_serve.py --models char-cpu --clients 1,8 --requests 5     # a quick look
    python bench/bench_serve.py --speculate 8 --temperature 0 --out bench/results/serve-speculate   # speculating

For each model (bench/models.py: trained briefly on tiny-shakespeare; `char-cpu` is 4 x 4 x 128 with
a character vocabulary, `bpe-6x384` is 6 x 6 x 384 with GPT-2's BPE) a server is started as its own
process on a free port of 127.0.0.1 (nothing else is contacted) with `--max-batch 32`. Then, for each
concurrency level, that many clients (asyncio + httpx, in this process) each send `--requests`
streamed completions one after another: a prompt cut from the validation text, `--max-tokens` new
tokens, temperature 1, a per-request seed. Measured per request: latency (sent -> last byte), time
to first token (sent -> first text chunk), tokens (the stream's usage chunk); per level: total
completion tokens / wall time from the first request sent to the last one answered, p50 / p99 latency,
p50 / p99 time to first token, and failed requests (anything but a complete 200 stream). The goal is
32 clients >= 4x the total tokens/s of one client with no failed request; ratios come from the same
run. The server and the clients share the machine's cores: the load average is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from harness import machine  # noqa: E402
from models import ENV, ensure, val_tokens  # noqa: E402


def start_server(run_dir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "gpt",
        "serve",
        "--ckpt",
        str(run_dir),
        "--port",
        "0",
        "--max-batch",
        "32",
        "--max-queue",
        "256",
        "--max-tokens",
        str(args.max_tokens),
        "--model-name",
        "bench",
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.speculate:
        cmd += ["--speculate", str(args.speculate)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    if not line.startswith("serving "):
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    return proc, line.split(" at ")[1].split("/ ")[0]


async def one_request(client, url: str, prompt: str, seed: int, max_tokens: int, temperature: float) -> dict:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first, tokens, done = None, 0, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif first is None and chunk["choices"][0]["text"]:
                    first = time.perf_counter() - sent
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    latency = time.perf_counter() - sent
    return {
        "ok": done,
        "latency": latency,
        "ttft": first if first is not None else latency,
        "tokens": tokens,
        **({} if done else {"error": "stream ended before [DONE]"}),
    }


async def level(url: str, clients: int, requests: int, prompts: list[str], max_tokens: int, temperature: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def user(u: int) -> list[dict]:
            out = []
            for i in range(requests):
                k = u * requests + i
                out.append(await one_request(client, url, prompts[k % len(prompts)], k, max_tokens, temperature))
            return out

        load_before = os.getloadavg()
        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(user(u) for u in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    lat = sorted(r["latency"] for r in ok)
    ttft = sorted(r["ttft"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {
        "clients": clients,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": pct(lat, 0.5),
        "latency_p99_s": pct(lat, 0.99),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
    }


def prompts_for(name: str, n: int, prompt_tokens: int) -> list[str]:
    """`n` prompts of `prompt_tokens` tokens cut at seeded places from the validation split."""
    from gpt.checkpoints.loader import read_meta
    from gpt.data.tokenizer import get_tokenizer

    tok = get_tokenizer(read_meta(ensure(name))["tokenizer"])
    ids = val_tokens(name)
    rng = random.Random(0)
    return [
        tok.decode(ids[s : s + prompt_tokens].tolist())
        for s in (rng.randrange(len(ids) - prompt_tokens) for _ in range(n))
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="char-cpu,bpe-6x384", help="comma-separated bench/models.py names")
    p.add_argument("--clients", default="1,8,32", help="concurrency levels")
    p.add_argument("--requests", type=int, default=20, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length in tokens")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="server's torch threads, 0 for torch's default (default: 1: on a shared CPU more threads stall)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="the requests' temperature (0: greedy)")
    p.add_argument("--speculate", type=int, default=0, help="the server's --speculate K (prompt lookup; 0: off)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve"), help="results path, without suffix")
    args = p.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    env = machine()
    env["load_avg_start"] = os.getloadavg()
    print(f"CPU: {env['cpu']} ({env['cores']} cores, {env['capability']}), torch {env['torch']}", flush=True)
    results, speculation = [], {}
    for name in args.models.split(","):
        run_dir = ensure(name)
        prompts = prompts_for(name, 64, args.prompt_tokens)
        proc, url = start_server(run_dir, args)
        try:
            asyncio.run(level(url, 2, 2, prompts, 8, args.temperature))  # warm-up
            for clients in levels:
                r = {
                    "model": name,
                    **asyncio.run(level(url, clients, args.requests, prompts, args.max_tokens, args.temperature)),
                }
                results.append(r)
                print(
                    f"{name:10s} {clients:3d} clients: {r['tokens_per_s']:8.1f} tokens/s | latency p50 "
                    f"{r['latency_p50_s']:.2f} s p99 {r['latency_p99_s']:.2f} s | first token p50 "
                    f"{1000 * r['ttft_p50_s']:.0f} ms p99 {1000 * r['ttft_p99_s']:.0f} ms | {r['failed']} failed | "
                    f"load {r['load_avg_before'][0]:.1f}",
                    flush=True,
                )
            if args.speculate:  # the server's count of guesses over every level (and the warm-up)
                import httpx

                speculation[name] = httpx.get(url + "/health").json()["speculation"]
                print(f"{name:10s} speculation: {speculation[name]}", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    ratios = {}
    for name in args.models.split(","):
        by = {r["clients"]: r for r in results if r["model"] == name}
        if 1 in by:
            ratios[name] = {c: by[c]["tokens_per_s"] / by[1]["tokens_per_s"] for c in by}
    goal = {name: r.get(max(levels), 0) >= 4 for name, r in ratios.items()}
    failed = sum(r["failed"] for r in results)
    env["load_avg_end"] = os.getloadavg()
    settings = {
        k: getattr(args, k) for k in ("requests", "max_tokens", "prompt_tokens", "threads", "temperature", "speculate")
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "env": env,
                "settings": settings,
                "results": results,
                "ratio_vs_1_client": ratios,
                "goal_met": goal,
                "failed": failed,
                **({"speculation": speculation} if speculation else {}),
            },
            indent=2,
        )
        + "\n"
    )
    md = [
        f"CPU: {env['cpu']}, {env['cores']} cores, torch CPU capability {env['capability']}, torch {env['torch']}; "
        f"load average {env['load_avg_start'][0]:.1f} at the start, {env['load_avg_end'][0]:.1f} at the end",
        f"Settings: {json.dumps(settings)}",
        "",
        "| model | clients | requests | failed | total tokens/s | vs 1 client | latency p50 / p99 | "
        "first token p50 / p99 | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = ratios.get(r["model"], {}).get(r["clients"], float("nan"))
        md.append(
            f"| {r['model']} | {r['clients']} | {r['requests']} | {r['failed']} | {r['tokens_per_s']:.0f} | "
            f"{ratio:.1f}x | {r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} s | "
            f"{1000 * r['ttft_p50_s']:.0f} / {1000 * r['ttft_p99_s']:.0f} ms | {r['load_avg_before'][0]:.1f} |"
        )
    md.append("")
    verdicts = ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goal.items())
    md.append(
        f"Goal ({max(levels)} clients >= 4x one client's total tokens/s, no failed request): {verdicts}; "
        f"{failed} failed requests"
    )
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

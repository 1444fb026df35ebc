"""Generation far past block_size through the bounded (ring) KV cache of a windowed RoPE model: tokens/s and
memory along the way.

    python bench/bench_ring.py                                   # 10x block_size tokens, 5 rounds, quiet machine
    python bench/bench_ring.py --block 64 --times 2 --rounds 2 --out /tmp/ring   # a quick check that it runs

A small model with random weights (the speed of a step does not depend on what it says): RoPE, every layer
windowed (`--window`, `--global-tokens`), so each layer caches G + W slots (gpt/model/cache.py). One sample
is decoded greedily for `--times` x block_size tokens after a short prompt, in the process itself (the
sampler's `Decoder`, as `gpt sample` runs it; `--compile`: the compiled one-token step, its compile not
timed). Each tenth of the run is a segment: its tokens/s, the caches' bytes at its end (keys and values of
every layer) and the process's resident set (VmRSS). Medians over `--rounds` rounds. The goal (issue 46):
tokens/s flat (the last segment's median against the first's) and constant memory (the caches' bytes never
change; the resident set grows by the token history only, 8 bytes a token).

Writes bench/results/ring.json (or --out DIR/ring.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import harness  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402
from gpt.infer.sampling import Decoder  # noqa: E402

SEGMENTS = 10


def rss_mib() -> float:
    """The process's resident set now (VmRSS), in MiB; 0 where /proc has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def build(args) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.block,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
        pos_encoding="rope",
        attention_window=str(args.window),
        global_tokens=args.global_tokens,
    )
    model = GPT(cfg).eval()
    if args.compile:
        model.compile_decoding()
    return model


@torch.no_grad()
def one_round(model: GPT, args, n: int) -> dict:
    """One generation of n tokens: per tenth of it its tokens/s, the caches' bytes and the RSS."""
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    dec = Decoder(model, prompt)
    per = n // SEGMENTS
    segments = []
    for _ in range(SEGMENTS):
        start = time.perf_counter()
        for _ in range(per):
            dec.advance(dec.logits.argmax(-1))
        seconds = time.perf_counter() - start
        segments.append(
            {
                "tok_s": per / seconds,
                "cache_bytes": sum(c.nbytes for c in dec.caches),
                "rss_mib": rss_mib(),
            }
        )
    return {
        "segments": segments,
        "tokens": dec.tokens.size(1) - args.prompt,
        "prefills": dec.prefills,
        "slots": [c.max_len for c in dec.caches],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--global-tokens", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--times", type=int, default=10, help="tokens generated, in block_size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="the compiled one-token step (its compile not timed)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build(args)
    if args.compile:  # the compile, before any timing
        one_round(model, args, SEGMENTS)
    per = args.times * args.block // SEGMENTS
    rounds = [one_round(model, args, per * SEGMENTS) for _ in range(args.rounds)]
    segments = []
    for i in range(SEGMENTS):
        seg = [r["segments"][i] for r in rounds]
        segments.append(
            {
                "segment": i + 1,
                "tokens_to": (i + 1) * per,
                "tok_s": harness.spread([s["tok_s"] for s in seg]),
                "cache_bytes": harness.spread([s["cache_bytes"] for s in seg]),
                "rss_mib": harness.spread([s["rss_mib"] for s in seg]),
            }
        )
    first, last = segments[0], segments[-1]
    result = {
        "bench": "ring",
        "machine": harness.machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {"params": model.num_params(), "slots_per_layer": rounds[0]["slots"]},
        "tokens": rounds[0]["tokens"],
        "prefills": rounds[0]["prefills"],
        "segments": segments,
        "summary": {
            "tok_s_last_over_first": last["tok_s"]["median"] / first["tok_s"]["median"],
            "cache_bytes_constant": len({s["cache_bytes"] for r in rounds for s in r["segments"]}) == 1,
            "cache_bytes": first["cache_bytes"]["median"],
            "rss_growth_mib": last["rss_mib"]["median"] - first["rss_mib"]["median"],
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "ring.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    print(
        f"{result['tokens']} tokens ({args.times}x block_size {args.block}), {args.rounds} rounds: tok/s first "
        f"{first['tok_s']['median']:.1f}, last {last['tok_s']['median']:.1f} ({s['tok_s_last_over_first']:.2f}x); "
        f"caches {s['cache_bytes']} bytes, constant {s['cache_bytes_constant']}; RSS +{s['rss_growth_mib']:.1f} MiB "
        f"-> {path}"
    )
    return result


if __name__ == "__main__":
    main()

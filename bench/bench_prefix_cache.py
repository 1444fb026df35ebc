"""Time to first token of a conversation's second turn, with and without the server's prefix cache
(`gpt serve --prefix-cache-mb`, gpt/infer/prefix.py).

    python bench/bench_prefix_cache.py                 # 5 rounds
    python bench/bench_prefix_cache.py --rounds 1 --context 200    # a smoke run

GPT-2 124M's shape (12 x 12 x 768, block 1024) with random weights (time to first token does not depend on
what the weights say), float32, on the CPU with --threads threads, served in this process on loopback. Each
round, for each setting (cache off, then on, each its own server): a conversation over the completions
route, streamed: turn 1 is --context tokens of WikiText-2 text (another passage each round) and a question;
turn 2 is turn 1's prompt, its answer and a second question. Time to first token = request sent to the
first text chunk. Medians and spread over the rounds.

Results: `prefix-cache.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


def ttft(client, prompt: str, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first text chunk of a streamed greedy completion, and the whole text."""
    sent = time.perf_counter()
    first, text = None, ""
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True):
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece and first is None:
            first = time.perf_counter() - sent
        text += piece
    return first if first is not None else time.perf_counter() - sent, text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=800, help="tokens of text before turn 1's question")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    import openai
    import torch

    from gpt import GPT, GPTConfig
    from gpt.data.tokenizer import get_tokenizer
    from gpt.serve.app import ServeConfig, create_app, running

    torch.set_num_threads(args.threads)
    tok = get_tokenizer("gpt2", str(SHARED / "gpt2.tiktoken"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
    ids = tok.encode((SHARED / "wikitext2-valid.txt").read_text(encoding="utf-8"))
    meta = {"model_config": model.config.to_dict(), "tokenizer": tok.spec}
    times: dict[str, dict[str, list[float]]] = {"off": {"turn1": [], "turn2": []}, "on": {"turn1": [], "turn2": []}}
    hits = {}
    for r in range(args.rounds):
        context = tok.decode(ids[r * args.context * 2 : r * args.context * 2 + args.context])
        first = context + "\n\nQuestion: what is this passage about?\nAnswer:"
        for setting, mb in (("off", 0), ("on", 512)):
            config = ServeConfig(model_name="m", prefix_cache_mb=mb, max_tokens=64, max_batch=2)  # (a small pool)
            with running(create_app(model, tok, meta, config)) as url:
                client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
                t1, answer = ttft(client, first, 16)
                t2, _ = ttft(client, first + answer + "\n\nQuestion: and who wrote it?\nAnswer:", 16)
                engine_stats = client._client.get(url + "/health").json().get("prefix_cache")
            times[setting]["turn1"].append(t1)
            times[setting]["turn2"].append(t2)
            hits[setting] = engine_stats
        print(f"round {r}: turn 2 first token {1000 * times['off']['turn2'][-1]:.0f} ms without the cache, "
              f"{1000 * times['on']['turn2'][-1]:.0f} ms with it")  # fmt: skip
    out = {"machine": harness.machine(), "commit": harness.commit(), "date": time.strftime("%Y-%m-%d")}
    out["settings"] = {"rounds": args.rounds, "context_tokens": args.context, "threads": args.threads}
    out["results"] = {
        setting: {turn: harness.spread([t * 1000 for t in ts]) for turn, ts in turns.items()}
        for setting, turns in times.items()
    }
    out["results"]["turn2_speedup"] = harness.spread(
        [a / b for a, b in zip(times["off"]["turn2"], times["on"]["turn2"])]
    )
    out["results"]["last_round_cache"] = hits["on"]
    out["results"]["turn2_ms_saved_median"] = (
        statistics.median(times["off"]["turn2"]) * 1000 - statistics.median(times["on"]["turn2"]) * 1000
    )
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "prefix-cache.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.results / 'prefix-cache.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

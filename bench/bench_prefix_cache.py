"""Time to first token of a conversation's second turn, and lm-evaluation-harness's wall time on a multiple
choice task, with and without the server's prefix cache (`gpt serve --prefix-cache-mb`, gpt/infer/prefix.py).

    python bench/bench_prefix_cache.py                 # 5 rounds of each case
    python bench/bench_prefix_cache.py --rounds 1 --context 200 --items 2    # a smoke run
    python bench/bench_prefix_cache.py --case lm-eval  # only lm-eval's (the turns' results are kept)

GPT-2 124M's shape (12 x 12 x 768, block 1024) with random weights (time to first token does not depend on
what the weights say), float32, on the CPU with --threads threads, served in this process on loopback. Each
round, for each setting (cache off, then on, each its own server): a conversation over the completions
route, streamed: turn 1 is --context tokens of WikiText-2 text (another passage each round) and a question;
turn 2 is turn 1's prompt, its answer and a second question. Time to first token = request sent to the
first text chunk. Medians and spread over the rounds.

lm-eval case: lm-eval's `local-completions` model (one request at a time, --batch-size prompts each: lm-eval's
default 1; the server's tokenizer) on `gpt_wikitext2_next_sentence` (gpt/evals: a WikiText-2 validation passage
of about 2500 characters, some 600 tokens, then which of 4 sentences comes next; every choice repeats the
passage), its first --items items, the same model served in this process. Each round runs `simple_evaluate`
once without the cache and once with --cache-mb (its own server each: the cache starts empty), the order
alternating round by round; the wall time of `simple_evaluate`. The accuracies must be equal with and without
(asserted), and so every request's log-likelihood, within 1e-3 (asserted; the largest difference is recorded).
The weights are random: the accuracy is chance's, the time is what a trained model of this shape takes.

Results: `prefix-cache.json` in `--results` (default bench/results/); a run of one case keeps the other's.
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


def turns(args, model, tok, meta) -> dict:
    """The conversation case: time to first token of turn 1 and turn 2, without and with the cache."""
    import openai

    from gpt.serve.app import ServeConfig, create_app, running

    ids = tok.encode((SHARED / "wikitext2-valid.txt").read_text(encoding="utf-8"))
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
    return out


TASK = "gpt_wikitext2_next_sentence"


def lm_eval_case(args, model, tok, meta) -> dict:
    """The lm-eval case: simple_evaluate's wall time without and with the cache, the accuracies (equal)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads: the task reads a local file
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from gpt.evals import TASKS_DIR
    from gpt.serve.app import ServeConfig, create_app, running

    head = {"machine": harness.machine(), "commit": harness.commit(), "date": time.strftime("%Y-%m-%d")}  # what runs
    text = SHARED / "wikitext2-valid.txt"
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"text_file": str(text)})
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    scores, cache = {}, None
    for r in range(args.rounds):
        for setting in ("off", "on") if r % 2 == 0 else ("on", "off"):
            mb = args.cache_mb if setting == "on" else 0
            config = ServeConfig(model_name="m", prefix_cache_mb=mb, max_batch=max(8, args.batch_size))
            with running(create_app(model, tok, meta, config)) as url:
                model_args = {"model": "m", "base_url": f"{url}/v1/completions", "tokenizer_backend": "remote",
                              "max_length": model.config.block_size + 1, "batch_size": args.batch_size}  # fmt: skip
                start = time.perf_counter()
                out = lm_eval.simple_evaluate(
                    model="local-completions", model_args=model_args, tasks=[TASK], task_manager=manager,
                    limit=args.items, random_seed=0, bootstrap_iters=0, log_samples=True,
                )  # fmt: skip
                seconds[setting].append(time.perf_counter() - start)
                if setting == "on":
                    import httpx

                    cache = httpx.get(url + "/health").json().get("prefix_cache")
            results = {k: out["results"][TASK][k] for k in ("acc,none", "acc_norm,none")}
            lls = [resp[0][0] for doc in out["samples"][TASK] for resp in doc["resps"]]
            if setting in scores:
                assert scores[setting][0] == results, (setting, scores[setting][0], results)  # deterministic
            scores[setting] = (results, lls)
        assert scores["on"][0] == scores["off"][0], scores  # the cache changes no answer
        print(f"round {r}: lm-eval {seconds['off'][-1]:.1f} s without the cache, {seconds['on'][-1]:.1f} s with it")
    (on, on_lls), (_, off_lls) = scores["on"], scores["off"]
    out = head
    out["settings"] = {"rounds": args.rounds, "items": args.items, "task": TASK, "choices": 4,
                       "batch_size": args.batch_size, "cache_mb": args.cache_mb, "threads": args.threads}  # fmt: skip
    out["results"] = {setting: harness.spread(ts) for setting, ts in seconds.items()}
    out["results"]["speedup"] = harness.spread([a / b for a, b in zip(seconds["off"], seconds["on"])])
    out["results"]["accuracy"] = {k.split(",")[0]: v for k, v in on.items()}
    out["results"]["requests"] = len(on_lls)
    out["results"]["max_loglikelihood_diff"] = max(abs(a - b) for a, b in zip(on_lls, off_lls))
    assert out["results"]["max_loglikelihood_diff"] < 1e-3, out["results"]  # float rounding, not another answer
    out["results"]["last_round_cache"] = cache
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=["both", "turns", "lm-eval"], default="both")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=800, help="tokens of text before turn 1's question")
    p.add_argument("--items", type=int, default=16, help="lm-eval: the task's first N items (4 requests each)")
    p.add_argument("--cache-mb", type=int, default=2048, help="lm-eval: the prefix cache's budget")
    p.add_argument("--batch-size", type=int, default=1, help="lm-eval: prompts per request (its batch_size)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    import torch

    from gpt import GPT, GPTConfig
    from gpt.data.tokenizer import get_tokenizer

    torch.set_num_threads(args.threads)
    tok = get_tokenizer("gpt2", str(SHARED / "gpt2.tiktoken"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
    meta = {"model_config": model.config.to_dict(), "tokenizer": tok.spec}
    path = args.results / "prefix-cache.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    if args.case in ("both", "turns"):
        out = {**turns(args, model, tok, meta), "lm_eval": out.get("lm_eval")}
    if args.case in ("both", "lm-eval"):
        out["lm_eval"] = lm_eval_case(args, model, tok, meta)
    args.results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The per-token cost of a grammar's token mask: llguidance (what gpt/infer/constrain.py uses) against xgrammar,
on GPT-2's BPE (50,257 ids) and on a char vocabulary (printable ASCII, 96 ids), for a JSON schema.

    python bench/bench_grammar.py                 # 5 rounds over 20 documents each
    python bench/bench_grammar.py --rounds 1 --docs 3

Each round walks the token ids of `--docs` valid documents of the schema (the same for both engines, made by a
seeded generator below) through a fresh matcher: at every position the mask of allowed ids is computed (timed),
then the document's next id is consumed. Reported per engine and vocabulary: the grammar's compile time, the
median and 90th percentile of one mask over all positions of a round, then the median and spread of those over
the rounds; for llguidance also `Matchers.allowed`, the mask as the sampler takes it (a bool tensor). One
thread (torch and the engines'), on whatever else runs on the machine: see `machine` in the results.

Results: `grammar.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "ok"],
    "additionalProperties": False,
}
WORDS = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Ken", "Dennis", "Linus", "Margaret", "Donald", "Frances"]
CITIES = ["Berlin", "Lyon", "Oslo", "Porto", "Kyoto", "Austin", "Leeds"]


def documents(n: int) -> list[str]:
    """`n` valid documents of SCHEMA, compact JSON (the grammar's form: no free whitespace)."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        name = " ".join(rng.sample(WORDS, 2))[:24]
        doc = {
            "name": name,
            "age": rng.randint(0, 120),
            "email": f"{name.split()[0].lower()}{rng.randint(1, 99)}@example.org",
            "tags": rng.sample(["red", "green", "blue", "yellow"], rng.randint(0, 4)),
            "address": {"city": rng.choice(CITIES), "zip": f"{rng.randint(0, 99999):05d}"},
            "ok": rng.random() < 0.5,
        }
        out.append(json.dumps(doc, separators=(",", ":")))
    return out


def tokenizers() -> dict:
    from gpt.data.tokenizer import CharTokenizer, get_tokenizer

    return {
        "gpt2": get_tokenizer("gpt2", str(ROOT.parent / "shared" / "data" / "gpt2.tiktoken")),
        "char": CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n"),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_llguidance(tok, docs: list[str]) -> dict:
    import numpy as np

    from gpt.infer.constrain import Grammar, Matchers, bridge

    start = time.perf_counter()
    bridge(tok)
    bridge_s = time.perf_counter() - start
    grammar = Grammar.json_schema(SCHEMA)
    start = time.perf_counter()
    Matchers(grammar, tok, {tok.eot_token}, 1)
    compile_s = time.perf_counter() - start
    raw, full = [], []
    words = (tok.vocab_size + 31) // 32
    bits = np.empty(words, dtype=np.int32)
    for doc in docs:
        rows = Matchers(grammar, tok, {tok.eot_token}, 1)
        m = rows.rows[0]
        for token in tok.encode(doc):
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
            t1 = time.perf_counter()
            allowed = rows.allowed(tok.vocab_size, [0])
            t2 = time.perf_counter()
            assert allowed[0, token], (doc, token)
            raw.append(t1 - t0)
            full.append(t2 - t1)
            rows.advance([token], [0])
    return {"bridge_s": bridge_s, "compile_s": compile_s, "mask": raw, "allowed": full}


def run_xgrammar(tok, docs: list[str]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    vocab = [b"" if i == tok.eot_token else tok.decode_bytes([i]) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[tok.eot_token])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    bridge_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    raw = []
    for doc in docs:
        m = xgr.GrammarMatcher(compiled)
        for token in tok.encode(doc):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            raw.append(time.perf_counter() - t0)
            assert m.accept_token(token), (doc, token)
    return {"bridge_s": bridge_s, "compile_s": compile_s, "mask": raw}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--docs", type=int, default=20)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    docs = documents(args.docs)
    engines = {"llguidance": run_llguidance, "xgrammar": run_xgrammar}
    out = {"machine": harness.machine(), "commit": harness.commit(), "date": time.strftime("%Y-%m-%d")}
    out["settings"] = {"rounds": args.rounds, "docs": args.docs, "schema": SCHEMA, "threads": 1}
    results = {}
    for vocab, tok in tokenizers().items():
        for engine, run in engines.items():
            rounds = [run(tok, docs) for _ in range(args.rounds)]  # interleaving would share the bridge's cache
            entry = {
                "tokens_per_round": len(rounds[0]["mask"]),
                "compile_ms": harness.spread([r["compile_s"] * 1e3 for r in rounds]),
                "setup_ms": harness.spread([r["bridge_s"] * 1e3 for r in rounds]),
                "mask_us_median": harness.spread([statistics.median(r["mask"]) * 1e6 for r in rounds]),
                "mask_us_p90": harness.spread([percentile(r["mask"], 0.9) * 1e6 for r in rounds]),
            }
            if "allowed" in rounds[0]:
                entry["allowed_us_median"] = harness.spread([statistics.median(r["allowed"]) * 1e6 for r in rounds])
            results[f"{engine} {vocab}"] = entry
            print(
                f"{engine:10s} {vocab:5s} mask median {entry['mask_us_median']['median']:8.1f} us  "
                f"p90 {entry['mask_us_p90']['median']:8.1f} us  compile {entry['compile_ms']['median']:8.1f} ms"
            )
    out["results"] = results
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "grammar.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.results / 'grammar.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

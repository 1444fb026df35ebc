"""Speculative decoding against plain decoding, greedy, one sequence, eager, on the CPU: tokens/s and how many
guesses were kept (gpt/infer/speculative.py).

    python bench/bench_speculative.py                 # 5 rounds (the first time also about 20 min of training)
    python bench/bench_speculative.py --rounds 1 --tokens 64 --text-tokens 48 --prompts 2 --sentences 5  # a smoke run

Every model is trained here and cached under ~/.cache/gpt-bench/speculative/NAME-HASH (HASH: its settings), so
a rerun only measures. Cases (each prompt plain and speculative in turn, every case --rounds times; medians
and spread; tokens/s over all of a case's prompts):
1. `char copy`: a char model trained on tiny-shakespeare (4 layers x 128, --steps steps), a prompt that is
   a val passage followed by its first line again, so the continuation copies the passage; prompt lookup, K 8.
2. `char free`: the same model on a plain prompt (no passage to copy); prompt lookup, K 8.
3. `char draft`: the same model with a 1-layer x 64 draft trained alongside it; K 4.
4. `gpt2-124m loop`: GPT-2 124M's shape (12 layers x 768, block 1024) with RANDOM weights (no trained 124M
   model can be had here: no download, and no time to train one): its greedy text falls into loops that
   prompt lookup predicts, so this measures only the cost of checking K guesses in one pass at that width.
The text models (TEXT_MODEL: 4 layers x 192, block 256, a 4,096-id byte-level BPE trained on each corpus,
--text-steps steps) on held-out real text, prompt lookup K 8:
5. `code edit`: a model of Python source (the top-level modules of this interpreter's standard library,
   read where they lie, every 12th file held out); the prompt is the first function of 40-110 tokens of
   each of --prompts held-out files followed by its first line again, as an edit that keeps a function
   copies it; --text-tokens tokens.
6. `code continue`: the same model continuing the first 128 tokens of --prompts held-out files.
7. `translation`: a model of Multi30k's training pairs written "German ||| English" (block 128), greedy
   translating --sentences sentences of test_2016_flickr (prompt "German |||", up to end-of-text): the
   guesses can only come from the German (names, numbers) and the English so far.
8. `prose quote`: a WikiText-2 model (trained on wikitext2-valid.txt) given --prompts paragraphs of
   wikitext2-test.txt (60-120 tokens) each followed by its first sentence again, so the rest is quoted.
9. `prose continue`: the same model continuing the first 64 tokens of the same paragraphs.
Greedy texts are checked equal to plain decoding's for every prompt in every round (the run stops if not).

Results: `speculative.json` in `--results` (default bench/results/).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402

SHAKESPEARE = harness.SHARED_DATA / "tinyshakespeare.txt"
MULTI30K = harness.SHARED_DATA / "multi30k"
WIKITEXT = harness.SHARED_DATA / "wikitext2-valid.txt"  # trained on; wikitext2-test.txt held out
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt-bench" / "speculative"
# The text models: one shape, their own byte-level BPE each (GPT-2's 50,257 ids cost 4 s a step here).
TEXT_MODEL = {"layers": 4, "embd": 192, "vocab": 4096, "batch": 8, "block": 256}


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """The interpreter's own standard library, top-level modules (read where it lies, never copied into the
    repository): (trained on, held out), every 12th file from the 6th held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [f for i, f in enumerate(files) if i % 12 != 5], [f for i, f in enumerate(files) if i % 12 == 5]


def code_corpus(path: Path) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for f in stdlib_files()[0]:
            out.write(json.dumps({"text": f.read_text(encoding="utf-8", errors="replace")}) + "\n")


def translation_corpus(path: Path) -> None:
    """Multi30k's training pairs as "German ||| English" documents (the model learns to end after English)."""
    de = (MULTI30K / "train.de").read_text(encoding="utf-8").splitlines()
    en = (MULTI30K / "train.en").read_text(encoding="utf-8").splitlines()
    with open(path, "w", encoding="utf-8") as out:
        for d, e in zip(de, en):
            out.write(json.dumps({"text": f"{d.strip()} ||| {e.strip()}"}) + "\n")


def prose_corpus(path: Path) -> None:
    path.write_text(WIKITEXT.read_text(encoding="utf-8"), encoding="utf-8")


CORPORA = {"code": code_corpus, "translation": translation_corpus, "prose": prose_corpus}


def gpt(*argv) -> None:
    run = subprocess.run([sys.executable, "-m", "gpt", *map(str, argv)], cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"failed: gpt {' '.join(map(str, argv))}\n{run.stdout[-2000:]}{run.stderr[-2000:]}")


def cached(name: str, settings: dict) -> Path:
    """CACHE/NAME-HASH for these settings: a rerun with the same settings finds the checkpoint there."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return CACHE / f"{name}-{key}"


def train_text(name: str, steps: int, threads: int) -> Path:
    """A TEXT_MODEL trained `steps` steps on corpus `name` (its BPE trained on it), cached."""
    m = dict(TEXT_MODEL, block=128 if name == "translation" else TEXT_MODEL["block"])
    m["batch"] = TEXT_MODEL["batch"] * TEXT_MODEL["block"] // m["block"]  # the same tokens a step
    settings = {"corpus": name, "steps": steps, **m, "python": sys.version_info[:2]}
    out = cached(name, settings)
    if (out / "best.pt").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / ("corpus.txt" if name == "prose" else "corpus.jsonl")
    CORPORA[name](corpus)
    gpt("prepare", corpus, "--out", out / "data", "--tokenizer", "bpe", "--vocab-size", m["vocab"], "--force")
    corpus.unlink()
    gpt("train", "--data", out / "data", "--out-dir", out, "--force", "--n-layer", m["layers"], "--n-head", 4,
        "--n-embd", m["embd"], "--block-size", m["block"], "--batch-size", m["batch"], "--max-iters", steps,
        "--eval-interval", steps, "--eval-iters", 20, "--learning-rate", "2e-3", "--warmup-iters", 50,
        "--device", "cpu", "--dtype", "float32", "--no-plot", "--threads", threads, "--seed", 0)  # fmt: skip
    return out


def train_char(name: str, layers: int, embd: int, steps: int) -> Path:
    settings = {"corpus": "tinyshakespeare", "layers": layers, "embd": embd, "steps": steps}
    out = cached(name, settings)
    if (out / "best.pt").is_file():
        return out
    gpt("prepare", SHAKESPEARE, "--out", out / "data", "--tokenizer", "char", "--quiet", "--force")
    gpt("train", "--data", out / "data", "--out-dir", out, "--force", "--n-layer", layers,
        "--n-head", 4 if embd >= 128 else 2, "--n-embd", embd, "--block-size", 256, "--batch-size", 16,
        "--max-iters", steps, "--eval-interval", steps, "--learning-rate", "2e-3", "--device", "cpu",
        "--dtype", "float32", "--no-plot")  # fmt: skip
    return out


def timed(pieces) -> tuple[float, list[int]]:
    """Seconds to draw every piece of `pieces` (a generator), and the ids they carry."""
    start = time.perf_counter()
    ids = [i for piece in pieces for i in piece.ids]
    return time.perf_counter() - start, ids


def first_functions(tok, n: int, lo: int = 40, hi: int = 110) -> list[tuple[str, str]]:
    """(file name, source) of the first function of `lo`..`hi` tokens in each of the first `n` held-out
    files that have one."""
    found = []
    for path in stdlib_files()[1]:
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                source = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
                if lo <= len(tok.encode(source)) <= hi:
                    found.append((path.name, source))
                    break
        if len(found) == n:
            break
    return found


def paragraphs(tok, n: int, lo: int = 60, hi: int = 120) -> list[str]:
    """The first `n` paragraphs of WikiText-2's test split (held out) of `lo`..`hi` tokens."""
    text = (harness.SHARED_DATA / "wikitext2-test.txt").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines()]
    found = [line for line in lines if line and not line.startswith("=") and lo <= len(tok.encode(line)) <= hi]
    return found[:n]


def head(tok, text: str, n: int) -> str:
    return tok.decode(tok.encode(text)[:n])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=200, help="tokens generated per case and round (char, 124M)")
    p.add_argument("--text-tokens", type=int, default=100, help="tokens generated per prompt (code, prose)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per code and prose case")
    p.add_argument("--sentences", type=int, default=20, help="test sentences translated per round")
    p.add_argument("--steps", type=int, default=600, help="training steps of the char models")
    p.add_argument("--text-steps", type=int, default=1200, help="training steps of the code, translation, prose models")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    import torch

    from gpt import GPT, GPTConfig, load_checkpoint
    from gpt.infer import speculative
    from gpt.infer.sampling import SampleConfig, generate

    target, tok, _ = load_checkpoint(train_char("char-target", 4, 128, args.steps))
    draft = load_checkpoint(train_char("char-draft", 1, 64, args.steps))[0]
    text = {name: load_checkpoint(train_text(name, args.text_steps, args.threads))[:2] for name in CORPORA}
    torch.set_num_threads(args.threads)
    val = SHAKESPEARE.read_text(encoding="utf-8")[-3000:]
    passage = val[val.index("\n\n") + 2 :][:180]
    copy_prompt = passage + "\n\n" + passage.split("\n")[0] + "\n"
    torch.manual_seed(0)
    big = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
    greedy = dict(temperature=0, top_k=None)
    fixed = SampleConfig(max_new_tokens=args.tokens, stop_at_eot=False, **greedy)
    text_cfg = SampleConfig(max_new_tokens=args.text_tokens, stop_at_eot=False, **greedy)
    lookup = lambda: speculative.PromptLookup(k=8)  # noqa: E731
    code, code_tok = text["code"]
    functions = first_functions(code_tok, args.prompts)
    held_out = stdlib_files()[1][: args.prompts]
    # an edit: the function, then its first line again, so the rest is copied; a continuation: a file's start
    edits = [src + "\n\n" + src.split("\n")[0] + "\n" for _, src in functions]
    starts = [head(code_tok, f.read_text(encoding="utf-8", errors="replace"), 128) for f in held_out]
    prose, prose_tok = text["prose"]
    paras = paragraphs(prose_tok, args.prompts)
    # a quotation: the paragraph, then its first sentence again; a continuation: the paragraph's first 64 tokens
    quotes = [para + "\n\n" + para.split(" . ")[0] + " ." for para in paras]
    para_starts = [head(prose_tok, para, 64) for para in paras]
    de_en, de_en_tok = text["translation"]
    german = (MULTI30K / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()[: args.sentences]
    translate = SampleConfig(max_new_tokens=60, stop_at_eot=True, **greedy)
    cases = {  # name: (model, tokenizer, prompts, config, drafter)
        "char copy": (target, tok, [copy_prompt], fixed, lookup),
        "char free": (target, tok, ["ROMEO:\n"], fixed, lookup),
        "char draft": (target, tok, ["ROMEO:\n"], fixed, lambda: speculative.DraftModel(draft, k=4)),
        "gpt2-124m loop": (big, tok, ["ROMEO:\n"], fixed, lookup),
        "code edit": (code, code_tok, edits, text_cfg, lookup),
        "code continue": (code, code_tok, starts, text_cfg, lookup),
        "translation": (de_en, de_en_tok, [f"{de.strip()} |||" for de in german], translate, lookup),
        "prose quote": (prose, prose_tok, quotes, text_cfg, lookup),
        "prose continue": (prose, prose_tok, para_starts, text_cfg, lookup),
    }
    results = {}
    for name, (model, tokenizer, prompts, cfg, drafter) in cases.items():
        plain_s, spec_s, kept = [], [], []
        for _ in range(args.rounds):
            t = s = 0.0
            tokens, stats, texts = 0, speculative.Stats(), []
            for prompt in prompts:
                dt, ref = timed(generate(model, tokenizer, prompt, cfg))
                ds, out = timed(speculative.generate(model, tokenizer, prompt, cfg, drafter(), stats=stats))
                if out != ref:
                    raise SystemExit(f"{name}: speculative greedy text differs from plain decoding's")
                t, s, tokens = t + dt, s + ds, tokens + len(ref)
                texts.append(tokenizer.decode(ref))
            plain_s.append(tokens / t)
            spec_s.append(tokens / s)
            kept.append(stats.acceptance)
        results[name] = {
            "prompts": len(prompts),
            "tokens": tokens,
            "tokens_per_pass": tokens / stats.passes if stats.passes else None,
            "plain_tokens_per_s": harness.spread(plain_s),
            "speculative_tokens_per_s": harness.spread(spec_s),
            "speedup": harness.spread([b / a for a, b in zip(plain_s, spec_s)]),
            "acceptance": harness.spread(kept),
            "first_texts": texts[:2],  # what the model wrote: a copy, free text, or a loop
        }
        print(f"{name:16s} plain {results[name]['plain_tokens_per_s']['median']:7.1f} tok/s, speculative "
              f"{results[name]['speculative_tokens_per_s']['median']:7.1f} ({results[name]['speedup']['median']:.2f}x), "
              f"{results[name]['acceptance']['median']:.0%} of guesses kept, {tokens} tokens", flush=True)  # fmt: skip
    out = {"machine": harness.machine(), "commit": harness.commit(), "date": time.strftime("%Y-%m-%d")}
    out["settings"] = {k: v for k, v in vars(args).items() if k != "results"} | {"text_model": TEXT_MODEL}
    out["held_out"] = {"code_functions": [name for name, _ in functions], "code_starts": [f.name for f in held_out]}
    out["results"] = results
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "speculative.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.results / 'speculative.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where an eager GPT-2 124M decode step spends its time: the Linear layers' products, and the rest, with our C
kernels (gpt/model/rowkernels.py), whole blocks or layer by layer, and with PyTorch's.

    python bench/bench_kernels.py                      # float32, bf16 (native bf16 only), int8; 2 threads, 5 rounds
    python bench/bench_kernels.py --rounds 1 --tokens 8 --out /tmp/kernels     # a quick check that it runs

`gpt sample`'s eager path (load_for_inference, then gpt.infer.sampling.Decoder one token at a time, as
generate runs it) on GPT-2 124M's shape with random weights, after a 22-token prompt, three times for each
precision:
- `steps`: what load_for_inference lays out where our kernels build: the embeddings, every block and the final
  LayerNorm one C call (`StackStep`), the output head a `RowLinear`;
- `layers`: the same with the steps in C off: every Linear layer a `RowLinear` call, the rest PyTorch's ops;
- `pytorch`: GPT_ROW_KERNELS=off: MKL's column blocks for float32 `ChunkedLinear`, oneDNN's packed bf16
  `PackedLinear`, `Int8Linear`'s `torch._int_mm` and the ops around it.
Each round times `--tokens` steps plainly (ms a token), then the same number again with a clock around every
Linear layer's forward and every step in C: the time inside the products (`layers`, `pytorch`: each with the
weights it streams from memory) or inside our C calls (`steps`: the model's whole step, and the head's product).

Against llama.cpp's whole token (llama-bench's tok/s for the same pair in bench/results/llamacpp.json, or
--llamacpp): `vs_llama_bench`, its ms a token over ours (these 64 tokens, not bench_llamacpp's 256); and for
`layers` and `pytorch`, the products' time alone bounds what eager decoding can reach with those kernels: even
if everything else cost nothing, ours / llama.cpp <= llama.cpp's ms a token / the products' ms a token.
Writes bench/results/kernels.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402
from bench_llamacpp import PROMPT, random_checkpoint  # noqa: E402

from gpt.checkpoints.loader import load_for_inference  # noqa: E402
from gpt.infer.sampling import Decoder  # noqa: E402
from gpt.model.packed import ChunkedLinear, PackedLinear  # noqa: E402
from gpt.model.quantize import Int8Linear  # noqa: E402
from gpt.model.rowkernels import RowLinear  # noqa: E402
from gpt.runtime import cpu_has_native_bf16  # noqa: E402

PRECISIONS = [("float32", "none", "f32"), ("bfloat16", "none", "f16"), ("float32", "int8", "q8_0")]
KERNELS = {"steps": "native", "layers": "native", "pytorch": "off"}  # GPT_ROW_KERNELS for each
LINEARS = (RowLinear, ChunkedLinear, PackedLinear, Int8Linear, torch.nn.Linear)


def started(model, prompt: list[int]) -> Decoder:
    """A decoder after the prompt's prefill and its first step (greedy, as generate)."""
    dec = Decoder(model, torch.tensor([prompt]))
    dec.advance(dec.logits.argmax(-1))
    return dec


def advance(dec: Decoder, n: int) -> None:
    for _ in range(n):
        dec.advance(dec.logits.argmax(-1))


@contextmanager
def clocked(model):
    """Every Linear layer and step in C of `model` timed while inside: yields a list whose one entry sums their
    seconds."""
    total = [0.0]
    layers = [m for m in model.modules() if isinstance(m, LINEARS)]
    steps = [b for b in [model, *model.transformer.h] if b.step is not None]

    def timed(forward, *args):
        t0 = time.perf_counter()
        y = forward(*args)
        total[0] += time.perf_counter() - t0
        return y

    for m in layers:
        m.forward = partial(timed, m.forward)
    for b in steps:
        b.step = partial(timed, b.step)
    try:
        yield total
    finally:
        for m in layers:
            del m.forward
        for b in steps:
            b.step = b.step.args[0]


def round_of(model, prompt: list[int], n: int) -> dict:
    """ms a token decoding plainly, then the ms a token inside the Linear layers and steps in C."""
    dec = started(model, prompt)
    t0 = time.perf_counter()
    advance(dec, n)
    wall = (time.perf_counter() - t0) / n
    dec = started(model, prompt)
    with clocked(model) as products:
        advance(dec, n)
    return {"ms": wall * 1e3, "products_ms": products[0] / n * 1e3}


def llamacpp_ms(results: Path, theirs: str) -> float | None:
    """llama-bench's ms a token for GPT-2 against `theirs` (f32, f16, q8_0) in an eager row of that file."""
    if not results.exists():
        return None
    for row in json.loads(results.read_text())["rows"]:
        if (
            row["model"] == "gpt2"
            and row["llama_cpp"] == theirs
            and "--compile" not in row["ours"]
            and "bench_tok_s" in row
        ):
            return 1e3 / row["bench_tok_s"]["median"]
    return None


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--tokens", type=int, default=64, help="steps timed in each round (and again, clocking the products)"
    )
    p.add_argument("--llamacpp", default=str(ROOT / "bench" / "results" / "llamacpp.json"), help="llama.cpp's figures")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels"), help="writes OUT.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    precisions = [x for x in PRECISIONS if x[0] != "bfloat16" or cpu_has_native_bf16()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        ckpt = random_checkpoint("gpt2", Path(tmp))
        for dtype, quantize, theirs in precisions:
            models = {}
            for kernels, env in KERNELS.items():  # each laid out as load_for_inference does with that setting
                os.environ["GPT_ROW_KERNELS"] = env
                _, models[kernels], tok, _, _ = load_for_inference(ckpt, "cpu", dtype, args.threads, quantize)
                if kernels == "layers":
                    for part in [models[kernels], *models[kernels].transformer.h]:
                        part.step = None
            os.environ.pop("GPT_ROW_KERNELS")
            prompt = tok.encode(PROMPT)[:22]
            got = {kernels: [] for kernels in models}
            for model in models.values():
                advance(started(model, prompt), 4)  # warm-up
            for _ in range(args.rounds):  # interleaved: both see the same load
                for kernels, model in models.items():
                    got[kernels].append(round_of(model, prompt, args.tokens))
            print(f"{dtype} {quantize}: {got}", file=sys.stderr)
            theirs_ms = llamacpp_ms(Path(args.llamacpp), theirs)
            for kernels, runs in got.items():
                inside = "in_c" if kernels == "steps" else "products"  # (the blocks' products are inside the steps)
                row = {
                    "ours": dtype if quantize == "none" else quantize,
                    "kernels": kernels,
                    "llama_cpp": theirs,
                    "ms_per_token": harness.spread(g["ms"] for g in runs),
                    f"{inside}_ms_per_token": harness.spread(g["products_ms"] for g in runs),
                    "rest_ms_per_token": harness.spread(g["ms"] - g["products_ms"] for g in runs),
                }
                if theirs_ms:
                    row["llama_bench_ms_per_token"] = theirs_ms
                    row["vs_llama_bench"] = theirs_ms / row["ms_per_token"]["median"]
                    if inside == "products":
                        row["bound_by_products"] = theirs_ms / row["products_ms_per_token"]["median"]
                rows.append(row)
            del models
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"machine": harness.machine(), "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens}
    out.write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    for r in rows:
        inside = "in C" if r["kernels"] == "steps" else "products"
        ms = r.get("in_c_ms_per_token") or r["products_ms_per_token"]
        vs = f", {r['vs_llama_bench']:.2f}x llama-bench" if "vs_llama_bench" in r else ""
        bound = f" (at most {r['bound_by_products']:.2f}x with these products)" if "bound_by_products" in r else ""
        print(
            f"{r['ours']} ({r['kernels']}): {r['ms_per_token']['median']:.2f} ms a token, {inside} "
            f"{ms['median']:.2f} ms, the rest {r['rest_ms_per_token']['median']:.2f} ms{vs}{bound}"
        )


if __name__ == "__main__":
    main()

"""Where a GPT-2 124M training micro-step spends its time on one GPU: variants timed, one profiled.

    python bench/probe_gpu.py --variants base,autotune --batch 32 --profile base

Each variant builds the model afresh, compiles it, warms up, then times `--steps` micro-steps
(forward + backward, one fused AdamW step every `--accum`) with CUDA events. MFU counts
GPT.flops_per_token against 989 TFLOP/s (dense bf16, H100 datasheet). The profiled variant's kernels
are grouped (matmul, attention, triton-fused, other) and the top kernels listed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT

PEAK = 989e12


class FusedCE(torch.autograd.Function):
    """Mean cross-entropy whose logits gradient is made in the forward pass (one fewer pass over the logits)."""

    @staticmethod
    def forward(ctx, logits, targets):
        x = logits.float()
        lse = torch.logsumexp(x, -1, keepdim=True)
        valid = (targets != -1).unsqueeze(-1)
        onehot = torch.arange(x.size(-1), device=x.device) == targets.unsqueeze(-1)
        n = valid.sum().clamp(min=1)
        loss = ((lse - (x * onehot).sum(-1, keepdim=True)) * valid).sum() / n
        grad = ((torch.exp(x - lse) - onehot.float()) * (valid / n)).to(logits.dtype)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None


def variant_setup(name: str) -> dict:
    import torch._inductor.config as ic

    opts = {}
    mode = None
    if "autotune" in name:
        mode = "max-autotune-no-cudagraphs"
    if "coord" in name:
        opts["coordinate_descent_tuning"] = True
    if "ro" in name.split("+"):
        mode = "reduce-overhead"
    torch.backends.cuda.enable_cudnn_sdp("flash" not in name)  # torch 2.11 prefers cuDNN's kernel on H100
    ic.fx_graph_cache = True
    return {"mode": mode, "options": opts or None}


def run(name: str, batch: int, steps: int, accum: int, profile: bool, out: Path) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=True, dropout=0.0)
    model = GPT(cfg).cuda()
    if "fce" in name:
        model.loss = lambda logits, targets: FusedCE.apply(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95), fused=True)
    kw = variant_setup(name)
    train_model = torch.compile(model, **{k: v for k, v in kw.items() if v is not None})
    x = torch.randint(0, 50257, (batch, 1024), device="cuda")
    y = torch.randint(0, 50257, (batch, 1024), device="cuda")

    def micro(i):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = train_model(x, y)
        (loss / accum).backward()
        if (i + 1) % accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    t0 = time.time()
    for i in range(accum * 2):
        micro(i)
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.reset_peak_memory_stats()
    start.record()
    for i in range(steps):
        micro(i)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    tok_s = batch * 1024 / (ms / 1e3)
    mfu = tok_s * model.flops_per_token() / PEAK
    res = {
        "variant": name,
        "batch": batch,
        "ms_per_micro_step": round(ms, 2),
        "tokens_per_s": round(tok_s),
        "mfu": round(mfu, 4),
        "compile_s": round(compile_s, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    print(json.dumps(res), flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for i in range(accum):
                micro(i)
            torch.cuda.synchronize()
        groups, kernels = defaultdict(float), defaultdict(lambda: [0.0, 0])
        for e in p.key_averages():
            t = e.self_device_time_total if hasattr(e, "self_device_time_total") else e.self_cuda_time_total
            if t <= 0:
                continue
            n = e.key
            low = n.lower()
            if "flash" in low or "fmha" in low or "sdpa" in low or "cudnn" in low:
                g = "attention"
            elif any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")):
                g = "matmul"
            elif low.startswith(("triton", "red_", "per_", "poi_")) or "triton" in low:
                g = "triton"
            elif "adam" in low or "foreach" in low or "multi_tensor" in low:
                g = "optimizer"
            else:
                g = "other"
            groups[g] += t
            kernels[n][0] += t
            kernels[n][1] += e.count
        total = sum(groups.values())
        lines = [f"profile of {accum} micro-steps of {name}: {total / 1e3 / accum:.2f} ms GPU time per micro-step"]
        for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {g:10s} {t / 1e3 / accum:8.2f} ms  {t / total:6.1%}")
        lines.append("top kernels (ms per micro-step, calls per micro-step):")
        for n, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:40]:
            lines.append(f"  {t / 1e3 / accum:7.3f} {c / accum:5.0f}  {n[:150]}")
        text = "\n".join(lines)
        print(text, flush=True)
        (out / f"profile-{name}-b{batch}.txt").write_text(text + "\n")
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="base")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--profile", default="")
    p.add_argument("--out", type=Path, default=Path("/tmp"))
    p.add_argument("--deadline", type=float, default=1e9, help="seconds from start after which no variant starts")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    results = []
    for spec in a.variants.split(","):
        name, _, b = spec.partition("@")
        if time.time() - t0 > a.deadline:
            print(f"skipped {spec}: past the deadline", flush=True)
            continue
        results.append(run(name, int(b or a.batch), a.steps, a.accum, name in a.profile.split(","), a.out))
    (a.out / "probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

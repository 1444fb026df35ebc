"""`python -m gpt.serve`: serve a checkpoint over OpenAI's completions API, with a playground at `/`.

    python -m gpt.serve --ckpt out/shakespeare-char
    python -m gpt.serve --ckpt out/gpt2-run --quantize int8 --port 0 --max-batch 16 --api-key "$KEY"

Binds to 127.0.0.1 unless `--host` says otherwise; `--port 0` picks a free port. The first line on
stderr says where it listens (`serving NAME at http://HOST:PORT ...`). Mistakes (a missing
checkpoint, a port in use, bad settings) are one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path
from typing import Sequence

from gpt.cli import ArgumentParser, run_main
from gpt.serve import ServeError


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m gpt.serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Serve a gpt checkpoint over OpenAI's completions API, with a web "
                       "playground at /.")
    p.add_argument("--ckpt", required=True, help="run directory (best.pt, else last.pt), checkpoint file or HF GPT-2 dir")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    p.add_argument("--model-name", help="the model id clients ask for (default: the checkpoint's directory name)")
    p.add_argument("--api-key", default=os.environ.get("GPT_SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $GPT_SERVE_API_KEY, else none)")
    p.add_argument("--max-batch", type=int, default=32, help="samples decoded together (rows of the batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for rows; more are answered 429")
    p.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask for")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (default: the model's block_size)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (CUDA only)")
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: dynamic int8 Linear layers (CPU, float32; see gpt/quantize.py)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    return p


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from gpt.serve.app import ServeConfig, create_app, fingerprint, listen
    except ImportError as e:
        raise ServeError(f"serving needs FastAPI and uvicorn ({e.name} is missing): pip install -e \".[serve]\"") from None

    from gpt.checkpoint import load_for_inference

    name = args.model_name or Path(args.ckpt).resolve().with_suffix("").name
    config = ServeConfig(model_name=name, api_key=args.api_key, max_batch=args.max_batch, max_queue=args.max_queue,
                         max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
                         max_body_bytes=args.max_body_bytes)  # checked before anything slow
    rt, model, tokenizer, meta, n_params = load_for_inference(args.ckpt, args.device, args.dtype, args.threads,
                                                              args.quantize)
    device, dtype = rt.device, rt.dtype
    config.fingerprint = fingerprint(name, str(device), str(dtype), args.quantize, model.config.to_dict())
    app = create_app(model, tokenizer, meta, config)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {name} at http://{shown}:{port}/ (playground; API at /v1, docs at /docs): "
          f"{n_params / 1e6:.2f}M parameters, {device}, {rt.precision()}"
          f"{', int8 Linear layers' if args.quantize == 'int8' else ''}, up to {config.max_batch} samples at once",
          file=sys.stderr, flush=True)
    if not is_loopback(host) and not config.api_key:
        print(f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=3))
    server.run(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args), interrupted="the server stopped")


if __name__ == "__main__":
    sys.exit(main())

"""`gpt serve`: serve a checkpoint over OpenAI's completions API, with a playground at `/`.

    gpt serve --ckpt out/shakespeare-char
    gpt serve --ckpt out/gpt2-run --quantize int8 --port 0 --max-batch 16 --api-key "$KEY"

Binds to 127.0.0.1 unless `--host` says otherwise; `--port 0` picks a free port. The first line on
stderr says where it listens (`serving NAME at http://HOST:PORT ...`). Mistakes (a missing
checkpoint, a port in use, bad settings) are one `error: ...` line and exit code 2. The API key
(`--api-key`, else $GPT_SERVE_API_KEY) is never printed, not even by --help.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpt.cli import ArgumentParser, options, run_main
from gpt.serve import ServeError


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, but not a None one (the help says what unset means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="gpt serve",
        formatter_class=_Help,
        description="Serve a gpt checkpoint over OpenAI's completions API, with a web playground at /.",
    )
    p.add_argument(
        "--ckpt", required=True, help="run directory (best.pt, else last.pt), checkpoint file or HF GPT-2 dir"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    p.add_argument("--model-name", help="the model id clients ask for (default: the checkpoint's directory name)")
    from_env = "set" if os.environ.get("GPT_SERVE_API_KEY") else "not set"
    p.add_argument(
        "--api-key",  # no default from the environment: --help would print it
        help="require 'Authorization: Bearer KEY' on /v1 (default: $GPT_SERVE_API_KEY, "
        f"{from_env} here; without a key, see --allowed-hosts)",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        metavar="NAME",
        help="without an API key, the server answers only requests whose Host header is localhost, "
        "127.0.0.1, [::1] or --host (any port; --host 0.0.0.0 or ::, any IP address), against DNS "
        "rebinding; these names are answered too ('*': any Host). No CORS headers are sent: browsers "
        "refuse cross-origin calls",
    )
    p.add_argument("--max-batch", type=int, default=32, help="samples decoded together (rows of the batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for rows; more are answered 429")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve this LoRA run (trained on --ckpt) beside the model as model NAME; repeatable: a request's "
        "`model` picks the adapter, and rows of different adapters decode in one batch (default: none)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=0,
        help="keep the keys and values of prompt prefixes (system prompts, earlier turns) in this many MiB, so a "
        "prompt that starts as an earlier one prefills only what is new; answers equal up to float rounding "
        "(default: 0, off)",
    )
    p.add_argument(
        "--speculate",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding: each row guesses up to K tokens a step and one pass of the model checks every "
        "row's guesses; the guesses come from --draft-ckpt, else from the row's prompt and text so far (prompt "
        "lookup). Greedy text is plain serving's, sampled text has its distribution; rows with a grammar "
        "(response_format) decode one token a step; not for windowed or encoder-decoder models; /health shows "
        "how many guesses are kept (default: off; 4 with --draft-ckpt alone)",
    )
    p.add_argument(
        "--draft-ckpt",
        default=None,
        metavar="CKPT",
        help="speculative decoding with this smaller checkpoint's guesses (the same tokenizer) (default: none)",
    )
    p.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask for")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longest prompt in tokens (default: the model's block_size)"
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive; a slower one is answered 408",
    )
    p.add_argument(
        "--body-idle-timeout",
        type=float,
        default=5.0,
        help="seconds a request body may go without a byte; then it is answered 408 (a body trickled byte by byte "
        "is also closed to make room at --max-connections)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=5.0,
        help="seconds a connection may take to send a whole request head, from when it opens or its last "
        "answer ends; then it is closed (idle or half-sent requests hold no place under --max-connections)",
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=30.0,
        help="seconds an answer may sit unread by its client (the send buffer full); then the connection is dropped",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most (uvicorn's limit_concurrency): at the limit, a new connection closes one "
        "that waits for a request head or body, from the client address holding the most connections; with every "
        "place busy, more are answered 503 (default: 2 x (max-batch + max-queue))",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        help="open connections one client address (an IPv6 /64) may hold: a new one closes the address's own waiting "
        "ones, and is answered 429 when all of them have requests under way; behind a proxy every client is the "
        "proxy's address (default: half of --max-connections, plus one: with the default --max-connections one client "
        "can fill the batch and the queue, never every place)",
    )
    p.add_argument(
        "--max-logprob-values",
        type=int,
        default=1 << 17,
        help="log-probabilities one completion's answer may carry, summed over its choices: tokens (the prompt's "
        "with echo, plus max_tokens) x (logprobs + 1); more is a 400",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="serve the OpenAPI docs at /docs (Swagger UI, whose script and style the browser loads from a CDN "
        "into this server's origin) and /openapi.json",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (CUDA only)")
    options.add_quantize(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (info logs every request)",
    )
    return p


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> None:
    try:
        from gpt.serve.app import ServeConfig, Server, create_app, fingerprint, listen  # optional: serve extra
    except ImportError as e:
        raise ServeError(
            f'serving needs FastAPI and uvicorn ({e.name} is missing): pip install -e ".[serve]"'
        ) from None

    from gpt.checkpoints.loader import (
        load_for_inference,  # torch: loaded once the flags are checked (--help and mistakes answer at once)
    )

    name = args.model_name or Path(args.ckpt).resolve().with_suffix("").name
    named = [spec.partition("=") for spec in args.lora]
    if any(not sep or not adapter or not path for adapter, sep, path in named):
        raise ServeError(f"--lora takes NAME=DIR (a LoRA run trained on --ckpt), got {args.lora}")
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in 0-65535 (0 picks a free one), got {args.port}")
    api_key = args.api_key or os.environ.get("GPT_SERVE_API_KEY") or None
    if args.speculate is not None and args.speculate < 1:
        raise ServeError(f"--speculate must be a number of tokens >= 1, got {args.speculate}")
    speculate = args.speculate or (4 if args.draft_ckpt else 0)
    config = ServeConfig(
        model_name=name,
        api_key=api_key,
        max_batch=args.max_batch,
        adapters=tuple(adapter for adapter, _, _ in named),
        prefix_cache_mb=args.prefix_cache_mb,
        speculate=speculate,
        draft_ckpt=args.draft_ckpt,
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        body_idle_timeout=args.body_idle_timeout,
        header_timeout=args.header_timeout,
        send_timeout=args.send_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        max_logprob_values=args.max_logprob_values,
        allowed_hosts=(args.host, *(args.allowed_hosts or ())),
        docs=args.docs,
    )  # checked before anything slow
    rt, model, tokenizer, meta, n_params = load_for_inference(
        args.ckpt,
        args.device,
        args.dtype,
        args.threads,
        args.quantize,
        group_size=args.group_size,
        adapters=tuple(path for _, _, path in named),
    )
    device, dtype = rt.device, rt.dtype
    quantized = f"{args.quantize}/{args.group_size}" if args.quantize == "int4" else args.quantize
    config.fingerprint = fingerprint(name, str(device), str(dtype), quantized, model.config.to_dict())
    app = create_app(model, tokenizer, meta, config)
    spec = app.state.service.worker.engine.speculator if speculate else None
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"serving {name} at http://{shown}:{port}/ (playground; API at /v1{', docs at /docs' if args.docs else ''}): "
        f"{n_params / 1e6:.2f}M parameters, {device}, {rt.precision()}, up to {config.max_batch} samples at once"
        + (f", speculating {speculate} tokens ({spec.kind})" if spec is not None else ""),
        file=sys.stderr,
        flush=True,
    )
    if not is_loopback(host) and not config.api_key:
        print(
            f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model",
            file=sys.stderr,
            flush=True,
        )

    def farewell() -> None:  # the run's summary, once it has stopped
        if spec is not None:
            stats = spec.stats
            print(
                f"speculation: {stats.kept} of {stats.drafted} guesses kept ({stats.acceptance:.0%}) in "
                f"{stats.passes} passes",
                file=sys.stderr,
                flush=True,
            )

    Server(app, farewell=farewell, log_level=args.log_level, timeout_graceful_shutdown=3).run(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args), interrupted="the server stopped")

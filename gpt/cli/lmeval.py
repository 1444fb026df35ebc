"""`gpt evaluate --ckpt RUN --lm-eval TASKS`: EleutherAI's lm-evaluation-harness on a checkpoint, through
the server, in one command.

    gpt evaluate --ckpt out/shakespeare-char --lm-eval gpt_shakespeare_next_line,gpt_wikitext2 \
        --text ../shared/data/wikitext2-test.txt --json lm_eval.json

It serves the checkpoint (`gpt.serve`, on a thread of this process, on a free loopback port), runs
`lm_eval.simple_evaluate` with its `local-completions` model and the server's own tokenizer
(`tokenizer_backend=remote`: any checkpoint, char, own BPE, GPT-2, RoPE, chat, no export needed), stops the
server, prints lm-eval's table and with `--json` writes its results and the settings. The tasks are this
repository's (`gpt/evals`, offline: `gpt_wikitext2` scores `--text`, default `$GPT_SHARED_DATA/wikitext2-test.txt`)
or any of lm-eval's own (which download their data sets). Scoring is deterministic; `--seed` (default 1234)
is lm-eval's seed for what it samples (few-shot examples, generation).

Windows. lm-eval's `max_length` is `block_size + 1` here: every request then fits the model's context
(lm-eval sends `max_length - 1` tokens at most), and rolling tasks score `block_size - 1` new tokens per
window, each window's first target with one token of context.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gpt.errors import UserError
from gpt.evals import LOCAL_TASKS, TASKS, TASKS_DIR

DEFAULT_SEED = 1234


class LmEvalError(UserError, ValueError):
    """A task, data file or setting lm-eval cannot run with."""


def task_names(spec: str) -> list[str]:
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise LmEvalError(f"--lm-eval needs task names, e.g. {','.join(TASKS)}")
    return names


def text_file(args: argparse.Namespace) -> Path | None:
    """The rolling task's text file: --text, else $GPT_SHARED_DATA/wikitext2-test.txt; checked to exist."""
    if args.text is not None:
        path = Path(args.text)
    elif os.environ.get("GPT_SHARED_DATA"):
        path = Path(os.environ["GPT_SHARED_DATA"]) / "wikitext2-test.txt"
    else:
        raise LmEvalError(
            "gpt_wikitext2 needs a text file: give --text FILE (e.g. wikitext2-test.txt), or set GPT_SHARED_DATA "
            "to the directory that holds wikitext2-test.txt"
        )
    if not path.is_file():
        raise LmEvalError(f"gpt_wikitext2: no text file {path}: give an existing UTF-8 text file with --text")
    return path


def run_lm_eval(args: argparse.Namespace, write_json, check_output) -> str:
    """Serve --ckpt, run the harness on --lm-eval's tasks, stop; the table (and --json)."""
    names = task_names(args.lm_eval)
    if args.limit is not None and args.limit < 1:
        raise LmEvalError(f"--limit must be an integer >= 1 (the first N items of each task), got {args.limit}")
    batch = 8 if args.batch_size is None else args.batch_size
    if batch < 1:
        raise LmEvalError(f"--batch-size must be an integer >= 1, got {batch}")
    if args.json:
        check_output(args.json, "--json")
    metadata = {}  # the text file of the tasks that read one: --text, else each task's own default
    if "gpt_wikitext2" in names or (args.text is not None and "gpt_wikitext2_next_sentence" in names):
        metadata = {"text_file": str(text_file(args))}
    try:
        # lm-eval, the server and torch: imported once the flags are checked (--help and mistakes answer at once)
        import lm_eval  # optional: the eval extra
        from lm_eval.tasks import TaskManager  # optional: the eval extra
        from lm_eval.utils import make_table  # optional: the eval extra
    except ImportError:
        raise LmEvalError("--lm-eval needs lm-evaluation-harness: pip install -e '.[eval]'") from None
    from gpt.checkpoints.loader import load_for_inference  # torch: after the flags are checked
    from gpt.serve.app import ServeConfig, create_app, running  # fastapi and torch: after the flags

    name = "gpt"
    # lm-eval's remote tokenizer posts a rolling task's whole document to /tokenize in one request
    body = max(1 << 20, 2 * Path(metadata["text_file"]).stat().st_size + 4096) if metadata else 1 << 20
    config = ServeConfig(  # its settings checked (--prefix-cache-mb) before the model loads
        model_name=name,
        max_batch=batch,
        max_queue=64,
        max_body_bytes=body,
        body_timeout=300.0,
        prefix_cache_mb=args.prefix_cache_mb,  # a context's choices share its prefill (gpt/infer/prefix.py)
    )

    # lm-eval's own thousands of task files take seconds to index: only when a task is not one of ours
    ours = all(n in LOCAL_TASKS for n in names)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=not ours, metadata=metadata)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise LmEvalError(
            f"unknown lm-eval task {unknown[0]!r}: this repository's are {', '.join(LOCAL_TASKS)} (gpt/evals); "
            f"`lm_eval ls tasks` lists lm-eval's own"
        )
    rt, model, tok, meta, _ = load_for_inference(
        args.ckpt, args.device, args.dtype, args.threads, args.quantize, group_size=args.group_size
    )
    if model.config.n_encoder_layer:
        raise LmEvalError(f"{args.ckpt} is a translation (encoder-decoder) model: lm-eval scores language models")
    if metadata:  # the whole text must be in the checkpoint's vocabulary (a char model's characters)
        from gpt.data.tokenizer import TokenizerError  # only for a text file

        try:
            tok.encode(Path(metadata["text_file"]).read_bytes().decode("utf-8"))
        except (TokenizerError, UnicodeDecodeError) as e:
            raise LmEvalError(
                f"gpt_wikitext2: {metadata['text_file']}: {e}: the checkpoint's tokenizer cannot encode this text"
            ) from None
    block_size = model.config.block_size
    app = create_app(model, tok, meta, config)
    with running(app) as url:
        model_args = {
            "model": name,
            "base_url": f"{url}/v1/completions",
            "tokenizer_backend": "remote",
            "max_length": block_size + 1,
            "batch_size": batch,
            "num_concurrent": 1,
        }
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=names,
            task_manager=manager,
            limit=args.limit,
            random_seed=args.seed,
            numpy_random_seed=args.seed,
            torch_random_seed=args.seed,
            fewshot_random_seed=args.seed,
            log_samples=False,
        )
    if results is None:
        raise LmEvalError("lm-eval returned no results")
    prefix = app.state.worker.engine.prefix
    settings = {
        "ckpt": str(args.ckpt),
        "tasks": names,
        "limit": args.limit,
        "seed": args.seed,
        "text_file": metadata.get("text_file"),
        "max_length": block_size + 1,
        "batch_size": batch,
        "prefix_cache": {"mb": args.prefix_cache_mb, **prefix.stats} if prefix is not None else None,
        "device": str(rt.device),
        "precision": rt.precision(),
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
    }
    if args.json:
        write_json(
            args.json,
            {
                "task": "lm-eval",
                **settings,
                "results": results["results"],
                "versions": results.get("versions"),
                "n-samples": results.get("n-samples"),
            },
        )
    return make_table(results)

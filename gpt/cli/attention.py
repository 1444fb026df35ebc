"""Draw what a checkpoint attends to over a text: `gpt attention`."""

from __future__ import annotations

from pathlib import Path

from gpt.checkpoints.outputs import check_targets
from gpt.cli import ArgumentParser, run_main
from gpt.errors import UserError


class AttentionError(UserError, ValueError):
    """Options or a text that cannot be drawn."""


def parse_layers(value: str | None, n: int) -> list[int] | None:
    if value is None:
        return None
    try:
        layers = [int(x) for x in value.split(",")]
    except ValueError:
        raise AttentionError(f"--layers takes layer numbers separated by commas, e.g. 0,2; got {value!r}") from None
    if any(not 0 <= x < n for x in layers):
        raise AttentionError(f"--layers {value}: this model's layers are 0..{n - 1}")
    return layers


def run(args) -> str:
    from gpt.checkpoints.loader import load_for_inference  # torch: after the flags are read
    from gpt.infer.attention import attention_for, draw  # torch: after flags
    from gpt.train.plot import save_figure  # torch: after flags

    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise AttentionError(f"--out {args.out}: name a .png file")
    if not out.parent.is_dir():
        raise AttentionError(f"--out {args.out}: there is no directory {out.parent}")
    check_targets([out], force=True)  # a figure is replaced, a run's own file never (its .png: inside tensorboard/)
    if not args.text:
        raise AttentionError("--text is empty: give the text whose attention to draw")
    _, model, tok, meta, _ = load_for_inference(args.ckpt, "cpu", "float32")
    try:
        maps = attention_for(model, tok, meta, args.text, args.target)
    except ValueError as e:
        raise AttentionError(str(e)) from None
    written = []
    for kind, m in maps.items():
        path = out if kind == "self" else out.with_name(f"{out.stem}-{kind}{out.suffix}")
        written.append(str(save_figure(draw(m, parse_layers(args.layers, len(m.layers))), path)))
    return "wrote " + ", ".join(written)


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="gpt attention",
        description="Per-layer, per-head attention heatmaps of a checkpoint over a text, tokens on the axes. "
        "A seq2seq checkpoint also gets OUT-cross.png (target over source: the alignment) and OUT-encoder.png; "
        "a chat checkpoint's text is the user's message, in its template, followed by the answer.",
    )
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint file")
    p.add_argument(
        "--text", required=True, help="the text (seq2seq: the source sentence; a chat model: the user's message)"
    )
    p.add_argument(
        "--target",
        help="seq2seq: the translation to align; a chat model: the answer (default: the model's own, greedy)",
    )
    p.add_argument("--out", required=True, help="the PNG to write, e.g. attn.png")
    p.add_argument("--layers", help="only these layers, e.g. 0,2 (default: all)")
    args = p.parse_args(argv)
    return run_main(lambda: run(args))

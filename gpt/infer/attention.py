"""What a model attends to: the attention weights of one forward over a text, as per-layer, per-head heatmaps.

    maps = attention_for(model, tok, meta, "The cat sat on the mat.")       # decoder-only: self-attention
    maps = attention_for(model, tok, meta, "Ein Hund rennt.")               # seq2seq: + cross and encoder
    fig = draw(maps["self"])                                                # a matplotlib Figure

Each map is a `Maps`: the weights per layer (n_head, T_query, T_key), rows summing to 1, and the tokens
of both axes as labels. For a seq2seq checkpoint the target is the model's own greedy translation of the
source (or `target`), fed after the start token, so "cross" shows which source tokens each target token
looked at: the alignment. A chat checkpoint's text is the user's message, rendered with its template and
followed by the model's greedy answer (or `target`), so the map shows what the answer looked at. The
weights come from GPT.attention_maps; the normal forward is untouched.

Longer than the context: a text is drawn as its last block_size tokens and a seq2seq source or target as
its first, each with a ContextWarning saying so (as sample.py warns of a long prompt); a chat question and
answer that do not fit together are refused (ValueError), so a chat map always holds the whole answer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from gpt.infer.chat import answer_ids, chat_template, end_tokens
from gpt.infer.sampling import ContextWarning
from gpt.infer.translate import encode_sources, seq2seq_ids, translate

MAX_LABELED = 64  # axes with more tokens than this get no tick labels (they would be unreadable)
MAX_ANSWER = 32  # tokens of a chat model's own answer drawn, at most


@dataclass
class Maps:
    title: str
    layers: list[torch.Tensor]  # per layer (n_head, T_query, T_key)
    queries: list[str]  # tick labels: the query tokens (rows)
    keys: list[str]  # and the key tokens (columns)


def token_labels(tok, ids: list[int]) -> list[str]:
    """Each token's text, spaces and line breaks made visible."""
    return [tok.decode([i]).replace(" ", "·").replace("\n", "\\n") or "∅" for i in ids]


def attention_for(model, tok, meta: dict, text: str, target: str | None = None) -> dict[str, Maps]:
    """The attention maps of `text` (decoder-only: the text itself, its last block_size tokens; a chat model: `text`
    as the user's message in the template, then `target` or the model's greedy answer and end-of-turn;
    seq2seq: the source, with `target` or the model's greedy translation as the decoder's input)."""
    device = next(model.parameters()).device
    block = model.config.block_size
    template = chat_template(meta)
    if template is not None:  # a chat model: the question templated, then the answer (given or its own)
        prompt = template.prompt([{"role": "user", "content": text}], tok)
        room = block - len(prompt) - 1  # for the answer, after the question and before its end-of-turn token
        if target is None:
            if room < 1:
                raise ValueError(
                    f"the question takes {len(prompt)} tokens in the chat template, which leaves no room for an "
                    f"answer and its end-of-turn token in the model's context of {block}: shorten --text"
                )
            ends = end_tokens(template, tok)
            target_ids = answer_ids(model, [prompt], ends, tok.vocab_size, min(MAX_ANSWER, room))[0]
        else:
            target_ids = tok.encode(target)
            if len(target_ids) > room:
                raise ValueError(
                    f"the question ({len(prompt)} tokens in the chat template), the answer ({len(target_ids)}) "
                    f"and its end-of-turn token need {len(prompt) + len(target_ids) + 1} tokens, more than the "
                    f"model's context of {block}: shorten --target or --text"
                )
        ids = [*prompt, *target_ids, tok.special(template.end)]
        maps = model.attention_maps(torch.tensor([ids], device=device))
        labels = token_labels(tok, ids)
        return {"self": Maps("self-attention (chat)", [w[0] for w in maps["self"]], labels, labels)}
    if not model.config.n_encoder_layer:
        if target is not None:
            raise ValueError("--target is for seq2seq and chat checkpoints (the answer to align with --text)")
        ids = tok.encode(text)
        if not ids:
            raise ValueError("the text has no tokens")
        if len(ids) > block:
            warn(
                f"the text has {len(ids)} tokens, more than the model's context of {block}: only its last {block} are drawn"
            )
            ids = ids[-block:]
        maps = model.attention_maps(torch.tensor([ids], device=device))
        labels = token_labels(tok, ids)
        return {"self": Maps("self-attention", [w[0] for w in maps["self"]], labels, labels)}
    bos, eos = seq2seq_ids(meta)
    src, mask = encode_sources(tok, [text], eos, block, device)
    if target is None:
        longest = min(src.size(1) + 50, block - 1)  # translate's own bound, less the start token's place
        target = translate(model, tok, [text], bos, eos, max_new_tokens=longest)[0]
    tgt = [bos, *tok.encode(target)]
    if len(tgt) > block:
        warn(
            f"the target has {len(tgt) - 1} tokens, more than the {block - 1} the model's context holds after the "
            f"start token: only its first {block - 1} are drawn"
        )
        tgt = tgt[:block]
    maps = model.attention_maps(torch.tensor([tgt], device=device), src, mask)
    source_labels = token_labels(tok, src[0].tolist())
    target_labels = ["<s>", *token_labels(tok, tgt[1:])]
    return {
        "self": Maps("decoder self-attention", [w[0] for w in maps["self"]], target_labels, target_labels),
        "cross": Maps(
            "cross-attention (target over source)", [w[0] for w in maps["cross"]], target_labels, source_labels
        ),
        "encoder": Maps("encoder self-attention", [w[0] for w in maps["encoder"]], source_labels, source_labels),
    }


def warn(message: str) -> None:
    warnings.warn(message, ContextWarning, stacklevel=3)


def draw(maps: Maps, layers: list[int] | None = None):
    """A Figure of one heatmap per layer (rows) and head (columns); tokens as tick labels."""
    from matplotlib.figure import Figure  # optional: plot

    layers = list(range(len(maps.layers))) if layers is None else layers
    heads = maps.layers[0].size(0)
    Tq, Tk = len(maps.queries), len(maps.keys)
    cell = min(4.0, max(1.8, 0.12 * max(Tq, Tk)))
    fig = Figure(figsize=(cell * heads + 1, cell * len(layers) + 0.6), layout="constrained")
    fig.suptitle(maps.title)
    axes = fig.subplots(len(layers), heads, squeeze=False)
    for r, layer in enumerate(layers):
        for h in range(heads):
            ax = axes[r][h]
            image = ax.imshow(maps.layers[layer][h].float().cpu().numpy(), vmin=0, vmax=1, cmap="viridis")
            ax.set_title(f"layer {layer} head {h}", fontsize=8)
            for axis, labels, n in ((ax.xaxis, maps.keys, Tk), (ax.yaxis, maps.queries, Tq)):
                if n <= MAX_LABELED:
                    axis.set_ticks(range(n), labels, fontsize=max(3, 8 - n // 12))
                else:
                    axis.set_ticks([])
            ax.tick_params(axis="x", labelrotation=90)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    return fig

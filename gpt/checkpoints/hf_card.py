"""The model card (README.md) of a Hugging Face export: the Hub's front matter, a table of what the model
is, how to load it, and where the Hugging Face side reads text differently from ours.

Nothing in it differs between two exports of one model (no dates, no paths), so export -> import ->
export stays byte-stable.
"""

from __future__ import annotations

from gpt.data.chat import ChatTemplate
from gpt.model.transformer import ROPE_THETA

POSITIONS = {
    "learned": "learned (GPT-2's wpe)",
    "sinusoidal": "sinusoidal, held in GPT-2's wpe (token embeddings pre-scaled by sqrt(n_embd))",
    "rope": f"rotary (GPT-NeoX: rotary_pct 1.0, base {ROPE_THETA:g}, sequential residual)",
}
TOKENIZER_KINDS = {"gpt2": "GPT-2's byte-level BPE", "bpe": "own byte-level BPE", "char": "characters"}


def _scaling(hf_config: dict) -> str:
    """How the card names a context extension (config.json's rope_scaling), "" without one."""
    rope = hf_config.get("rope_scaling")
    if not rope:
        return ""
    since = f" from {rope['original_max_position_embeddings']}" if "original_max_position_embeddings" in rope else ""
    return f", {rope['rope_type']} scaling x{rope['factor']:g}{since}"


def model_card(model, tokenizer, hf_config: dict, template: ChatTemplate | None, facts: dict) -> str:
    """README.md: the Hub's front matter, what the model is, how to load it; nothing that differs between
    two exports of one model (no dates, no paths)."""
    cfg = model.config
    arch = hf_config["architectures"][0]
    base = tokenizer.spec.get("base", tokenizer.spec)
    rows = [
        ("architecture", f"`{arch}` (`{hf_config['model_type']}`)"),
        ("parameters", f"{model.num_params():,}"),
        ("layers / heads / width", f"{cfg.n_layer} / {cfg.n_head} / {cfg.n_embd}"),
        ("context", f"{cfg.block_size} tokens"),
        ("positions", POSITIONS.get(cfg.pos_encoding, cfg.pos_encoding) + _scaling(hf_config)),
        ("activation", "GELU (tanh approximation)" if cfg.activation == "gelu_tanh" else "GELU (exact)"),
        ("biases", "yes" if cfg.bias else "none (exported as zeros)"),
        ("tokenizer", f"{TOKENIZER_KINDS[base['kind']]}, {tokenizer.vocab_size:,} ids ({cfg.vocab_size:,} rows)"),
    ]
    if template is not None:
        rows.append(("chat template", " ".join(f"`{t}`" for t in template.specials) + " (`tok.chat_template`)"))
    rows += [(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else f"{v:.4f}") for k, v in facts.items()]
    tags = ["gpt", hf_config["model_type"]] + (["chat"] if template else [])
    use = (
        [
            'ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,',
            '                              return_dict=True, return_tensors="pt")["input_ids"]',
        ]
        if template
        else ['ids = tok("Hello", return_tensors="pt").input_ids']
    )
    notes = [
        "`tok(text)` reads text that spells a special token as that token (transformers' default); this model's "
        "own tokenizer reads it as text: pass `split_special_tokens=True` for the same ids."
    ]
    if template is not None:
        notes.append(
            "The chat template escapes special tokens spelled inside a message (U+FDD0 after their first "
            "character, which the tokenizer's normalizer takes out), so a message cannot forge a turn. "
            "`{% generation %}` marks the assistant's words and end token: `return_assistant_tokens_mask=True` "
            "gives the loss mask this model was trained with."
        )
    if base["kind"] == "char":
        notes.append(
            "A character outside the vocabulary is an error (tokenizers: 'Missing [UNK] token'), never replaced."
        )
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", *[f"- {t}" for t in tags]]
    lines += ["---", "", f"# {arch} exported from gpt", ""]
    lines += ["Written by `gpt hf export`; `gpt hf import` takes it back as it was.", ""]
    lines += ["| field | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""]
    lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    lines += [
        'tok = AutoTokenizer.from_pretrained("THIS_DIR")',
        'model = AutoModelForCausalLM.from_pretrained("THIS_DIR")',
    ]
    lines += [*use, "print(tok.decode(model.generate(ids, max_new_tokens=50)[0]))", "```", ""]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"

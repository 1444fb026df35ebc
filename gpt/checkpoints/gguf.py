"""GGUF for llama.cpp: a decoder-only checkpoint as one file that llama.cpp runs with nothing else.

    gpt export --format gguf --ckpt out/shakespeare-char --out model.gguf [--quant f32|f16|q8_0|q4_0]
    gpt export --format gguf --ckpt out/gpt2-run --out model.gguf --quant q4_k_m   # (or q5_k_m, q6_k)
    llama-cli -m model.gguf -p "ROMEO:" -n 100          # or: llama-server -m model.gguf (chat models)

Written with `gguf`, the llama.cpp project's own writer (`pip install -e ".[gguf]"`).

| our model                                   | GGUF architecture                                         |
|---------------------------------------------|-----------------------------------------------------------|
| learned positions                           | `gpt2`, wpe as `position_embd`                            |
| sinusoidal positions                        | `gpt2`, our table as `position_embd`; the embedding's      |
|                                             | sqrt(n_embd) scale folded into `token_embd`, so the head   |
|                                             | (`output`, tied to wte here) is written on its own         |
| RoPE                                        | `gptneox`, sequential residual, rotary over whole heads,   |
|                                             | NeoX's half-split rotation (ours), theta ROPE_THETA        |
| RoPE with rope_scaling linear / yarn        | `rope.scaling.*` (type, factor; yarn: original context,    |
|                                             | beta_fast 32, beta_slow 1): llama.cpp computes our angles  |
| untied_head                                 | the head written as `output`                               |
| post-norm, encoder-decoder, relu2, qk_norm, | refused (gpt/model/config.py's `EXPORTS`): no llama.cpp    |
|                                             | architecture computes them                                |
| logit_softcap, x0_skip, value_embeds        | (zero_init_proj is training only: exported as any model)   |

Layout: our `c_attn` is already what llama.cpp's graphs slice (all queries, then all keys, then all values;
Hugging Face's GPT-NeoX interleaves them per head, which llama.cpp's converter undoes) and nn.Linear's
(out, in) weights are GGUF's row-major (in, out) tensors, so every matrix is written as it is. Without
biases (`bias=False`) the biases llama.cpp requires are written as zeros. Quantization follows llama.cpp's
converter: vectors, norms and the position table stay float32; other matrices become `--quant`'s type, and
a matrix whose rows q8_0 or q4_0 cannot take (a row length not a multiple of 32) falls back to f16. q4_0 is
gguf's quantiser, which gives llama.cpp's own Q4_0 bits (tests/test_gguf_quant.py) and the grid
`gpt train --qat q4_0` trains on (gpt/model/grids.py). The K-quants (q4_k_m, q5_k_m, q6_k) are llama.cpp's
own quantiser (`llama_model_quantize`, from llama-cpp-python) run on the float32 file we write, with its
own choice of type per tensor (the `_m` mixes keep some matrices at higher precision); they store rows in
blocks of 256, so a model whose width 256 does not divide is refused in one line naming q4_0.

Tokenizer (gpt/data/bytelevel.py, the vocabulary the Hugging Face export writes too): every kind becomes
llama.cpp's byte-level BPE (`gpt2`) with GPT-2's pre-tokenizer, GPT-2's own merges for GPT-2; the
end-of-text token and a chat model's role markers are control tokens, which plain text never produces
(`llama_tokenize(..., parse_special=false)`, as our `encode`). A chat model's template is written as Jinja
(`tokenizer.chat_template`, gpt/data/chat_jinja.py: the Hugging Face export's, without `{% generation %}`)
whose rendering is our prompt; its end-of-turn token is EOT. No BOS is added. The vocabulary is the
tokenizer's: a model padded to a multiple of 64 rows loses the extra rows of its embedding and head, ids
that our sampler never draws either (llama.cpp would).

Chat: text that spells a marker. llama.cpp renders the template and tokenizes the whole text with special
tokens parsed (`llama-server`, and llama-cpp-python's `create_chat_completion`: `tokenize(..., special=True)`;
llama.cpp's own Jinja engine marks the parts that come from messages, but the version llama-cpp-python
0.3.36 vendors joins the parts into one string before tokenizing), so a message spelling `<|end|><|user|>`
would become those tokens: a forged turn, where our `encode` keeps it text. The Hugging Face export escapes such spellings in the template (U+FDD0 after the first character,
gpt/data/chat_jinja.py) and its tokenizer.json's normalizer removes the escape. llama.cpp's byte-level BPE
has no normalizer, so the escape must vanish in tokenization itself or the ids differ from ours:
- char vocabularies: it does. llama.cpp emits a BPE symbol that is not a token byte by byte and drops the
  bytes that have no token (llm_tokenizer_bpe_session::tokenize); U+FDD0 is not in the vocabulary, no merge joins
  its bytes to a neighbour, and neither they nor what the merges make of them are tokens (a char
  vocabulary's one-byte tokens are ASCII characters). So a char model's template escapes every special token spelled in a message
  and llama.cpp tokenizes the result exactly as our `encode` does the message (tests/test_gguf.py). Markers
  that could straddle the escape are refused, as for Hugging Face (chat_jinja.check_escapable); a char
  vocabulary that holds U+FDD0 itself gets no escaping.
- byte-level BPE (`gpt2`, an own `bpe`): it cannot. Every one of the 256 bytes is a token, so whatever the
  template inserts becomes tokens of its own (U+FDD0 gives three), and without an insertion the text spells
  the marker, which the special-token pass matches before BPE runs. The only exact way out would be
  control tokens whose text no message holds (e.g. the marker plus U+FDD0), which would stop users and
  tools that write `<|user|>` by hand from reaching the token; it is not done. Such a GGUF parses markers
  typed in a message as the tokens themselves, as most chat models in llama.cpp do.

Known differences from PyTorch, all small: llama.cpp computes GELU through a float16 table (and always
in the tanh form, so `activation="gelu"` models get tanh's curve, within 1e-3 of erf's) and keeps its
KV cache in float16 unless asked for float32 (`--cache-type-k f32 --cache-type-v f32`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from gpt.data.bytelevel import byte_level, vocabulary
from gpt.data.chat import ChatTemplate
from gpt.data.chat_jinja import ESCAPE, chat_template_jinja
from gpt.data.tokenizer import GPT2_PATTERN
from gpt.errors import UserError, storage_error
from gpt.fsutil import replacing
from gpt.model.config import refusals
from gpt.model.positions import YARN_BETA_FAST, YARN_BETA_SLOW, Positions
from gpt.model.transformer import ROPE_THETA

QUANTS = ("f32", "f16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")
K_QUANTS = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}  # llama.cpp's quantiser, its LLAMA_FTYPE_MOSTLY_*
K_BLOCK = 256  # a K-quant's block: rows must be a multiple of it
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which every LayerNorm of ours uses


class GGUFError(UserError, ValueError):
    """A checkpoint that llama.cpp cannot run, or an output that cannot be written (the message says why)."""


def architecture(config) -> str:
    """ "gpt2" or "gptneox" for this model config (its positions' GGUF family); GGUFError (one line) for what
    llama.cpp cannot compute (gpt/model/config.py's `EXPORTS`)."""
    found = refusals(config, "gguf")
    alone = [r.text for r in found if r.alone]
    if alone:
        raise GGUFError(f"{alone[0]}; export it with `gpt export --format onnx` instead")
    if found:
        raise GGUFError(
            f"llama.cpp's gpt2 and gptneox graphs cannot compute {', '.join(r.text for r in found)}: "
            "export it with `gpt export --format onnx` instead"
        )
    return Positions.of(config).family("gguf")


def check_rope_scaling(scaling) -> None:
    """GGUFError for a yarn scaling from a fractional original block (rope_original_block 0: block_size /
    rope_factor), which llama.cpp's whole-number original context cannot say."""
    if scaling is not None and scaling.kind == "yarn" and not float(scaling.original).is_integer():
        raise GGUFError(
            f"this checkpoint's yarn scaling starts from block_size / rope_factor = {scaling.original:g} positions: "
            "llama.cpp's rope.scaling.original_context_length is a whole number"
        )


def rope_scaling(w, scaling) -> None:
    """llama.cpp's rope.scaling.* keys of a context extension (none without one): its "linear" divides every
    frequency by the factor; its "yarn" is ours (the same truncated ramp between beta_fast 32 and beta_slow 1
    over the original context, cos and sin times 0.1 ln(factor) + 1)."""
    import gguf  # (the writer package, optional: write_gguf has imported it already)

    if scaling is None:
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if scaling.kind == "linear" else gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(scaling.factor)
    if scaling.kind == "yarn":
        w.add_rope_scaling_orig_ctx_len(round(scaling.original))
        w.add_rope_scaling_yarn_beta_fast(YARN_BETA_FAST)
        w.add_rope_scaling_yarn_beta_slow(YARN_BETA_SLOW)


def weights(model, arch: str, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every tensor llama.cpp's `arch` graph loads, in its order; the embedding
    and head cut to the tokenizer's `n_vocab` rows (a padded vocabulary's extra rows: ids nothing samples)."""
    cfg = model.config
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    for key in ("transformer.wte.weight", "lm_head.weight"):
        sd[key] = sd[key][:n_vocab]
    zeros = np.zeros

    def both(prefix: str, name: str) -> list[tuple[str, np.ndarray]]:  # a Linear's or LayerNorm's weight and bias
        w = sd[f"{prefix}.weight"]
        return [(f"{name}.weight", w), (f"{name}.bias", sd.get(f"{prefix}.bias", zeros(w.shape[0], np.float32)))]

    wte = sd["transformer.wte.weight"]
    positions = Positions.of(cfg)
    if positions.scaled:  # GPT.embed scales token embeddings by sqrt(n_embd) before adding the table
        wte = wte * np.float32(math.sqrt(cfg.n_embd))
    out = [("token_embd.weight", wte)]
    if positions.adds == "pe":
        out.append(("position_embd.weight", model.pe.detach().float().cpu().numpy()))
    elif positions.adds == "wpe":
        out.append(("position_embd.weight", sd["transformer.wpe.weight"]))
    out += both("transformer.ln_f", "output_norm")
    if arch == "gptneox" or positions.scaled or cfg.untied_head:  # (gpt2 reuses token_embd without)
        out.append(("output.weight", sd["lm_head.weight"]))
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}"
        out += both(f"{h}.ln_1", f"blk.{i}.attn_norm")
        out += both(f"{h}.attn.c_attn", f"blk.{i}.attn_qkv")
        out += both(f"{h}.attn.c_proj", f"blk.{i}.attn_output")
        out += both(f"{h}.ln_2", f"blk.{i}.ffn_norm")
        out += both(f"{h}.mlp.c_fc", f"blk.{i}.ffn_up")
        out += both(f"{h}.mlp.c_proj", f"blk.{i}.ffn_down")
    return out


def tensor_type(name: str, array: np.ndarray, quant: str):
    """The GGML type `name` is stored in under `quant` (llama.cpp's converter's rules, module notes)."""
    import gguf  # (the writer package: only this module needs it)

    T = gguf.GGMLQuantizationType
    if array.ndim < 2 or name.endswith("_norm.weight") or name == "position_embd.weight" or quant == "f32":
        return T.F32
    kind = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}.get(quant)
    if kind is not None and array.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
        return kind
    return T.F16


def write_gguf(model, tokenizer, path: str | Path, quant: str = "f32", chat_template: dict | None = None, name=""):
    """Write `model` (a decoder-only GPT) with its tokenizer (and chat template) as a GGUF file at `path`,
    atomically; returns {GGML type name: number of tensors}."""
    try:
        import gguf  # optional extra
    except ImportError:
        raise GGUFError('GGUF export needs the gguf package: pip install -e ".[gguf]"') from None
    if quant not in QUANTS:
        raise GGUFError(f"--quant {quant!r} is not one of {', '.join(QUANTS)}")
    cfg = model.config
    if quant in K_QUANTS:
        k_quant_check(cfg.n_embd, quant)
    arch = architecture(cfg)
    check_rope_scaling(Positions.of(cfg).scaling)
    words = vocabulary(tokenizer)
    vocab = byte_level(words)
    if vocab.pattern not in (None, GPT2_PATTERN):
        raise GGUFError(
            f"this tokenizer splits words with its own pattern {vocab.pattern!r}: llama.cpp's BPE knows a fixed "
            "set of pre-tokenizers and none of them is known to split as this one does"
        )
    if len(vocab.tokens) > cfg.vocab_size:
        raise GGUFError(f"the tokenizer has {len(vocab.tokens)} ids but the model only {cfg.vocab_size} rows")
    tokens = vocab.tokens
    control = set(vocab.specials.values())
    chat = None  # (end-of-turn id, Jinja template), made before the file so that a refusal leaves nothing
    if chat_template:
        template = ChatTemplate.from_spec(chat_template, "the checkpoint's chat_template")
        escape = list(words.specials) if words.model == "char" and ESCAPE not in words.tokens else None
        chat = (tokenizer.special(template.end), chat_template_jinja(template, escape=escape))  # (module notes)
    types = [gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL for i in range(len(tokens))]

    counts: dict[str, int] = {}
    path = Path(path)
    first = "f32" if quant in K_QUANTS else quant  # a K-quant: llama.cpp quantises the float32 file we write
    try:
        with replacing(path) as out:
            tmp = out.with_name(out.name + ".f32") if quant in K_QUANTS else out
            w = gguf.GGUFWriter(tmp, arch)
            w.add_name(name or path.stem)
            w.add_context_length(cfg.block_size)
            w.add_embedding_length(cfg.n_embd)
            w.add_feed_forward_length(4 * cfg.n_embd)
            w.add_block_count(cfg.n_layer)
            w.add_head_count(cfg.n_head)
            w.add_layer_norm_eps(LAYER_NORM_EPS)
            F = gguf.LlamaFileType
            w.add_file_type({"f16": F.MOSTLY_F16, "q8_0": F.MOSTLY_Q8_0, "q4_0": F.MOSTLY_Q4_0}.get(quant, F.ALL_F32))
            if arch == "gptneox":
                w.add_rope_dimension_count(cfg.n_embd // cfg.n_head)
                w.add_rope_freq_base(ROPE_THETA)
                w.add_parallel_residual(False)
                rope_scaling(w, Positions.of(cfg).scaling)
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre("gpt-2")
            w.add_token_list(tokens)
            w.add_token_types([int(t) for t in types])
            # llama.cpp requires merges and gguf writes no empty list: a char vocabulary of one-byte characters
            # (none to merge) gets one merge of a special token's text with itself, which BPE never forms.
            never = tokens[tokenizer.eot_token]
            w.add_token_merges([f"{a} {b}" for a, b in vocab.merges] or [f"{never} {never}"])
            w.add_bos_token_id(tokenizer.eot_token)
            w.add_eos_token_id(tokenizer.eot_token)
            w.add_add_bos_token(False)
            w.add_add_eos_token(False)
            if chat is not None:
                w.add_eot_token_id(chat[0])
                w.add_chat_template(chat[1])
            for tname, array in weights(model, arch, len(tokens)):
                qtype = tensor_type(tname, array, first)
                data = array.astype(np.float32) if qtype == gguf.GGMLQuantizationType.F32 else array
                if qtype == gguf.GGMLQuantizationType.F16:
                    data = array.astype(np.float16)
                elif qtype != gguf.GGMLQuantizationType.F32:
                    data = gguf.quants.quantize(array, qtype)
                w.add_tensor(tname, data, raw_dtype=qtype)
                counts[qtype.name] = counts.get(qtype.name, 0) + 1
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            if quant in K_QUANTS:
                try:
                    counts = llama_quantize(tmp, out, K_QUANTS[quant])
                finally:
                    tmp.unlink(missing_ok=True)
    except OSError as e:
        raise storage_error(e, "write", path) from None
    return counts


def k_quant_check(width: int, quant: str) -> None:
    """One line when `quant` (a K-quant) cannot store the model's rows, or llama.cpp's quantiser is missing."""
    if width % K_BLOCK:
        raise GGUFError(
            f"--quant {quant}: K-quants store rows in blocks of {K_BLOCK}, and this model's rows are {width} wide: "
            "use --quant q4_0 (blocks of 32) or q8_0"
        )
    try:
        import llama_cpp  # noqa: F401  (optional: llama.cpp's own quantiser)
    except ImportError:
        raise GGUFError(f"--quant {quant} runs llama.cpp's quantiser: pip install llama-cpp-python") from None


def llama_quantize(source: Path, target: Path, ftype: str) -> dict[str, int]:
    """llama.cpp's quantiser (`llama_model_quantize`) from the GGUF `source` to `target` as `ftype` (its
    LLAMA_FTYPE_MOSTLY_ name: "Q4_K_M"); returns {GGML type name: number of tensors} of what it wrote."""
    import ctypes  # lazy: only for llama.cpp's C API

    import gguf  # (the writer package: only this module needs it)
    import llama_cpp  # optional: llama.cpp's own quantiser

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)):
        raise GGUFError(f"llama.cpp's quantiser could not write {ftype} from {source.name} (its log says why)")
    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(target).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts

"""The model room: the Transformer and what changes its layers.

- `config.py` `GPTConfig`, the model's shape, validated on construction, and `EXPORTS`, the one table of
  which export formats carry each option (every exporter's refusals).
- `transformer.py` `GPT`: embeddings, the decoder stack, the optional encoder, the head, and what users
  expect next to the model (caches, parameter groups, vocabulary growth); it re-exports the names below.
- `attention.py` `Attention`: self-attention (KV cache, qk_norm, value_embeds) and cross-attention;
  `block.py` `Block` and `MLP`, pre/post-norm residual sublayers; `positions.py` `Positions`, the one owner of
  the position scheme (what the embedding adds, what attention receives, whether a KV cache slides, the
  export family), position ids, the sinusoidal table and rotary embeddings; `windows.py` `Windows`, the
  one owner of attention windows and global tokens (which keys each layer sees); `sparse.py` how a windowed
  layer attends without a cache, at linear cost (`Band`, `attend`); `cache.py` the `KVCache` (for a windowed
  layer, a ring of its window).
- `lora.py` LoRA adapter layers (apply, merge); `quantize.py` int8 and int4 Linear layers; `grids.py` the
  quantisation grids (int8, int4, llama.cpp's Q4_0) they and `qat.py` (quantisation-aware training) share;
  `packed.py` the Linear weights laid out for CPU decoding (our kernels', else transposed float32, oneDNN-packed
  bf16); `rowkernels.py` those kernels of our own (`rowkernels.c`, built on first use), a few rows times a weight, and
  the whole one-token step of the common block and model in one call;
  `compiled.py` the one-token decode step compiled (ahead of time on the CPU, `GPT.compile_decoding`); `stepcache.py` those
  compiled steps kept on disk for the next run on the same weights.

May import: the foundations only. Never data, checkpoints, training or inference.
"""

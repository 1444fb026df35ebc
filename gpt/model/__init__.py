"""The model room: the Transformer and what changes its layers.

- `config.py` `GPTConfig`, the model's shape, validated on construction.
- `transformer.py` `GPT`: embeddings and positions (learned, sinusoidal, rotary), causal self-attention,
  the MLP, pre/post-norm blocks, the optional encoder and cross-attention; `cache.py` its `KVCache`.
- `lora.py` LoRA adapter layers (apply, merge); `quantize.py` dynamic int8 Linear layers; `packed.py` the
  Linear weights laid out for CPU decoding (transposed float32, oneDNN-packed bf16).

May import: the foundations only. Never data, checkpoints, training or inference.
"""

"""gpt: pretrain, fine-tune and sample GPT-style language models.

    from gpt import GPT, GPTConfig, get_tokenizer
    from gpt import generate, load_checkpoint      # sampling: see gpt/infer/sampling.py

Names are imported on first use, so `import gpt.data.tokens` or a prepare script does not pay for
modules it never touches.
"""

import importlib

_EXPORTS = {
    "GPT": "gpt.model.transformer",
    "GPTConfig": "gpt.model.config",
    "CharTokenizer": "gpt.data.tokenizer",
    "StreamDecoder": "gpt.data.tokenizer",
    "get_tokenizer": "gpt.data.tokenizer",
    "load_checkpoint": "gpt.checkpoints.loader",
    "generate": "gpt.infer.sampling",
    "SampleConfig": "gpt.infer.sampling",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpt' has no attribute {name!r}")

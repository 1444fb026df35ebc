"""gpt: pretrain, fine-tune and sample GPT-style language models.

    from gpt import GPT, GPTConfig, get_tokenizer
    from gpt import generate, load_checkpoint      # sampling: see gpt/sampling.py

Names are imported on first use, so `import gpt.data` or a prepare script does not pay for
modules it never touches.
"""

import importlib

_EXPORTS = {
    "GPT": "gpt.model",
    "GPTConfig": "gpt.model",
    "CharTokenizer": "gpt.tokenizer",
    "StreamDecoder": "gpt.tokenizer",
    "get_tokenizer": "gpt.tokenizer",
    "load_checkpoint": "gpt.checkpoint",
    "generate": "gpt.sampling",
    "SampleConfig": "gpt.sampling",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpt' has no attribute {name!r}")

"""gpt: pretrain, fine-tune and sample GPT-style language models.

    from gpt import GPT, GPTConfig, get_tokenizer
    from gpt import generate, load_checkpoint      # sampling: see gpt/sampling.py
"""

from gpt.checkpoint import load_checkpoint
from gpt.model import GPT, GPTConfig
from gpt.sampling import SampleConfig, generate
from gpt.tokenizer import CharTokenizer, StreamDecoder, get_tokenizer

__all__ = [
    "GPT", "GPTConfig", "CharTokenizer", "StreamDecoder", "get_tokenizer", "load_checkpoint", "generate", "SampleConfig",
]

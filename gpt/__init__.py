"""gpt: pretrain, fine-tune and sample GPT-style language models.

    from gpt import GPT, GPTConfig, get_tokenizer
"""

from gpt.model import GPT, GPTConfig
from gpt.tokenizer import CharTokenizer, StreamDecoder, get_tokenizer

__all__ = ["GPT", "GPTConfig", "CharTokenizer", "StreamDecoder", "get_tokenizer"]

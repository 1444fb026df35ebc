"""The inference room: from a loaded model to tokens.

- `sampling.py` the sampling settings and the KV-cached decode loop; `logits.py` logits -> next token (penalties,
  temperature, top-k, top-p, min-p); `stream.py` ids -> text as it comes (stop strings).
- `speculative.py` speculative decoding (prompt lookup, a draft model): guesses checked in one pass.
- `constrain.py` constrained decoding: a JSON schema, regex or grammar as each step's token mask (llguidance).
- `prefix.py` the prefix cache: prompt prefixes' keys and values kept across requests (LRU, a byte budget).
- `batching.py` continuous batching: requests joining and leaving one decode batch (the server's engine);
  `speculative_batch.py` its speculative step (every row's guesses checked in one forward); `engine.py`
  what the engines share (requests, the waiting queue, the worker thread); `seq2seq_engine.py` the engine
  of encoder-decoder checkpoints.
- `translate.py` seq2seq greedy and beam decoding; `evaluate.py` BLEU and ROUGE of translations.
- `perplexity.py` loss, perplexity and bits per byte of a text file, in sliding windows.
- `export.py` ONNX / torch.export of the logits graph; `llamacpp.py` runs a GGUF export in llama.cpp.
- `chat.py` a conversation with a chat checkpoint; `logprobs.py` token log-probabilities as the completions
  API reports them; `attention.py` attention weights as heatmaps.

May import: checkpoints, model, data, the foundations. Never training or the command line.
"""

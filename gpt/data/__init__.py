"""The data room: text in, token ids on disk, batches out. Imports torch only where batches are made.

- `corpus.py` reads text files and directories into documents, `records.py` the rows of JSONL / Parquet files; `prepare.py` tokenizes them into a
  dataset directory (`train.bin`, `val.bin`, `meta.json`); `pairs.py` does the same for translation
  pairs and batches them by length.
- `tokenizer.py` (gpt2, char, own BPE through tiktoken), `bpe.py` (training a BPE), `vocab.py`
  (reusing a dataset's vocabulary, the unknown-character policy), `bytelevel.py` (any of them as
  the tokens, merges, pre-tokenizer and specials that Hugging Face's tokenizer.json and llama.cpp's GGUF
  take); `chat.py` (conversations and the chat template), `chat_jinja.py` (the template as Jinja, for
  both exports), `tools.py` (tool calls and results as the template's text, the grammar of a call).
- `sft.py` turns chat files into a chat dataset (ids, a loss mask, where each conversation starts);
  `packing.py` packs its conversations into training windows. `preferences.py` turns preference files
  (prompt, chosen, rejected) into a preference dataset; `preference_batches.py` batches its pairs.
- `format.py` owns the on-disk format: meta.json's schema, dtypes, checksums; `staging.py` writes a dataset
  into a hidden directory and publishes it atomically, within a byte budget.
- `tokens.py` opens a token dataset memory-mapped and draws training / evaluation batches.

May import: the foundations (`gpt.errors`, `gpt.fsutil`, `gpt.progress`, `gpt.runtime`). Never the
model, checkpoints, training or inference.
"""

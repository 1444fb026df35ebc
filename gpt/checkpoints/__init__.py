"""The checkpoints room: every format a model is stored in, and the one loader that reads them all.

- `native.py` the `.pt` format: its meta (`build_meta`, `check_meta`), atomic `save`, `load_file`.
- `dcp.py` sharded checkpoints (`--fsdp`, torch.distributed.checkpoint); `dcp_index.py` reads their index
  (a pickle) with a pickle machine of its own that runs nothing, and `dcp_check.py` checks what it read.
- `hf.py` Hugging Face directories, import and export: GPT-2 (learned, sinusoidal positions) and, through
  `hf_neox.py`, GPT-NeoX (RoPE); `hf_tokenizer.py` writes tokenizer.json and tokenizer_config.json; `hf_card.py` the
  model card.
- `gguf.py` GGUF files for llama.cpp (export only: `gpt export --format gguf`).
- Both exports take the tokenizer's vocabulary from gpt/data/bytelevel.py and the Jinja chat template from
  gpt/data/chat_jinja.py.
- `adapters.py` LoRA checkpoints: adapters only, naming their base.
- `outputs.py` where a command may write a checkpoint or an export: never over what it reads, an existing
  file only with `--force`.
- `loader.py` `locate` decides what a path is once (pt, dcp, hf, lora; a run directory resolves to its
  checkpoint); `load_model` / `load_checkpoint` / `load_for_inference` hand it to that kind's reader;
  none of the formats imports it back.

May import: model, data, the foundations. Never training, inference or the command line.
"""

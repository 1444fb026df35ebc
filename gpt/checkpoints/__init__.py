"""The checkpoints room: every format a model is stored in, and the one loader that reads them all.

- `native.py` the `.pt` format: its meta (`build_meta`, `check_meta`), atomic `save`, `load_file`.
- `dcp.py` sharded checkpoints (`--fsdp`, torch.distributed.checkpoint); `dcp_index.py` reads their index
  (a pickle) with a pickle machine of its own that runs nothing.
- `hf.py` Hugging Face GPT-2 directories (import and export).
- `adapters.py` LoRA checkpoints: adapters only, naming their base.
- `loader.py` `load_model` / `load_checkpoint` / `load_for_inference`: dispatches to the formats above;
  none of them imports it back.

May import: model, data, the foundations. Never training, inference or the command line.
"""

"""The training room: from a config to checkpoints.

- `config.py` `TrainConfig` (holding the model's fields), TOML files and `--key value` flags, the
  resume lookup; `configs/*.toml` the shipped configs.
- `trainer.py` the loop and its step; `tasks.py` what it trains on (tokens or pairs); `schedule.py`
  learning rates; `muon.py` the Muon optimizer; `parallel.py` DDP / FSDP2 / activation checkpointing;
  `finetune.py` what a LoRA run starts from.
- `rundir.py` the run directory and its lock; `runlog.py` console / JSONL / W&B / TensorBoard;
  `health.py` loss spikes and gradients; `preflight.py` parameters, memory and ETA before step 1;
  `stopping.py` signals and the time limit; `plan.py` the memory planner; `plot.py` the loss curves.

May import: checkpoints, model, data, the foundations. Never inference or the command line.
"""

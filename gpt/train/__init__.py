"""The training room: from a config to checkpoints.

- `config.py` `TrainConfig` (holding the model's fields) and its checks, and the small configs it builds for
  its components (`OptimizerConfig`, the model room's `LoRAConfig`); `flags.py` TOML files and `--key value`
  flags into one (`build_config`, `gpt train --help`); `configs/*.toml` the shipped configs.
- `start.py` `resolve_run`: the command line resolved once into a `RunPlan` (the config, the `--resume` /
  `--init-from` / LoRA base checkpoints located with their meta read); what a run starts from.
- `trainer.py` the loop; `step.py` its step (the optimizer, each step's hyperparameters, the micro-batches,
  the evaluation loss); `tasks.py` what it trains on (tokens, pairs, chat or preferences); `schedule.py`
  learning rates; `muon.py` the Muon optimizer; `parallel.py` DDP / FSDP2 / activation checkpointing;
  `mesh.py` the processes as pipeline x data x tensor parallel (`Layout`, the DeviceMesh);
  `tensor_parallel.py` `--tp`: each block's matrices split over the mesh's "tp" processes; `pipeline.py`
  pipeline parallelism (`--pp`: the decoder in stages, its schedule, step and evaluation);
- `distill.py` knowledge distillation (`--distill-from`): the frozen teacher and the KL term mixed into the loss;
  `prefer.py` preference tuning (`--objective dpo | orpo`): the frozen reference and the DPO / ORPO losses;
  `reference_cache.py` the reference's log-probs computed once for the run (`--reference-cache`);
  `grpo.py` GRPO (`--objective grpo`): group sampling on the model's caches, the advantages and the clipped
  loss; `prompts.py` its prompt rows (a `.jsonl` read at the start, the policy's tokenizer); `rewards.py` the
  checkers that score completions (`--reward exact | json | bleu | module:function`);
- `rundir.py` the run directory and its lock; `runlog.py` console / JSONL / W&B / TensorBoard;
  `health.py` loss spikes and gradients; `preflight.py` parameters, memory and ETA before step 1;
  `stopping.py` signals and the time limit; `plan.py` the memory planner; `sizing.py` a whole run sized from
  `--depth` / `--params` and a time budget (`gpt plan --depth`); `plot.py` the loss curves.
- `sweep.py` hyperparameter sweeps on Optuna (`gpt sweep`): each trial a `gpt train` run in a child process,
  pruned after its evaluations; `space.py` the sweep's search space (TOML); `sweepplot.py` the study's PNG.

May import: checkpoints, model, data, the foundations. Never inference or the command line.
"""

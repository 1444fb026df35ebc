"""Loading any checkpoint kind: one entry point that dispatches to the format that wrote it.

    model, tok, meta = load_checkpoint("out/NAME")    # a run dir (best.pt, else last.pt), a .pt file, a DCP
                                                      # directory or a Hugging Face GPT-2 directory
    model, meta = load_model(path)                    # without the tokenizer
    inf = load_for_inference(path, device, dtype)     # + runtime, precision, int8: sample.py, evaluate, serve

| kind                            | read by                                  |
|---------------------------------|------------------------------------------|
| `.pt` file (`last.pt`, `best.pt`)| `native.load_file` (torch.load weights_only) |
| DCP directory (`last.dcp`)      | `dcp.read` (its index by `dcp_index`, no unpickler) |
| Hugging Face GPT-2 / GPT-NeoX directory | `hf.read` (safetensors or weights_only)    |
| LoRA adapters (`meta["lora"]`)  | their base, loaded here, + `adapters.attach`                   |

Every kind ends as the same checked meta (`native.check_meta`) and `native.build_model`. The formats
never import this module back: it is the one place that knows them all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from gpt.checkpoints import adapters, dcp, hf
from gpt.checkpoints.native import (
    BEST_FIRST,
    SHARDED,
    CheckpointError,
    Fields,
    build_meta,
    build_model,
    check_meta,
    checked,
    is_sharded,
    load_file,
    model_config,
    read_file,
)
from gpt.data.format import is_dataset
from gpt.data.tokenizer import get_tokenizer
from gpt.data.vocab import Reused, dataset_spec
from gpt.model import lora
from gpt.model.packed import pack
from gpt.model.quantize import dtype_flag
from gpt.model.quantize import quantize as quantize_model
from gpt.model.transformer import GPT
from gpt.runtime import Runtime, decode_threads, resolve_dtype, setup


def resolve(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Path:
    """A checkpoint (a file, or a DCP directory) from its path or a run directory (the first of `names`
    there, or its DCP twin: the later step of the two)."""
    path = Path(path)
    if path.is_dir() and not is_sharded(path):
        for name in names:
            found = [p for p in (path / name, path / SHARDED.get(name, name)) if p.is_file() or is_sharded(p)]
            if found:
                return max(found, key=lambda p: read_meta(p).get("step", 0))
        raise CheckpointError(_not_a_run(path, names))
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return path


def _not_a_run(path: Path, names: tuple[str, ...]) -> str:
    """Why a directory without checkpoints is not a run, and what to pass instead."""
    if is_dataset(path):
        return (
            f"{path} is a prepared dataset, not a training run: give a run directory produced by train.py, "
            f"e.g. out/{path.name} after `python train.py --data {path} --out-dir out/{path.name}`"
        )
    if hf.is_hf_dir(path):
        return (
            f"{path} is a Hugging Face model directory: it holds weights but no training state; fine-tune "
            f"from it with `python train.py --init-from {path} --data DATA --out-dir OUT`"
        )
    return f"no {' or '.join(names)} in {path}: train one with `python train.py --out-dir {path}`"


def read(path: str | os.PathLike, map_location="cpu", names: tuple[str, ...] = BEST_FIRST) -> Fields:
    """The checkpoint dict with `meta` checked and parsed (`check_meta`); never unpickles arbitrary objects."""
    path = resolve(path, names)
    return checked(dcp.read(path, map_location), path) if is_sharded(path) else read_file(path, map_location)


def read_meta(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Fields:
    """Only the checked metadata (the tensors are memory-mapped, not read)."""
    path = resolve(path, names)
    if is_sharded(path):
        return dcp.read_meta(path)
    return check_meta(load_file(path, mmap=True)["meta"], path)


def _read_hf(path: str | os.PathLike) -> tuple[Fields, dict, Path]:
    """(meta, state dict, source) of a Hugging Face GPT-2 or GPT-NeoX directory."""
    source = Path(path) / "config.json"
    config, state, facts = hf.read(path)
    config = model_config(config, source)
    meta = build_meta(
        model_config=config.to_dict(),
        tokenizer=hf.tokenizer_spec(path, config.vocab_size),
        hf_dir=str(path),
        chat_template=hf.chat_template_spec(path),
        **{k: facts[k] for k in ("step", "val_loss", "tokens_seen") if k in facts},
    )
    return check_meta(meta, source), state, source


def load_model(path: str | os.PathLike, device="cpu", _chain: tuple[Path, ...] = ()):
    """(model, meta), model in eval mode, from a run directory, checkpoint file or Hugging Face GPT-2
    directory (gpt/checkpoints/hf.py); a LoRA checkpoint gives its base with the adapters merged in.
    (`_chain`: the LoRA checkpoints whose bases led here, so that a cycle of bases is one line.)"""
    if hf.is_hf_dir(path):
        meta, state, source = _read_hf(path)
    else:
        _check_chain(path, _chain)
        ckpt = read(path, map_location=device)
        if (
            "lora" in ckpt["meta"]
        ):  # adapters only: loaded onto the base they name, merged (gpt/checkpoints/adapters.py)
            return _adapted(ckpt, device, merge_adapters=True, chain=_chain)
        meta, state, source = ckpt["meta"], ckpt["model"], ckpt.source
    return build_model(meta, state, source).to(device).eval(), meta


def _check_chain(path, chain: tuple[Path, ...]) -> None:
    """A base that is one of the LoRA checkpoints leading to it is refused before it is read again."""
    if chain and (here := resolve(path).resolve()) in chain:
        cycle = " -> ".join(map(str, [*chain[chain.index(here) :], here]))
        raise lora.LoRAError(
            f"{chain[0]}: its LoRA bases form a cycle ({cycle}); adapters need a base that holds all the "
            f"weights: give one with `python -m gpt.lora merge --ckpt {chain[0]} --base PATH --out merged.pt`"
        )


def load_checkpoint(path: str | os.PathLike, device="cpu"):
    """(model, tokenizer, meta), model in eval mode: everything sampling needs."""
    model, meta = load_model(path, device)
    return model, get_tokenizer(meta["tokenizer"]), meta


class Inference(NamedTuple):
    rt: Runtime
    model: GPT
    tokenizer: object
    meta: dict
    n_params: int  # counted before quantizing (int8 Linear layers hold no nn.Parameters)


def load_for_inference(
    path: str | os.PathLike,
    device: str = "auto",
    dtype: str = "auto",
    threads: int = 0,
    quantize: str = "none",
    single_stream: bool = False,
) -> Inference:
    """What sample.py, translation, evaluation and the server share: the runtime for --device / --dtype /
    --threads, the checkpoint in that precision, its Linear layers in int8 with --quantize int8, else on
    the CPU laid out for decoding (`gpt.model.packed`).
    `single_stream` (one sequence decoded at a time, sample.py): on CPU without --threads, the thread
    count `decode_threads` picks for the model's size."""
    dtype = dtype_flag(dtype, quantize)
    rt = setup(device, dtype, threads, distributed=False)
    model, tokenizer, meta = load_checkpoint(path, device=rt.device)
    n_params = model.num_params()
    if dtype == "auto":  # inference's rule, which depends on the model's size
        rt.dtype, rt.reason = resolve_dtype(dtype, rt.device, inference_params=n_params)
    if single_stream and rt.device.type == "cpu" and not threads:
        torch.set_num_threads(decode_threads(n_params))
    model = quantize_model(model.to(rt.dtype), quantize)
    return Inference(rt, pack(model) if quantize == "none" else model, tokenizer, meta, n_params)


def _adapted(ckpt: Fields, device="cpu", merge_adapters: bool = True, base=None, chain: tuple[Path, ...] = ()):
    """(model, meta) of a LoRA checkpoint already read: its base loaded, the adapters attached."""
    meta = ckpt["meta"]
    base = Path(base) if base else adapters.find_base(meta["lora"], ckpt.source)
    base_model, _ = load_model(base, device=device, _chain=(*chain, Path(ckpt.source).resolve()))
    model = adapters.attach(base_model, meta["lora"], meta["model_config"], ckpt.source, base)
    lora.load_weights(model, ckpt["model"], ckpt.source)
    model.eval()
    return (lora.merge(model) if merge_adapters else model), meta


def load_adapted(path, device="cpu", merge_adapters: bool = False, base=None):
    """(model, meta) of a LoRA checkpoint: the base plus its adapters, separate or merged, in eval mode;
    `base` overrides the base path the checkpoint names."""
    ckpt = read(path, map_location=device)
    if "lora" not in ckpt["meta"]:
        raise lora.LoRAError(f"{ckpt.source} is not a LoRA checkpoint (it holds all the weights already)")
    return _adapted(ckpt, device, merge_adapters, base)


def base_path(init_from) -> Path:
    """The file (or Hugging Face directory) `--init-from` names, as a LoRA checkpoint records it."""
    return Path(init_from).resolve() if hf.is_hf_dir(init_from) else resolve(init_from).resolve()


def tokenizer_source(path: str | os.PathLike) -> Reused:
    """`--tokenizer-from`: the self-contained tokenizer spec of a dataset, run directory, checkpoint file or
    Hugging Face GPT-2 directory."""
    found = dataset_spec(path)
    if found is not None:
        return found
    if hf.is_hf_dir(path):
        return Reused(hf.tokenizer_spec(path, hf.read_config(path)["vocab_size"]), str(path))
    try:
        return Reused(dict(read_meta(path)["tokenizer"]), str(path))
    except CheckpointError as e:
        raise CheckpointError(f"--tokenizer-from: {e}") from None

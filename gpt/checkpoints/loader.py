"""Loading any checkpoint kind: `locate` decides what a path is, once, and hands it to that kind's reader.

    model, tok, meta = load_checkpoint("out/NAME")    # a run dir (best.pt, else last.pt), a .pt file, a DCP
                                                      # directory or a Hugging Face GPT-2 directory
    model, meta = load_model(path)                    # without the tokenizer
    inf = load_for_inference(path, device, dtype)     # + runtime, precision, int8: sample.py, evaluate, serve
    found = locate(path)                              # Located(kind, path, meta): read nothing twice after it

| kind (`Located.kind`)           | read by                                  |
|---------------------------------|------------------------------------------|
| `pt`: a `.pt` file (`last.pt`, `best.pt`) | `native.read_file` (torch.load weights_only) |
| `dcp`: a DCP directory (`last.dcp`)       | `dcp.read` (its index by `dcp_index`, no unpickler) |
| `hf`: a Hugging Face GPT-2 / GPT-NeoX directory | `hf.read` (safetensors or weights_only)    |
| `lora`: adapters (`meta["lora"]`, in a .pt or DCP) | their base, located and loaded here, + `adapters.attach` |

A run directory is not a kind of its own: `locate` resolves it to its checkpoint (best.pt, else last.pt, or
the DCP twin with the later step). Every kind ends as the same checked meta (`native.check_meta`) and
`native.build_model`. The formats never import this module back: it is the one place that knows them all.
"""

from __future__ import annotations

import os
import warnings
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
from gpt.model import lora, qat
from gpt.model.packed import pack
from gpt.model.quantize import dtype_flag
from gpt.model.quantize import quantize as quantize_model
from gpt.model.quantize import summary as quantize_summary
from gpt.model.rowkernels import whole_step
from gpt.model.transformer import GPT
from gpt.runtime import Runtime, decode_threads, resolve_dtype, setup


class Located(NamedTuple):
    """A checkpoint path as `locate` decided it, once: its kind, what to read, and (but for "hf") its meta."""

    kind: str  # "pt" (a .pt file), "dcp" (a DCP directory), "hf" (a Hugging Face directory), "lora" (adapters)
    path: Path  # the file or directory to read: a run directory's checkpoint, or the path itself
    meta: Fields | None  # checked (`check_meta`); None for "hf", whose meta comes with its weights
    sharded: bool = False  # the weights are a DCP directory ("dcp", or "lora" adapters saved sharded)


def locate(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Located:
    """What `path` is, decided here once: a Hugging Face directory, or a checkpoint (a .pt file, a DCP
    directory, LoRA adapters in either) named directly or through a run directory (the first of `names`
    there, or its DCP twin: the later step of the two). Each candidate's meta is read once."""
    path = Path(path)
    if hf.is_hf_dir(path):
        return Located("hf", path, None)
    sharded = is_sharded(path)
    if path.is_dir() and not sharded:  # a run directory
        for name in names:
            twins = [(path / name, False)] + [(path / SHARDED[name], True)] * (name in SHARDED)  # .pt, DCP twin
            found = [_checkpoint(p, dcp) for p, dcp in twins if (is_sharded(p) if dcp else p.is_file())]
            if found:
                return max(found, key=lambda c: c.meta.get("step", 0))
        raise CheckpointError(_not_a_run(path, names))
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return _checkpoint(path, sharded)


def _checkpoint(path: Path, sharded: bool) -> Located:
    meta = dcp.read_meta(path) if sharded else check_meta(load_file(path, mmap=True)["meta"], path)
    kind = "lora" if "lora" in meta else "dcp" if sharded else "pt"
    return Located(kind, path, meta, sharded)


def trained(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Located:
    """`locate`, for what needs a checkpoint train.py wrote (a Hugging Face directory has no meta of ours)."""
    found = locate(path, names)
    if found.kind == "hf":
        raise CheckpointError(_not_a_run(found.path, names))
    return found


def resolve(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Path:
    """A checkpoint (a file, or a DCP directory) from its path or a run directory (see `locate`)."""
    return trained(path, names).path


def _not_a_run(path: Path, names: tuple[str, ...]) -> str:
    """Why a directory without checkpoints is not a run, and what to pass instead."""
    if is_dataset(path):
        return (
            f"{path} is a prepared dataset, not a training run: give a run directory produced by `gpt train`, "
            f"e.g. out/{path.name} after `gpt train --data {path} --out-dir out/{path.name}`"
        )
    if hf.is_hf_dir(path):
        return (
            f"{path} is a Hugging Face model directory: it holds weights but no training state; fine-tune "
            f"from it with `gpt train --init-from {path} --data DATA --out-dir OUT`"
        )
    return f"no {' or '.join(names)} in {path}: train one with `gpt train --out-dir {path}`"


def read(path: str | os.PathLike | Located, map_location="cpu", names: tuple[str, ...] = BEST_FIRST) -> Fields:
    """The checkpoint dict with `meta` checked and parsed (`check_meta`); never unpickles arbitrary objects."""
    found = path if isinstance(path, Located) else trained(path, names)
    if found.sharded:
        return checked(dcp.read(found.path, map_location), found.path)
    return read_file(found.path, map_location)


def read_meta(path: str | os.PathLike, names: tuple[str, ...] = BEST_FIRST) -> Fields:
    """Only the checked metadata (the tensors are memory-mapped, not read)."""
    return trained(path, names).meta


def _read_hf(path: Path) -> tuple[Fields, dict, Path]:
    """(meta, state dict, source) of a Hugging Face GPT-2 or GPT-NeoX directory."""
    source = path / "config.json"
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


def load_model(path: str | os.PathLike | Located, device="cpu", _chain: tuple[Path, ...] = ()):
    """(model, meta), model in eval mode, from a run directory, checkpoint file or DCP directory, a Hugging
    Face GPT-2 / GPT-NeoX directory (gpt/checkpoints/hf.py), or a `locate`d one; a LoRA checkpoint gives its
    base with the adapters merged in. (`_chain`: the LoRA checkpoints whose bases led here, so that a cycle
    of bases is one line.)"""
    found = path if isinstance(path, Located) else locate(path)
    if found.kind == "hf":
        meta, state, source = _read_hf(found.path)
        return build_model(meta, state, source).to(device).eval(), meta
    if _chain and (here := found.path.resolve()) in _chain:  # refused before it is read again
        cycle = " -> ".join(map(str, [*_chain[_chain.index(here) :], here]))
        raise lora.LoRAError(
            f"{_chain[0]}: its LoRA bases form a cycle ({cycle}); adapters need a base that holds all the "
            f"weights: give one with `gpt lora merge --ckpt {_chain[0]} --base PATH --out merged.pt`"
        )
    ckpt = read(found, map_location=device)
    if found.kind == "lora":  # adapters only: loaded onto the base they name, merged (gpt/checkpoints/adapters.py)
        return _adapted(ckpt, device, merge_adapters=True, chain=_chain)
    return build_model(ckpt["meta"], ckpt["model"], ckpt.source).to(device).eval(), ckpt["meta"]


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
    compile_step: bool = False,
    group_size: int = 32,
    adapters: tuple = (),
) -> Inference:
    """What sample.py, translation, evaluation and the server share: the runtime for --device / --dtype /
    --threads, the checkpoint in that precision, its Linear layers in int8 or int4 with --quantize (int4 in
    groups of `group_size`), and on the CPU (but int4) laid out for decoding (`gpt.model.packed`: our own
    kernels where the machine builds them, `gpt.model.rowkernels`).
    `single_stream` (one sequence decoded at a time, sample.py): on CPU without --threads, the thread
    count `decode_threads` picks for the model's size.
    `compile_step` (`sample.py --compile`): the one-token decode step compiled (`GPT.compile_decoding`) and
    the Linear layers left unpacked (on the CPU the compiled step lays its weights out itself); but not an
    int8 model on a CPU where our kernels take its whole step (`rowkernels.whole_step`): that step is compiled
    C already and decodes faster than Inductor's int8 step (bench/README.md, "Against llama.cpp"), so the
    model is laid out as without it (its `decode_step` stays None).
    `adapters`: LoRA checkpoints of this very model served beside it (`serve_adapters`, `gpt serve --lora`)."""
    if adapters and (quantize != "none" or compile_step):
        raise lora.LoRAError("--lora adapters are served on the model's float weights: leave out --quantize")
    dtype = dtype_flag(dtype, quantize)
    rt = setup(device, dtype, threads, distributed=False)
    model, meta = load_model(path, device=rt.device)
    tokenizer = get_tokenizer(meta["tokenizer"])
    n_params = model.num_params()
    if dtype == "auto":  # inference's rule, which depends on the model's size (and, decoding, on our kernels)
        steps = single_stream and quantize == "none" and rt.device.type == "cpu" and not compile_step
        rt.dtype, rt.reason = resolve_dtype(dtype, rt.device, n_params, bf16_steps=steps and whole_step(model))
    if single_stream and rt.device.type == "cpu" and not threads:
        torch.set_num_threads(decode_threads(n_params))
    warning = qat.mismatch(meta.get("qat"), quantize, group_size)
    if warning:
        warnings.warn(warning, stacklevel=2)
    if adapters:
        serve_adapters(model, list(adapters), rt.device)
    model = quantize_model(model.to(rt.dtype), quantize, group_size)
    if quantize != "none":  # the run's header and summary: "float32 (int8 Linear layers)"
        rt.reason = quantize_summary(model, quantize, group_size)
    if compile_step and not (rt.device.type == "cpu" and quantize == "int8" and whole_step(model)):
        model.compile_decoding()
    elif quantize != "int4":
        pack(model)
    return Inference(rt, model, tokenizer, meta, n_params)


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


def serve_adapters(model: GPT, paths: list, device="cpu") -> None:
    """The LoRA checkpoints `paths` (each of `model`'s very weights) put on `model` side by side, adapters 1..n
    (`gpt.model.lora.serve_side_by_side`; `lora.select` picks one per batch row): `gpt serve --lora`."""
    base = lora.fingerprint(model)
    adapted = []
    for path in paths:
        other, _ = load_adapted(path, device)
        if lora.fingerprint(other) != base:
            raise lora.LoRAError(f"--lora {path}: its base is not the checkpoint served (--ckpt): other weights")
        adapted.append(other)
    lora.serve_side_by_side(model, adapted)


def base_path(init_from: str | os.PathLike | Located) -> Path:
    """The file (or Hugging Face directory) `--init-from` names, as a LoRA checkpoint records it."""
    return (init_from if isinstance(init_from, Located) else locate(init_from)).path.resolve()


def tokenizer_source(path: str | os.PathLike) -> Reused:
    """`--tokenizer-from`: the self-contained tokenizer spec of a dataset, run directory, checkpoint file or
    Hugging Face GPT-2 directory."""
    found = dataset_spec(path)
    if found is not None:
        return found
    try:
        found = locate(path)
    except CheckpointError as e:
        raise CheckpointError(f"--tokenizer-from: {e}") from None
    if found.kind == "hf":
        return Reused(hf.tokenizer_spec(path, hf.read_config(path)["vocab_size"]), str(path))
    return Reused(dict(found.meta["tokenizer"]), str(path))

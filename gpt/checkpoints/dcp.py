"""Sharded checkpoints (`--fsdp`) through `torch.distributed.checkpoint` (DCP), with the promises of
gpt/checkpoints/native.py: atomic, nothing executed on load, exact resume, any number of processes.

    gpt dcp convert --ckpt out/NAME                      # last.dcp / best.dcp -> last.pt / best.pt
    gpt dcp convert --ckpt out/NAME/last.dcp --out model.pt

In the run directory of an FSDP run:

| path                  | what it is                                                                   |
|-----------------------|------------------------------------------------------------------------------|
| `last.dcp`, `best.dcp`| symbolic links to the latest / lowest-val-loss checkpoint directory          |
| `step-000120/`        | one checkpoint: `.metadata` (DCP's index, rank 0), `__R_0.distcp` (process R's shards of the weights and AdamW moments: tensors only), `train.pt` (rank 0: optimizer hyper-parameters, scaler, every process's RNG state, tied-weight names), `meta.json` (the meta of gpt/checkpoints/native.py) |

- **Sharded**: every process writes its own shards; no process gathers the model. The run directory
  must be one every node sees (a shared file system) when the run spans machines.
- **Atomic**: a save goes to `.step-000120.tmp-PID-RANDOM/` and is renamed to `step-000120/` only when every
  shard, `train.pt` and `meta.json` are written and fsynced; then the link `last.dcp` is switched in
  one rename. A failed or killed save never touches the checkpoint `last.dcp` points to; its
  temporary directory is removed (or, after a kill, by the next save). Directories no link points to
  are deleted after each switch.
- **Any number of processes**: DCP stores each tensor's global shape and where each shard sits, so a
  checkpoint written by N processes loads into M: each reads the pieces its own shards need (`load`).
  The optimizer state is keyed by parameter name (DCP's `get_state_dict`), not by position.
- **Pipeline stages** (`--pp`, gpt/train/pipeline.py): each process holds some of the model's parameters
  under their whole-model names and writes those (a tied copy held by two stages is written once, as
  any key several processes hold); `save(..., whole=)` makes train.pt describe the whole model (every
  process's optimizer groups merged in the model's order, its tied names), so such a checkpoint reads
  like any other, and `load(..., whole=)` reads a process's part of a sharded or one-file checkpoint.
- **One process reads it whole** (`read`): the same dict a `.pt` checkpoint holds, so
  `gpt.checkpoints.native.read` / `load_model` (sample.py, `--init-from`, the Hugging Face export, `--resume`
  without `--fsdp`) accept a DCP checkpoint as they are, and `convert` writes it as one file.
- **Nothing executed on load**: DCP's `.metadata` is a pickle; it is read by a pickle machine of our own
  (gpt/checkpoints/dcp_index.py) that can only make instances of DCP's index dataclasses, torch sizes,
  dtypes and layouts, and set only those instances' fields. Shards and `train.pt` are read with
  `weights_only`. Only tensors go into the shards (DCP would pickle anything else).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from gpt.checkpoints import dcp_index, native
from gpt.errors import StorageError, storage_error
from gpt.fsutil import fsync_path, remove_stale_temps, replacing, temp_name

META, TRAIN = "meta.json", "train.pt"


class CheckpointError(native.CheckpointError):
    """A DCP checkpoint that cannot be read or written as asked."""


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader  # lazy: DCP only

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            try:
                metadata = dcp_index.load(Path(self.path))
            except Exception as e:  # a refused name or opcode, a truncated or foreign file: data from disk, any error
                reason = (str(e).splitlines() or [""])[0][:200]
                raise CheckpointError(f"{path} is not a readable DCP checkpoint: {reason}") from None
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _load_shards(state: dict, reader, path: Path, distributed: bool) -> None:
    """DCP's load of `state` from the checkpoint `reader` reads, a damaged shard one line (on every process:
    DCP gathers the failures)."""
    import torch.distributed.checkpoint as tdcp  # lazy: DCP only

    try:
        with _one_process():
            tdcp.load(state, storage_reader=reader, no_dist=not distributed)
    except (Exception, tdcp.CheckpointException) as e:  # CheckpointException is a BaseException
        cause = _failure(e)
        if isinstance(cause, OSError):
            raise storage_error(cause, "read", path) from None
        if isinstance(cause, pickle.UnpicklingError):  # (torch.load's weights_only refusal: pages of advice)
            reason = "a shard holds objects other than tensors, or is damaged"
        else:
            reason = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}"
        raise CheckpointError(f"{path} is not a readable DCP checkpoint: {reason}") from None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _one_process():
    """DCP warns on every save and load without a process group; here that is the intent, not a slip."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied weights: {second name: first name} (lm_head.weight is transformer.wte.weight)."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p in first:
            out[name] = first[p]
        else:
            first[p] = name
    return out


def _by_name(optimizer_state: dict, names: list[str]) -> dict:
    """torch.optim's state dict (parameters by position) keyed by parameter names instead."""
    return {
        "state": {names[i]: s for i, s in optimizer_state["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer_state["param_groups"]],
    }


def _by_index(optimizer_state: dict) -> dict:
    """The reverse of `_by_name`: positions in the order the groups list the names."""
    index = {name: i for i, name in enumerate(n for g in optimizer_state["param_groups"] for n in g["params"])}
    return {
        "state": {index[n]: s for n, s in optimizer_state["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in optimizer_state["param_groups"]],
    }


def read_meta(path: Path) -> native.Fields:
    """The checked meta of a DCP checkpoint directory."""
    try:
        text = (path / META).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / META} cannot be read ({e})") from None
    return native.check_meta(text, path)


def _load_side(path: Path, map_location="cpu") -> tuple[dict, dict]:
    """(meta, train.pt's contents) of a DCP checkpoint directory."""
    meta = read_meta(path)
    try:
        train = torch.load(path / TRAIN, map_location=map_location, weights_only=True)
    except OSError as e:
        raise storage_error(e, "read", path / TRAIN) from None
    except pickle.UnpicklingError:
        raise CheckpointError(f"{path / TRAIN} holds objects other than tensors and plain data; refused") from None
    except Exception as e:  # not a torch file, a truncated one: data from disk
        raise CheckpointError(f"{path / TRAIN} cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    if not _is_train_state(train):
        raise CheckpointError(
            f"{path / TRAIN} is not a checkpoint's training state (param_groups, aliases, rng, scaler)"
        )
    return meta, train


def _is_train_state(train) -> bool:
    """train.pt as `save` writes it: parameter groups naming parameters, tied names, rng and scaler."""

    def strings(xs) -> bool:
        return all(type(x) is str for x in xs)

    return (
        type(train) is dict
        and {"param_groups", "aliases", "rng", "scaler"} <= set(train)
        and type(train["param_groups"]) is list
        and all(
            type(g) is dict and type(g.get("params")) is list and strings(g["params"]) for g in train["param_groups"]
        )
        and type(train["aliases"]) is dict
        and strings(train["aliases"])
        and strings(train["aliases"].values())
    )


def _grouped(param_groups: list[dict]) -> set[str]:
    """The parameter names an optimizer state's groups hold."""
    return {name for g in param_groups for name in g["params"]}


def read(path: str | os.PathLike, map_location="cpu") -> dict:
    """A whole DCP checkpoint, read by this one process, as gpt/checkpoints/native.py's file format holds it:
    `model` (state dict), `optimizer` (torch.optim's, by position), `scaler`, `rng`, `meta` (JSON text)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: DCP only

    path = Path(path)
    meta, train = _load_side(path, map_location)
    reader = _reader(path)
    metadata = reader.read_metadata()
    flat = {
        key: torch.zeros(md.size, dtype=md.properties.dtype, device=map_location)  # (no byte left unset)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    _load_shards(flat, reader, path, distributed=False)
    nested = {"model": {}, "optimizer": {}}
    for key, tensor in flat.items():  # planner_data: each flat key's path in the saved nested dict
        top, name, *rest = metadata.planner_data[key]
        if rest:
            nested[top].setdefault(name, {})[rest[0]] = tensor
        else:
            nested[top][name] = tensor
    model = nested["model"]
    if not set(train["aliases"].values()) <= set(model) or not set(nested["optimizer"]) <= _grouped(
        train["param_groups"]
    ):
        raise CheckpointError(f"{path} is not a readable DCP checkpoint: {TRAIN} names parameters its shards lack")
    model.update({alias: model[name] for alias, name in train["aliases"].items()})
    optimizer = _by_index({"state": nested["optimizer"], "param_groups": train["param_groups"]})
    return {
        "model": model,
        "optimizer": optimizer,
        "scaler": train["scaler"],
        "rng": train["rng"],
        "meta": json.dumps(dict(meta)),
    }


# ---- the training state: save and load, every process taking part ---------------------------------


def load(
    source: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout=None,
    whole: dict | None = None,
) -> native.Fields:
    """Restore `model` and `optimizer` (FSDP-sharded, tensor-parallel, a pipeline stage or whole) from a training
    checkpoint: a DCP directory, each process reading only what its shards need, or a `.pt` file, which each
    process reads whole and keeps its part of. Returns the checkpoint's `meta`, `rng` and `scaler`. Every
    process calls this. `layout`: how the model's state differs from the one-process state checkpoints
    hold (gpt/train/tensor_parallel.py's SavedLayout), None where it does not. `whole` (see `save`): `model`
    holds some of the checkpoint's parameters only (a pipeline stage), and reads those."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: DCP only
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    source = Path(source)
    if not native.is_sharded(source):
        ckpt = native.read_file(source)
        names = {p: n for n, p in model.named_parameters()}
        order = [names[p] for g in optimizer.param_groups for p in g["params"]]
        if whole is not None:  # the file's optimizer counts the whole model's parameters, group by group
            order = [
                n for g in _merged(get_state_dict(model, optimizer)[1]["param_groups"], whole) for n in g["params"]
            ]
        optim_state = _by_name(ckpt["optimizer"], order)
        if whole is not None:
            ckpt = dict(ckpt, model={k: v for k, v in ckpt["model"].items() if k in model.state_dict()})
            optim_state = _part(optim_state, set(names.values()))
        model_state = ckpt["model"]
        if layout is not None:
            model_state, optim_state["state"] = layout.from_whole(model_state, optim_state["state"])
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=StateDictOptions(full_state_dict=True),
        )
        return ckpt

    meta, train = _load_side(source)
    reader = _reader(source)
    reader.read_metadata()  # checked here, where a refusal is one line (inside DCP's load it is wrapped)
    model_state, optim_state = get_state_dict(model, optimizer)  # the shapes and shards to fill
    mine, saved = _grouped(optim_state["param_groups"]), _grouped(train["param_groups"])
    if mine != saved and not (whole is not None and mine <= saved):
        raise CheckpointError(f"{source / TRAIN}: its optimizer's parameter groups are not this model's")
    if whole is not None:
        train = dict(train, param_groups=_part(train, mine)["param_groups"])
    aliases = _aliases(model)
    state = {"model": {k: v for k, v in model_state.items() if k not in aliases}, "optimizer": optim_state["state"]}
    like = state
    if layout is not None:
        state = dict(zip(("model", "optimizer"), layout.placeholders(state["model"], state["optimizer"])))
    _load_shards(state, reader, source, distributed=_distributed())
    if layout is not None:
        state = {part: layout.restored(state[part], like[part]) for part in state}
    state["model"].update({alias: state["model"][name] for alias, name in aliases.items()})
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={"state": state["optimizer"], "param_groups": train["param_groups"]},
    )
    return native.Fields({"meta": meta, "rng": train["rng"], "scaler": train["scaler"]}, source)


def save(
    link: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    scaler: dict | None,
    rng,
    layout=None,
    whole: dict | None = None,
) -> None:
    """Write a sharded checkpoint of `model` and `optimizer` into a new `step-NNNNNN/` beside `link`
    (run_dir/last.dcp), then point `link` at it (see the module notes). Every process calls this;
    `meta` (gpt.checkpoints.native.build_meta), `scaler` and `rng` (every process's) are written by rank 0. A
    failure on any process is one StorageError on all of them, the previous checkpoint intact. `layout`: as
    `load`'s; the state is written in the one-process layout whatever the model's.

    `whole`, where each process holds other parameters of one model (pipeline stages: gpt/train/pipeline.py):
    {"names": the whole model's parameter names in its order, "aliases": its tied names}. train.pt then
    describes the whole model: every process's optimizer groups merged in that order, as one process's."""
    import torch.distributed.checkpoint as tdcp  # lazy: DCP only
    from torch.distributed.checkpoint import FileSystemWriter  # lazy: DCP only
    from torch.distributed.checkpoint.state_dict import get_state_dict  # lazy: DCP only

    link = Path(link)
    run_dir, distributed = link.parent, _distributed()
    master = not distributed or dist.get_rank() == 0
    names = [None, None]
    if master:
        remove_stale_temps(run_dir)
        final = _free_name(run_dir, meta["step"])
        names = [temp_name(run_dir / final).name, final]
    if distributed:
        dist.broadcast_object_list(names, src=0)
    tmp, final = run_dir / names[0], names[1]
    model_state, optim_state = get_state_dict(model, optimizer)  # this process's shards (DTensors under FSDP)
    aliases = _aliases(model)
    state = {"model": {k: v for k, v in model_state.items() if k not in aliases}, "optimizer": optim_state["state"]}
    if layout is not None:
        state = dict(zip(("model", "optimizer"), layout.saved(state["model"], state["optimizer"])))
    groups = optim_state["param_groups"] if whole is None else _merged(optim_state["param_groups"], whole)
    error = None
    try:
        with _one_process():
            tdcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not distributed)
    except (Exception, tdcp.CheckpointException) as e:  # CheckpointException is a BaseException
        error = _failure(e)
    if master and error is None:
        try:
            _write_side(
                tmp,
                meta,
                dict(
                    param_groups=groups,
                    aliases=aliases if whole is None else whole["aliases"],
                    scaler=scaler,
                    rng=rng,
                ),
            )
            os.rename(tmp, run_dir / final)
            fsync_path(run_dir)
            point(link, final)
        except OSError as e:
            error = e
    if master and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    message = [None]
    if error is not None:
        kept = f"the previous {link.name} is intact" if link.exists() else "nothing was written"
        message = [
            str(storage_error(error, "write checkpoint", run_dir / final, kept))
            if isinstance(error, OSError)
            else f"could not write checkpoint {run_dir / final}: {error}; {kept}"
        ]
    if distributed:
        dist.broadcast_object_list(message, src=0)  # rank 0 heard of every failure (DCP gathers them)
    if message[0]:
        raise StorageError(message[0])


def _merged(param_groups: list[dict], whole: dict) -> list[dict]:
    """Every process's optimizer groups (named parameters) as one: group by group, each group's names in the
    whole model's order, a name held by several processes (a tied copy, a data replica) once. Collective."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, param_groups)
    assert len({len(groups) for groups in every}) == 1, "the processes' optimizers have different groups"
    rank = {name: i for i, name in enumerate(whole["names"])}
    return [
        dict(group, params=sorted({n for groups in every for n in groups[i]["params"]}, key=rank.__getitem__))
        for i, group in enumerate(every[0])
    ]


def _part(optimizer_state: dict, names: set[str]) -> dict:
    """An optimizer state keyed by names, cut down to `names`."""
    state = {n: s for n, s in optimizer_state.get("state", {}).items() if n in names}
    groups = [dict(g, params=[n for n in g["params"] if n in names]) for g in optimizer_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def _failure(e: BaseException) -> BaseException:
    """The first underlying error of a DCP failure (an OSError where there is one)."""
    causes = [exc for exc, _trace in getattr(e, "failures", {}).values()] or [e]
    return next((c for c in causes if isinstance(c, OSError)), causes[0])


def _free_name(run_dir: Path, step: int) -> str:
    name = f"step-{step:06d}"
    n = 0
    while os.path.lexists(run_dir / name):  # the same step saved again (a resumed run), or a link: a new name
        n += 1
        name = f"step-{step:06d}.{n}"
    return name


def _write_side(directory: Path, meta: dict, train: dict) -> None:
    """train.pt, then meta.json (what marks the directory complete), each fsynced."""
    with open(directory / TRAIN, "wb") as f:
        torch.save(train, f)
        f.flush()
        os.fsync(f.fileno())
    with open(directory / META, "w", encoding="utf-8") as f:
        json.dump({"format": native.FORMAT_VERSION, **meta}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)


def point(link: Path, target: str) -> None:
    """Make `link` a symbolic link to `target` (a name in the same directory) in one atomic rename, then
    delete the checkpoint directories no link points to any more."""
    with replacing(link) as tmp:
        os.symlink(target, tmp)  # relative: the run directory may move
    fsync_path(link.parent)
    links = [os.path.join(link.parent, name) for name in native.SHARDED.values()]
    kept = {os.readlink(p) for p in links if os.path.islink(p)}  # (os.path: nothing a loaded file set decides it)
    for d in link.parent.glob("step-*"):
        if d.name not in kept and os.path.isdir(d) and not os.path.islink(d):
            shutil.rmtree(d, ignore_errors=True)


def mark_best(run_dir: str | os.PathLike) -> None:
    """best.dcp := the checkpoint last.dcp points to (no copy)."""
    run_dir = Path(run_dir)
    point(run_dir / native.SHARDED["best.pt"], os.readlink(run_dir / native.SHARDED["last.pt"]))

"""The checks on DCP's index once `gpt.checkpoints.dcp_index` has read it: what gpt's own sharded checkpoints hold.

    check(metadata, step_dir)   # ValueError naming the first part that is not what gpt writes

Each part is looked at once (the reader lets no container or instance be shared). An entry's chunks must
hold exactly its tensor's elements (DCP's chunks tile their tensor: more would be read and copied twice,
fewer would leave a hole) and a shard's regions no more than the shard, so DCP reads and copies no byte
twice; the tensors together are no larger than the shards on disk, so an index cannot make a reader
allocate more memory than the checkpoint takes. Messages show a string of the file cut short, or only an
object's type (`show`): a repr could walk a structure far larger than the text that made it.
"""

from __future__ import annotations

import math
import pathlib
from pathlib import Path

import torch


def show(x) -> str:
    """An object of the file in a message: a string, cut short, or else only its type's name."""
    return repr(x if len(x) <= 60 else x[:60] + "...") if type(x) is str else f"a {type(x).__name__}"


def check(metadata, directory: Path) -> None:
    """The index holds what gpt's DCP checkpoints hold, each part of its type (ValueError otherwise): tensor
    entries only, each with a path in the saved state dict (`planner_data`), stored in files of the
    checkpoint's own directory within their sizes, and no more tensor bytes than those files hold (an
    index cannot make a reader allocate more memory than the checkpoint takes on disk)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # lazy: DCP only
    from torch.distributed.checkpoint.metadata import (  # lazy: DCP only
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if type(metadata) is not Metadata:
        raise ValueError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    entries, paths = getattr(metadata, "state_dict_metadata", None), metadata.planner_data
    if type(entries) is not dict or not all(type(md) is TensorStorageMetadata for md in entries.values()):
        raise ValueError("an entry other than a tensor")
    tensor_bytes = 0
    for key, md in entries.items():  # (each part once: the unpickler lets no container or instance be shared)
        where = paths.get(key) if type(paths) is dict and type(key) is str else None
        if (
            type(where) is not tuple
            or len(where) not in (2, 3)
            or not all(type(p) is str for p in where)
            or where[0] not in ("model", "optimizer")
        ):
            raise ValueError(f"entry {show(key)} has no place in the saved state dict")
        props, size, chunks = (getattr(md, f, None) for f in ("properties", "size", "chunks"))
        if type(props) is not TensorProperties or type(size) is not torch.Size or type(chunks) is not list:
            raise ValueError(f"entry {show(key)} is not a tensor's description")
        held = 0
        for c in chunks:
            offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if (
                type(c) is not ChunkStorageMetadata
                or type(offsets) is not torch.Size
                or type(sizes) is not torch.Size
                or not len(offsets) == len(sizes) == len(size)
                or any(o + s > n for o, s, n in zip(offsets, sizes, size))
            ):
                raise ValueError(f"entry {show(key)} has a chunk outside the tensor")
            held += math.prod(sizes)
        if held != math.prod(size):  # DCP's chunks tile their tensor: more is read twice, less leaves a hole
            raise ValueError(
                f"entry {show(key)} has chunks holding {'more' if held > math.prod(size) else 'less'} than the tensor"
            )
        tensor_bytes += math.prod(size) * props.dtype.itemsize
    storage, files, used = metadata.storage_data, {}, {}
    if type(storage) is not dict:
        raise ValueError("no storage table")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if type(index) is not MetadataIndex or type(index.offset) is not torch.Size or type(info) is not _StorageInfo:
            raise ValueError(f"storage {show(name)} is not a file in the checkpoint's directory")
        if name not in files:  # (each name checked once: a shard holds many regions)
            if type(name) is not str or name in ("", ".", "..") or ("/" in name or "\\" in name):
                raise ValueError(f"storage {show(name)} is not a file in the checkpoint's directory")
            try:
                files[name] = (directory / name).stat().st_size
            except OSError:
                raise ValueError(f"storage {show(name)} is missing") from None
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(start) is not int or type(length) is not int or start < 0 or length < 0 or start + length > files[name]:
            raise ValueError(f"storage {show(name)} is read past its end")
        used[name] = used.get(name, 0) + length
        if used[name] > files[name]:  # (DCP's regions of a shard do not overlap: none is read twice)
            raise ValueError(f"storage {show(name)} has regions adding up to more than its {files[name]:,} bytes")
        if getattr(info, "transform_descriptors", None) not in (None, [], ()):
            raise ValueError(f"storage {show(name)} names transforms (gpt writes none)")
    stored = {(index.fqn, tuple(index.offset)) for index in storage}  # (no two of one hash: see _setitems)
    missing = [key for key, md in entries.items() for c in md.chunks if (key, tuple(c.offsets)) not in stored]
    if missing:
        raise ValueError(f"entry {show(missing[0])} has a chunk stored nowhere")
    if tensor_bytes > sum(files.values()):
        raise ValueError(f"its tensors ({tensor_bytes:,} bytes) are larger than its shards ({sum(files.values()):,})")
    meta = metadata.storage_meta
    if meta is not None and (
        type(meta) is not StorageMeta
        or not isinstance(meta.checkpoint_id, (str, pathlib.PurePath, type(None)))
        or not all(isinstance(v, (str, type(None))) for v in (meta.save_id, meta.load_id))
        or type(getattr(meta, "modules", None)) is not list
        or not all(type(m) is str for m in meta.modules)
    ):
        raise ValueError("storage_meta of the wrong type")
    if metadata.version is not None and type(metadata.version) is not str:
        raise ValueError("version of the wrong type")

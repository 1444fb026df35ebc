"""DCP's index (a checkpoint directory's `.metadata`, a pickle) read without running anything the file says.

    metadata = dcp_index.load(step_dir)   # its .metadata: torch.distributed.checkpoint's Metadata, checked

Python's unpickler cannot be made safe by restricting the names it looks up: its BUILD opcode sets
attributes on whatever object is on the stack, so a file naming an allowed class or function could
rewrite it for the whole process (`pathlib.PosixPath.is_symlink`, `torch.serialization._get_layout.cache`).
torch's own `weights_only` unpickler cannot read the protocol-4 opcodes DCP writes. So this module is a
small pickle machine of its own, which knows only what DCP's index of a checkpoint of tensors holds:

- Opcodes: those `pickle.dump` writes for such an index (protocols 2 to 5); any other is refused, among
  them INST, OBJ, NEWOBJ_EX, persistent ids and the extension registry (EXT1/2/4).
- Names (GLOBAL, STACK_GLOBAL) are looked up in a fixed table of exact (module, name) pairs: nothing is
  imported and no attribute is read. A dtype is a value; any other name gives an opaque `_Name` that
  only NEWOBJ and REDUCE accept, so no class or function reaches any other opcode or the result.
- NEWOBJ makes an empty instance of one of DCP's index dataclasses; BUILD fills it once: only an instance
  NEWOBJ made and no BUILD filled yet, with that dataclass's fields only, each value of its field's type
  (`fqn` a str, `offset` a torch.Size or None...). Nothing is built on any other object, and the file
  ends with every instance filled.
- REDUCE calls only value constructors with checked plain arguments: `torch.Size` (ints), the memory
  format's enum (an int), a layout by name, a pure path (strings), an empty `OrderedDict`.
- Not `BytesStorageMetadata`: DCP loads such an entry with `torch.load(weights_only=False)`, which runs
  code; our checkpoints hold tensors only. `check` (gpt/checkpoints/dcp_check.py) then refuses an index
  whose parts have the wrong types, storage outside the checkpoint's directory, or tensors larger than
  its shards.

No object a file builds costs more to read, check or report than the bytes that made it:

- Each container and each instance is referenced once: the memo gives back only strings, numbers,
  names, sizes and paths (DCP shares nothing else), so `t = (t, t)` cannot double at a few bytes a level.
- Objects nest at most 16 deep (DCP's index is 6): nothing recursive (hash, repr, ==) runs out of stack.
- No two keys of one dict have the same hash: an int hashes to itself (modulo 2**61 - 1), so a file could
  otherwise give a dict of DCP's `MetadataIndex` keys one hash and make each insertion compare them all.
- Strings and paths hold at most 4,096 characters, a size at most 64 dimensions below 2**63: each
  comparison of a name shared by many parts is short.
- Messages name types and positions, never format an object of the file (a repr walks every path).
- `check` looks at each part once (dcp_check.py says what it bounds).
"""

from __future__ import annotations

import pathlib
import pickle
import struct
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from gpt.checkpoints.dcp_check import check

_OPNAMES = {  # opcode -> its name in the pickle module, for messages
    getattr(pickle, n)[0]: n
    for n in dir(pickle)
    if isinstance(getattr(pickle, n), bytes) and len(getattr(pickle, n)) == 1
}


MAX_DEPTH = 16  # how deep objects nest (DCP's index: Metadata > dict > entry > chunk list > chunk > size)
MAX_CHARS = 4096  # a string's or a path's characters (names and paths; PATH_MAX on Linux)
MAX_DIMS = 64  # a torch.Size's dimensions


class _Name:
    """A class or function a pickle names: only NEWOBJ (`new`) or REDUCE (`call`) can use it."""

    __slots__ = ("label", "new", "call")

    def __init__(self, label: str, new=None, call=None):
        self.label, self.new, self.call = label, new, call

    def __repr__(self) -> str:
        return self.label


def _size(*args):
    if (
        len(args) == 1
        and type(args[0]) is tuple
        and len(args[0]) <= MAX_DIMS
        and all(type(n) is int and 0 <= n < 2**63 for n in args[0])
    ):
        return torch.Size(args[0])
    raise ValueError(f"torch.Size takes a tuple of at most {MAX_DIMS} sizes below 2**63")


def _strings(*args) -> tuple[str, ...]:
    if not all(type(a) is str for a in args):
        raise ValueError("a path is made of strings")
    if sum(map(len, args)) > MAX_CHARS:
        raise ValueError(f"a path of more than {MAX_CHARS:,} characters")
    return args


def _ordered_dict(*args):
    if args:
        raise ValueError("an OrderedDict is filled by SETITEMS, not by arguments")
    return OrderedDict()


@lru_cache(maxsize=1)
def _names() -> dict[tuple[str, str], object]:
    """(module, name) -> what a pickle may name. Built on first use from modules already imported (dcp.py's
    readers import DCP's); the dtypes and layouts come from torch's namespace as it is, read without
    `getattr` (which would import a lazily loaded submodule)."""
    from torch.distributed.checkpoint import filesystem  # lazy: DCP only
    from torch.distributed.checkpoint import metadata as md  # lazy: DCP only

    formats = {m.value: m for m in md._MEM_FORMAT_ENCODING}

    def enum(*args):
        if len(args) == 1 and type(args[0]) is int and args[0] in formats:
            return formats[args[0]]
        raise ValueError("a memory format is one of DCP's numbers for them")

    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}

    def layout(*args):
        if len(args) == 1 and type(args[0]) is str and args[0] in layouts:
            return layouts[args[0]]
        raise ValueError("a layout is named by one of torch's layouts")

    classes = [md.Metadata, md.TensorStorageMetadata, md.TensorProperties, md.ChunkStorageMetadata]
    classes += [md.MetadataIndex, md.StorageMeta, filesystem._StorageInfo]
    table = {(c.__module__, c.__name__): _Name(c.__name__, new=c) for c in classes}
    calls = {
        ("torch", "Size"): _size,
        (md.__name__, "_MEM_FORMAT_ENCODING"): enum,
        ("torch.serialization", "_get_layout"): layout,
        ("collections", "OrderedDict"): _ordered_dict,
    }
    for module in ("pathlib", "pathlib._local"):  # (Python 3.13 moved the classes)
        calls[(module, "PosixPath")] = calls[(module, "PurePosixPath")] = lambda *a: pathlib.PurePosixPath(
            *_strings(*a)
        )
        calls[(module, "WindowsPath")] = calls[(module, "PureWindowsPath")] = lambda *a: pathlib.PureWindowsPath(
            *_strings(*a)
        )
    table.update({key: _Name(".".join(key), call=f) for key, f in calls.items()})
    table.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return table


@lru_cache(maxsize=1)
def _fields() -> dict[type, dict[str, tuple[type, ...]]]:
    """DCP's index dataclasses (but TensorProperties, which sets its own state) -> each field -> the types its
    value may have. A field DCP adds later is refused until it is named here."""
    from torch.distributed.checkpoint import filesystem  # lazy: DCP only
    from torch.distributed.checkpoint import metadata as md  # lazy: DCP only

    size, none, path = torch.Size, type(None), (PurePosixPath, PureWindowsPath)
    return {
        md.Metadata: {
            "state_dict_metadata": (dict,),
            "planner_data": (dict, none),
            "storage_data": (dict, none),
            "storage_meta": (md.StorageMeta, none),
            "version": (str, none),
        },
        md.TensorStorageMetadata: {"properties": (md.TensorProperties,), "size": (size,), "chunks": (list,)},
        md.ChunkStorageMetadata: {"offsets": (size,), "sizes": (size,)},
        md.MetadataIndex: {"fqn": (str,), "offset": (size, none), "index": (int, none)},
        md.StorageMeta: {
            "checkpoint_id": (str, *path, none),
            "save_id": (str, none),
            "load_id": (str, none),
            "modules": (list,),
        },
        filesystem._StorageInfo: {
            "relative_path": (str,),
            "offset": (int,),
            "length": (int,),
            "transform_descriptors": (list, tuple, none),
        },
    }


def _properties_state(state) -> bool:
    """TensorProperties' state: (dtype, layout, requires_grad, memory format, pin_memory), each of its type."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING  # lazy: DCP only

    return (
        type(state) is tuple
        and len(state) == 5
        and [type(v) for v in state] == [torch.dtype, torch.layout, bool, _MEM_FORMAT_ENCODING, bool]
    )


class _Unpickler:
    """The pickle machine (see the module notes); `load` returns the object or raises UnpicklingError."""

    def __init__(self, data: bytes):
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING  # lazy: DCP only

        self.data, self.pos = memoryview(data), 0
        self.stack: list = []
        self.marks: list[list] = []
        self.memo: dict[int, object] = {}
        self.names, self.fields = _names(), _fields()
        self.classes = {n.new for n in self.names.values() if isinstance(n, _Name) and n.new}
        self.index = self.names[("torch.distributed.checkpoint.metadata", "MetadataIndex")].new
        self.shared = {str, int, float, bool, type(None), _Name, torch.dtype, torch.layout, _MEM_FORMAT_ENCODING}
        self.shared |= {torch.Size, PurePosixPath, PureWindowsPath}  # what the memo gives back: DCP shares no more
        self.nested = {tuple, list, dict, OrderedDict, torch.Size, *self.classes}  # what has a depth
        self.depths: dict[int, int] = {}  # id of a nested object -> how deep it nests, where more than 1
        self.hashes: dict[int, set[int]] = {}  # id of a dict -> its keys' hashes, once it has keys
        self.unfilled: dict[int, object] = {}  # id -> an instance NEWOBJ made that no BUILD filled yet

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise pickle.UnpicklingError("the file ends in the middle of an opcode")
        out = self.data[self.pos : self.pos + n].tobytes()
        self.pos += n
        return out

    def line(self) -> str:
        end = bytes(self.data[self.pos : self.pos + 512]).find(b"\n")
        if end < 0:
            raise pickle.UnpicklingError("a GLOBAL name without its end of line")
        return self.take(end + 1)[:-1].decode("utf-8")

    def number(self, fmt: str) -> int | float:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def pop_mark(self) -> list:
        items, self.stack = self.stack, self.marks.pop()
        return items

    def lookup(self, module: str, name: str):
        named = type(module) is str and type(name) is str
        found = self.names.get((module, name)) if named else None
        if found is None:
            what = f"{module[:100]}.{name[:100]}" if named else "a name that is not a string"
            raise pickle.UnpicklingError(f"{what} is not allowed in a checkpoint's .metadata")
        return found

    def depth(self, x) -> int:
        return self.depths.get(id(x), 1) if type(x) in self.nested else 0

    def made(self, obj, items=(), at_least: int = 1) -> None:
        """Note how deep `obj` nests, just made of `items` (or grown by them: then `at_least` is its depth). Every
        nested object passes here when it is made, which clears what a dead one with its id left."""
        depth = max(at_least, 1 + max(map(self.depth, items), default=0))
        if depth > MAX_DEPTH:
            raise pickle.UnpicklingError(f"objects nested more than {MAX_DEPTH} deep")
        if depth > 1:
            self.depths[id(obj)] = depth
        else:  # (most objects: no entry)
            self.depths.pop(id(obj), None)

    def build(self, state) -> None:
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self.classes:
            what = inst.label if isinstance(inst, _Name) else f"a {cls.__name__}"
            raise pickle.UnpicklingError(f"BUILD on {what} is not allowed in a checkpoint's .metadata")
        if self.unfilled.pop(id(inst), None) is not inst:  # (else a key already hashed could change)
            raise pickle.UnpicklingError(f"BUILD on a {cls.__name__} that a BUILD filled already")
        if cls.__name__ == "TensorProperties":  # its own __setstate__, from (dtype, layout, grad, format, pin)
            if not _properties_state(state):
                raise pickle.UnpicklingError("TensorProperties' state is not its 5 fields of their types")
            inst.__setstate__(state)
            self.made(inst)
            return
        fields = self.fields[cls]
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            raise pickle.UnpicklingError(f"{cls.__name__}'s state is not a dict of its fields")
        for name, value in state.items():
            if type(value) not in fields[name]:
                raise pickle.UnpicklingError(f"{cls.__name__}'s {name} is a {type(value).__name__}")
        inst.__dict__.update(state)  # (the fields themselves: no __setattr__, as pickle does)
        self.made(inst, state.values())

    def load(self):
        ops = _DISPATCH
        while True:
            if self.pos >= len(self.data):
                raise pickle.UnpicklingError("the file ends before its STOP opcode")
            code = self.data[self.pos]
            self.pos += 1
            op = ops.get(code)
            if op is None:
                name = _OPNAMES.get(code, f"0x{code:02x}")
                raise pickle.UnpicklingError(f"pickle opcode {name} is not allowed in a checkpoint's .metadata")
            if op(self):
                return self.stack.pop()


def _new(u: _Unpickler, obj, items=()) -> None:
    """Push what an opcode made (of `items`), noting how deep it nests; a dict starts with no keys' hashes."""
    u.hashes.pop(id(obj), None)
    u.made(obj, items)
    u.stack.append(obj)  # (u.stack read after `obj` is made: popping a mark replaces the stack)


def _named(obj) -> str:
    return obj.label if isinstance(obj, _Name) else f"a {type(obj).__name__}"


def _newobj(u: _Unpickler) -> None:
    args, cls = u.stack.pop(), u.stack.pop()
    if not isinstance(cls, _Name) or cls.new is None or type(args) is not tuple or args:
        raise pickle.UnpicklingError(f"NEWOBJ of {_named(cls)} is not allowed in a checkpoint's .metadata")
    inst = object.__new__(cls.new)
    u.unfilled[id(inst)] = inst
    _new(u, inst)


def _reduce(u: _Unpickler) -> None:
    args, func = u.stack.pop(), u.stack.pop()
    if not isinstance(func, _Name) or func.call is None or type(args) is not tuple:
        raise pickle.UnpicklingError(f"REDUCE of {_named(func)} is not allowed in a checkpoint's .metadata")
    _new(u, func.call(*args))


def _setitems(u: _Unpickler, items: list) -> None:
    target = u.stack[-1]
    if type(target) not in (dict, OrderedDict) or len(items) % 2:
        raise pickle.UnpicklingError(f"SETITEMS on a {type(target).__name__}")
    hashes = u.hashes.setdefault(id(target), set())
    for i in range(0, len(items), 2):
        key = items[i]  # a str or an index of DCP's, its fields typed by BUILD: hashed safely
        if type(key) is not str and not (type(key) is u.index and type(getattr(key, "fqn", None)) is str):
            raise pickle.UnpicklingError(f"a dict key of type {type(key).__name__} in a checkpoint's .metadata")
        h = hash(key)
        if h in hashes:  # (a dict would compare each new key with every key of that hash)
            raise pickle.UnpicklingError("two keys of one dict have the same hash")
        hashes.add(h)
        target[key] = items[i + 1]
    u.made(target, items, at_least=u.depth(target))


def _append(u: _Unpickler, items: list) -> None:
    target = u.stack[-1]
    if type(target) is not list:
        raise pickle.UnpicklingError(f"APPEND to a {type(target).__name__}")
    target.extend(items)
    u.made(target, items, at_least=u.depth(target))


def _tuple(u: _Unpickler, n: int) -> None:
    if len(u.stack) < n:
        raise pickle.UnpicklingError("a tuple of more items than the stack holds")
    items = tuple(u.stack[len(u.stack) - n :])
    del u.stack[len(u.stack) - n :]
    _new(u, items, items)


def _tuple_to_mark(u: _Unpickler) -> None:
    items = u.pop_mark()
    _new(u, tuple(items), items)


def _mark(u: _Unpickler) -> None:
    u.marks.append(u.stack)
    u.stack = []


def _memo_put(u: _Unpickler, index: int) -> None:
    u.memo[index] = u.stack[-1]


def _memo_get(u: _Unpickler, index: int) -> None:
    if index not in u.memo:
        raise pickle.UnpicklingError(f"memo entry {index} was never stored")
    obj = u.memo[index]
    if type(obj) not in u.shared:
        raise pickle.UnpicklingError(
            f"memo entry {index} holds a {type(obj).__name__}: only strings, numbers, names, sizes and paths are "
            "referenced twice"
        )
    u.stack.append(obj)


def _string(u: _Unpickler, fmt: str) -> None:
    text = u.take(u.number(fmt)).decode("utf-8", "surrogatepass")
    if len(text) > MAX_CHARS:
        raise pickle.UnpicklingError(f"a string of more than {MAX_CHARS:,} characters")
    u.stack.append(text)


def _stack_global(u: _Unpickler) -> None:
    name, module = u.stack.pop(), u.stack.pop()
    u.stack.append(u.lookup(module, name))


def _stop(u: _Unpickler) -> bool:
    if len(u.stack) != 1 or u.marks:
        raise pickle.UnpicklingError("STOP with a stack of other than one object")
    if u.unfilled:
        cls = type(next(iter(u.unfilled.values())))
        raise pickle.UnpicklingError(f"a {cls.__name__} that no BUILD filled")
    return True


_DISPATCH = {
    pickle.PROTO[0]: lambda u: u.take(1) and None,
    pickle.FRAME[0]: lambda u: u.take(8) and None,  # (frames only help a streaming reader: the file is read whole)
    pickle.STOP[0]: _stop,
    pickle.MARK[0]: _mark,
    pickle.NONE[0]: lambda u: u.stack.append(None),
    pickle.NEWTRUE[0]: lambda u: u.stack.append(True),
    pickle.NEWFALSE[0]: lambda u: u.stack.append(False),
    pickle.BININT[0]: lambda u: u.stack.append(u.number("<i")),
    pickle.BININT1[0]: lambda u: u.stack.append(u.number("<B")),
    pickle.BININT2[0]: lambda u: u.stack.append(u.number("<H")),
    pickle.LONG1[0]: lambda u: u.stack.append(int.from_bytes(u.take(u.number("<B")), "little", signed=True)),
    pickle.BINFLOAT[0]: lambda u: u.stack.append(u.number(">d")),
    pickle.SHORT_BINUNICODE[0]: lambda u: _string(u, "<B"),
    pickle.BINUNICODE[0]: lambda u: _string(u, "<I"),
    pickle.BINUNICODE8[0]: lambda u: _string(u, "<Q"),
    pickle.EMPTY_TUPLE[0]: lambda u: _new(u, ()),
    pickle.TUPLE1[0]: lambda u: _tuple(u, 1),
    pickle.TUPLE2[0]: lambda u: _tuple(u, 2),
    pickle.TUPLE3[0]: lambda u: _tuple(u, 3),
    pickle.TUPLE[0]: _tuple_to_mark,
    pickle.EMPTY_LIST[0]: lambda u: _new(u, []),
    pickle.APPEND[0]: lambda u: _append(u, [u.stack.pop()]),
    pickle.APPENDS[0]: lambda u: _append(u, u.pop_mark()),
    pickle.EMPTY_DICT[0]: lambda u: _new(u, {}),
    pickle.SETITEM[0]: lambda u: _setitems(u, [u.stack.pop(-2), u.stack.pop()]),
    pickle.SETITEMS[0]: lambda u: _setitems(u, u.pop_mark()),
    pickle.MEMOIZE[0]: lambda u: _memo_put(u, len(u.memo)),
    pickle.BINPUT[0]: lambda u: _memo_put(u, u.number("<B")),
    pickle.LONG_BINPUT[0]: lambda u: _memo_put(u, u.number("<I")),
    pickle.BINGET[0]: lambda u: _memo_get(u, u.number("<B")),
    pickle.LONG_BINGET[0]: lambda u: _memo_get(u, u.number("<I")),
    pickle.GLOBAL[0]: lambda u: u.stack.append(u.lookup(u.line(), u.line())),
    pickle.STACK_GLOBAL[0]: _stack_global,
    pickle.NEWOBJ[0]: _newobj,
    pickle.REDUCE[0]: _reduce,
    pickle.BUILD[0]: lambda u: u.build(u.stack.pop()),
}


def load(directory: Path):
    """The checked index of the DCP checkpoint in `directory`; any problem raises (an OSError, an
    UnpicklingError, a ValueError...): the caller makes it one line."""
    metadata = _Unpickler(Path(directory, ".metadata").read_bytes()).load()
    check(metadata, Path(directory))
    return metadata

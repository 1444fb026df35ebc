"""DCP's index read by gpt/checkpoints/dcp_index.py: what a hostile `.metadata` may cost. Each pickle here is written
opcode by opcode, as an attacker would; tests/test_dcp.py has the pickles that would run code or rewrite a class."""

import shutil
import struct
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from test_dcp import MOD, _global, _u, save, trained
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from gpt.checkpoints import dcp_index, loader, native


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory with one real DCP checkpoint (step-000002), copied by each test that rewrites it."""
    run = tmp_path_factory.mktemp("saved")
    save(run, *trained(), step=2)
    return run


def planted(saved, tmp_path, body: bytes):
    """A copy of the saved run whose .metadata is `body` between PROTO 4 and STOP."""
    run = tmp_path / "run"
    shutil.copytree(saved, run, symlinks=True)
    (run / "step-000002" / ".metadata").write_bytes(b"\x80\x04" + body + b".")
    return run


def index_of(tmp_path, body: bytes):
    """`dcp_index.load` of a directory holding only a .metadata of `body`: what it raises."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + body + b".")
    with pytest.raises(Exception) as e:
        dcp_index.load(tmp_path)
    return str(e.value)


# ---- opcodes ------------------------------------------------------------------------------------------------


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n) if n < 2**31 else b"\x8a\x08" + n.to_bytes(8, "little")  # BININT, LONG1


def _size(*ns: int) -> bytes:  # torch.Size(ns): REDUCE
    return _global("torch", "Size") + b"(" + b"".join(map(_int, ns)) + b"t\x85R"


def _obj(cls: str, *fields: tuple[str, bytes]) -> bytes:  # NEWOBJ of one of DCP's classes, BUILD with a dict
    module = "torch.distributed.checkpoint.filesystem" if cls == "_StorageInfo" else MOD
    return _global(module, cls) + b")\x81" + _dict(*fields) + b"b"


def _dict(*items: tuple[bytes | str, bytes]) -> bytes:  # EMPTY_DICT MARK key value ... SETITEMS
    pairs = (_u(k) if isinstance(k, str) else k for k, _ in items)
    return b"}(" + b"".join(k + v for k, (_, v) in zip(pairs, items)) + b"u"


MEMOIZE, TUPLE1, TUPLE2, NEWOBJ, REDUCE = b"\x94", b"\x85", b"\x86", b"\x81", b"R"


def _get(i: int) -> bytes:  # BINGET or LONG_BINGET
    return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)


# ---- the three files of issue 42 ----------------------------------------------------------------------------


def rebuilt_key() -> bytes:
    """A MetadataIndex put in a dict while its offset is None, then BUILT again (memo 0) with an offset 400,000
    tuples deep (one byte a level): check() hashed it, and CPython's tuple hash overflowed the C stack."""
    deep = b")" + TUPLE1 * 400_000
    key = _global(MOD, "MetadataIndex") + b")\x81" + MEMOIZE + _dict(("fqn", _u("k"))) + b"b"
    entries = b"}" + key + _global(MOD, "TensorStorageMetadata") + b")\x81s"
    rebuild = _get(0) + _dict(("offset", deep)) + b"b"
    state = _dict(
        ("state_dict_metadata", entries), ("planner_data", b"}"), ("storage_data", b"}"), ("version", rebuild)
    )
    return _global(MOD, "Metadata") + b")\x81" + state + b"b"


def doubled_tuple(levels=40) -> bytes:
    """t = (t, t) at 4 bytes a level: 2**40 paths through a 170-byte file, which a repr walks (here NEWOBJ's
    message)."""
    out = b")"
    for i in range(levels):
        out += MEMOIZE + _get(i) + TUPLE2
    return out + b")" + NEWOBJ


REPORTED = {
    "BUILD again on a key already hashed (segfault)": (
        rebuilt_key,
        "memo entry 0 holds a MetadataIndex: only strings, numbers, names, sizes and paths are referenced twice",
    ),
    "a tuple of itself twice, in a message (exponential)": (
        doubled_tuple,
        "memo entry 0 holds a tuple: only strings, numbers, names, sizes and paths are referenced twice",
    ),
}

CHILD = """import sys, time
from gpt.checkpoints import dcp_index, loader, native
dcp_index._names()  # (DCP's modules, imported before the clock starts)
start = time.perf_counter()
try:
    loader.load_model(sys.argv[1])
except native.CheckpointError as e:
    print(e)
print(f"{time.perf_counter() - start:.3f}")
"""


@pytest.mark.parametrize("case", REPORTED)
def test_a_reported_metadata_is_one_line_in_a_bounded_time(saved, tmp_path, case):
    """In a child (3 GiB of address space): a crash or a runaway repr fails this test instead of ending pytest."""
    import resource

    make, reason = REPORTED[case]
    run = planted(saved, tmp_path, make())

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(run)], cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=cap
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    message, seconds = res.stdout.splitlines()
    assert message == f"{run / 'last.dcp'} is not a readable DCP checkpoint: {reason}"
    assert float(seconds) < 1.0


class _Memo:
    """Writes a piece the first time (then MEMOIZE), fetches it from the memo after (BINGET), as pickle.dump does;
    call it in the order the pieces stand in the file."""

    def __init__(self):
        self.index: dict[bytes, int] = {}

    def __call__(self, piece: bytes) -> bytes:
        if piece in self.index:
            return _get(self.index[piece])
        self.index[piece] = len(self.index)
        return piece + MEMOIZE


def shared_chunk_list(entries=1400, refs=40_000) -> bytes:
    """E zero-size entries sharing one chunk list of N references to one chunk (names and strings memoized, as DCP
    writes them; 161 KB): check() looked at E * N chunks."""
    m = _Memo()

    def empty_size() -> bytes:  # torch.Size(())
        return m(_global("torch", "Size")) + b")" + TUPLE1 + REDUCE

    def properties() -> bytes:  # float32, strided, no grad, contiguous, not pinned
        out = m(_global(MOD, "TensorProperties")) + b")\x81(" + m(_global("torch", "float32"))
        out += m(_global("torch.serialization", "_get_layout") + _u("torch.strided") + TUPLE1 + REDUCE) + b"\x89"
        return out + m(_global(MOD, "_MEM_FORMAT_ENCODING") + b"K\x00" + TUPLE1 + REDUCE) + b"\x89tb"

    body, chunk_list = b"", None
    for i in range(entries):
        body += _u(f"w{i}") + m(_global(MOD, "TensorStorageMetadata")) + b")\x81}("
        body += m(_u("properties")) + properties() + m(_u("size")) + empty_size() + m(_u("chunks"))
        if chunk_list is None:
            chunk = m(_global(MOD, "ChunkStorageMetadata")) + b")\x81}("
            chunk += m(_u("offsets")) + empty_size() + m(_u("sizes")) + empty_size() + b"ub"
            chunk_list = b"](" + m(chunk) + m(chunk) * (refs - 1) + b"e"
        body += m(chunk_list) + b"ub"
    paths = b"".join(_u(f"w{i}") + m(_u("model")) + _u(f"w{i}") + TUPLE2 for i in range(entries))
    state = _dict(
        ("state_dict_metadata", b"}(" + body + b"u"), ("planner_data", b"}(" + paths + b"u"), ("storage_data", b"}")
    )
    return _global(MOD, "Metadata") + b")\x81" + state + b"b"


def test_entries_sharing_one_chunk_list_cost_no_more_than_their_bytes(saved, tmp_path):
    run = planted(saved, tmp_path, shared_chunk_list())
    start = time.perf_counter()
    with pytest.raises(native.CheckpointError) as e:
        loader.load_model(run)
    assert str(e.value) == (
        f"{run / 'last.dcp'} is not a readable DCP checkpoint: memo entry 12 holds a ChunkStorageMetadata: only "
        "strings, numbers, names, sizes and paths are referenced twice"
    )
    assert time.perf_counter() - start < 1.0


def test_keys_of_one_hash_are_refused_before_a_dict_compares_them(tmp_path):
    """An int hashes to itself modulo 2**61 - 1: offsets made of 0, M, 2M and 3M all hash alike, so every key of a
    storage table could collide (2,000 keys: two million comparisons of DCP's dataclass)."""
    m = 2**61 - 1
    offsets = [[(i >> (2 * d) & 3) * m for d in range(6)] for i in range(2000)]
    keys = b"".join(_obj("MetadataIndex", ("fqn", _u("k")), ("offset", _size(*o))) + b"N" for o in offsets)
    start = time.perf_counter()
    assert index_of(tmp_path, b"}(" + keys + b"u") == "two keys of one dict have the same hash"
    assert time.perf_counter() - start < 1.0


# ---- each bound, alone ----------------------------------------------------------------------------------------

PAYLOAD = _u("PAYLOAD" * 30) + TUPLE1  # an object of the file's, which no message may show

BOUNDS = {
    "a list referenced twice": (
        b"]" + MEMOIZE + _get(0) + TUPLE2,
        "memo entry 0 holds a list: only strings, numbers, names, sizes and paths are referenced twice",
    ),
    "BUILD twice on one instance": (
        _obj("MetadataIndex", ("fqn", _u("a"))) + _dict(("fqn", _u("b"))) + b"b",
        "BUILD on a MetadataIndex that a BUILD filled already",
    ),
    "a field of the wrong type": (
        _obj("_StorageInfo", ("relative_path", PAYLOAD)),
        "_StorageInfo's relative_path is a tuple",
    ),
    "a key's offset of the wrong type": (
        _obj("MetadataIndex", ("fqn", _u("a")), ("offset", _u("0"))),
        "MetadataIndex's offset is a str",
    ),
    "an object no BUILD filled": (
        b"]" + _global(MOD, "ChunkStorageMetadata") + b")\x81a",
        "a ChunkStorageMetadata that no BUILD filled",
    ),
    "nesting deeper than 16": (b")" + TUPLE1 * 16, "objects nested more than 16 deep"),
    "a string of 4,097 characters": (
        b"X" + struct.pack("<I", 4097) + b"a" * 4097,
        "a string of more than 4,096 characters",
    ),
    "a size of 65 dimensions": (_size(*[1] * 65), "torch.Size takes a tuple of at most 64 sizes below 2**63"),
    "a path of 4,097 characters": (
        _global("pathlib", "PurePosixPath") + b"(" + _u("a" * 200) + MEMOIZE + _get(0) * 20 + b"t" + REDUCE,
        "a path of more than 4,096 characters",
    ),
    "a key of the same string twice": (
        b"}(" + _u("k") + b"N" + _u("k") + b"Nu",
        "two keys of one dict have the same hash",
    ),
    # messages: type names, never the object (a repr of a 170-byte file's tuple can take any time)
    "NEWOBJ of a tuple": (PAYLOAD + b")" + NEWOBJ, "NEWOBJ of a tuple is not allowed in a checkpoint's .metadata"),
    "REDUCE of a tuple": (PAYLOAD + b")" + REDUCE, "REDUCE of a tuple is not allowed in a checkpoint's .metadata"),
    "a layout named by a tuple": (
        _global("torch.serialization", "_get_layout") + PAYLOAD + TUPLE1 + REDUCE,
        "a layout is named by one of torch's layouts",
    ),
    "a global named by a tuple": (
        PAYLOAD + _u("x") + b"\x93",
        "a name that is not a string is not allowed in a checkpoint's .metadata",
    ),
    "a memory format that is a tuple": (
        _global(MOD, "TensorProperties")
        + b")\x81("
        + _global("torch", "float32")
        + _global("torch.serialization", "_get_layout")
        + _u("torch.strided")
        + b"\x85R\x89"
        + PAYLOAD
        + b"\x89tb",
        "TensorProperties' state is not its 5 fields of their types",
    ),
}


@pytest.mark.parametrize("bound", BOUNDS)
def test_each_bound_is_one_line_naming_no_object_of_the_file(tmp_path, bound):
    body, reason = BOUNDS[bound]
    message = index_of(tmp_path, body)
    assert message == reason and "PAYLOAD" not in message


def test_a_real_index_is_within_every_bound(saved):
    """The checkpoint of one process (tests/test_parallel.py reads sharded ones, written by torchrun)."""
    metadata = dcp_index.load(saved / "step-000002")
    assert metadata.state_dict_metadata.keys() == metadata.planner_data.keys()
    chunk = metadata.state_dict_metadata["model.transformer.wte.weight"].chunks[0]
    assert type(chunk) is ChunkStorageMetadata and chunk.sizes == torch.Size([64, 16])

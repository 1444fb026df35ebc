"""llama.cpp built for this machine (-march=native), as a user who builds it or installs llama-cpp-python
gets it: the peer bench/bench_llamacpp.py measures against.

    python bench/llamacpp_native.py            # build once (about 10 minutes on 2 cores); prints where
    python bench/llamacpp_native.py --check    # is there a native build for this CPU? (exit 1 if not)

It builds the llama.cpp sources that the installed llama-cpp-python vendors (its sdist, from pip's index),
so both front ends run the same commit: `llama-bench` (llama.cpp's own C++ benchmark: no Python call per
token) and the shared libraries, which llama-cpp-python loads instead of its own when
`LLAMA_CPP_LIB_PATH` names them. The build goes to its own folder (`$GPT_LLAMACPP_NATIVE`, default
`~/.cache/gpt-bench/llama.cpp-VERSION-native-FAMILY`), never into pip's wheel cache: `.ci/run`'s portable
wheel (`GGML_NATIVE=OFF`, which any x86-64 CPU with AVX2 can run) stays what the tests use.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LIBS = ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so")


def version() -> str:
    from importlib.metadata import version as installed

    return installed("llama-cpp-python")


def home() -> Path:
    """Where the native build for this llama-cpp-python and this CPU lives."""
    if os.environ.get("GPT_LLAMACPP_NATIVE"):
        return Path(os.environ["GPT_LLAMACPP_NATIVE"])
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import cpu_family_model

    cpu = cpu_family_model().replace("family ", "f").replace(" model ", "m") or "cpu"
    return Path.home() / ".cache" / "gpt-bench" / f"llama.cpp-{version()}-native-{cpu}"


def built(where: Path) -> bool:
    return (where / "bin" / "llama-bench").is_file() and all((where / "bin" / lib).exists() for lib in LIBS)


def build(where: Path, jobs: int = os.cpu_count() or 2) -> Path:
    """Download llama-cpp-python's sdist (the installed version) and build its llama.cpp natively into `where`."""
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-cache-dir"]
        subprocess.run([*pip, f"llama-cpp-python=={version()}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (src,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]
        flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
        subprocess.run(["cmake", "-S", src, "-B", where, *flags], check=True)
        subprocess.run(["cmake", "--build", where, "-j", str(jobs), "--target", "llama-bench", "llama"], check=True)
    return where


def ensure() -> Path:
    """The native build's folder, built first if it is not there."""
    where = home()
    if not built(where):
        print(f"building llama.cpp {version()} natively into {where} (about 10 minutes on 2 cores)", file=sys.stderr)
        build(where)
    return where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only say whether the native build exists (exit 1 if not)")
    args = p.parse_args()
    where = home()
    if args.check:
        print(f"{where}: {'built' if built(where) else 'not built'}")
        sys.exit(0 if built(where) else 1)
    print(ensure() / "bin")


if __name__ == "__main__":
    main()

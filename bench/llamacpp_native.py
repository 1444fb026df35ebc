"""llama.cpp built for this machine (-march=native), as a user who builds it or installs llama-cpp-python
gets it: the peer bench/bench_llamacpp.py measures against.

    python bench/llamacpp_native.py            # build once (about 10 minutes on 2 cores); prints where
    python bench/llamacpp_native.py --check    # is there a native build for this CPU? (exit 1 if not)
    python bench/llamacpp_native.py --avx2     # the same sources built for any AVX2 CPU (GGML_NATIVE=OFF)

It builds the llama.cpp sources that the installed llama-cpp-python vendors (its sdist, from pip's index),
so both front ends run the same commit: `llama-bench` (llama.cpp's own C++ benchmark: no Python call per
token) and the shared libraries, which llama-cpp-python loads instead of its own when
`LLAMA_CPP_LIB_PATH` names them. The build goes to its own folder (`$GPT_LLAMACPP_NATIVE`, default
`~/.cache/gpt-bench/llama.cpp-VERSION-native-FAMILY`), never into pip's wheel cache: `.ci/run`'s portable
wheel (`GGML_NATIVE=OFF`, which any x86-64 CPU with AVX2 can run) stays what the tests use.

`--avx2` builds those sources as that wheel is built (GGML_NATIVE=OFF: AVX2, FMA, F16C and BMI2 on, no
AVX-512), with llama-bench, into `...-avx2` beside the native folder: llama.cpp as a CPU without AVX-512
runs it, for `bench_llamacpp.py --as-avx2` (an AVX2-only machine's figures approximated on this one).
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


def home(avx2: bool = False) -> Path:
    """Where the native build (or the AVX2 one) for this llama-cpp-python and this CPU lives."""
    if os.environ.get("GPT_LLAMACPP_NATIVE") and not avx2:
        return Path(os.environ["GPT_LLAMACPP_NATIVE"])
    sys.path.insert(0, str(Path(__file__).parent))
    from harness import cpu_family_model

    cpu = cpu_family_model().replace("family ", "f").replace(" model ", "m") or "cpu"
    return Path.home() / ".cache" / "gpt-bench" / (f"llama.cpp-{version()}-" + ("avx2" if avx2 else f"native-{cpu}"))


def built(where: Path) -> bool:
    return (where / "bin" / "llama-bench").is_file() and all((where / "bin" / lib).exists() for lib in LIBS)


def build(where: Path, avx2: bool = False, jobs: int = os.cpu_count() or 2) -> Path:
    """Download llama-cpp-python's sdist (the installed version) and build its llama.cpp into `where`, natively
    or (`avx2`) as .ci/run's wheel is built."""
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-cache-dir"]
        subprocess.run([*pip, f"llama-cpp-python=={version()}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (src,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", f"-DGGML_NATIVE={'OFF' if avx2 else 'ON'}"]
        flags += ["-DLLAMA_CURL=OFF"]
        flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
        subprocess.run(["cmake", "-S", src, "-B", where, *flags], check=True)
        subprocess.run(["cmake", "--build", where, "-j", str(jobs), "--target", "llama-bench", "llama"], check=True)
    return where


def ensure(avx2: bool = False) -> Path:
    """The native (or AVX2) build's folder, built first if it is not there."""
    where = home(avx2)
    if not built(where):
        how = "for AVX2" if avx2 else "natively"
        print(f"building llama.cpp {version()} {how} into {where} (about 10 minutes on 2 cores)", file=sys.stderr)
        build(where, avx2)
    return where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only say whether the native build exists (exit 1 if not)")
    p.add_argument(
        "--avx2", action="store_true", help="the build for any AVX2 CPU (GGML_NATIVE=OFF), not -march=native"
    )
    args = p.parse_args()
    where = home(args.avx2)
    if args.check:
        print(f"{where}: {'built' if built(where) else 'not built'}")
        sys.exit(0 if built(where) else 1)
    print(ensure(args.avx2) / "bin")


if __name__ == "__main__":
    main()

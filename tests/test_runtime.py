"""gpt.runtime: the device and precision each machine gets, and why."""

import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ROOT

from gpt import runtime
from gpt.runtime import DeviceError, SlowPrecisionWarning, resolve_dtype, setup

CPU = torch.device("cpu")


@pytest.fixture
def native_bf16(monkeypatch):
    """Set the CPU's flags (and clear $GPT_CPU_BF16, which would overrule them)."""
    monkeypatch.delenv(runtime.BF16_OVERRIDE, raising=False)

    def set_flags(*flags):
        monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset(flags))

    return set_flags


def test_auto_precision_follows_the_cpu(native_bf16):
    native_bf16("avx2", "fma")
    assert resolve_dtype("auto", CPU) == (torch.float32, "this CPU has no native bf16")
    native_bf16("avx512f", "avx512_bf16")
    assert resolve_dtype("auto", CPU) == (torch.bfloat16, "this CPU has native bf16")
    native_bf16("amx_bf16", "amx_tile")
    assert resolve_dtype("auto", CPU)[0] == torch.bfloat16
    assert resolve_dtype("float32", CPU) == (torch.float32, "asked for")


def test_bf16_asked_for_on_a_cpu_that_emulates_it_warns(native_bf16):
    native_bf16("avx2")
    with pytest.warns(SlowPrecisionWarning, match="emulated and can be many times slower"):
        assert resolve_dtype("bfloat16", CPU)[0] == torch.bfloat16
    native_bf16("avx512_bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPrecisionWarning)
        resolve_dtype("bfloat16", CPU)  # native: no warning


def test_bad_precision_and_device_names():
    with pytest.raises(DeviceError, match="--dtype 'float64' is not one of"):
        resolve_dtype("float64", CPU)
    with pytest.raises(DeviceError, match="float16 needs a CUDA device"):
        resolve_dtype("float16", CPU)
    with pytest.raises(DeviceError, match="is not a device"):
        runtime.resolve_device("gpu9")


@pytest.mark.parametrize(
    "dtype, compiled, flash",
    [(torch.float32, False, True), (torch.float32, True, False), (torch.bfloat16, False, False)],
)
def test_cpu_attention_kernel_is_the_faster_one_for_the_step(dtype, compiled, flash):
    """Eager float32: PyTorch's choice (flash on CPU); bf16 or a compiled step: the math kernel."""
    with runtime.Runtime(CPU, dtype, compiled=compiled).autocast():
        assert torch.backends.cuda.flash_sdp_enabled() is flash  # the backend flags cover CPU too
        assert torch.backends.cuda.math_sdp_enabled()


def test_compiled_tanh_gelu_matches_eager():
    """compile_options' tanh (2 / (1 + exp(-2x)) - 1) keeps GPT-2's GELU and its gradient to float32 rounding."""
    from gpt.train.parallel import compile_options

    x = torch.linspace(-12, 12, 4001, requires_grad=True)
    gelu = torch.nn.GELU(approximate="tanh")
    compiled = torch.compile(gelu, options=compile_options(CPU))
    (eager_grad,) = torch.autograd.grad(gelu(x).pow(2).sum(), x)
    y = compiled(x)
    (grad,) = torch.autograd.grad(y.pow(2).sum(), x)
    torch.testing.assert_close(y, gelu(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, eager_grad, atol=1e-5, rtol=1e-5)


def test_cpu_flags_are_read_from_cpuinfo(monkeypatch):
    flags = runtime.cpu_flags()
    assert isinstance(flags, frozenset)
    if sys.platform.startswith("linux"):
        assert flags  # every Linux CPU lists some
    monkeypatch.setattr(runtime, "cpu_name", lambda: "Intel(R) Xeon(R) Processor")  # a name with its own "("
    capability = torch.backends.cpu.get_cpu_capability()
    native = "native" if runtime.cpu_has_native_bf16() else "no native"
    override = runtime.cpu_bf16_override()
    assert runtime.cpu_description() == f"Intel(R) Xeon(R) Processor ({capability}, {native} bf16" + (
        f", GPT_CPU_BF16={int(override)})" if override is not None else ")"
    )


@pytest.mark.precision
def test_the_run_header_says_the_precision_and_why_and_bf16_trains_on_cpu(tmp_path):
    """A short bf16 CPU run through train.py: it trains, and says what it runs on and why (with the
    one-line warning where this CPU only emulates bf16)."""
    text = tmp_path / "t.txt"
    text.write_text("hello world, a tiny corpus for a tiny model\n" * 400)
    subprocess.run(
        [
            sys.executable,
            "data/prepare.py",
            str(text),
            "--out",
            str(tmp_path / "d"),
            "--tokenizer",
            "char",
            "--block-size",
            "16",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    common = [
        "train.py",
        "--data",
        str(tmp_path / "d"),
        "--n-layer",
        "1",
        "--n-head",
        "1",
        "--n-embd",
        "16",
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--max-iters",
        "3",
        "--eval-iters",
        "1",
        "--device",
        "cpu",
    ]
    res = subprocess.run(
        [sys.executable, *common, "--out-dir", str(tmp_path / "auto")], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    dtype, reason = resolve_dtype("auto", CPU)  # this CPU's (or $GPT_CPU_BF16's) answer
    assert f"cpu {str(dtype).removeprefix('torch.')} ({reason})" in res.stdout and "threads" in res.stdout
    res = subprocess.run(
        [sys.executable, *common, "--dtype", "bfloat16", "--out-dir", str(tmp_path / "bf16")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "cpu bfloat16 (asked for)" in res.stdout and "done: 3 steps" in res.stdout
    warned = "warning: --dtype bfloat16 on a CPU without native bf16" in res.stderr
    assert warned != runtime.cpu_has_native_bf16()


def test_negative_threads_are_refused_for_every_command():  # train, sample, evaluate and serve share setup()
    with pytest.raises(DeviceError, match=r"^--threads must be >= 0 \(0: the default\), got -1$"):
        setup("cpu", "float32", threads=-1, distributed=False)

"""What `--dtype auto` picks on CPU, and $GPT_CPU_BF16, which lets either CPU class run the other's path:
0 behaves as a CPU without native bf16, 1 as one with it (emulated, slow, where the CPU has none: keep
what runs under it tiny). Every entry point says what it picked and why, and computes in it: the matrix
products of a real train step and of real decode steps are recorded (`Products`), not the banner."""

from collections import Counter

import pytest
import torch
from conftest import save_random_lm
from test_sample_seq2seq import save_seq2seq
from torch.utils._python_dispatch import TorchDispatchMode

from gpt import GPT, GPTConfig, runtime
from gpt.checkpoints import loader
from gpt.cli import evaluate, sample
from gpt.model.rowkernels import KINDS, MANY_ROWS, BlockStep, RowLinear, StackStep, library
from gpt.runtime import INFERENCE_BF16_MIN_PARAMS, DeviceError, resolve_dtype
from gpt.train.start import resolve_run
from gpt.train.trainer import train

pytestmark = [pytest.mark.precision, pytest.mark.usefixtures("one_thread")]  # see conftest.py

CPU = torch.device("cpu")
# the shipped benchmark models (bench/bench_sampling.py: 65 tiny-shakespeare chars + end-of-text, GPT-2's BPE)
BENCH = {
    "char-cpu": dict(vocab_size=66, n_layer=4, n_head=4, n_embd=128, block_size=64),
    "char-gpu": dict(vocab_size=66, n_layer=6, n_head=6, n_embd=384, block_size=256),
    "bpe-6x384": dict(vocab_size=50304, n_layer=6, n_head=6, n_embd=384, block_size=256),
}
BF16 = {"0": torch.float32, "1": torch.bfloat16}


@pytest.fixture(params=["0", "1"])
def override(request, monkeypatch):
    monkeypatch.setenv(runtime.BF16_OVERRIDE, request.param)
    return request.param


class Products(TorchDispatchMode):
    """Under it, the dtypes of the operands of each matrix product run on this thread (autograd's CPU backward
    runs on the caller's thread too), by kind: `linear`, the Linear layers' (mm / addmm; linear itself under
    inference_mode, which reaches here undecomposed; the oneDNN product a bf16 decode packs its weights for:
    gpt/model/packed.py), and `attention`'s (q, k, v of scaled_dot_product_attention or the CPU flash kernel,
    and in its backward also the output and its gradient, not the float32 row statistics it keeps; the math
    kernel's bmm)."""

    OPERANDS = {  # the op, its kind and how many of its leading arguments are operands
        "mm": ("linear", 2),
        "addmm": ("linear", 3),
        "linear": ("linear", 3),
        "_linear_pointwise": ("linear", 2),
        "scaled_dot_product_attention": ("attention", 3),
        "_scaled_dot_product_flash_attention_for_cpu": ("attention", 3),
        "_scaled_dot_product_flash_attention_for_cpu_backward": ("attention", 5),
        "bmm": ("attention", 2),
    }

    def __init__(self):
        super().__init__()
        self.seen: dict[str, Counter] = {"linear": Counter(), "attention": Counter()}

    def __enter__(self):
        """Also our C kernels' products (gpt/model/rowkernels.py), which no dispatcher sees: by the dtype of the
        weights each streams (the rows are turned into it; up to MANY_ROWS rows, past which RowLinear calls
        PyTorch's product); a step in C (a block's BlockStep, the whole model's
        StackStep) as each block's four products and an attention over its cache, in the cache's dtype."""
        forward, block, stack = RowLinear.forward, BlockStep.__call__, StackStep.__call__
        weights = {v: k for k, v in KINDS.items()}

        def recorded(layer, x):
            # (more rows: PyTorch's product, which __torch_dispatch__ sees)
            if x.numel() <= MANY_ROWS * layer.in_features:
                self.seen["linear"][layer.weight_blocks.dtype] += 1
            return forward(layer, x)

        def stepped(call):
            def run(step, x, caches):
                y = call(step, x, caches)
                if y is not None:
                    caches = caches if isinstance(caches, list) else [caches]
                    kind = step.blocks[0].kind if call is stack else step.kind
                    self.seen["linear"][weights[kind]] += 4 * len(caches)
                    self.seen["attention"][caches[0].k.dtype] += len(caches)
                return y

            return run

        self._restore = forward, block, stack
        RowLinear.forward = recorded
        BlockStep.__call__, StackStep.__call__ = stepped(block), stepped(stack)
        return super().__enter__()

    def __exit__(self, *exc):
        RowLinear.forward, BlockStep.__call__, StackStep.__call__ = self._restore
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind, n = self.OPERANDS.get(func.overloadpacket.__name__, (None, 0))
        for dtype in {a.dtype for a in args[:n] if isinstance(a, torch.Tensor)}:
            self.seen[kind][dtype] += 1  # products, by the dtypes they read
        return func(*args, **(kwargs or {}))

    @property
    def linear(self) -> set[torch.dtype]:
        return set(self.seen["linear"])

    @property
    def attention(self) -> set[torch.dtype]:
        return set(self.seen["attention"])


def computed_in(products: Products, dtype: torch.dtype) -> None:
    """Every Linear product read `dtype`; attention read it or float32: over a KV cache attention runs in the
    cache's dtype, float32 for a bf16 model on CPU (GPT.cache_dtype), and bf16 training's math kernel (gpt/
    runtime.py picks it) computes in float32 whatever its inputs (PyTorch's rule)."""
    assert products.linear == {dtype}, products.seen
    assert products.attention and products.attention <= {dtype, torch.float32}, products.seen


def test_the_recorder_sees_the_products_of_a_train_step_and_their_dtype():
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    x = torch.randint(0, 16, (2, 8))
    with Products() as fp32:
        model(x, x)[1].backward()
    with Products() as bf16, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x)[1].backward()
    assert fp32.linear == fp32.attention == {torch.float32}
    assert bf16.linear == bf16.attention == {torch.bfloat16}
    assert fp32.seen["linear"][torch.float32] == 5 * 3  # 5 Linear layers, forward and 2 backward products each


def test_the_override_decides_over_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setenv("GPT_CPU_BF16", "1")
    assert runtime.cpu_has_native_bf16()
    assert resolve_dtype("auto", CPU) == (torch.bfloat16, "GPT_CPU_BF16=1: as a CPU that has native bf16")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    monkeypatch.setenv("GPT_CPU_BF16", "0")
    assert not runtime.cpu_has_native_bf16()
    assert resolve_dtype("auto", CPU) == (torch.float32, "GPT_CPU_BF16=0: as a CPU that has no native bf16")
    assert runtime.cpu_description().endswith(", no native bf16, GPT_CPU_BF16=0)")
    monkeypatch.setenv("GPT_CPU_BF16", "")
    assert runtime.cpu_has_native_bf16()  # empty is unset: detect
    monkeypatch.setenv("GPT_CPU_BF16", "yes")
    with pytest.raises(DeviceError, match=r"^GPT_CPU_BF16='yes': use 0 \(as a CPU without native bf16\), 1 "):
        runtime.cpu_has_native_bf16()


def params(name: str) -> int:
    with torch.device("meta"):  # counted, never allocated
        return GPT(GPTConfig(**BENCH[name])).num_params()


@pytest.mark.parametrize(
    "name,dtype", [("char-cpu", torch.float32), ("char-gpu", torch.bfloat16), ("bpe-6x384", torch.bfloat16)]
)
def test_inference_on_a_cpu_with_native_bf16_picks_by_model_size(monkeypatch, name, dtype):
    """PyTorch's kernels (bench/results/sampling-dtype-2026-11-24.md): bf16 decodes the 4x4x128 model slower than
    float32, the 6x6x384 ones faster."""
    monkeypatch.setenv("GPT_CPU_BF16", "1")
    picked, reason = resolve_dtype("auto", CPU, inference_params=params(name))
    assert picked == dtype
    if dtype == torch.float32:
        assert reason == (
            f"GPT_CPU_BF16=1: as a CPU that has native bf16, but decodes faster in float32 below "
            f"{INFERENCE_BF16_MIN_PARAMS / 1e6:g}M parameters"
        )
    assert resolve_dtype("bfloat16", CPU, inference_params=1)[0] == torch.bfloat16  # asked for: never overruled
    assert resolve_dtype("auto", CPU, params(name), bf16_steps=True)[0] == torch.bfloat16  # our C step: any size
    monkeypatch.setenv("GPT_CPU_BF16", "0")
    assert resolve_dtype("auto", CPU, inference_params=params(name))[0] == torch.float32
    # our C step without native bf16: from the size (it widens bf16 weights in registers)
    assert resolve_dtype("auto", CPU, params(name), bf16_steps=True)[0] == dtype


def test_training_on_a_cpu_with_native_bf16_picks_bf16_at_any_size(monkeypatch):
    monkeypatch.setenv("GPT_CPU_BF16", "1")
    assert resolve_dtype("auto", CPU) == (torch.bfloat16, "GPT_CPU_BF16=1: as a CPU that has native bf16")


# ---- every entry point honours the override and says so -------------------------------------------


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return save_random_lm(tmp_path_factory.mktemp("lm"), "\n abcdefgh")


@pytest.fixture
def any_size(monkeypatch):
    """Inference's bf16 for tiny models too, so that the entry points show what the override does."""
    monkeypatch.setattr(runtime, "INFERENCE_BF16_MIN_PARAMS", 0)


def said(dtype: torch.dtype, override: str) -> str:
    has = "has" if override == "1" else "has no"
    return f"cpu, {str(dtype).removeprefix('torch.')} (GPT_CPU_BF16={override}: as a CPU that {has} native bf16"


def test_train_py(override, char_data, tmp_path, capsys):
    plan = resolve_run(
        [
            "--data",
            str(char_data),
            "--out-dir",
            str(tmp_path / "o"),
            "--n-layer",
            "1",
            "--n-head",
            "1",
            "--n-embd",
            "16",
            "--block-size",
            "16",
            "--batch-size",
            "2",
            "--max-iters",
            "1",
            "--eval-iters",
            "1",
            "--device",
            "cpu",
        ]
    )
    with Products() as products:
        train(plan)
    assert said(BF16[override], override).replace("cpu, ", "cpu ") + ")" in capsys.readouterr().out
    computed_in(products, BF16[override])  # what it said


def decode(argv: list[str]) -> Products:
    """`gpt sample` on CPU, its products recorded."""
    with Products() as products:
        assert sample.main([*argv, "--device", "cpu"]) == 0
    return products


def test_sample_py(override, lm_dir, capsys):
    """A tiny model: with native bf16 our C step decodes bf16 at any size (bench/README.md, "bf16 against
    float32"); PyTorch's kernels (where ours do not build) keep float32 below the size, and say why."""
    products = decode(["--ckpt", str(lm_dir), "--prompt", "a", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    if override == "1" and library() is not None:
        assert said(torch.bfloat16, "1") + ")" in err, err
        computed_in(products, torch.bfloat16)
        return
    if override == "1":
        assert said(torch.float32, "1") + ", but decodes faster in float32 below" in err, err
    else:
        assert said(torch.float32, "0") + ")" in err, err
    computed_in(products, torch.float32)


def test_sample_py_with_native_bf16_where_our_kernels_take_no_step(lm_dir, monkeypatch, capsys):
    monkeypatch.setenv("GPT_CPU_BF16", "1")
    monkeypatch.setattr(loader, "whole_step", lambda model: False)  # as where our kernels do not build
    computed_in(decode(["--ckpt", str(lm_dir), "--prompt", "a", "--max-new-tokens", "2"]), torch.float32)
    assert said(torch.float32, "1") + ", but decodes faster in float32 below" in capsys.readouterr().err


def test_sample_py_bf16(any_size, override, lm_dir, capsys):
    """Above the size, bf16 where the CPU has it, and also where it has not but our C kernels take the whole
    decode step (they widen bf16 weights in registers); float32 there without the kernels (the next test)."""
    products = decode(["--ckpt", str(lm_dir), "--prompt", "a", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    if override == "1" or library() is None:
        assert said(BF16[override], override) + ")" in err, err
        computed_in(products, BF16[override])
    else:
        assert said(torch.bfloat16, "0") + ", but our C decoding kernels read bf16 weights faster from 0M" in err
        computed_in(products, torch.bfloat16)
        assert products.seen["linear"][torch.bfloat16] and not products.seen["linear"][torch.float32]


def test_sample_py_without_native_bf16_where_our_kernels_take_no_step(any_size, lm_dir, monkeypatch, capsys):
    monkeypatch.setenv("GPT_CPU_BF16", "0")
    monkeypatch.setattr(loader, "whole_step", lambda model: False)  # as where our kernels do not build
    computed_in(decode(["--ckpt", str(lm_dir), "--prompt", "a", "--max-new-tokens", "2"]), torch.float32)
    assert said(torch.float32, "0") + ")" in capsys.readouterr().err


def test_bf16_over_many_rows_without_native_bf16_is_computed_in_float32(monkeypatch):
    """A prompt longer than MANY_ROWS goes through PyTorch's product: without native bf16 that would be its
    emulated bf16 GEMM, so a bf16 RowLinear computes it in float32 and rounds; with native bf16, in bf16."""
    if library() is None:
        pytest.skip("our C kernels do not build here")
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    row = RowLinear(linear)
    x = torch.randn(MANY_ROWS + 3, 64).to(torch.bfloat16)
    for flag, dtype in (("0", torch.float32), ("1", torch.bfloat16)):
        monkeypatch.setenv("GPT_CPU_BF16", flag)
        with Products() as products, torch.inference_mode():
            y = row(x)
        assert products.linear == {dtype} and y.dtype == torch.bfloat16
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)


def test_evaluate(any_size, override, tmp_path, capsys):
    pytest.importorskip("sacrebleu")
    pytest.importorskip("rouge_score")  # (gpt evaluate scores BLEU and ROUGE by default)
    save_seq2seq(tmp_path / "run")
    (tmp_path / "src.txt").write_text("abc\n")
    (tmp_path / "ref.txt").write_text("cba\n")
    with Products() as products:
        code = evaluate.main(
            [
                "--ckpt",
                str(tmp_path / "run"),
                "--source-file",
                str(tmp_path / "src.txt"),
                "--reference",
                str(tmp_path / "ref.txt"),
                "--device",
                "cpu",
                "--max-new-tokens",
                "4",
            ]
        )
    assert code == 0
    assert f"| {said(BF16[override], override)}) |" in capsys.readouterr().out
    computed_in(products, BF16[override])


def test_the_server(any_size, override, lm_dir, monkeypatch, capsys):
    """`gpt serve`'s banner, up to where uvicorn would start serving; then one completion decoded by the
    engine the app was given (on this thread, where `Products` records)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from gpt.cli.serve import main
    from gpt.infer.batching import Request
    from gpt.infer.sampling import SampleConfig
    from gpt.serve import app

    products = Products()

    class NotServing:
        def __init__(self, app, **settings):
            self.engine = app.state.worker.engine

        def run(self, sockets):
            for sock in sockets:
                sock.close()
            prompt = self.engine.tokenizer.encode("a")
            self.engine.submit(Request(prompt, SampleConfig(max_new_tokens=2, temperature=0), lambda piece: None))
            with products:
                while self.engine.busy:
                    self.engine.step()

    monkeypatch.setattr(app, "Server", NotServing)
    assert main(["--ckpt", str(lm_dir), "--device", "cpu", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("serving ") and said(BF16[override], override) + ")" in err, err
    computed_in(products, BF16[override])

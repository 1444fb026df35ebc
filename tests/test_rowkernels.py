"""Our C decode kernels (gpt/model/rowkernels.py): the numbers of nn.Linear and Int8Linear, a row's result
independent of its neighbours and of the threads, both builds (this machine's and AVX2's), decoding through them,
and the fallbacks when they cannot be built."""

import platform
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from test_packed import greedy, tiny

from gpt.model import rowkernels
from gpt.model.cache import KVCache
from gpt.model.config import GPTConfig
from gpt.model.packed import pack
from gpt.model.quantize import Int8Linear, quantize
from gpt.model.rowkernels import RowLinear, fits, library
from gpt.model.transformer import GPT
from gpt.runtime import HUGE_PAGE, cpu_flags, on_huge_pages

AVX2 = platform.machine() == "x86_64" and "avx2" in cpu_flags()
BUILDS = ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(not AVX2, reason="no AVX2 on this CPU"))]
needs_kernels = pytest.mark.skipif(library() is None, reason=f"the kernels do not build here: {rowkernels.why_not()}")
pytestmark = needs_kernels


def layer(kind: str, bias: bool, out: int = 100, n_in: int = 64) -> nn.Module:
    """A Linear layer of `kind`: 100 outputs, so the last block of 64 is padded."""
    torch.manual_seed(0)
    linear = nn.Linear(n_in, out, bias=bias)
    return Int8Linear(linear) if kind == "int8" else linear.to(getattr(torch, kind)).eval()


def int8_exact(q: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """Int8Linear's numbers with the products in int64: each row quantised by its largest magnitude, the integer
    dot products, scaled back (row scale x channel scale) and the bias added after."""
    amax = x.abs().amax(1, keepdim=True).clamp_min(1e-30)
    dot = torch.round(x * (127 / amax)).long() @ q.weight_int8.long().t()
    y = dot.float() * (amax * q.weight_scale)
    return y if q.bias is None else q.bias + y


def reference(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `base` computes, in float32 (int8: `int8_exact`)."""
    if isinstance(base, Int8Linear):
        return int8_exact(base, x)
    return x.float() @ base.weight.float().t() + (base.bias.float() if base.bias is not None else 0)


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_in", [64, 200])  # 200: AVX2's bf16 rows widen 64 inputs at a time, and the rest
def test_a_few_rows_give_the_layers_numbers_whatever_rows_come_beside(march, kind, bias, n_in):
    base = layer(kind, bias, n_in=n_in)
    ours = RowLinear(base, march)
    x = torch.randn(rowkernels.MANY_ROWS, n_in)
    x[3] = 0  # an all-zero row quantises to zeros, not NaN
    if kind == "bfloat16":
        x = x.bfloat16()
    with torch.no_grad():
        got = ours(x)
        if kind == "int8":
            assert torch.equal(got, int8_exact(base, x))  # exact integer products, the same scaling
        else:  # float sums in another order: to the precision's rounding
            tol = 1e-5 if kind == "float32" else 2e-2
            assert got.dtype == x.dtype
            torch.testing.assert_close(got.float(), reference(base, x), atol=tol, rtol=tol)
        for m in (1, 3, 4, 5, 7):  # one row, fewer than a group of rows, a group and a remainder
            assert torch.equal(ours(x[:m]), got[:m])  # the same numbers whatever rows come beside
        assert torch.equal(ours(x[7:9].view(2, 1, n_in)), got[7:9].view(2, 1, 100))  # (B, T, C) in, (B, T, out)
        assert ours(x[:0]).shape == (0, 100)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_many_rows_go_through_pytorchs_product_with_the_same_numbers(kind, monkeypatch):
    """More than MANY_ROWS rows (a prefill): PyTorch's kernels on the weight unblocked, so not our kernels."""
    base = layer(kind, True)
    ours = RowLinear(base)
    x = torch.randn(rowkernels.MANY_ROWS + 9, 64).to(torch.bfloat16 if kind == "bfloat16" else torch.float32)
    with torch.no_grad():
        want = base(x)
        monkeypatch.setattr(rowkernels, "_build", lambda march: (None, "not called"))  # our kernels: out of reach
        got = ours(x.view(1, -1, 64))[0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # int8: exact, but for the bias's rounding


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_threads_share_the_blocks_without_changing_a_number(kind, monkeypatch):
    ours = RowLinear(layer(kind, True, out=1000, n_in=128))
    x = torch.randn(3, 128).to(torch.bfloat16 if kind == "bfloat16" else torch.float32)
    n = torch.get_num_threads()
    with torch.no_grad():
        try:
            torch.set_num_threads(1)
            one = ours(x)
            torch.set_num_threads(2)
            assert torch.equal(ours(x), one)
        finally:
            torch.set_num_threads(n)


def test_the_native_build_uses_the_cpus_dot_products():
    """Pairs of bf16 where the CPU has AVX512_BF16, quads of int8 where it has AVX512_VNNI or AVX2 (the layout
    follows); a build without AVX2 is not used."""
    flags = cpu_flags()
    assert library().layout(0) == 1
    assert library().layout(1) == (2 if {"avx512_bf16", "avx512bw"} <= flags else 1)
    assert library().layout(2) == (4 if "avx2" in flags else 1)
    if AVX2:
        assert [library("x86-64-v3").layout(k) for k in range(3)] == [1, 1, 4]  # int8 pairs of pairs
        assert library("x86-64") is None  # SSE2 only: PyTorch's kernels do as well
        assert rowkernels.why_not("x86-64") == "-march=x86-64 has neither AVX2 nor AVX-512"
    assert RowLinear(layer("int8", False)).weight_blocks.shape == (
        2,
        64 // library().layout(2),
        64,
        library().layout(2),
    )


def test_fits_takes_cpu_float_and_int8_layers_only():
    assert fits(nn.Linear(64, 8)) and fits(layer("int8", False)) and fits(nn.Linear(64, 8).bfloat16())
    assert not fits(nn.Linear(64, 8).half()) and not fits(nn.Embedding(4, 64))
    assert fits(nn.Linear(33, 8).bfloat16()) == (library().layout(1) == 1)  # pairs need an even width


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_packed_model_decodes_as_the_plain_one_and_as_it_recomputes(kind):
    def make():
        model = tiny()
        return quantize(model, "int8") if kind == "int8" else model.to(getattr(torch, kind))

    model, reference = pack(make()), make()
    n = sum(isinstance(m, RowLinear) for m in model.modules())
    assert n == 2 * 4 + 1 and not any(isinstance(m, (nn.Linear, Int8Linear)) for m in model.modules())
    assert torch.equal(model.transformer.wte.weight, reference.transformer.wte.weight)  # the embedding's own copy
    idx = torch.randint(0, 50, (1, 5))
    tokens, logits = greedy(model, idx, 10)
    assert torch.equal(tokens, greedy(reference, idx, 10)[0])
    with torch.no_grad():
        full = model.head(model.hidden(tokens))[:, -1].float()
    tol = 3e-2 if kind == "bfloat16" else 1e-4
    torch.testing.assert_close(logits, full, atol=tol, rtol=tol)


def test_without_kernels_pack_keeps_pytorchs_and_says_why(monkeypatch):
    assert rowkernels._build("off") == (None, "GPT_ROW_KERNELS=off")
    monkeypatch.setenv("GPT_ROW_KERNELS", "off")
    assert library() is None and rowkernels.why_not() == "GPT_ROW_KERNELS=off"
    model = pack(tiny())
    assert not any(isinstance(m, RowLinear) for m in model.modules())
    assert not model.transformer.h[0].mlp.c_fc.weight.is_contiguous()  # PyTorch's layout instead
    monkeypatch.setenv("CC", "false")  # a compiler that fails: no library, the reason kept and said
    with pytest.warns(rowkernels.KernelWarning, match="not used: false failed"):
        lib, why = rowkernels._build.__wrapped__("native")
    assert lib is None and why.startswith("false failed")
    monkeypatch.setenv("CC", "/nonexistent/cc")  # one that does not run
    with pytest.warns(rowkernels.KernelWarning, match="/nonexistent/cc or loading its library failed"):
        assert rowkernels._build.__wrapped__("native")[0] is None


def test_a_library_that_cannot_be_loaded_is_a_warning_not_an_error(monkeypatch):
    """A temporary directory mounted noexec: the compiler writes the library, loading it fails."""

    def refuse(path, *args, **kwargs):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(rowkernels.ctypes, "CDLL", refuse)
    with pytest.warns(rowkernels.KernelWarning, match="failed to map segment"):
        lib, why = rowkernels._build.__wrapped__("native")
    assert lib is None and "failed to map segment" in why


def decoded(model, idx: torch.Tensor, steps: int) -> tuple[torch.Tensor, list]:
    """The hidden states of `steps` one-token steps after a prefill of idx's first tokens, and the caches."""
    with torch.no_grad():
        caches = model.new_caches(idx.size(0))
        model.hidden(idx[:, :-steps], caches)
        out = torch.cat([model.hidden(idx[:, t : t + 1], caches) for t in range(idx.size(1) - steps, idx.size(1))], 1)
    return out.float(), caches


@pytest.fixture
def taken(monkeypatch) -> dict[str, list[int]]:
    """Calls of our C steps, by kind ("stack": StackStep, the model's; "block": BlockStep): [taken, declined]."""
    counts = {"stack": [0, 0], "block": [0, 0]}
    for kind, cls in (("stack", rowkernels.StackStep), ("block", rowkernels.BlockStep)):

        def counted(step, *args, _call=cls.__call__, _kind=kind):
            y = _call(step, *args)
            counts[_kind][y is None] += 1
            return y

        monkeypatch.setattr(cls, "__call__", counted)
    return counts


def unstepped(model, blocks: bool = True):
    """The model's own step off, and its blocks' too (`blocks`): it computes through the modules."""
    model.step = None
    for b in model.transformer.h if blocks else ():
        b.step = None


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "relu2"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_decode_step_in_c_computes_what_the_blocks_do(march, kind, activation, bias, monkeypatch, taken):
    """The whole step (StackStep), then block by block (BlockStep), against the modules. Head size 12: the
    attention's dot products in 8s and the rest; the caches hold the same keys and values."""
    monkeypatch.setenv("GPT_ROW_KERNELS", march)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=48, activation=activation, bias=bias)
    )
    for p in model.parameters():  # values of about 1 everywhere: GELU's cube and attention's scale matter
        nn.init.normal_(p, std=0.3)
    model = pack(quantize(model.eval(), "int8") if kind == "int8" else model.eval().to(getattr(torch, kind)))
    assert isinstance(model.step, rowkernels.StackStep)
    assert all(isinstance(b.step, rowkernels.BlockStep) and b.step.march == march for b in model.transformer.h)
    idx = torch.randint(0, 50, (3, 9))
    runs = [decoded(model, idx, 4)]
    assert taken == {"stack": [4, 1], "block": [0, 2]}  # every one-token step; the prefill through the blocks
    unstepped(model, blocks=False)
    runs.append(decoded(model, idx, 4))
    assert taken == {"stack": [4, 1], "block": [2 * 4, 2 + 2]}
    unstepped(model)
    blocks, caches = decoded(model, idx, 4)
    # an int8 row's float rounding can move a quantised value by one step, a bf16 result by one rounding
    tol = 1e-5 if kind == "float32" else 3e-2
    for ours, our_caches in runs:
        torch.testing.assert_close(ours, blocks, atol=tol, rtol=tol)
        if kind == "bfloat16":  # rounded to bf16 where the eager step rounds: nearly every value the same number
            assert (ours != blocks).float().mean() <= 0.02
        for a, b in zip(our_caches, caches):
            assert a.pos == b.pos == 9
            torch.testing.assert_close(a.k, b.k, atol=tol, rtol=tol)
            torch.testing.assert_close(a.v, b.v, atol=tol, rtol=tol)


def test_the_step_takes_one_token_over_a_plain_cache_only(taken):
    model = pack(tiny())
    idx = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        caches = model.new_caches(2)
        model.hidden(idx[:, :4], caches)  # a prefill: through the blocks
        assert taken == {"stack": [0, 1], "block": [0, 2]}
        model.hidden(idx[:, 4:5], caches, mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))  # a mask: the blocks'
        assert taken == {"stack": [0, 1], "block": [0, 2]}
        model.hidden(idx[:, 5:6], caches)
        assert taken == {"stack": [1, 1], "block": [0, 2]}
        with pytest.raises(IndexError, match="index out of range"):  # as nn.Embedding says it
            model.hidden(torch.tensor([[50], [0]]), caches)
        assert all(c.pos == 6 for c in caches)
        unstepped(model, blocks=False)  # the blocks' steps, over the same caches
        model.hidden(idx[:, 5:6], caches)
        assert taken["block"] == [2, 2] and all(c.pos == 7 for c in caches)
        for cache in caches:  # a static cache (a tensor position): the blocks'
            cache.pos = torch.tensor(5)
        model.hidden(idx[:, 5:6], caches)
        assert taken["block"][0] == 2
        maps = model.attention_maps(idx[:, :1])  # recording attention weights: the blocks'
        assert len(maps["self"]) == 2 and taken["block"][0] == 2
    for over in ({"attention_window": "4"}, {"x0_skip": True}, {"pos_encoding": "sinusoidal"}):
        assert pack(tiny(**over)).step is None  # masks, skips, a fixed table: the blocks' steps only
    windowed = pack(tiny(attention_window="4"))  # a ring cache: its keys are in no order
    with torch.no_grad():
        caches = windowed.new_caches(1)
        for t in range(6):
            windowed.hidden(idx[:1, t : t + 1], caches)
    assert caches[0].ring and taken["block"][0] == 2


@pytest.mark.parametrize("over", [{"norm": "post"}, {"qk_norm": True}, {"n_encoder_layer": 1}])
def test_blocks_the_c_step_does_not_compute_keep_their_own(over, taken):
    model = pack(tiny(**over))
    assert all(b.step is None for b in model.transformer.h)
    gated = pack(tiny(value_embeds=True)).transformer.h  # value embeddings in alternate layers: those keep theirs
    assert [b.step is None for b in gated] == [hasattr(b.attn, "ve_gate") for b in gated] != [False, False]
    assert any(isinstance(m, RowLinear) for m in model.transformer.h.modules())  # their products are still ours
    rope = pack(tiny(pos_encoding="rope"))  # a step; its blocks get rotations, which it does not take
    assert all(b.step is not None for b in rope.transformer.h)
    tokens, logits = greedy(rope, torch.randint(0, 50, (1, 3)), 4)
    assert rope.step is None and taken == {"stack": [0, 0], "block": [0, 0]}
    with torch.no_grad():
        torch.testing.assert_close(logits, rope.head(rope.hidden(tokens))[:, -1], atol=1e-4, rtol=1e-4)


def test_the_weights_live_on_huge_pages_where_the_kernel_gives_them():
    layer = RowLinear(nn.Linear(768, 3072))  # 9 MiB of blocks
    w = layer.weight_blocks
    assert w.data_ptr() % HUGE_PAGE == 0 and w.is_contiguous()
    cache = KVCache(1, 12, 1024, 64, "cpu", torch.float32)  # a 3 MiB cache too, zeros without a copy
    assert cache.k.data_ptr() % HUGE_PAGE == 0 and not cache.k.any() and not cache.v.any()
    small = torch.randn(10)
    assert on_huge_pages(small) is small  # under a page: as it is
    big = torch.randn(3 * HUGE_PAGE // 4 + 5)
    assert torch.equal(on_huge_pages(big), big) and on_huge_pages(big).data_ptr() != big.data_ptr()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off here")
    start = w.data_ptr()
    for entry in Path("/proc/self/smaps").read_text().split("\n")[:-1]:
        if entry and entry[0] in "0123456789abcdef" and "-" in entry.split()[0]:
            lo, hi = (int(a, 16) for a in entry.split()[0].split("-"))
            mine = lo <= start < hi
        elif mine and entry.startswith("AnonHugePages:"):
            assert int(entry.split()[1]) >= 2048  # kB: at least one 2 MiB page
            return
    pytest.fail("the mapping of the blocks was not found")


def test_compile_keeps_our_step_for_int8_where_it_takes_the_whole_model(tmp_path, monkeypatch, capsys):
    """`gpt sample --compile --quantize int8` on a CPU where our kernels take the whole step: no Inductor compile,
    the model laid out for them, the same text as without --compile, and a line that says so."""
    from conftest import save_random_lm

    from gpt.checkpoints.loader import load_for_inference
    from gpt.cli import sample as sample_cli

    compiled = []
    monkeypatch.setattr(GPT, "compile_decoding", lambda self: compiled.append(self))
    run = save_random_lm(tmp_path, "abcdefgh ")
    model = load_for_inference(run, "cpu", quantize="int8", compile_step=True).model
    assert not compiled and isinstance(model.step, rowkernels.StackStep) and model.decode_step is None
    load_for_inference(run, "cpu", compile_step=True)  # float32: compiled as always
    assert len(compiled) == 1
    args = ["--ckpt", str(run), "--prompt", "ab", "--max-new-tokens", "12", "--temperature", "0", "--no-stop-at-eot"]
    assert sample_cli.main([*args, "--quantize", "int8", "--compile"]) == 0
    out, err = capsys.readouterr()
    assert "nothing to compile" in err and "s of it compiling" not in err
    assert sample_cli.main([*args, "--quantize", "int8"]) == 0 and capsys.readouterr().out == out

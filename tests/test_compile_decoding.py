"""`GPT.compile_decoding` (`sample.py --compile`): one compiled one-token step, the same tokens as eager.

On the CPU the step is compiled ahead of time into one C++ function (`AheadOfTimeStep`,
gpt/model/compiled.py, ~15 s a compile: the compiled models are shared by module fixtures); elsewhere it
is torch.compile's `DynamoStep`, tested here on the CPU by building it directly."""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gpt import GPT, GPTConfig
from gpt.errors import UserError
from gpt.infer.sampling import Decoder
from gpt.model import compiled
from gpt.model.attention import one_query_attention
from gpt.model.compiled import AheadOfTimeStep, CompileError, DynamoStep
from gpt.model.packed import pack
from gpt.model.quantize import quantize

NATIVE_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def tiny(dtype=torch.float32, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=23, block_size=16, n_layer=2, n_head=2, n_embd=32) | kw
    return GPT(GPTConfig(**cfg)).eval().to(dtype)


def greedy(model: GPT, prompt: torch.Tensor, n: int, check=None) -> list[list[int]]:
    dec = Decoder(model, prompt, keep=8)
    out = []
    for _ in range(n):
        if check:
            check(dec)
        token = dec.logits.argmax(-1)
        out.append(token.tolist())
        dec.advance(token)
    return out


def twin_of(model: GPT, step=None) -> GPT:
    twin = GPT.__new__(GPT)
    twin.__dict__ = dict(model.__dict__)  # the same weights, its own compiled step
    if step is None:
        twin.compile_decoding()
    else:
        twin.decode_step = step(twin)
    return twin


def agrees_with_the_full_forward(model: GPT, atol: float = 1e-4):
    def check(dec: Decoder) -> None:
        logits = model(dec.tokens[:, dec.start :])[0][:, -1].float()
        torch.testing.assert_close(dec.logits, logits, rtol=atol, atol=atol)

    return check


PROMPT = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
ONE_ROW = PROMPT[:1]


@pytest.fixture(scope="module")
def learned() -> tuple[GPT, GPT]:
    model = tiny()
    twin = twin_of(model)
    assert isinstance(twin.decode_step, AheadOfTimeStep)  # the CPU's kind
    return model, twin


def test_compiled_step_equals_eager_and_the_full_forward_at_every_length(learned):
    model, compiled = learned
    # 2 rows, 30 tokens in a 16-token context: every cache length, window slides (eager prefills) in between
    assert greedy(compiled, PROMPT, 30, agrees_with_the_full_forward(model)) == greedy(model, PROMPT, 30)
    # other row counts, one row too (the last sample left in a batch): the same compiled code, no second compile
    three = torch.tensor([[7, 1, 2], [3, 3, 3], [9, 8, 7]])
    assert greedy(compiled, three, 20) == greedy(model, three, 20)
    assert greedy(compiled, PROMPT[:1, :2], 20) == greedy(model, PROMPT[:1, :2], 20)
    assert len(compiled.decode_step._runs) == 1


def test_after_the_compile_a_step_never_runs_the_python_model(learned, monkeypatch):
    model, compiled = learned
    greedy(compiled, PROMPT, 2)  # compiled (by the test above, or now)

    def python_step(*args):
        raise AssertionError("the compiled step ran the model's Python code")

    monkeypatch.setattr(compiled, "_logits_after", python_step)
    assert greedy(compiled, PROMPT, 12) == greedy(model, PROMPT, 12)


@pytest.mark.parametrize(
    "scaling",
    [
        {},
        pytest.param(  # the stretched angles are in the compiled step too (another ~15 s compile)
            dict(rope_scaling="yarn", rope_factor=4.0, rope_original_block=4), marks=pytest.mark.slow
        ),
    ],
)
def test_rope_rolling_cache_compiled_for_one_row_equals_eager(scaling):
    model = tiny(pos_encoding="rope", **scaling)
    twin = twin_of(model)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    eager, compiled = Decoder(model, prompt), Decoder(twin, prompt)
    for _ in range(24):  # past the full 16-slot cache: the rolling slots
        torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-4, atol=1e-4)
        token = eager.logits.argmax(-1)
        eager.advance(token)
        compiled.advance(token)
    assert [one_row for one_row, _ in twin.decode_step._runs] == [True]  # one row's own program


@pytest.mark.parametrize(
    "failure, message",
    [
        (
            RuntimeError("C++ compile error\ng++: not found\n(pages of log)"),
            r"\(C\+\+ compile error\); it needs a C\+\+",
        ),
        (OSError(28, "No space left on device"), "compile the decode step in .*: the disk is full"),
    ],
)
def test_a_failed_compile_is_one_line(failure, message, monkeypatch):
    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fail)
    with pytest.raises(UserError, match=message) as e:
        greedy(twin_of(tiny()), PROMPT, 2)
    assert "\n" not in str(e.value) and "without --compile" in str(e.value)


@pytest.mark.skipif(not NATIVE_BF16, reason="oneDNN computes bf16 natively only")
@pytest.mark.parametrize(  # small models' rows (slow to compile, -m slow); a big one's single row
    "template_below", [pytest.param(compiled.SMALL_PARAMS, marks=pytest.mark.slow), 0]
)
def test_bf16_compiled_step_equals_eager_to_bf16_rounding(template_below, monkeypatch):
    """Through the GEMM template: a small model's rows, and a big one's single row (GPT-2's `gpt sample
    --compile`); a big model's many rows keep oneDNN's kernels."""
    monkeypatch.setattr(compiled, "SMALL_PARAMS", template_below)
    model = tiny(torch.bfloat16)
    assert ("max_autotune" in compiled.inductor_options(model)) == bool(template_below)
    assert "max_autotune" in compiled.inductor_options(model, one_row=True)
    assert "realize_opcount_threshold" not in compiled.inductor_options(model, one_row=True)
    prompt = PROMPT if template_below else ONE_ROW
    greedy(twin_of(model), prompt, 20, agrees_with_the_full_forward(model, atol=3e-2))


def test_the_step_run_eagerly_equals_the_full_forward():
    """The exported module itself (the caches gathered to their written slots), without the compiler."""
    model = tiny(pos_encoding="rope")
    twin = twin_of(model, lambda m: AheadOfTimeStep(m, compiled=False))
    prompt = torch.tensor([[3, 1, 4], [2, 7, 1]])
    assert greedy(twin, prompt, 30) == greedy(model, prompt, 30)
    twin = twin_of(tiny(), lambda m: AheadOfTimeStep(m, compiled=False))
    greedy(twin, PROMPT, 30, agrees_with_the_full_forward(tiny()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_attention_is_sdpa(dtype):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 1, 8, dtype=dtype), torch.randn(2, 3, 6, 8, dtype=dtype), torch.randn(2, 3, 6, 8)
    v = v.to(dtype)
    for mask in ((torch.arange(6) <= 3).view(1, 1, 1, 6), torch.rand(2, 1, 1, 6) < 0.7):
        mask[..., 0] = True
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).to(dtype)
        got = one_query_attention(q, k, v, mask)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("kernels, kind", [(False, "ChunkedLinear"), (True, "RowLinear")])
def test_packed_layers_are_refused_in_one_line(kernels, kind):
    model = pack(tiny(), chunks=2, chunk_bytes=0, kernels=kernels)
    kind = kind if any(type(m).__name__ == kind for m in model.modules()) else "ChunkedLinear"  # (no compiler)
    with pytest.raises(CompileError, match=f"plain nn.Linear .* not {kind}: compile before packing") as e:
        AheadOfTimeStep(model)
    assert "\n" not in str(e.value)


def test_int8_compiled_step_equals_eager_int8():
    """Int8Linear is plain PyTorch: compiled with oneDNN's int8 products (no GEMM template), the same numbers."""
    model = quantize(tiny(), "int8")
    assert compiled.inductor_options(model) == {"freezing": True}
    twin = twin_of(model)
    assert greedy(twin, PROMPT, 30, agrees_with_the_full_forward(model, atol=1e-4)) == greedy(model, PROMPT, 30)


def test_int8_one_row_step_sums_the_row_products_and_equals_eager_int8(monkeypatch):
    """One row of a big model: the products are the row times each int8 weight row summed in float32
    (`row_products`), integers summed exactly, so the same tokens and logits as eager's `torch._int_mm`."""
    model = quantize(tiny(), "int8")
    assert compiled.inductor_options(model, one_row=True) == {"freezing": True}  # small: torch._int_mm
    monkeypatch.setattr(compiled, "SMALL_PARAMS", 0)  # as GPT-2's size
    assert compiled.inductor_options(model, one_row=True) == {"freezing": True, "realize_opcount_threshold": 0}
    twin = twin_of(model)
    assert greedy(twin, ONE_ROW, 12, agrees_with_the_full_forward(model, atol=1e-5)) == greedy(model, ONE_ROW, 12)


def test_row_products_compute_each_layer_as_it_was_for_that_model_only_and_are_undone():
    model, other = quantize(tiny(), "int8"), tiny()
    x = torch.randn(1, 1, 32)
    with compiled.row_products(model), compiled.row_products(other):
        assert not any("forward" in vars(m) for m in tiny().modules())
        for m in [model.transformer.h[0].mlp.c_fc, other.transformer.h[0].mlp.c_fc, other.lm_head]:
            assert "forward" in vars(m)
            torch.testing.assert_close(m(x), type(m).forward(m, x), rtol=1e-6, atol=1e-6)
    assert not any("forward" in vars(m) for m in [*model.modules(), *other.modules()])


# ---- DynamoStep: torch.compile's step (CUDA), on the CPU -------------------------------------------------


@pytest.fixture()
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_dynamo_step_equals_eager_and_full_forward_and_compiles_once(fresh_dynamo):
    model = tiny()
    compiled = twin_of(model, DynamoStep)
    prompt = PROMPT[:1]
    assert greedy(compiled, prompt, 30, agrees_with_the_full_forward(model)) == greedy(model, prompt, 30)
    # one graph for every length, a second for the full (contiguous) cache; a new decoder adds none
    assert counters["stats"]["unique_graphs"] == 2
    assert greedy(compiled, prompt[:, :3], 20) == greedy(model, prompt[:, :3], 20)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]


def test_dynamo_step_marks_the_cache_length_dynamic_once_not_at_every_step(fresh_dynamo, monkeypatch):
    """Marking costs Python time at every token (~35 us, an eighth of the char model's compiled step);
    once is enough: the symbolic-length graph then serves every length without recompiling."""
    model = twin_of(tiny(), DynamoStep)
    marked = []
    real = torch._dynamo.mark_dynamic
    monkeypatch.setattr(torch._dynamo, "mark_dynamic", lambda t, dim: (marked.append(dim), real(t, dim)))
    prompt = torch.tensor([[1, 2, 3]])
    assert greedy(model, prompt, 10) == greedy(tiny(), prompt, 10)
    assert len(marked) == 2 * 2  # keys and values of 2 layers, at the first step only
    greedy(model, prompt, 10)
    assert len(marked) == 2 * 2 and counters["stats"]["unique_graphs"] == 1


def test_int4_compiled_step_equals_eager_int4():
    """Int4Linear is plain PyTorch: its int4 kernel stays a call of that op when compiled (for many rows, and for
    one row of a big model, where the other layers sum row products), the same tokens, the logits to bf16's
    rounding of the kernel's output."""
    model = quantize(tiny(), "int4", 32)
    assert compiled.inductor_options(model) == {"freezing": True}
    twin = twin_of(model)
    assert greedy(twin, PROMPT, 20, agrees_with_the_full_forward(model, atol=1e-2)) == greedy(model, PROMPT, 20)
    assert greedy(twin, ONE_ROW, 12, agrees_with_the_full_forward(model, atol=1e-2)) == greedy(model, ONE_ROW, 12)

"""FP8 block-scaled kernels: quantization against its torch reference (the same values) and within e4m3's
rounding bound, the GEMM against the same maths in torch and within FP8 tolerance of the bf16 product on the
dequantized weight, FP8Linear's gradients, the fused LoRA blocks on FP8 bases, the fallback path and doctor's
words. Under the Triton interpreter: small shapes, blocks of 32 to cross several blocks cheaply."""

import dataclasses

import pytest
import torch

from fastplug.kernels import fp8 as F8
from fastplug.kernels.lora import LoRAProjection, lora_linear, lora_mlp, lora_qkv
from tests.helpers import assert_close, rel_err

# FP8 against a bf16 product: x (and dY) rounded to 3 mantissa bits, ~2.5% per element on random data
FP8_TOL = 6e-2


def _weight(n, k, dtype=torch.bfloat16):
    return torch.randn(n, k, dtype=dtype)


def _roundtrip_bound(x, scale_per_element):
    """e4m3 rounding: half an ulp, 2^-4 of the value in the normal range, 2^-10 of the scale below it."""
    return torch.maximum(x.abs() / 16, scale_per_element / 1024) * (1 + 1e-6)


# ------------------------------------------------------------------------------------------ quantization


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,block", [((70, 100), 32), ((33, 64), 32), ((130, 128), 128)])
def test_quantize_weight_equals_reference_within_e4m3_bound(shape, block, dtype):
    w = _weight(*shape, dtype) * 3
    w[:block, :block] = 0  # an all-zero block
    q, s = F8.quantize_weight_blockwise(w, block)
    q_ref, s_ref = F8.quantize_weight_blockwise_reference(w, block)
    assert q.dtype == F8.FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // block), -(-shape[1] // block))
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
    deq = F8.dequantize_blockwise(q, s, block, torch.float32)
    assert torch.equal(deq, F8.dequantize_blockwise_reference(q, s, block, torch.float32))
    per_element = s.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]
    assert (deq - w.float()).abs().le(_roundtrip_bound(w.float(), per_element)).all()
    assert deq[:block, :block].eq(0).all()
    assert q.float().abs().amax() == F8.FP8_MAX  # each block's largest value maps to 448


@pytest.mark.parametrize("shape,group", [((3, 5, 100), 32), ((7, 128), 128), ((1, 40), 32)])
def test_quantize_activation_per_token_group(shape, group):
    x = torch.randn(shape, dtype=torch.bfloat16) * torch.logspace(-3, 2, shape[-1])  # groups of unlike size
    q, s = F8.quantize_activation(x, group)
    q_ref, s_ref = F8.quantize_activation_reference(x, group)
    groups = -(-shape[-1] // group)
    assert q.shape == x.shape and s.shape == (*shape[:-1], groups)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
    deq = F8.dequantize_blockwise(q, s, (1, group), torch.float32)
    assert torch.equal(deq, F8.dequantize_blockwise_reference(q, s, (1, group), torch.float32))
    per_element = s.repeat_interleave(group, -1)[..., : shape[-1]]
    assert (deq - x.float()).abs().le(_roundtrip_bound(x.float(), per_element)).all()


def test_dequantize_into_a_buffer_in_its_dtype():
    q, s = F8.quantize_weight_blockwise(_weight(40, 70), 32)
    out = torch.empty(40, 70, dtype=torch.float16)
    assert F8.dequantize_blockwise(q, s, 32, out=out) is out
    torch.testing.assert_close(out, F8.dequantize_blockwise_reference(q, s, 32, torch.float16), rtol=2**-10, atol=0)


# -------------------------------------------------------------------------------------------------- GEMM


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "lead,n,k,block", [((37,), 70, 100, 32), ((2, 3), 40, 64, 32), ((1,), 33, 96, 32), ((9,), 130, 200, 128)]
)
def test_fp8_block_matmul_against_reference_and_bf16(lead, n, k, block, x_dtype):
    w = _weight(n, k)
    q, s = F8.quantize_weight_blockwise(w, block)
    x = torch.randn(*lead, k, dtype=x_dtype)
    y = F8.fp8_block_matmul(x, q, s, x_group=block)
    assert y.shape == (*lead, n) and y.dtype == x_dtype
    assert_close(y, F8.fp8_block_matmul_reference(x, q, s, x_group=block), torch.bfloat16, "vs the same maths")
    dense = x.double() @ F8.dequantize_blockwise_reference(q, s, block, torch.float64).t()
    assert_close(y, dense, torch.bfloat16, "vs the dequantized product", tol=FP8_TOL)


def test_fp8_gemm_input_grad_accumulate_and_bias():
    n, k, block = 70, 100, 32
    q, s = F8.quantize_weight_blockwise(_weight(n, k), block)
    w = F8.dequantize_blockwise_reference(q, s, block, torch.float64)
    dy = torch.randn(2, 11, n, dtype=torch.bfloat16)
    dq, ds = F8.quantize_activation(dy, block)
    dy_deq = F8.dequantize_blockwise_reference(dq, ds, (1, block), torch.float64)
    dx = F8.fp8_gemm(dq, ds, q, s, block=block, input_grad=True)  # dY W through the stored weight
    assert dx.shape == (2, 11, k)
    assert_close(dx, dy_deq @ w, torch.bfloat16, "dY W")
    x = torch.randn(22, k, dtype=torch.bfloat16)
    xq, xs = F8.quantize_activation(x, block)
    x_deq = F8.dequantize_blockwise_reference(xq, xs, (1, block), torch.float64)
    bias, acc = torch.randn(n, dtype=torch.bfloat16), torch.randn(22, n, dtype=torch.bfloat16)
    expected = acc.double() + x_deq @ w.t() + bias.double()
    assert F8.fp8_gemm(xq, xs, q, s, block=block, bias=bias, out=acc) is acc
    assert_close(acc, expected, torch.bfloat16, "out += x W^T + b")


# ------------------------------------------------------------------------------------------- FP8Linear


@pytest.mark.parametrize("dx_fp8", [False, True])
def test_fp8_linear_gradients_against_dequantized_layer(dx_fp8):
    n, k, block = 70, 100, 32
    q, s = F8.quantize_weight_blockwise(_weight(n, k), block)
    w = F8.dequantize_blockwise_reference(q, s, block, torch.float64)
    x = torch.randn(3, 13, k, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(n, dtype=torch.bfloat16, requires_grad=True)
    y = F8.fp8_linear(x, q, s, bias, block=block, dx_fp8=dx_fp8)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, b64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    y64 = torch.nn.functional.linear(x64, w, b64)
    y64.backward(dy.double())
    assert_close(y, y64, torch.bfloat16, "forward", tol=FP8_TOL)
    # dX through the dequantized weight is exact for the FP8 weight; through the FP8 GEMM dY is rounded too
    assert_close(x.grad, x64.grad, torch.bfloat16, "dX", tol=FP8_TOL if dx_fp8 else None)
    assert_close(bias.grad, b64.grad, torch.bfloat16, "db")


def test_fp8_linear_registered_operator_passes_opcheck():
    q, s = F8.quantize_weight_blockwise(_weight(40, 64), 32)
    x = torch.randn(5, 64, requires_grad=True)
    # test_schema is left out: it perturbs every input with a multiplication, which torch lacks for float8
    torch.library.opcheck(
        F8._fp8_linear_op,
        (x, q, s, torch.randn(40, requires_grad=True), 32, False),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_bad_inputs_raise_value_errors():
    q, s = F8.quantize_weight_blockwise(_weight(40, 64), 32)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    cases = [
        (lambda: F8.quantize_weight_blockwise(_weight(4, 4), 48), "power of two"),
        (lambda: F8.quantize_weight_blockwise(torch.randn(4, 4, 4), 32), "2-D"),
        (lambda: F8.quantize_activation(torch.ones(4, 64, dtype=torch.int32), 32), "dtype"),
        (lambda: F8.fp8_block_matmul(x, q.float(), s, x_group=32), "float8_e4m3fn"),
        (lambda: F8.fp8_block_matmul(x, q, s[:, :1], x_group=32), "w_scale must have shape (2, 2)"),
        (lambda: F8.fp8_block_matmul(x, q, s, x_group=128), "w_scale must have shape (1, 1)"),
        (lambda: F8.fp8_block_matmul(x[:, :60], q, s, x_group=32), "x must have shape [..., 64]"),
        (lambda: F8.fp8_linear(x, q, s, torch.zeros(3), block=32), "bias must have shape (40,)"),
        (lambda: F8.fp8_linear(x, q.requires_grad_(), s, block=32), "frozen"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            call()


def test_without_the_kernels_weights_are_dequantized(monkeypatch):
    q, s = F8.quantize_weight_blockwise(_weight(40, 64), 32)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(F8, "_kernels_run", lambda t: False)
    dense = F8.dequantize_blockwise_reference(q, s, 32, torch.bfloat16)
    assert torch.equal(F8.fp8_block_matmul(x, q, s, x_group=32), x @ dense.t())  # x itself is not quantized
    assert torch.equal(F8.quantize_weight_blockwise(dense, 32)[1], F8.quantize_weight_blockwise_reference(dense, 32)[1])
    with pytest.raises(ValueError, match="needs the FP8 kernels"):
        F8.fp8_gemm(*F8.quantize_activation(x, 32), q, s, block=32)


def test_fp8_path_words(monkeypatch):
    monkeypatch.setattr(F8, "_capability", lambda index: (8, 0))
    assert F8.fp8_path("cuda:0") == "dequantize + matmul in the input dtype (capability 8.0 < 8.9: no FP8 tensor cores)"
    assert F8.fp8_path("cuda:0", "quantize_activation").startswith("torch reference (capability 8.0")
    monkeypatch.setattr(F8, "_capability", lambda index: (9, 0))
    assert F8.fp8_path("cuda:0") == "Triton FP8 block-scaled GEMM"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert F8.fp8_path("cpu") == "dequantize + matmul in the input dtype (no Triton on cpu)"


# --------------------------------------------------------------------------------- fused LoRA on FP8


def _fp8_and_dense(n, k, block=32):
    q, s = F8.quantize_weight_blockwise(_weight(n, k), block)
    return F8.fp8_parameter(q, s, block), F8.dequantize_blockwise_reference(q, s, block, torch.bfloat16)


def _proj(weight, n, k, r=4):
    a = (torch.randn(r, k) / k**0.5).requires_grad_()
    b = (torch.randn(n, r) / r).requires_grad_()
    return LoRAProjection(weight, None, a, b, 2.0)


def _run(fn, x, projs, dy):
    adapters = [t for p in projs for t in (p.lora_A, p.lora_B) if t is not None]
    for t in adapters:
        t.grad = None
    x = x.detach().requires_grad_()
    y = fn(x, *projs)
    torch.autograd.backward(y, dy)
    return y, x.grad, [t.grad.clone() for t in adapters]


@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_fused_lora_on_fp8_bases_matches_the_dequantized_bases(block):
    hidden, inter, kv = 64, 96, 32
    if block == "mlp":
        shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
    else:
        shapes = [(hidden, hidden), (kv, hidden), (kv, hidden)]
    pairs = [_fp8_and_dense(*shape) for shape in shapes]
    fp8_projs = [_proj(fp8, *shape) for (fp8, _), shape in zip(pairs, shapes)]
    dense_projs = [p._replace(weight=dense) for p, (_, dense) in zip(fp8_projs, pairs)]  # the same adapters
    if block == "qkv":
        fp8_projs[1] = fp8_projs[1]._replace(lora_A=None, lora_B=None)  # k_proj: a plain FP8 linear
        dense_projs[1] = dense_projs[1]._replace(lora_A=None, lora_B=None)
    fn = lora_mlp if block == "mlp" else lora_qkv
    x = torch.randn(2, 9, hidden, dtype=torch.bfloat16)
    y_ref = fn(x, *dense_projs)
    dy = tuple(torch.randn_like(t) for t in y_ref) if block == "qkv" else torch.randn_like(y_ref)
    y8, dx8, grads8 = _run(fn, x, fp8_projs, dy)
    y, dx, grads = _run(fn, x, dense_projs, dy)
    for a, b in zip(y8 if block == "qkv" else (y8,), y if block == "qkv" else (y,)):
        assert_close(a, b, torch.bfloat16, "forward", tol=FP8_TOL)
    assert_close(dx8, dx, torch.bfloat16, "dX", tol=FP8_TOL)
    for g8, g in zip(grads8, grads):
        assert rel_err(g8, g) < 0.1


def test_fused_lora_linear_with_bias_on_an_fp8_parameter():
    weight, dense = _fp8_and_dense(40, 64)
    # integer-typed and frozen (a model's .to(dtype) leaves it alone), the same bytes as the FP8 tensors
    assert weight.dtype == torch.uint8 and weight.fp8_scale.dtype == torch.int32 and not weight.requires_grad
    assert torch.equal(F8.dequantize_blockwise_reference(*F8.fp8_weight(weight), 32, torch.bfloat16), dense)
    proj = LoRAProjection(weight, torch.randn(40, dtype=torch.bfloat16), None, None, 0.0)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    assert_close(
        lora_linear(x, proj), x.double() @ dense.double().t() + proj.bias.double(), torch.bfloat16, tol=FP8_TOL
    )


@pytest.mark.parametrize("input_grad", [False, True])
def test_tma_loads_give_the_same_product(input_grad):
    # the tensor-descriptor path (Hopper's TMA; emulated by the interpreter): zero fill past every edge
    n, k, block = 80, 96, 32
    q, s = F8.quantize_weight_blockwise(_weight(n, k), block)
    a = torch.randn(37, n if input_grad else k, dtype=torch.bfloat16)
    aq, as_ = F8.quantize_activation(a, block)
    config = dataclasses.replace(F8.GEMM_INTERPRETER, tma=True)
    assert F8._tma_ready(a.device, aq, q)
    y = F8.fp8_gemm(aq, as_, q, s, block=block, input_grad=input_grad, config=config)
    assert torch.equal(y, F8.fp8_gemm(aq, as_, q, s, block=block, input_grad=input_grad))

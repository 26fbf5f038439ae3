"""Flash attention on a GPU at the bench's sequence lengths (fewer heads, so that the fp32 reference fits):
forward and dq/dk/dv against attention_reference, bf16 and fp16; the dispatcher's SDPA path."""

import dataclasses
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from fastplug.kernels import attention, attention_reference, tuning
from fastplug.kernels.attention import FlashAttention, _problem, packed_bounds, right_padding_bounds
from tests.helpers import rel_err

A = importlib.import_module("fastplug.kernels.attention")  # the module: the package exports the function

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(B, Hq, Hkv, T, D, dtype):
    q = torch.randn(B, T, Hq, D, device=DEV, dtype=dtype).transpose(1, 2)  # as the attention modules pass them
    k = torch.randn(B, T, Hkv, D, device=DEV, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, device=DEV, dtype=dtype).transpose(1, 2)
    return [t.requires_grad_() for t in (q, k, v)]


def _check(fn, ref_fn, inputs, tol=2e-2):
    out = fn(*inputs)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref = ref_fn(*ref_inputs)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        err = rel_err(a, b)
        assert err < tol, f"{name}: relative error {err:.2e}"


def _triton(options):
    """The Triton kernel itself, past the dispatcher (which may pick SDPA)."""

    def run(q, k, v):
        D = q.shape[3]
        p = _problem(q, k, options.get("causal", True), options.get("sliding_window"), options.get("softcap"), D**-0.5)
        return FlashAttention.apply(q, k, v, p, None, None)

    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape, options",
    [
        ((1, 8, 2, 4096, 128), {}),  # Llama causal, GQA 4:1
        ((1, 4, 1, 3000, 64), {"causal": False}),  # MQA, full
        ((1, 4, 2, 2500, 80), {"sliding_window": 700}),
        ((1, 2, 1, 8192, 256), {"softcap": 50.0, "sliding_window": 4096}),  # Gemma2 at T8192
        ((1, 4, 2, 2047, 96), {"softcap": 30.0}),
    ],
)
def test_triton_kernel_matches_reference(shape, options, dtype):
    inputs = _inputs(*shape, dtype)
    _check(_triton(options), lambda *x: attention_reference(*x, **options), inputs)


@pytest.mark.parametrize("options", [{"sliding_window": 128}, {}], ids=["sliding", "full"])
def test_sinks_at_gpt_oss_shapes(options):
    """gpt-oss's layers (64-wide heads, GQA 8:1, sliding window 128 or full) at T 2048 in bf16 with attention sinks:
    out and the gradients of q, k, v and the sinks against the fp32 reference (the dispatcher never takes SDPA)."""
    q, k, v = _inputs(1, 8, 1, 2048, 64, torch.bfloat16)
    sinks = (2 * torch.randn(8, device=DEV)).to(torch.bfloat16).requires_grad_()
    inputs = [q, k, v, sinks]
    out = attention(q, k, v, sinks=sinks, **options)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref = attention_reference(*ref_inputs[:3], sinks=ref_inputs[3], **options)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad.float())
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref, *ref_grads)):
        assert rel_err(a, b) < 2e-2, f"{name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize("tma", [("fwd", "dkdv", "dq"), ()], ids=["tma", "pointers"])
@pytest.mark.parametrize(
    "shape, options",
    [
        ((1, 8, 2, 2049, 128), {}),
        ((1, 2, 1, 3001, 256), {"softcap": 50.0, "sliding_window": 1000}),
    ],
)
def test_every_kernel_with_and_without_tma(shape, options, tma, request):
    """AttentionTables.tma picks TMA descriptors per kernel and head dim; each kernel is right both ways."""
    tables = dataclasses.replace(A.ATTENTION_TABLES, tma=((256, tma),))
    request.addfinalizer(tuning.override("attention", functools.partial(A.attention_config, tables=tables)).undo)
    inputs = _inputs(*shape, torch.bfloat16)
    _check(_triton(options), lambda *x: attention_reference(*x, **options), inputs)


def test_right_padded_gemma2_rows_match_the_padded_mask():
    """Right-padded rows through per-token bounds (the model path for Gemma2's padded batches) against the
    padded mask transformers applies: every position, pads included, and all three gradients."""
    B, T = 2, 3000
    count = torch.tensor([3000, 1800], device=DEV)
    valid = torch.arange(T, device=DEV)[None] < count[:, None]
    (start, end), right_padded = right_padding_bounds(valid)
    assert bool(right_padded.all())
    options = {"softcap": 50.0, "sliding_window": 1500}

    def reference(q, k, v):
        i, j = torch.arange(T, device=DEV)[:, None], torch.arange(T, device=DEV)[None]
        seen = (j <= i) & (j > i - options["sliding_window"]) & valid[:, None, None, :]
        kf, vf = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
        scores = q @ kf.transpose(-1, -2) * q.shape[3] ** -0.5
        scores = options["softcap"] * torch.tanh(scores / options["softcap"])
        return (torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ vf).transpose(1, 2)

    def kernel(q, k, v):
        return A.flash_attention(q, k, v, **options, doc_start=start, doc_end=end)

    _check(kernel, reference, _inputs(B, 2, 1, T, 256, torch.bfloat16))


def test_varlen_8_documents_matches_per_document_reference():
    lengths = [3001, 1, 517, 4096, 2222, 1999, 3333, 1215]  # 16384 tokens
    cu = torch.tensor([0, *lengths], device=DEV).cumsum(0).to(torch.int32)
    inputs = _inputs(1, 8, 2, sum(lengths), 128, torch.bfloat16)

    def per_document(q, k, v):
        return torch.cat(
            [
                attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
            ],
            dim=1,
        )

    _check(lambda *x: attention(*x, cu_seqlens=cu), per_document, inputs)
    position_ids = torch.cat([torch.arange(n, device=DEV) for n in lengths])[None]
    start, end = packed_bounds(position_ids)
    assert torch.equal(start[0], torch.repeat_interleave(cu[:-1], torch.tensor(lengths, device=DEV)))


def test_dispatcher_takes_sdpa_for_plain_causal():
    q, k, v = _inputs(2, 8, 2, 1024, 128, torch.bfloat16)
    out = attention(q, k, v)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert torch.equal(out, sdpa)

"""Flash attention (Triton, interpreter on CPU) against attention_reference: forward and dq/dk/dv, causal and
not, sliding window, softcap, GQA/MQA, head dims that are not powers of two, packed documents, attention sinks
(against float64, their gradient too); bad input."""

import dataclasses
import functools
import importlib

import pytest
import torch

from fastplug.kernels import attention, attention_reference, cu_seqlens_from_position_ids, tuning
from fastplug.kernels.attention import flash_attention, packed_bounds, right_padding_bounds
from tests.helpers import TOL, assert_close, rel_err

A = importlib.import_module("fastplug.kernels.attention")  # the module: the package exports the function

# Every kernel both ways: tiles read through TMA descriptors, and through masked pointer loads.
PATHS = {"TMA": ((256, ("fwd", "dkdv", "dq")),), "pointers": ((256, ()),)}


def with_tma_table(request, table):
    """Launches read through TMA per `table` until the test ends (the override hook, undone by a finalizer)."""
    tables = dataclasses.replace(A.ATTENTION_TABLES, tma=table)
    request.addfinalizer(tuning.override("attention", functools.partial(A.attention_config, tables=tables)).undo)


@pytest.fixture(params=list(PATHS))
def path(request):
    with_tma_table(request, PATHS[request.param])
    return request.param


def _inputs(B, Hq, Hkv, T, S, D, dtype=torch.float32):
    q = torch.randn(B, Hq, T, D, dtype=dtype)
    # k and v transposed views, as the attention modules hand them over (B, T, H, D) -> (B, H, T, D)
    k = torch.randn(B, S, Hkv, D, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, dtype=dtype).transpose(1, 2)
    return [t.requires_grad_() for t in (q, k, v)]


def _fwd_bwd(fn, inputs, grad):
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, grad)
    return out, grads


def _compare(fn, ref_fn, inputs, dtype, tol=None):
    out_shape = (inputs[0].shape[0], inputs[0].shape[2], inputs[0].shape[1], inputs[0].shape[3])
    grad = torch.randn(out_shape, dtype=dtype)
    out, grads = _fwd_bwd(fn, inputs, grad)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref, ref_grads = _fwd_bwd(ref_fn, ref_inputs, grad.float())
    assert out.shape == out_shape and out.dtype == dtype
    assert_close(out, ref, dtype, "out", tol)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape
        assert_close(g, r, dtype, name, tol)


# (B, Hq, Hkv, T, S, D, options): T and S are never multiples of the interpreter's 16/32 blocks
CASES = {
    "causal GQA 4:1 D64": (2, 8, 2, 37, 37, 64, {}),
    "full MQA D80": (1, 4, 1, 45, 45, 80, {"causal": False}),
    "window D128": (1, 4, 2, 50, 50, 128, {"sliding_window": 7}),
    "softcap D256": (1, 2, 1, 33, 33, 256, {"softcap": 5.0}),
    "window+softcap MQA D80": (1, 4, 1, 41, 41, 80, {"sliding_window": 9, "softcap": 5.0, "scale": 0.2}),
    "keys longer than queries D64": (1, 2, 1, 5, 40, 64, {"sliding_window": 20}),
    "full with window D64": (1, 2, 2, 40, 40, 64, {"causal": False, "sliding_window": 6}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_reference_fp32(case, path):
    B, Hq, Hkv, T, S, D, options = CASES[case]
    inputs = _inputs(B, Hq, Hkv, T, S, D)
    _compare(lambda *x: attention(*x, **options), lambda *x: attention_reference(*x, **options), inputs, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_half_precision(dtype, path):
    inputs = _inputs(1, 4, 2, 39, 39, 96, dtype)
    options = {"sliding_window": 11, "softcap": 20.0}
    # the reference rounds nothing: bf16/fp16 kernels round p and dS to the input dtype for the dots
    _compare(
        lambda *x: attention(*x, **options), lambda *x: attention_reference(*x, **options), inputs, dtype, tol=2e-2
    )


DOCS = (11, 17, 9)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 5, "softcap": 5.0}, {"causal": False}])
def test_varlen_matches_per_document_reference(options, path):
    total = sum(DOCS)
    cu = torch.tensor([0, 11, 28, 37], dtype=torch.int32)
    inputs = _inputs(1, 4, 2, total, total, 64)

    def per_document(q, k, v):
        outs = [
            attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], **options)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
        return torch.cat(outs, dim=1)

    _compare(lambda *x: attention(*x, cu_seqlens=cu, max_seqlen=17, **options), per_document, inputs, torch.float32)


# (B, Hq, Hkv, T, S, D, options), with sinks: gpt-oss's sliding and full layers (GQA), keys beyond the queries
# (a cached step), packed documents, and a row of pads that sees no key (its output 0: all the weight on the sink)
SINK_CASES = {
    "causal window GQA D40": (1, 4, 2, 18, 18, 40, {"sliding_window": 6}),
    "full MQA D24": (1, 2, 1, 19, 19, 24, {"causal": False}),
    "keys longer D32": (1, 2, 1, 3, 23, 32, {}),
    "packed D16": (1, 2, 1, 20, 20, 16, {"cu_seqlens": torch.tensor([0, 7, 20], dtype=torch.int32)}),
}


@pytest.mark.parametrize(
    "case, dtype", [(case, torch.float32) for case in SINK_CASES] + [("causal window GQA D40", torch.bfloat16)]
)
def test_sinks_against_float64(case, dtype):
    """Output and the gradients of q, k, v and the sinks against the float64 maths (the sink's logit one more column
    of each row's softmax, dropped after it); bf16 no worse than torch's own bf16 computation of the same."""
    B, Hq, Hkv, T, S, D, options = SINK_CASES[case]
    q, k, v = _inputs(B, Hq, Hkv, T, S, D, dtype)
    sinks = (2 * torch.randn(Hq)).to(dtype).requires_grad_()  # logits of the size of the scores, some larger
    inputs = (q, k, v, sinks)
    grad = torch.randn(B, T, Hq, D).to(dtype)
    out = attention(q, k, v, sinks=sinks, **options)
    got = torch.autograd.grad(out, inputs, grad)

    def maths(*xs, cast):
        xs = [x.detach().to(cast).requires_grad_() for x in xs]
        cu = options.get("cu_seqlens")
        start, end = A.bounds_from_cu_seqlens(cu, T) if cu is not None else (None, None)
        causal, window = options.get("causal", True), options.get("sliding_window")
        ref = A._reference(*xs[:3], causal, window, None, D**-0.5, start, end, xs[3])
        return ref, torch.autograd.grad(ref, xs, grad.to(cast))

    ref, ref_grads = maths(*inputs, cast=torch.float64)
    floor = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "dsinks": 0.0}
    if dtype != torch.float32:  # torch's own error at this precision (its maths in bf16, the same inputs)
        low, low_grads = maths(*inputs, cast=dtype)
        floor = dict(zip(floor, (rel_err(x, r) for x, r in zip((low, *low_grads), (ref, *ref_grads)))))
    for name, x, r in zip(floor, (out, *got), (ref, *ref_grads)):
        assert x.dtype == dtype and x.shape == r.shape, name
        bound = TOL[dtype] if dtype == torch.float32 else max(2 * floor[name], TOL[dtype]) + 1e-3
        assert rel_err(x, r) < bound, f"{name}: {rel_err(x, r):.2e} >= {bound:.1e}"


def test_sinks_on_rows_that_see_no_key_and_bad_sinks():
    """A pad row of a right-padded batch sees no key beyond its bounds: every row still gets the sink's share; the
    sinks must be one per query head, of a float dtype, on q's device."""
    q, k, v = _inputs(1, 2, 1, 9, 9, 16)
    sinks = torch.randn(2, requires_grad=True)
    start = torch.zeros(1, 9, dtype=torch.int32)
    end = torch.full((1, 9), 9, dtype=torch.int32)
    end[0, 6:] = 0  # these rows see nothing: output 0, the whole row's weight on the sink
    out = flash_attention(q, k, v, doc_start=start, doc_end=end, sinks=sinks)
    assert torch.equal(out[0, 6:], torch.zeros_like(out[0, 6:]))
    out.sum().backward()
    assert torch.isfinite(sinks.grad).all() and torch.isfinite(q.grad).all()
    for bad, match in (
        (torch.randn(3), r"sinks must be a tensor of shape \(2,\)"),
        (torch.randn(1, 2), r"sinks must be a tensor of shape"),
        (torch.zeros(2, dtype=torch.int64), "sinks must have dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            attention(q, k, v, sinks=bad)


def test_tma_only_where_the_layout_allows():
    cpu = torch.device("cpu")
    tables = dataclasses.replace(A.ATTENTION_TABLES, tma=PATHS["TMA"])
    cfg = lambda kernel, block_d: A.attention_config(kernel, block_d, cpu, tables=tables)  # noqa: E731
    x = torch.randn(2, 5, 3, 64)
    assert A._use_tma(cfg("fwd", 64), x.transpose(1, 2))
    assert not A._use_tma(cfg("fwd", 64), x.transpose(1, 2)[..., ::2])  # head dim not unit-stride
    assert not A._use_tma(cfg("fwd", 16), torch.randn(2, 3, 5, 7))  # 28-byte rows
    tables = dataclasses.replace(A.ATTENTION_TABLES, tma=((128, ("dq",)), (256, ("fwd",))))
    assert not A._use_tma(cfg("fwd", 64), x) and A._use_tma(cfg("dq", 64), x) and A._use_tma(cfg("fwd", 256), x)


def test_strides_unfit_for_tma(request):
    """Rows of 7 fp32 (28 bytes, not 16-byte aligned) take the pointer loads in every kernel."""
    with_tma_table(request, PATHS["TMA"])
    inputs = _inputs(1, 4, 2, 23, 23, 7)
    _compare(
        lambda *x: attention(*x, sliding_window=6),
        lambda *x: attention_reference(*x, sliding_window=6),
        inputs,
        torch.float32,
    )


def test_packed_bounds_and_cu_seqlens_from_position_ids():
    position_ids = torch.cat([torch.arange(n) for n in DOCS])[None]
    cu, max_seqlen = cu_seqlens_from_position_ids(position_ids)
    assert cu.tolist() == [0, 11, 28, 37] and cu.dtype == torch.int32 and max_seqlen == 17
    start, end = packed_bounds(position_ids.expand(2, -1))
    assert start.shape == (2, 37) and start.dtype == torch.int32
    assert start[1].tolist() == [0] * 11 + [11] * 17 + [28] * 9
    assert end[0].tolist() == [11] * 11 + [28] * 17 + [37] * 9
    # an unpacked row is one document
    start, end = packed_bounds(torch.arange(6)[None])
    assert start.tolist() == [[0] * 6] and end.tolist() == [[6] * 6]
    # the kernel takes the bounds directly (the model path), same result as cu_seqlens
    q, k, v = _inputs(1, 2, 1, 37, 37, 32)
    start, end = packed_bounds(position_ids)
    out = flash_attention(q, k, v, sliding_window=4, doc_start=start, doc_end=end)
    assert_close(out, attention_reference(q, k, v, sliding_window=4, cu_seqlens=cu), torch.float32, "bounds")


@pytest.mark.parametrize("window, softcap", [(None, None), (6, 50.0)])
def test_right_padding_bounds_give_transformers_padded_mask(window, softcap):
    """Every token, pads included, sees the real keys up to itself (transformers' padded mask), forward and
    all three gradients with the pads' outputs trained too; left padding and holes are flagged."""
    T = 37
    mask = torch.ones(3, T, dtype=torch.long)
    mask[0, -5:] = 0
    mask[2, -1:] = 0
    (start, end), right_padded = right_padding_bounds(mask)
    assert right_padded.tolist() == [True, True, True] and start.dtype == torch.int32
    q, k, v = _inputs(3, 4, 2, T, T, 16)
    out = flash_attention(q, k, v, sliding_window=window, softcap=softcap, doc_start=start, doc_end=end)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    seen = (j <= i) & mask.bool()[:, None, None, :] & (j > i - window if window else True)
    kf, vf = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kf.transpose(-1, -2) * 16**-0.5
    scores = softcap * torch.tanh(scores / softcap) if softcap else scores
    ref = (torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ vf).transpose(1, 2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert_close(out, ref, torch.float32, "output")
    for name, a, b in zip("qkv", got, want):
        assert_close(a, b, torch.float32, f"d{name}")
    holes = torch.ones(3, T, dtype=torch.long)
    holes[0, :3] = 0  # left padding
    holes[1, 5:7] = 0  # a hole
    holes[2] = 0  # no real token
    assert right_padding_bounds(holes)[1].tolist() == [False, False, False]


def test_torch_reference_path_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, no interpreter: the op takes its reference
    q, k, v = _inputs(1, 2, 1, 9, 9, 16)
    assert torch.equal(attention(q, k, v, softcap=3.0), attention_reference(q, k, v, softcap=3.0))


def _bad(**changes):
    q, k, v = _inputs(1, 4, 2, 8, 8, 32)
    args = {"q": q, "k": k, "v": v, **changes}
    return args.pop("q"), args.pop("k"), args.pop("v"), args


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"q": torch.randn(4, 8, 32)}, "q must have rank 4"),
        ({"k": torch.randn(1, 3, 8, 32), "v": torch.randn(1, 3, 8, 32)}, "k's head count 3 must divide"),
        ({"v": torch.randn(1, 2, 8, 32, dtype=torch.bfloat16)}, "k and v must have q's dtype"),
        ({"q": torch.randn(1, 4, 8, 32, dtype=torch.float64)}, "q must have dtype"),
        (
            {"q": torch.randn(1, 4, 8, 288), "k": torch.randn(1, 2, 8, 288), "v": torch.randn(1, 2, 8, 288)},
            "head_dim must be between 1 and 256",
        ),
        ({"k": torch.randn(1, 2, 8, 16), "v": torch.randn(1, 2, 8, 16)}, "k must have q's batch"),
        ({"k": torch.randn(1, 2, 4, 32), "v": torch.randn(1, 2, 4, 32)}, "causal attention needs k at least"),
        ({"cu_seqlens": torch.tensor([0, 5, 3, 8], dtype=torch.int32)}, "cu_seqlens must increase"),
        ({"cu_seqlens": torch.tensor([0, 5, 7], dtype=torch.int32)}, "cu_seqlens must increase strictly from 0 to"),
        ({"cu_seqlens": torch.tensor([0, 8])}, "cu_seqlens must be a 1-D int32"),
        ({"max_seqlen": 8}, "max_seqlen is only meaningful with cu_seqlens"),
        ({"sliding_window": 0}, "sliding_window must be None or an int >= 1"),
        ({"softcap": -1.0}, "softcap must be None or a finite number > 0"),
        ({"scale": float("nan")}, "scale must be None"),
        ({"causal": 1}, "causal must be a bool"),
    ],
)
def test_bad_input_names_the_argument(changes, match):
    q, k, v, options = _bad(**changes)
    for fn in (attention, attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, **options)


def test_cu_seqlens_needs_one_packed_row():
    q, k, v = _inputs(2, 4, 2, 8, 8, 32)
    with pytest.raises(ValueError, match="packed rows"):
        attention(q, k, v, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))


def test_autocast_computes_in_the_autocast_dtype():
    q, k, v = _inputs(1, 2, 1, 20, 20, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, softcap=10.0)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(v.grad).all()
    assert_close(out, attention_reference(q, k, v, softcap=10.0), torch.bfloat16, "autocast out", tol=2e-2)

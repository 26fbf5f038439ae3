"""cross_entropy / fused_linear_cross_entropy against float64 references, under the Triton interpreter.

The module's block and chunk sizes are lowered (`small_tiles`) so that small shapes still loop over several
vocab blocks per row (the last one partial) and over several row chunks of the fused op, some of them
entirely ignored (skipped).
"""

import importlib

import pytest
import torch

from fastplug.kernels import (
    cross_entropy,
    cross_entropy_reference,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from tests.helpers import assert_close

# `fastplug.kernels.cross_entropy` the attribute is the function; the module holds the tunables.
ce_module = importlib.import_module("fastplug.kernels.cross_entropy")

IGNORE = -100
REDUCTIONS = ["mean", "sum", "none"]
# Every option set meets every reduction somewhere in this list (the full product is slow in the interpreter).
OPTION_REDUCTIONS = [
    ("plain", "mean"),
    ("plain", "sum"),
    ("plain", "none"),
    ("smoothing", "mean"),
    ("softcap_zloss", "sum"),
    ("softcap_zloss", "none"),
    ("all", "mean"),
    ("all", "none"),
]
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "softcap_zloss": {"softcap": 4.0, "z_loss": 1e-3},
    "all": {"label_smoothing": 0.2, "softcap": 3.0, "z_loss": 1e-2},
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(ce_module, "ROW_BLOCK", 256)
    monkeypatch.setattr(ce_module, "LOGITS_CHUNK_BYTES", 16 * 1000 * 2)  # 8 fp32 / 16 bf16 rows at V=1000


def _labels(n, vocab, ignored_rows=()):
    labels = torch.randint(0, vocab, (n,))
    labels[list(ignored_rows)] = IGNORE
    return labels


def _many_ignored(n):
    # A leading prompt fully ignored (whole chunks skipped) plus scattered ignored rows.
    return list(range(n // 2)) + list(range(n // 2 + 1, n, 5))


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grad_output(out, reduction):
    if reduction == "none":
        return torch.randn_like(out)
    return torch.tensor(1.0 if reduction == "mean" else 2.5, dtype=out.dtype)


def _loss_and_grads(fn, tensors, reduction, grad_output=None):
    out = fn(*tensors)
    if grad_output is None:
        grad_output = _grad_output(out, reduction)
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, grad_output.to(out.dtype)))
    return out, [next(grads) if t is not None and t.requires_grad else None for t in tensors], grad_output


def _as_float64(t):
    if t is None:
        return None
    return _leaf(t.double()) if t.requires_grad else t.double()


def _check(fn, ref_fn, tensors, reduction, dtype, names):
    """fn on `tensors` vs ref_fn on float64 copies of the same (already rounded) values."""
    out, grads, grad_output = _loss_and_grads(fn, tensors, reduction)
    ref_out, ref_grads, _ = _loss_and_grads(ref_fn, [_as_float64(t) for t in tensors], reduction, grad_output.double())
    assert out.shape == ref_out.shape
    assert_close(out, ref_out, dtype, "loss")
    for name, t, g, ref_g in zip(names, tensors, grads, ref_grads):
        if t is not None and t.requires_grad:
            assert g.dtype == t.dtype and g.shape == t.shape, name
            assert_close(g, ref_g, dtype, f"grad {name}")
    return out, grads


# ------------------------------------------------------------------------------- materialised logits


@pytest.mark.parametrize("option, reduction", OPTION_REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_float64(dtype, option, reduction):
    n, vocab = 29, 1000
    logits = _leaf(torch.randn(n, vocab, dtype=dtype) * 4)
    labels = _labels(n, vocab, range(0, n, 3))
    kw = dict(OPTIONS[option], reduction=reduction)
    _check(
        lambda x: cross_entropy(x, labels, **kw),
        lambda x: cross_entropy_reference(x, labels, **kw),
        [logits],
        reduction,
        dtype,
        ["logits"],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cross_entropy_odd_vocab_leading_shape_non_contiguous(dtype):
    vocab = 3001
    base = _leaf(torch.randn(vocab, 2, 5, dtype=dtype) * 3)  # permuted to [2, 5, V]: last stride 10
    labels = _labels(10, vocab, [3]).reshape(2, 5)
    kw = {"softcap": 5.0, "label_smoothing": 0.05, "reduction": "none"}
    out, _ = _check(
        lambda x: cross_entropy(x.permute(1, 2, 0), labels, **kw),
        lambda x: cross_entropy_reference(x.permute(1, 2, 0), labels, **kw),
        [base],
        "none",
        dtype,
        ["logits"],
    )
    assert out.shape == (2, 5) and out.dtype == dtype and out[0, 3] == 0


def test_cross_entropy_reference_is_torch_cross_entropy():
    logits = torch.randn(29, 300, dtype=torch.float64)
    labels = _labels(29, 300, [0, 7, 8])
    for reduction in REDUCTIONS:
        for smoothing in (0.0, 0.3):
            ours = cross_entropy_reference(logits, labels, label_smoothing=smoothing, reduction=reduction)
            torchs = torch.nn.functional.cross_entropy(
                logits, labels, ignore_index=IGNORE, label_smoothing=smoothing, reduction=reduction
            )
            assert_close(ours, torchs, torch.float32, f"{reduction}, smoothing {smoothing}")


@pytest.mark.parametrize("bad", [300, 999, -5, -1])
@pytest.mark.parametrize("fn", [cross_entropy, cross_entropy_reference])
def test_cross_entropy_out_of_range_label_raises_like_torch(fn, bad):
    logits = torch.randn(29, 300)
    labels = _labels(29, 300, [0, 7, 8])
    labels[21] = bad
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE)  # the words users know
    for reduction in REDUCTIONS:
        with pytest.raises(IndexError, match=rf"Target {bad} is out of bounds.*\[0, 300\).*ignore_index \(-100\)"):
            fn(logits, labels, reduction=reduction)


def test_another_ignore_index_makes_minus_100_out_of_bounds():
    logits, labels = torch.randn(6, 40), torch.randint(0, 40, (6,))
    labels[[1, 4]] = -1
    assert torch.isfinite(cross_entropy(logits, labels, ignore_index=-1))
    labels[2] = -100
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        cross_entropy(logits, labels, ignore_index=-1)


# ------------------------------------------------------------------------------------ fused linear head


def _fused_inputs(n, hidden_size, vocab, dtype, bias=True):
    hidden = _leaf(torch.randn(n, hidden_size, dtype=dtype))
    weight = _leaf(torch.randn(vocab, hidden_size, dtype=dtype) * hidden_size**-0.5 * 3)
    b = _leaf(torch.randn(vocab, dtype=dtype)) if bias else None
    return hidden, weight, b


def _check_fused(tensors, labels, dtype, **kw):
    return _check(
        lambda h, w, b: fused_linear_cross_entropy(h, w, labels, bias=b, **kw),
        lambda h, w, b: fused_linear_cross_entropy_reference(h, w, labels, bias=b, **kw),
        tensors,
        kw.get("reduction", "mean"),
        dtype,
        ["hidden", "weight", "bias"],
    )


@pytest.mark.parametrize("option, reduction", OPTION_REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_float64(dtype, option, reduction):
    n = 45
    tensors = _fused_inputs(n, 40, 1000, dtype, bias=option in ("plain", "all"))
    kw = dict(OPTIONS[option], reduction=reduction)
    if option == "all":
        kw["logit_scale"] = 0.7
    out, _ = _check_fused(tensors, _labels(n, 1000, _many_ignored(n)), dtype, **kw)
    assert out.dtype == torch.float32


def test_fused_odd_vocab_leading_shape():
    hidden, weight, bias = _fused_inputs(6, 48, 3001, torch.float32)
    hidden = _leaf(hidden.detach().reshape(2, 3, 48))
    out, _ = _check_fused([hidden, weight, bias], _labels(6, 3001, [4]), torch.float32, reduction="none", softcap=30.0)
    assert out.shape == (2, 3)


def test_fused_frozen_weight_has_no_weight_grad():
    hidden, weight, _ = _fused_inputs(40, 32, 1000, torch.bfloat16, bias=False)
    weight.requires_grad_(False)
    labels = _labels(40, 1000, _many_ignored(40))
    _, grads = _check_fused([hidden, weight, None], labels, torch.bfloat16, z_loss=1e-4)
    assert grads[1] is None and weight.grad is None


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_num_items_in_batch_and_no_grad(reduction):
    hidden, weight, bias = _fused_inputs(37, 32, 1000, torch.float32)
    labels = _labels(37, 1000, _many_ignored(37))
    if reduction == "none":
        with pytest.raises(ValueError, match="num_items_in_batch"):
            fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=5, reduction=reduction)
        return
    _check_fused([hidden, weight, bias], labels, torch.float32, num_items_in_batch=torch.tensor(91))
    with torch.no_grad():  # eval: loss only, no gradient buffers
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=bias, num_items_in_batch=91)
    ref = fused_linear_cross_entropy_reference(
        hidden.double(), weight.double(), labels, bias=bias.double(), num_items_in_batch=91
    )
    assert_close(loss, ref, torch.float32)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("row, bad", [(0, 1000), (44, -7), (30, 5000)])
def test_fused_out_of_range_label_raises_in_any_chunk(row, bad, reduction):
    # 45 rows of V=1000 fp32: 6 chunks; the bad label in the first, the last or a middle one, among ignored rows
    hidden, weight, _ = _fused_inputs(45, 24, 1000, torch.float32, bias=False)
    labels = _labels(45, 1000, _many_ignored(45)[:-3])
    labels[row] = bad
    for fn in (fused_linear_cross_entropy, fused_linear_cross_entropy_reference):
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
            fn(hidden, weight, labels, reduction=reduction)
    assert hidden.grad is None and weight.grad is None


def test_fused_out_of_range_label_raises_under_torch_compile():
    # Through the registered operator (what torch.compile traces): its implementation checks, the trace stays whole.
    hidden, weight, _ = _fused_inputs(10, 16, 40, torch.float32, bias=False)
    loss_fn = torch.compile(lambda h, w, y: fused_linear_cross_entropy(h, w, y), fullgraph=True, backend="aot_eager")
    labels = torch.randint(0, 40, (10,))
    assert torch.isfinite(loss_fn(hidden, weight, labels))
    labels[3] = 40
    with pytest.raises(IndexError, match="Target 40 is out of bounds"):
        loss_fn(hidden, weight, labels)


@pytest.mark.parametrize("shape", [(0, 24), (3, 0, 24)])
def test_fused_no_rows_gives_zero_like_all_ignored(shape):
    # An empty batch reaching the op directly: a defined 0 and zero gradients, no launch on an empty grid
    hidden = _leaf(torch.randn(*shape))
    weight = _leaf(torch.randn(70, 24))
    labels = torch.randint(0, 70, shape[:-1])
    for reduction in REDUCTIONS:
        loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
        assert loss.shape == (() if reduction != "none" else shape[:-1]) and loss.sum() == 0
        loss.sum().backward()
        assert hidden.grad.shape == hidden.shape and torch.equal(weight.grad, torch.zeros_like(weight))
        hidden.grad = weight.grad = None


def test_gradient_accumulation_matches_one_big_batch():
    """Two half-batches divided by the whole batch's label count sum to the one-batch "mean" gradient."""
    n = 48
    hidden, weight, bias = _fused_inputs(n, 32, 1000, torch.float32)
    labels = _labels(n, 1000, list(range(0, 20)) + [30, 31, 40])
    total = int((labels != IGNORE).sum())

    fused_linear_cross_entropy(hidden, weight, labels, bias=bias).backward()
    one_batch = [t.grad.clone() for t in (weight, bias)]
    weight.grad = bias.grad = None
    for part in (slice(0, n // 2), slice(n // 2, n)):
        loss = fused_linear_cross_entropy(
            hidden[part], weight, labels[part], bias=bias, num_items_in_batch=torch.tensor(total)
        )
        loss.backward()
    for name, acc, ref in zip(("weight", "bias"), (weight.grad, bias.grad), one_batch):
        assert_close(acc, ref, torch.float32, f"accumulated grad {name}")


def test_fused_autocast_computes_in_autocast_dtype():
    hidden, weight, _ = _fused_inputs(37, 32, 1000, torch.float32, bias=False)
    labels = _labels(37, 1000, [1, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    assert weight.grad.dtype == torch.float32
    h, w = _leaf(hidden.detach().bfloat16().double()), _leaf(weight.detach().bfloat16().double())
    ref = fused_linear_cross_entropy_reference(h, w, labels)
    ref.backward()
    assert_close(loss, ref, torch.bfloat16, "loss")
    assert_close(weight.grad, w.grad, torch.bfloat16, "grad weight")
    assert_close(hidden.grad, h.grad, torch.bfloat16, "grad hidden")


@pytest.mark.torch_reference  # the path a bf16 Trainer takes on CPU; autocast made its logits (and loss) bf16
@pytest.mark.parametrize(
    "reduction, bias, dtype",
    [("mean", False, torch.bfloat16), ("none", True, torch.bfloat16), ("none", False, torch.float32)],
)
def test_fused_torch_reference_under_autocast_returns_fp32(reduction, bias, dtype):
    n, vocab = 37, 1000
    tensors = [t for t in _fused_inputs(n, 32, vocab, dtype, bias) if t is not None]
    labels = _labels(n, vocab, [1, 2])
    kw = dict(softcap=3.0, logit_scale=0.7, label_smoothing=0.1, reduction=reduction)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(*tensors[:2], labels, bias=tensors[2] if bias else None, **kw)
    # fp32 inputs are rounded to bf16 first, as the kernel (and nn.Linear) rounds them under autocast
    as64 = [_leaf(t.detach().bfloat16().double()) for t in tensors]
    z = as64[0] @ as64[1].t() + (as64[2] if bias else 0)
    z = 3.0 * torch.tanh(z * 0.7 / 3.0)
    expected = torch.nn.functional.cross_entropy(z, labels, ignore_index=IGNORE, label_smoothing=0.1,
                                                 reduction=reduction)  # fmt: skip
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert_close(loss, expected, torch.float32, "loss")  # fp32 logits, as the kernel's fp32 accumulation
    grad_output = _grad_output(expected, reduction)
    loss.backward(grad_output.float())
    expected.backward(grad_output)
    for name, t, ref in zip(("hidden", "weight", "bias"), tensors, as64):
        assert t.grad.dtype == dtype
        assert_close(t.grad, ref.grad, torch.bfloat16, f"grad {name}")


# --------------------------------------------------------------------------------- all labels ignored


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction):
    labels = torch.full((20,), IGNORE)
    logits = _leaf(torch.randn(20, 1000))
    loss = cross_entropy(logits, labels, reduction=reduction)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(logits.grad, torch.zeros_like(logits))

    hidden, weight, bias = _fused_inputs(20, 32, 1000, torch.float32)
    loss = fused_linear_cross_entropy(hidden, weight, labels, bias=bias, z_loss=1e-3, reduction=reduction)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    for t in (hidden, weight, bias):
        assert torch.equal(t.grad, torch.zeros_like(t))


# ------------------------------------------------------------------------------------------ bad input


def test_chunk_rows_fit_the_budget(monkeypatch):
    monkeypatch.setattr(ce_module, "LOGITS_CHUNK_BYTES", 128 * 1024 * 1024)
    assert ce_module.logits_chunk_rows(8192, 128256, torch.bfloat16) == 512
    assert ce_module.logits_chunk_rows(100, 128256, torch.bfloat16) == 100
    assert ce_module.logits_chunk_rows(8192, 32000, torch.float32) == 1024
    monkeypatch.setattr(ce_module, "LOGITS_CHUNK_BYTES", 192 * 1024 * 1024)
    assert ce_module.logits_chunk_rows(8192, 128256, torch.bfloat16) == 768


@pytest.mark.parametrize(
    "change, argument",
    [
        ({"hidden": torch.randn(6, 31)}, "hidden"),
        ({"weight": torch.randn(50, 32, 1)}, "weight"),
        ({"labels": torch.zeros(5, dtype=torch.int64)}, "labels"),
        ({"labels": torch.zeros(6)}, "labels"),
        ({"bias": torch.randn(49)}, "bias"),
        ({"hidden": torch.randn(6, 32, dtype=torch.float64)}, "hidden"),
        ({"hidden": torch.randn(6, 32, dtype=torch.bfloat16)}, "dtype"),
        ({"reduction": "avg"}, "reduction"),
        ({"softcap": 0.0}, "softcap"),
        ({"label_smoothing": 1.5}, "label_smoothing"),
        ({"z_loss": -1.0}, "z_loss"),
        ({"logit_scale": float("nan")}, "logit_scale"),
        ({"ignore_index": 1.5}, "ignore_index"),
        ({"num_items_in_batch": torch.ones(2)}, "num_items_in_batch"),
    ],
)
def test_fused_bad_input_names_the_argument(change, argument):
    kw = {"hidden": torch.randn(6, 32), "weight": torch.randn(50, 32), "labels": torch.arange(6)}
    kw.update(change)
    with pytest.raises(ValueError, match=argument):
        fused_linear_cross_entropy(kw.pop("hidden"), kw.pop("weight"), kw.pop("labels"), **kw)


@pytest.mark.parametrize(
    "logits, labels, kw, argument",
    [
        (torch.randn(4, 10), torch.zeros(3, dtype=torch.int64), {}, "labels"),
        (torch.randn(4, 10), torch.zeros(4), {}, "labels"),
        (torch.randn(4, 10).int(), torch.zeros(4, dtype=torch.int64), {}, "logits"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.int64), {"softcap": -2.0}, "softcap"),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.int64), {"reduction": None}, "reduction"),
    ],
)
def test_cross_entropy_bad_input_names_the_argument(logits, labels, kw, argument):
    with pytest.raises(ValueError, match=argument):
        cross_entropy(logits, labels, **kw)

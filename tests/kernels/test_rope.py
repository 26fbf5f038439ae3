"""RoPE (rotate-half): forward and backward against float64 references and transformers' apply_rotary_pos_emb."""

import dataclasses
import functools
import importlib

import pytest
import torch

import fastplug.kernels.tuning as kernel_tuning
from fastplug.kernels.rope import rope, rope_reference
from tests.helpers import assert_close

# fastplug.kernels re-exports the function `rope`, which shadows the submodule as a package attribute.
rope_module = importlib.import_module("fastplug.kernels.rope")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _qk(batch, heads_q, heads_k, tokens, head_dim, dtype, layout="hf"):
    """q, k leaves [B, H, T, D]; "hf" makes them proj(x).view(B, T, H, D).transpose(1, 2) like transformers."""

    def make(heads):
        if layout == "hf":
            return torch.randn(batch, tokens, heads, head_dim).to(dtype).transpose(1, 2).requires_grad_()
        return torch.randn(batch, heads, tokens, head_dim).to(dtype).requires_grad_()

    return make(heads_q), make(heads_k)


def _cos_sin(batch, tokens, rot_dim, dtype, form="batched"):
    """Random (not unit-circle) cos/sin tables so any mix-up of the two halves or of the signs shows."""
    shape = {"batched": (batch, tokens, rot_dim), "broadcast": (1, tokens, rot_dim), "2d": (tokens, rot_dim)}[form]
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def check_rope(q, k, cos, sin, dtype, check_layout=True):
    """rope forward and backward against the float64 reference; also used by tests/gpu at the benchmark shapes."""
    q_rot, k_rot = rope(q, k, cos, sin)
    grad_q, grad_k = torch.randn_like(q_rot), torch.randn_like(k_rot)
    torch.autograd.backward((q_rot, k_rot), (grad_q, grad_k))

    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    ref_q, ref_k = rope_reference(q64, k64, cos.double(), sin.double())
    torch.autograd.backward((ref_q, ref_k), (grad_q.double(), grad_k.double()))

    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    for out, x in (
        ((q_rot, q), (k_rot, k)) if check_layout else ()
    ):  # outputs keep the inputs' layout (strides of size-1 dims are free)
        assert [s for s, n in zip(out.stride(), x.shape) if n > 1] == [s for s, n in zip(x.stride(), x.shape) if n > 1]
    assert_close(q_rot, ref_q, dtype, "q_rot")
    assert_close(k_rot, ref_k, dtype, "k_rot")
    assert_close(q.grad, q64.grad, dtype, "dq")
    assert_close(k.grad, k64.grad, dtype, "dk")
    assert q.grad.dtype == q.dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,rot_dim", [(80, 80), (64, 64), (80, 48)], ids=["d80", "d64", "d80-partial48"])
def test_forward_backward(dtype, head_dim, rot_dim):
    q, k = _qk(2, 4, 2, 7, head_dim, dtype)
    cos, sin = _cos_sin(2, 7, rot_dim, dtype)
    check_rope(q, k, cos, sin, dtype)


@pytest.mark.parametrize("form", ["broadcast", "2d"])
@pytest.mark.parametrize("layout", ["hf", "contiguous"])
def test_cos_broadcast_and_layouts(form, layout):
    q, k = _qk(3, 4, 1, 5, 80, torch.float32, layout)
    cos, sin = _cos_sin(3, 5, 80, torch.float32, form)
    check_rope(q, k, cos, sin, torch.float32)


def _override_constants(request, **changes):
    constants = dataclasses.replace(rope_module.ROPE_CONSTANTS, **changes)
    request.addfinalizer(
        kernel_tuning.override("rope", functools.partial(rope_module.rope_config, constants=constants)).undo
    )


def test_many_heads_loop_over_head_blocks(request):
    # A small tile makes a program walk over several head blocks, the last one partly masked.
    _override_constants(request, tile_elements=256)
    q, k = _qk(2, 6, 3, 9, 128, torch.float32)
    cos, sin = _cos_sin(2, 9, 96, torch.float32)
    check_rope(q, k, cos, sin, torch.float32)


@pytest.mark.parametrize(
    "tuning",
    [
        dict(split_heads=True, tile_elements=256),  # q: 6 heads in blocks of 4 (last partly masked), k: 3 in 4
        dict(split_heads=True, max_block_heads=2, tile_elements=512, num_warps=8),  # several tokens a program
        dict(split_heads=False, max_block_heads=2, tile_elements=4096, num_warps=8),
    ],
    ids=["split", "split-2-heads", "loop-2-heads"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tuning_variants(request, tuning, dtype):
    # The launch shapes scripts/tune_kernels.py may pick: same numbers, partial rotary included.
    _override_constants(request, **tuning)
    q, k = _qk(2, 6, 3, 9, 128, dtype)
    cos, sin = _cos_sin(1, 9, 96, dtype)
    check_rope(q, k, cos, sin, dtype)


def test_non_contiguous_gradients():
    q, k = _qk(2, 4, 2, 7, 80, torch.bfloat16, layout="contiguous")
    cos, sin = _cos_sin(1, 7, 80, torch.bfloat16)
    q_rot, k_rot = rope(q, k, cos, sin)
    grad_q = torch.randn(2, 7, 4, 80).to(torch.bfloat16).transpose(1, 2)
    grad_k = torch.randn(80, 2, 2, 7).to(torch.bfloat16).permute(1, 2, 3, 0)  # non-unit last stride
    torch.autograd.backward((q_rot, k_rot), (grad_q, grad_k))
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    ref_q, ref_k = rope_reference(q64, k64, cos.double(), sin.double())
    torch.autograd.backward((ref_q, ref_k), (grad_q.double(), grad_k.double()))
    assert_close(q.grad, q64.grad, torch.bfloat16, "dq")
    assert_close(k.grad, k64.grad, torch.bfloat16, "dk")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_transformers_llama(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=320, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14, 15]])  # a different offset per row
    hidden = torch.randn(2, 7, 320).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(hidden, position_ids)
    q, k = _qk(2, 4, 2, 7, 80, dtype)
    ours = rope(q, k, cos, sin)
    theirs = apply_rotary_pos_emb(q, k, cos, sin)
    for out, ref, name in zip(ours, theirs, ("q", "k")):
        assert out.dtype == ref.dtype
        assert_close(out, ref, dtype, f"{name} vs apply_rotary_pos_emb")
    check_rope(q, k, cos, sin, dtype)


def test_output_dtype_promotes_like_transformers():
    # bf16 q with fp32 cos (autocast): q * cos is fp32 in transformers, and so is ours; grads come back bf16.
    q, k = _qk(1, 2, 1, 4, 64, torch.bfloat16)
    cos, sin = _cos_sin(1, 4, 64, torch.float32)
    q_rot, k_rot = rope(q, k, cos, sin)
    ref_q, ref_k = rope_reference(q, k, cos, sin)
    assert q_rot.dtype == ref_q.dtype == torch.float32
    assert_close(q_rot, ref_q, torch.float32, "q_rot")
    assert_close(k_rot, ref_k, torch.float32, "k_rot")
    (q_rot.sum() + k_rot.sum()).backward()
    assert q.grad.dtype == torch.bfloat16 and k.grad.dtype == torch.bfloat16


def test_trainable_cos_sin_take_the_torch_path():
    q, k = _qk(1, 2, 1, 4, 64, torch.float32)
    cos, sin = (t.requires_grad_() for t in _cos_sin(1, 4, 64, torch.float32))
    q_rot, k_rot = rope(q, k, cos, sin)
    (q_rot.sum() + k_rot.sum()).backward()
    assert cos.grad is not None and sin.grad is not None


def test_torch_path_without_triton(monkeypatch):
    monkeypatch.setattr(rope_module, "use_triton", lambda *tensors: False)
    q, k = _qk(2, 4, 2, 7, 80, torch.float32)
    cos, sin = _cos_sin(2, 7, 48, torch.float32)
    check_rope(q, k, cos, sin, torch.float32, check_layout=False)  # torch.cat gives contiguous outputs


def test_bad_input_raises_value_error_naming_the_argument():
    q, k = _qk(2, 4, 2, 7, 80, torch.float32)
    cos, sin = _cos_sin(2, 7, 80, torch.float32)
    bad = [
        ("k", (q, k[..., :64], cos, sin)),  # head dim mismatch
        ("k", (q, k[:, :, :5], cos, sin)),  # token mismatch
        ("k", (q, k.bfloat16(), cos, sin)),  # dtype mismatch
        ("q", (q[0], k, cos, sin)),  # not 4-D
        ("q", (q.to(torch.float64), k, cos, sin)),  # unsupported dtype
        ("cos", (q, k, cos[:, :5], sin[:, :5])),  # tokens mismatch
        ("cos", (q, k, torch.randn(3, 7, 80), torch.randn(3, 7, 80))),  # batch neither 1 nor B
        ("cos", (q, k, cos[..., :47], sin[..., :47])),  # odd rotary dim
        ("cos", (q, k, torch.randn(2, 7, 96), torch.randn(2, 7, 96))),  # rotary dim > head dim
        ("sin", (q, k, cos, sin[..., :64])),  # sin shape differs
        ("sin", (q, k, cos, sin.half())),  # sin dtype differs
    ]
    for name, args in bad:
        with pytest.raises(ValueError, match=name):
            rope(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_rotates_fresh_projections_in_their_buffers(dtype, device="cpu"):
    """As attention calls it: q and k are fresh projection outputs viewed [B, H, T, D]. The rotated values
    land in their buffers, so do the gradients in backward, and both equal the float64 reference."""
    torch.manual_seed(0)
    B, T, Hq, Hk, D = 2, 7, 4, 2, 32
    q_src = torch.randn(B, T, Hq, D, device=device).to(dtype).requires_grad_()
    k_src = torch.randn(B, T, Hk, D, device=device).to(dtype).requires_grad_()
    cos, sin = (t.to(device) for t in _cos_sin(B, T, D, dtype, "broadcast"))
    q, k = q_src.clone().transpose(1, 2), k_src.clone().transpose(1, 2)  # clone: its backward passes grads on
    buffers = (q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr())
    q_rot, k_rot = rope(q, k, cos, sin, inplace=True)
    assert (q_rot.untyped_storage().data_ptr(), k_rot.untyped_storage().data_ptr()) == buffers
    rotated = (q_rot.detach().clone(), k_rot.detach().clone())
    grad_q, grad_k = torch.randn_like(q_rot), torch.randn_like(k_rot)
    torch.autograd.backward((q_rot, k_rot), (grad_q, grad_k))

    q64, k64 = q_src.detach().double().requires_grad_(), k_src.detach().double().requires_grad_()
    ref_q, ref_k = rope_reference(q64.transpose(1, 2), k64.transpose(1, 2), cos.double(), sin.double())
    torch.autograd.backward((ref_q, ref_k), (grad_q.double(), grad_k.double()))
    assert_close(rotated[0], ref_q, dtype, "q_rot")
    assert_close(rotated[1], ref_k, dtype, "k_rot")
    assert_close(q_src.grad, q64.grad, dtype, "dq")
    assert_close(k_src.grad, k64.grad, dtype, "dk")
    assert (q_src.grad.untyped_storage().data_ptr(), k_src.grad.untyped_storage().data_ptr()) == buffers


def test_inplace_under_checkpointing_matches_new_buffers():
    """A checkpointed attention block (non-reentrant, as transformers runs layers): the recompute rotates its
    own projections in place again, and the gradients equal those of rope without inplace."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    B, T, H, D = 2, 6, 2, 16
    x = torch.randn(B, T, 32, requires_grad=True)
    wq, wk, wv = (torch.randn(32, H * D, requires_grad=True) for _ in range(3))
    cos, sin = _cos_sin(B, T, D, torch.float32, "broadcast")

    def block(x, inplace):
        q, k, v = ((x @ w).view(B, T, H, D).transpose(1, 2) for w in (wq, wk, wv))
        q, k = rope(q, k, cos, sin, inplace=inplace)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    grad = torch.randn(B, H, T, D)
    params = [x, wq, wk, wv]
    plain = torch.autograd.grad(block(x, False), params, grad)
    for run in (lambda: block(x, True), lambda: checkpoint(block, x, True, use_reentrant=False)):
        for got, ref in zip(torch.autograd.grad(run(), params, grad), plain):
            assert_close(got, ref.double(), torch.float32, "grad")


def test_inplace_makes_a_kept_graph_fail_loudly():
    """A graph kept for a second backward still holds q_rot, which the first backward overwrote with dq:
    the second backward raises instead of reading it."""
    x = torch.randn(1, 5, 2, 16, requires_grad=True)
    w = torch.randn(1, 2, 5, 16, requires_grad=True)
    cos, sin = _cos_sin(1, 5, 16, torch.float32)
    q_rot, k_rot = rope((x * 2).transpose(1, 2), (x * 3).transpose(1, 2), cos, sin, inplace=True)
    loss = (q_rot * w).sum() + k_rot.sum()  # the product saves q_rot for w's gradient
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified inplace|modified by an inplace operation"):
        loss.backward()


def test_inplace_is_ignored_for_leaves_and_makes_other_savers_fail_loudly():
    torch.manual_seed(0)
    q, k = _qk(1, 2, 2, 5, 16, torch.float32)  # views of leaves: never overwritten
    before = q.detach().clone()
    cos, sin = _cos_sin(1, 5, 16, torch.float32)
    q_rot, _ = rope(q, k, cos, sin, inplace=True)
    assert torch.equal(q.detach(), before) and q_rot.data_ptr() != q.data_ptr()

    x = torch.randn(1, 5, 2, 16, requires_grad=True)
    q_fresh = (x * 2).transpose(1, 2)
    saver = q_fresh * x.transpose(1, 2)  # saves q_fresh, which the in-place RoPE then overwrites
    q_rot, k_rot = rope(q_fresh, (x * 3).transpose(1, 2), cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (q_rot.sum() + k_rot.sum() + saver.sum()).backward()

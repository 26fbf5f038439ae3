"""Fused LoRA linear / QKV / MLP against peft's own modules (run in float64 as the reference).

Real peft layers from get_peft_model on a tiny attention+MLP block; init_lora_weights=False so B is not zero.
The MLP's activation runs the Triton kernels under the interpreter: shapes stay tiny.
"""

import copy

import peft
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from fastplug.kernels.lora import LoRAProjection, StackedBase, lora_linear, lora_mlp, lora_qkv
from fastplug.models import stacking
from fastplug.models.peft_lora import lora_projection, unfused_reason
from tests.helpers import assert_close, rel_err

HIDDEN, INTERMEDIATE, Q_OUT, KV_OUT, RANK = 48, 40, 48, 16, 4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TORCH_ACT = {
    "silu": F.silu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "gelu": F.gelu,
}


class TinyBlock(nn.Module):
    """q/k/v/o with GQA-narrow k/v (optional Qwen2-style q/k/v bias) and a gated MLP."""

    def __init__(self, qkv_bias=False, hidden=HIDDEN, intermediate=INTERMEDIATE, q_out=Q_OUT, kv_out=KV_OUT):
        super().__init__()
        self.q_proj = nn.Linear(hidden, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_out, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_out, bias=qkv_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


def peft_block(dtype=torch.float32, qkv_bias=False, targets=ATTENTION + MLP, device="cpu", sizes=None, **lora):
    """(peft model in dtype, a float64 copy holding the same (rounded) values); sizes: TinyBlock's kwargs."""
    config = dict(r=RANK, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
    config.update(lora)
    model = peft.get_peft_model(TinyBlock(qkv_bias, **(sizes or {})), peft.LoraConfig(**config))
    model.to(device=device, dtype=dtype)
    return model, copy.deepcopy(model).double()


def layers(model):
    return model.base_model.model if isinstance(model, peft.PeftModel) else model


def fwd_bwd(model, fn, x, grads_out):
    """Outputs, dX and the grads of model's trainable params after backward of fn(x) with grads_out."""
    model.zero_grad(set_to_none=True)
    x = x.detach().to(next(model.parameters()).dtype).requires_grad_()
    outs = fn(x)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads_out, outs)])
    params = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return outs, x.grad, params


def assert_matches_peft(model, ref, fused_fn, peft_fn, x, out_features, dtype):
    grads_out = [torch.randn(*x.shape[:-1], n, dtype=torch.float64, device=x.device) for n in out_features]
    outs, dx, grads = fwd_bwd(model, lambda t: fused_fn(layers(model), t), x, grads_out)
    ref_outs, ref_dx, ref_grads = fwd_bwd(ref, lambda t: peft_fn(layers(ref), t), x, grads_out)
    for i, (out, ref_out) in enumerate(zip(outs, ref_outs)):
        assert out.dtype == dtype
        assert_close(out, ref_out, dtype, f"output {i}")
    assert_close(dx, ref_dx, dtype, "dX")
    assert ref_grads, "nothing trainable"
    for name, ref_grad in ref_grads.items():
        if ref_grad is None:  # a param the computation does not use
            assert grads[name] is None, name
            continue
        assert grads[name] is not None, f"{name}: no gradient"
        assert_close(grads[name], ref_grad, dtype, name)


def fused_qkv(m, x):
    return lora_qkv(x, lora_projection(m.q_proj), lora_projection(m.k_proj), lora_projection(m.v_proj))


def peft_qkv(m, x):
    return m.q_proj(x), m.k_proj(x), m.v_proj(x)


def fused_mlp(activation):
    return lambda m, x: lora_mlp(
        x, lora_projection(m.gate_proj), lora_projection(m.up_proj), lora_projection(m.down_proj), activation
    )


def peft_mlp(activation):
    return lambda m, x: m.down_proj(TORCH_ACT[activation](m.gate_proj(x)) * m.up_proj(x))


DTYPES = [torch.float32, torch.bfloat16]


# ------------------------------------------------------------------------------- QKV, O and MLP vs peft


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_qkv_matches_peft(dtype, qkv_bias, use_rslora):
    # different ranks per module (k: 2, v: 6) exercise the concatenated x A^T slices
    model, ref = peft_block(dtype, qkv_bias, use_rslora=use_rslora, rank_pattern={"k_proj": 2, "v_proj": 6})
    x = torch.randn(3, 7, HIDDEN)
    assert_matches_peft(model, ref, fused_qkv, peft_qkv, x, [Q_OUT, KV_OUT, KV_OUT], dtype)


def _rotary_tables(batch, tokens, head_dim, dtype):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = (
        torch.arange(tokens, dtype=torch.float64)[:, None] + torch.rand(batch, 1, 1, dtype=torch.float64) * 50
    ) * inv_freq  # per-row offsets: the batch dim of cos/sin is read, not broadcast
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(y, cos, sin, head_dim):
    """transformers' apply_rotary_pos_emb on [B, T, heads * head_dim] rows."""
    q = y.view(*y.shape[:-1], -1, head_dim).transpose(1, 2)
    c, s = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
    half = head_dim // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return (q * c + rotated * s).transpose(1, 2).reshape(y.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", ["same", "float32"])
def test_qkv_with_rotary_matches_peft_then_rope(dtype, table_dtype):
    """RoPE inside the QKV node (q and k rotated in their own buffers, gradients rotated back) equals peft's
    projections followed by transformers' RoPE; fp32 tables under a bf16 model take the separate rope op
    (RoPE then promotes q and k to fp32, as transformers does)."""
    head_dim = 8
    model, ref = peft_block(dtype, rank_pattern={"k_proj": 2})
    x = torch.randn(2, 9, HIDDEN)
    cos, sin = _rotary_tables(2, 9, head_dim, dtype if table_dtype == "same" else torch.float32)

    def fused(m, t):
        return lora_qkv(
            t,
            lora_projection(m.q_proj),
            lora_projection(m.k_proj),
            lora_projection(m.v_proj),
            rotary=(cos, sin, head_dim),
        )

    def reference(m, t):
        q, k, v = peft_qkv(m, t)
        return _rotate(q, cos.double(), sin.double(), head_dim), _rotate(k, cos.double(), sin.double(), head_dim), v

    grads_out = [torch.randn(2, 9, n, dtype=torch.float64) for n in (Q_OUT, KV_OUT, KV_OUT)]
    outs, dx, grads = fwd_bwd(model, lambda t: fused(layers(model), t), x, grads_out)
    ref_outs, ref_dx, ref_grads = fwd_bwd(ref, lambda t: reference(layers(ref), t), x, grads_out)
    promoted = torch.promote_types(dtype, cos.dtype)
    assert [o.dtype for o in outs] == [promoted, promoted, dtype]
    for i, (out, ref_out) in enumerate(zip(outs, ref_outs)):
        assert_close(out, ref_out, dtype, f"output {i}")
    assert_close(dx, ref_dx, dtype, "dX")
    checked = [name for name, g in ref_grads.items() if g is not None]  # o_proj and the MLP are not used
    assert any("lora_A" in n for n in checked) and any("lora_B" in n for n in checked)
    for name in checked:
        assert_close(grads[name], ref_grads[name], dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_o_proj_matches_peft(dtype):
    model, ref = peft_block(dtype, alpha_pattern={"o_proj": 3})
    x = torch.randn(2, 11, Q_OUT)
    fused = lambda m, t: lora_linear(t, lora_projection(m.o_proj))  # noqa: E731
    assert_matches_peft(model, ref, fused, lambda m, t: m.o_proj(t), x, [HIDDEN], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_mlp_matches_peft(dtype, activation):
    model, ref = peft_block(dtype, rank_pattern={"down_proj": 8}, use_rslora=activation == "gelu")
    x = torch.randn(37, HIDDEN)
    assert_matches_peft(model, ref, fused_mlp(activation), peft_mlp(activation), x, [HIDDEN], dtype)


def test_some_projections_without_adapter():
    # LoRA on q and v only (a common config) and on up only: k, gate and down are frozen plain linears.
    model, ref = peft_block(targets=["q_proj", "v_proj", "up_proj"])
    assert lora_projection(layers(model).k_proj).lora_A is None
    x = torch.randn(19, HIDDEN)
    assert_matches_peft(model, ref, fused_qkv, peft_qkv, x, [Q_OUT, KV_OUT, KV_OUT], torch.float32)
    assert_matches_peft(model, ref, fused_mlp("silu"), peft_mlp("silu"), x, [HIDDEN], torch.float32)


# ------------------------------------------------------------------- stacked bases (one GEMM per group)


def stacked_qkv(m, x, rotary=None):
    projs = [lora_projection(getattr(m, n)) for n in ("q_proj", "k_proj", "v_proj")]
    return lora_qkv(x, *projs, rotary=rotary, stacked=stacking.stacked_base(m, projs))


def stacked_mlp(activation):
    def fn(m, x):
        projs = [lora_projection(getattr(m, n)) for n in MLP]
        return lora_mlp(x, *projs, activation=activation, stacked=stacking.stacked_base(m, projs[:2]))

    return fn


def enable_stacking(model):
    """On CPU: the group is stacked at its first call."""
    block = layers(model)
    stacking.switch(block, model, ("q_proj", "k_proj", "v_proj") if hasattr(block, "q_proj") else MLP[:2])()


def assert_stacked(m, names):
    storages = {getattr(m, n).base_layer.weight.untyped_storage().data_ptr() for n in names}
    assert len(storages) == 1, "the group's weights do not share one buffer"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_stacked_qkv_matches_peft(dtype, qkv_bias):
    """q/k/v bases as one matrix (and the adapters' B block-diagonal): different ranks and scalings per
    projection, biases stacked too."""
    model, ref = peft_block(dtype, qkv_bias, rank_pattern={"k_proj": 2, "v_proj": 6}, alpha_pattern={"v_proj": 3})
    enable_stacking(model)
    x = torch.randn(3, 7, HIDDEN)
    assert_matches_peft(model, ref, stacked_qkv, peft_qkv, x, [Q_OUT, KV_OUT, KV_OUT], dtype)
    assert_stacked(layers(model), ("q_proj", "k_proj", "v_proj"))


def test_stacked_adapters_are_not_served_to_parameters_that_reuse_dead_ids():
    """The stacked adapter matrices are cached by the adapters' ids until the next generation; outside a
    patched model no generation passes between calls, so a new block whose adapters reuse the ids of a dead
    one's (CPython reuses freed addresses) must not get the dead block's matrices (a failure seen in CI)."""
    from fastplug.kernels.lora import casts

    casts._STACKED_ADAPTERS.clear()
    old, _ = peft_block(torch.bfloat16, True, rank_pattern={"k_proj": 2, "v_proj": 6})
    enable_stacking(old)
    x = torch.randn(3, 7, HIDDEN)
    stacked_qkv(layers(old), x.bfloat16())
    ((old_key, old_entry),) = casts._STACKED_ADAPTERS.items()
    model, ref = peft_block(torch.bfloat16, True, rank_pattern={"k_proj": 2, "v_proj": 6})
    enable_stacking(model)
    m = layers(model)
    new_ids = tuple(
        id(getattr(getattr(m, n), f"lora_{ab}")["default"].weight)
        for n in ("q_proj", "k_proj", "v_proj")
        for ab in "AB"
    )
    casts._STACKED_ADAPTERS.clear()  # the dead block's entry under the new block's ids, same versions
    casts._STACKED_ADAPTERS[(*new_ids, old_key[-1])] = old_entry
    del old
    assert_matches_peft(model, ref, stacked_qkv, peft_qkv, x, [Q_OUT, KV_OUT, KV_OUT], torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_stacked_mlp_matches_peft(dtype, activation):
    model, ref = peft_block(dtype, rank_pattern={"down_proj": 8, "up_proj": 2})
    enable_stacking(model)
    x = torch.randn(37, HIDDEN)
    assert_matches_peft(model, ref, stacked_mlp(activation), peft_mlp(activation), x, [HIDDEN], dtype)
    assert_stacked(layers(model), ("gate_proj", "up_proj"))


def test_stacked_with_projections_without_adapter():
    # LoRA on q and v only: k's block of B is zero; on up only: gate's is.
    model, ref = peft_block(targets=["q_proj", "v_proj", "up_proj", "down_proj"])
    enable_stacking(model)
    x = torch.randn(19, HIDDEN)
    assert_matches_peft(model, ref, stacked_qkv, peft_qkv, x, [Q_OUT, KV_OUT, KV_OUT], torch.float32)
    assert_matches_peft(model, ref, stacked_mlp("silu"), peft_mlp("silu"), x, [HIDDEN], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_qkv_with_rotary_matches_peft_then_rope(dtype):
    """RoPE in place on q and k, which are column blocks of one output buffer; gradients rotated back into
    the blocks of one gradient buffer."""
    head_dim = 8
    model, ref = peft_block(dtype, rank_pattern={"k_proj": 2})
    enable_stacking(model)
    x = torch.randn(2, 9, HIDDEN)
    cos, sin = _rotary_tables(2, 9, head_dim, dtype)

    def reference(m, t):
        q, k, v = peft_qkv(m, t)
        return _rotate(q, cos.double(), sin.double(), head_dim), _rotate(k, cos.double(), sin.double(), head_dim), v

    fused = lambda m, t: stacked_qkv(m, t, rotary=(cos, sin, head_dim))  # noqa: E731
    assert_matches_peft(model, ref, fused, reference, x, [Q_OUT, KV_OUT, KV_OUT], dtype)


def test_stacked_bf16_base_with_fp32_adapters_follows_optimizer_steps():
    """The cached block-diagonal B and cat(A) are rebuilt after each fused AdamW step (which writes the
    adapters without bumping their versions): two steps give what unstacked fused LoRA gives."""
    runs = []
    for stack in (False, True):
        torch.manual_seed(0)
        model = peft.get_peft_model(
            TinyBlock().to(torch.bfloat16),
            peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, target_modules=ATTENTION + MLP),
        )
        if stack:
            enable_stacking(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)  # the Trainer's default
        x = torch.randn(2, 5, HIDDEN, dtype=torch.bfloat16)
        losses = []
        for _ in range(3):
            m = layers(model)
            q, k, v = (stacked_qkv if stack else fused_qkv)(m, x)
            y = (stacked_mlp if stack else fused_mlp)("silu")(m, x)
            loss = q.float().square().mean() + k.float().mean() + v.float().square().mean() + y.float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs.append(losses)
    assert len(set(runs[0])) == 3  # the adapters moved
    # the same products in the same order per element (scaling 2 folds into B exactly): equal bit for bit
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


def test_stacked_bad_input_raises():
    model, _ = peft_block()
    m = layers(model)
    projs = [lora_projection(getattr(m, n)) for n in ("q_proj", "k_proj", "v_proj")]
    x = torch.randn(4, HIDDEN)
    copy_not_view = StackedBase(torch.cat([p.weight for p in projs]), None)
    with pytest.raises(ValueError, match="row blocks"):
        lora_qkv(x, *projs, stacked=copy_not_view)
    with pytest.raises(ValueError, match="stacked must be a StackedBase"):
        lora_qkv(x, *projs, stacked=copy_not_view.weight)


def test_stacking_skips_trainable_bases_and_stops_when_a_weight_is_re_pointed():
    model, ref = peft_block()
    m = layers(model)
    m.q_proj.base_layer.weight.requires_grad_(True)  # full fine-tuning of q: keeps its own storage
    enable_stacking(model)
    projs = [lora_projection(getattr(m, n)) for n in ("q_proj", "k_proj", "v_proj")]
    assert stacking.stacked_base(m, projs) is None
    model, ref = peft_block()
    m = layers(model)
    enable_stacking(model)
    projs = [lora_projection(getattr(m, n)) for n in ("q_proj", "k_proj", "v_proj")]
    assert stacking.stacked_base(m, projs) is not None
    m.k_proj.base_layer.weight.data = m.k_proj.base_layer.weight.data.clone() * 2  # e.g. model.to(...)
    ref.base_model.model.k_proj.base_layer.weight.data *= 2
    projs = [lora_projection(getattr(m, n)) for n in ("q_proj", "k_proj", "v_proj")]
    assert stacking.stacked_base(m, projs) is None
    assert_matches_peft(
        model, ref, stacked_qkv, peft_qkv, torch.randn(5, HIDDEN), [Q_OUT, KV_OUT, KV_OUT], torch.float32
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_fine_tuning_without_lora(dtype):
    # Plain trainable linears (with biases): the base weights and biases get their gradients.
    model = TinyBlock(qkv_bias=True).to(dtype)
    ref = copy.deepcopy(model).double()
    x = torch.randn(2, 5, HIDDEN)
    assert_matches_peft(model, ref, fused_qkv, peft_qkv, x, [Q_OUT, KV_OUT, KV_OUT], dtype)
    assert_matches_peft(model, ref, fused_mlp("gelu_tanh"), peft_mlp("gelu_tanh"), x, [HIDDEN], dtype)


def test_lora_on_trainable_base():
    # Base weights unfrozen next to the adapters (modules_to_save-like setups): every grad is checked.
    model, ref = peft_block(qkv_bias=True)
    for m in (model, ref):
        for name, p in m.named_parameters():
            p.requires_grad_(True)
    x = torch.randn(13, HIDDEN)
    assert_matches_peft(model, ref, fused_qkv, peft_qkv, x, [Q_OUT, KV_OUT, KV_OUT], torch.float32)
    assert_matches_peft(model, ref, fused_mlp("silu"), peft_mlp("silu"), x, [HIDDEN], torch.float32)


def test_frozen_base_gets_no_grad_and_x_without_grad():
    model, _ = peft_block()
    m = layers(model)
    x = torch.randn(9, HIDDEN)  # no requires_grad: dX is skipped, the adapters still train
    y = lora_mlp(x, lora_projection(m.gate_proj), lora_projection(m.up_proj), lora_projection(m.down_proj))
    y.square().sum().backward()
    assert m.gate_proj.base_layer.weight.grad is None
    assert m.gate_proj.lora_A["default"].weight.grad is not None
    assert m.down_proj.lora_B["default"].weight.grad is not None


def test_mlp_under_checkpointing_and_a_second_backward():
    model, _ = peft_block()
    m = layers(model)
    x = torch.randn(2, 9, HIDDEN, requires_grad=True)
    mlp = fused_mlp("silu")
    plain = torch.autograd.grad(mlp(m, x).sum(), x)[0]
    y = torch.utils.checkpoint.checkpoint(mlp, m, x, use_reentrant=False)
    assert_close(torch.autograd.grad(y.sum(), x)[0], plain, torch.float32, "dX under checkpointing")
    # backward overwrites the saved gate/up with their grads: a second backward must fail loudly
    y = mlp(m, x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_bf16_base_with_fp32_adapters():
    # peft's default (autocast_adapter_dtype) keeps adapters in fp32 next to a bf16 base: grads come back fp32.
    model = peft.get_peft_model(
        TinyBlock().to(torch.bfloat16),
        peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, target_modules=ATTENTION + MLP),
    )
    assert layers(model).q_proj.lora_A["default"].weight.dtype == torch.float32
    ref = copy.deepcopy(model).double()
    x = torch.randn(17, HIDDEN)
    grads_out = [torch.randn(17, n, dtype=torch.float64) for n in (Q_OUT, KV_OUT, KV_OUT)]
    outs, _, grads = fwd_bwd(model, lambda t: fused_qkv(layers(model), t.bfloat16()), x, grads_out)
    ref_outs, _, ref_grads = fwd_bwd(ref, lambda t: peft_qkv(layers(ref), t), x, grads_out)
    for out, ref_out in zip(outs, ref_outs):
        assert out.dtype == torch.bfloat16
        assert_close(out, ref_out, torch.bfloat16)
    for name, ref_grad in ref_grads.items():
        if "q_proj" in name or "k_proj" in name or "v_proj" in name:
            assert grads[name].dtype == torch.float32
            assert_close(grads[name], ref_grad, torch.bfloat16, name)


def test_autocast_runs_in_autocast_dtype():
    model, ref = peft_block()
    m = layers(model)
    x = torch.randn(6, Q_OUT, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_linear(x, lora_projection(m.o_proj))
    assert y.dtype == torch.bfloat16
    assert_close(y, layers(ref).o_proj(x.detach().double()), torch.bfloat16)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.o_proj.lora_A["default"].weight.grad.dtype == torch.float32


# ------------------------------------------------------------------ call-time state of the peft layers


def test_disable_adapter_gives_base_output():
    model, _ = peft_block(qkv_bias=True)
    m = layers(model)
    x = torch.randn(5, HIDDEN)
    with model.disable_adapter():
        proj = lora_projection(m.q_proj)
        assert proj.lora_A is None and unfused_reason(m.q_proj) is None
        assert_close(lora_linear(x, proj), m.q_proj.base_layer(x), torch.float32)
        assert_close(lora_linear(x, proj), m.q_proj(x), torch.float32)
    assert lora_projection(m.q_proj).lora_A is not None
    assert_close(lora_linear(x, lora_projection(m.q_proj)), m.q_proj(x), torch.float32)


def test_merged_adapter_gives_base_layer():
    model, _ = peft_block()
    m = layers(model)
    x = torch.randn(5, HIDDEN)
    unmerged = m.up_proj(x).detach()
    model.merge_adapter()
    proj = lora_projection(m.up_proj)
    assert proj.lora_A is None  # the merged weight already holds the adapter
    assert_close(lora_linear(x, proj), unmerged, torch.float32)
    with model.disable_adapter():  # peft unmerges on the call: leave it to peft
        assert lora_projection(m.up_proj) is None
        assert unfused_reason(m.up_proj) == "merged adapter inside disable_adapter()"
    model.unmerge_adapter()
    assert lora_projection(m.up_proj).lora_A is not None


def test_set_adapter_picks_the_active_one():
    model, ref = peft_block()
    model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=5, init_lora_weights=False, target_modules=MLP))
    m = layers(model)
    model.set_adapter("other")
    proj = lora_projection(m.gate_proj)
    assert proj.lora_A is m.gate_proj.lora_A["other"].weight and proj.scaling == 2.5
    assert lora_projection(m.q_proj).lora_A is None  # "other" has no q_proj adapter: base layer alone
    x = torch.randn(7, HIDDEN)
    assert_close(fused_mlp("silu")(m, x), peft_mlp("silu")(m, x), torch.float32)
    m.gate_proj.set_adapter(["default", "other"])  # peft sums both: stays unfused
    assert lora_projection(m.gate_proj) is None
    assert unfused_reason(m.gate_proj) == "several active adapters"


@pytest.mark.parametrize(
    "lora, reason",
    [(dict(use_dora=True), "DoRA"), (dict(lora_dropout=0.1), "lora_dropout > 0"), (dict(lora_bias=True), "lora_bias")],
)
def test_unfusable_layers_fall_back(lora, reason):
    model, _ = peft_block(qkv_bias=True, targets=["q_proj"], **lora)
    m = layers(model)
    assert lora_projection(m.q_proj) is None
    assert unfused_reason(m.q_proj) == reason
    if "lora_dropout" in lora:  # in eval mode the dropout drops nothing: fused again
        model.eval()
        assert unfused_reason(m.q_proj) is None
        x = torch.randn(4, HIDDEN)
        assert_close(lora_linear(x, lora_projection(m.q_proj)), m.q_proj(x), torch.float32)


def test_other_unfusable_layers():
    model, _ = peft_block()
    m = layers(model)
    m.k_proj.fan_in_fan_out = True
    assert unfused_reason(m.k_proj) == "fan_in_fan_out"
    handle = m.v_proj.base_layer.register_forward_hook(lambda *args: None)
    assert unfused_reason(m.v_proj) == "base layer has forward hooks"
    handle.remove()
    assert unfused_reason(m.v_proj) is None
    assert lora_projection(nn.LayerNorm(4)) is None
    assert "not nn.Linear" in unfused_reason(nn.LayerNorm(4))
    plain = nn.Linear(3, 2)
    assert lora_projection(plain) == LoRAProjection(plain.weight, plain.bias, None, None, 0.0)


# ---------------------------------------------------------------------------------------- bad input


def test_bad_input_raises_naming_the_argument():
    w, a, b = torch.randn(8, 6), torch.randn(2, 6), torch.randn(8, 2)
    x = torch.randn(3, 6)
    good = LoRAProjection(w, None, a, b, 1.0)
    with pytest.raises(ValueError, match="proj.weight"):
        lora_linear(torch.randn(3, 5), good)
    with pytest.raises(ValueError, match="proj.lora_B"):
        lora_linear(x, LoRAProjection(w, None, a, torch.randn(8, 3), 1.0))
    with pytest.raises(ValueError, match="proj.lora_A and proj.lora_B"):
        lora_linear(x, LoRAProjection(w, None, a, None, 1.0))
    with pytest.raises(ValueError, match="proj.bias"):
        lora_linear(x, LoRAProjection(w, torch.randn(7), a, b, 1.0))
    with pytest.raises(ValueError, match="k_proj.lora_A"):
        lora_qkv(x, good, LoRAProjection(w, None, torch.randn(2, 5), b, 1.0), good)
    with pytest.raises(ValueError, match="x must have dtype"):
        lora_linear(x.long(), good)
    up_wrong = LoRAProjection(torch.randn(9, 6), None, None, None, 0.0)
    with pytest.raises(ValueError, match="up_proj.weight"):
        lora_mlp(x, good, up_wrong, LoRAProjection(torch.randn(6, 8), None, None, None, 0.0))
    with pytest.raises(ValueError, match="down_proj.weight"):
        lora_mlp(x, good, good, good)
    with pytest.raises(ValueError, match="activation"):
        lora_mlp(x, good, good, LoRAProjection(torch.randn(6, 8), None, None, None, 0.0), "relu")


def test_cast_adapters_follow_in_place_updates():
    # The fp32 -> bf16 copies are cached per parameter version: an optimizer step must invalidate them.
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    weight = torch.randn(12, 16, dtype=torch.bfloat16)
    a = torch.nn.Parameter(torch.randn(4, 16))
    b = torch.nn.Parameter(torch.randn(12, 4))
    proj = LoRAProjection(weight, None, a, b, 0.5)
    first = lora_linear(x, proj)
    with torch.no_grad():
        b.mul_(-3.0)  # what an optimizer does: in place
    second = lora_linear(x, proj)
    expected = x.float() @ weight.float().t() + 0.5 * (x.float() @ a.t()) @ b.t()
    assert_close(second, expected, torch.bfloat16, "after an in-place update")
    assert rel_err(first, second) > 1e-2


def test_one_optimizer_step_refreshes_every_cast_adapter_together():
    # The first stale adapter met after a step recasts all stale ones in one go; each copy must still be its
    # own parameter's values (shapes differ, so a mix-up in the shared buffer would show).
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    weights = [torch.randn(n, 16, dtype=torch.bfloat16) for n in (12, 7)]
    adapters = [
        (torch.nn.Parameter(torch.randn(r, 16)), torch.nn.Parameter(torch.randn(w.shape[0], r)))
        for r, w in zip((4, 3), weights)
    ]
    projs = [LoRAProjection(w, None, a, b, 0.5) for w, (a, b) in zip(weights, adapters)]
    for proj in projs:
        lora_linear(x, proj)
    with torch.no_grad():
        for a, b in adapters:
            a.add_(torch.randn_like(a))
            b.mul_(-2.0)
    for proj in projs:
        expected = x.float() @ proj.weight.float().t() + 0.5 * (x.float() @ proj.lora_A.t()) @ proj.lora_B.t()
        assert_close(lora_linear(x, proj), expected, torch.bfloat16, "after a step on every adapter")


def test_base_weight_written_between_forward_and_backward_raises():
    # Parameters are kept on ctx rather than saved tensors; the version check save_for_backward would have
    # made must still catch an in-place write before backward.
    x = torch.randn(5, 16, requires_grad=True)
    weight = torch.randn(12, 16)
    proj = LoRAProjection(weight, None, torch.randn(4, 16, requires_grad=True), torch.randn(12, 4), 0.5)
    y = lora_linear(x, proj)
    weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

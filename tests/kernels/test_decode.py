"""Decode kernels (fastplug.kernels.decode) against their torch references and plain torch maths, under the
Triton interpreter on CPU: fresh random inputs, odd shapes, both GEMV paths, bad input."""

import pytest
import torch
import torch.nn.functional as F

from fastplug.kernels.decode import (
    add_rms_norm,
    decode_attention,
    decode_attention_reference,
    gemv,
    gemv_reference,
    greedy_emit,
)
from fastplug.kernels.norms import rms_norm_reference

# bf16: the kernels round several times (norm, projection, LoRA, residual) as the unfused modules do, and the
# interpreter's fp32 -> bf16 casts truncate instead of rounding to nearest: each rounding can add ~0.4% (biased)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def rel(out, ref):
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m, ns, k, dot", [(1, (24,), 40, False), (2, (13, 5, 7), 33, False), (3, (20, 6), 48, True), (5, (17,), 70, True)]
)
def test_gemv_segments_norm_bias_lora_residual(dtype, m, ns, k, dot):
    x = rand(m, k, dtype=dtype)
    weights = [rand(n, k, dtype=dtype, scale=k**-0.5) for n in ns]
    norm = (rand(k, dtype=dtype) + 1.0, 1e-5, 0.0)
    biases = [rand(n, dtype=dtype) for n in ns]
    bs = [rand(n, r, dtype=dtype) for n, r in zip(ns, (4, 3, 5))]
    bs[-1 if len(ns) > 1 else 0] = None if len(ns) > 1 else bs[0]  # one projection without an adapter
    cols = sum(b.shape[1] for b in bs if b is not None)
    lora = (rand(m, cols, dtype=dtype), bs, [0.5, 2.0, 1.0][: len(ns)])
    res = rand(m, sum(ns), dtype=dtype)
    config = (True, 16, 16, 32, 4) if dot else (None if m == 1 else (False, 2, 4, 16, 4))  # the 3-D FMA path
    kw = dict(norm=norm, biases=biases, lora=lora, residual=res)
    out = gemv(x, weights, config=config, **kw)
    ref = gemv_reference(x, weights, **kw)
    assert out.dtype == dtype and out.shape == (m, sum(ns))
    assert rel(out, ref) < TOL[dtype]
    if dtype == torch.float32:  # and the plain maths, without the kernel's reference
        h = rms_norm_reference(x, *norm)
        plain = torch.cat([h @ w.t() + b for w, b in zip(weights, biases)], 1)
        for i, b in enumerate(bs):
            if b is not None:
                start = sum(bb.shape[1] for bb in bs[:i] if bb is not None)
                sl = slice(sum(ns[:i]), sum(ns[: i + 1]))
                plain[:, sl] += lora[2][i] * lora[0][:, start : start + b.shape[1]] @ b.t()
        assert rel(out, plain + res) < 1e-5


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("m, dot", [(1, False), (4, True)])
def test_gemv_gated_activation_with_gemma_norm(activation, m, dot):
    k, n = 36, 19
    x, g, u = rand(m, k), rand(n, k, scale=0.3), rand(n, k, scale=0.3)
    norm = (rand(k, scale=0.1), 1e-6, 1.0)
    lora = (rand(m, 6), [rand(n, 2), rand(n, 4)], [1.5, 0.5])
    out = gemv(x, [g, u], norm=norm, lora=lora, activation=activation, config=(True, 16, 16, 16, 4) if dot else None)
    h = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + norm[0])
    gate = h @ g.t() + 1.5 * lora[0][:, :2] @ lora[1][0].t()
    up = h @ u.t() + 0.5 * lora[0][:, 2:] @ lora[1][1].t()
    act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}[activation]
    assert rel(out, act(gate) * up) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_logits_fp32_softcap_in_place_residual(dtype):
    x, w = rand(2, 30, dtype=dtype), rand(77, 30, dtype=dtype)
    out = gemv(x, [w], out_dtype=torch.float32, softcap=3.0)
    assert out.dtype == torch.float32
    ref = gemv_reference(x, [w], out_dtype=torch.float32, softcap=3.0)
    assert rel(out, ref) < TOL[dtype]
    assert rel(out, torch.tanh((x.float() @ w.float().t()) / 3.0) * 3.0) < TOL[dtype] * 2
    h = rand(2, 77, dtype=dtype)
    expected = gemv_reference(x, [w], residual=h)
    assert gemv(x, [w], residual=h, out=h) is h
    assert rel(h, expected) < TOL[dtype]


def test_gemv_bad_input():
    x, w = rand(2, 8), rand(4, 8)
    with pytest.raises(ValueError, match="weights"):
        gemv(x, [rand(4, 9)])
    with pytest.raises(ValueError, match="x must have 1 to 16 rows"):
        gemv(rand(17, 8), [w])
    with pytest.raises(ValueError, match="x must have the weights' dtype"):
        gemv(x.double(), [w.double().float()]) if False else gemv(x.bfloat16(), [w])
    with pytest.raises(ValueError, match="activation"):
        gemv(x, [w, rand(5, 8)], activation="silu")
    with pytest.raises(ValueError, match="activation must be one of"):
        gemv(x, [w, w], activation="relu")
    with pytest.raises(ValueError, match="norm weight"):
        gemv(x, [w], norm=(rand(7), 1e-6, 0.0))
    with pytest.raises(ValueError, match="lora xa"):
        gemv(x, [w], lora=(rand(2, 3), [rand(4, 2)], [1.0]))
    with pytest.raises(ValueError, match="residual"):
        gemv(x, [w], residual=rand(2, 5))
    with pytest.raises(ValueError, match="weights must hold"):
        gemv(x, [w] * 4)


def attention_case(dtype, b=2, heads=6, hkv=2, d=24, length=40, slot=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (heads + 2 * hkv) * d, generator=g).to(dtype)
    k_cache = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    v_cache = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    valid = torch.zeros(b, length, dtype=torch.bool)
    valid[:, :slot] = True
    valid[1, :5] = False  # left padding of row 1
    pos = torch.tensor([slot, slot - 5])
    angles = torch.arange(64)[:, None] * torch.linspace(0.01, 1.0, d // 2)[None]
    cos = torch.cat([angles.cos()] * 2, 1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, 1).to(dtype)
    return qkv, k_cache, v_cache, valid, torch.tensor([slot]), pos, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(chunk=16),
        dict(softcap=5.0, window=7, chunk=16),
        dict(qk_norm=True),
        dict(d=16, heads=2, hkv=2, slot=39),
    ],
)
def test_decode_attention(dtype, opts):
    opts = dict(opts)
    shape = {k: opts.pop(k) for k in ("d", "heads", "hkv", "slot") if k in opts}
    qkv, kc, vc, valid, slot, pos, cos, sin = attention_case(dtype, **shape)
    heads, d = shape.get("heads", 6), kc.shape[-1]
    if opts.pop("qk_norm", False):
        opts["qk_norm"] = (rand(d, dtype=dtype) + 1, rand(d, dtype=dtype) + 1, 1e-6, 0.0)
    kc2, vc2 = kc.clone(), vc.clone()
    out = decode_attention(qkv, kc, vc, valid, slot, pos, cos, sin, heads=heads, scaling=d**-0.5, **opts)
    opts.pop("chunk", None)
    ref = decode_attention_reference(qkv, kc2, vc2, valid, slot, pos, cos, sin, heads=heads, scaling=d**-0.5, **opts)
    assert rel(out, ref) < TOL[dtype]
    assert rel(kc, kc2) < TOL[dtype] and torch.equal(vc, vc2)  # the new column written, nothing else
    # the reference against plain attention over the updated cache (row 0 in fp32, no extras)
    if dtype == torch.float32 and not opts:
        s = int(slot)
        q = qkv[0, : heads * d].view(heads, d)
        c, sn = cos[int(pos[0])], sin[int(pos[0])]
        rot = lambda t: t * c + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sn  # noqa: E731
        keys = kc2[0].repeat_interleave(heads // kc.shape[1], 0)[:, : s + 1]
        vals = vc2[0].repeat_interleave(heads // kc.shape[1], 0)[:, : s + 1]
        probs = torch.softmax(torch.einsum("hd,hld->hl", rot(q), keys) * d**-0.5, -1)
        assert rel(out[0].view(heads, d), torch.einsum("hl,hld->hd", probs, vals)) < 1e-5


def test_decode_attention_bad_input():
    qkv, kc, vc, valid, slot, pos, cos, sin = attention_case(torch.float32)
    with pytest.raises(ValueError, match="heads"):
        decode_attention(qkv, kc, vc, valid, slot, pos, cos, sin, heads=5, scaling=1.0)
    with pytest.raises(ValueError, match="qkv"):
        decode_attention(qkv[:, :-1], kc, vc, valid, slot, pos, cos, sin, heads=6, scaling=1.0)
    with pytest.raises(ValueError, match="valid"):
        decode_attention(qkv, kc, vc, valid.long(), slot, pos, cos, sin, heads=6, scaling=1.0)
    with pytest.raises(ValueError, match="cos and sin"):
        decode_attention(qkv, kc, vc, valid, slot, pos, cos[:, :4], sin, heads=6, scaling=1.0)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        decode_attention(qkv, kc, vc[:, :1], valid, slot, pos, cos, sin, heads=6, scaling=1.0)
    with pytest.raises(ValueError, match="slot"):
        decode_attention(qkv, kc, vc, valid, slot.float(), pos, cos, sin, heads=6, scaling=1.0)


@pytest.mark.parametrize("offset, dtype", [(0.0, torch.float32), (1.0, torch.bfloat16)])
def test_add_rms_norm(offset, dtype):
    h, y, w = rand(3, 50, dtype=dtype), rand(3, 50, dtype=dtype), rand(50, dtype=dtype)
    expected = (h.float() + rms_norm_reference(y, w, 1e-6, offset).float()).to(dtype)
    assert add_rms_norm(h, y, (w, 1e-6, offset)) is h
    assert rel(h, expected) < TOL[dtype]
    with pytest.raises(ValueError, match="h and y"):
        add_rms_norm(h, y[:2], (w, 1e-6, offset))


def test_greedy_emit():
    b, v = 3, 300
    logits = torch.randn(b, v)
    logits[2, 7] = logits[2, 250] = 50.0  # a tie: the first index wins, as torch.argmax
    finished = torch.tensor([False, True, False])
    done_at = torch.full((b,), 99)
    count = torch.tensor([4])
    eos = torch.full((8,), -1)
    eos[0] = int(logits[0].argmax())
    pad = torch.tensor(0)
    out = torch.full((b, 10), -5)
    tok = torch.zeros(b, 1, dtype=torch.long)
    pos = torch.tensor([[3], [6], [9]])
    greedy_emit(logits, finished, done_at, count, eos, pad, out, tok, pos)
    assert out[:, 4].tolist() == [int(logits[0].argmax()), 0, 7]
    assert tok.view(-1).tolist() == out[:, 4].tolist()
    assert finished.tolist() == [True, True, False] and done_at.tolist() == [4, 99, 99]
    assert pos.view(-1).tolist() == [4, 7, 10]
    assert (out[:, :4] == -5).all() and (out[:, 5:] == -5).all()
    with pytest.raises(ValueError, match="logits"):
        greedy_emit(logits.bfloat16(), finished, done_at, count, eos, pad, out, tok, pos)
    with pytest.raises(ValueError, match="finished"):
        greedy_emit(logits, finished.long(), done_at, count, eos, pad, out, tok, pos)

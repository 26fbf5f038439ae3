"""MoE kernels against float64 references: grouped GEMM (forward, dX, dW, routing-weight grads) with uneven,
empty and single-row experts; the router and routing metadata; the expert MLP with and without LoRA; gpt-oss's
experts (transposed weights, interleaved gate/up, biases, the clamped SwiGLU) against transformers' own module;
the autotune cache."""

import json

import pytest
import torch

from fastplug.kernels.activations import gate_factor_torch
from fastplug.kernels.moe import (
    ExpertLoRA,
    grouped_gemm,
    grouped_gemm_reference,
    moe_experts,
    moe_experts_reference,
    moe_router,
    moe_router_reference,
    routing_metadata,
    routing_metadata_reference,
    tuning,
)
from fastplug.kernels.moe.glu import glu_spec
from fastplug.kernels.moe.grouped_gemm import grouped_mm_dw, grouped_mm_glu, grouped_mm_rows
from fastplug.kernels.moe.grouped_gemm import sweep as sweep_configs
from tests.helpers import TOL, assert_close, rel_err

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _f64(*tensors):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "counts, K, N, fused",
    [
        ([3, 0, 1, 17, 2], 40, 24, True),  # uneven, an empty and a single-row expert, odd K/N
        ([40, 0, 1, 70], 150, 70, True),  # several row tiles per expert, K and N past one block
        ([0, 0, 5], 16, 33, True),  # leading empty experts
        ([1, 1], 8, 16, False),  # rows already grouped: no gather/scatter
        ([70, 3, 0, 161, 33, 9, 1], 24, 150, True),  # > 8 row tiles: a full and a partial group of row tiles
    ],
)
def test_grouped_gemm_matches_loop(dtype, counts, K, N, fused):
    E, M = len(counts), sum(counts)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    T = 9
    x = torch.randn(T if fused else M, K, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(E, N, K, device=DEVICE) / K**0.5).to(dtype).requires_grad_()
    kw = {}
    if fused:
        kw = dict(
            gather_index=torch.randint(0, T, (M,), device=DEVICE),
            scatter_index=torch.randperm(M, device=DEVICE),
            row_weights=torch.rand(M, device=DEVICE, requires_grad=True),
        )
    out = grouped_gemm(x, w, offsets, **kw)
    assert out.dtype == dtype and out.shape == (M, N)
    x64, w64 = _f64(x, w)
    kw64 = dict(kw, row_weights=_f64(kw["row_weights"])[0]) if fused else {}
    ref = grouped_gemm_reference(x64, w64, offsets, **kw64)
    assert_close(out, ref, dtype, "out")
    grad = torch.randn(out.shape, device=DEVICE).to(dtype)
    inputs, inputs64 = [x, w], [x64, w64]
    if fused:
        inputs.append(kw["row_weights"]), inputs64.append(kw64["row_weights"])
    for name, g, g64 in zip(
        ("dx", "dw", "drow_weights"), _grads(out, inputs, grad), _grads(ref, inputs64, grad.double())
    ):
        assert_close(g, g64, dtype, name)


def test_grouped_gemm_errors_name_the_argument():
    x, w = torch.randn(4, 8), torch.randn(2, 6, 8)
    offsets = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_gemm(x, w, offsets[:1])
    with pytest.raises(ValueError, match="w's last dim"):
        grouped_gemm(x, torch.randn(2, 6, 7), offsets)
    with pytest.raises(ValueError, match="gather_index"):
        grouped_gemm(x, w, offsets, gather_index=torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="row_weights"):
        grouped_gemm(x, w, offsets, row_weights=torch.ones(5))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("T, E, k", [(13, 6, 2), (5, 4, 4), (1, 3, 1)])
def test_router_matches_torch(T, E, k, normalize):
    logits = torch.randn(T, E, device=DEVICE, requires_grad=True)
    weights, index = moe_router(logits, k, normalize=normalize)
    ref_logits = _f64(logits)[0]
    ref_weights, ref_index = moe_router_reference(ref_logits, k, normalize=normalize, weights_dtype=torch.float64)
    assert torch.equal(index, ref_index)
    assert_close(weights, ref_weights, torch.float32, "weights")
    grad = torch.randn(weights.shape, device=DEVICE)
    assert_close(
        _grads(weights, [logits], grad)[0],
        _grads(ref_weights, [ref_logits], grad.double())[0],
        torch.float32,
        "dlogits",
    )
    with pytest.raises(ValueError, match="top_k"):
        moe_router(logits, E + 1)


@pytest.mark.parametrize("T, E, k", [(11, 5, 2), (1, 3, 3), (300, 7, 2)])
def test_routing_metadata_is_a_stable_sort(T, E, k):
    index = torch.stack([torch.randperm(E, device=DEVICE)[:k] for _ in range(T)])
    index[0] = torch.arange(k, device=DEVICE)  # expert E-1 may be empty
    for got, want in zip(routing_metadata(index, E), routing_metadata_reference(index, E)):
        assert torch.equal(got.cpu(), want.cpu().to(got.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lora", [False, True])
def test_moe_experts_matches_loop(dtype, lora):
    T, H, I, E, k, r = 9, 40, 24, 5, 2, 4
    x = torch.randn(T, H, device=DEVICE).to(dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5).to(dtype).requires_grad_()
    down = (torch.randn(E, H, I, device=DEVICE) / I**0.5).to(dtype).requires_grad_()
    logits = torch.randn(T, E, device=DEVICE)
    logits[:, E - 1] = -1e4  # one expert gets no tokens
    logits = logits.requires_grad_()
    adapters = [
        torch.randn(*s, device=DEVICE, requires_grad=True) for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))
    ]

    def run(fn, x, gate_up, down, logits, adapters):
        weights, index = moe_router_reference(logits, k, weights_dtype=x.dtype)
        kw = dict(gate_up_lora=ExpertLoRA(*adapters[:2], 0.5), down_lora=ExpertLoRA(*adapters[2:], 2.0)) if lora else {}
        return fn(x, gate_up, down, index, weights, **kw)

    inputs = [x, gate_up, down, logits] + (adapters if lora else [])
    out = run(moe_experts, x, gate_up, down, logits, adapters)
    inputs64 = _f64(*inputs)
    ref = run(moe_experts_reference, *inputs64[:4], inputs64[4:] if lora else adapters)
    # two GEMMs with bf16 intermediates (gate_up output, h), rounded as transformers rounds them; the
    # interpreter truncates to bf16 instead of rounding (twice the error)
    tol = (2e-2 if DEVICE.type == "cuda" else 3e-2) if dtype == torch.bfloat16 else None
    assert_close(out, ref, dtype, "out", tol=tol)
    grad = torch.randn(out.shape, device=DEVICE).to(dtype)
    names = ["dx", "dgate_up", "ddown", "dlogits", "dA1", "dB1", "dA2", "dB2"]
    for name, g, g64 in zip(names, _grads(out, inputs, grad), _grads(ref, inputs64, grad.double())):
        assert_close(g, g64, dtype, name, tol=tol)


@pytest.mark.parametrize("impl", ["ptr", "tma", "torch"])
@pytest.mark.parametrize("K, N", [(64, 96), (40, 72)])  # block-aligned widths, and ones that are not
def test_launch_paths_match_loop(impl, K, N):
    """Each launch path the tuner may pick (pointer loads, tensor descriptors, torch._grouped_mm + the scale/
    scatter pass), forced: fused rows, plain rows, the transposed weight view of dX, and dW."""
    dtype = torch.bfloat16
    counts = [40, 0, 1, 70, 9]
    E, M, T = len(counts), sum(counts), 30
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    x, xm = torch.randn(T, K, device=DEVICE).to(dtype), torch.randn(M, K, device=DEVICE).to(dtype)
    w = (torch.randn(E, N, K, device=DEVICE) / K**0.5).to(dtype)
    wt = (torch.randn(E, K, N, device=DEVICE) / K**0.5).to(dtype)  # wt.transpose(1, 2): dX's view, unit stride on N
    gather, scatter = torch.randint(0, T, (M,), device=DEVICE), torch.randperm(M, device=DEVICE)
    rw, dy = torch.rand(M, device=DEVICE), torch.randn(M, N, device=DEVICE).to(dtype)
    cfg = tuning.as_config((0, 0, 0, 0, 0, "torch") if impl == "torch" else (32, 32, 32, 1, 1, impl))
    d = lambda t: t.double()  # noqa: E731

    def dw_loop(dy_rows, x_rows, scale=1.0):
        out, start = [], 0
        for end in offsets.tolist():
            out.append(scale * dy_rows[start:end].T @ x_rows[start:end])
            start = end
        return torch.stack(out)

    got = grouped_mm_rows(x, w, offsets, a_index=gather, out_index=scatter, row_weights=rw, config=cfg)
    ref = grouped_gemm_reference(d(x), d(w), offsets, gather_index=gather, scatter_index=scatter, row_weights=d(rw))
    assert_close(got, ref, dtype, "fused rows")
    assert_close(
        grouped_mm_rows(xm, w, offsets, config=cfg), grouped_gemm_reference(d(xm), d(w), offsets), dtype, "rows"
    )
    assert_close(
        grouped_mm_rows(xm, wt.transpose(1, 2), offsets, config=cfg),
        grouped_gemm_reference(d(xm), d(wt).transpose(1, 2), offsets),
        dtype,
        "rows, transposed weights",
    )
    assert_close(
        grouped_mm_dw(dy, x, offsets, E, dy_index=scatter, x_index=gather, row_weights=rw, config=cfg),
        dw_loop(d(dy)[scatter] * d(rw)[:, None], d(x)[gather]),
        dtype,
        "dw, gathered",
    )
    assert_close(grouped_mm_dw(dy, xm, offsets, E, scale=0.5, config=cfg), dw_loop(d(dy), d(xm), 0.5), dtype, "dw")
    if impl != "torch":  # the gate_up GEMM with the activation in its epilogue (Triton only)
        I = N // 2
        for activation in ("silu", "gelu_tanh"):
            spec = glu_spec(activation)
            gu, h = grouped_mm_glu(x, w[:, : 2 * I].contiguous(), offsets, spec, a_index=gather, config=cfg)
            ref_gu = grouped_gemm_reference(d(x), d(w[:, : 2 * I]), offsets, gather_index=gather)
            assert_close(gu, ref_gu, dtype, "glu: gu")
            gate, up = gu.double()[:, :I], gu.double()[:, I:]  # h from the rounded gu, as a separate pass reads it
            ref_h = gate * gate_factor_torch(gate, activation)[0] * up
            assert_close(h, ref_h, dtype, f"glu: h ({activation})")
            none, h2 = grouped_mm_glu(
                x, w[:, : 2 * I].contiguous(), offsets, spec, a_index=gather, store_gu=False, config=cfg
            )
            assert none is None and torch.equal(h2, h)
            if impl == "ptr":  # the unfused pair the tuner may pick instead: the GEMM, then the activation pass
                split = tuning.as_config((0, 0, 0, 0, 0, "split"))
                gu_s, h_s = grouped_mm_glu(x, w[:, : 2 * I].contiguous(), offsets, spec, a_index=gather, config=split)
                assert_close(gu_s, ref_gu, dtype, "split glu: gu")
                assert_close(h_s, ref_h, dtype, f"split glu: h ({activation})")


@pytest.mark.parametrize("lora", [False, True])
def test_moe_experts_frozen_down_split_path(lora):
    """A frozen down projection without LoRA takes ExpertsUp + ExpertsDown: same values and gradients as
    the loop (x, gate_up, the routing weights, LoRA on gate_up)."""
    dtype = torch.float32
    T, H, I, E, k, r = 11, 40, 24, 5, 2, 4
    x = torch.randn(T, H, device=DEVICE).requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5).requires_grad_()
    down = torch.randn(E, H, I, device=DEVICE) / I**0.5
    logits = torch.randn(T, E, device=DEVICE)
    logits[:, 1] = -1e4  # an expert without tokens
    logits = logits.requires_grad_()
    adapters = [
        torch.randn(E, r, H, device=DEVICE, requires_grad=True),
        torch.randn(E, 2 * I, r, device=DEVICE, requires_grad=True),
    ]

    def run(fn, x, gate_up, logits, adapters):
        weights, index = moe_router_reference(logits, k)
        kw = dict(gate_up_lora=ExpertLoRA(*adapters, 0.5)) if lora else {}
        return fn(x, gate_up, down.to(x.dtype), index, weights.to(x.dtype), **kw)

    inputs = [x, gate_up, logits] + (adapters if lora else [])
    out = run(moe_experts, x, gate_up, logits, adapters)
    assert out.grad_fn is not None and "ExpertsDown" in type(out.grad_fn).__name__
    inputs64 = _f64(*inputs)
    ref = run(moe_experts_reference, *inputs64[:3], inputs64[3:])
    assert_close(out, ref, dtype, "out")
    grad = torch.randn(out.shape, device=DEVICE)
    for name, g, g64 in zip(
        ["dx", "dgate_up", "dlogits", "dA1", "dB1"], _grads(out, inputs, grad), _grads(ref, inputs64, grad.double())
    ):
        assert_close(g, g64, dtype, name)


def test_split_path_skips_the_down_gemm_in_checkpoint_recompute(monkeypatch):
    """Under non-reentrant checkpointing (early stop on) the down GEMM runs once: ExpertsDown saves nothing
    that the recompute must rebuild. Gradients equal the unchecked run's."""
    from torch.utils.checkpoint import checkpoint

    from fastplug.kernels.moe import experts

    T, H, I, E, k = 9, 32, 16, 4, 2
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    gate_up = (torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5).requires_grad_()
    down = torch.randn(E, H, I, device=DEVICE) / I**0.5
    router = torch.randn(H, E, device=DEVICE)
    calls = []
    forward = experts.ExpertsDown.forward
    monkeypatch.setattr(experts.ExpertsDown, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))

    def layer(x):
        weights, index = moe_router(x @ router, k)
        return x + moe_experts(x, gate_up, down, index, weights)

    grad = torch.randn(T, H, device=DEVICE)
    plain = _grads(layer(x), [x, gate_up], grad)
    calls.clear()
    checked = _grads(checkpoint(layer, x, use_reentrant=False), [x, gate_up], grad)
    assert len(calls) == 1
    for name, a, b in zip(("dx", "dgate_up"), checked, plain):
        assert torch.allclose(a, b), name


def test_tuning_candidates_fit_shared_memory():
    small = tuning.candidates("fwd", torch.bfloat16, 1536, 2048, 64, 65536, smem_limit=64 * 1024)
    assert small and all(tuning.shared_memory_bytes("fwd", c, torch.bfloat16) <= 64 * 1024 for c in small)
    big = tuning.candidates("fwd", torch.bfloat16, 1536, 2048, 64, 65536, smem_limit=228 * 1024)
    assert len(big) > len(small)
    tiny = tuning.candidates("fwd", torch.bfloat16, 16, 16, 4, 8, smem_limit=228 * 1024)
    assert [c["impl"] for c in tiny] == ["torch", "ptr"]  # no Triton block fits the shape: the smallest one
    assert [c["impl"] for c in tuning.candidates("fwd", torch.bfloat16, 16, 16, 4, 8, 228 * 1024, ("ptr", "tma"))] == [
        "ptr"
    ]


def test_tuning_cache_written_read_back_and_keyed(tmp_path, monkeypatch):
    path = tmp_path / "moe.json"
    monkeypatch.setenv("FASTPLUG_MOE_TUNE_CACHE", str(path))
    monkeypatch.setattr(tuning, "device_key", lambda device: "Fake GPU|triton 0")
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 228 * 1024)
    monkeypatch.setattr(tuning, "_may_time", lambda device: True)
    timings = {}

    def fake_time(run, cfg):
        # prefers big BLOCK_N, many stages; torch._grouped_mm slower than all
        timings[str(cfg)] = 1.0 if cfg["impl"] == "torch" else 1.0 / (cfg["BLOCK_N"] * cfg["num_stages"])
        return timings[str(cfg)]

    monkeypatch.setattr(tuning, "time_config", fake_time)
    fake = torch.device("cuda", 0)
    args = ("fwd", torch.bfloat16, 1536, 2048, 64, 65536, fake)
    tuning.set_autotune(True)
    try:
        tuning.reset_cache_state()
        best = tuning.config_for(*args, run=lambda cfg: None, variant="t")
        assert timings and best == min(tuning.candidates(*args[:6], 228 * 1024), key=lambda c: timings[str(c)])
        assert any(c["impl"] == "torch" for c in tuning.candidates(*args[:6], 228 * 1024))
        data = json.loads(path.read_text())
        assert data["Fake GPU|triton 0"][tuning.shape_key(*args[:6], "t")] == best

        # without "t" in the variant (LoRA, fp32) torch._grouped_mm is never timed; another key
        timings.clear()
        other = tuning.config_for(*args, run=lambda cfg: None, variant="l")
        assert timings and not any("torch" in c for c in timings) and other["impl"] != "torch"

        # a new process reads it back without timing anything
        tuning.reset_cache_state()
        monkeypatch.setattr(tuning, "time_config", lambda run, cfg: pytest.fail("timed a cached shape"))
        assert tuning.config_for(*args, run=lambda cfg: None, variant="t") == best

        # a cache entry from before the impl field is ignored (retuned), never misread
        data["Fake GPU|triton 0"][tuning.shape_key(*args[:6], "old")] = {
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "BLOCK_K": 64,
            "num_warps": 4,
            "num_stages": 3,
        }
        path.write_text(json.dumps(data))
        tuning.reset_cache_state()
        assert tuning.config_for(*args, variant="old") == tuning.as_config(tuning.DEFAULTS["fwd"])

        # another device or Triton version ignores the entry (no run given: the default)
        tuning.reset_cache_state()
        monkeypatch.setattr(tuning, "device_key", lambda device: "Other GPU|triton 0")
        assert tuning.config_for(*args) == tuning.as_config(tuning.DEFAULTS["fwd"])

        # the switch: no tuning, no cache, the default config
        tuning.set_autotune(False)
        tuning.reset_cache_state()
        monkeypatch.setattr(tuning, "device_key", lambda device: "Fake GPU|triton 0")
        assert tuning.config_for(*args, run=lambda cfg: None) == tuning.as_config(tuning.DEFAULTS["fwd"])
    finally:
        tuning.set_autotune(None)
        tuning.reset_cache_state()


def test_moe_tune_needs_cuda_and_names_pandas(monkeypatch):
    import sys

    from fastplug.bench import moe_tune

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            moe_tune.moe_tune_rows(64, 64, 4, 256)
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    with pytest.raises(ImportError, match="pip install pandas"):
        moe_tune.moe_tune_dataframe(64, 64, 4, 256)
    with pytest.raises(ValueError, match="kind"):
        sweep_configs("bwd", 64, 64, 4, 256, device="cpu")


# ------------------------------------------------------------------- gpt-oss: clamped SwiGLU, interleaved, biases
@pytest.mark.parametrize(
    "activation, interleaved", [("clamped_swiglu", True), ("clamped_swiglu", False), ("silu", True)]
)
def test_glu_rows_layouts_and_clamps(activation, interleaved):
    """The rows kernel forward and backward against float64 autograd: gate/up columns as halves or interleaved,
    gpt-oss's clamps hit on both sides (their gradients zero outside them), routing-weight gradients."""
    from fastplug.kernels.moe.glu import glu_rows_backward, glu_rows_forward, glu_rows_reference

    clamped = activation == "clamped_swiglu"
    spec = glu_spec(
        activation, interleaved=interleaved, alpha=1.702 if clamped else None, limit=1.5 if clamped else None
    )
    M, I = 37, 24
    gu = 2 * torch.randn(M, 2 * I, device=DEVICE)  # beyond the limit 1.5 both ways
    rw, dh = torch.rand(M, device=DEVICE), torch.randn(M, I, device=DEVICE)
    gu64, rw64 = _f64(gu)[0].requires_grad_(), _f64(rw)[0].requires_grad_()
    h64 = glu_rows_reference(gu64, spec)
    dgu64, drw64 = torch.autograd.grad(h64 * rw64[:, None], (gu64, rw64), dh.double())
    assert_close(glu_rows_forward(gu, spec), h64, torch.float32, "h")
    dgu, h, drw = glu_rows_backward(dh.clone(), gu, rw, spec)
    assert_close(h, h64, torch.float32, "h (backward)")
    assert_close(dgu, dgu64, torch.float32, "dgu")
    assert_close(drw, (dh.double() * h64).sum(1), torch.float32, "drw")
    if clamped:
        assert (dgu64 == 0).sum() > M  # the clamps did cut gradients


def _gpt_oss_experts(E, H, I):
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_limit=1.5)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


@pytest.mark.parametrize("dtype, down_frozen", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_moe_experts_gpt_oss_against_transformers(dtype, down_frozen):
    """gpt-oss's experts on the grouped GEMMs: [E, in, out] weights passed as transposed views, interleaved gate/up,
    biases, the clamped SwiGLU, LoRA on gate_up (and on down unless it is frozen: the split path). The float64
    loop is transformers' GptOssExperts itself; values and every gradient (x, weights, biases, routing weights,
    adapters) against it, bf16 no worse than the same maths in bf16."""
    T, H, I, E, k, r = 7, 24, 12, 4, 2, 2
    module = _gpt_oss_experts(E, H, I)
    x = torch.randn(T, H, device=DEVICE, dtype=torch.float64)
    index = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEVICE)
    index[:, 0] = index[:, 0].clamp(max=E - 2)
    index[index == E - 1] = 0  # an expert without tokens
    weights = torch.rand(T, k, device=DEVICE, dtype=torch.float64)
    adapters = [0.3 * torch.randn(*s, device=DEVICE, dtype=torch.float64) for s in ((E, r, H), (E, 2 * I, r))]
    adapters += (
        []
        if down_frozen
        else [0.3 * torch.randn(*s, device=DEVICE, dtype=torch.float64) for s in ((E, r, I), (E, H, r))]
    )
    params = [module.gate_up_proj, module.gate_up_proj_bias, module.down_proj, module.down_proj_bias]

    def run(fn, x, weights, gate_up, gate_up_bias, down, down_bias, *adapters):
        lora = dict(gate_up_lora=ExpertLoRA(*adapters[:2], 0.5))
        if len(adapters) > 2:
            lora["down_lora"] = ExpertLoRA(*adapters[2:], 2.0)
        return fn(
            x, gate_up.transpose(1, 2), down.transpose(1, 2), index, weights, activation="clamped_swiglu",
            swiglu_alpha=module.alpha, swiglu_limit=module.limit, interleaved=True, gate_up_bias=gate_up_bias,
            down_bias=down_bias, **lora,
        )  # fmt: skip

    leaves64 = [t.detach().clone().requires_grad_() for t in (x, weights, *params, *adapters)]
    ref = run(moe_experts_reference, *leaves64)
    with torch.no_grad():  # the reference's layout mapping is transformers' own (no LoRA there: W + s B A folded)
        folded = [p.detach().clone() for p in params]
        folded[0] += 0.5 * torch.einsum("eor,eri->eio", adapters[1], adapters[0])
        if not down_frozen:
            folded[2] += 2.0 * torch.einsum("eor,eri->eio", adapters[3], adapters[2])
        plain = _gpt_oss_experts(E, H, I)
        for p, value in zip(
            (plain.gate_up_proj, plain.gate_up_proj_bias, plain.down_proj, plain.down_proj_bias), folded
        ):
            p.copy_(value)
        assert_close(ref, plain(x, index, weights), torch.float32, "reference vs GptOssExperts", tol=1e-10)

    leaves = [
        t.detach().clone().to(dtype).requires_grad_(i not in (4, 5) or not down_frozen) for i, t in enumerate(leaves64)
    ]
    out = run(moe_experts, *leaves)
    if down_frozen:
        assert "ExpertsDown" in type(out.grad_fn).__name__
    grad = torch.randn(T, H, device=DEVICE, dtype=torch.float64)
    wanted = [i for i, t in enumerate(leaves) if t.requires_grad]
    got = torch.autograd.grad(out, [leaves[i] for i in wanted], grad.to(dtype))
    want = torch.autograd.grad(ref, [leaves64[i] for i in wanted], grad)
    floor = [0.0] * (len(wanted) + 1)
    if dtype != torch.float32:  # torch's own bf16 error: the reference maths on the bf16 inputs
        low_leaves = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in leaves]
        low = run(moe_experts_reference, *low_leaves)
        low_grads = torch.autograd.grad(low, [low_leaves[i] for i in wanted], grad.to(dtype))
        floor = [rel_err(a, b) for a, b in zip((low, *low_grads), (ref, *want))]
    names = ["out"] + [
        ("x", "weights", "gate_up", "gate_up_bias", "down", "down_bias", "A1", "B1", "A2", "B2")[i] for i in wanted
    ]
    # bf16: as test_moe_experts_matches_loop (two GEMMs with bf16 intermediates; the interpreter truncates to bf16
    # where a GPU rounds), or twice torch's own error where that is larger
    low_bound = 2e-2 if DEVICE.type == "cuda" else 3e-2
    for name, a, b, f in zip(names, (out, *got), (ref, *want), floor):
        bound = TOL[dtype] if dtype == torch.float32 else max(2 * f + 1e-3, low_bound)
        assert a.dtype == dtype and rel_err(a, b) < bound, f"{name}: {rel_err(a, b):.2e} >= {bound:.1e}"


def test_moe_experts_gpt_oss_bad_input():
    x, gate_up, down = torch.randn(3, 8), torch.randn(2, 12, 8), torch.randn(2, 8, 6)
    index, weights = torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1)
    for kwargs, match in (
        ({"gate_up_bias": torch.randn(2, 6)}, r"gate_up_bias must have shape \(2, 12\)"),
        ({"down_bias": torch.randn(3, 8)}, r"down_bias must have shape \(2, 8\)"),
        ({"activation": "clamped_swiglu", "swiglu_alpha": 1.7}, "swiglu_limit must be a finite number > 0"),
        ({"swiglu_limit": 7.0}, "swiglu_limit applies to activation 'clamped_swiglu' only"),
        ({"activation": "relu"}, "activation must be one of"),
        ({"interleaved": 1}, "interleaved must be a bool"),
    ):
        with pytest.raises(ValueError, match=match):
            moe_experts(x, gate_up, down, index, weights, **kwargs)


def test_a_row_bucket_near_a_tuned_one_takes_its_config_untimed(tmp_path, monkeypatch):
    """Variable-length batches bring new row buckets mid-training: one within a factor of four of a timed bucket,
    or smaller than one, takes that bucket's config (in memory; the disk keeps what was timed); a much larger one
    is timed, and a borrowed config is never lent on."""
    path = tmp_path / "moe.json"
    monkeypatch.setenv("FASTPLUG_MOE_TUNE_CACHE", str(path))
    monkeypatch.setattr(tuning, "device_key", lambda device: "Fake GPU|triton 0")
    monkeypatch.setattr(tuning, "shared_memory_limit", lambda device: 228 * 1024)
    monkeypatch.setattr(tuning, "_may_time", lambda device: True)
    timed = []

    def fake_time(run, cfg):
        timed.append(cfg)
        return 1.0 / (cfg["BLOCK_M"] * cfg["BLOCK_N"] * cfg["num_stages"]) if cfg["impl"] != "torch" else 1.0

    def config(rows, variant="g"):
        timed.clear()
        return tuning.config_for(
            "fwd", torch.bfloat16, 1536, 2048, 64, rows, fake, run=lambda cfg: None, variant=variant
        )

    monkeypatch.setattr(tuning, "time_config", fake_time)
    fake = torch.device("cuda", 0)
    tuning.set_autotune(True)
    try:
        tuning.reset_cache_state()
        best = config(65536)
        assert timed
        for rows in (20000, 131072, 16384, 262144, 1024):  # 2x and 4x either side, and far smaller: untimed
            assert config(rows) == best and not timed, rows
        saved = json.loads(path.read_text())["Fake GPU|triton 0"]
        assert list(saved) == [tuning.shape_key("fwd", torch.bfloat16, 1536, 2048, 64, 65536, "g")], "only the timed"
        config(65536 * 16)
        assert timed, "16x larger than the timed bucket: timed (4x from a borrowed one lends nothing)"
        config(65536, variant="x")
        assert timed, "another launch (variant) borrows nothing"
        # a new process: the disk's timed buckets lend, the nearest first
        tuning.reset_cache_state()
        assert config(65536 * 8) == config(65536 * 16) and not timed
    finally:
        tuning.set_autotune(None)
        tuning.reset_cache_state()

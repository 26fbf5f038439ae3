"""KernelOptions.fp8 on a tiny Llama: the decoder linears quantized at patch time under peft LoRA (fp32
adapters on a bf16 base) match the unpatched model built on the dequantized weights, train, and restore
(bit-exact by default; dequantized from FP8, with a warning, under fp8_keep_original=False); transformers'
fine-grained FP8 layers, built here as
its FP8 loading builds them, take fastplug's kernel and are put back by restore()."""

import copy

import peft
import pytest
import torch
from torch import nn

import fastplug
from fastplug.kernels.fp8 import (
    dequantize_blockwise_reference,
    quantize_activation_reference,
    quantize_weight_blockwise,
    quantize_weight_blockwise_reference,
)
from fastplug.models.fp8 import is_fp8_linear
from tests.helpers import rel_err
from tests.models.tiny import batch, tiny_model

LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTIONS = dict(fp8=True, gradient_checkpointing=False)


def _decoder_linears(model):
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and ".layers." in n and "lora_" not in n}


def _rounded_to_fp8(model):
    """The same model with its decoder linears' weights replaced by their FP8 values (bf16)."""
    with torch.no_grad():
        for m in _decoder_linears(model).values():
            m.weight.copy_(
                dequantize_blockwise_reference(*quantize_weight_blockwise_reference(m.weight, 128), 128, m.weight.dtype)
            )
    return model


def _fp8_inputs(model):
    """Each decoder linear of the unpatched model reads its input rounded as the FP8 GEMM reads it (per token
    and group of 128; straight through in backward, as the kernel's dX is): the FP8 layer's exact maths."""

    def round_input(module, args):
        x = args[0]
        rounded = dequantize_blockwise_reference(*quantize_activation_reference(x.detach(), 128), (1, 128), x.dtype)
        return (x + (rounded - x).detach(), *args[1:])

    for m in _decoder_linears(model).values():
        m.register_forward_pre_hook(round_input)
    return model


def _with_lora(model, targets=LORA):
    torch.manual_seed(3)  # the same random A and B for the models compared
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _loss_and_adapter_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _flat(grads):
    return torch.cat([g.flatten() for g in grads.values()])


def test_fp8_layers_compute_exactly_the_fp8_maths_fp32():
    # fp32 leaves only the FP8 roundings, which both sides make identically
    base = tiny_model("llama")
    ref = _fp8_inputs(_with_lora(_rounded_to_fp8(copy.deepcopy(base))))
    model = _with_lora(base)
    fastplug.patch_model(model, **OPTIONS)
    loss, grads = _loss_and_adapter_grads(model, batch())
    ref_loss, ref_grads = _loss_and_adapter_grads(ref, batch())
    assert abs(loss - ref_loss) / ref_loss < 1e-4  # rounding near a tie may flip a few FP8 values
    assert rel_err(_flat(grads), _flat(ref_grads)) < 1e-2


def test_fp8_lora_llama_matches_dequantized_model_trains_and_restores():
    base = tiny_model("llama").to(torch.bfloat16)
    ref = _with_lora(_rounded_to_fp8(copy.deepcopy(base)))
    exact = _fp8_inputs(_with_lora(_rounded_to_fp8(copy.deepcopy(base))))
    model = _with_lora(base)
    originals = {n: m.weight for n, m in _decoder_linears(model).items()}
    handle = fastplug.patch_model(model, fp8_keep_original=False, **OPTIONS)
    assert handle.counts["fp8_linear"] == 14 and handle.counts["lora_fused"] == 4
    assert "14 linear layers quantized to FP8 in 128x128 blocks" in handle.summary() and "saved" in handle.summary()
    assert "dequantized from FP8 (lossy: fp8_keep_original=False)" in handle.summary()
    assert all(is_fp8_linear(m) for m in _decoder_linears(model).values())
    assert all(p.numel() == 0 for p in originals.values())  # the bf16 storage is released

    inputs = batch()
    loss, grads = _loss_and_adapter_grads(model, inputs)
    with torch.no_grad():
        assert abs(loss - ref(**inputs).loss) / loss < 1e-2  # the FP8 rounding of the activations
    exact_loss, exact_grads = _loss_and_adapter_grads(exact, inputs)
    assert abs(loss - exact_loss) / exact_loss < 2e-3
    assert grads.keys() == exact_grads.keys() and all(g.dtype == torch.float32 for g in grads.values())
    # bf16 alone puts 2-6% between fastplug's and peft's adapter grads on this tiny model (measured, fp8=False)
    assert rel_err(_flat(grads), _flat(exact_grads)) < 0.15

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss, _ = _loss_and_adapter_grads(model, inputs)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses

    with pytest.warns(UserWarning, match="restore.. gave back 14 frozen linear weights dequantized from FP8"):
        handle.restore()
    handle.restore()  # harmless
    ref_linears = _decoder_linears(ref)
    for name, m in _decoder_linears(model).items():
        assert m.weight is originals[name] and "forward" not in vars(m)
        # lossy: the FP8 values back in bf16 (the interpreter truncates where torch rounds: one bf16 ulp)
        torch.testing.assert_close(m.weight, ref_linears[name].weight, rtol=2**-7, atol=0)


def test_restore_is_bit_exact_by_default_and_trainable_weights_stay(recwarn):
    model = tiny_model("llama").to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_(".mlp." in name)  # attention linears frozen, MLP linears trainable
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    handle = fastplug.patch_model(model, **OPTIONS)
    assert handle.counts["fp8_linear"] == 8  # q/k/v/o of 2 layers
    summary = handle.summary()
    assert "originals kept in CPU memory" in summary and "trainable weight (FP8 bases are frozen)" in summary
    model(**batch()).loss.backward()
    handle.restore()
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    assert not [w for w in recwarn if "FP8" in str(w.message)]


def _transformers_fp8_model():
    """A tiny Llama whose decoder linears are transformers' FP8Linear, filled as a fine-grained FP8 checkpoint
    loads them (weight_scale_inv: the dequantization multiplier of each 128x128 block)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = tiny_model("llama")
    weights = {n: m.weight.detach().clone() for n, m in _decoder_linears(model).items()}
    replace_with_fp8_linear(
        model,
        modules_to_not_convert=["lm_head"],
        quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)),
    )
    for name, w in weights.items():
        m = model.get_submodule(name)
        m.to_empty(device="cpu")
        q, s = quantize_weight_blockwise(w, 128)
        with torch.no_grad():
            m.weight.copy_(q)
            m.weight_scale_inv.copy_(s)
    return model


def test_transformers_fine_grained_fp8_layers_take_fastplugs_kernel():
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    ref = _fp8_inputs(_with_lora(_rounded_to_fp8(tiny_model("llama")), ["q_proj", "v_proj", "down_proj"]))
    model = _with_lora(_transformers_fp8_model(), ["q_proj", "v_proj", "down_proj"])
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():  # peft rounds the adapters it puts on an FP8Linear to e4m3 (peft 0.21): the same ones
        for n, p in ref.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[n])
    fp8_layers = {n: m for n, m in model.named_modules() if type(m).__name__ == "FP8Linear"}
    weights = {n: m.weight for n, m in fp8_layers.items()}
    assert len(fp8_layers) == 14

    with fastplug.patch_model(model, gradient_checkpointing=False) as plain:  # fp8=False: left to transformers
        assert "fused with the fp8=True option" in plain.summary() and "fp8_linear" not in plain.counts

    handle = fastplug.patch_model(model, **OPTIONS)
    assert handle.counts["fp8_linear"] == 14 and handle.counts["lora_fused"] == 4
    assert "14 FP8Linear layers of the checkpoint on fastplug's kernel" in handle.summary()
    assert all(is_fp8_linear(m) for m in fp8_layers.values())
    inputs = batch()
    loss, grads = _loss_and_adapter_grads(model, inputs)
    ref_loss, ref_grads = _loss_and_adapter_grads(ref, inputs)
    assert abs(loss - ref_loss) / ref_loss < 1e-4  # fp32 model: the FP8 maths (as in the test above)
    assert rel_err(_flat(grads), _flat(ref_grads)) < 1e-2
    handle.restore()
    for name, m in fp8_layers.items():
        assert "forward" not in vars(m) and m.weight is weights[name] and m.weight.dtype == torch.float8_e4m3fn


def test_fast_model_quantizes_the_bases_once_peft_freezes_them(tmp_path):
    from types import SimpleNamespace

    from fastplug import FastModel, KernelOptions
    from fastplug.generate.fast_model import _default_options
    from fastplug.patch.engine import active_handle
    from tests.model_path_helpers import save_tiny

    model, _ = FastModel.from_pretrained(
        save_tiny(tmp_path, "llama"), dtype="bfloat16", options=KernelOptions(fp8=True, gradient_checkpointing=False)
    )
    assert "fp8_linear" not in active_handle(model).counts  # trainable when loaded: nothing to quantize yet
    peft_model = FastModel.get_peft_model(model, r=4)
    handle = active_handle(peft_model)
    assert handle.counts["fp8_linear"] == 14 and handle.counts["lora_fused"] == 4
    peft_model(**batch()).loss.backward()
    # a fine-grained FP8 checkpoint is patched with fp8 on by default
    assert _default_options(SimpleNamespace(config=SimpleNamespace(quantization_config={"quant_method": "fp8"}))).fp8
    assert not _default_options(SimpleNamespace(config=SimpleNamespace())).fp8


def test_fp8_layers_compile_fullgraph():
    # fp8_linear is a registered operator (fake implementation, registered autograd): no graph break
    model = tiny_model("llama")
    model.requires_grad_(False)
    fastplug.patch_model(model, fp8=True, lora=False, attention=False, gradient_checkpointing=False)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 64, requires_grad=True)
    expected = mlp(x)
    torch._dynamo.reset()
    y = torch.compile(mlp, backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    torch.testing.assert_close(y, expected)
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_fp8_layers_follow_dtype_conversions_of_the_model():
    # Lightning patches before it converts precision ("bf16-true") and moves the model: the FP8 weights and
    # their scales are integer-typed Parameters, left alone by model.to(dtype), moved by model.to(device)
    model = tiny_model("llama")
    model.requires_grad_(False)
    inputs = batch()
    handle = fastplug.patch_model(model, **OPTIONS)
    layer = model.model.layers[0].mlp.up_proj
    assert dict(layer.named_parameters()).keys() == {"weight", "weight_scale_inv"}
    with torch.no_grad():
        before = model(**inputs).loss
        model.to(torch.bfloat16)
        after = model(**inputs).loss
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale_inv.dtype == torch.int32
    assert abs(after - before) / before < 1e-2
    handle.restore()
    assert dict(layer.named_parameters()).keys() == {"weight"} and layer.weight.dtype == torch.bfloat16

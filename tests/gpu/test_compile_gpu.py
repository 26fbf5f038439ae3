"""torch.compile (Inductor) of a patched decoder layer on CUDA: fastplug's registered operators inside the
compiled graph, fullgraph, no recompilation, the same numbers as the eager patched layer. With peft LoRA
(fp32 adapters on a bf16 base, as peft makes them) the fused LoRA runs traced and fastplug's attention as
a registered operator (Gemma2: softcap and sliding window on the Triton kernel)."""

import pytest
import torch
import transformers

import fastplug
from tests.helpers import assert_close, train_losses


@pytest.mark.parametrize("family, lora", [("llama", False), ("gemma", False), ("llama", True), ("gemma2", True)])
def test_patched_decoder_layer_compiles_with_inductor(family, lora):
    config_class = {
        "llama": transformers.LlamaConfig,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
    }[family]
    config = config_class(hidden_size=1024, intermediate_size=2816, num_hidden_layers=1, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=64, vocab_size=1000)  # fmt: skip
    if family == "gemma2":
        config.sliding_window = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        handle = fastplug.patch_model(model, gradient_checkpointing=False)
        assert handle.counts.get("lora_fused")
        model = model.get_base_model()
    else:
        handle = fastplug.patch_model(model, lora=False, attention=False, gradient_checkpointing=False)
    layer = model.model.layers[0]
    compiled = torch.compile(layer, fullgraph=True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2):
            torch.manual_seed(seed)
            hidden = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
            position_ids = torch.arange(512, device="cuda").expand(2, 512)
            cos_sin = model.model.rotary_emb(hidden, position_ids)
            results = []
            for fn in (compiled, layer):
                x = hidden.clone().requires_grad_()
                out = fn(x, position_embeddings=cos_sin, attention_mask=None, position_ids=position_ids)
                out = out[0] if isinstance(out, tuple) else out
                out.float().square().mean().backward()
                results.append(
                    (out.detach(), x.grad, [p.grad.clone() for p in layer.parameters() if p.grad is not None])
                )
                model.zero_grad()
            (out_c, dx_c, dp_c), (out_e, dx_e, dp_e) = results
            assert_close(out_c, out_e, torch.bfloat16, "output")
            assert_close(dx_c, dx_e, torch.bfloat16, "dx")
            for got, want in zip(dp_c, dp_e):
                assert_close(got, want, torch.bfloat16, "parameter grad")
    handle.restore()


def test_compiled_auto_checkpointing_trains_like_eager_with_stacked_bases():
    """A peft model patched on the GPU has its q/k/v and gate/up bases stacked at patch time (before anything
    compiles), and compiled with gradient_checkpointing="auto" (a graph-broken first step that measures a layer,
    then a recompile) it trains like the eager patched model. It once drifted from step 2 on: stacking from an
    eager stretch of the compiled run moved weights that compiled graphs read where they had been."""
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
    )
    ids = torch.randint(0, 1000, (3, 2, 256), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        handle = fastplug.patch_model(model, gradient_checkpointing="auto", stack_projections=True, freeze_gc=False)
        attn = model.get_base_model().model.layers[0].self_attn
        storages = {
            getattr(attn, n).base_layer.weight.untyped_storage().data_ptr() for n in ("q_proj", "k_proj", "v_proj")
        }
        assert len(storages) == 1, "q/k/v bases are stacked when patched on the GPU"
        run = torch.compile(model) if compiled else model
        torch._dynamo.reset()
        losses.append(train_losses(run, model, ids, fused=True))
        handle.restore()
    assert losses[1] == pytest.approx(losses[0], rel=3e-4), losses  # the drift was 1e-3

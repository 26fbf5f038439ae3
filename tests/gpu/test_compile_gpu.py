"""torch.compile (Inductor) of a patched decoder layer on CUDA: fastplug's registered operators inside the
compiled graph, fullgraph, no recompilation, the same numbers as the eager patched layer."""

import pytest
import torch
import transformers

import fastplug
from tests.helpers import assert_close


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_patched_decoder_layer_compiles_with_inductor(family):
    config_class = transformers.LlamaConfig if family == "llama" else transformers.GemmaConfig
    config = config_class(hidden_size=1024, intermediate_size=2816, num_hidden_layers=1, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=64, vocab_size=1000)  # fmt: skip
    model_class = transformers.LlamaForCausalLM if family == "llama" else transformers.GemmaForCausalLM
    torch.manual_seed(0)
    model = model_class(config).to("cuda", torch.bfloat16)
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
                results.append((out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]))
                model.zero_grad()
            (out_c, dx_c, dp_c), (out_e, dx_e, dp_e) = results
            assert_close(out_c, out_e, torch.bfloat16, "output")
            assert_close(dx_c, dx_e, torch.bfloat16, "dx")
            for got, want in zip(dp_c, dp_e):
                assert_close(got, want, torch.bfloat16, "parameter grad")
    handle.restore()

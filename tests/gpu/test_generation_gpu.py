"""fast_generate on CUDA: the captured decode step gives what the eager step gives, and transformers' /
peft's greedy tokens; the graph is reused across calls and sees in-place adapter updates."""

import pytest
import torch
import transformers

from fastplug import fast_generate
from fastplug.generation import graph_status

peft = pytest.importorskip("peft")

PAD, EOS = 0, 1
CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, vocab_size=512, pad_token_id=PAD, eos_token_id=EOS)


def model(family="Llama", dtype=torch.float32, lora=True, **extra):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**CONFIG, **extra)
    m = getattr(transformers, f"{family}ForCausalLM")(config).to("cuda", dtype).eval()
    if lora:
        m = peft.get_peft_model(m, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                   init_lora_weights=False))
    return m.eval()


def prompts(rows=5, length=24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, CONFIG["vocab_size"], (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, : 3 * row] = 0
    ids[mask == 0] = PAD
    return ids.cuda(), mask.cuda()


def generate(m, ids, mask, new=40, **kw):
    return fast_generate(m, ids, attention_mask=mask, max_new_tokens=new, pad_token_id=PAD, **kw)


@pytest.mark.parametrize("family, extra", [("Llama", {}), ("Gemma2", {"sliding_window": 16,
                                                                      "query_pre_attn_scalar": 32})])
def test_graph_equals_eager_and_transformers(family, extra):
    m = model(family, **extra)
    ids, mask = prompts()
    free = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    eos = int(free[2, ids.shape[1] + 5])  # makes some rows stop early
    expected = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos,
                          pad_token_id=PAD)
    eager = generate(m, ids, mask, do_sample=False, eos_token_id=eos, cuda_graph=False)
    graphed = generate(m, ids, mask, do_sample=False, eos_token_id=eos)
    assert "CUDA graph" in graph_status(m), graph_status(m)
    assert torch.equal(eager, graphed)
    assert torch.equal(graphed, expected)


def test_graph_is_reused_and_sees_adapter_updates():
    m = model()
    ids, mask = prompts()
    before = generate(m, ids, mask, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)  # an optimizer step writes in place too
    after = generate(m, ids, mask, do_sample=False, eos_token_id=None)
    assert graph_status(m).startswith("CUDA graph (1 captured)"), graph_status(m)
    assert not torch.equal(before, after)
    assert torch.equal(after, m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                         eos_token_id=None, pad_token_id=PAD))


def test_bf16_sampling_graph_equals_eager_with_fp32_adapters():
    m = model(dtype=torch.bfloat16)
    for p in m.parameters():  # peft keeps adapters in fp32 on a bf16 base: the cast-copy path
        if p.requires_grad:
            p.data = p.data.float()
    ids, mask = prompts(rows=8)
    outs = []
    for cuda_graph in (False, True, True):
        torch.manual_seed(7)
        outs.append(generate(m, ids, mask, do_sample=True, temperature=0.8, top_k=50, top_p=0.95,
                             eos_token_id=None, cuda_graph=cuda_graph))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert graph_status(m).startswith("CUDA graph")

"""fast_generate on CUDA: the captured decode step gives what the eager step gives, and transformers' /
peft's greedy tokens (Gemma2's sliding layers on a ring cache, 4-bit QLoRA bases); the graph is reused across
calls and sees in-place adapter updates."""

import pytest
import torch
import transformers

from fastplug import fast_generate
from fastplug.generate.api import graph_status

peft = pytest.importorskip("peft")

PAD, EOS = 0, 1
CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    pad_token_id=PAD,
    eos_token_id=EOS,
)


def model(family="Llama", dtype=torch.float32, lora=True, **extra):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**CONFIG, **extra)
    m = getattr(transformers, f"{family}ForCausalLM")(config).to("cuda", dtype).eval()
    if lora:
        m = peft.get_peft_model(
            m, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        )
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


@pytest.mark.parametrize(
    "family, extra", [("Llama", {}), ("Gemma2", {"sliding_window": 16, "query_pre_attn_scalar": 32})]
)
def test_graph_equals_eager_and_transformers(family, extra):
    m = model(family, **extra)
    ids, mask = prompts()
    free = m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    eos = int(free[2, ids.shape[1] + 5])  # makes some rows stop early
    expected = m.generate(
        ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=PAD
    )
    eager = generate(m, ids, mask, do_sample=False, eos_token_id=eos, cuda_graph=False)
    graphed = generate(m, ids, mask, do_sample=False, eos_token_id=eos)
    assert "CUDA graph" in graph_status(m), graph_status(m)
    assert torch.equal(eager, graphed)
    assert torch.equal(graphed, expected)


def test_qlora_graph_equals_transformers(tmp_path, monkeypatch):
    """A Llama loaded in 4 bits (NF4, double quant; fp32 compute and activations, so the dequantized weights
    are exact) with LoRA: the captured decode step reads the packed weights in the decode kernels' GEMV and
    gives transformers' greedy tokens; the per-op step (gemv_4bit) too."""
    pytest.importorskip("bitsandbytes")
    import fastplug.generate.decoder as decoder

    base = model(lora=False)
    base.save_pretrained(tmp_path)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    m = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=quant, dtype=torch.float32, device_map="cuda"
    )
    torch.manual_seed(0)
    m = peft.get_peft_model(
        m, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    ).eval()
    ids, mask = prompts()
    expected = m.generate(
        ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD
    )
    assert torch.equal(generate(m, ids, mask, do_sample=False, eos_token_id=None), expected)
    assert graph_status(m).startswith("CUDA graph") and "decode kernels" in graph_status(m), graph_status(m)
    monkeypatch.setattr(decoder, "FAST_DECODE", False)
    assert torch.equal(generate(m, ids, mask, do_sample=False, eos_token_id=None), expected)


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
    assert torch.equal(
        after,
        m.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=PAD),
    )


def test_bf16_sampling_graph_equals_eager_with_fp32_adapters():
    m = model(dtype=torch.bfloat16)
    for p in m.parameters():  # peft keeps adapters in fp32 on a bf16 base: the cast-copy path
        if p.requires_grad:
            p.data = p.data.float()
    ids, mask = prompts(rows=8)
    outs = []
    for cuda_graph in (False, True, True):
        torch.manual_seed(7)
        outs.append(
            generate(
                m,
                ids,
                mask,
                do_sample=True,
                temperature=0.8,
                top_k=50,
                top_p=0.95,
                eos_token_id=None,
                cuda_graph=cuda_graph,
            )
        )
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert graph_status(m).startswith("CUDA graph")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_decode_kernels_on_cuda_at_llama_1b_widths(rows):
    """The decode kernels compiled for the GPU against their torch references (bf16, Llama-3.2-1B widths)."""
    from fastplug.kernels.decode import decode_attention, decode_attention_reference, gemv, gemv_reference, greedy_emit

    def rel(a, b):
        assert not torch.isnan(a).any()
        return float((a.double() - b.double()).norm() / b.double().norm())

    torch.manual_seed(rows)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    hidden, inter, heads, kv, hd = 2048, 8192, 32, 8, 64
    x = torch.randn(rows, hidden, **bf)
    norm = (torch.randn(hidden, **bf) * 0.1 + 1, 1e-5, 0.0)
    ws = [torch.randn(n, hidden, **bf) * hidden**-0.5 for n in (heads * hd, kv * hd, kv * hd)]
    bs = [torch.randn(n, 16, **bf) * 0.1 for n in (heads * hd, kv * hd, kv * hd)]
    xa = torch.randn(rows, 48, **bf)
    kw = dict(norm=norm, lora=(xa, bs, [2.0, 2.0, 2.0]))
    assert rel(gemv(x, ws, **kw), gemv_reference(x, ws, **kw)) < 1e-2
    gu = [torch.randn(inter, hidden, **bf) * hidden**-0.5 for _ in range(2)]
    assert rel(gemv(x, gu, norm=norm, activation="silu"), gemv_reference(x, gu, norm=norm, activation="silu")) < 1e-2
    down = torch.randn(hidden, inter, **bf) * inter**-0.5
    hid = torch.randn(rows, inter, **bf)
    res = torch.randn(rows, hidden, **bf)
    expected = gemv_reference(hid, [down], residual=res)
    assert rel(gemv(hid, [down], residual=res, out=res), expected) < 1e-2
    head = torch.randn(50000, hidden, **bf) * 0.05
    logits = gemv(x, [head], norm=norm, out_dtype=torch.float32, softcap=30.0)
    assert rel(logits, gemv_reference(x, [head], norm=norm, out_dtype=torch.float32, softcap=30.0)) < 1e-2

    length, slot = 512, 300
    qkv = torch.randn(rows, (heads + 2 * kv) * hd, **bf)
    kc, vc = torch.randn(rows, kv, length, hd, **bf), torch.randn(rows, kv, length, hd, **bf)
    valid = torch.zeros(rows, length, dtype=torch.bool, device="cuda")
    valid[:, 7:slot] = True
    pos = torch.full((rows,), slot - 7, device="cuda")
    t = torch.arange(length, device="cuda")[:, None] * torch.logspace(0, -4, hd // 2, device="cuda")[None]
    cos, sin = torch.cat([t.cos()] * 2, 1).bfloat16(), torch.cat([t.sin()] * 2, 1).bfloat16()
    slot_t = torch.tensor([slot], device="cuda")
    for chunk, window in ((None, None), (64, 100), (512, None)):
        k2, v2 = kc.clone(), vc.clone()
        out = decode_attention(
            qkv, kc, vc, valid, slot_t, pos, cos, sin, heads=heads, scaling=hd**-0.5, window=window, chunk=chunk
        )
        ref = decode_attention_reference(
            qkv, k2, v2, valid, slot_t, pos, cos, sin, heads=heads, scaling=hd**-0.5, window=window
        )
        assert rel(out, ref) < 1e-2 and torch.equal(vc, v2) and rel(kc, k2) < 1e-2
    # a ring of the last 100 columns (column c at c % 100) against the same window over the full cache
    window = 100
    held = torch.arange(slot - window + 1, slot + 1, device="cuda")
    ring_k, ring_v = torch.zeros_like(kc[:, :, :window]), torch.zeros_like(vc[:, :, :window])
    ring_k[:, :, held % window], ring_v[:, :, held % window] = kc[:, :, held], vc[:, :, held]
    for chunk in (None, 32):
        out = decode_attention(
            qkv,
            ring_k,
            ring_v,
            valid,
            slot_t,
            pos,
            cos,
            sin,
            heads=heads,
            scaling=hd**-0.5,
            window=window,
            ring=True,
            chunk=chunk,
        )
        ref = decode_attention_reference(
            qkv, kc.clone(), vc.clone(), valid, slot_t, pos, cos, sin, heads=heads, scaling=hd**-0.5, window=window
        )
        assert rel(out, ref) < 1e-2 and torch.equal(ring_v[:, :, slot % window], vc[:, :, slot])

    finished = torch.zeros(rows, dtype=torch.bool, device="cuda")
    done_at = torch.full((rows,), 99, device="cuda")
    out_ids = torch.zeros(rows, 8, dtype=torch.long, device="cuda")
    tok = torch.zeros(rows, 1, dtype=torch.long, device="cuda")
    step_pos = torch.zeros(rows, 1, dtype=torch.long, device="cuda")
    eos = torch.full((8,), -1, device="cuda")
    greedy_emit(
        logits,
        finished,
        done_at,
        torch.tensor([2], device="cuda"),
        eos,
        torch.tensor(0, device="cuda"),
        out_ids,
        tok,
        step_pos,
    )
    assert torch.equal(out_ids[:, 2], logits.argmax(-1)) and torch.equal(tok[:, 0], logits.argmax(-1))
    assert (step_pos == 1).all()

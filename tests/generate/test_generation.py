"""fast_generate against transformers' generate: greedy token for token (batched, left padding, per-row EOS)
on tiny models saved and reloaded through FastModel, with and without unmerged LoRA adapters; seeded
sampling; errors. CPU: the decode step runs eagerly (the CUDA graph is tested in tests/gpu)."""

import sys
from copy import deepcopy

import pytest
import torch
import transformers

from fastplug import FastModel, fast_generate
from fastplug.generate.api import _DECODERS, graph_status
from fastplug.patch.engine import unwrap
from tests.model_path_helpers import PAD, save_tiny

peft = pytest.importorskip("peft")

PROMPT, NEW = 7, 10


def prompts(seed=3):
    """3 rows, left padded to different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (3, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids[mask == 0] = PAD
    return ids, mask


def reference(model, ids, mask, eos, new=NEW, **kwargs):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=PAD, **kwargs
    )


def an_early_eos(model, ids, mask, new=NEW):
    """A token that the middle row generates at its 3rd step and the others do not generate before it."""
    free = reference(model, ids, mask, eos=None, new=new)[:, PROMPT:]
    return int(free[1, 2])


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma2", "gemma3_text", "mixtral"])
@pytest.mark.torch_reference  # the decoder's plumbing; its kernels: the decode_kernels tests
def test_greedy_equals_transformers(tmp_path, family):
    """The tiny windowed families (Mistral, Gemma2/3, Mixtral: window 6) get prompts longer than the window."""
    path = save_tiny(tmp_path, family)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model, _ = FastModel.from_pretrained(path)
    ids, mask = prompts()
    eos = an_early_eos(ref_model, ids, mask)
    expected = reference(ref_model, ids, mask, eos)
    got = model.fast_generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD
    )
    assert torch.equal(got, expected)
    assert (got[1, PROMPT + 3 :] == PAD).all()  # the middle row stopped at its EOS


def lora_pair(path, seed=0):
    """(FastModel peft model, a plain transformers + peft copy with the same adapters); random lora_B."""
    model, _ = FastModel.from_pretrained(path)
    fast = FastModel.get_peft_model(model, r=4, lora_alpha=8, init_lora_weights=False, random_state=seed)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    ref = peft.get_peft_model(
        ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    ref.load_state_dict(fast.state_dict())
    return fast, ref.eval()


@pytest.mark.compat
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.torch_reference  # the decoder's plumbing; its kernels: the decode_kernels tests
def test_greedy_with_unmerged_lora_equals_peft(tmp_path, family):
    fast, ref = lora_pair(save_tiny(tmp_path, family))
    ids, mask = prompts()
    eos = an_early_eos(ref, ids, mask)
    expected = reference(ref, ids, mask, eos)
    with ref.disable_adapter():
        assert not torch.equal(expected, reference(ref, ids, mask, eos))  # the adapters matter
    assert torch.equal(
        fast.fast_generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD
        ),
        expected,
    )
    assert fast.training  # the caller's mode comes back

    # a "training step" in place, then disabled adapters: each call generates with the adapters as they are
    with torch.no_grad():
        for name, p in fast.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    ref.load_state_dict(fast.state_dict())
    assert torch.equal(
        fast_generate(
            fast, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD
        ),
        reference(ref, ids, mask, eos),
    )
    with fast.disable_adapter(), ref.disable_adapter():
        assert torch.equal(
            fast_generate(
                fast, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD
            ),
            reference(ref, ids, mask, eos),
        )


def decode_kernels_on_cpu(monkeypatch):
    """Run the decode step through fastplug.kernels.decode (the CUDA path) on CPU, under the Triton interpreter."""
    import fastplug.generate.decoder as decoder
    from fastplug.kernels._utils import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on machines without CUDA)")
    monkeypatch.setattr(decoder, "_FAST_DECODE_ON_CPU", True)


def model_and_reference(path, lora: bool):
    if lora:
        return lora_pair(path)
    return FastModel.from_pretrained(path)[0], transformers.AutoModelForCausalLM.from_pretrained(path).eval()


# Mistral is Llama with a window (here a ring); Llama without LoRA adds nothing the others miss: the LM head's
# GEMV runs without an adapter in every case. 6 new tokens: each interpreted decode step costs ~0.7 s.
@pytest.mark.parametrize(
    "family, lora", [("mistral", True), ("qwen3", True), ("gemma2", False), ("gemma3_text", False)]
)
def test_decode_kernels_greedy_equals_transformers(tmp_path, monkeypatch, family, lora):
    """Fused norm + GEMVs, LoRA in the epilogue, attention over the cache (rings for the windowed layers),
    the one-kernel greedy emit."""
    decode_kernels_on_cpu(monkeypatch)
    model, ref = model_and_reference(save_tiny(tmp_path, family), lora)
    ids, mask = prompts()
    new = 6
    eos = an_early_eos(ref, ids, mask, new)
    expected = reference(ref, ids, mask, eos, new)
    got = fast_generate(
        model, ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=PAD
    )
    assert "decode kernels" in graph_status(model), graph_status(model)
    assert torch.equal(got, expected)
    assert (got[1, PROMPT + 3 :] == PAD).all()
    alone = fast_generate(
        model,
        ids[1:2],
        attention_mask=mask[1:2],
        max_new_tokens=3,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD,
    )  # batch 1: the GEMV's FMA path
    assert torch.equal(alone, reference(ref, ids[1:2], mask[1:2], None, new=3))


@pytest.mark.parametrize("kernels", [False, True], ids=["per_op", "decode_kernels"])
def test_windowed_layers_keep_a_ring_of_window_columns(tmp_path, monkeypatch, kernels):
    """Gemma2 (sliding and global layers alternate) with a window of 4 and LoRA: the sliding layers' caches are
    4 columns; a prompt longer than the window, then a shorter prompt on the same cache (ring slots it does not
    reach still hold the first call's keys and must stay masked), both left padded."""
    if kernels:
        decode_kernels_on_cpu(monkeypatch)
    model, ref = lora_pair(save_tiny(tmp_path, "gemma2", sliding_window=4))
    ids, mask = prompts()
    short_ids, short_mask = ids[:, 5:].clone(), torch.ones(3, 2, dtype=torch.long)
    short_mask[1, 0] = 0
    short_ids[1, 0] = PAD
    for ids, mask, new in ((ids, mask, 4), (short_ids, short_mask, 3)):
        got = fast_generate(
            model, ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=PAD
        )
        assert torch.equal(got, reference(ref, ids, mask, None, new=new))
    decoder = _DECODERS[unwrap(model)]
    assert ("decode kernels" in graph_status(model)) == kernels
    (session,) = decoder.sessions.values()
    assert [lp.window for lp in decoder.plan.layers] == [4, None]
    assert [tuple(k.shape) for k in session.k] == [(4, 2, 4, 16), (4, 2, session.length, 16)]
    assert [v.shape for v in session.v] == [k.shape for k in session.k]


@pytest.mark.parametrize("chunk", [None, 16], ids=["one_split", "two_splits"])
def test_ring_attention_equals_the_window_over_a_full_cache(chunk):
    """decode_attention (the kernel under the interpreter) on a ring of the last 32 columns gives what it gives
    on the full cache with a window of 32, pads inside the window included, and writes the same key/value."""
    from fastplug.kernels.decode import decode_attention

    torch.manual_seed(0)
    b, hkv, heads, d, length, window, slot = 2, 1, 2, 16, 64, 32, 45
    qkv = torch.randn(b, (heads + 2 * hkv) * d)
    full_k, full_v = torch.randn(b, hkv, length, d), torch.randn(b, hkv, length, d)
    held = torch.arange(slot - window + 1, slot + 1)  # the columns the window sees, at their ring slots
    ring_k, ring_v = torch.randn(b, hkv, window, d), torch.randn(b, hkv, window, d)
    ring_k[:, :, held % window], ring_v[:, :, held % window] = full_k[:, :, held], full_v[:, :, held]
    valid = torch.ones(b, length, dtype=torch.bool)
    valid[0, :20] = False  # row 0's left padding reaches into the window
    pos = torch.tensor([slot - 20, slot])
    angles = torch.arange(length)[:, None] * torch.logspace(0, -3, d // 2)[None]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    kw = dict(heads=heads, scaling=d**-0.5, window=window, chunk=chunk)
    slot_t = torch.tensor([slot])
    expected = decode_attention(qkv, full_k, full_v, valid, slot_t, pos, cos, sin, **kw)
    got = decode_attention(qkv, ring_k, ring_v, valid, slot_t, pos, cos, sin, ring=True, **kw)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(ring_k[:, :, slot % window], full_k[:, :, slot])
    assert torch.equal(ring_v[:, :, slot % window], full_v[:, :, slot])
    with pytest.raises(ValueError, match="window"):
        decode_attention(
            qkv, ring_k, ring_v, valid, slot_t, pos, cos, sin, ring=True, heads=heads, scaling=1.0, window=window + 1
        )


def load_4bit(path, lora: bool):
    """The tiny model loaded in 4 bits by transformers (NF4, double quantization; fp32 compute and activations:
    the dequantized weights are exact in fp32, so only the order of the sums differs from bitsandbytes')."""
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.float32, device_map="cpu"
    )
    for module in model.modules():  # on CPUs with AVX512-BF16 bitsandbytes would repack the weights at the
        if hasattr(module, "support_avx512bf16_for_cpu"):  # first eval forward into a layout fastplug leaves
            module.support_avx512bf16_for_cpu = False  # to the module: keep the standard one
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    return model.eval()


@pytest.mark.parametrize(
    "lora, kernels",
    [(False, False), (True, False), (True, True)],
    ids=["4bit", "4bit_lora", "4bit_lora_decode_kernels"],
)
def test_4bit_bases_decode_from_packed_weights(tmp_path, monkeypatch, lora, kernels):
    """QLoRA: a tiny Llama in 4 bits (with unmerged LoRA on every projection) generates transformers' greedy
    tokens, its projections run through fastplug's 4-bit kernels (no Linear4bit module call): gemv_4bit in
    the per-op step, the decode kernels' GEMV reading the packed weights otherwise."""
    pytest.importorskip("bitsandbytes")
    import fastplug.generate.plan as plan
    from fastplug.kernels import quant

    if kernels:
        decode_kernels_on_cpu(monkeypatch)
    rows_seen = []

    def counted(x, weight):
        rows_seen.append(x.numel() // x.shape[-1])
        return quant.gemv_4bit(x, weight)

    monkeypatch.setattr(plan, "gemv_4bit", counted)
    model = load_4bit(save_tiny(tmp_path, "llama"), lora)
    ids, mask = prompts()
    got = fast_generate(
        model, ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=PAD
    )
    decoder = _DECODERS[unwrap(model)]
    projs = [p for lp in decoder.plan.layers for p in lp.projs]
    assert all(p.module is None and p.packed for p in projs) and len(projs) == 14
    assert all((p.lora_A is not None) == lora for p in projs)
    assert decoder.fast_reason is None and ("decode kernels" in graph_status(model)) == kernels
    # the prompt (3 rows in a bucket of 4, 7 tokens) once per projection, then 4 decode steps of 4 rows
    assert rows_seen == [28] * 14 + ([] if kernels else [4] * 14 * 4)
    assert torch.equal(got, dense_reference(model, ids, mask, new=5))


def dense_reference(model, ids, mask, new):
    """transformers' greedy tokens with each 4-bit base replaced, in place, by an nn.Linear holding the float64
    values of its bytes (in fp32), not bitsandbytes' CPU dequantization: on AVX-512 CPUs that one is wrong where
    blocks straddle rows (the tiny Llama's down_proj, in = 96, blocksize 64; tests/test_bnb_layouts.py)."""
    import bitsandbytes as bnb

    from tests.test_bnb_layouts import dequantize_float64

    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = dequantize_float64(child.weight).float()
                if child.bias is not None:
                    dense.bias.data = child.bias.data.float()
                setattr(owner, name, dense)
    return reference(model, ids, mask, None, new=new)


def packed_4bit(out, k, nested, quant_type, blocksize=64):
    """A bitsandbytes 4-bit weight [out, k] on the CPU (normal values scaled by 1/8)."""
    bnb = pytest.importorskip("bitsandbytes")
    w = bnb.nn.Params4bit(
        torch.randn(out, k) / 8,
        requires_grad=False,
        quant_type=quant_type,
        compress_statistics=nested,
        blocksize=blocksize,
    )
    return w._quantize("cpu")


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_gemv_reads_4bit_weights_as_their_dequantization(rows):
    """decode_kernels.gemv on packed weights (NF4 double-quantized, FP4 plain) gives, bit for bit in fp32, what
    it gives on their dequantized matrices: q/k/v with norm, bias and LoRA; gate/up with the activation;
    down with the residual. Mixed dense and 4-bit weights are refused."""
    from fastplug.kernels.decode import gemv
    from fastplug.kernels.quant import dequantize_4bit_reference

    torch.manual_seed(rows)
    x = torch.randn(rows, 64)
    for nested, quant_type in ((True, "nf4"), (False, "fp4")):
        qkv = [packed_4bit(n, 64, nested, quant_type) for n in (48, 16, 16)]
        gate_up = [packed_4bit(32, 64, nested, quant_type) for _ in range(2)]
        down = [packed_4bit(64, 64, nested, quant_type)]
        lora = (torch.randn(rows, 8), [torch.randn(48, 4), None, torch.randn(16, 4)], [2.0, 0.0, 0.5])
        cases = [
            (
                qkv,
                dict(norm=(torch.rand(64) + 0.5, 1e-6, 0.0), biases=[torch.randn(n) for n in (48, 16, 16)], lora=lora),
            ),
            (gate_up, dict(activation="silu")),
            (down, dict(residual=torch.randn(rows, 64))),
        ]
        for weights, kw in cases:
            dense = [dequantize_4bit_reference(w, torch.float32) for w in weights]
            assert torch.equal(gemv(x, weights, **kw), gemv(x, dense, **kw))
    with pytest.raises(ValueError, match="4-bit and dense"):
        gemv(x, [qkv[0], torch.randn(16, 64)])


def test_generation_never_imports_bitsandbytes(llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # an import of it would now raise ImportError
    ids, mask = prompts()
    fast_generate(llama, ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("gen_llama"), "llama")
    return FastModel.from_pretrained(path, max_seq_length=40)[0]


@pytest.mark.torch_reference  # the decoder's plumbing; its kernels: the decode_kernels tests
def test_sampling_is_seeded_and_top_k_1_is_greedy(llama):
    ids, mask = prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)

    def sample(seed, **more):
        torch.manual_seed(seed)
        return fast_generate(llama, ids, do_sample=True, **kwargs, **more)

    first = sample(1, temperature=1.5)
    assert torch.equal(first, sample(1, temperature=1.5))
    assert not torch.equal(first, sample(2, temperature=1.5))
    assert first.shape == (3, PROMPT + NEW) and first.min() >= 0 and first.max() < 128
    greedy = fast_generate(llama, ids, do_sample=False, **kwargs)
    assert torch.equal(sample(3, top_k=1), greedy)
    assert torch.equal(sample(4, top_p=1e-6), greedy)  # top-p keeps only the most likely token
    # a tiny temperature sharpens towards greedy; a wide top-k/top-p sample is a valid one
    assert torch.equal(sample(5, temperature=1e-4), greedy)
    assert sample(6, top_k=20, top_p=0.9).shape == greedy.shape


@pytest.mark.torch_reference  # the decoder's plumbing; its kernels: the decode_kernels tests
def test_streamer_gets_the_prompt_then_the_tokens(llama):
    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ids, mask = prompts()
    streamer = Collect()
    out = fast_generate(
        llama,
        ids[1:2],
        attention_mask=mask[1:2],
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        streamer=streamer,
    )
    assert streamer.parts[0] == ids[1].tolist() and streamer.ended
    assert sum(streamer.parts[1:], []) == out[0, PROMPT:].tolist()


@pytest.mark.torch_reference  # the decoder's plumbing; its kernels: the decode_kernels tests
def test_errors_before_generating(llama):
    ids, mask = prompts()
    with pytest.raises(ValueError, match="max_seq_length 40"):
        fast_generate(llama, ids, attention_mask=mask, max_new_tokens=34)
    with pytest.raises(ValueError, match="LEFT padding"):
        fast_generate(llama, ids, attention_mask=mask.flip(1), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        fast_generate(llama, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="input_ids"):
        fast_generate(llama, ids[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask"):
        fast_generate(llama, ids, attention_mask=mask[:, 1:], max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        fast_generate(llama, ids, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        fast_generate(llama, ids, max_new_tokens=2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="eos_token_id"):
        fast_generate(llama, ids, max_new_tokens=2, eos_token_id="<eos>")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="supports the families"):
        fast_generate(gpt2, ids % 64, max_new_tokens=2)


@pytest.mark.torch_reference  # the decoder's plumbing; its kernels: the decode_kernels tests
def test_generation_config_and_batch_buckets(llama):
    ids, mask = prompts()
    config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = fast_generate(llama, ids, attention_mask=mask, max_new_tokens=NEW, generation_config=config)
    # 3 rows run in a bucket of 4; each row alone (bucket 1) gives the same tokens
    for row in range(3):
        alone = fast_generate(
            llama, ids[row : row + 1, mask[row].argmax() :], max_new_tokens=NEW, generation_config=config
        )
        assert torch.equal(alone[0, -NEW:], out[row, -NEW:])
    decoder = _DECODERS[llama]
    assert list(decoder.sessions) == [(1, 256)]
    held = decoder.sessions[(1, 256)]
    fast_generate(llama, ids[:1], max_new_tokens=2, generation_config=config)  # shorter: the same cache
    assert decoder.sessions[(1, 256)] is held
    copy = deepcopy(llama)  # TRL copies models (reference models): the cache stays with the original
    assert copy not in _DECODERS
    assert torch.equal(fast_generate(copy, ids, attention_mask=mask, max_new_tokens=NEW, generation_config=config), out)


@pytest.mark.parametrize(
    "rows,dtype", [(1, torch.float32), (1, torch.bfloat16), (3, torch.float32), (8, torch.bfloat16)]
)
def test_decode_gemv_word_wise_path_matches_decoded_tiles(rows, dtype):
    """decode_kernels.gemv on 4-bit weights read as 32-bit words (the path the decode step takes on a GPU, 1-8
    rows of x) equals the path without it (decoded tiles at one row, the dequantized weights at more) within the
    rounding of the weight (products of the unrounded weight there): q/k/v with the Llama and the Gemma norm,
    bias and LoRA; gate/up with the activation; down with an in-place residual; NF4 nested and FP4 plain,
    blocksizes 64 and 128, several chunks of K."""
    from fastplug.kernels.decode import gemv

    torch.manual_seed(0)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for k, nested, quant_type, blocksize in ((64, True, "nf4", 64), (1024, False, "fp4", 128), (520, True, "nf4", 64)):
        x = torch.randn(rows, k, dtype=dtype)
        qkv = [packed_4bit(n, k, nested, quant_type, blocksize) for n in (48, 16, 12)]
        lora = (
            torch.randn(rows, 8, dtype=dtype),
            [torch.randn(48, 4, dtype=dtype), None, torch.randn(12, 4, dtype=dtype)],
            [2.0, 0.0, 0.5],
        )
        nw = (torch.rand(k) + 0.5).to(dtype)
        cases = [
            (qkv, dict(norm=(nw, 1e-6, 0.0), biases=[torch.randn(n, dtype=dtype) for n in (48, 16, 12)], lora=lora)),
            (qkv, dict(norm=(nw, 1e-6, 1.0))),
            ([packed_4bit(32, k, nested, quant_type, blocksize) for _ in range(2)], dict(activation="silu")),
            ([packed_4bit(64, k, nested, quant_type, blocksize)], dict(residual=torch.randn(rows, 64, dtype=dtype))),
        ]
        for weights, kw in cases:
            tiles = gemv(x, weights, words=False, **kw).float()
            if "residual" in kw:  # in place, as the decode step's o/down projections
                out = kw["residual"].clone()
                gemv(x, weights, words=True, **{**kw, "residual": out}, out=out)
            else:
                out = gemv(x, weights, words=True, **kw)
            err = ((out.float() - tiles).norm() / tiles.norm()).item()
            assert err < tol, (k, quant_type, sorted(kw), err)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(torch.randn(9, 64), [packed_4bit(16, 64, True, "nf4", 64)], words=True)

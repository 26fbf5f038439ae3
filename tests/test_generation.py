"""fast_generate against transformers' generate: greedy token for token (batched, left padding, per-row EOS)
on tiny models saved and reloaded through FastModel, with and without unmerged LoRA adapters; seeded
sampling; errors. CPU: the decode step runs eagerly (the CUDA graph is tested in tests/gpu)."""

from copy import deepcopy

import pytest
import torch
import transformers

from fastplug import FastModel, fast_generate
from fastplug.generation import _DECODERS
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


def reference(model, ids, mask, eos, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=PAD, **kwargs)


def an_early_eos(model, ids, mask):
    """A token that the middle row generates at its 3rd step and the others do not generate before it."""
    free = reference(model, ids, mask, eos=None)[:, PROMPT:]
    return int(free[1, 2])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma2", "gemma3_text", "mixtral"])
def test_greedy_equals_transformers(tmp_path, family):
    path = save_tiny(tmp_path, family)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model, _ = FastModel.from_pretrained(path)
    ids, mask = prompts()
    eos = an_early_eos(ref_model, ids, mask)
    expected = reference(ref_model, ids, mask, eos)
    got = model.fast_generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                              pad_token_id=PAD)
    assert torch.equal(got, expected)
    assert (got[1, PROMPT + 3:] == PAD).all()  # the middle row stopped at its EOS


def lora_pair(path, seed=0):
    """(FastModel peft model, a plain transformers + peft copy with the same adapters); random lora_B."""
    model, _ = FastModel.from_pretrained(path)
    fast = FastModel.get_peft_model(model, r=4, lora_alpha=8, init_lora_weights=False, random_state=seed)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    ref = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                   init_lora_weights=False))
    ref.load_state_dict(fast.state_dict())
    return fast, ref.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_with_unmerged_lora_equals_peft(tmp_path, family):
    fast, ref = lora_pair(save_tiny(tmp_path, family))
    ids, mask = prompts()
    eos = an_early_eos(ref, ids, mask)
    expected = reference(ref, ids, mask, eos)
    with ref.disable_adapter():
        assert not torch.equal(expected, reference(ref, ids, mask, eos))  # the adapters matter
    assert torch.equal(fast.fast_generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                          eos_token_id=eos, pad_token_id=PAD), expected)
    assert fast.training  # the caller's mode comes back

    # a "training step" in place, then disabled adapters: each call generates with the adapters as they are
    with torch.no_grad():
        for name, p in fast.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    ref.load_state_dict(fast.state_dict())
    assert torch.equal(fast_generate(fast, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                     eos_token_id=eos, pad_token_id=PAD), reference(ref, ids, mask, eos))
    with fast.disable_adapter(), ref.disable_adapter():
        assert torch.equal(fast_generate(fast, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                         eos_token_id=eos, pad_token_id=PAD), reference(ref, ids, mask, eos))


@pytest.mark.parametrize("family, lora", [("llama", False), ("gemma2", False), ("gemma3_text", False),
                                          ("llama", True), ("qwen3", True)])
def test_decode_kernels_greedy_equals_transformers(tmp_path, monkeypatch, family, lora):
    """The decode step through fastplug.kernels.decode (the CUDA path), run on CPU under the Triton interpreter:
    fused norm + GEMVs, LoRA in the epilogue, attention over the cache, the one-kernel greedy emit."""
    import fastplug.generation as generation
    from fastplug.kernels._utils import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on machines without CUDA)")
    monkeypatch.setattr(generation, "_FAST_DECODE_ON_CPU", True)
    path = save_tiny(tmp_path, family)
    if lora:
        model, ref = lora_pair(path)
    else:
        ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        model, _ = FastModel.from_pretrained(path)
    ids, mask = prompts()
    eos = an_early_eos(ref, ids, mask)
    expected = reference(ref, ids, mask, eos)
    got = fast_generate(model, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                        pad_token_id=PAD)
    assert "decode kernels" in generation.graph_status(model), generation.graph_status(model)
    assert torch.equal(got, expected)
    alone = fast_generate(model, ids[1:2, 0:], attention_mask=mask[1:2], max_new_tokens=4, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD)  # batch 1: the GEMV's FMA path
    assert torch.equal(alone[0, PROMPT:], reference(ref, ids[1:2], mask[1:2], None)[0, PROMPT:PROMPT + 4])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("gen_llama"), "llama")
    return FastModel.from_pretrained(path, max_seq_length=40)[0]


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
    out = fast_generate(llama, ids[1:2], attention_mask=mask[1:2], max_new_tokens=NEW, do_sample=False,
                        eos_token_id=None, streamer=streamer)
    assert streamer.parts[0] == ids[1].tolist() and streamer.ended
    assert sum(streamer.parts[1:], []) == out[0, PROMPT:].tolist()


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


def test_generation_config_and_batch_buckets(llama):
    ids, mask = prompts()
    config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = fast_generate(llama, ids, attention_mask=mask, max_new_tokens=NEW, generation_config=config)
    # 3 rows run in a bucket of 4; each row alone (bucket 1) gives the same tokens
    for row in range(3):
        alone = fast_generate(llama, ids[row:row + 1, mask[row].argmax():], max_new_tokens=NEW,
                              generation_config=config)
        assert torch.equal(alone[0, -NEW:], out[row, -NEW:])
    decoder = _DECODERS[llama]
    assert list(decoder.sessions) == [(1, 256)]
    held = decoder.sessions[(1, 256)]
    fast_generate(llama, ids[:1], max_new_tokens=2, generation_config=config)  # shorter: the same cache
    assert decoder.sessions[(1, 256)] is held
    copy = deepcopy(llama)  # TRL copies models (reference models): the cache stays with the original
    assert copy not in _DECODERS
    assert torch.equal(fast_generate(copy, ids, attention_mask=mask, max_new_tokens=NEW, generation_config=config),
                       out)

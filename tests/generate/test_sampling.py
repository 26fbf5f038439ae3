"""fast_generate's sampling against transformers': a repetition penalty on greedy decoding token for token, and
sampled tokens (temperature, top-k, top-p, min-p, repetition penalty together) drawn from the distribution
transformers' logits processors give, by a chi-square test on a 12-token vocabulary over two steps."""

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fastplug import fast_generate
from tests.models.tiny import tiny_model

PAD = 0
SETTINGS = dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.08, repetition_penalty=1.6)


@pytest.fixture(scope="module")
def small_vocab_llama():
    """12 tokens, logits spread wide enough that every filter cuts something."""
    model = tiny_model("llama", seed=4, vocab_size=12, hidden_size=32, head_dim=8, num_hidden_layers=1).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    return model


def processors(settings):
    """transformers' processors for these settings, in the order its generate() applies them."""
    return LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]),
            TemperatureLogitsWarper(settings["temperature"]),
            TopKLogitsWarper(settings["top_k"]),
            TopPLogitsWarper(settings["top_p"]),
            MinPLogitsWarper(settings["min_p"]),
        ]
    )


@torch.no_grad()
def joint_distribution(model, prompt: list[int], settings) -> torch.Tensor:
    """p(t1, t2) [V, V] of two sampled tokens after `prompt`, from transformers' processors (float64)."""
    procs = processors(settings)

    def next_probs(ids):
        ids = torch.tensor([ids])
        scores = model(ids).logits[:, -1].float()
        return torch.softmax(procs(ids, scores).double(), -1)[0]

    first = next_probs(prompt)
    vocab = first.numel()
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in first.nonzero().flatten().tolist():
        joint[t1] = first[t1] * next_probs(prompt + [t1])
    return joint


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the counts under probs; cells expecting fewer than 5 draws are pooled into one."""
    counts, probs = counts.flatten().double(), probs.flatten()
    n = counts.sum()
    if counts[probs == 0].any():  # a draw transformers could never make
        return 0.0
    expected = n * probs
    small = (expected < 5) & (probs > 0)
    obs = torch.cat([counts[expected >= 5], counts[small].sum().view(1)])
    exp = torch.cat([expected[expected >= 5], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def counts_of(out: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    pairs = out[rows][:, -2:]
    return torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).view(vocab, vocab)


def test_sampling_draws_from_transformers_distribution(small_vocab_llama):
    model, vocab = small_vocab_llama, 12
    prompts = [[3, 7, 3], [5, 9, 2, 11]]  # different lengths: the first row is left padded
    ids = torch.tensor([[PAD, 3, 7, 3], [5, 9, 2, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    draws = 1500
    ids, mask = ids.repeat_interleave(draws, 0), mask.repeat_interleave(draws, 0)
    rows = [torch.arange(draws) + i * draws for i in range(2)]

    def sample(generate, **settings):
        torch.manual_seed(11)
        return generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, eos_token_id=None,
                        pad_token_id=PAD, **settings)  # fmt: skip

    ours = sample(lambda *a, **k: fast_generate(model, *a, **k), **SETTINGS)
    theirs = sample(model.generate, **SETTINGS)
    unpenalized = sample(lambda *a, **k: fast_generate(model, *a, **k), **{**SETTINGS, "repetition_penalty": 1.0})
    for prompt, row in zip(prompts, rows):
        expected = joint_distribution(model, prompt, SETTINGS)
        assert (expected > 0).sum() >= 6 and (expected.sum(1) > 0).sum() < vocab, "filters cut, several tokens left"
        assert chi_square_p(counts_of(theirs, row, vocab), expected) > 1e-3, "the expected law is transformers'"
        assert chi_square_p(counts_of(ours, row, vocab), expected) > 1e-3
        # the test can tell a wrong law: sampling without the penalty fails it
        assert chi_square_p(counts_of(unpenalized, row, vocab), expected) < 1e-3


def test_repetition_penalty_greedy_equals_transformers():
    model = tiny_model("llama", seed=2).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[mask == 0] = PAD
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    plain = fast_generate(model, ids, **kwargs)
    ours = fast_generate(model, ids, repetition_penalty=1.5, **kwargs)
    expected = model.generate(ids, repetition_penalty=1.5, **kwargs)
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, plain), "the penalty changes the tokens"


@pytest.mark.parametrize(
    "kw, match",
    [({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": -0.1}, "min_p")],
)
def test_bad_settings_raise(small_vocab_llama, kw, match):
    with pytest.raises(ValueError, match=match):
        fast_generate(small_vocab_llama, torch.tensor([[1, 2]]), max_new_tokens=1, do_sample=True, **kw)

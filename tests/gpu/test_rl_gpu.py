"""The RL pieces on CUDA (issue 37): the fused per-token log-probs at the Llama-3 vocabulary against a float64
reference; the repetition penalty and min-p inside the captured decode step (decode kernels' greedy emit, the
sampling graph); FastGRPOTrainer's rollouts through CUDA graphs equal TRL's. Numbers only, no timings
(`python -m fastplug.bench grpo` measures)."""

import pytest
import torch

from fastplug.generate.api import graph_status
from fastplug.kernels import fused_linear_log_probs, fused_linear_log_probs_reference
from tests.gpu.test_generation_gpu import PAD, generate, model, prompts
from tests.helpers import assert_close, rel_err

VOCAB = 128256


def test_fused_log_probs_at_llama_vocab_match_float64():
    torch.manual_seed(0)
    n, hidden_size = 1536, 2048
    hidden = (torch.randn(n, hidden_size, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(VOCAB, hidden_size, device="cuda") * hidden_size**-0.5 * 2).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (n,), device="cuda")
    labels[:200] = -100
    labels[200::9] = -100
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    kw = dict(temperature=0.7, entropy=True)

    log_probs, entropy = fused_linear_log_probs(hidden, weight, labels, **kw)
    (grad,) = torch.autograd.grad((log_probs * g_lp).sum() + (entropy * g_ent).sum(), hidden)
    ref_hidden = hidden.detach().double().requires_grad_(True)
    ref_log_probs, ref_entropy = fused_linear_log_probs_reference(ref_hidden, weight.double(), labels, **kw)
    (ref_grad,) = torch.autograd.grad((ref_log_probs * g_lp).sum() + (ref_entropy * g_ent).sum(), ref_hidden)
    # torch at bf16: the logits of a bf16 matmul, the rest in fp32 (what TRL computes)
    torch_hidden = hidden.detach().clone().requires_grad_(True)
    logits = (torch_hidden @ weight.t()).float()
    log_p = torch.log_softmax(logits / 0.7, -1)
    valid = labels != -100
    torch_lp = torch.where(valid, log_p.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    torch_ent = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    (torch_grad,) = torch.autograd.grad((torch_lp * g_lp).sum() + (torch_ent * g_ent).sum(), torch_hidden)

    assert_close(log_probs, ref_log_probs, torch.bfloat16, "log_probs", 2 * rel_err(torch_lp, ref_log_probs) + 1e-3)
    assert_close(entropy, ref_entropy, torch.bfloat16, "entropy", 2 * rel_err(torch_ent, ref_entropy) + 1e-3)
    assert_close(grad, ref_grad, torch.bfloat16, "grad hidden", 2 * rel_err(torch_grad, ref_grad) + 1e-3)


def test_repetition_penalty_and_min_p_in_the_captured_step():
    m = model()
    ids, mask = prompts()
    penalized = dict(do_sample=False, repetition_penalty=1.3, eos_token_id=None)
    expected = m.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=PAD, **penalized)
    assert torch.equal(generate(m, ids, mask, **penalized), expected)  # decode kernels' greedy emit, in a graph
    assert "CUDA graph" in graph_status(m) and "decode kernels" in graph_status(m), graph_status(m)
    assert not torch.equal(generate(m, ids, mask, do_sample=False, eos_token_id=None), expected)
    sampled = dict(do_sample=True, temperature=0.9, min_p=0.05, repetition_penalty=1.2, eos_token_id=None)
    outs = []
    for cuda_graph in (False, True):
        torch.manual_seed(3)
        outs.append(generate(m, ids, mask, cuda_graph=cuda_graph, **sampled))
    assert torch.equal(outs[0], outs[1])


def test_fast_grpo_rollouts_on_cuda_equal_trl(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from fastplug.integrations.trl import FastGRPOTrainer
    from tests.integrations.test_grpo import Recorder, reward
    from tests.integrations.test_trl import TOKENIZER, randomise_lora_b

    def run(cls):
        m = model(lora=False)
        m.config.pad_token_id = m.generation_config.pad_token_id = TOKENIZER.pad_token_id
        args = GRPOConfig(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
            steps_per_generation=1, max_completion_length=24, learning_rate=2e-2, beta=0.1,
            generation_kwargs={"do_sample": False}, logging_steps=1, report_to="none", save_strategy="no", seed=0,
            bf16=False, disable_tqdm=True,
        )  # fmt: skip
        trainer = cls(
            model=m, reward_funcs=reward, args=args, processing_class=TOKENIZER,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["1+1=", "hello wor", "abc", "the quick brown"]}),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        )  # fmt: skip
        randomise_lora_b(trainer.model)
        recorder = Recorder(trainer)
        trainer.train()
        return trainer, recorder

    reference, theirs = run(GRPOTrainer)
    trainer, ours = run(FastGRPOTrainer)
    assert "rollouts: fastplug fast_generate" in trainer.fast_kernels_summary
    assert ours.rollouts == theirs.rollouts and ours.rollouts[0] != ours.rollouts[1]
    losses = [torch.tensor([h["loss"] for h in t.state.log_history if "loss" in h]) for t in (trainer, reference)]
    assert rel_err(*losses) < 1e-3  # fastplug's kernels in the layers: fp32 / TF32 rounding

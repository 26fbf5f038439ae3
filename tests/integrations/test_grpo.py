"""FastGRPOTrainer / FastRLOOTrainer against TRL's own trainers on a tiny Llama with LoRA, greedy rollouts and a
deterministic reward: the same completions (fast_generate with the live adapters: the second rollout comes after
an optimizer step and differs from the first), per-token log-probs and entropies (fused LM head; the reference
with the adapters disabled), losses, KL and LoRA gradients; the model is restored after training; settings fast
generation lacks fall back to TRL's path and say so once."""

import warnings

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from peft import LoraConfig  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from fastplug import KernelOptions  # noqa: E402
from fastplug.integrations.trl import FastGRPOTrainer, FastRLOOTrainer  # noqa: E402
from fastplug.models.structure import unwrap  # noqa: E402
from fastplug.patch.engine import active_handle  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.integrations.test_trl import TOKENIZER, module_state, randomise_lora_b, tiny_llama  # noqa: E402

# What is under test is the rollouts and the log-prob passes; the layer kernels (interpreted on CPU, slow) and
# the self-check have their own tests.
ROLLOUTS_ONLY = KernelOptions(rms_norm=False, rope=False, mlp=False, attention=False, cross_entropy=False,
                              self_check=False)  # fmt: skip
PROMPTS = ["1+1=", "hello wor", "abc", "the quick brown"]  # different lengths: left padding


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a loaded 2-core machine: several intra-op threads made a rollout 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dataset():
    return datasets.Dataset.from_dict({"prompt": PROMPTS})


def reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


class Recorder(TrainerCallback):
    """Each rollout (prompts, completions), each log-prob pass's outputs, the trainable gradients at each step."""

    def __init__(self, trainer):
        self.rollouts, self.log_probs, self.grads = [], [], []
        generate, log_probs = trainer._generate_single_turn, trainer._get_per_token_logps_and_entropies

        def record_rollout(prompt_ids, *args, **kwargs):
            out = generate(prompt_ids, *args, **kwargs)
            self.rollouts.append({tuple(p): c for p, c in zip(prompt_ids, out[0])})
            return out

        def record_log_probs(*args, **kwargs):
            out = log_probs(*args, **kwargs)
            self.log_probs.append([None if t is None else t.detach().clone() for t in out[:2]])
            return out

        trainer._generate_single_turn, trainer._get_per_token_logps_and_entropies = record_rollout, record_log_probs
        trainer.add_callback(self)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))


def grpo_args(tmp_path, **more):
    # 4 prompts x 2 greedy generations per rollout, two micro-batches of 4 rows each (gradient accumulation),
    # a rollout every optimizer step; beta > 0: the reference pass runs (the adapters disabled); bf16 autocast, as
    # runs are set up (fp32 had hidden an issue-40 crash)
    settings = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        gradient_accumulation_steps=2, steps_per_generation=2, max_completion_length=6, learning_rate=5e-2,
        beta=0.1, generation_kwargs={"do_sample": False}, logging_steps=1, report_to="none", save_strategy="no",
        seed=0, use_cpu=True, bf16=True, disable_tqdm=True,
    )  # fmt: skip
    return GRPOConfig(**{**settings, **more})


def train(trainer_cls, args, **kwargs):
    trainer = trainer_cls(
        model=tiny_llama(), reward_funcs=reward, args=args, train_dataset=dataset(), processing_class=TOKENIZER,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), **kwargs,
    )  # fmt: skip
    randomise_lora_b(trainer.model)  # the policy differs from the reference from the first step
    recorder = Recorder(trainer)
    trainer.train()
    return trainer, recorder


def logged(trainer, key):
    return torch.tensor([h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h])


@pytest.mark.compat
def test_fast_grpo_matches_trl(tmp_path):
    # fp32: the second rollout equals TRL's only if the first step's update does (bf16: the test below)
    reference, theirs = train(GRPOTrainer, grpo_args(tmp_path, bf16=False))
    trainer, ours = train(FastGRPOTrainer, grpo_args(tmp_path, bf16=False), options=ROLLOUTS_ONLY)

    assert "rollouts: fastplug fast_generate" in trainer.fast_kernels_summary
    assert "per-token log-probs: fastplug's fused LM head" in trainer.fast_kernels_summary
    assert len(ours.rollouts) == 2 and ours.rollouts == theirs.rollouts
    assert ours.rollouts[1] != ours.rollouts[0], "the second rollout runs the adapters of after the first step"
    # per rollout: the reference pass (no grad), then the policy pass of each micro-batch (with grad, entropies)
    assert len(ours.log_probs) == len(theirs.log_probs) == 6
    for (log_probs, entropy), (their_log_probs, their_entropy) in zip(ours.log_probs, theirs.log_probs):
        assert log_probs.dtype == torch.float32 and rel_err(log_probs, their_log_probs) < 1e-5
        assert (entropy is None) == (their_entropy is None)
        assert entropy is None or rel_err(entropy, their_entropy) < 1e-5
    for key in ("loss", "kl", "entropy", "reward"):
        assert rel_err(logged(trainer, key), logged(reference, key)) < 1e-5, key
    assert logged(trainer, "kl").abs().min() > 0, "the KL term (and so the reference pass) counts"
    assert len(ours.grads) == 2
    for grads, their_grads in zip(ours.grads, theirs.grads):
        assert grads.abs().max() > 0 and rel_err(grads, their_grads) < 1e-4

    # restored: the modules TRL made, no instance forward but TRL's fused LM head (TRL 1.16) on the causal LM
    assert active_handle(trainer.model) is None
    (modules, _), (their_modules, _) = (module_state(t.model, trl_head=unwrap(t.model)) for t in (trainer, reference))
    assert [m[::2] for m in modules] == [m[::2] for m in their_modules] and all(m[3] is None for m in modules)
    head, their_head = (vars(unwrap(t.model)).get("forward") for t in (trainer, reference))
    assert getattr(head, "__code__", None) is getattr(their_head, "__code__", None)


@pytest.mark.torch_reference  # the path of a bf16 run on CPU, whose log-probs crashed in masked_scatter (issue 40)
def test_fast_grpo_bf16_matches_trl(tmp_path):
    # one step: a second rollout would follow updates that differ at bf16 precision, and greedy tokens with them
    reference, theirs = train(GRPOTrainer, grpo_args(tmp_path, max_steps=1))
    trainer, ours = train(FastGRPOTrainer, grpo_args(tmp_path, max_steps=1), options=ROLLOUTS_ONLY)
    assert "per-token log-probs: fastplug's fused LM head" in trainer.fast_kernels_summary
    assert len(ours.rollouts) == 1 and ours.rollouts == theirs.rollouts
    assert len(ours.log_probs) == len(theirs.log_probs) == 3
    for (log_probs, entropy), (their_log_probs, their_entropy) in zip(ours.log_probs, theirs.log_probs):
        assert log_probs.dtype == torch.float32 and rel_err(log_probs, their_log_probs) < 1e-2
        assert (entropy is None) == (their_entropy is None)
        assert entropy is None or (entropy.dtype == torch.float32 and rel_err(entropy, their_entropy) < 1e-2)
    for key in ("loss", "kl", "entropy", "reward"):
        assert rel_err(logged(trainer, key), logged(reference, key)) < 1e-2, key
    assert len(ours.grads) == 1 and ours.grads[0].abs().max() > 0 and rel_err(ours.grads[0], theirs.grads[0]) < 5e-2


def test_fast_rloo_matches_trl(tmp_path):
    def args():
        return RLOOConfig(
            output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=2,
            max_completion_length=5, learning_rate=5e-2, beta=0.1, generation_kwargs={"do_sample": False},
            logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True, bf16=True,
            disable_tqdm=True,
        )  # fmt: skip

    reference, theirs = train(RLOOTrainer, args())
    trainer, ours = train(FastRLOOTrainer, args(), options=ROLLOUTS_ONLY)
    assert "fast_generate" in trainer.fast_kernels_summary and ours.rollouts == theirs.rollouts
    # bf16 autocast (the kernels' path): fp32 log-probs, within bf16 precision of TRL's
    assert all(a[0].dtype == torch.float32 for a in ours.log_probs)
    assert all(rel_err(a[0], b[0]) < 1e-2 for a, b in zip(ours.log_probs, theirs.log_probs))
    assert rel_err(logged(trainer, "loss"), logged(reference, "loss")) < 1e-2
    assert rel_err(ours.grads[0], theirs.grads[0]) < 5e-2


def test_what_fast_paths_cannot_run_takes_trls_path_and_says_so_once(tmp_path, monkeypatch):
    from fastplug.patch import engine

    monkeypatch.setattr(engine, "_warned_model_types", set())  # said once per process: not yet, whatever ran before

    def build(model, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = FastGRPOTrainer(
                model=model, reward_funcs=reward, args=grpo_args(tmp_path, **kwargs.pop("args", {})),
                train_dataset=dataset(), processing_class=TOKENIZER,
                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), **kwargs,
            )  # fmt: skip
        messages = [str(w.message) for w in caught]
        return trainer, [m for m in messages if "take TRL's own path" in m], messages

    no_ngram = {"generation_kwargs": {"do_sample": False, "no_repeat_ngram_size": 2}}
    trainer, said, _ = build(tiny_llama(), args=no_ngram, options=ROLLOUTS_ONLY, fast_log_probs=False)
    assert "rollouts: TRL's own generation (generation settings fast_generate lacks: no_repeat_ngram_size=2)" in (
        trainer.fast_kernels_summary
    )
    assert "per-token log-probs: TRL's own (fast_log_probs=False)" in trainer.fast_kernels_summary
    assert len(said) == 2 and not trainer._undo_log_probs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()  # TRL's paths, a rollout per step
    assert trainer.state.global_step == 2
    assert not [w for w in caught if "take TRL's own path" in str(w.message)], "said once, at set-up"

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=64))
    trainer, said, messages = build(gpt2, options=ROLLOUTS_ONLY)
    assert any("not a supported family" in m for m in messages), "fastplug's own warning for unknown models"
    assert "rollouts: TRL's own generation (fast_generate supports the families" in trainer.fast_kernels_summary
    assert "per-token log-probs: TRL's own (model type 'gpt2' is not a family" in trainer.fast_kernels_summary
    assert len(said) == 2
    trainer.restore_fast_kernels()  # never trained: the patch made at set-up goes

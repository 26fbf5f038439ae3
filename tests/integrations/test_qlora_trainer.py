"""QLoRA in the real transformers.Trainer: a tiny Llama loaded in 4 bits (BitsAndBytesConfig NF4, double
quant, bf16 compute; bitsandbytes' CPU backend) with peft LoRA on every linear layer trains with
FastKernels() to the losses of the unpatched model with its 4-bit bases computed in float64 from their bytes
(bitsandbytes' CPU output is no reference: tests/test_bnb_layouts.py); the summary counts the 4-bit LoRA blocks
as fused; restore leaves the bitsandbytes modules as they were."""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import transformers  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from fastplug import FastKernels  # noqa: E402
from fastplug.patch.engine import active_handle  # noqa: E402
from tests.helpers import float64_bases  # noqa: E402
from tests.models.tiny import batch, tiny_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(path)
    return path


def _qlora_model(path):
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.bfloat16, device_map="cpu"
    )
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(model, lora)


def _dataset(n=8, tokens=10):
    data = batch(batch_size=n, tokens=tokens, seed=3)
    return [{k: v[i] for k, v in data.items()} for i in range(n)]


def _train(path, tmp_path, callbacks, float64: bool = False):
    model = float64_bases(_qlora_model(path)) if float64 else _qlora_model(path)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=5e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=callbacks)
    trainer.train()
    return model, torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


@pytest.mark.compat
def test_qlora_trainer_losses_match_unpatched(saved_llama, tmp_path):
    fast = FastKernels()
    model, losses = _train(saved_llama, tmp_path, [fast])
    _, ref_losses = _train(saved_llama, tmp_path, [], float64=True)

    assert len(losses) == 4 and torch.isfinite(losses).all()
    # the fused path dequantizes exactly and computes in the activations' fp32 (prepare_model_for_kbit_training),
    # the reference in float64: equal but for fp32 rounding (the Trainer logs losses rounded to 4 decimals)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-3, atol=0)
    assert losses[-1] < losses[0], "it learns"
    assert "lora_fused: 4" in fast.summary, fast.summary  # 2 attention + 2 MLP blocks on 4-bit bases
    assert "LoRA left unfused" not in fast.summary

    assert active_handle(model) is None
    layers = model.base_model.model.model.layers
    for layer in layers:
        for owner, name in ((layer.self_attn, "q_proj"), (layer.mlp, "gate_proj")):
            base = getattr(owner, name).base_layer
            assert type(base) is bnb.nn.Linear4bit and "forward" not in vars(base)
            assert base.weight.quant_state is not None and base.weight.dtype == torch.uint8

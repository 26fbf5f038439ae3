"""Preference tuning (DPO) with TRL and fastplug's kernels: `python examples/trl_dpo.py` (no arguments).

LoRA on a tiny Llama without a separate reference model: TRL's reference pass runs the policy with the
adapter disabled, which fastplug's fused LoRA honours. Nothing is downloaded; on a GPU the Triton kernels
run. The patch summary is printed when training starts, the losses after it.
"""

import tempfile

from trl_sft import char_tokenizer, common_args, tiny_llama  # the tiny model and tokenizer of the SFT example


def main():
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig

    from fastplug.integrations.trl import FastDPOTrainer

    tokenizer = char_tokenizer()
    numbers = range(128)
    pairs = {
        "prompt": [f"Is {i} even? Answer: " for i in numbers],
        "chosen": ["yes" if i % 2 == 0 else "no" for i in numbers],
        "rejected": ["no" if i % 2 == 0 else "yes" for i in numbers],
    }
    trainer = FastDPOTrainer(
        model=tiny_llama(tokenizer),
        args=DPOConfig(**common_args(tempfile.mkdtemp(prefix="fastplug_dpo_"))),
        train_dataset=Dataset.from_dict(pairs),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
    )
    trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print("losses:", losses)


if __name__ == "__main__":
    main()

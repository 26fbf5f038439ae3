"""A Lightning fit with fastplug's kernels: `python examples/lightning_fit.py` (no arguments).

`import fastplug` registers the "fastkernels" strategies in Lightning; the strategy patches the transformers
model inside the LightningModule (here a tiny Llama with LoRA, built locally) before training and restores
it afterwards. On a GPU the Triton kernels run, in bf16; on a CPU the kernels' torch reference path.
The strategy prints the patch summary at set-up; the losses are printed at the end.
"""

import lightning.pytorch as L
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import fastplug  # noqa: F401  (registers strategy="fastkernels", "fastkernels_ddp", "fastkernels_fsdp")

VOCAB, SEQ = 128, 128


class CausalLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=SEQ,
        )  # fmt: skip
        self.lm = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.lm(input_ids=batch, labels=batch).loss
        self.losses.append(round(loss.item(), 4))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW((p for p in self.parameters() if p.requires_grad), lr=2e-3)


def counting_sequences(n: int) -> torch.Tensor:
    """Rows of a + k*step (mod VOCAB): a pattern the model can learn in a few steps."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=generator)
    step = torch.randint(1, 4, (n, 1), generator=generator)
    return (start + step * torch.arange(SEQ)) % VOCAB


def main():
    module = CausalLM()
    trainer = L.Trainer(
        strategy="fastkernels",  # the device comes from the accelerator (a GPU when there is one)
        precision="bf16-mixed" if torch.cuda.is_available() else "32-true",
        max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(counting_sequences(160), batch_size=8))
    print("losses:", module.losses)


if __name__ == "__main__":
    main()

"""Host ms of the Trainer's four per-step walks of the module tree, nn.Module's own against fastplug's
(fastplug/patch/module_walks.py), on a Gemma2-2B-deep tree (26 layers, LoRA on every linear: 2,219 modules, what
the real model has) at small widths: the walks' cost is per module, not per element. No GPU needed.

    python scripts/module_walks_ms.py
"""

import time

import peft
import transformers

from fastplug.patch.module_walks import ModuleWalks


def _ms(fn, repeats: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _walks(model, base) -> dict:
    return {
        "model.train()": model.train,
        "list(model.parameters())": lambda: list(model.parameters()),
        "model.zero_grad()": model.zero_grad,
        "num_parameters(exclude_embeddings=True)": lambda: base.num_parameters(exclude_embeddings=True),
    }


def main() -> None:
    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=26, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=256,
    )  # fmt: skip
    model = peft.get_peft_model(
        transformers.Gemma2ForCausalLM(config), peft.LoraConfig(r=4, target_modules="all-linear")
    )
    base = model.get_base_model()
    print(f"{len(list(model.modules()))} modules, {len(list(model.parameters()))} parameters")
    own = {name: _ms(fn) for name, fn in _walks(model, base).items()}
    undo = ModuleWalks(model, base).install()
    try:
        fast = {name: _ms(fn) for name, fn in _walks(model, base).items()}
    finally:
        undo()
    print("| walk | nn.Module / transformers ms | fastplug ms |\n|---|---|---|")
    for name in own:
        print(f"| {name} | {own[name]:.2f} | {fast[name]:.2f} |")


if __name__ == "__main__":
    main()

"""Whatever the self-check can leave installed does no more work per training step than transformers' own
modules: a declined kind falls back to the original modules beside the patches that stay, and no mix of the two
may be slower than the unpatched model (a fallback that ran a per-expert loop, or merged LoRA into full weights
with no fused path, would show here as more operations).

Speed itself is measured on the GPU (`python -m fastplug.bench e2e`), never asserted in a test; what is counted
here is the host's work of a forward and backward on a tiny Gemma 4 MoE with LoRA on every linear layer and the
experts: each torch operator dispatched plus each Triton launch (one operation, however many torch calls the
interpreter makes to run it on CPU)."""

from torch.utils._python_dispatch import TorchDispatchMode

from fastplug.patch import self_check
from fastplug.patch.engine import patch_model
from tests.models.test_gemma4 import EXPERTS, _ids, gemma4

DECLINABLE = ("attention", "mlp", "experts_lora")


class _Work(TorchDispatchMode):
    """Torch operators dispatched and Triton launches made inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = self.launches = 0
        self._in_launch = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_launch:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter

        self._run = interpreter.InterpretedFunction.run
        work = self

        def counted(function, *args, **kwargs):
            work.launches += 1
            work._in_launch = True
            try:
                return work._run(function, *args, **kwargs)
            finally:
                work._in_launch = False

        interpreter.InterpretedFunction.run = counted
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime import interpreter

        interpreter.InterpretedFunction.run = self._run
        return super().__exit__(*exc)


def _step_work(model, ids) -> int:
    model.train()
    model.zero_grad(set_to_none=True)
    with _Work() as work:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return work.ops + work.launches


def test_what_the_self_check_leaves_does_no_more_work_than_transformers():
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", target_parameters=EXPERTS, init_lora_weights=False
    )
    model = get_peft_model(gemma4(moe=True), lora)
    ids = _ids(batch=1)
    _step_work(model, ids)  # first calls may set up caches
    transformers_work = _step_work(model, ids)
    work = {}
    for declined in [(), *((kind,) for kind in DECLINABLE), DECLINABLE]:
        handle = patch_model(model, gradient_checkpointing=False, self_check=False)
        try:
            for kind in declined:  # what the self-check does to a kind it declines
                self_check._decline(handle._records, kind)
            _step_work(model, ids)
            work["+".join(declined) or "nothing"] = _step_work(model, ids)
        finally:
            handle.restore()
    slower = {name: n for name, n in work.items() if n > transformers_work}
    assert not slower, f"operations per step with these kinds declined: {work}; transformers: {transformers_work}"
    # the count sees the patches: with every kind installed a step is 1,623 operations against transformers' 2,374
    assert work["nothing"] < 0.8 * transformers_work, (work, transformers_work)

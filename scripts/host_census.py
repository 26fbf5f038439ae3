"""Host work of one LoRA training step, counted per decoder layer on CPU: aten ops, Triton launches, Python
function calls and host syncs, for plain transformers and for fastplug.

On a lent GPU host the step of a thin-layered model is set by how fast Python issues it (issue 13): what it
costs is, roughly, (aten ops x ~15 µs) + (Triton launches x ~25 µs) + the Python around them. Those counts
do not need a GPU: the tiny models of the e2e bench run here under the Triton interpreter, a step of L and of
L + 1 layers is counted, and the difference is one layer's work (the rest is the step's fixed cost: embedding,
loss, optimizer). Work inside a Triton launch (the interpreter's own) is not counted; the launch is.

    TRITON_INTERPRET=1 python scripts/host_census.py [--models llama,gemma2] [--impls transformers,fastplug]
        [--top 15]

Prints per model and implementation: per-layer counts by phase (forward, backward with the recompute,
optimizer), the fixed cost, and the aten ops a layer issues most. Syncs (`.item()`, `nonzero`, ...) must be
zero per layer for fastplug: on a GPU each one stalls the host until the device catches up.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fastplug.bench.e2e import MODELS, apply_impl, build_model, token_batches  # noqa: E402

# aten ops that read a device value on the host (a sync on CUDA)
SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "is_nonzero",
    "equal",
    "item",
    "unique",
    "_unique2",
    "unique_consecutive",
    "masked_select",
    "nonzero_static",
}
PHASES = ("forward", "backward", "optimizer")


class _Census(TorchDispatchMode):
    """Counts aten ops (by name) or Python calls (the dispatch mode's own calls would swamp them: one step
    counts each), outside Triton launches, and the launches themselves."""

    def __init__(self, python: bool):
        super().__init__()
        self.python = python
        self.aten = collections.Counter()
        self.launches = collections.Counter()
        self.python_calls = 0
        self.functions = collections.Counter()  # "module.py:function" -> calls
        self._in_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_launch:
            self.aten[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))

    def _profile(self, frame, event, arg):
        if event == "call" and not self._in_launch:
            self.python_calls += 1
            code = frame.f_code
            self.functions[f"{os.path.basename(code.co_filename)}:{code.co_qualname}"] += 1

    @contextlib.contextmanager
    def counting(self):
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        census = self

        def run(fn, *args, **kwargs):
            if not census._in_launch:
                census.launches[getattr(fn.fn, "__name__", "kernel")] += 1
            census._in_launch += 1
            try:
                return original(fn, *args, **kwargs)
            finally:
                census._in_launch -= 1

        InterpretedFunction.run = run
        try:
            if self.python:
                sys.setprofile(self._profile)
                yield self
            else:
                with self:
                    yield self
        finally:
            sys.setprofile(None)
            InterpretedFunction.run = original

    def totals(self) -> dict:
        syncs = sum(n for name, n in self.aten.items() if name in SYNC_OPS)
        return dict(
            aten=sum(self.aten.values()), launches=sum(self.launches.values()), python=self.python_calls, syncs=syncs
        )


def count_step(model_name: str, impl: str, layers: int, steps_before: int = 2) -> dict[str, _Census]:
    """Two counted training steps, aten ops then Python calls (after `steps_before` uncounted ones), of the
    tiny preset with `layers` layers; per phase, one census holding both."""
    preset = MODELS[model_name]
    saved = preset["tiny"]
    preset["tiny"] = dict(saved, num_hidden_layers=layers)
    try:
        model = build_model(model_name, tiny=True, device=torch.device("cpu"), seed=0)
    finally:
        preset["tiny"] = saved
    model, _ = apply_impl(model, impl, checkpointing=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)  # the HF Trainer's default
    ids = token_batches(model.config.vocab_size, 2, 32, 1, seed=0, device=torch.device("cpu"))[0]
    aten = {phase: _Census(python=False) for phase in PHASES}
    python = {phase: _Census(python=True) for phase in PHASES}
    for step in range(steps_before + 2):
        counted = {steps_before: aten, steps_before + 1: python}.get(step)

        def phase(name):
            return counted[name].counting() if counted else contextlib.nullcontext()

        with phase("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for name in PHASES:
        aten[name].python_calls, aten[name].functions = python[name].python_calls, python[name].functions
    return aten


def _minus(a: collections.Counter, b: collections.Counter) -> collections.Counter:
    return collections.Counter({k: a[k] - b[k] for k in set(a) | set(b) if a[k] != b[k]})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gemma2")
    parser.add_argument("--impls", default="transformers,fastplug")
    parser.add_argument("--layers", type=int, default=2, help="L: the step of L+1 layers minus that of L")
    parser.add_argument("--top", type=int, default=12, help="aten ops listed per layer")
    parser.add_argument("--functions", type=int, default=0, help="Python functions listed per layer and phase")
    args = parser.parse_args(argv)
    rows = []
    for model_name in args.models.split(","):
        for impl in args.impls.split(","):
            small = count_step(model_name, impl, args.layers)
            large = count_step(model_name, impl, args.layers + 1)
            per_layer, fixed = {}, {}
            for phase in PHASES:
                one = {k: large[phase].totals()[k] - small[phase].totals()[k] for k in small[phase].totals()}
                per_layer[phase] = one
                fixed[phase] = {k: small[phase].totals()[k] - args.layers * v for k, v in one.items()}
            layer_ops = {p: _minus(large[p].aten, small[p].aten) for p in PHASES}
            layer_launches = sum((_minus(large[p].launches, small[p].launches) for p in PHASES), collections.Counter())
            layer_functions = {p: _minus(large[p].functions, small[p].functions) for p in PHASES}
            rows.append((model_name, impl, per_layer, fixed, layer_ops, layer_launches, layer_functions))
    print("\nper decoder layer, one training step (forward | backward incl. recompute | optimizer)")
    print(f"{'model':<10} {'impl':<13} {'aten ops':>20} {'Triton launches':>20} {'Python calls':>24} {'syncs':>12}")
    for model_name, impl, per_layer, fixed, *_ in rows:
        cells = ["/".join(str(per_layer[p][k]) for p in PHASES) for k in ("aten", "launches", "python", "syncs")]
        print(f"{model_name:<10} {impl:<13} {cells[0]:>20} {cells[1]:>20} {cells[2]:>24} {cells[3]:>12}")
    print("\nfixed cost of the step (everything but the layers), same columns")
    for model_name, impl, _, fixed, *_ in rows:
        cells = ["/".join(str(fixed[p][k]) for p in PHASES) for k in ("aten", "launches", "python", "syncs")]
        print(f"{model_name:<10} {impl:<13} {cells[0]:>20} {cells[1]:>20} {cells[2]:>24} {cells[3]:>12}")
    for model_name, impl, _, _, layer_ops, layer_launches, layer_functions in rows:
        print()
        for phase in PHASES[:2]:
            ops = ", ".join(f"{name} {n}" for name, n in layer_ops[phase].most_common(args.top))
            print(f"{model_name} / {impl}: a layer's aten ops in the {phase}: {ops}")
        kernels = ", ".join(f"{name} {n}" for name, n in layer_launches.most_common(args.top))
        if kernels:
            print(f"{model_name} / {impl}: a layer's Triton launches: {kernels}")
        for phase in PHASES[:2] if args.functions else ():
            calls = ", ".join(f"{name} {n}" for name, n in layer_functions[phase].most_common(args.functions))
            print(f"{model_name} / {impl}: a layer's Python calls in the {phase}: {calls}")


if __name__ == "__main__":
    main()

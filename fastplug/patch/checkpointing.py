"""Gradient checkpointing: the model's own (non-reentrant), or "offload": layer inputs parked in pinned
host memory.

`snapshot(model)` / `restore(snapshot)` put a model's checkpointing state back exactly, so patching stays
reversible. `enable(model, mode)` turns checkpointing on; with "offload" every decoder layer's
`_gradient_checkpointing_func` (an instance attribute transformers itself sets) becomes an `OffloadCheckpoint`;
with "auto" an `AutoCheckpointing` leaves as many layers unchecked as the GPU's memory holds.

In every mode the last decoder layer runs unchecked (`leave_last_layer_unchecked`): its recompute would be
the first thing backward does, right after the loss, so checkpointing it only repeats its forward. Its
activations then live through the loss instead of being rebuilt just after it, which is the same peak
wherever the layer's own backward needs more transient memory than the loss does.

How "offload" works: transformers calls `layer._gradient_checkpointing_func(partial(forward, layer, **kw),
hidden_states)`. The forward runs without autograd; its input is copied to pinned CPU memory on a side CUDA
stream (overlapping the next layer's compute) and the GPU copy is released. In backward the input comes
back (the previous layer's input is prefetched on the side stream meanwhile), the layer is recomputed with
grad enabled and backpropagated. Only the layer output of the last layer and the host copies stay alive.
The layer's trainable parameters are inputs of the offload node, which returns their gradients: DDP with
find_unused_parameters=True (the HF Trainer's default for a PeftModel) would otherwise mark them unused at the
end of forward and fail when the recompute's backward accumulated into them.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels import state
from ..models.structure import decoder_layers, decoder_stack

_FLAG, _FUNC = "gradient_checkpointing", "_gradient_checkpointing_func"
_AUTO = "_fastplug_auto_checkpointing"  # the model's AutoCheckpointing, an instance attribute
logger = logging.getLogger("fastplug")
_MISSING = object()


# --------------------------------------------------------------------------------------- state and restore
# Where enabling checkpointing keeps the hooks that make the embeddings' output require grad: transformers 5.17
# sets `_require_grads_hook`, 5.24 also a list `_require_grads_hooks` (the first kept under the old name).
_INPUT_GRADS_ATTRIBUTES = ("_require_grads_hook", "_require_grads_hooks")


@dataclass
class CheckpointingSnapshot:
    model: nn.Module
    attributes: list[tuple[nn.Module, str, Any]]  # (module, name, instance value or _MISSING)
    input_grads: dict[str, Any]  # the input-grads hook attributes as they were (or _MISSING)
    forward_hooks: set[int]  # the keys of every forward hook on the model's modules (unique in the process)


# The functions transformers' enable_input_require_grads and peft's fallback register on the input embeddings
_INPUT_GRADS_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


def snapshot(model: nn.Module) -> CheckpointingSnapshot:
    """The checkpointing state of every module of `model` (flags, functions, the input-grads hooks)."""
    attributes = [
        (module, name, vars(module).get(name, _MISSING))
        for module in model.modules()
        if hasattr(module, _FLAG)
        for name in (_FLAG, _FUNC)
    ]
    input_grads = {n: vars(model).get(n, _MISSING) for n in _INPUT_GRADS_ATTRIBUTES}
    forward_hooks = {key for module in model.modules() for key in module._forward_hooks}
    return CheckpointingSnapshot(model, attributes, input_grads, forward_hooks)


def restore(state: CheckpointingSnapshot) -> None:
    for module, name, value in state.attributes:
        if value is _MISSING:
            vars(module).pop(name, None)
        else:
            setattr(module, name, value)
    # Every input-grads hook added since the snapshot, not only those the attributes hold now: each enable (peft's
    # get_peft_model, for_training after for_inference) overwrites the attributes, orphaning the earlier hooks.
    for module in state.model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if key not in state.forward_hooks and getattr(hook, "__name__", None) in _INPUT_GRADS_HOOKS:
                for table in (
                    module._forward_hooks,
                    module._forward_hooks_with_kwargs,
                    module._forward_hooks_always_called,
                ):
                    table.pop(key, None)  # what RemovableHandle.remove() does, for a hook whose handle is lost
    for name in _INPUT_GRADS_ATTRIBUTES:  # the attributes back
        if state.input_grads[name] is _MISSING:
            vars(state.model).pop(name, None)
        else:
            vars(state.model)[name] = state.input_grads[name]


def is_enabled(model: nn.Module) -> bool:
    return any(getattr(m, _FLAG, False) is True for m in model.modules())


def disable(model: nn.Module) -> None:
    """Turn checkpointing off, an "auto" plan included: its hooks would set the layers' flags again at the next
    training forward."""
    plan = vars(model).get(_AUTO)
    if plan is not None:
        plan.remove()
    elif not is_enabled(model):
        return
    # transformers 5.23 name first (the older one warns there), then 5.17's
    off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    off()


def enable_native(model: nn.Module) -> None:
    """The model's own non-reentrant checkpointing (transformers 5.23 name first, then 5.17's)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def install_offload(model: nn.Module) -> int:
    """Make every checkpointed layer use one `OffloadCheckpoint`; returns how many. Needs CUDA, else 0 + warning."""
    if not torch.cuda.is_available():
        warnings.warn(
            "fastplug: gradient_checkpointing='offload' needs a CUDA device; using plain checkpointing instead",
            stacklevel=2,
        )
        return 0
    layers = [m for m in model.modules() if getattr(m, _FLAG, False) is True and hasattr(m, _FUNC)]
    offload = OffloadCheckpoint()
    for layer in layers:
        setattr(layer, _FUNC, offload)
    return len(layers)


def last_decoder_layer(model: nn.Module) -> nn.Module | None:
    layers = decoder_layers(decoder_stack(model)) or decoder_layers(model)
    return layers[-1] if layers else None


def leave_last_layer_unchecked(model: nn.Module) -> bool:
    """Turn checkpointing off on the last decoder layer (see the module docstring); False when the model has
    none. Call it after whatever turned checkpointing on (the Trainer enables it on every layer)."""
    last = last_decoder_layer(model)
    if last is not None:
        setattr(last, _FLAG, False)
    return last is not None


def apply_mode(model: nn.Module, mode) -> str:
    """Mode True or "offload" on a model whose layers checkpointing is on for: the last layer unchecked and,
    with "offload", the others' inputs parked on the host; returns words for summaries."""
    notes = []
    offloaded = mode == "offload" and install_offload(model)
    if mode == "offload":
        notes.append("layer inputs in pinned CPU memory" if offloaded else "offload needs CUDA")
    if leave_last_layer_unchecked(model):
        notes.append("the last layer unchecked")
    name = "offload" if offloaded else "non-reentrant"
    return f"{name} ({'; '.join(notes)})" if notes else name


def enable(model: nn.Module, mode, memory_budget: float = 0.9):
    """Turn checkpointing on (mode True, "offload" or "auto"); returns words for the patch summary, or for
    "auto" the AutoCheckpointing (its str is those words; `remove()` it before restoring a snapshot), which
    keeps the step's peak under `memory_budget` of the device's memory."""
    if not is_enabled(model):
        enable_native(model)
    if mode == "auto":  # one per model: enabling again (FastModel.for_training) keeps the measured plan
        return vars(model).get(_AUTO) or AutoCheckpointing(model, memory_budget)
    return f"on, {apply_mode(model, mode)}"


class TrainerCheckpointing:
    """The checkpointing mode of the options, on layers a trainer (HF Trainer, TRL) turned checkpointing on
    for: `apply_mode` for True and "offload", AutoCheckpointing for "auto". `reapply()` after the trainer
    turned it on again (TRL's DPO does around each reference pass); `undo()` puts the layers back as the
    trainer had set them."""

    def __init__(self, model: nn.Module, mode, memory_budget: float = 0.9):
        self.model, self.mode = model, mode
        self._snapshot = snapshot(model)
        # a plan FastModel made ("auto" too) serves the run, keeps what it measured and outlives the run
        existing = vars(model).get(_AUTO) if mode == "auto" else None
        self._owns_auto = existing is None
        self.auto = existing or (AutoCheckpointing(model, memory_budget) if mode == "auto" else None)
        self._words = apply_mode(model, mode) if self.auto is None else None
        self._last = last_decoder_layer(model) if self.auto is None else None
        # the layers install_offload gave its OffloadCheckpoint (none where offload fell back to plain)
        offload = getattr(self._last, _FUNC, None) if mode == "offload" else None
        self._offload = offload if isinstance(offload, OffloadCheckpoint) else None
        self._offloaded = [] if self._offload is None else [m for m in model.modules() if vars(m).get(_FUNC) is offload]
        if self.auto is not None:
            self.auto.reapply()

    def reapply(self) -> None:
        """Called at every training step: the mode goes on the layers found once (the offloaded ones get back the
        one `OffloadCheckpoint`, the last layer its flag), since walking a peft model's thousands of modules costs
        milliseconds of a step."""
        if self.auto is not None:
            self.auto.reapply()
            return
        for layer in self._offloaded:
            if getattr(layer, _FUNC, None) is not self._offload:
                setattr(layer, _FUNC, self._offload)
        if self._last is not None:
            setattr(self._last, _FLAG, False)

    def __str__(self) -> str:
        return str(self.auto) if self.auto is not None else self._words

    def undo(self) -> None:
        if self.auto is not None and self._owns_auto:
            self.auto.remove()
        restore(self._snapshot)


# ------------------------------------------------------------------------------------------------- auto
class AutoCheckpointing:
    """gradient_checkpointing="auto": recompute only as many decoder layers as memory needs.

    A 1B model at 4x2048 leaves most of an 80 GB GPU unused, yet full checkpointing recomputes every layer's
    forward (about a third more work per step). At the first training forward the first layer runs
    unchecked and what its saved activations take is measured (allocated bytes after its forward, minus its
    output, per token). After the first optimizer step (so that its states are allocated) the peak so far is
    the base: weights, optimizer states, checkpointed inputs, one layer's recompute, the loss, and the one
    measured layer. From then on as many more layers run unchecked as fit under `fraction` of the device's
    memory, for the tokens of each batch (all checkpointed when even the measured layer does not fit). The
    last layer is never checkpointed, as in the other modes. On CPU every other layer stays checkpointed."""

    def __init__(self, model: nn.Module, fraction: float = 0.9):
        self.layers = decoder_layers(model)
        self.fraction = fraction
        self.bytes_per_token = None  # one unchecked layer's saved activations, per token
        self.room = None  # bytes under the budget above the peak through the first optimizer step (which
        # had the measured layer unchecked); None until then
        self.unchecked = 0
        self.device = None
        self._measure = None  # [allocated before layer 0, tokens] while the first layer is being measured
        self._steps_at_measure = None
        state.ensure_optimizer_hook()  # the step counter below (fastplug.kernels.state)
        self._model = weakref.ref(model)
        vars(model)[_AUTO] = self
        self._hooks = [decoder_stack(model).register_forward_pre_hook(self._before_forward, with_kwargs=True)]
        self._set_unchecked(0)
        if self.layers:
            first = self.layers[0]
            self._hooks += [
                first.register_forward_pre_hook(self._layer_start),
                first.register_forward_hook(self._layer_end),
            ]

    def checkpointed(self) -> int:
        """How many layers run checkpointed now."""
        return sum(getattr(layer, _FLAG, False) is True for layer in self.layers)

    def __str__(self) -> str:
        n, checked = len(self.layers), self.checkpointed()
        if self.room is None:
            return f"auto: {checked} of {n} layers checkpointed until the first training step is measured"
        return (f"auto: {checked} of {n} layers checkpointed "
                f"({self.bytes_per_token / 2**10:.1f} KiB per token per unchecked layer)")  # fmt: skip

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        model = self._model()
        if model is not None and vars(model).get(_AUTO) is self:
            del vars(model)[_AUTO]

    def reapply(self) -> None:
        """Set the layers' flags to the current plan again (after something turned them all on)."""
        self._set_unchecked(self.unchecked)

    def _set_unchecked(self, k: int) -> None:
        """The first k layers unchecked, and the last one (see `leave_last_layer_unchecked`)."""
        self.unchecked = k
        for i, layer in enumerate(self.layers):
            layer.gradient_checkpointing = k <= i < len(self.layers) - 1

    def _before_forward(self, module, args, kwargs) -> None:
        if not (module.training and torch.is_grad_enabled()) or not self.layers:
            return
        tokens = _tokens(args, kwargs)
        if tokens is None:
            return
        if self.bytes_per_token is None:
            self.device = _first_device(module)
            if self.device is not None and self.device.type == "cuda":
                self._set_unchecked(1)  # measured in this forward
                self._measure = [None, tokens]
            return
        first_plan = self.room is None
        if first_plan:
            if state.optimizer_steps() == self._steps_at_measure:
                return  # states not allocated yet (gradient accumulation): keep the measured set-up
            _, total = torch.cuda.mem_get_info(self.device)
            self.room = self.fraction * total - torch.cuda.max_memory_allocated(self.device)
        self._set_unchecked(self.plan(tokens))
        if first_plan:
            logger.info("fastplug gradient checkpointing %s", self)

    def plan(self, tokens: int) -> int:
        """How many layers run unchecked for a batch of `tokens` tokens: the measured one, plus as many as
        fit in the room (none when the room is negative)."""
        per_layer = self.bytes_per_token * tokens
        if per_layer <= 0:
            return len(self.layers) if self.room >= 0 else 0
        return max(0, min(len(self.layers), 1 + math.floor(self.room / per_layer)))

    def _layer_start(self, module, args) -> None:
        if self._measure is not None and torch.is_grad_enabled():
            self._measure[0] = torch.cuda.memory_allocated(self.device)

    def _layer_end(self, module, args, output) -> None:
        if self._measure is None or self._measure[0] is None or not torch.is_grad_enabled():
            return
        before, tokens = self._measure
        self._measure = None
        out = output[0] if isinstance(output, tuple) else output
        grown = torch.cuda.memory_allocated(self.device) - before - out.numel() * out.element_size()
        self.bytes_per_token = max(grown, 0) / tokens
        self._steps_at_measure = state.optimizer_steps()


def _tokens(args, kwargs) -> int | None:
    for name in ("input_ids", "inputs_embeds"):
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor):
            return t.shape[:2].numel() if t.dim() >= 2 else t.numel()
    if args and isinstance(args[0], torch.Tensor):
        return args[0].shape[:2].numel()
    return None


def _first_device(module: nn.Module):
    p = next(module.parameters(), None)
    return None if p is None else p.device


# ---------------------------------------------------------------------------------------------- offload
class _Stash:
    """One layer input parked on the host, and its way back (on the side stream that parked it)."""

    __slots__ = ("host", "device", "stream", "stored", "fetched", "previous", "__weakref__")


def _no_stash() -> None:
    return None


class OffloadCheckpoint:
    """The `_gradient_checkpointing_func` of one model's offloaded layers (`install_offload`): a drop-in for
    transformers' checkpoint that keeps each layer's input in pinned host memory. Its state is its own and goes
    with the layers' function when checkpointing is restored: a side stream per device for the copies, and the
    input the layer before parked (the next backward's prefetch)."""

    def __init__(self):
        self._streams: dict[int, Any] = {}
        self._last = _no_stash  # weakref to the stash of the layer that ran before
        self._force_grad = torch.empty(0, requires_grad=True)  # outputs need a grad_fn even when no input does

    def __call__(self, function, *args, **kwargs):
        hidden = args[0] if args else None
        if (
            kwargs
            or not torch.is_grad_enabled()
            or not isinstance(hidden, torch.Tensor)
            or not hidden.is_floating_point()
        ):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)
        spec: dict = {}
        tensors = _OffloadedCheckpoint.apply(
            function, spec, self, self._force_grad, len(args) - 1, *args, *_trainable_parameters(function)
        )
        outputs = [None] * spec["n"]
        for i, t in zip(spec["tensor_at"], tensors):
            outputs[i] = t
        for i, o in spec["others"].items():
            outputs[i] = o
        return tuple(outputs) if spec["tuple"] else outputs[0]

    def _side_stream(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def park(self, x: torch.Tensor) -> _Stash:
        stash = _Stash()
        stash.device, stash.stream, stash.fetched, stash.stored = x.device, None, None, None
        if x.is_cuda:
            stream = stash.stream = self._side_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))  # x is complete before the copy reads it
            with torch.cuda.stream(stream):
                stash.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                stash.host.copy_(x, non_blocking=True)
                stash.stored = torch.cuda.Event()
                stash.stored.record(stream)
            x.record_stream(stream)  # the allocator must not reuse x's memory before the copy is done
        else:  # CPU tensors (tests): nothing to move, a copy keeps the semantics
            stash.host = x.detach().clone()
        stash.previous, self._last = self._last, weakref.ref(stash)
        return stash


def _prefetch(stash: _Stash) -> None:
    if stash.fetched is not None or not stash.device.type == "cuda":
        return
    with torch.cuda.stream(stash.stream):
        stash.stream.wait_event(stash.stored)
        gpu = stash.host.to(stash.device, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record(stash.stream)
    stash.fetched = (gpu, arrived)


def _fetch(stash: _Stash) -> torch.Tensor:
    if stash.device.type != "cuda":
        return stash.host
    _prefetch(stash)
    gpu, arrived = stash.fetched
    current = torch.cuda.current_stream(stash.device)
    current.wait_event(arrived)
    gpu.record_stream(current)  # allocated on the side stream, used on this one
    previous = stash.previous()
    if previous is not None:  # the next backward needs the previous layer's input: start its copy now
        _prefetch(previous)
    return gpu


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, spec, offload, force_grad, n_args, hidden, *args_and_params):
        device_type = hidden.device.type
        args, ctx.params = args_and_params[:n_args], args_and_params[n_args:]
        ctx.run, ctx.args = run, args
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        with torch.no_grad():
            outputs = run(hidden, *args)
        ctx.stash = offload.park(hidden)
        spec["tuple"] = isinstance(outputs, tuple)
        outputs = outputs if spec["tuple"] else (outputs,)
        spec["tensor_at"] = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)]
        spec["others"] = {i: o for i, o in enumerate(outputs) if not isinstance(o, torch.Tensor)}
        spec["n"] = len(outputs)
        return tuple(outputs[i] for i in spec["tensor_at"])

    @staticmethod
    def backward(ctx, *grads):
        hidden = _fetch(ctx.stash).detach().requires_grad_(ctx.needs_input_grad[5])
        ctx.stash = None
        args = [
            a.detach().requires_grad_(needs) if isinstance(a, torch.Tensor) else a
            for a, needs in zip(ctx.args, ctx.needs_input_grad[6:])
        ]
        device_type, autocast_on, autocast_dtype = ctx.autocast
        devices = [hidden.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                outputs = ctx.run(hidden, *args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip((o for o in outputs if isinstance(o, torch.Tensor)), grads)
            if g is not None and o.requires_grad
        ]
        wanted = [t for t in (hidden, *args, *ctx.params) if isinstance(t, torch.Tensor) and t.requires_grad]
        found = {}
        if pairs and wanted:
            outs, outs_grads = zip(*pairs)
            if ctx.params:  # the parameters' gradients leave through this node (see the module docstring)
                found = dict(zip(map(id, wanted), torch.autograd.grad(outs, wanted, outs_grads, allow_unused=True)))
            else:  # the recompute's backward accumulates into the parameters
                torch.autograd.backward(outs, outs_grads)
                found = {id(t): t.grad for t in wanted}

        def grad(t):
            return found.get(id(t)) if isinstance(t, torch.Tensor) else None

        return (None, None, None, None, None, grad(hidden), *map(grad, args), *map(grad, ctx.params))


def _trainable_parameters(function) -> list:
    """The trainable parameters of the layer that `function` runs: transformers passes partial(forward, layer)
    (5.23) or partial(layer.__call__) (5.17, where FSDP2's parameters are still sharded DTensors here)."""
    layer = getattr(getattr(function, "func", None), "__self__", None)
    if not isinstance(layer, nn.Module):
        args = getattr(function, "args", ())
        layer = args[0] if args and isinstance(args[0], nn.Module) else None
    params = [p for p in layer.parameters() if p.requires_grad] if layer is not None else []
    # the recompute then gathers other tensors than these: its backward accumulates into those itself
    return params if all(type(p.data) is torch.Tensor for p in params) else []

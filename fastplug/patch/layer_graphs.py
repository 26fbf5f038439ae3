"""CUDA graphs of the decoder layers (`cuda_graphs`, on by default): each layer's forward and backward replayed
as one graph each, instead of issued op by op from Python.

Why: a LoRA step of a 1B model is ~100 ms of GPU work that the host takes 1.3-2x as long to issue (dozens of
kernels, autograd nodes and Python frames per layer); a replay costs the host a few microseconds.

How: the layers' class is swapped, on these instances only, for a subclass whose `__call__` routes a call to
the graphs when it can (restore() swaps it back). The first time the stack's first layer sees a call signature
(the tensors' shapes, dtypes and strides, every other argument's value, which layers are checkpointed) the stack
runs eagerly and each layer's own signature is recorded (`_Record`: its arguments, its tensors' layouts); the
second time, every layer is captured with its own recorded inputs, sharing one memory pool, in the order they
run (forwards first to last, then backwards last to first), and from then on each layer call whose signature
matches its record is a replay. A stack whose layers all take inputs alike (Llama's, Qwen's, Gemma2's) captures
a new shape at its first sighting, every layer's record inferred from layer 0's and an earlier shape's records
(`_inferred_records`): its second shape already, where varied lengths may repeat one only many steps later:
- the layer's checkpointing, when on, is inside its graphs: the forward graph keeps only the inputs, the
  backward graph recomputes; memory as without graphs, plus each layer's output and input-gradient buffers.
- layer k's input is layer k-1's output buffer, so the hidden states are not copied. The other tensor inputs
  (position embeddings, a mask, Gemma 4's per-layer inputs) go through static buffers that the layers share: a
  replay copies its own inputs in when the buffers hold another's (the rotary tables and masks of another layer
  type, another layer's per-layer input), in the forward and again before the backward, which reads them (its
  recompute, or tensors the forward saved). A mapping argument (Gemma 4's store of shared keys and values)
  is keyed by its type: what a layer's capture stores there becomes an extra output of its graph, and a later
  layer that reads it (KV sharing) takes those buffers as extra inputs and gives back their gradients; a replay
  puts its stores in the caller's mapping, for the layers that read them, replayed or eager.
- fused LoRA casts and stacks the adapters inside the graphs (it caches nothing while a stream is captured:
  `lora.casts.adapters_cacheable`), so a replay reads the parameters as the optimizer left them; parameter
  gradients come out as fresh tensors (one foreach copy), so gradient accumulation adds to them rather than to
  a buffer the next replay overwrites.
Under FSDP2 (`fully_shard` per layer) the layers replay inside its hooks (`call_within_hooks`): the graphs read
static parameters that each replay fills from what the hooks gathered, forward and backward, and the replay hands
the gathered parameters their gradients, for FSDP2's reduce-scatter.
Under torch.compile the layers stay out of the compiled graphs (a graph break at each; the embedding, final norm
and loss are compiled) and replay their CUDA graphs as in eager mode.
Memory: the captured shapes' hidden states share one arena (`_Arena`); by default (`cuda_graphs=None`) a shape is
captured only while the graphs' predicted keep stays within `graphs_memory` times the peak an eager step of it
would reach (`_eager_peak`); `cuda_graphs=True` has no cap.
Eager instead (the same numbers, the usual speed): inference or no grad, packed rows (the caller passed
position_ids or cu_seq_lens), a tensor off the GPU, hooks on a layer other than fastplug's and FSDP2's, dropout,
"offload" checkpointing, a signature beyond the first `max_signatures` (four without a memory cap, sixteen with
one) or beyond the memory cap, a layer whose previous replay still awaits its backward (two forwards before one
backward), a capture that failed (a warning says why; that signature stays eager). Parameters re-pointed, frozen
or unfrozen, peft adapters disabled, switched or merged, hooks or modules added since the capture (`_Fixed`): the
graphs are dropped and the stack is captured afresh.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Mapping
from functools import partial

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from ..models.fast_attention import DOCUMENT_BOUNDS, rows_unpacked
from ..models.rules import is_fsdp

# Two of the reasons `LayerGraphs.eager` counts forwards by (bench varlen tells a step's host cost by them)
CAPTURING = "inside this stack's capture"
FIRST_SIGHTING = "a batch shape seen for the first time (captured when it repeats)"
_EAGER = object()
_FAILED = object()
_GRAPHS = "_fastplug_layer_graphs"  # the layer's instance attribute: (its LayerGraphs, its index in the stack)
_SUBCLASSES: dict[type, type] = {}
_SCALARS = (bool, int, float, str, type(None), torch.dtype)
_FUNC, _MISSING = "_gradient_checkpointing_func", object()


def why_not(decoder: nn.Module | None, layers: list[nn.Module], placed: bool) -> str | None:
    """Why `layers` (the decoder stack `decoder`'s, in call order) cannot run through CUDA graphs; None: they can.
    placed: the layers must be on a CUDA device already (the default's test; asked for, the graphs wait for a
    move)."""
    if decoder is None or not layers:
        return "no decoder layers"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if placed and not any(p.is_cuda for layer in layers for p in layer.parameters()):
        return "the model is not on a CUDA device"
    if any(isinstance(m, nn.Dropout) and m.p > 0 for layer in layers for m in layer.modules()) or any(
        getattr(getattr(layer, "self_attn", None), "attention_dropout", 0) for layer in layers
    ):
        return "dropout in the layers (random numbers inside graphs are not supported here)"
    return None


class LayerGraphs:
    """The graphs of one decoder stack, per call signature."""

    def __init__(
        self,
        decoder: nn.Module,
        layers: list[nn.Module],
        max_signatures: int | None = None,
        memory_cap: float | None = None,
    ):
        self.layers = layers
        # memory_cap: what the graphs may keep beyond the first capture's, as a fraction of the peak an eager step of
        # the shape to capture would reach (None: no cap; `_eager_peak`). The first capture (the arena and the
        # pool's temporaries, about what an eager step allocates) is bounded by the free memory only; each later
        # shape adds its graphs' buffers, and their sum is what the cap bounds. Before each capture its cost is
        # predicted (`_fits`). Without a cap, four shapes at most; with one, sixteen.
        self.memory_cap = memory_cap
        self.max_signatures = max_signatures or (4 if memory_cap is None else 16)
        self._cap_bytes: int | None = None  # the cap at the last capture's decision
        self._static_bytes: int | None = None  # allocated when the stack's first training forward began
        self._largest_eager = 0  # the most hidden-state elements a forward that ran eagerly had
        # (peak allocated, _largest_eager) at the first capture: the eager steps' peak and the shape it came from
        self._eager_base: tuple[int, int] | None = None
        self.kept = 0  # bytes the graphs keep: the arena and the memory pool
        self._first_kept = 0  # what they kept after the first capture
        self._growths: list[tuple[int, int]] = []  # (hidden-state elements, pool bytes added) per capture
        self._held = 0  # pool bytes the first capture's graphs hold beyond their temporaries (gradient buffers)
        self._arena: _Arena | None = None  # the hidden states of every captured shape, one at a time
        self._warmed = False  # one capture ran: later ones need no warm-up (lazy initialisation is done)
        # Whether a new shape may be captured at its first sighting, its layers' inputs inferred from layer 0's
        # (`_inferred_records`); off for good once an inference was wrong or such a capture failed
        self._infer = True
        self._refused = False  # a shape was refused for memory (`_fits`) since the graphs were last dropped
        self._inferred: set[tuple] = set()  # signatures captured from inferred records
        self._misfits: set[tuple] = set()  # of those, the ones a later layer's inputs did not match
        self.sets: dict[tuple, list | object] = {}  # signature -> [_LayerGraph per layer] or _FAILED
        # signature -> what each layer took at the signature's first sighting ({layer index: _Record})
        self.seen: dict[tuple, dict[int, _Record]] = {}
        self._recording: dict[int, _Record] | None = None  # the records of this forward, a first sighting
        self._forward = None  # the graphs layer 0 replayed in this forward: the later layers replay theirs
        # Whether the rows of the decoder stack's forward now running are known to need no host work to tell
        # their documents apart (set by its pre-hook, taken by layer 0): not packed, or packed by fastplug with
        # their document bounds. Rows a caller packed (position_ids, cu_seq_lens) cost the attention a host sync.
        self._rows_known: bool | None = None
        self._decoder_hook = decoder.register_forward_pre_hook(self._note_rows, with_kwargs=True)
        self._removed: str | None = None  # what __str__ said when remove() freed the graphs
        self.replays = 0
        self.capturing = False  # while this stack's layers are warmed up and captured
        self.eager: Counter = Counter()  # per forward of the stack: "replayed", or why its layers ran eagerly
        # One memory pool for all signatures: what one leaves free (its layers' temporaries) another uses. Safe
        # while no two signatures' replays interleave, i.e. one awaits its backward when another would run. A new
        # one once every graph of the old is dropped (`_drop_graphs`): torch frees a pool with its last graph, and
        # a capture into a freed pool fails an allocator assertion.
        self._pool = None
        self._last = None  # the graphs that ran last
        self._fixed = _Fixed([])  # what the graphs in `sets` took as fixed when they were captured
        self._statics: dict[tuple, torch.Tensor] = {}  # FSDP2 units' static parameters (`_param_statics`)
        for index, layer in enumerate(layers):
            vars(layer)[_GRAPHS] = (self, index)
            layer.__class__ = _graphed_subclass(type(layer), traced_when_compiled=memory_cap is not None)

    def remove(self) -> None:
        self._removed = str(self)
        self._decoder_hook.remove()
        self._fixed.close()
        self.seen.clear()
        self._inferred.clear()
        self._misfits.clear()
        self._recording = self._forward = self._last = self._arena = None
        self._statics.clear()
        for layer in self.layers:
            vars(layer).pop(_GRAPHS, None)
            if type(layer) in _SUBCLASSES.values():
                layer.__class__ = type(layer).__bases__[0]
        self.sets.clear()

    def __str__(self) -> str:
        if self._removed is not None:
            return self._removed
        captured = sum(1 for s in self.sets.values() if s is not _FAILED)
        failed = len(self.sets) - captured
        paths = "; ".join(f"{why}: {n}" for why, n in self.eager.most_common())
        cap = f" of at most {(self._first_kept + self._cap_bytes) / 2**30:.2f}" if self._cap_bytes is not None else ""
        return (
            f"CUDA graphs of {len(self.layers)} decoder layers: {captured} call signature(s) captured"
            + (f", {failed} failed (eager)" if failed else "")
            + (f", keeping {self.kept / 2**30:.2f}{cap} GiB" if self.sets else "")
            + f", {self.replays} layer calls replayed"
            + (f"; forwards by path: {paths}" if paths else "")
        )

    # -- what a batch may be padded on to (models/padding.RowLengths)
    def replayed_lengths(self, rows: int) -> set[int]:
        """The sequence lengths of the captured shapes of `rows` rows (their hidden states, the first layer's first
        argument: rows x length x width)."""
        shapes = (key[1][0] for key, graphs in self.sets.items() if graphs is not _FAILED)
        return {shape[1] for shape in shapes if len(shape) == 3 and shape[0] == rows}

    def may_capture(self) -> bool:
        """Whether a new shape may still be captured: fewer than `max_signatures`, and none refused for memory since
        the graphs were last dropped."""
        return len(self.sets) < self.max_signatures and not self._refused

    # -- routing
    def _note_rows(self, decoder, args, kwargs) -> None:
        self._rows_known = kwargs.get(DOCUMENT_BOUNDS) is not None or rows_unpacked(args, kwargs)

    def call_within_hooks(self, layer: nn.Module, index: int, args: tuple, kwargs: dict, eager_call):
        """A call of a layer that FSDP2's `fully_shard` made a unit: its hooks run as for any call (the pre-forward
        gathers the parameters, the post-forward frees them and hooks the backward's gather), and inside them the
        layer replays its graphs, or runs eagerly through `eager_call` (its class's `__call__`, checkpointing
        included) with the hooks that already ran set aside."""

        def forward(*args, **kwargs):
            vars(layer).pop("forward", None)
            out = self.call(layer, index, args, kwargs)
            if out is not _EAGER:
                return out
            with _hooks_set_aside([layer]):
                return eager_call(*args, **kwargs)

        vars(layer)["forward"] = forward  # what nn.Module's call runs between the hooks
        try:
            return nn.Module.__call__(layer, *args, **kwargs)
        finally:
            vars(layer).pop("forward", None)

    def call(self, layer: nn.Module, index: int, args: tuple, kwargs: dict):
        """The layer's output from its graphs, or _EAGER (the first layer's reason tallied in `eager`)."""
        graphs = self._route(layer, index, args, kwargs)
        if index == 0:
            self.eager[graphs if isinstance(graphs, str) else "replayed"] += 1
        return _EAGER if isinstance(graphs, str) else graphs

    def _route(self, layer: nn.Module, index: int, args: tuple, kwargs: dict):
        """The layer's output from its graphs, or why it runs eagerly."""
        rows_known = None
        if index == 0 and not self.capturing:
            # a new forward of the stack: what the last one recorded or replayed is not this one's, whichever
            # reason stops layer 0 below (the later layers follow layer 0's graphs or records only)
            rows_known, self._rows_known = self._rows_known, None
            self._forward = self._recording = None
        if not (layer.training and torch.is_grad_enabled()):
            return "inference or no grad"
        if self.capturing:  # the warm-up and the capture call the layers: they run as they are
            return CAPTURING
        if index == 0 and self._static_bytes is None and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            self._static_bytes = torch.cuda.memory_allocated(args[0].device)  # weights, their states: `_eager_peak`
        if index == 0 and not rows_known:
            return "rows the caller may have packed (position_ids or cu_seq_lens passed)"
        if not args or not isinstance(args[0], torch.Tensor) or _foreign_hooks(layer, fsdp_allowed=True):
            return "hooks on a layer, or hidden states not passed first"
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors, key = [], [spec]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if not leaf.is_cuda:
                    return "a tensor off the GPU"
                # whether the hidden states need a gradient is the layer's business (layer 0's input often
                # does not, the others' do): checked against the graph below, not part of the signature
                key.append((leaf.shape, leaf.stride(), leaf.dtype, bool(tensors) and leaf.requires_grad))
                tensors.append(leaf)
            elif isinstance(leaf, _SCALARS):
                key.append((type(leaf), leaf))
            elif isinstance(leaf, Mapping):  # a store shared with later layers: see _CaptureMapping
                key.append((type(leaf), "mapping"))
            else:
                return f"an argument of type {type(leaf).__name__}"
        key.append(tuple(getattr(l, "gradient_checkpointing", False) for l in self.layers))
        key.append(torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))
        key = tuple(key)
        if index != 0:
            if self._recording is not None:  # the stack's first sighting: each layer's own inputs, for the capture
                self._recording[index] = _Record(key, leaves, spec, tensors, _gathered_params(layer))
                return FIRST_SIGHTING
            graphs = self._forward
            if graphs is None:
                return "its stack's first layer ran eagerly"
            if graphs[index].key != key:
                if graphs[0].key in self._inferred:  # the stack is not uniform after all: recorded at the next sighting
                    self._infer = False
                    self._misfits.add(graphs[0].key)
                return "inputs unlike those it was captured with"
        else:
            if self.sets and not self._fixed.holds():
                self._drop_graphs()  # parameters re-pointed, (un)frozen, adapters switched, hooks added: capture afresh
                self.sets.clear()
                self.seen.clear()
                self._inferred.clear()
                self._misfits.clear()
            if key in self._misfits:  # captured from wrongly inferred records: forgotten, recorded afresh
                self._misfits.discard(key)
                self.sets.pop(key, None)
                self.seen.pop(key, None)
            graphs = self.sets.get(key)
            if graphs is None:
                inferred = False
                if len(self.seen.get(key, ())) != len(self.layers):
                    records = self._inferred_records(key, leaves, spec, tensors)
                    if records is None:
                        # first sighting (or one whose forward stopped before the last layer): eager, its layers'
                        # inputs recorded, captured next time
                        return self._first_sighting(layer, key, leaves, spec, tensors)
                    self.seen[key], inferred = records, True
                if len(self.sets) >= self.max_signatures:
                    return f"a batch shape beyond the first {self.max_signatures} captured"
                if not self._capturable():
                    return "checkpointing other than plain, or hooks inside the layers"
                if self._last is not None and any(g.awaiting_backward() for g in self._last):
                    return "another shape's replay awaits its backward (they share the memory pool)"
                slot = self._arena_plan(tensors[0])
                if slot is None:
                    self._refused = True
                    return "a batch shape beyond the graphs' memory cap (graphs_memory)"
                if not self.sets:
                    self._fixed.close()
                    self._fixed = _Fixed(self.layers)
                records = [self.seen[key][i] for i in range(len(self.layers))]
                untimed = _untimed_moe_launches()
                graphs = self.sets[key] = self._capture(records, tensors, slot, inferred)
                if inferred:
                    # A failed capture may need an eager run first (off for good: warned), and MoE launches at a row
                    # bucket far from any tuned one took an untimed config: either way the shape runs eagerly now
                    # (which times them) and is captured when it repeats.
                    if graphs is _FAILED or _untimed_moe_launches() != untimed:
                        self._infer = self._infer and graphs is not _FAILED
                        del self.sets[key]
                        return self._first_sighting(layer, key, leaves, spec, tensors)
                    self._inferred.add(key)
            if graphs is _FAILED:
                return "its capture failed (warned)"
        graph = graphs[index]
        if tensors[0].requires_grad and not graph.inputs[0].requires_grad:
            return "captured for an input that needed no gradient"
        if graphs is not self._last and self._last is not None and any(g.awaiting_backward() for g in self._last):
            return "another shape's replay awaits its backward (they share the memory pool)"
        if graph.awaiting_backward():
            return "two forwards before one backward"
        mapping = next((leaf for leaf in leaves if isinstance(leaf, Mapping)), None)
        reads = []
        if graph.read_keys:  # another layer's stores, as its replay or its eager run left them in the mapping
            if any(key not in mapping for key in graph.read_keys):
                return "an entry another layer stores is missing from the mapping argument"
            reads = pytree.tree_leaves([mapping[key] for key in graph.read_keys])
            static = graph.inputs[len(graph.inputs) - graph.reads :]
            if [(t.shape, t.dtype) for t in reads] != [(t.shape, t.dtype) for t in static]:
                return "stored entries unlike those it was captured with"
        self._last = graphs
        if index == 0:
            self._forward = graphs
        self.replays += 1
        output, stored = graph.run(tensors + reads)
        for key, value in stored.items():  # for the layers that read them, replayed or eager
            mapping[key] = value
        return output

    def _first_sighting(self, layer: nn.Module, key: tuple, leaves: list, spec, tensors: list[torch.Tensor]) -> str:
        """Layer 0's call of a shape that runs eagerly now and is recorded (each layer's inputs, for its capture
        when it repeats); FIRST_SIGHTING."""
        self._largest_eager = max(self._largest_eager, tensors[0].numel())
        self.seen[key] = self._recording = {0: _Record(key, leaves, spec, tensors, _gathered_params(layer))}
        return FIRST_SIGHTING

    def _inferred_records(self, key: tuple, leaves: list, spec, tensors: list[torch.Tensor]) -> dict | None:
        """Every layer's record for a shape first seen now, inferred from layer 0's: where every layer of a shape
        seen before (captured or not) took inputs like layer 0's (same structure and layouts: Llama's, Qwen's,
        Gemma2's stacks; not Gemma 4's, whose global layers take wider rotary tables) and `key` differs from that
        shape's only in its tensors' shapes and strides. Capturing it now saves the eager step a first sighting
        costs: the stack's second shape is captured, not its first repeat, which data of varied lengths may bring
        many steps later. After the first capture it needs no warm-up: the kernels do not specialise on the batch
        length, and what they cache is made outside the capture (`kernels.state`). A later layer whose inputs prove
        the inference wrong runs eagerly, and the shape is recorded at its next sighting (`_misfits`). None: record
        it eagerly."""
        if not self._infer:
            return None
        for other, records in self.seen.items():
            if self.sets.get(other) is _FAILED or other in self._misfits or not _alike(other, key):
                continue
            if len(records) == len(self.layers) and all(r.key == other for r in records.values()):
                return {i: _Record(key, leaves, spec, tensors, r.params) for i, r in records.items()}
        return None

    def _capturable(self) -> bool:
        for layer in self.layers:
            if getattr(layer, "gradient_checkpointing", False) and not _is_plain_checkpoint(layer):
                return False
            if any(_foreign_hooks(m, fsdp_allowed=m is layer) for m in layer.modules()):
                return False
        return True

    # -- capture
    def _arena_plan(self, hidden: torch.Tensor) -> int | None:
        """The arena's slot size (elements) for a capture of hidden states like `hidden`, or None when the capture
        would not fit (`_fits`). A new arena takes room for longer rows where that fits (each shape seen with its
        sequence length rounded up to a power of two): a longer batch later then finds its slot, where a new arena
        would drop every graph captured in the old one (captured again, one step each, at their next sighting).
        The first arena of data whose shapes vary (two seen) takes room for rows twice as long where that fits: it
        is sized from a step or two, and on `bench varlen`'s documents a new arena at Gemma2's ninth step sent
        two re-captures into the measured steps."""
        rooms = (2, 1, 0) if self._arena is None and len(self.seen) > 1 else (1, 0)
        for room in rooms:
            numel = self._arena_numel(hidden, room)
            if self._fits(hidden, numel):
                return numel
        return None

    def _fits(self, hidden: torch.Tensor, slot: int) -> bool:
        """Whether capturing for hidden states like `hidden`, in an arena of `slot` elements a slot if it needs a
        new one, keeps the graphs within the memory cap, and within half of what the device has free (a default
        must not turn a run that fits into one that does not). Its cost is the arena's growth (`_Arena`) and the
        pool's (`_pool_growth`)."""
        if self.memory_cap is None:
            return True
        device = hidden.device
        self._cap_bytes = int(self.memory_cap * self._eager_peak(hidden))
        cost = self._arena_growth(hidden, slot) + self._pool_growth(hidden)
        if self._warmed and self.kept - self._first_kept + cost > self._cap_bytes:
            return False
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return cost <= (torch.cuda.mem_get_info(device)[0] + cached) / 2

    def _eager_peak(self, hidden: torch.Tensor) -> float:
        """The peak an eager step of hidden states like `hidden` would reach, what the memory cap is a fraction of:
        the peak allocated before the first capture, or where `hidden` is larger than the largest eager forward
        then, that peak's part above the weights (`_static_bytes`: activations, temporaries) scaled with the
        hidden states' size. Captured at the stack's second shape, the first capture may follow one short batch:
        the graphs of a longer one are still bounded by what an eager step of theirs would take."""
        if self._eager_base is None:
            peak = torch.cuda.max_memory_allocated(hidden.device)
            self._eager_base = (peak, self._largest_eager or hidden.numel())
        peak, numel = self._eager_base
        static = min(self._static_bytes or 0, peak)
        return max(peak, static + (peak - static) * hidden.numel() / numel)

    def _pool_growth(self, hidden: torch.Tensor) -> float:
        """The pool's predicted growth for a capture of hidden states like `hidden`. The first capture fills the
        pool with its layers' temporaries, which are free between replays, so a shape no larger than one captured
        reuses them and adds what its graphs hold (their gradient buffers: the largest growth of such a capture,
        or what the first holds until one ran). A larger shape needs larger temporaries: predicted at the largest
        growth per hidden-state element so far. Before any capture, one hidden-state buffer."""
        numel = hidden.numel()
        if not self._growths:
            return numel * hidden.element_size()
        if numel > max(n for n, _ in self._growths):
            return numel * max(added / n for n, added in self._growths)
        later = [added for n, added in self._growths[1:] if n <= numel]
        return max(later) if later else self._held

    def _arena_numel(self, hidden: torch.Tensor, room: int = 0) -> int:
        """A slot's size for an arena that must hold `hidden`: the largest hidden states of this dtype seen so far
        (their shapes are in the signatures' keys), so that a later, larger shape does not need a new arena; room
        for longer rows (`_slot_numel`): 1, each sequence length rounded up to a power of two; 2, twice that."""
        shapes = [hidden.shape, *(key[1][0] for key in self.seen if key[1][2] == hidden.dtype)]
        return max(_slot_numel(shape, room) for shape in shapes)

    def _arena_growth(self, hidden: torch.Tensor, slot: int) -> int:
        """The bytes a capture of `hidden`'s shape adds to the arena: none if it holds the shape, else a new arena
        of `slot` elements a slot in place of the old."""
        if self._arena is not None and self._arena.holds(hidden):
            return 0
        new = _Arena.slots_for(len(self.layers)) * slot * hidden.element_size()
        return new - (self._arena.nbytes if self._arena is not None else 0)

    def _drop_graphs(self) -> None:
        """Forget every captured graph (failed signatures stay failed), and with them their memory pool."""
        self.sets = {key: graphs for key, graphs in self.sets.items() if graphs is _FAILED}
        self._last = self._forward = self._pool = None
        self._refused = False

    def _capture(self, records: list["_Record"], tensors: list[torch.Tensor], slot: int, inferred: bool = False):
        """slot: a new arena's slot size (`_arena_plan`), if this shape needs one; inferred: the records are
        `_inferred_records`' (the shape's first sighting)."""
        hidden = tensors[0]
        if self._arena is None or not self._arena.holds(hidden):
            # the captured shapes' graphs write the old arena: they go (captured again at their next sighting)
            self._drop_graphs()
            self._arena = None  # the old arena's bytes go first, so the two are never held at once
            self._arena = _Arena(len(self.layers), slot, hidden)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        before = _pool_bytes(self._pool)
        graphs = self._capture_graphs(records, tensors, self._arena, inferred)
        after = _pool_bytes(self._pool)
        statics = sum(t.numel() * t.element_size() for t in self._statics.values())
        self.kept = self._arena.nbytes + after + statics
        if graphs is not _FAILED:
            self._growths.append((hidden.numel(), max(after - before, 0)))
            if not self._warmed:
                self._held = sum(graph.held_bytes() for graph in graphs)
                self._first_kept = self.kept
            self._warmed = True
        return graphs

    def _param_statics(self, record: "_Record", device: torch.device) -> list[torch.Tensor] | None:
        """The static parameters an FSDP2 unit's graphs read (`record.params`), one per name, shape and dtype,
        shared by the layers and the captured shapes: FSDP2 gathers a unit's parameters into new memory at each
        forward and backward, and a replay copies them in first (`_Replay`). None for other layers."""
        if record.params is None:
            return None
        statics = []
        for name, shape, dtype, trains, plain in record.params:
            if not plain:
                raise RuntimeError(f"the gathered parameter {name} is a DTensor (tensor parallelism)")
            static = self._statics.get((name, shape, dtype, trains))
            if static is None:
                static = torch.zeros(shape, dtype=dtype, device=device).requires_grad_(trains)
                self._statics[(name, shape, dtype, trains)] = static
            statics.append(static)
        return statics

    def _capture_graphs(
        self, records: list["_Record"], tensors: list[torch.Tensor], arena: "_Arena", inferred: bool = False
    ):
        """records: each layer's inputs at the first sighting (or inferred from layer 0's now); tensors: layer
        0's now."""
        pool = self._pool
        # The inputs besides the hidden states go through static buffers that the layers share, one per argument
        # position and layout (Gemma 4's global layers take wider rotary tables than its sliding ones). A buffer
        # starts with layer 0's tensor where that fits, else zeros: replays copy each layer's own tensors in.
        # One that needs a gradient (Gemma 4's per-layer inputs when the embeddings' output does) gets it.
        statics: dict[tuple, torch.Tensor] = {}
        sources: dict[int, tuple] = {}  # id(buffer) -> (weakref, version) of what it last received
        graphs = []
        for layer, record in zip(self.layers, records):
            shared = []
            for position, layout in enumerate(record.layouts):
                buffer = statics.get((position, layout))
                if buffer is None:
                    first = tensors[1 + position] if 1 + position < len(tensors) else None
                    if first is not None and _layout(first) == layout:
                        buffer = first.detach().clone()
                    else:
                        buffer = torch.empty_strided(layout[0], layout[1], dtype=layout[2], device=tensors[0].device)
                        buffer.zero_()
                    buffer = statics[(position, layout)] = buffer.requires_grad_(layout[3])
                shared.append(buffer)
            graphs.append(_LayerGraph(layer, record, shared, sources, self._param_statics(record, tensors[0].device)))
        try:
            self.capturing = True
            # FSDP2's hooks stay out of the capture, and its units hold their static parameters throughout: the
            # checkpointed layers' recompute, in the backward's warm-up and capture, reads the module's own
            with (
                _no_autocast_cache(),
                _hooks_set_aside([layer for layer in self.layers if is_fsdp(layer)]),
                _static_parameters(graphs),
            ):
                hidden = arena.slot(0, tensors[0])
                with torch.no_grad():
                    hidden.copy_(tensors[0])
                hidden.requires_grad_(tensors[0].requires_grad)
                warm_store, store = {}, {}  # what layers store in a mapping argument for later ones (KV sharing)
                # The first capture warms up on a side stream (lazy initialisation of the capture's own path).
                # A later one needs none: the capture's path ran at the first capture, the kernels do not
                # specialise on the batch length, and MoE launches at new rows borrow a tuned config (or ran
                # eagerly at the shape's first sighting); a warm-up would cost an unoverlapped eager step.
                if not self._warmed:
                    for graph in graphs:
                        graph.warm_up(hidden, warm_store)
                for index, graph in enumerate(graphs):
                    hidden = graph.capture_forward(hidden, pool, store, arena.slot(1 + index, hidden))
                # Input gradients alternate between two buffers: layer k's is read by layer k-1's backward only,
                # and layer k-2 may then overwrite it (the last layer's output gradient is copied into one).
                buffers = [arena.slot(len(graphs) + 1, hidden), arena.slot(len(graphs) + 2, hidden)]
                grad = buffers[len(graphs) % 2]
                for index in reversed(range(len(graphs))):
                    grad = graphs[index].capture_backward(grad, buffers[index % 2], pool)
        except Exception as error:  # a host sync or an unsupported op in a layer: this signature stays eager
            if inferred:
                what = (
                    "at a batch shape's first sighting failed; each new shape now runs eagerly once and is "
                    "captured when it repeats"
                )
            else:
                what = "failed, running them eagerly for this batch shape"
            warnings.warn(
                f"fastplug: CUDA graph capture of the decoder layers {what}: {type(error).__name__}: {error}",
                stacklevel=4,
            )
            return _FAILED
        finally:
            self.capturing = False
        return graphs


class _LayerGraph:
    """One layer's forward and backward graphs and the buffers they read and write."""

    def __init__(
        self,
        layer: nn.Module,
        record: "_Record",
        shared: list[torch.Tensor],
        sources: dict,
        statics: list[torch.Tensor] | None = None,
    ):
        self.layer = layer
        self.key, self.leaves, self.spec = record.key, record.leaves, record.spec
        self.inputs: list[torch.Tensor] = [None, *shared]  # static inputs; [0] (the hidden states) set at capture
        self.sources = sources
        # statics: an FSDP2 unit's (`_param_statics`): its graphs read those, and a replay copies in the parameters
        # the unit's hooks gathered, found where FSDP2 puts them (`slots`: the submodule and name of each)
        self.statics = statics
        self.slots: list[tuple[nn.Module, str]] = []
        self.trains: list[bool] = []  # per slot, whether it trains
        if statics is not None:
            self.params = None  # the gathered parameters: read at each call (`run`)
            # the unit holds its statics throughout the capture (`_static_parameters`); the trained ones are what
            # the backward differentiates
            self.aliases = {}
            for (name, *_, trains, _plain), static in zip(record.params, statics):
                prefix, _, leaf = name.rpartition(".")
                self.slots.append((layer.get_submodule(prefix), leaf))
                self.trains.append(trains)
                if trains:
                    self.aliases[name] = static
        else:
            trained = [(name, p) for name, p in layer.named_parameters() if p.requires_grad]
            self.params = [p for _, p in trained]
            # The graphs see the trained parameters through fresh leaves on the same storage (the optimizer's
            # updates show in every replay): a parameter's own gradient accumulator, kept alive by an earlier
            # step's graph, belongs to the default stream, and autograd would sync with it in mid-capture (which
            # voids it).
            self.aliases = {name: p.detach().requires_grad_() for name, p in trained}
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # outputs: what the backward differentiates (the hidden states as copied into the arena's slot; dropped
        # after its capture); returned: what a replay returns, the same as leaves
        self.outputs = self.out_spec = None
        self.returned: list[torch.Tensor] = []
        self.layer_outputs = 0  # how many of `returned` are the layer's own; the rest are what it stored
        self.stores: list[tuple] = []  # (key, spec, count) of each entry it stored in the mapping argument
        self.read_keys: list = []  # the entries of the mapping argument it reads (another layer's stores)
        self.reads = 0  # how many of `inputs` (the last ones) are those entries' tensors
        self.grad_outputs: list = []
        self.grad_inputs: list = []  # per static input: its gradient buffer or None
        self.grad_params: list = []
        self._pending = None  # weakref to the _Token of the last replay

    def _call(self, tensors, mapping: "Mapping | None" = None):
        if sum(isinstance(leaf, Mapping) for leaf in self.leaves) > 1:
            raise RuntimeError("a layer takes more than one mapping argument")
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten(
            [next(it) if leaf is _TENSOR else mapping if isinstance(leaf, Mapping) else leaf for leaf in self.leaves],
            self.spec,
        )
        return torch.func.functional_call(self.layer, self.aliases, tuple(args), kwargs, strict=False)

    def _mapping(self, store: dict) -> "Mapping | None":
        kind = next((type(leaf) for leaf in self.leaves if isinstance(leaf, Mapping)), None)
        return None if kind is None else _capture_mapping(kind, store)

    def _differentiable(self, outputs, reads=()):
        wrt = [t for t in self.inputs if t.requires_grad] + [t for t in reads if t.requires_grad]
        return [o for o in outputs if o.requires_grad], wrt + list(self.aliases.values())

    def warm_up(self, hidden: torch.Tensor, store: dict) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.inputs[0] = hidden
            with _checkpointing_for_capture(self.layer):
                for _ in range(2):
                    mapping = self._mapping(store)
                    outputs = pytree.tree_leaves(self._call(self.inputs, mapping))
                    stored = pytree.tree_leaves(mapping.stored) if mapping is not None else []
                    reads = pytree.tree_leaves([store[key] for key in mapping.read]) if mapping is not None else []
                    grads_of, wrt = self._differentiable(outputs + stored, reads)
                    if grads_of:
                        torch.autograd.grad(grads_of, wrt, [torch.ones_like(o) for o in grads_of], allow_unused=True)
            if mapping is not None:
                store.update(_aliases(mapping.stored))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def capture_forward(self, hidden: torch.Tensor, pool, store: dict, into: torch.Tensor) -> torch.Tensor:
        """store: what earlier layers' graphs stored in the mapping argument, as leaves on their output buffers;
        this layer's reads become inputs of its graph (its backward gives their gradients) and its stores outputs.
        into: the arena's slot for its output hidden states, which the graph copies there; returns it as a leaf
        (the next layer's input, no further copy)."""
        self.inputs[0] = hidden
        mapping = self._mapping(store)
        with _checkpointing_for_capture(self.layer), torch.cuda.graph(self.fwd, pool=pool):
            leaves, self.out_spec = pytree.tree_flatten(self._call(self.inputs, mapping))
            if leaves[0].shape != into.shape or leaves[0].dtype != into.dtype:
                raise RuntimeError(f"a layer's output {tuple(leaves[0].shape)} is not shaped as its input")
            # with grad: the slot takes the output's place in the autograd graph (the backward differentiates it),
            # and the output's own bytes go back to the pool now, for the next layer's capture
            into.copy_(leaves[0])
        self.outputs = [into, *leaves[1:]]
        del leaves
        self.returned = [into.detach().requires_grad_(into.requires_grad), *self.outputs[1:]]
        self.layer_outputs = len(self.outputs)
        if mapping is not None:
            for key, value in mapping.stored.items():
                leaves, spec = pytree.tree_flatten(value)
                self.stores.append((key, spec, len(leaves)))
                self.outputs += leaves
                self.returned += leaves
            store.update(_aliases(mapping.stored))
            self.read_keys = list(mapping.read)
            reads = pytree.tree_leaves([store[key] for key in self.read_keys])
            self.inputs += reads
            self.reads = len(reads)
        return self.returned[0]

    def capture_backward(self, grad_of_output: torch.Tensor, into: torch.Tensor, pool) -> torch.Tensor:
        """grad_of_output: where the output's gradient arrives (the next layer's `into`); into: where the input's
        gradient goes. Returns `into`."""
        self.grad_outputs = [
            None if not o.requires_grad else grad_of_output if i == 0 else torch.empty_like(o)
            for i, o in enumerate(self.outputs)
        ]
        grads_of, wrt = self._differentiable(self.outputs)
        grads = [None] * len(wrt)
        if grads_of:
            with torch.cuda.graph(self.bwd, pool=pool):
                grads = list(
                    torch.autograd.grad(
                        grads_of, wrt, [g for g in self.grad_outputs if g is not None], allow_unused=True
                    )
                )
                if self.inputs[0].requires_grad:
                    with torch.no_grad():
                        into.copy_(grads[0])
                    grads[0] = into
        it = iter(grads)
        self.grad_inputs = [next(it) if t.requires_grad else None for t in self.inputs]
        self.grad_params = list(it)
        self.outputs = None  # the forward's autograd graph, now captured
        return into

    def held_bytes(self) -> int:
        """The bytes of the pool's tensors these graphs hold between replays: gradient buffers and stores."""
        held = [*self.grad_params, *self.grad_inputs[1:], *self.returned[1:]]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    # -- replay
    def awaiting_backward(self) -> bool:
        token = self._pending() if self._pending is not None else None
        return token is not None and not token.done

    def run(self, tensors: list[torch.Tensor]) -> tuple:
        """The layer's output and what it stored in the mapping argument ({key: value}), from a replay."""
        params = self.params if self.statics is None else [m._parameters[name] for m, name in self.slots]
        outputs = _Replay.apply(self, *tensors, *params)
        stored, at = {}, self.layer_outputs
        for key, spec, count in self.stores:
            stored[key] = pytree.tree_unflatten(list(outputs[at : at + count]), spec)
            at += count
        return pytree.tree_unflatten(list(outputs[: self.layer_outputs]), self.out_spec), stored


class _Token:
    """Alive as long as a replay's autograd node; `done` once its backward ran."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: _LayerGraph, *tensors):
        if graph.inputs[0].data_ptr() != tensors[0].data_ptr():
            graph.inputs[0].copy_(tensors[0])
        shared = tensors[1 : len(graph.inputs)]
        _load_shared(graph, shared)
        ctx.params = None
        if graph.statics is not None:  # an FSDP2 unit's parameters as its hooks gathered them for this forward
            ctx.params = tensors[len(graph.inputs) :]
            torch._foreach_copy_(graph.statics, ctx.params)
        graph.fwd.replay()
        ctx.graph, ctx.token, ctx.shared = graph, _Token(), shared
        graph._pending = weakref.ref(ctx.token)
        return tuple(o.detach() for o in graph.returned)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        graph = ctx.graph
        ctx.token.done = True
        _load_shared(graph, ctx.shared)  # later layers' forwards may have put theirs in the shared buffers
        if ctx.params is not None:  # gathered again by FSDP2's pre-backward hook (the forward's copy is overwritten)
            torch._foreach_copy_(graph.statics, ctx.params)
        for static, g in zip(graph.grad_outputs, grads):
            if static is not None and static.data_ptr() != g.data_ptr():
                static.copy_(g)
        graph.bwd.replay()
        present = [g for g in graph.grad_params if g is not None]
        fresh = iter(torch._foreach_mul(present, 1.0) if present else [])  # one launch, not one per parameter
        param_grads = [None if g is None else next(fresh) for g in graph.grad_params]
        if graph.statics is not None:  # every gathered parameter came in; the trained ones get gradients
            trained = iter(param_grads)
            param_grads = [next(trained) if trains else None for trains in graph.trains]
        return None, *(None if g is None else g.detach() for g in graph.grad_inputs), *param_grads


def _load_shared(graph: _LayerGraph, tensors) -> None:
    """Put this layer's inputs besides the hidden states into the buffers the layers share, where these hold
    another tensor (or this one changed in place since)."""
    for static, t in zip(graph.inputs[1:], tensors):
        last = graph.sources.get(id(static))
        if static.data_ptr() == t.data_ptr() or (last is not None and last[0]() is t and last[1] == t._version):
            continue
        static.copy_(t)
        graph.sources[id(static)] = (weakref.ref(t), t._version)


class _Arena:
    """The hidden states of every captured shape: layer 0's input, each layer's output (the next one's input, and
    what its checkpointed backward recomputes from) and the two input-gradient buffers, one slot each, sized for
    the largest shape. Replays of two shapes never interleave (one awaits its backward when another would run),
    so the shapes share these bytes instead of each keeping its own (Llama-1B at 4 x 4096 tokens: 1 GiB a shape,
    most of what a capture keeps)."""

    @staticmethod
    def slots_for(layers: int) -> int:
        return layers + 3

    def __init__(self, layers: int, numel: int, like: torch.Tensor):
        self.numel = numel
        self.buffer = torch.empty(self.slots_for(layers) * numel, dtype=like.dtype, device=like.device)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()

    def holds(self, hidden: torch.Tensor) -> bool:
        return (
            hidden.numel() <= self.numel and hidden.dtype == self.buffer.dtype and hidden.device == self.buffer.device
        )

    def slot(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Slot `index` as a contiguous tensor shaped as `like` on the arena's storage: not a view, so autograd
        relates no slot to another (views of one base, some made in no-grad mode by the replays' detach, would
        make autograd refuse the captures' in-place writes to the others)."""
        slot = torch.empty(0, dtype=self.buffer.dtype, device=self.buffer.device)
        strides = torch.empty(like.shape, device="meta").stride()
        with torch.no_grad():
            return slot.set_(self.buffer.untyped_storage(), index * self.numel, like.shape, strides)


def _slot_numel(shape, room: int) -> int:
    """Elements of hidden states shaped `shape`, with room for longer rows: 0, none; 1, the sequence length (the
    second-last dimension) rounded up to a power of two, the longest of the bucketed lengths (models/padding.py)
    up to it; 2, the power of two at or above twice the length."""
    numel = math.prod(shape)
    if not room or len(shape) < 2 or shape[-2] < 1:
        return numel
    return numel // shape[-2] * (1 << (room * shape[-2] - 1).bit_length())


def _pool_bytes(pool: tuple) -> int:
    """The device memory held by one graph memory pool: a capture's cost is its growth. Not the device's reserved
    total, nor all pools': torch.cuda.graph collects garbage and empties the allocator's cache on entry, which
    can free other memory (another model's graphs) during the capture."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool)


_TENSOR = object()  # a tensor's place among a _Record's leaves


def _untimed_moe_launches() -> int:
    """How many MoE launches took an untimed config so far (`kernels.moe.tuning.UNTIMED`; 0 before any MoE ran)."""
    tuning = sys.modules.get("fastplug.kernels.moe.tuning")
    return sum(tuning.UNTIMED.values()) if tuning is not None else 0


def _alike(a: tuple, b: tuple) -> bool:
    """Whether two signatures differ at most in their tensors' shapes and strides."""
    return len(a) == len(b) and all(
        x == y or (_is_tensor_entry(x) and _is_tensor_entry(y) and x[2:] == y[2:]) for x, y in zip(a, b)
    )


def _is_tensor_entry(entry) -> bool:
    return isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[0], torch.Size)


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)


class _Record:
    """What one layer took at a signature's first sighting: its signature, its arguments with each tensor's
    place marked (the tensors themselves are not kept) and the layouts of its tensors besides the hidden states."""

    __slots__ = ("key", "leaves", "spec", "layouts", "params")

    def __init__(self, key: tuple, leaves: list, spec, tensors: list[torch.Tensor], params: list | None = None):
        self.key, self.spec = key, spec
        self.params = params  # an FSDP2 unit's gathered parameters (`_gathered_params`), else None
        # a mapping argument by its type only: what the eager layers stored in it must not be kept alive
        self.leaves = [
            _TENSOR if isinstance(leaf, torch.Tensor) else type(leaf)() if isinstance(leaf, Mapping) else leaf
            for leaf in leaves
        ]
        self.layouts = [_layout(t) for t in tensors[1:]]


class _Fixed:
    """What captured graphs take as fixed, checked at each forward (~0.2 ms for a 1B LoRA model): every
    parameter's storage and whether it trains (`model.to()` re-points `.data`), each peft LoRA layer's adapter
    state (a replay would not see `disable_adapter()` or `set_adapter`), how many hooks the modules have (a
    replay would skip one added later, e.g. transformers' output recorders), and, through torch's registration
    hooks, no parameter or submodule assigned on them since (an adapter injected, a weight replaced)."""

    def __init__(self, layers: list[nn.Module]):
        modules = [m for layer in layers for m in layer.modules()]
        sharded = {id(m) for layer in layers if is_fsdp(layer) for m in layer.modules()}
        self.params = [
            (p, p.data_ptr(), p.requires_grad)
            for m in modules
            if id(m) not in sharded
            for p in m._parameters.values()
            if p is not None
        ]
        # FSDP2 units' parameters: FSDP2 swaps them (sharded, gathered) at every forward and backward, and their
        # graphs read copies of what it gathered; whether each trains is what a replay takes as fixed
        self.sharded = [
            (m, name, p.requires_grad)
            for m in modules
            if id(m) in sharded
            for name, p in m._parameters.items()
            if p is not None
        ]
        self.hook_dicts = [
            d
            for m in modules
            for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
        ]
        self.hooks = sum(map(len, self.hook_dicts))
        tuner = sys.modules.get("peft.tuners.tuners_utils")
        self.tuners = [m for m in modules if tuner is not None and isinstance(m, tuner.BaseTunerLayer)]
        self.adapters = self._adapters()
        self.changed = False
        ids, this = {id(m) for m in modules}, weakref.ref(self)  # the process-wide hooks must not keep the model

        def registered(module, name, value):
            fixed = this()
            if fixed is not None and id(module) in ids:
                fixed.changed = True

        self._handles = (
            [
                register_module_parameter_registration_hook(registered),
                register_module_module_registration_hook(registered),
            ]
            if modules
            else []
        )
        self._finalizer = weakref.finalize(self, _remove_handles, self._handles)

    def _adapters(self) -> list:
        # peft's attributes behind its `disable_adapters` / `active_adapters` properties (those cost 4x more)
        return [(m._disable_adapters, m._active_adapter, list(m.merged_adapters)) for m in self.tuners]

    def holds(self) -> bool:
        if self.changed or sum(map(len, self.hook_dicts)) != self.hooks:
            return False
        for p, ptr, trains in self.params:
            if p.data_ptr() != ptr or p.requires_grad != trains:
                return False
        for m, name, trains in self.sharded:
            p = m._parameters.get(name)
            if p is None or p.requires_grad != trains:
                return False
        return self._adapters() == self.adapters

    def close(self) -> None:
        self._finalizer()


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()


# ----------------------------------------------------------------------------------------------- helpers
_CAPTURE_MAPPINGS: dict[type, type] = {}


def _capture_mapping(kind: type, store: dict) -> Mapping:
    """An empty mapping of the argument's type for one layer's warm-up or capture (Gemma 4's store of shared keys
    and values): what the layer stores goes to `.stored` (the graph's extra outputs), and what it reads comes
    from `store`, the earlier layers' stores in this capture, and is listed in `.read` (its graph's extra
    inputs). A key no earlier layer stored raises KeyError, as the eager model would."""
    cls = _CAPTURE_MAPPINGS.get(kind)
    if cls is None:

        def __init__(self, store):
            kind.__init__(self)
            self._store, self.stored, self.read = store, {}, []

        def __getitem__(self, key):
            if key in self.stored:
                return self.stored[key]
            value = self._store[key]
            if key not in self.read:
                self.read.append(key)
            return value

        def get(self, key, default=None):
            return self[key] if key in self else default

        def __contains__(self, key):
            return key in self.stored or key in self._store

        def __setitem__(self, key, value):
            self.stored[key] = value

        def iterate(self, *args, **kwargs):
            raise RuntimeError("a layer iterates over a mapping argument shared between layers")

        methods = dict(__init__=__init__, __getitem__=__getitem__, get=get, __contains__=__contains__)
        methods.update(__setitem__=__setitem__, keys=iterate, values=iterate, items=iterate, __iter__=iterate)
        cls = _CAPTURE_MAPPINGS[kind] = type(f"Capture{kind.__name__}", (kind,), methods)
    return cls(store)


def _aliases(stored: dict) -> dict:
    """Stored entries as the layers that read them take them: leaves on the same buffers, needing a gradient
    where the stored tensor does (the reader's backward graph then gives it)."""
    return {
        key: pytree.tree_map(lambda t: t.detach().requires_grad_(t.requires_grad), value)
        for key, value in stored.items()
    }


def _graphed_subclass(cls: type, traced_when_compiled: bool) -> type:
    """The layers' class with a `__call__` that replays their graphs. Under torch.compile either the layer is
    traced as its own class would be (traced_when_compiled: the default's graphs, so that a compiled model keeps
    its whole graph) or it is a graph break that replays (cuda_graphs=True: the embedding, final norm and loss
    compile; compiling the layers would add little to a replay, fastplug's layers being its kernels)."""
    sub = _SUBCLASSES.get((cls, traced_when_compiled))
    if sub is None:

        @torch.compiler.disable
        def replayed_or_eager(self, args, kwargs):
            entry = vars(self).get(_GRAPHS)
            if entry is not None and not entry[0].capturing and is_fsdp(self):
                return entry[0].call_within_hooks(self, entry[1], args, kwargs, super(sub, self).__call__)
            out = _EAGER if entry is None else entry[0].call(self, entry[1], args, kwargs)
            return super(sub, self).__call__(*args, **kwargs) if out is _EAGER else out

        if traced_when_compiled:

            def __call__(self, *args, **kwargs):
                if torch.compiler.is_compiling():
                    return super(sub, self).__call__(*args, **kwargs)
                return replayed_or_eager(self, args, kwargs)

        else:

            def __call__(self, *args, **kwargs):
                return replayed_or_eager(self, args, kwargs)

        sub = _SUBCLASSES[(cls, traced_when_compiled)] = type(
            cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return sub


@contextlib.contextmanager
def _checkpointing_for_capture(layer: nn.Module):
    """The layer's checkpointing, if on, as non-reentrant checkpoint that saves no RNG state (no dropout runs,
    and a generator's state may not be read while capturing); the layer's own function back afterwards."""
    own = vars(layer).get(_FUNC, _MISSING)
    if getattr(layer, "gradient_checkpointing", False):
        vars(layer)[_FUNC] = partial(checkpoint, use_reentrant=False, preserve_rng_state=False)
    try:
        yield
    finally:
        if own is _MISSING:
            vars(layer).pop(_FUNC, None)
        else:
            vars(layer)[_FUNC] = own


def _is_plain_checkpoint(layer) -> bool:
    """torch's checkpoint (either kind: the graphs recompute the same), not "offload"'s."""
    func = getattr(layer, _FUNC, None)
    return isinstance(func, partial) and func.func is checkpoint


def _foreign_hooks(module: nn.Module, fsdp_allowed: bool = False) -> bool:
    """Hooks a replay would skip: any but fastplug's own (auto checkpointing measures layer 0 at step one), and
    FSDP2's where `fsdp_allowed` (a replay runs inside them: `LayerGraphs.call_within_hooks`)."""
    hooks = [
        *module._forward_hooks.values(),
        *module._forward_pre_hooks.values(),
        *module._backward_hooks.values(),
        *module._backward_pre_hooks.values(),
    ]
    owners = ("fastplug.", "torch.distributed.fsdp.") if fsdp_allowed else ("fastplug.",)
    return any(not type(getattr(h, "__self__", None)).__module__.startswith(owners) for h in hooks)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _hooks_set_aside(modules: list[nn.Module]):
    """The modules' hooks out of the way while their call runs without them: FSDP2's, whose gathers must not run
    inside a capture, nor twice in one call (a layer's eager call inside the hooks that already ran), and any
    other that already ran for the call. Put back in their order afterwards."""
    saved = [(getattr(m, name), dict(getattr(m, name))) for m in modules for name in _HOOK_DICTS]
    for hooks, _ in saved:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, own in saved:
            hooks.update(own)


@contextlib.contextmanager
def _static_parameters(graphs: list["_LayerGraph"]):
    """FSDP2 units' parameters swapped for their graphs' statics (FSDP2's own put back afterwards), in place as
    torch.func.functional_call swaps them."""
    swapped = []
    try:
        for graph in graphs:
            for (module, name), static in zip(graph.slots, graph.statics or ()):
                swapped.append((module, name, module._parameters[name]))
                module._parameters[name] = static
        yield
    finally:
        for module, name, own in reversed(swapped):
            module._parameters[name] = own


def _gathered_params(layer: nn.Module) -> list[tuple] | None:
    """An FSDP2 unit's parameters as its forward sees them, gathered: (name, shape, dtype, whether it trains,
    whether it is a plain tensor) each; None for any other layer (its graphs read its parameters in place)."""
    if not is_fsdp(layer):
        return None
    return [
        (name, tuple(p.shape), p.dtype, p.requires_grad, type(p.data) is torch.Tensor)
        for name, p in layer.named_parameters()
    ]


@contextlib.contextmanager
def _no_autocast_cache():
    """Autocast's cached weight casts would be made once at capture and never again: cast in the graphs."""
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)

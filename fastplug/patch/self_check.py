"""The patch-time self-check: each kind of patch is shown equal to the original modules on the user's own model
before it is kept.

transformers changes its modules every month (5.24 renamed the attention's cache argument, and a patched
attention silently stopped filling the KV cache). So `patch_model` does not assume that a module computes
what it computed last release: it runs a few random tokens through the first decoder layers and the LM head,
once with the patches and once with the original modules, and compares

- the training loss (labels given, train mode: the fused LM-head loss) and the gradients of the first layer's
  input and of its trainable parameters (LoRA included: the adapters' B, zero in a fresh peft model, is given
  random values for the check and put back bit for bit, so the fused LoRA forward is exercised);
- the prompt's logits and one cached decode step's logits (eval mode, no grad: what `generate()` runs).

Dropout is off during the check and the user's RNG is untouched (the tokens come from a private generator).
A kind of patch whose addition makes the two disagree by more than the model dtype's bound, on two different
batches, is judged against a float64 run of the original modules: kept when it is about as close to float64 as the
original is (the original may be the one off: a random-init MoE's routing ties in bf16), else taken off again
everywhere and reported; the original modules keep running.

The model is truncated to as many leading decoder layers as it takes to meet every variant of every patch
(a kind and the path it takes) and every layer type of the config (sliding/full, linear/full attention), at
most MAX_LAYERS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from ..versions import installed_version

TOKENS = 8  # prompt tokens; one more is decoded from the cache
MAX_LAYERS = 8
SEEDS = (1234, 4321)  # a kind is declined only when it disagrees on both batches (MoE routing near-ties)

# Relative difference ||patched - original|| / ||original|| allowed between two correct implementations in the
# model's dtype, for the forward quantities (loss, logits); gradients, which sum more rounded terms, get
# GRADIENT_FACTOR times as much. Seen on the ten families' tiny models with LoRA (CPU interpreter, which
# truncates bf16 casts where a GPU rounds) and at Llama-1B/8B widths (scripts/self_check_gpu.py): correct
# patches differ by < 1e-5 in fp32 and by up to 6e-2 in bf16 LoRA gradients; a changed computation differs far
# more (the unfilled KV cache: 0.56 in the logits; Llama's norm computed as Gemma's: ~1).
BOUNDS = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 6e-2}
GRADIENT_FACTOR = 2.5
TF32_BOUND = 5e-3  # fp32 models on CUDA with TF32 matmuls allowed (the Trainer's tf32=True)
# A gradient whose norm is below NEGLIGIBLE x the largest gradient's of the same run is measured against that floor,
# not its own norm: an exact zero (OPT's and BERT's key bias, which softmax ignores) comes out as rounding noise
# (1e-10 in fp32 against gradients of ~1), which two correct implementations round differently (relative ~1).
NEGLIGIBLE = 1e-4
# Past the bound, a patch is kept when its error against float64 is at most FLOAT64_FACTOR x the original modules'
# own error against float64 (or within the bound of float64).
FLOAT64_FACTOR = 1.5


def bound_for(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return TF32_BOUND
    return BOUNDS.get(dtype, BOUNDS[torch.float32])


def versions() -> str:
    """The library versions a disagreement is reported with."""
    found = [(name, installed_version(name)) for name in ("transformers", "torch", "peft", "bitsandbytes")]
    return ", ".join(f"{name} {version}" for name, version in found if version is not None)


@dataclass
class Outputs:
    """What one run of the truncated model gives: named tensors to compare."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Verdict:
    ok: bool
    worst: float  # the relative difference nearest (or furthest past) its bound
    where: str  # which compared tensor it was
    allowed: float = 0.0  # that tensor's bound
    original: float | None = None  # against float64: the original modules' own error on that tensor
    float64: Verdict | None = None  # past the bound: the verdict against float64, which decides


def compare(out: Outputs, ref: Outputs, bound: float, original: Outputs | None = None) -> Verdict:
    """The verdict on each difference against its bound (gradients: GRADIENT_FACTOR x bound); the worst is the
    one closest to (or furthest past) its bound. With `original` (`ref` then being float64's run), each tensor may
    also be as far from `ref` as the original modules' is, times FLOAT64_FACTOR."""
    theirs = _errors(original, ref) if original is not None else {}
    worst = Verdict(True, 0.0, "", bound)
    worst_ratio = -1.0
    for name, (err, problem) in _errors(out, ref).items():
        if problem:
            return Verdict(False, float("inf"), f"{name} ({problem})")
        allowed = bound * (GRADIENT_FACTOR if _is_gradient(name) else 1.0)
        if name in theirs:
            allowed = max(allowed, FLOAT64_FACTOR * theirs[name][0])
        if err / allowed > worst_ratio:
            mark = theirs[name][0] if name in theirs else None
            worst_ratio, worst = err / allowed, Verdict(err <= allowed, err, name, allowed, mark)
    return worst


def _is_gradient(name: str) -> bool:
    return name.startswith("gradient")


def _errors(out: Outputs, ref: Outputs) -> dict[str, tuple[float, str]]:
    """Each tensor's relative difference ||out - ref|| / ||ref|| (gradients: ||ref|| floored at NEGLIGIBLE x the
    largest gradient's), with what makes it incomparable ('' when nothing does; the difference is then inf)."""
    norms = {name: r.double().norm().item() for name, r in ref.tensors.items()}
    floor = NEGLIGIBLE * max((n for name, n in norms.items() if _is_gradient(name)), default=0.0)
    errors = {}
    for name, r in ref.tensors.items():
        o = out.tensors.get(name)
        if o is None or o.shape != r.shape:
            errors[name] = (float("inf"), f"missing or shape {None if o is None else tuple(o.shape)}")
            continue
        o, r = o.double(), r.double()
        if not torch.isfinite(o).all() and torch.isfinite(r).all():
            errors[name] = (float("inf"), "not finite")
            continue
        scale = max(norms[name], floor if _is_gradient(name) else 0.0)
        errors[name] = ((o - r).norm().item() / scale if scale > 0 else (o - r).norm().item(), "")
    return errors


def why_not_checkable(model: nn.Module, layers: list[nn.Module]) -> str | None:
    """None when the self-check can run on this model, else the reason."""
    if not layers:
        return "no decoder layers found"
    if _layer_list(model, layers) is None:
        return "the decoder layers are not one nn.ModuleList"
    if not callable(getattr(model, "get_input_embeddings", None)) or model.get_input_embeddings() is None:
        return "no input embeddings"
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type == "meta":
        return "the model has no materialised weights (meta device)"
    from ..models.rules import is_fsdp

    if any(is_fsdp(m) for m in model.modules()):
        return "FSDP-sharded model (a partial forward would desynchronise the ranks)"
    return None


def _layer_list(model: nn.Module, layers: list[nn.Module]) -> nn.ModuleList | None:
    first = layers[0]
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and any(child is first for child in module.children()):
            return module
    return None


class Probe:
    """Runs a model cut to its first `n_layers` decoder layers on a fixed random batch."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]):
        self.model = model
        self.layers = layers
        self.layer_list = _layer_list(model, layers)
        embeddings = model.get_input_embeddings()
        self.device = embeddings.weight.device
        self.dtype = _least_precise_dtype(model)
        self.vocab = embeddings.weight.shape[0]
        self.n_layers = 1
        self.decode = True  # one cached decode step; off when the original cannot decode when cut short
        self.no_decode = ""  # why not

    def bound(self) -> float:
        return bound_for(self.dtype, self.device)

    # -- the run
    def run(self, seed: int, float64: bool = False) -> Outputs:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.vocab, (1, TOKENS + 1), generator=generator).to(self.device)
        out = Outputs()
        with (
            self._truncated(),
            _quiet(self.model),
            self._random_lora_b(generator),  # before float64: the same B values, rounded to the adapters' dtype
            _in_float64(self.model) if float64 else contextlib.nullcontext(),
            _embedding_grad(self.model) as h0,
        ):
            was_training = self.model.training
            try:
                self.model.train()
                with torch.enable_grad():
                    self._train_step(ids[:, :TOKENS], h0, out)
                self.model.eval()
                with torch.no_grad():
                    if self.decode:
                        self._decode_step(ids, out)
            finally:
                self.model.train(was_training)
        return out

    def _train_step(self, ids, h0, out: Outputs) -> None:
        result = self.model(input_ids=ids, labels=ids, use_cache=False)
        loss = getattr(result, "loss", None)
        if loss is None:  # a model without an LM head: a fixed random projection of its output
            hidden = result[0]
            weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7)).to(hidden)
            loss = (hidden.float() * weights.float()).sum()
        params = {n: p for layer in self.layers[: self.n_layers] for n, p in _named_trainable(layer, self.layers)}
        wanted = [h0[0], *params.values()]
        grads = torch.autograd.grad(loss, wanted, allow_unused=True)
        out.tensors["loss"] = loss.detach().float().reshape(1)
        names = ["gradient of the first layer's input", *(f"gradient of {n}" for n in params)]
        if grads[0] is not None:  # the batch's own tokens: bucket_lengths pads the rows on (models/padding.py)
            grads = (grads[0][:, : ids.shape[1]], *grads[1:])
        for name, grad in zip(names, grads):
            if grad is not None:
                out.tensors[name] = grad.detach()

    def _decode_step(self, ids, out: Outputs) -> None:
        from ..models.attention import cache_keyword

        prompt = self.model(input_ids=ids[:, :TOKENS], use_cache=True)
        out.tensors["prompt logits (eval)"] = _first_output(prompt)
        cache_name = cache_keyword(type(self.model))
        cache = getattr(prompt, cache_name, None) if cache_name else None
        if cache is None:
            return
        step = self.model(input_ids=ids[:, TOKENS:], use_cache=True, **{cache_name: cache})
        out.tensors["decode-step logits (KV cache)"] = _first_output(step)

    # -- what the run changes and puts back
    @contextlib.contextmanager
    def _truncated(self):
        from ..models.bnb_4bit import float64_4bit_forwards

        saved = self.layer_list._modules
        self.layer_list._modules = OrderedDict(list(saved.items())[: self.n_layers])
        try:
            with (
                _output_capturing_untouched(self.model),
                _own_forwards_above(self.model, self.layer_list),
                # bitsandbytes' CPU output is wrong where blocks straddle rows, and its eval forward repacks the
                # user's weights: 4-bit layers compute from their bytes in float64 during the check instead
                float64_4bit_forwards(self.model),
            ):
                yield
        finally:
            self.layer_list._modules = saved

    @contextlib.contextmanager
    def _random_lora_b(self, generator: torch.Generator):
        """peft initialises lora_B to zero, which would hide the fused LoRA forward: random values for the
        check, the originals copied back (in place, so views and the fused path's copies follow)."""
        saved = []
        with torch.no_grad():
            for layer in self.layers[: self.n_layers]:
                for name, p in layer.named_parameters():
                    if "lora_B" in name or "lora_embedding_B" in name:
                        saved.append((p, p.detach().clone()))
                        p.copy_(0.02 * torch.randn(p.shape, generator=generator).to(p))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, original in saved:
                    p.copy_(original)


@contextlib.contextmanager
def _output_capturing_untouched(model: nn.Module):
    """transformers >= 5.2x installs output-capturing hooks (router logits, attentions) on the modules present at a
    model's first forward, once, and marks the model: a first forward on the cut stack would leave the other
    layers unhooked for good (an MoE's auxiliary loss then sums the first layer's router alone). Hooks installed
    during the check are taken off again and the mark removed, so the user's first forward installs them."""
    marked = {id(m) for m in model.modules() if "_output_capturing_hooks_installed" in vars(m)}
    hooks_before = {id(m): set(m._forward_hooks) for m in model.modules()}
    try:
        yield
    finally:
        for module in model.modules():
            if "_output_capturing_hooks_installed" in vars(module) and id(module) not in marked:
                del module._output_capturing_hooks_installed
            for key in set(module._forward_hooks) - hooks_before.get(id(module), set()):
                if "output_capturing" in getattr(module._forward_hooks[key], "__qualname__", ""):
                    for hooks in (
                        module._forward_hooks,
                        module._forward_hooks_with_kwargs,
                        module._forward_hooks_always_called,
                    ):
                        hooks.pop(key, None)


@contextlib.contextmanager
def _own_forwards_above(model: nn.Module, layer_list: nn.Module):
    """Another library's instance forward on a module above the decoder layers (TRL 1.7's chunked-NLL loss head on
    the causal LM, which fails on some families' structure) is set aside while the check runs: the check compares
    fastplug's patches under the model's own forwards, with and without them. fastplug's own patches stay, and so
    do accelerate's hooks (they move inputs between devices)."""
    path = next(name for name, m in model.named_modules() if m is layer_list)
    above = {path.rsplit(".", i)[0] for i in range(1, path.count(".") + 1)} | {""}
    foreign = {
        module: forward
        for name, module in model.named_modules()
        if name in above
        and not hasattr(module, "_hf_hook")
        and (forward := vars(module).get("forward")) is not None
        and not getattr(getattr(forward, "__func__", forward), "__module__", "").startswith("fastplug.")
    }
    for module in foreign:
        del module.forward
    try:
        yield
    finally:
        for module, forward in foreign.items():
            module.forward = forward


@contextlib.contextmanager
def _in_float64(model: nn.Module):
    """The modules of the (cut) model in float64: each floating parameter's data and each floating buffer swapped
    for a float64 copy and put back after (the same Parameter objects: the gradients asked for stay theirs), and
    transformers' implementations that have float64 (grouped_mm experts and flash attention have not). Quantized
    weights stay packed: their layers take float64 inputs or raise (then the bound alone decides)."""
    parameters = [p for p in model.parameters() if p.is_floating_point()]
    buffers = [
        (module, name, buffer)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and buffer.is_floating_point()
    ]
    datas = [p.data for p in parameters]
    switched = []
    try:
        for p in parameters:
            p.data = p.data.double()
        for module, name, buffer in buffers:
            module._buffers[name] = buffer.double()
        for setter, attribute, wanted in (
            ("set_experts_implementation", "_experts_implementation", "eager"),
            ("set_attn_implementation", "_attn_implementation", "sdpa"),
        ):
            root = next((m for m in model.modules() if callable(getattr(type(m), setter, None))), None)
            current = getattr(getattr(root, "config", None), attribute, None)
            if current is not None and current not in ("eager", wanted):
                getattr(root, setter)(wanted)
                switched.append((root, setter, current))
        yield
    finally:
        for root, setter, previous in reversed(switched):
            getattr(root, setter)(previous)
        for module, name, buffer in buffers:
            module._buffers[name] = buffer
        for p, data in zip(parameters, datas):
            p.data = data


def _least_precise_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in at its least precise: of its floating parameters and of its quantized
    layers' compute dtype (a QLoRA model keeps fp32 norms and adapters beside bf16 4-bit matmuls)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtypes |= {m.compute_dtype for m in model.modules() if isinstance(getattr(m, "compute_dtype", None), torch.dtype)}
    dtypes |= {getattr(getattr(p, "quant_state", None), "dtype", None) for p in model.parameters()}  # 4-bit weights
    dtypes &= set(BOUNDS)
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def _named_trainable(layer: nn.Module, layers):
    index = next(i for i, candidate in enumerate(layers) if candidate is layer)
    return [(f"layers.{index}.{n}", p) for n, p in layer.named_parameters() if p.requires_grad]


def _first_output(result) -> torch.Tensor:
    logits = getattr(result, "logits", None)
    return (logits if logits is not None else result[0]).detach().float()


@contextlib.contextmanager
def _embedding_grad(model: nn.Module):
    """The embedding output made a leaf that requires grad (the first layer's input gradient), via a hook."""
    holder: list[torch.Tensor] = []

    def hook(module, args, output):
        leaf = output.detach().requires_grad_(True)
        holder[:] = [leaf]
        return leaf

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield holder
    finally:
        handle.remove()


# Float rates that modules apply through torch.nn.functional (OPT's dropout and layerdrop), not a Dropout module
_NOISE_ATTRIBUTES = (
    "dropout",
    "attention_dropout",
    "attn_dropout",
    "activation_dropout",
    "hidden_dropout",
    "layerdrop",
    "jitter_noise",
    "router_jitter_noise",
)


@contextlib.contextmanager
def _quiet(model: nn.Module):
    """No dropout, no router jitter: both runs must see the same function."""
    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    noisy = [
        (m, name, getattr(m, name))
        for m in model.modules()
        for name in _NOISE_ATTRIBUTES
        if isinstance(getattr(m, name, None), float) and getattr(m, name) > 0
    ]
    saved_p = [m.p for m in dropouts]
    try:
        for m in dropouts:
            m.p = 0.0
        for m, name, _ in noisy:
            setattr(m, name, 0.0)
        yield
    finally:
        for m, p in zip(dropouts, saved_p):
            m.p = p
        for m, name, value in noisy:
            setattr(m, name, value)


@dataclass
class Report:
    """What the self-check did, for summary()."""

    ran: bool
    reason: str = ""  # why it did not run
    passed: list[str] = field(default_factory=list)
    declined: list[tuple[str, str]] = field(default_factory=list)  # (kind, why)
    worst: float = 0.0
    where: str = ""
    bound: float = 0.0
    layers: int = 0
    seconds: float = 0.0
    dtype: str = ""
    reused: bool = False  # the verdict of a model identical in structure, checked earlier in this process
    no_decode: str = ""  # why no cached decode step was compared
    float64: list[str] = field(default_factory=list)  # differences past the bound that float64 found in our favour
    float64_seconds: float = 0.0  # of `seconds`, in float64 runs

    def lines(self) -> list[str]:
        if not self.ran:
            return [f"  self-check: not run ({self.reason})"]
        when = "verdict of an identical model checked earlier" if self.reused else f"{self.seconds:.2f} s"
        if self.float64_seconds and not self.reused:
            when += f", {self.float64_seconds:.2f} s of it in float64"
        head = (
            f"  self-check ({self.dtype}, {TOKENS} tokens{'' if self.no_decode else ' + 1 cached'}, "
            f"{self.layers} layer(s), {when}): "
            f"agree: {', '.join(self.passed) or 'nothing'}; largest difference {self.worst:.1e} ({self.where}), "
            f"bound {self.bound:.0e} (gradients x{GRADIENT_FACTOR})"
        )
        notes = [f"    no cached decode step: the original failed it ({self.no_decode})"] if self.no_decode else []
        notes += [f"    {note}" for note in self.float64]
        return [head] + notes + [f"    declined {kind}: {why}" for kind, why in self.declined]


class Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.start = time.perf_counter()

    def seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start


def verify(model: nn.Module, layers: list[nn.Module], records: list, options, known_family: bool) -> Report:
    """Check the installed patches (`records`, in the order applied; each has .patch, .module, .path,
    install() and uninstall()) against the original modules of `model` (its decoder `layers`); take off every
    kind that disagrees."""
    import warnings

    if not records:
        return Report(ran=False, reason="nothing patched")
    if not options.self_check:
        return Report(ran=False, reason="off (self_check=False)")
    reason = why_not_checkable(model, layers)
    probe = Probe(model, layers) if reason is None else None
    if probe is not None:
        layer_of = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
        first_layer: dict[tuple[str, str], int] = {}
        for r in records:
            index = layer_of.get(id(r.module), 0)
            key = (r.patch.kind, r.patch.path_taken)
            first_layer[key] = min(first_layer.get(key, index), index)
        first_of_type = _first_layer_of_each_type(model)  # hybrid stacks: one full-attention layer at least
        probe.n_layers = min(MAX_LAYERS, 1 + max([*first_layer.values(), *first_of_type]))
        in_scope = [r for r in records if layer_of.get(id(r.module), 0) < probe.n_layers]
        key = (_computing_options(options), *_structure_key(model, probe, in_scope))
        if key in _VERDICTS:
            return _reuse(_VERDICTS[key], records)
        timer = Timer(probe.device)
        with _originals(in_scope):
            try:
                references = [probe.run(SEEDS[0])]
            except Exception as exc:
                try:  # a model that cannot decode from its cache when cut short (linear-attention layers alone)
                    probe.decode = False
                    references = [probe.run(SEEDS[0])]
                    probe.no_decode = f"{type(exc).__name__}: {exc}"
                except Exception as exc:  # the model's own forward needs more than token ids (vision inputs, ...)
                    reason = f"the original model failed on random tokens: {type(exc).__name__}: {exc}"
    if reason is not None:
        report = Report(ran=False, reason=reason)
        if not known_family:  # structural patches of an unknown family are kept only when shown equal
            for kind in _kinds(records):
                _decline(records, kind)
                report.declined.append((kind, f"unknown family and the self-check cannot run ({reason})"))
        return report

    bound = probe.bound()
    truths: dict[int, Outputs | str] = {}  # float64 runs of the original modules, by seed (or why none ran)
    float64_seconds = 0.0

    def truth(seed: int) -> Outputs | str:
        nonlocal float64_seconds
        failed = next((t for t in truths.values() if isinstance(t, str)), None)  # it would fail again
        if seed not in truths and failed is None:
            timer = Timer(probe.device)
            try:
                with _originals(in_scope):
                    truths[seed] = probe.run(seed, float64=True)
            except Exception as exc:  # a layer with no float64 path (bitsandbytes on CUDA), out of memory, ...
                truths[seed] = f"{type(exc).__name__}: {exc}"
            float64_seconds += timer.seconds()
            if probe.device.type == "cuda":  # the float64 weights' blocks (4x a bf16 copy of the probed layers)
                torch.cuda.empty_cache()
        return truths.get(seed, failed)

    def agreement() -> Verdict:
        """Patched against original on one batch, then the other; past the bound on both, against float64."""
        attempts = []
        for i, seed in enumerate(SEEDS):
            if len(references) == i:  # this batch's reference, run with the original modules
                with _originals(in_scope):
                    references.append(probe.run(seed))
            verdict, out = _attempt(probe, seed, references[i], bound)
            if verdict.ok:
                return verdict
            attempts.append((seed, verdict, out))
        for (seed, verdict, out), reference in zip(attempts, references):
            if out is None:  # the patched run raised: nothing to weigh
                continue
            exact = truth(seed)
            judged = (
                compare(out, exact, bound, original=reference)
                if isinstance(exact, Outputs)
                else Verdict(False, float("inf"), f"no float64 run ({exact})")
            )
            verdict = dataclasses.replace(verdict, ok=judged.ok, float64=judged)
            if judged.ok:
                return verdict
        return verdict

    verdict = agreement()
    report = Report(
        ran=True,
        bound=bound,
        layers=probe.n_layers,
        dtype=str(probe.dtype).replace("torch.", ""),
        no_decode=probe.no_decode,
    )
    if verdict.ok and verdict.float64 is not None:
        report.float64.append(f"float64 sided with the patches: {_differences(verdict)}")
    if not verdict.ok:  # find the kinds responsible: add them back one at a time
        for r in reversed(in_scope):
            r.uninstall()
        last_good = Verdict(True, 0.0, "", bound)
        for kind in _kinds(in_scope):
            for r in in_scope:
                if r.patch.kind == kind:
                    r.install()
            verdict = agreement()
            if verdict.ok:
                last_good = verdict
                if verdict.float64 is not None:
                    report.float64.append(f"float64 sided with the patched {kind}: {_differences(verdict)}")
                continue
            where = next(r.path for r in in_scope if r.patch.kind == kind) or type(model).__name__
            why = _differences(verdict, f" with {where} patched")
            _decline(records, kind)
            report.declined.append((kind, why))
            warnings.warn(
                f"fastplug: the patched {kind} disagrees with the original modules on this model: {why}; "
                f"{versions()}. It is not installed: the original modules run. Please report this.",
                stacklevel=4,
            )
        verdict = last_good
    report.passed = [kind for kind in _kinds(records) if any(r.active for r in records if r.patch.kind == kind)]
    report.worst, report.where, report.seconds = verdict.worst, verdict.where, timer.seconds()
    report.float64_seconds = float64_seconds
    _VERDICTS[key] = report
    return report


# Verdicts of this process, by model structure: patching a model identical in structure to one checked before
# (same classes and the same functions behind them, config, dtype, device, options, patches and parameters, in
# the layers the check runs) reuses its verdict instead of running the check again. Holds no tensors.
_VERDICTS: dict[tuple, Report] = {}


def forget() -> None:
    """Drop the remembered verdicts (a test that changes fastplug's or transformers' code in place)."""
    _VERDICTS.clear()


# Options that do not change what the checked modules compute (checkpointing runs after the check, graphs and gc
# are host-side): two patches that differ only in these share a verdict.
_NOT_COMPUTING = ("gradient_checkpointing", "memory_budget", "cuda_graphs", "freeze_gc", "self_check")


def _computing_options(options) -> tuple:
    return tuple(
        (f.name, getattr(options, f.name)) for f in dataclasses.fields(options) if f.name not in _NOT_COMPUTING
    )


def _structure_key(model: nn.Module, probe: Probe, in_scope: list) -> tuple:
    import sys

    from ..models.attention import attention_function

    classes = list(dict.fromkeys(type(m) for layer in probe.layers[: probe.n_layers] for m in layer.modules()))
    classes.append(type(model))
    functions = []
    for cls in classes:  # the originals' code: their forwards and the functions their modules define
        functions.append((cls.__qualname__, id(cls.forward)))
        namespace = vars(sys.modules.get(cls.__module__, object))
        functions += [(name, id(value)) for name, value in namespace.items() if callable(value)]
    attentions = {
        type(m): m for layer in probe.layers[: probe.n_layers] for m in layer.modules() if hasattr(m, "q_proj")
    }
    for module in attentions.values():
        if hasattr(module, "config"):
            with contextlib.suppress(Exception):
                functions.append(("attention", id(attention_function(module))))
    parameters = [
        (name, p.dtype, tuple(p.shape), p.requires_grad, type(p).__name__)
        for layer in probe.layers[: probe.n_layers]
        for name, p in layer.named_parameters()
    ]
    patches = [(r.path, r.patch.kind, r.patch.path_taken, r.patch.lora_fused) for r in in_scope]
    config = getattr(model, "config", None)
    return (
        type(model),
        config.to_json_string() if config is not None else "",
        probe.dtype,
        str(probe.device),
        probe.n_layers,
        tuple(functions),
        tuple(parameters),
        tuple(patches),
    )


def _reuse(verdict: Report, records: list) -> Report:
    for kind, _ in verdict.declined:
        _decline(records, kind)
    return dataclasses.replace(verdict, reused=True)


def _first_layer_of_each_type(model: nn.Module) -> list[int]:
    """Where each layer type of config.layer_types first appears (sliding/full attention, linear attention):
    a cache of linear-attention layers alone cannot even say its length."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)):
        return []
    return [types.index(t) for t in dict.fromkeys(types)]


@contextlib.contextmanager
def _originals(records: list):
    """The original modules where these patches are active now; the same patches back afterwards."""
    active = [r for r in records if r.active]
    for r in reversed(active):
        r.uninstall()
    try:
        yield
    finally:
        for r in active:
            r.install()


def _kinds(records) -> list[str]:
    return list(dict.fromkeys(r.patch.kind for r in records))


def _decline(records, kind: str) -> None:
    for r in reversed(records):
        if r.patch.kind == kind:
            r.uninstall()


def _attempt(probe: Probe, seed: int, reference: Outputs, bound: float) -> tuple[Verdict, Outputs | None]:
    """The verdict of the patched run against the reference, and that run's outputs (None: it raised)."""
    try:
        out = probe.run(seed)
    except Exception as exc:  # a patched forward that raises where the original ran is a disagreement too
        return Verdict(False, float("inf"), f"{type(exc).__name__}: {exc}"), None
    return compare(out, reference, bound), out


def _differences(verdict: Verdict, patched: str = "") -> str:
    """A verdict past the bound in words, with float64's side of it when there was one."""
    text = f"{verdict.where} differs by {verdict.worst:.2e} (bound {verdict.allowed:.1e}){patched}"
    exact = verdict.float64
    if exact is None:
        return text
    if exact.original is None:  # no float64 run, or a tensor that cannot be compared
        return f"{text}; against float64: {exact.where}"
    return (
        f"{text}; against float64, {exact.where} is off by {exact.worst:.2e} with the patches and by "
        f"{exact.original:.2e} with the original modules (allowed {exact.allowed:.1e})"
    )

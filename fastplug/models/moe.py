"""MoE layers (Mixtral, Qwen2-MoE, Qwen3-MoE): experts, LoRA on experts, router.

- Experts: fastplug registers "fastplug" in transformers' experts interface (`ALL_EXPERTS_FUNCTIONS`) and
  the patch switches this model instance to it (`set_experts_implementation`); restore switches back to
  the previous implementation. Biases, transposed ([E, in, out]) and interleaved gate/up weights and gpt-oss's
  clamped SwiGLU run on the grouped kernels through their flags; experts they cannot run (post-expert norms, expert
  parallelism, an unknown activation or gating, MXFP4-packed weights, experts off the interface) are skipped with
  the reason.
- LoRA on experts (peft `target_parameters`, one `ParamWrapper` per 3-D weight, nested): the outermost
  wrapper's forward runs the experts with each adapter as a rank-r grouped term; when that does not apply
  (several active adapters, merged weights) it calls peft's own forward, which still reaches the fastplug
  experts with peft's folded weights.
- Router: softmax, top-k and renormalisation in one kernel; its logits are still returned, so the
  load-balancing loss (output_router_logits) is unchanged.
A Qwen2-MoE shared expert is a dense MLP: mlp.py patches it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels._utils import use_triton
from ..kernels.moe import ExpertLoRA, moe_experts, moe_router
from .mlp import activation_name
from .rules import MatchContext, Patch, Skip, off_the_gpu

IMPLEMENTATION = "fastplug"
# family -> (renormalise the top k: True, or the router attribute that says so; weights in fp32)
_ROUTERS = {
    "mixtral": (True, True),
    "qwen2_moe": ("norm_topk_prob", False),
    "qwen3_moe": ("norm_topk_prob", False),
    "qwen3_5_moe_text": (True, False),
    "qwen3_5_moe": (True, False),
    "qwen3_next": ("norm_topk_prob", False),
    "gpt_oss": (True, False),  # softmax over the top-k logits (+ the router's bias): the renormalised top k
}
# family -> moe_experts' gating arguments for experts that gate with their own `_apply_gate`, read from the module
_OWN_GATES = {
    "gpt_oss": lambda experts: dict(
        activation="clamped_swiglu", swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit)
    ),
}
# family -> why its experts or router stay transformers' (they are off the experts interface)
_LEFT = {
    "llama4_text": {
        "experts": "Llama 4 scales each token by its router score before the experts (routed_in = x * score) and "
        "runs every expert over every token (one bmm); the grouped kernels weight the experts' outputs: left to "
        "transformers",
        "router": "Llama 4's router (a sigmoid of the top-k logits, no softmax) has no fused kernel: left to "
        "transformers",
    },
}


def _experts_interface():
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return moe if hasattr(moe, "ALL_EXPERTS_FUNCTIONS") else None


# ------------------------------------------------------------------------------------------ the experts
def _gating(experts: nn.Module) -> dict | str:
    """moe_experts' activation arguments for these experts, or why no kernel computes their gating."""
    moe = _experts_interface()
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if moe is not None and apply_gate is not getattr(moe, "_default_apply_gate", apply_gate):
        own = _OWN_GATES.get(getattr(getattr(experts, "config", None), "model_type", None))
        return own(experts) if own is not None else f"{type(experts).__name__} has its own gating (_apply_gate)"
    activation = activation_name(getattr(experts, "act_fn", None))
    if activation is None:
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__} has no fused kernel"
    return {"activation": activation}


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why the grouped kernels cannot run these experts (None: they can)."""
    flags = {"has_gate": True, "has_post_expert_norm": False, "_is_expert_parallel": False}
    for flag, wanted in flags.items():
        if getattr(experts, flag, wanted) != wanted:
            return f"{flag}={not wanted} is not supported by the grouped kernels"
    gating = _gating(experts)
    return gating if isinstance(gating, str) else None


def _kernel_weights(experts: nn.Module):
    """gate_up [E, 2I, H] and down [E, H, I] as the kernels read them (views of transposed storage: gpt-oss)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False):
        return gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def _run_experts(experts, hidden_states, top_k_index, top_k_weights, gate_up_lora=None, down_lora=None):
    gate_up, down = _kernel_weights(experts)
    biased = getattr(experts, "has_bias", False)
    out = moe_experts(
        hidden_states.to(gate_up.dtype),
        gate_up,
        down,
        top_k_index,
        top_k_weights,
        gate_up_lora=gate_up_lora,
        down_lora=down_lora,
        gate_up_bias=experts.gate_up_proj_bias if biased else None,
        down_bias=experts.down_proj_bias if biased else None,
        interleaved=not getattr(experts, "is_concatenated", True),
        **_gating(experts),
    )
    return out.to(hidden_states.dtype)


def fastplug_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "fastplug" experts implementation; experts it cannot run go to transformers' grouped_mm."""
    if unsupported_reason(self) is not None or not use_triton(hidden_states):
        fallback = _experts_interface().ALL_EXPERTS_FUNCTIONS["grouped_mm"]
        return fallback(self, hidden_states, top_k_index, top_k_weights)
    return _run_experts(self, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    interface = _experts_interface().ALL_EXPERTS_FUNCTIONS
    if interface.get(IMPLEMENTATION) is not fastplug_experts_forward:
        interface.register(IMPLEMENTATION, fastplug_experts_forward)


def _switch(root: nn.Module):
    """Switch this model instance to the fastplug experts; returns the undo (a no-op when already)."""

    def switch():
        previous = root.config._experts_implementation
        if previous == IMPLEMENTATION:
            return lambda: None
        root.set_experts_implementation(IMPLEMENTATION)
        return lambda: root.set_experts_implementation(previous)

    return switch


def _experts_weights(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).dim() >= 3
        for n in ("gate_up_proj", "down_proj")
    )


def _is_experts(module: nn.Module) -> bool:
    return _experts_weights(module) and hasattr(module, "has_gate") and module.gate_up_proj.is_floating_point()


def _packed(module) -> bool:
    """MXFP4 experts (transformers' Mxfp4GptOssExperts): packed uint8 weights that its own kernels run."""
    return module is not None and _experts_weights(module) and not module.gate_up_proj.is_floating_point()


_PACKED = (
    "MXFP4-packed expert weights ({name}, uint8): transformers' MXFP4 kernels run them; the grouped kernels take "
    "bf16 experts (load with Mxfp4Config(dequantize=True) to train them)"
)


def _match_experts(module: nn.Module, ctx: MatchContext):
    if _experts_interface() is None or not hasattr(ctx.root, "set_experts_implementation"):
        import transformers

        return Skip("experts", f"transformers {transformers.__version__} has no experts interface")
    reason = unsupported_reason(module)
    if reason is not None:
        return Skip("experts", reason)
    _register()
    E, two_i, hidden = _kernel_weights(module)[0].shape
    quirks = [_gating(module)["activation"]]
    quirks += ["biases"] if getattr(module, "has_bias", False) else []
    quirks += ["interleaved gate/up"] if not getattr(module, "is_concatenated", True) else []
    taken = f"fastplug grouped GEMM experts ({E} experts, {hidden} -> {two_i // 2}, {', '.join(quirks)})"
    return Patch(
        "experts", None, switch=_switch(ctx.root), path_taken=_on_device(module, taken, "transformers' grouped_mm")
    )


def _on_device(experts: nn.Module, taken: str, fallback: str) -> str:
    """`taken` as it runs on the experts' device: on the GPU as is, interpreted on a CPU with TRITON_INTERPRET, else
    (no Triton there) `fallback`, which the forwards hand over to."""
    elsewhere = off_the_gpu(experts)
    weight = _kernel_weights(experts)[0]
    if elsewhere is None:
        return taken
    if use_triton(weight):
        return f"{taken} {elsewhere}"
    return f"{fallback} (fastplug's grouped kernels need Triton, which does not run on {weight.device.type} here)"


# -------------------------------------------------------------------------------------- LoRA on experts
def _is_param_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "ParamWrapper" and type(module).__module__.startswith("peft")


def _wrapper_chain(outer: nn.Module) -> list[nn.Module]:
    chain = [outer]
    while _is_param_wrapper(chain[-1].base_layer):
        chain.append(chain[-1].base_layer)
    return chain


def _expert_adapters(chain) -> dict | str:
    """{parameter name: ExpertLoRA or None} as the adapters stand now, or why the grouped path cannot run."""
    adapters = {}
    for wrapper in chain:
        name = wrapper.parameter_name
        if name not in ("gate_up_proj", "down_proj"):
            return f"LoRA on {name}"
        if wrapper.merged:
            return "adapter weights are merged"
        # peft reads a 3-D weight as [E, in, out] unless it swapped in and out for [E, out, in] storage; either way
        # its factors are the kernels' [E, out, in] view's when that reading matches the experts' layout
        transposed = bool(getattr(wrapper.get_base_layer(), "is_transposed", False))
        if getattr(wrapper, "_did_swap_in_out_features", False) == transposed:
            return "peft reads the expert weights in another layout (in and out swapped)"
        if wrapper.disable_adapters:
            adapters[name] = None
            continue
        active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        if len(active) > 1:
            return f"{len(active)} active adapters"
        if not active:
            adapters[name] = None
            continue
        A, B = wrapper.lora_A[active[0]].weight, wrapper.lora_B[active[0]].weight
        E = wrapper.num_experts
        adapters[name] = ExpertLoRA(
            A.view(E, -1, A.shape[1]), B.view(B.shape[0], -1, E).permute(2, 0, 1), wrapper.scaling[active[0]]
        )
    return adapters


def _lora_experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    chain = _wrapper_chain(self)
    experts = chain[-1].get_base_layer()
    adapters = _expert_adapters(chain)
    if isinstance(adapters, str) or args or kwargs or unsupported_reason(experts) or not use_triton(hidden_states):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    return _run_experts(
        experts,
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_lora=adapters.get("gate_up_proj"),
        down_lora=adapters.get("down_proj"),
    )


def _match_lora_experts(module: nn.Module, ctx: MatchContext):
    if any(_is_param_wrapper(m) and m.base_layer is module for m in ctx.root.modules()):
        return None  # an inner wrapper: the outermost one runs the whole chain
    chain = _wrapper_chain(module)
    if not _is_experts(chain[-1].get_base_layer()):
        return None
    if not ctx.options.lora:
        return Skip("experts_lora", "lora option off: peft folds the adapters into the expert weights")
    reason = unsupported_reason(chain[-1].get_base_layer())
    adapters = _expert_adapters(chain)
    reason = reason or (adapters if isinstance(adapters, str) else None)
    if reason is not None:
        return Skip("experts_lora", f"{reason}: peft folds the adapters into the expert weights")
    ranks = ", ".join(f"{name} r={a.A.shape[1]}" for name, a in adapters.items() if a is not None)
    return Patch(
        "experts_lora",
        _lora_experts_forward,
        lora_fused=True,
        path_taken=_on_device(
            chain[-1].get_base_layer(),
            f"LoRA on experts as grouped rank-r terms ({ranks}), no dense delta weight",
            "peft's LoRA on experts",
        ),
    )


# ------------------------------------------------------------------------------------------- the router
def _router_forward(normalize, fp32_weights: bool):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = nn.functional.linear(hidden_states, self.weight, getattr(self, "bias", None))  # gpt-oss: a bias
        renorm = normalize if isinstance(normalize, bool) else bool(getattr(self, normalize))
        weights, index = moe_router(
            logits, self.top_k, normalize=renorm, weights_dtype=torch.float32 if fp32_weights else logits.dtype
        )
        return logits, weights, index

    return forward


def _match_router(module: nn.Module, ctx: MatchContext):
    mlp = next((m for m in ctx.root.modules() if getattr(m, "router", None) is module), None)
    experts = getattr(mlp, "experts", None)
    if _packed(experts):
        return Skip("router", f"unused: the MLP of {_PACKED.format(name=type(experts).__name__)} routes itself")
    normalize, fp32_weights = _ROUTERS[ctx.family.name]
    return Patch("router", _router_forward(normalize, fp32_weights))


def _is_router(module: nn.Module, ctx: MatchContext) -> bool:
    weight = getattr(module, "weight", None)
    return (
        ctx.family is not None
        and ctx.family.name in _ROUTERS
        and type(module).__name__.endswith("TopKRouter")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and hasattr(module, "top_k")
        and hasattr(module, "hidden_dim")
    )


# --------------------------------------------------------------------------------------------- the rule
def match_moe(module: nn.Module, ctx: MatchContext):
    if not ctx.options.moe:
        return None
    if _is_param_wrapper(module):
        return _match_lora_experts(module, ctx)
    if _is_experts(module):
        return _match_experts(module, ctx)
    if _packed(module):
        return Skip("experts", _PACKED.format(name=type(module).__name__))
    if _is_router(module, ctx):
        return _match_router(module, ctx)
    left = _LEFT.get(ctx.family.name if ctx.family else None, {})
    if _experts_weights(module) and "experts" in left:
        return Skip("experts", left["experts"])
    if type(module).__name__.endswith("Router") and "router" in left:
        return Skip("router", left["router"])
    return None

"""cuda_graphs=True off the GPU: the option says why nothing was captured; the per-instance routing of the
decoder layers (their class swapped on these instances only) changes no number while calls run eagerly and
is undone exactly; fused LoRA without its adapter caches (what a capture records) computes the same.
Replays themselves are tested on CUDA (tests/gpu/test_layer_graphs_gpu.py)."""

import pytest
import torch
from torch import nn

import fastplug
from fastplug.kernels import lora
from fastplug.kernels.lora import casts as lora_casts
from fastplug.models.structure import decoder_layers, decoder_stack
from fastplug.patch import layer_graphs
from fastplug.patch.checkpointing import enable_native
from tests.helpers import assert_close
from tests.models.tiny import batch, tiny_model


def _peft(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def test_option_without_cuda_says_why():
    handle = fastplug.patch_model(tiny_model("llama"), gradient_checkpointing=False, cuda_graphs=True)
    assert handle.graphs is None
    assert any(path == "cuda_graphs" and "CUDA" in reason for path, reason in handle.skipped)
    handle.restore()


def test_routing_is_per_instance_exact_and_undone():
    ids = batch()
    reference, routed = _peft(tiny_model("llama")), _peft(tiny_model("llama"))
    for model in (reference, routed):  # transformers 5.23 wraps a subclass's forward for checkpointing too
        enable_native(model)
    layers = decoder_layers(routed)
    original = type(layers[0])
    graphs = layer_graphs.LayerGraphs(
        decoder_stack(routed), layers, max_signatures=2
    )  # the patch installs none without CUDA
    assert type(layers[0]) is not original and isinstance(layers[0], original)
    assert type(decoder_layers(reference)[0]) is original, "another model's layers keep their class"
    results = []
    for model in (reference, routed):
        model.train()
        loss = model(**ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    (want_loss, want_grads), (got_loss, got_grads) = results
    assert torch.equal(got_loss, want_loss)
    for got, want in zip(got_grads, want_grads):
        assert torch.equal(got, want)
    assert graphs.replays == 0 and not graphs.sets, "CPU tensors always run eagerly"
    assert list(graphs.eager.items()) == [("a tensor off the GPU", 1)], "and the stack's forward says why"
    assert "forwards by path: a tensor off the GPU" in str(graphs)
    torch._dynamo.reset()
    compiled_loss = torch.compile(routed, backend="eager")(**ids).loss  # the layers are graph breaks
    assert_close(compiled_loss.detach(), want_loss, torch.float32, "compiled loss")
    graphs.eager.clear()
    graphs._recording, graphs._forward = {}, []  # as a forward that recorded or replayed leaves them
    positions = torch.arange(ids["input_ids"].shape[1]).expand_as(ids["input_ids"])
    routed(**ids, position_ids=positions).loss.backward()  # rows a caller may have packed: their own reason
    assert graphs._recording is None and graphs._forward is None, "the later layers never follow an older forward"
    hidden = torch.randn(1, 3, layers[0].hidden_size)
    rotary = decoder_stack(routed).rotary_emb(hidden, torch.arange(3)[None])
    layers[0](hidden, position_embeddings=rotary)  # called outside its stack: its rows unknown
    assert list(graphs.eager.items()) == [("rows the caller may have packed (position_ids or cu_seq_lens passed)", 2)]
    hooks = len(decoder_stack(routed)._forward_pre_hooks)
    graphs.remove()
    assert all(type(layer) is original and layer_graphs._GRAPHS not in vars(layer) for layer in layers)
    assert len(decoder_stack(routed)._forward_pre_hooks) == hooks - 1, "the graphs' pre-hook goes with them"


def test_fused_lora_without_adapter_caches_computes_the_same(monkeypatch):
    """What a CUDA graph's capture records (`adapters_cacheable` False: no cached cast or stack) gives the
    cached path's loss and gradients, and leaves nothing in the caches (a bf16 base, peft's fp32 adapters: each
    adapter is cast to bf16 per call)."""
    from fastplug.kernels.lora import functions as lora_functions
    from fastplug.kernels.lora import ops as lora_ops

    torch.manual_seed(0)
    model = _peft(tiny_model("llama").to(torch.bfloat16))
    handle = fastplug.patch_model(model, gradient_checkpointing=False, attention=False)
    ids = batch()
    results = []
    for cached in (True, False):
        model.zero_grad(set_to_none=True)
        lora.invalidate_adapter_casts()
        lora_casts._CAST_CACHE.clear()
        if not cached:
            for module in (lora_functions, lora_ops):
                monkeypatch.setattr(module, "adapters_cacheable", lambda x: False)
        loss = model(**ids).loss
        loss.backward()
        if cached:
            assert lora_casts._CAST_CACHE, "the cached path keeps the casts"
        else:
            assert not lora_casts._CAST_CACHE and not lora_casts._STACKED_ADAPTERS, "nothing cached while uncached"
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    handle.restore()
    (want_loss, want_grads), (got_loss, got_grads) = results
    assert_close(got_loss, want_loss, torch.bfloat16, "loss")
    for got, want in zip(got_grads, want_grads):
        assert_close(got, want, torch.bfloat16, "adapter grad")


def test_adapters_are_cacheable_off_the_gpu():
    assert lora_casts.adapters_cacheable(torch.randn(2, 3))


def test_what_the_graphs_take_as_fixed_sees_adapter_switches_hooks_freezing_and_new_modules():
    from torch.nn.modules import module as torch_module

    registered = len(torch_module._global_module_registration_hooks)
    model = _peft(tiny_model("llama"))
    layer = decoder_layers(model)[1]
    fixed = layer_graphs._Fixed(decoder_layers(model))
    assert fixed.holds()
    with model.disable_adapter():
        assert not fixed.holds(), "a replay would still add the disabled adapters"
    assert fixed.holds()
    hook = layer.mlp.register_forward_hook(lambda *_: None)
    assert not fixed.holds(), "a replay would skip a hook added after the capture"
    hook.remove()
    trained = next(p for p in model.parameters() if p.requires_grad)
    trained.data = trained.data.clone()
    assert not fixed.holds(), "a replay would read the parameter's old storage"
    trained.requires_grad_(False)
    fixed = layer_graphs._Fixed(decoder_layers(model))
    trained.requires_grad_(True)
    assert not fixed.holds(), "a replay would return no gradient for an unfrozen parameter"
    fixed = layer_graphs._Fixed(decoder_layers(model))
    layer.mlp.extra = torch.nn.Linear(2, 2)
    assert not fixed.holds(), "a module assigned inside a layer"
    fixed.close()
    fixed = layer_graphs._Fixed(decoder_layers(model))
    tiny_model("llama").lm_head.weight = torch.nn.Parameter(torch.zeros(2))  # another model: not ours
    assert fixed.holds()
    fixed.close()
    del fixed
    assert len(torch_module._global_module_registration_hooks) == registered, "process-wide hooks removed"


def test_default_resolves_off_the_gpu_quietly():
    """cuda_graphs=None: off on a CPU model without a warning entry (the user asked for nothing); the handle's
    options say what runs (no graphs, so no bucketed lengths) and the summary says why."""
    handle = fastplug.patch_model(tiny_model("llama"), gradient_checkpointing=False)
    try:
        assert handle.graphs is None and handle.options.cuda_graphs is False
        assert not handle.options.buckets_on()
        assert not any(path == "cuda_graphs" for path, _ in handle.skipped)
        assert "CUDA graphs of the decoder layers: off (needs a CUDA device)" in handle.summary()
    finally:
        handle.restore()


def _fake_cuda_memory(monkeypatch, reserved: int, allocated: int) -> list:
    """The allocator's figures the memory cap reads, on a CPU: a peak of 10**6 bytes before the first capture,
    `reserved` and `allocated` now, and the device's free bytes in the returned list's one item (10**9; set it)."""
    free = [10**9]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 10**6)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 10**12))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    return free


def test_the_memory_cap_predicts_each_capture_from_the_earlier_ones(monkeypatch):
    """A shape is captured only while what the graphs keep beyond the first capture's, plus its predicted cost,
    stays within the cap, and its cost within half the free memory: the arena's growth (a slot per layer and three
    more, sized for the largest hidden states seen) and the pool's: a shape no larger than one captured reuses the
    first capture's temporaries and adds what its graphs hold (what the first holds until a later capture measured
    it), a larger one costs the largest growth per element so far; the first needs only the free memory for its
    estimate; no cap, no limit."""
    free = _fake_cuda_memory(monkeypatch, reserved=600, allocated=500)
    model = tiny_model("llama")
    layers = decoder_layers(model)
    slots = len(layers) + 3
    capped = layer_graphs.LayerGraphs(decoder_stack(model), layers, memory_cap=0.5)
    capped._largest_eager = 10**4  # an eager step's peak (10**6 bytes) came from hidden states this large

    def fits(hidden):  # a new arena, if any, sized for the largest shape seen exactly
        return capped._fits(hidden, capped._arena_numel(hidden))

    try:
        assert capped.max_signatures == 16
        hidden = torch.empty(100)  # fp32: the first capture is estimated as the arena and one more buffer
        assert fits(hidden), "the first capture goes ahead when it fits in the free memory"
        free[0] = 2 * (slots + 1) * 400 - 100 - 2  # with the allocator's 100 cached bytes: 2 short
        assert not fits(hidden), "half the free memory bounds the first capture too"
        free[0] = 10**9
        capped._arena = layer_graphs._Arena(len(layers), 2000, hidden)
        capped._warmed, capped._growths, capped._held = True, [(1000, 400_000)], 3000
        capped._first_kept = 10**6  # the first capture's keep does not count against the cap
        capped.kept = capped._first_kept + capped._arena.nbytes + 400_000  # the cap: 500_000
        assert capped._pool_growth(torch.empty(1000)) == 3000, "a smaller shape adds what the first holds"
        assert fits(torch.empty(1000)) and not fits(torch.empty(1001))
        assert capped._pool_growth(torch.empty(1001)) == 1001 * 400, "a larger one: the first's growth per element"
        capped._growths.append((500, 1000))  # a later capture measured what a smaller shape adds
        assert capped._pool_growth(torch.empty(800)) == 1000
        capped.kept = capped._first_kept + 500_000 - 1000
        assert fits(torch.empty(800))
        capped.kept += 1
        assert not fits(torch.empty(800))
        capped.kept = capped._first_kept + capped._arena.nbytes
        bigger = torch.empty(2001)  # a new arena for 2001 elements a slot, and its pool growth
        assert capped._arena_growth(bigger, 2001) == slots * 2001 * 4 - capped._arena.nbytes
        assert not fits(bigger), "the arena's growth and the larger shape's temporaries count"
        free[0] = 2 * 1000 - 100 - 2
        capped.kept = capped._first_kept
        assert not fits(torch.empty(800)), "within the cap but not in half the free memory"
    finally:
        capped.remove()
    uncapped = layer_graphs.LayerGraphs(decoder_stack(model), layers)
    try:
        assert uncapped.max_signatures == 4
        uncapped._warmed, uncapped._growths, uncapped.kept = True, [(10, 20)], 10**12
        assert uncapped._fits(torch.empty(10**6), 10**6)
    finally:
        uncapped.remove()


def test_the_memory_cap_scales_with_a_shape_larger_than_the_eager_steps_before_the_first_capture(monkeypatch):
    """The cap is a fraction of the peak an eager step of the shape would reach: the peak allocated before the
    first capture, or for hidden states larger than the largest eager forward's then, that peak's part above the
    weights (allocated when the first forward began) scaled with their size. A first capture after one short
    batch then does not starve the longer ones."""
    _fake_cuda_memory(monkeypatch, reserved=600, allocated=500)  # peak 10**6 bytes
    model = tiny_model("llama")
    layers = decoder_layers(model)
    graphs = layer_graphs.LayerGraphs(decoder_stack(model), layers, memory_cap=0.5)
    try:
        graphs._static_bytes, graphs._largest_eager = 400_000, 1000
        assert graphs._eager_peak(torch.empty(500)) == 10**6, "a smaller shape: the peak itself"
        assert graphs._eager_peak(torch.empty(1000)) == 10**6
        assert graphs._eager_peak(torch.empty(3000)) == 400_000 + 600_000 * 3
        graphs._largest_eager = 10**5  # the base was taken at the first decision: later eager forwards leave it
        assert graphs._eager_peak(torch.empty(3000)) == 400_000 + 600_000 * 3
        graphs._fits(torch.empty(3000), 3000)
        assert graphs._cap_bytes == (400_000 + 600_000 * 3) // 2, "the cap of the last decision, for the summary"
    finally:
        graphs.remove()


def test_a_larger_shape_brings_a_new_arena_and_pool_and_the_captures_keep_their_accounts(monkeypatch):
    """What `_capture` does around a capture (CPU: the capture itself stubbed): the first sizes the arena for the
    largest hidden states seen; a shape it holds reuses arena and pool; a larger one drops the captured graphs (not
    the failed signatures), and with them the pool, which torch frees with its last graph, so the next capture
    takes a new pool; what the graphs keep is the arena and the pool's bytes."""
    handles = iter(range(100))
    pool_bytes = {}
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(layer_graphs, "_pool_bytes", lambda pool: pool_bytes.get(pool, 0))

    class Graph:
        def held_bytes(self):
            return 7

    def capture(records, tensors, arena, inferred):
        pool_bytes[graphs._pool] = pool_bytes.get(graphs._pool, 0) + 1000
        return [Graph() for _ in layers]

    def spec_key(shape):  # a signature's key: the spec, then the hidden states' shape, strides, dtype, grad
        return ("spec", (torch.Size(shape), None, torch.float32, False))

    def capture_shape(shape):  # a new arena, if any, sized exactly (`_arena_plan` picks the size on the GPU)
        hidden = torch.empty(shape)
        return graphs._capture([], [hidden], graphs._arena_numel(hidden))

    model = tiny_model("llama")
    layers = decoder_layers(model)
    graphs = layer_graphs.LayerGraphs(decoder_stack(model), layers, memory_cap=0.5)
    monkeypatch.setattr(graphs, "_capture_graphs", capture)
    try:
        graphs.seen = {spec_key((2, 8, 4)): {}, spec_key((2, 16, 4)): {}}
        graphs.sets[spec_key((2, 8, 4))] = capture_shape((2, 8, 4))
        first_pool, arena = graphs._pool, graphs._arena
        assert arena.numel == 2 * 16 * 4, "sized for the largest hidden states seen"
        assert graphs.kept == arena.nbytes + 1000 == graphs._first_kept and graphs._held == 7 * len(layers)
        graphs.sets[spec_key((2, 16, 4))] = capture_shape((2, 16, 4))
        assert graphs._pool == first_pool and graphs._arena is arena and len(graphs.sets) == 2
        assert graphs._growths == [(64, 1000), (128, 1000)] and graphs.kept == arena.nbytes + 2000
        graphs.sets[("failed",)] = layer_graphs._FAILED
        graphs.sets[spec_key((2, 32, 4))] = capture_shape((2, 32, 4))
        assert graphs._pool != first_pool and graphs._arena is not arena and graphs._arena.numel == 2 * 32 * 4
        assert set(graphs.sets) == {("failed",), spec_key((2, 32, 4))}, "the old arena's graphs are gone"
        assert graphs.kept == graphs._arena.nbytes + 1000
    finally:
        graphs.remove()


def test_the_arena_gives_each_slot_its_own_leaf_shaped_as_asked():
    arena = layer_graphs._Arena(2, 12, torch.empty(1, dtype=torch.bfloat16))
    assert arena.buffer.numel() == 5 * 12 and arena.nbytes == 5 * 12 * 2
    arena.buffer.normal_(generator=torch.Generator().manual_seed(0))  # torch.empty's bytes may be NaN
    like = torch.empty(2, 3, 2, dtype=torch.bfloat16)
    first, last = arena.slot(0, like), arena.slot(4, like)
    assert first.shape == like.shape and first.is_contiguous() and first._base is None and not first._is_view()
    assert last.data_ptr() == arena.buffer.data_ptr() + 4 * 12 * 2
    first.requires_grad_()  # a leaf of its own: the arena's buffer stays out of autograd
    assert not arena.buffer.requires_grad
    last.copy_(torch.ones(2, 3, 2) * first)  # grad mode: autograd sees no relation between two slots
    assert last.grad_fn is not None and first.grad_fn is None
    assert torch.equal(arena.buffer[48:60].view(2, 3, 2), last.detach()), "slots are the arena's bytes"
    assert arena.holds(like) and not arena.holds(torch.empty(13, dtype=torch.bfloat16))
    assert not arena.holds(torch.empty(2, dtype=torch.float32))


def test_capture_mapping_keeps_the_type_takes_stores_and_records_reads():
    """What each layer's warm-up and capture get for a mapping argument (Gemma 4's shared keys and values): its
    stores kept apart (its graph's extra outputs), its reads served from the earlier layers' stores and listed
    (its graph's extra inputs); a key nobody stored raises KeyError as in the eager model."""
    from collections import UserDict

    for kind in (dict, UserDict):
        earlier = {"sliding_attention": (torch.randn(2), torch.randn(2))}
        mapping = layer_graphs._capture_mapping(kind, earlier)
        assert isinstance(mapping, kind)
        mapping["full_attention"] = (torch.randn(3), torch.randn(3))
        assert set(mapping.stored) == {"full_attention"} and mapping.read == []
        assert mapping["full_attention"] is mapping.stored["full_attention"], "its own store reads back"
        assert mapping["sliding_attention"] is earlier["sliding_attention"]
        assert mapping.get("sliding_attention") is earlier["sliding_attention"] and "sliding_attention" in mapping
        assert mapping.read == ["sliding_attention"], "read once, listed once"
        assert mapping.get("missing") is None and "missing" not in mapping
        try:
            mapping["missing"]
        except KeyError:
            pass
        else:
            raise AssertionError(f"a {kind.__name__} served a key nobody stored")
        aliases = layer_graphs._aliases({"k": (torch.randn(2, requires_grad=True) * 2, torch.randn(2))})["k"]
        assert aliases[0].is_leaf and aliases[0].requires_grad and not aliases[1].requires_grad


def test_default_graphs_leave_a_compiled_model_whole():
    """Under torch.compile the default's layers (memory_cap set) are traced as their own class, so a fullgraph
    compile of the model works and computes the same; cuda_graphs=True's layers are graph breaks that replay."""
    ids = batch()
    want = tiny_model("llama").train()(**ids).loss
    for cap in (0.5, None):
        model = tiny_model("llama").train()
        graphs = layer_graphs.LayerGraphs(decoder_stack(model), decoder_layers(model), memory_cap=cap)
        try:
            torch._dynamo.reset()
            breaks = torch._dynamo.explain(model)(**ids).graph_break_count
            assert breaks == 0 if cap is not None else breaks >= len(decoder_layers(model)), breaks
            if cap is not None:
                torch._dynamo.reset()
                got = torch.compile(model, backend="eager", fullgraph=True)(**ids).loss
                assert_close(got.detach(), want.detach(), torch.float32, "compiled loss")
        finally:
            graphs.remove()


def test_a_new_arena_takes_room_for_longer_rows_where_it_fits(monkeypatch):
    """A new arena's slots are sized for the shapes seen with their sequence length rounded up to a power of two
    (a longer bucket later finds its slot instead of dropping every graph), where that fits; else exactly for
    the largest shape seen; None where neither fits. The first arena of varied shapes takes twice that room."""
    free = _fake_cuda_memory(monkeypatch, reserved=0, allocated=0)
    model = tiny_model("llama")
    layers = decoder_layers(model)
    slots = len(layers) + 3
    graphs = layer_graphs.LayerGraphs(decoder_stack(model), layers, memory_cap=0.5)
    try:
        hidden = torch.empty(2, 640, 3)  # a bucketed length (models/padding.py): room up to 1024
        assert layer_graphs._slot_numel(hidden.shape, 1) == 2 * 1024 * 3
        assert layer_graphs._slot_numel((2, 1024, 3), 1) == 2 * 1024 * 3, "a power of two stays"
        assert layer_graphs._slot_numel((7,), 1) == 7
        assert layer_graphs._slot_numel(hidden.shape, 2) == 2 * 2048 * 3
        assert layer_graphs._slot_numel((2, 1024, 3), 2) == 2 * 2048 * 3
        assert graphs._arena_plan(hidden) == 2 * 1024 * 3
        # a longer shape seen (not captured yet) is the one the arena makes room for
        key = (None, ((2, 1280, 3), (3840, 3, 1), torch.float32, False))
        graphs.seen[key] = {}
        assert graphs._arena_plan(hidden) == 2 * 2048 * 3
        # only the exact size fits in half the free memory (with the pool's one hidden-state buffer): no room
        free[0] = 2 * (slots * 2 * 1280 * 3 + hidden.numel()) * 4
        assert graphs._arena_plan(hidden) == 2 * 1280 * 3
        free[0] -= 8
        assert graphs._arena_plan(hidden) is None
        # the first arena of varied shapes (two seen) takes room for rows twice as long, where that fits
        free[0] = 10**9
        graphs.seen[(None, ((2, 640, 3), (1920, 3, 1), torch.float32, False))] = {}
        assert graphs._arena_plan(hidden) == 2 * 4096 * 3
        free[0] = 2 * (slots * 2 * 2048 * 3 + hidden.numel()) * 4
        assert graphs._arena_plan(hidden) == 2 * 2048 * 3, "else the power of two"
        free[0] = 10**9
        graphs._arena = layer_graphs._Arena(len(layers), 2 * 640 * 3, hidden)
        assert graphs._arena_plan(hidden) == 2 * 2048 * 3, "a later arena: the power of two"
    finally:
        graphs.remove()


def test_a_new_shape_of_a_uniform_stack_is_captured_at_its_first_sighting_from_inferred_records():
    """Once a shape was seen (run eagerly or captured) whose layers all took inputs like layer 0's, a new shape that
    differs from it only in its tensors' shapes and strides gets every layer's record from layer 0's (captured at
    once, no eager step); a stack whose layers took unlike inputs, a signature unlike in anything else, a shape
    whose capture failed, or a wrong inference or failed capture before (`_infer` off) leave the shape to be
    recorded eagerly."""
    model = tiny_model("llama")
    layers = decoder_layers(model)
    graphs = layer_graphs.LayerGraphs(decoder_stack(model), layers)

    def signature(rows: int, scalar=1.0, dtype=torch.bfloat16):
        hidden, cos = torch.empty(2, rows, 64, dtype=dtype), torch.empty(2, rows, 16, dtype=dtype)
        args, kwargs = (hidden,), {"position_embeddings": (cos, cos), "scaling": scalar}
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        key = [spec]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                key.append((leaf.shape, leaf.stride(), leaf.dtype, leaf is not hidden and leaf.requires_grad))
            else:
                key.append((type(leaf), leaf))
        return tuple(key), leaves, spec, tensors

    try:
        old, *rest = signature(128)
        records = {i: layer_graphs._Record(old, *rest) for i in range(len(layers))}
        graphs.seen[old] = records
        new = signature(192)
        inferred = graphs._inferred_records(*new)
        assert inferred is not None, "the eager records of one shape suffice: the second shape is captured"
        assert list(inferred) == list(range(len(layers))) and all(r.key == new[0] for r in inferred.values())
        graphs.sets[old] = layer_graphs._FAILED
        assert graphs._inferred_records(*new) is None, "not from a shape whose capture failed"
        graphs.sets[old] = [object()] * len(layers)
        assert graphs._inferred_records(*new) is not None
        assert inferred[0].layouts == [((2, 192, 16), (192 * 16, 16, 1), torch.bfloat16, False)] * 2
        assert graphs._inferred_records(*signature(192, scalar=0.5)) is None, "another scalar: not a new length"
        assert graphs._inferred_records(*signature(192, dtype=torch.float32)) is None, "another dtype"
        odd = signature(128, scalar=2.0)[0]
        graphs.seen[old] = {**records, len(layers) - 1: layer_graphs._Record(odd, *signature(128, 2.0)[1:])}
        assert graphs._inferred_records(*new) is None, "a layer took unlike inputs: the stack is not uniform"
        graphs.seen[old] = records
        graphs._infer = False
        assert graphs._inferred_records(*new) is None, "off once an inference was wrong or its capture failed"
    finally:
        graphs.remove()


def test_hooks_set_aside_for_a_call_come_back_in_their_order():
    """A layer's eager call inside FSDP2's hooks, and a capture, run with the layers' hooks set aside: none fires
    during it, and all are back afterwards, in their order, even when the call raises."""
    layer, fired = nn.Linear(4, 4), []
    handles = [
        layer.register_forward_pre_hook(lambda m, a: fired.append("pre 1")),
        layer.register_forward_pre_hook(lambda m, a: fired.append("pre 2")),
        layer.register_forward_hook(lambda m, a, o: fired.append("post")),
        layer.register_full_backward_hook(lambda m, gi, go: fired.append("backward")),
    ]
    x = torch.randn(2, 4, requires_grad=True)
    with layer_graphs._hooks_set_aside([layer]):
        layer(x).sum().backward()
    assert fired == []
    with pytest.raises(RuntimeError, match="inside"), layer_graphs._hooks_set_aside([layer]):
        raise RuntimeError("inside")
    layer(x).sum().backward()
    assert fired == ["pre 1", "pre 2", "post", "backward"]
    for handle in handles:
        handle.remove()

"""cuda_graphs=True on CUDA: LoRA training through replayed decoder-layer graphs gives the losses and adapters
of the same patched model run eagerly (bf16 base, peft's fp32 adapters, fused AdamW, gradient accumulation),
with checkpointing on and off, for Llama (also on FP8 bases), Gemma2 (fastplug's Triton attention with softcap
and window), Gemma3 (each layer type its own rotary tables) and Gemma 4 (per-layer inputs that need a gradient;
the MoE block beside the MLP; KV sharing, where later layers read the keys and values an earlier layer stored);
two forwards before one backward fall back to eager for the second and still give the right gradients."""

import gc
import warnings

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

import fastplug
from fastplug.bench.presets import ATTENTION_LORA, _gemma4_init
from tests.helpers import assert_close, train_losses

pytestmark = pytest.mark.gpu


def _model(family: str, seed: int = 0):
    common = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, vocab_size=1000)  # fmt: skip
    types = ["sliding_attention", "full_attention"] * 2
    gemma4 = dict(common, num_key_value_heads=1, global_head_dim=128, sliding_window=128, layer_types=types,
                  final_logit_softcapping=30.0, hidden_size_per_layer_input=0, num_kv_shared_layers=0)  # fmt: skip
    targets = "all-linear"
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, sliding_window=128)
    elif family == "gemma3":  # rope_local_base_freq: the sliding layers' rotary tables differ from the full ones'
        config = transformers.Gemma3TextConfig(**common, sliding_window=128, layer_types=types)
    elif family.startswith("gemma4"):
        if family in ("gemma4", "gemma4_kv_shared"):  # per-layer inputs: each layer its own slice
            gemma4.update(vocab_size_per_layer_input=1000, hidden_size_per_layer_input=64)
        if family == "gemma4_kv_shared":  # the last two layers reuse the first two's keys and values
            gemma4.update(num_kv_shared_layers=2)
        if family == "gemma4_moe":
            gemma4.update(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=256,
                          attention_k_eq_v=True, num_global_key_value_heads=1)  # fmt: skip
        config = transformers.Gemma4TextConfig(**gemma4)
        targets = ATTENTION_LORA + ["gate_proj", "up_proj", "down_proj"]  # not the per-layer input projection
    else:
        config = transformers.LlamaConfig(**common)
    config.use_cache = False
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    if family.startswith("gemma4"):
        _gemma4_init(model)
    if family == "gemma4":  # the embeddings' output needs a gradient, so the per-layer inputs made from it do
        model.enable_input_require_grads()
    torch.manual_seed(seed + 1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _adapters(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "family, checkpointing",
    [("llama", True), ("llama", False), ("gemma2", True), ("llama-fp8", True), ("llama-sdpa", True), ("gemma3", True),
     ("gemma3", False), ("gemma4", True), ("gemma4_moe", True), ("gemma4_kv_shared", True)],
)  # fmt: skip
def test_graphed_layers_train_like_eager(family, checkpointing):
    """llama-fp8: fp8=True too (cuBLAS's block-scaled GEMM where the shapes allow, the Triton GEMM and the
    dequantized dX elsewhere; the transposed-weight buffer inside the graphs). llama-sdpa: attention=False
    (transformers' SDPA inside the graphs). Gemma 4's layers store their keys and values in a mapping argument;
    with KV sharing later layers read them: the storing layer's graph outputs them, the readers' graphs take them
    as inputs and give their gradients back."""
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 1000, (2, 256), generator=gen).cuda() for _ in range(12)]
    results, summary, failed = {}, "", []
    for graphs in (False, True):
        model = _model(family.removesuffix("-fp8").removesuffix("-sdpa"))
        layer = model.get_base_model().model.layers[0]
        original = type(layer)
        handle = fastplug.patch_model(
            model, gradient_checkpointing=checkpointing, cuda_graphs=graphs, fp8=family.endswith("-fp8"),
            attention=not family.endswith("-sdpa"),
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[graphs] = (train_losses(model, model, batches, fused=True, accumulate=2), _adapters(model))
        if graphs:
            summary, replays = handle.summary(), handle.graphs.replays
            failed = [
                str(w.message) for w in caught if "CUDA graph capture of the decoder layers failed" in str(w.message)
            ]
        handle.restore()
        assert type(layer) is original
    (eager_losses, eager_params), (graph_losses, graph_params) = results[False], results[True]
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=2e-3, atol=2e-3)
    for name, want in eager_params.items():
        assert_close(graph_params[name], want, torch.bfloat16, name)
    assert not failed, failed
    assert replays >= 8 * 4, summary  # steps 3..12 of 4 layers replayed
    assert "1 call signature(s) captured" in summary


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "gemma4"])
def test_new_lengths_are_captured_at_their_first_sighting_and_train_like_eager(family):
    """Batches of changing lengths, as a Trainer's dynamic padding gives them: once the first shape ran eagerly,
    each new length of a stack whose layers take like inputs (Llama, Gemma2, Gemma3) is captured at its first
    sighting from layer 0's inputs, with no eager step (the second, with the capture's warm-up), and the first
    shape when it repeats; Gemma 4's global layers take wider rotary tables than its sliding ones, so each of its
    new lengths runs eagerly once and is captured when it repeats (the first arena, sized at the second shape,
    has room for all of them). Losses and adapters equal the eager layers'."""
    from fastplug.patch.layer_graphs import FIRST_SIGHTING

    gen = torch.Generator().manual_seed(11)
    lengths = [128, 160, 160, 192, 128, 224, 128, 192, 224, 160]
    batches = [torch.randint(0, 1000, (2, n), generator=gen).cuda() for n in lengths]
    results = {}
    for graphs_on in (False, True):
        model = _model(family)
        handle = fastplug.patch_model(model, cuda_graphs=graphs_on)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train_losses(model, model, batches, fused=True, after_forward=lambda _: gc.collect())
        results[graphs_on] = (losses, _adapters(model))
        if graphs_on:
            graphs, summary = handle.graphs, handle.summary()
            failed = [str(w.message) for w in caught if "CUDA graph capture of the decoder layers" in str(w.message)]
            first_sightings, inferred, replays = graphs.eager[FIRST_SIGHTING], len(graphs._inferred), graphs.replays
        handle.restore()
    assert not failed, failed
    if family == "gemma4":
        assert inferred == 0 and first_sightings == 4, summary
    else:
        assert inferred == 3 and first_sightings == 1, summary
    assert replays >= 4 * 4, summary
    torch.testing.assert_close(torch.tensor(results[True][0]), torch.tensor(results[False][0]), rtol=2e-3, atol=2e-3)
    for name, want in results[False][1].items():
        assert_close(results[True][1][name], want, torch.bfloat16, name)


def _right_padded(gen: torch.Generator, lengths: list[int]) -> dict:
    """A collator's right-padded batch of rows of these lengths on the GPU, the pads' labels ignored."""
    ids = torch.randint(1, 1000, (len(lengths), max(lengths)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=ids.masked_fill(mask == 0, -100).cuda())


def _train(model, batches) -> list[float]:
    """One fused-AdamW step per batch; the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    losses = []
    model.train()
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_padded_rows_packed_into_one_replay_like_eager(family):
    """A Trainer's dynamic padding (right-padded rows of varied lengths, the pads' labels ignored): the loss path
    packs the real tokens into one row, each row a document whose bounds the layers take as one more input, and
    the layer graphs capture and replay it (Gemma2: a sliding window shorter than some rows) with the losses and
    adapters of the eager layers. With the graphs, the 320-token bucket's batches are padded on to 384 once that
    is captured."""
    gen = torch.Generator().manual_seed(12)
    shapes = [[200, 90], [150, 150, 60], [200, 90], [120, 180], [150, 150, 60], [200, 90], [120, 180]]
    batches = [_right_padded(gen, lengths) for lengths in shapes]  # 290, 360, 300 real tokens: buckets 320, 384
    results = {}
    for graphs_on in (False, True):
        model = _model(family)
        handle = fastplug.patch_model(model, cuda_graphs=graphs_on, bucket_lengths=True)
        results[graphs_on] = (_train(model, batches), _adapters(model))
        summary, paths = handle.summary(), handle.batch_paths
        packed = "padding dropped, rows packed into one of "
        at_320 = paths[packed + "a bucket length (320)"]
        if graphs_on:  # 384 is captured at its first sighting (the second batch): 320's batches are padded on to it
            at_320 += paths[packed + "a longer length the graphs replay (384)"]
        assert at_320 == 5, summary
        if graphs_on:
            assert handle.graphs.replays >= 4 * 4, summary
        handle.restore()
    torch.testing.assert_close(torch.tensor(results[True][0]), torch.tensor(results[False][0]), rtol=2e-3, atol=2e-3)
    for name, want in results[False][1].items():
        assert_close(results[True][1][name], want, torch.bfloat16, name)


def test_a_shorter_batch_replays_a_longer_captured_length_like_eager():
    """Packed rows whose bucket is not captured, within reach of a longer length that is (models/padding.RowLengths):
    padded on to that length and replayed, with no capture of their own, and the losses and adapters of eager
    layers running each batch at its own bucket."""
    gen = torch.Generator().manual_seed(13)
    # 900 real tokens (bucket 1024) seen and captured, then 290 and 500 (buckets 320 and 512) replay at 1024
    shapes = [[600, 300], [500, 400], [200, 90], [300, 200], [700, 200], [200, 90]]
    batches = [_right_padded(gen, lengths) for lengths in shapes]
    results = {}
    for graphs_on in (False, True):
        model = _model("llama")
        handle = fastplug.patch_model(model, cuda_graphs=graphs_on, bucket_lengths=True)
        results[graphs_on] = (_train(model, batches), _adapters(model))
        summary = handle.summary()
        if graphs_on:
            assert "rows packed into one of a longer length the graphs replay (1024): 3" in summary, summary
            assert handle.graphs.replayed_lengths(1) == {1024}, summary
            assert handle.graphs.replays >= 4 * 4, summary
        else:
            assert "rows packed into one of a bucket length (320): 2" in summary, summary
        handle.restore()
    torch.testing.assert_close(torch.tensor(results[True][0]), torch.tensor(results[False][0]), rtol=2e-3, atol=2e-3)
    for name, want in results[False][1].items():
        assert_close(results[True][1][name], want, torch.bfloat16, name)


def test_two_forwards_before_backward_fall_back_to_eager():
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 1000, (2, 128), generator=gen).cuda() for _ in range(4)]
    grads = {}
    for graphs in (False, True):
        model = _model("llama")
        handle = fastplug.patch_model(model, cuda_graphs=graphs)
        model.train()
        for ids in batches[:2]:  # the shape seen, then captured
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        first = model(input_ids=batches[2], labels=batches[2]).loss
        second = model(input_ids=batches[3], labels=batches[3]).loss  # layer graphs still await first's backward
        (first + second).backward()
        grads[graphs] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
        handle.restore()
    for name, want in grads[False].items():
        assert_close(grads[True][name], want, torch.bfloat16, name)


def test_disabled_adapters_after_capture_are_seen():
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(5)).cuda()
    model = _model("llama")
    handle = fastplug.patch_model(model, cuda_graphs=True)
    model.train()
    for _ in range(3):  # seen, captured, replayed
        model(input_ids=ids, labels=ids).loss.backward()
    assert handle.graphs.replays > 0
    with model.disable_adapter():
        without = model(input_ids=ids, labels=ids).loss
    with_adapters = model(input_ids=ids, labels=ids).loss
    handle.restore()
    with torch.no_grad(), model.disable_adapter():
        want = model(input_ids=ids, labels=ids).loss
    assert_close(without.detach(), want, torch.bfloat16, "loss with adapters disabled")
    assert (with_adapters - without).abs().item() > 1e-4, "the adapters change the loss (else nothing is tested)"


def test_default_graphs_capture_within_their_memory_cap():
    """cuda_graphs=None (the default) installs the graphs on a CUDA model; a shape whose predicted keep would pass
    graphs_memory runs eagerly and says why, with the numbers of cuda_graphs=False."""
    gen = torch.Generator().manual_seed(6)
    batches = [torch.randint(0, 1000, (2, n), generator=gen).cuda() for n in (128, 256, 512) for _ in range(3)]
    results = {}
    for options in (dict(cuda_graphs=False), dict(graphs_memory=1e-9), {}):
        model = _model("llama")
        handle = fastplug.patch_model(model, **options)
        results[str(options)] = train_losses(model, model, batches, fused=True)
        graphs, summary = handle.graphs, handle.summary()
        handle.restore()
        if options.get("cuda_graphs") is False:
            assert graphs is None
            continue
        assert graphs is not None and graphs.memory_cap == options.get("graphs_memory", 0.5), summary
        captured = int(summary.split(" call signature(s) captured")[0].rsplit(" ", 1)[1])
        if options:  # the first shape always (at its second step); the next two, at each of their steps, beyond the cap
            assert captured == 1 and graphs.eager["a batch shape beyond the graphs' memory cap (graphs_memory)"] == 6
        else:  # half the peak: at least the first shape (always captured), the others as their size allows
            assert captured >= 1 and graphs.replays > 0, summary
        assert graphs.kept > 0 and "keeping" in summary, summary
    want = torch.tensor(results[str(dict(cuda_graphs=False))])
    for key, losses in results.items():
        torch.testing.assert_close(torch.tensor(losses), want, rtol=2e-3, atol=2e-3, msg=key)


def test_shapes_share_the_arena_and_a_larger_shape_replaces_it():
    """Shapes captured one after another share one arena of hidden states, sized for the largest shape seen; a larger
    shape later brings a new arena (the shapes captured in the old one are captured again at their next sighting,
    into a new memory pool: the old one goes with its graphs, which a collection at each step frees), and every
    step trains as the eager layers do, gradient accumulation included."""
    gen = torch.Generator().manual_seed(7)
    lengths = [128, 128, 192, 192, 128, 128, 512, 512, 128, 192, 512, 128, 192]
    batches = [torch.randint(0, 1000, (2, n), generator=gen).cuda() for n in lengths]
    results = {}
    for graphs_on in (False, True):
        model = _model("llama")
        handle = fastplug.patch_model(model, cuda_graphs=graphs_on)
        losses = train_losses(model, model, batches, fused=True, after_forward=lambda _: gc.collect())
        losses += train_losses(model, model, batches[:6], fused=True, accumulate=2)
        results[graphs_on] = (losses, _adapters(model))
        graphs, summary = handle.graphs, handle.summary()
        if graphs_on:
            assert graphs.replays >= 10 * 4, summary
            assert graphs._arena is not None and graphs._arena.numel == 2 * 512 * 512, summary
            assert graphs.kept >= graphs._arena.nbytes, summary
        handle.restore()
    torch.testing.assert_close(torch.tensor(results[True][0]), torch.tensor(results[False][0]), rtol=2e-3, atol=2e-3)
    for name, want in results[False][1].items():
        assert_close(results[True][1][name], want, torch.bfloat16, name)


def test_a_users_cuda_graph_of_fused_lora_reads_the_adapters_at_replay():
    """Captured fused LoRA (forward and backward) caches no adapter cast: after the fp32 adapters change in place
    (as fused AdamW writes them: no version bump through .data), a replay gives the eager result of the new
    adapters, and the capture left nothing in the caches."""
    from fastplug.kernels import lora
    from fastplug.kernels.lora import casts as lora_casts

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(384, 256, device="cuda", generator=gen, dtype=torch.bfloat16) / 16
    a = (torch.randn(16, 256, device="cuda", generator=gen) / 16).requires_grad_()
    b = (torch.randn(384, 16, device="cuda", generator=gen) / 16).requires_grad_()
    x = torch.randn(4, 100, 256, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(4, 100, 384, device="cuda", generator=gen, dtype=torch.bfloat16)

    def step():
        y = lora.lora_linear(x, lora.LoRAProjection(weight, None, a, b, 2.0))
        return (y, *torch.autograd.grad(y, (x, a, b), dy))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    lora.invalidate_adapter_casts()
    lora_casts._CAST_CACHE.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert not lora_casts._CAST_CACHE and not lora_casts._STACKED_ADAPTERS, "a capture cached adapter casts"
    for t in (a, b):
        t.data.add_(torch.randn(t.shape, device="cuda", generator=gen) / 16)
    graph.replay()
    want = step()
    for name, got, ref in zip(("y", "dx", "da", "db"), captured, want):
        assert_close(got, ref, torch.bfloat16, name)

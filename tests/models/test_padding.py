"""Padded training batches (models/padding.py): right padding runs without a mask and lengths round up to
buckets, with the loss and gradients of the batch as given; anything else runs as given."""

import copy

import pytest
import torch

from fastplug.models.fast_attention import UNREAD_MASK
from fastplug.models.padding import RowLengths, bucket_length, pad_slack
from fastplug.patch.engine import patch_model
from tests.helpers import assert_close
from tests.models.tiny import VOCAB, tiny_model


def test_buckets_cover_every_length_with_little_waste():
    lengths = range(1, 8193)
    buckets = [bucket_length(n) for n in lengths]
    assert all(b >= n for n, b in zip(lengths, buckets))
    assert all(a <= b for a, b in zip(buckets, buckets[1:])), "monotonic"
    assert all(b - n < b / 5 for n, b in zip(lengths, buckets) if n > 64), "less than a fifth is padding"
    assert bucket_length(1) == 64 and bucket_length(65) == 80 and bucket_length(2049) == 2560
    assert len(set(bucket_length(n) for n in range(64, 4097))) == 25  # 64, then four per doubling


def _padded_batch(lengths, right=True, seed=5):
    g = torch.Generator().manual_seed(seed)
    tokens = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), tokens), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        if right:
            mask[row, :n] = 1
        else:
            mask[row, tokens - n :] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)  # DataCollatorForLanguageModeling's labels
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _decoder_inputs(model):
    """What the decoder stack is called with: (its rows, their length, whether it got a mask: "unread" for one no
    mask function reads), per forward."""
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        seen.append((*ids.shape, "unread" if getattr(mask, UNREAD_MASK, False) else mask is not None))

    return seen, model.model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize(
    "family, buckets, right, lengths, expected",
    [
        # right padding: the 28 real tokens packed into one row (its mask unread), in its bucket (the smallest)
        ("llama", True, True, [13, 6, 9], (1, 64, "unread")),
        ("llama", True, True, [13, 13], (2, 64, "unread")),  # no padding: nothing to pack, rows padded on to a bucket
        ("llama", False, False, [13, 6, 9], (3, 13, True)),  # left padding: the mask, as given
        ("gemma2", False, True, [13, 6, 9], (1, 28, "unread")),  # softcap and a window: packed rows all the same
        ("qwen3_moe", True, True, [13, 6, 9], (1, 64, "unread")),  # the router's balance loss sees only real tokens
    ],
)
def test_padded_batches_train_like_transformers(family, buckets, right, lengths, expected):
    reference = tiny_model(family).train()
    model = copy.deepcopy(reference)
    # the self-check runs on the first case (its batch is padded to a bucket too); the others save its time
    patch_model(model, gradient_checkpointing=False, bucket_lengths=buckets, self_check=family == "llama")
    inputs = _padded_batch(lengths, right=right)
    seen, hook = _decoder_inputs(model)
    out, grads = _step(model, inputs)
    hook.remove()
    assert seen == [expected]
    ref, ref_grads = _step(reference, inputs)
    assert_close(out.loss, ref.loss, torch.float32, "loss")
    if getattr(ref, "aux_loss", None) is not None:
        assert_close(out.aux_loss, ref.aux_loss, torch.float32, "aux_loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}")


def test_pads_that_predict_a_label_keep_the_mask():
    """Labels left at the padding (a collator that copies input_ids): the pads' predictions count, and they
    depend on the mask, so the batch runs masked and the loss is transformers'."""
    reference = tiny_model("llama").train()
    model = copy.deepcopy(reference)
    patch_model(model, gradient_checkpointing=False, bucket_lengths=True, self_check=False)
    inputs = _padded_batch([13, 6])
    inputs["labels"] = inputs["input_ids"].clone()  # pad id 0 as a label
    seen, hook = _decoder_inputs(model)
    out, _ = _step(model, inputs)
    hook.remove()
    assert seen == [(2, 13, True)]
    assert_close(out.loss, _step(reference, inputs)[0].loss, torch.float32, "loss")


def test_hidden_states_asked_for_keep_the_batch_as_given():
    model = tiny_model("llama").train()
    patch_model(model, gradient_checkpointing=False, bucket_lengths=True)
    seen, hook = _decoder_inputs(model)
    model(**_padded_batch([13, 6]), output_hidden_states=True)
    hook.remove()
    assert seen == [(2, 13, True)]


def test_summary_tallies_the_path_of_each_training_batch():
    model = tiny_model("llama").train()
    handle = patch_model(model, gradient_checkpointing=False, bucket_lengths=True, self_check=False)
    for right in (True, True, False):
        model(**_padded_batch([13, 6], right=right))
    assert (
        "padded training batches (models/padding.py): padding dropped, rows packed into one of a bucket length (64): "
        "2; "
        "as given: padding not on the right: 1" in handle.summary()
    )


def _layer_lengths(model):
    """The sequence length the first decoder layer runs, per forward."""
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    return seen, hook


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("lengths", [[13, 6, 9], [13, 13]])
def test_a_loss_of_its_own_on_the_hidden_states_trains_on_bucketed_rows(family, lengths):
    """A loss path that is not fastplug's (TRL's LM head, a user's loss on the hidden states) calls the decoder
    stack itself: its rows are padded on to a bucket there and its hidden states trimmed back, so the loss and
    gradients are those of the batch as given, with or without padding in the batch (each row's mask goes on
    with its last value). The rows are not packed: the caller may read the pads' hidden states. The MoE model's
    router logits are not asked for (they would keep the batch as given)."""
    reference = tiny_model(family, **({"output_router_logits": False} if family == "qwen3_moe" else {})).train()
    model = copy.deepcopy(reference)
    handle = patch_model(model, gradient_checkpointing=False, bucket_lengths=True, self_check=False)
    inputs = _padded_batch(lengths)
    weights = torch.randn(13, model.config.hidden_size, generator=torch.Generator().manual_seed(3))

    def step(m):
        m.zero_grad(set_to_none=True)
        hidden = m.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
        loss = (hidden * weights * inputs["attention_mask"][..., None]).sum()
        loss.backward()
        return hidden, loss, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    seen, hook = _layer_lengths(model)
    hidden, loss, grads = step(model)
    hook.remove()
    assert seen == [64] and hidden.shape[1] == 13, "padded on inside, trimmed back outside"
    ref_hidden, ref_loss, ref_grads = step(reference)
    mask = inputs["attention_mask"].bool()
    assert_close(hidden[mask], ref_hidden[mask], torch.float32, "hidden states of the real tokens")
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}")
    assert "decoder inputs padded on to a bucket length (64): 1" in handle.summary()
    handle.restore()
    assert "forward" not in vars(model.model), "restore() takes the decoder's wrapper away"


@pytest.mark.parametrize(
    "call, reason",
    [
        (dict(position_ids=torch.arange(13).expand(2, 13)), "packed rows, positions or a cache passed"),
        (dict(output_hidden_states=True), "hidden states, attentions or router logits asked for"),
        (dict(output_router_logits=True), "hidden states, attentions or router logits asked for"),
        (dict(inputs_embeds=torch.randn(2, 13, 64)), "embeddings, not token ids"),
        (dict(token_type_ids=torch.zeros(2, 13, dtype=torch.long)), "a per-token argument (token_type_ids)"),
    ],
)
def test_the_decoder_runs_as_given_what_it_cannot_pad(call, reason):
    model = tiny_model("llama").train()
    handle = patch_model(model, gradient_checkpointing=False, bucket_lengths=True, self_check=False)
    inputs = _padded_batch([13, 13])
    if "inputs_embeds" in call:
        call = dict(inputs_embeds=torch.randn(2, 13, model.config.hidden_size))
        inputs.pop("input_ids")
    seen, hook = _layer_lengths(model)
    model.model(**{k: v for k, v in inputs.items() if k != "labels"}, **call)
    hook.remove()
    assert seen == [13]
    if "inputs_embeds" not in call:  # no token ids: no length to tally
        assert f"decoder inputs as given: {reason}: 1" in handle.summary()
    handle.restore()


class _Replayed:
    """A stand-in for the patch's layer graphs as `RowLengths` asks them: the lengths they replay per row count,
    and whether they may capture another shape."""

    def __init__(self, lengths: dict, may_capture: bool = True):
        self.lengths, self.capture = lengths, may_capture

    def replayed_lengths(self, rows):
        return self.lengths.get(rows, set())

    def may_capture(self):
        return self.capture


def test_row_lengths_pad_on_to_a_longer_length_the_graphs_replay_until_its_own_bucket_pays():
    lengths = RowLengths()
    assert lengths.fit(1, 290) == 320, "no graphs: the bucket"
    lengths.graphs = _Replayed({1: {1024, 8192}, 4: {600}})
    assert lengths.fit(1, 1024) == 1024, "captured itself"
    assert lengths.fit(1, 290) == 1024, "the bucket (320) is not captured: within the slack of a replayed length"
    assert lengths.fit(1, 3000) == 3072, "the next replayed length (8192) is more than twice its bucket away"
    assert lengths.fit(4, 290) == 600 and lengths.fit(2, 290) == 320, "lengths are per row count"
    assert lengths.fit(1, 5000) == 8192, "within twice the bucket (5120)"
    served = [lengths.fit(1, 700) for _ in range(12)]
    # the bucket 768 is served at 1024 eight times, then gets its own length, to be captured
    assert served == [1024] * 8 + [768] * 4, served
    full = RowLengths()
    full.graphs = _Replayed({1: {1024}}, may_capture=False)
    assert {full.fit(1, 700) for _ in range(20)} == {1024}, "beyond the graphs' cap: padded on, never eager"


def test_the_slack_to_a_replayed_length_shrinks_as_the_layers_widen():
    """Rent or buy, per token a layer: wider layers pad fewer tokens on before their bucket is captured. A MoE
    layer's experts count at top_k / experts; no stack known: 2,048 tokens."""
    import transformers

    from fastplug.bench.presets import MODELS

    def slack(config):
        config.num_hidden_layers = 1
        with torch.device("meta"):  # real widths, no memory
            model = transformers.AutoModelForCausalLM.from_config(config)
        return pad_slack(list(model.model.layers), model.config)

    def preset(name, **overrides):
        return getattr(transformers, MODELS[name]["config"])(**{**MODELS[name]["full"], **overrides})

    llama_1b, llama_8b = slack(preset("llama")), slack(preset("llama", hidden_size=4096, intermediate_size=14336))
    assert 2800 < llama_1b < 3100 and 700 < llama_8b < 1000, (llama_1b, llama_8b)
    moe, all_experts = slack(preset("qwen3_moe")), slack(preset("qwen3_moe", num_experts_per_tok=64))
    assert 2900 < moe < 3400 and all_experts < moe / 5, (moe, all_experts)
    assert pad_slack([], None) == 2048 and RowLengths().slack == 2048
    assert pad_slack([torch.nn.Linear(4, 4)], None) == 16384, "a tiny layer: the range's top"

    wide, narrow = RowLengths(llama_8b), RowLengths(llama_1b)
    wide.graphs = narrow.graphs = _Replayed({1: {3072}})
    assert narrow.fit(1, 730) == 3072, "Llama-1B: 768 padded on to 3,072 (2,304 tokens more)"
    assert wide.fit(1, 730) == 768, "at 8B widths those tokens cost more than their share of a capture"
    handle = patch_model(tiny_model("llama"), bucket_lengths=True, self_check=False, gradient_checkpointing=False)
    try:
        assert handle.row_lengths.slack == 16384, "the patch sizes it for its model's layers"
    finally:
        handle.restore()


def test_a_batch_padded_on_to_a_replayed_length_trains_like_transformers(monkeypatch):
    """Rows packed into one row and padded on to a longer length the layer graphs replay (stood in for here: a CPU
    has no graphs): the pads are short documents of their own, the LM head sees only the real tokens, and the
    loss and gradients are transformers'."""
    from fastplug.models import lm_head
    from fastplug.models.fast_attention import DOCUMENT_BOUNDS

    reference = tiny_model("llama").train()
    model = copy.deepcopy(reference)
    handle = patch_model(model, gradient_checkpointing=False, bucket_lengths=True, self_check=False)
    handle.row_lengths.graphs = _Replayed({1: {256}})
    inputs = _padded_batch([13, 6, 9])
    bounds, head_rows = [], []
    bounds_hook = model.model.register_forward_pre_hook(
        lambda m, args, kwargs: bounds.append(kwargs[DOCUMENT_BOUNDS]), with_kwargs=True
    )
    fused = lm_head.fused_linear_cross_entropy
    monkeypatch.setattr(
        lm_head, "fused_linear_cross_entropy", lambda x, *a, **k: head_rows.append(len(x)) or fused(x, *a, **k)
    )
    seen, hook = _decoder_inputs(model)
    out, grads = _step(model, inputs)
    hook.remove()
    bounds_hook.remove()
    assert seen == [(1, 256, "unread")]
    assert head_rows == [28], "the head's rows: the real tokens only"
    start, end = (b[0].long() for b in bounds[0])
    assert ((end - start)[28:] <= 64).all() and (start[28:] >= 28).all(), "pads: short documents after the real ones"
    assert "rows packed into one of a longer length the graphs replay (256): 1" in handle.summary()
    ref, ref_grads = _step(reference, inputs)
    assert_close(out.loss, ref.loss, torch.float32, "loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, f"grad of {name}")
    handle.restore()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize(
    "batch, expected",
    [
        ("padded", (1, 64, "unread")),  # packed
        ("unpadded", (2, 64, "unread")),  # nothing to pack: padded on to a bucket
        ("no mask", (2, 64, "unread")),  # input_ids and labels only, as a loop of the user's may pass them
    ],
)
def test_a_step_reads_nothing_from_the_device_but_the_padding(family, batch, expected, monkeypatch):
    """A training step's one host read is the padding check (`padding_facts`, which a trainer's collator makes on
    the host instead): given no mask, transformers would look for packed rows in the positions it numbers (a `bool()`
    per mask built: Gemma2 builds two), so the decoder gets a mask that no mask function reads. The loss is
    transformers'."""
    reference = tiny_model(family).train()
    model = copy.deepcopy(reference)
    patch_model(model, gradient_checkpointing=False, bucket_lengths=True, self_check=False)
    inputs = _padded_batch([13, 6, 9] if batch == "padded" else [13, 13])
    if batch == "no mask":
        del inputs["attention_mask"]
    asked = []
    to_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: asked.append(t.shape) or to_bool(t))
    seen, hook = _decoder_inputs(model)
    out, _ = _step(model, inputs)
    hook.remove()
    monkeypatch.setattr(torch.Tensor, "__bool__", to_bool)
    assert asked == [], asked
    assert seen == [expected]
    assert_close(out.loss, _step(reference, inputs)[0].loss, torch.float32, "loss")


def test_a_model_with_layers_beside_the_attention_gets_no_mask_it_would_not_read():
    """Where some layers mix tokens outside fastplug's attention (Qwen3.5's Gated DeltaNet reads the mask, and
    transformers tests it for all ones, a host read), unpadded rows reach the decoder as given, without a mask."""
    from tests.models.test_qwen3_5 import tiny as tiny_qwen3_5

    model = tiny_qwen3_5("qwen3_5").train()
    patch_model(model, gradient_checkpointing=False, bucket_lengths=False, self_check=False)
    inputs = _padded_batch([13, 13])
    del inputs["attention_mask"]
    seen, hook = _decoder_inputs(model)
    model(**inputs)
    hook.remove()
    assert seen == [(2, 13, False)]

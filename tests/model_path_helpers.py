"""Tiny models saved to a folder with a locally built tokenizer, for the FastModel and fast_generate tests."""

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.models.tiny import VOCAB, tiny_model

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
PAD, EOS, BOS = 0, 1, 2


def char_tokenizer(pad: bool = True) -> PreTrainedTokenizerFast:
    """Characters as tokens (ids below the tiny models' vocab of 128)."""
    chars = sorted(set(string.ascii_letters + string.digits + " .,"))
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    assert len(vocab) <= VOCAB
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    specials = dict(eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    if pad:
        specials["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)


def save_tiny(path, family: str = "llama", tokenizer_pad: bool = True, seed: int = 0, **overrides):
    """A tiny random `family` model and a char tokenizer saved under `path`; returns path as str."""
    moe = {"output_router_logits": False} if family in ("mixtral", "qwen2_moe", "qwen3_moe") else {}
    model = tiny_model(family, seed=seed, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, **moe, **overrides)
    model.save_pretrained(path)
    char_tokenizer(pad=tokenizer_pad).save_pretrained(path)
    return str(path)

"""Packed rows (varlen): per-token document bounds, the form the kernels take packed documents in.

Varlen: packed documents lie in one row, q (1, Hq, total, D), k/v (1, Hkv, total, D), `cu_seqlens` int32
(n+1) gives their boundaries. Internally every token carries its document's [start, end), so the grid runs
over the packed row as if it were one sequence and needs no max_seqlen and no host sync; the model
integration builds those bounds straight from position_ids (`packed_bounds`).

A padded batch takes the same form: right-padded rows get exact per-token bounds (`right_padding_bounds`).
"""

from __future__ import annotations

import torch


def bounds_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (shape (1, total), int32): the start and end of its document. On the device, no host sync."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    doc = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    return cu_seqlens[doc].view(1, total), cu_seqlens[doc + 1].view(1, total)


def packed_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (B, T) int32: start and end of its document, from position_ids that restart per document.

    A document starts wherever the position does not follow the previous one by 1 (transformers'
    `find_packed_sequence_indices` rule), so rows of one unpacked sequence give (0, T). Device ops only,
    no host sync: the model integration calls this inside the layer stack."""
    B, T = position_ids.shape
    idx = torch.arange(T, device=position_ids.device, dtype=torch.int32).expand(B, T)
    is_start = torch.ones((B, T), dtype=torch.bool, device=position_ids.device)
    is_start[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    start = torch.where(is_start, idx, 0).cummax(dim=1).values
    next_start = torch.full((B, T), T, dtype=torch.int32, device=position_ids.device)
    next_start[:, :-1] = torch.where(is_start[:, 1:], idx[:, 1:], T)
    end = next_start.flip(1).cummin(dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def right_padding_bounds(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a 2-D padding mask (B, T) (nonzero: a real token): ((2, B, T) int32 per-token (start, end)), and a
    bool per row: whether the row is right-padded (its real tokens, at least one, come first).

    For right-padded rows the bounds are exact, pad tokens included: with causality, token i sees the real
    keys j <= i, which is what transformers' padded mask lets every query see. The kernel reads a token's
    bounds both as the keys it sees and as the queries that see it, so real tokens get (0, T) (as queries
    causality keeps them to real keys; as keys every later token, pads too, sees them) and pads (0, real
    count) (as queries they see the real keys; as keys no one). A left pad query sees no key at all in
    transformers (its row is fully masked: eager then averages over every key), which bounds cannot
    express: callers check `right_padded` first. Device ops only, no host sync."""
    valid = valid.bool()
    B, T = valid.shape
    count = valid.sum(dim=1)
    leading = valid.int().cumprod(dim=1).sum(dim=1)  # real tokens before the first pad
    right_padded = (leading == count) & (count > 0)
    end = torch.where(valid, T, count[:, None]).to(torch.int32)
    return torch.stack((torch.zeros_like(end), end)), right_padded


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32, max_seqlen) for one packed row of position_ids (shape (total,) or (1, total)) that
    restart per document, as TRL's padding-free collator builds them.

    This syncs with the host, unavoidably: cu_seqlens' length (documents + 1) and max_seqlen depend on the
    data. Inside a model prefer `packed_bounds`, which the kernel takes directly and which does not sync."""
    pos = position_ids.reshape(-1) if position_ids.dim() == 1 or position_ids.shape[0] == 1 else None
    if pos is None:
        raise ValueError(f"position_ids must be one packed row (total,) or (1, total); got {tuple(position_ids.shape)}")
    total = pos.numel()
    starts = torch.ones(total, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] - pos[:-1] != 1
    cu = torch.cat((starts.nonzero().flatten(), torch.tensor([total], device=pos.device))).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())

"""Attention math shared by V4 and V4.1 (reference path): cache writes, the sliding-window keys of a query block,
the sink softmax over window ++ compressed keys, and the grouped output projection."""

from __future__ import annotations

import torch

from dsv4.kv.spec import PAD_SLOT
from dsv4.runtime.attn_metadata import slots_of

QUERY_BLOCK = 128  # queries per attention block: memory stays O(block * (block + window + entries))


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slot] = row for every slot that is not PAD_SLOT."""
    keep = slots != PAD_SLOT
    if bool(keep.all()):
        cache[slots] = rows.to(cache.dtype)
    else:
        cache[slots[keep]] = rows[keep].to(cache.dtype)


def window_keys(cache: torch.Tensor, table_row: torch.Tensor, block_size: int, qpos: torch.Tensor,
                window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys of a block of consecutive query positions `qpos` of one request, and their 0/-inf bias:
    query t sees keys (t - window, t]. Only positions [qpos[0] - window + 1, qpos[-1]] are read."""
    p0, p1 = int(qpos[0]), int(qpos[-1]) + 1
    kpos = torch.arange(max(0, p0 - window + 1), p1, device=qpos.device)
    keys = cache[slots_of(table_row, kpos, block_size)]
    seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
    return keys, torch.zeros(seen.shape, device=qpos.device).masked_fill(~seen, float("-inf"))


def sink_attention(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One softmax over keys plus a per-head sink logit that has no value row.

    q [Q, H, D], k [L, D] (K = V, shared by all heads), bias [Q, L] (0 or -inf) -> [Q, H, D].
    A query whose keys are all masked gets weight only on the sink, i.e. a zero output.
    """
    logits = torch.einsum("qhd,ld->hql", q.float(), k.float()) * scale + bias.unsqueeze(0)
    sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("hql,ld->qhd", probs, k.float()).to(q.dtype)


def grouped_projection(out: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """The grouped first half of the output projection: heads split into `groups` groups (head-major), group g
    through block g of `weight` [G*o_lora, H*D/G]: [T, H, D] -> [T, G*o_lora]."""
    T = out.shape[0]
    grouped = out.reshape(T, groups, -1).transpose(0, 1)  # [G, T, H*D/G]
    w = weight.view(groups, -1, grouped.shape[-1])  # [G, o_lora, H*D/G]
    return torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(T, -1)


def sink_attention_rows(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Decode form of `sink_attention`: one query per row over that row's own keys.

    q [R, H, D], k [R, L, D], mask [R, L] (True = visible) -> [R, H, D]; fixed shapes, so it can be captured.
    """
    logits = torch.einsum("rhd,rld->rhl", q.float(), k.float()) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("rhl,rld->rhd", probs, k.float()).to(q.dtype)

"""Attention math shared by V4 and V4.1: cache writes, the sink softmax of one query per row over its own keys (the
reference of dsv4/ops/decode_attention.py), and the grouped output projection."""

from __future__ import annotations

import torch
from torch import nn

from dsv4.kv.spec import PAD_SLOT, TRASH_SLOT


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slot] = row for every slot that is not PAD_SLOT. A PAD_SLOT row goes to TRASH_SLOT (the null block's
    slot 0, which nothing reads unmasked), as the decode path's masked writes do: no host check of the slots, which
    on a GPU is a device sync in every layer of a prefill step."""
    cache[torch.where(slots == PAD_SLOT, TRASH_SLOT, slots)] = rows.to(cache.dtype)


def grouped_projection(out: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """The grouped first half of the output projection: heads split into `groups` groups (head-major), group g
    through block g of `weight` [G*o_lora, H*D/G]: [T, H, D] -> [T, G*o_lora]."""
    T = out.shape[0]
    grouped = out.reshape(T, groups, -1).transpose(0, 1)  # [G, T, H*D/G]
    w = weight.view(groups, -1, grouped.shape[-1])  # [G, o_lora, H*D/G]
    return torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(T, -1)


def project_groups(out: torch.Tensor, proj: nn.Module, groups: int) -> torch.Tensor:
    """`grouped_projection` through the layer `proj` (an nn.Linear, or a quantized layer computing the same
    product from its stored weight: `dsv4.quant.layers.Fp8Linear`)."""
    if isinstance(proj, nn.Linear):
        return grouped_projection(out, proj.weight, groups)
    return proj(out.reshape(out.shape[0], -1), groups=groups)


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

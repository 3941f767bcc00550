"""The open-window ring of a compressor: raw (kv, gate) rows of the last few positions of each request.

A compressor pools the rows of every window of `ratio` tokens once the window is complete. A chunk may close
windows that started in an earlier step, so the rows of the last `cap` positions live in a per-request ring
(slot = position mod cap) in the KV cache's state group. Reading the ring for positions before the chunk and
the chunk's own rows after makes chunked prefill and decode pool exactly what one pass would.
"""

from __future__ import annotations

import torch


def window_rows(kv: torch.Tensor, gate: torch.Tensor, ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: int,
                p0: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One request's rows for positions [p0 - cap, p0 + len(kv)): the ring for the past, the chunk after.

    Positions before the sequence start get kv 0 and gate -inf (softmax weight 0). Returns (rows_kv, rows_gate,
    base); the row of position p is p - base.
    """
    cap = ring_kv.shape[1]
    past = torch.arange(p0 - cap, p0, device=kv.device)
    idx = past.remainder(cap)
    ext_kv = torch.cat([ring_kv[blk, idx].to(kv.dtype), kv], dim=0)
    ext_gate = torch.cat([ring_gate[blk, idx].to(gate.dtype), gate], dim=0)
    neg = past < 0
    ext_kv[:cap][neg] = 0
    ext_gate[:cap][neg] = float("-inf")
    return ext_kv, ext_gate, p0 - cap


def closing_windows(p0: int, p1: int, ratio: int, device: torch.device) -> torch.Tensor:
    """Indices of the windows [w*ratio, (w+1)*ratio) whose last token lies in [p0, p1)."""
    return torch.arange(p0 // ratio, p1 // ratio, device=device)


def roll_ring(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: int, kv: torch.Tensor, gate: torch.Tensor,
              p0: int) -> None:
    """Keep the chunk's last `cap` rows (positions [p0, p0 + len(kv))) in the ring for the next step."""
    cap = ring_kv.shape[1]
    p1 = p0 + kv.shape[0]
    keep = torch.arange(max(p0, p1 - cap), p1, device=kv.device)
    ring_kv[blk, keep.remainder(cap)] = kv[keep - p0].to(ring_kv.dtype)
    ring_gate[blk, keep.remainder(cap)] = gate[keep - p0].to(ring_gate.dtype)

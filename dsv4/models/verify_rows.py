"""The compressors on a speculative verify step run as decode rows (dsv4/spec_decode/verify_decode.py): q = k + 1
rows per request, row j of a request at position p + j, all in one fixed-shape step.

The plain decode writes its one row into the request's ring of raw compressor rows (`cap` rows, slot = position %
cap) and pools the window ending at it from the ring. With q rows of one request in a step, rows of the same slot
would collide in that scatter (duplicate indices: an undefined winner) and a row would pool a partner written by a
later row. So here, as on the token-row path (`Compressor.forward` of either model), row j's window takes its rows
from the step itself where they lie in it (this step's own projections) and from the ring as the previous step left
it otherwise (read before any write); positions before the sequence start are masked (kv 0, gate -inf). Then only
each request's last `cap` rows write the ring (distinct slots; the others write the null block, as padding rows
do), so the ring ends holding the step's newest positions, exactly what the token-row path leaves.

Under speculation a ring keeps q rows more than its window (dsv4/kv/spec.py `ring_slack`), so every row of the step
writes the ring, overwriting only rows older than any window still to be pooled, and a rejection needs no restore
(speculator.py).
- DeepSeek-V4.1 (ratio-2 pairs, fp32 rings; `pool_verify_rows`).
- DeepSeek-V4 (CSA: 2 * ratio rows, overlapping windows; HCA: ratio rows; rings in the model dtype;
  `deepseek_v4.Compressor.forward_decode`): the same windows (`ops.compress_pool.step_windows`) are pooled by the
  decode pool kernel in one launch on CUDA (`pool_decode(..., query_len=q)`, which reads the step's rows where a
  window reaches into the step), then `roll_rings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.kv.spec import NULL_BLOCK
from dsv4.ops.compress_pool import step_windows
from dsv4.runtime.attn_metadata import DecodeMetadata
from dsv4.runtime.kv_cache import LayerKVCache

if TYPE_CHECKING:  # type only: deepseek_v41 imports this module
    from dsv4.models.deepseek_v41 import Compressor


def roll_rings(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
               dmd: DecodeMetadata) -> None:
    """Each request's last `cap` rows (consecutive positions: distinct slots) write their raw rows into its ring;
    the others write the null block, so no two rows of a request scatter to the same ring row."""
    q, cap = dmd.query_len, ring_kv.shape[1]
    pos, blk = dmd.positions, dmd.state_blocks
    last = torch.arange(kv.shape[0], device=kv.device) % q >= q - cap
    wblk = torch.where(last, blk, torch.full_like(blk, NULL_BLOCK))
    ring_kv[wblk, pos % cap] = kv.to(ring_kv.dtype)
    ring_gate[wblk, pos % cap] = gate.to(ring_gate.dtype)


def pool_verify_rows(compressor: "Compressor", x: torch.Tensor, dmd: DecodeMetadata,
                     cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's ratio-2 compressor on q rows a request: latents [P, D] and entry ids [P] of every row's
    window ending at the row (a row whose window does not close at it writes to TRASH_SLOT through `entry_write`, so
    its latent is never read), and the ring rolled forward."""
    m = compressor.ratio
    assert cache.ring_kv is not None and cache.ring_gate is not None
    kv, gate = compressor.project(x)
    wkv, wgate = step_windows(cache.ring_kv, cache.ring_gate, kv, gate, dmd.state_blocks, dmd.positions, dmd.query_len,
                              m)
    latent = compressor.pool(wkv, wgate, x.dtype)
    ent = ((dmd.positions + 1) // m - 1).clamp(min=0)
    roll_rings(cache.ring_kv, cache.ring_gate, kv, gate, dmd)
    return latent, ent

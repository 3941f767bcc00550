"""DeepSeek-V4.1's ratio-2 compressor on a speculative verify step run as decode rows (dsv4/spec_decode/
verify_decode.py): q = k + 1 rows per request, row j of a request at position p + j, all in one fixed-shape step.

The plain decode (`AttentionV41._publish_decode`) writes its one row into the request's ring (`ratio` rows, slot =
position % ratio) and pools the whole ring. With q rows of one request in a step, rows of the same slot would
collide in that scatter (duplicate indices: an undefined winner) and a row would pool a partner written by a later
row. So here, as on the token-row path (`Compressor.forward`), row j's window (positions p + j - ratio + 1 .. p + j)
takes its rows from the step itself where they lie in it (this step's own kv / gate projections) and from the ring
as the previous step left it otherwise (read before any write), and only each request's last `ratio` rows write
the ring (distinct slots; the others write the null block, as padding rows do), so the ring ends holding the
step's newest positions, exactly what the token-row path leaves.

After a rejection the speculator rewinds the request to the start of its open pair (speculator.py's module
docstring): the next step starts at an even position, which never reads the ring, so the rows the rejected
positions left there are never read. After full acceptance the ring holds the last two positions, both committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.kv.spec import NULL_BLOCK
from dsv4.runtime.attn_metadata import DecodeMetadata
from dsv4.runtime.kv_cache import LayerKVCache

if TYPE_CHECKING:  # type only: deepseek_v41 imports this module
    from dsv4.models.deepseek_v41 import Compressor


def pool_verify_rows(compressor: "Compressor", x: torch.Tensor, dmd: DecodeMetadata,
                     cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents [P, D] and entry ids [P] of every row's window ending at the row (a row whose window does not close
    at it writes to TRASH_SLOT through `entry_write`, so its latent is never read), and the ring rolled forward.
    Fixed shapes, no host sync (capturable): row b of the step is row b % q of its request (requests have q rows
    each, padding whole requests)."""
    m, q = compressor.ratio, dmd.query_len
    assert cache.ring_kv is not None and cache.ring_gate is not None
    cap = cache.ring_kv.shape[1]
    pos, blk = dmd.positions, dmd.state_blocks
    P = x.shape[0]
    dev = x.device
    rows = torch.arange(P, device=dev)
    j = rows % q  # the row's offset among its request's rows
    back = torch.arange(m, device=dev) - (m - 1)  # window row i is position pos - m + 1 + i
    in_step = (j[:, None] + back) >= 0  # [P, m]: the window row is an earlier row of this step (or the row itself)
    src = (rows[:, None] + back).clamp(min=0)
    # a position before the step: its ring slot (a negative position only for an open window: never read)
    slot = (pos[:, None] + back) % cap
    kv, gate = compressor.project(x)
    take = in_step[..., None]
    # the ring as the previous step left it: gathered (copies) before this step's rows overwrite it below
    wkv = torch.where(take, kv[src], cache.ring_kv[blk[:, None], slot].to(kv.dtype))
    wgate = torch.where(take, gate[src], cache.ring_gate[blk[:, None], slot].to(gate.dtype))
    latent = compressor.pool(wkv, wgate, x.dtype)
    ent = ((pos + 1) // m - 1).clamp(min=0)
    # each request's last `cap` rows (consecutive positions: distinct slots) roll the ring; the others write the
    # null block, so no two rows of a request scatter to the same ring row
    last = j >= q - cap
    wblk = torch.where(last, blk, torch.full_like(blk, NULL_BLOCK))
    cache.ring_kv[wblk, pos % cap] = kv.to(cache.ring_kv.dtype)
    cache.ring_gate[wblk, pos % cap] = gate.to(cache.ring_gate.dtype)
    return latent, ent

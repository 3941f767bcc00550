"""Engram lookback window: for each batch row, the `depth` token ids before its chunk start, gathered from the
device token history (runtime.md section 5.1, the seed's model state).

Row b holds the ids at chunk_start-1, chunk_start-2, ..., chunk_start-depth of state row idx_mapping[b]; -1 where
that position is negative and for every row past the batch (so padded graph rows read "no history"). The torch
op is the reference and the CPU path; the Triton kernel is one program per row of the persistent buffer.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton use the torch op
    triton = None


def gather_lookback_torch(out: torch.Tensor, idx_mapping: torch.Tensor, chunk_starts: torch.Tensor,
                          token_history: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """Fill `out [max_rows, depth]` in place and return it."""
    depth = out.shape[1]
    out.fill_(-1)
    if num_reqs == 0:
        return out
    pos = chunk_starts[:num_reqs, None].long() - 1 - torch.arange(depth, device=out.device)  # [R, depth]
    rows = idx_mapping[:num_reqs, None].long().expand(-1, depth)
    ids = token_history[rows, pos.clamp(min=0)]
    out[:num_reqs] = torch.where(pos >= 0, ids, torch.full_like(ids, -1)).to(out.dtype)
    return out


if triton is not None:

    @triton.jit
    def _gather_lookback_kernel(out_ptr, idx_ptr, start_ptr, start_stride, hist_ptr, hist_stride, num_reqs,
                                DEPTH: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        d = tl.arange(0, BLOCK)
        dmask = d < DEPTH
        if b < num_reqs:
            row = tl.load(idx_ptr + b).to(tl.int64)
            pos = tl.load(start_ptr + b * start_stride).to(tl.int64) - 1 - d
            ok = dmask & (pos >= 0)
            ids = tl.load(hist_ptr + row * hist_stride + pos, mask=ok, other=-1)
            tl.store(out_ptr + b * DEPTH + d, ids.to(out_ptr.dtype.element_ty), mask=dmask)
        else:
            tl.store(out_ptr + b * DEPTH + d, tl.full([BLOCK], -1, out_ptr.dtype.element_ty), mask=dmask)


def gather_lookback_triton(out: torch.Tensor, idx_mapping: torch.Tensor, chunk_starts: torch.Tensor,
                           token_history: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """The same gather as one Triton launch over every row of `out` (rows past the batch get -1). `chunk_starts`
    may be a strided view (a uniform decode's starts are every q-th position: no index op needed)."""
    assert triton is not None, "triton is not installed"
    assert chunk_starts.dim() == 1, "chunk_starts is one start per row"
    depth = out.shape[1]
    _gather_lookback_kernel[(out.shape[0],)](
        out, idx_mapping, chunk_starts, chunk_starts.stride(0), token_history, token_history.stride(0), num_reqs,
        DEPTH=depth, BLOCK=triton.next_power_of_2(depth))
    return out


def gather_lookback(out: torch.Tensor, idx_mapping: torch.Tensor, chunk_starts: torch.Tensor,
                    token_history: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if out.is_cuda and triton is not None:
        return gather_lookback_triton(out, idx_mapping, chunk_starts, token_history, num_reqs)
    return gather_lookback_torch(out, idx_mapping, chunk_starts, token_history, num_reqs)

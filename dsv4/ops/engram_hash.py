"""Engram's n-gram hash of a step in one launch: the table row ids [T, (N-1)*H] of one Engram layer.

`dsv4.models.engram.engram_hash` is the reference, written as torch ops on [T, N] tensors: the request and chunk
position of each token, its n-gram slots from the chunk or the look-back ids, the sticky blocking of slots across a
gap (DEAD image tokens, the sequence start), then per slot a multiply-XOR hash and its remainder by each head's
prime. On a GPU that is ~43 kernels of 1-3 us each: 67.5 us of a batch-64 decode step of V4.1-Flash-8l on an H100
(benchmarks/results/2026-12-06-h100-decode-b64-splits, b64-both-on.log's timeline), and the released model hashes
for two Engram layers. Here one program a token does all of it in registers; integers throughout, so the row ids
equal the reference's exactly (the reference's products and XORs stay in [0, 2^63) by construction, so int64
arithmetic and the remainder agree).

On by default (DSV4_ENGRAM_HASH_KERNEL=0: the torch expression): the batch-64 decode replay 7.19 -> 7.13 ms on an
H100 (2026-12-06-h100-decode-optins); 3.5 us a call at batch 1.
"""

from __future__ import annotations

import os

import torch

from dsv4.models.engram import EngramLayout, engram_hash

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None

HASH_KERNEL = os.environ.get("DSV4_ENGRAM_HASH_KERNEL", "1") == "1"


if triton is not None:

    @triton.jit(do_not_specialize=["T", "R", "pad_id", "image_id"])
    def _engram_hash_kernel(ids_ptr, qsl_ptr, back_ptr, dead_ptr, map_ptr, mult_ptr, primes_ptr, offsets_ptr,
                            out_ptr, T, R, pad_id, image_id, N: tl.constexpr, H: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, HAS_DEAD: tl.constexpr,
                            HAS_IMAGE: tl.constexpr):
        """Token t: its request (how many chunks end at or before it), its place in the chunk, then slot s = 0..N-1
        holds the token at t - s inside the chunk, else look-back id s - local - 1 of its request (raw ids, mapped
        to compact ones; -1 and the image id are DEAD); a DEAD slot blocks itself and every later one (pad id).
        The hash: acc = tok_0 * m_0, then acc ^= tok_s * m_s; row id (s, h) = acc % prime[s-1, h] + offset."""
        t = tl.program_id(0).to(tl.int64)
        req = t * 0
        for r0 in range(0, R, BLOCK_R):  # qsl[1:R+1] <= t, counted
            r = r0 + tl.arange(0, BLOCK_R)
            ends = tl.load(qsl_ptr + 1 + r, mask=r < R, other=T + 1).to(tl.int64)
            req += tl.sum((ends <= t).to(tl.int64), axis=0)
        local = t - tl.load(qsl_ptr + req).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        hm = h < H
        blocked = local < 0  # (false: a scalar to carry)
        acc = t * 0
        for s in tl.static_range(N):
            in_chunk = s <= local
            src = tl.maximum(t - s, 0)
            tok = tl.load(ids_ptr + src, mask=in_chunk, other=0).to(tl.int64)
            back = s > local
            dead = local < 0
            if HAS_DEAD:
                dead = tl.load(dead_ptr + src, mask=in_chunk, other=0) != 0
            j = tl.minimum(tl.maximum(s - local - 1, 0), N - 2)
            raw = tl.load(back_ptr + req * (N - 1) + j, mask=back, other=0).to(tl.int64)
            dead_back = raw < 0
            if HAS_IMAGE:
                dead_back = dead_back | (raw == image_id)
            mapped = tl.load(map_ptr + tl.maximum(raw, 0), mask=back, other=0).to(tl.int64)
            tok = tl.where(in_chunk, tok, mapped)
            blocked = blocked | tl.where(in_chunk, dead, dead_back)
            tok = tl.where(blocked, pad_id, tok).to(tl.int64)
            term = tok * tl.load(mult_ptr + s).to(tl.int64)
            if s == 0:
                acc = term
            else:
                acc = acc ^ term
                primes = tl.load(primes_ptr + (s - 1) * H + h, mask=hm, other=1).to(tl.int64)
                offsets = tl.load(offsets_ptr + (s - 1) * H + h, mask=hm, other=0).to(tl.int64)
                tl.store(out_ptr + t * ((N - 1) * H) + (s - 1) * H + h, acc % primes + offsets, mask=hm)


def engram_hash_triton(comp_ids: torch.Tensor, query_start_loc: torch.Tensor, lookback: torch.Tensor,
                       dead: torch.Tensor | None, token_map: torch.Tensor, pad_id: int, layout: EngramLayout,
                       layer_id: int, image_token_id: int | None = None) -> torch.Tensor:
    """`engram_hash` in one launch (same arguments, same int64 row ids). `query_start_loc` must cover every token
    (its last entry >= T), as the reference's indexing needs too."""
    assert triton is not None, "triton is not installed"
    T, n = comp_ids.shape[0], lookback.shape[1] + 1
    mult, primes, offsets = layout.tensors(layer_id, comp_ids.device)
    H = primes.shape[1]
    assert mult.shape[0] == n and primes.shape[0] == n - 1, (mult.shape, primes.shape, n)
    out = torch.empty(T, (n - 1) * H, dtype=torch.int64, device=comp_ids.device)
    if T == 0:
        return out
    R = query_start_loc.shape[0] - 1
    dead_arg = dead.contiguous() if dead is not None else comp_ids
    _engram_hash_kernel[(T,)](
        comp_ids.contiguous(), query_start_loc.contiguous(), lookback.to(torch.int64).contiguous(), dead_arg,
        token_map.contiguous(), mult, primes.contiguous(), offsets.contiguous(), out, T, R, pad_id,
        image_token_id if image_token_id is not None else -1, N=n, H=H, BLOCK_H=max(2, triton.next_power_of_2(H)),
        BLOCK_R=max(2, min(128, triton.next_power_of_2(max(R, 1)))), HAS_DEAD=dead is not None,
        HAS_IMAGE=image_token_id is not None, num_warps=1)
    return out


def engram_hash_rows(comp_ids: torch.Tensor, query_start_loc: torch.Tensor, lookback: torch.Tensor,
                     dead: torch.Tensor | None, token_map: torch.Tensor, pad_id: int, layout: EngramLayout,
                     layer_id: int, image_token_id: int | None = None) -> torch.Tensor:
    """The one launch on CUDA where switched on (HASH_KERNEL), the torch reference elsewhere."""
    if HASH_KERNEL and triton is not None and comp_ids.is_cuda:
        return engram_hash_triton(comp_ids, query_start_loc, lookback, dead, token_map, pad_id, layout, layer_id,
                                  image_token_id)
    return engram_hash(comp_ids, query_start_loc, lookback, dead, token_map, pad_id, layout, layer_id,
                       image_token_id)

"""DeepSeek-V4's compressor pooling in a decode step, one launch on CUDA (model.md section 2).

Each decode row first pushes its new raw rows (kv and gate projections of its token) into its ring at slot
pos % cap, then pools the L newest raw rows of its ring (its window: L = 2 * ratio for CSA, ratio for HCA;
positions pos - L + 1 .. pos, the newest pushed already; a ring has cap >= L rows, more under speculation,
dsv4/kv/spec.py `ring_slack`) into one entry: rows before the sequence start are masked (kv 0, gate -inf); for the
overlapping (CSA) compressor, the older m rows give the first `dim` channels of their raw rows (Ca) and the newer m
rows the last `dim` (Cb); the gates get the position bias; softmax over the rows in fp32, the weights cast to the
stream dtype, and the weighted rows summed (HF-V4 numerics: the ring rows are read in the stream dtype, products
and sum rounded to it). Returns the pooled entries [R, dim] before the compressor's norm and rope.

A speculative verify step's q rows a request (`query_len` q > 1, dsv4/spec_decode/verify_decode.py) take the same
kernel with the step's projections as a second source: row j of a request reads the window rows at or after the
request's first position from the step's rows and the older ones from the ring, which it does not write (the caller
rolls the ring afterwards, dsv4/models/verify_rows.py); reference `pool_verify_torch` (`step_windows`, `pool_rows`).

The torch reference is ~30 small kernels per compressor and step (the ring push, index arithmetic, two gathers,
masks, bias adds, softmax, casts, product, sum). The kernel takes the newest row from the new projections directly
(each program writes its own channels of it into the ring, which no other program of the step reads), and computes
each channel's softmax over the rows in registers: the max and the weights as torch's CUDA softmax does (expf of x - max, IEEE division by the sum), but its sums (softmax
denominator, weighted sum) may add in another order, so an entry can differ by one ulp of the stream dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def pool_decode_torch(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: torch.Tensor, pos: torch.Tensor,
                      position_bias: torch.Tensor, ratio: int, overlap: bool, dtype: torch.dtype,
                      new_kv: torch.Tensor | None = None, new_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ring_kv / ring_gate [blocks, cap, coff*dim], blk / pos [R] -> pooled [R, dim] in `dtype`. With
    new_kv / new_gate [R, coff*dim], the rows' new raw rows are pushed into the rings first (at pos % cap). The
    window is `window_rows(ratio, overlap)` <= cap rows (a ring may keep more: kv.spec.ring_slack)."""
    m, cap = ratio, ring_kv.shape[1]
    if new_kv is not None and new_gate is not None:
        ring_kv[blk, pos % cap] = new_kv.to(ring_kv.dtype)
        ring_gate[blk, pos % cap] = new_gate.to(ring_gate.dtype)
    dim = ring_kv.shape[2] // (2 if overlap else 1)
    L = window_rows(m, overlap)
    src = pos[:, None] - L + 1 + torch.arange(L, device=pos.device)  # positions of the window's rows, in order
    kv = ring_kv[blk[:, None], src % cap].to(dtype)
    gate = ring_gate[blk[:, None], src % cap].to(dtype)
    before = (src < 0)[..., None]
    kv = kv.masked_fill(before, 0)
    gate = gate.masked_fill(before, float("-inf"))
    return pool_rows(kv, gate, position_bias, m, dim, overlap)


def window_rows(ratio: int, overlap: bool) -> int:
    """Rows a compressor's window pools: 2 * ratio for the overlapping (CSA) one, ratio otherwise."""
    return 2 * ratio if overlap else ratio


def step_windows(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                 blk: torch.Tensor, pos: torch.Tensor, q: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw rows (kv, gate) [P, length, C] of the windows ending at a verify step's rows (positions pos - length + 1
    .. pos in order; q rows a request at consecutive positions, request-major, so row b is row b % q of its request):
    from the step's own rows kv / gate [P, C] where the window reaches into the step, from the rings (as the step
    found them) before it; positions before 0: kv 0, gate -inf. Fixed shapes, no host sync."""
    cap = ring_kv.shape[1]
    dev = kv.device
    rows = torch.arange(kv.shape[0], device=dev)
    back = torch.arange(length, device=dev) - (length - 1)  # window row i is position pos - length + 1 + i
    take = ((rows % q)[:, None] + back >= 0)[..., None]  # an earlier row of this step (or the row itself)
    src = (rows[:, None] + back).clamp(min=0)
    at = pos[:, None] + back
    slot = at % cap  # a position before the step: its ring slot
    wkv = torch.where(take, kv[src], ring_kv[blk[:, None], slot].to(kv.dtype))
    wgate = torch.where(take, gate[src], ring_gate[blk[:, None], slot].to(gate.dtype))
    before = (at < 0)[..., None]
    return wkv.masked_fill(before, 0), wgate.masked_fill(before, float("-inf"))


def pool_verify_torch(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: torch.Tensor, pos: torch.Tensor,
                      position_bias: torch.Tensor, ratio: int, overlap: bool, dtype: torch.dtype, new_kv: torch.Tensor,
                      new_gate: torch.Tensor, q: int) -> torch.Tensor:
    """Reference of a verify step's pooling (`pool_decode(..., query_len=q)`): each row's window (`window_rows`,
    as a decode row pools) from `step_windows`, pooled as `pool_rows`; the rings are only read."""
    dim = ring_kv.shape[2] // (2 if overlap else 1)
    wkv, wgate = step_windows(ring_kv, ring_gate, new_kv.to(dtype), new_gate.to(dtype), blk, pos, q,
                              window_rows(ratio, overlap))
    return pool_rows(wkv, wgate, position_bias, ratio, dim, overlap)


def pool_rows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, ratio: int, dim: int,
              overlap: bool) -> torch.Tensor:
    """Entries [N, dim] of N windows from their raw rows kv / gate [N, L, coff*dim] in position order (masked rows:
    kv 0, gate -inf): the softmax pooling both the prefill and the decode paths use."""
    m = ratio
    if overlap:  # Ca of the previous window, Cb of this one
        kv_w = torch.cat([kv[:, :m, :dim], kv[:, m:, dim:]], dim=1)
        gate_w = torch.cat([gate[:, :m, :dim] + position_bias[:, :dim],
                            gate[:, m:, dim:] + position_bias[:, dim:]], dim=1)
    else:
        kv_w, gate_w = kv, gate + position_bias
    return (kv_w * gate_w.softmax(dim=1, dtype=torch.float32).to(kv_w.dtype)).sum(dim=1)


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne  # the interpreter's fp32 -> bf16 cast truncates

    @triton.jit
    def _pool_decode_kernel(kv_ptr, gate_ptr, blk_ptr, pos_ptr, pb_ptr, out_ptr, new_kv_ptr, new_gate_ptr, cap, dim,
                            ring_stride_b, ring_stride_r, new_stride, q, M: tl.constexpr, OVERLAP: tl.constexpr,
                            PUSH: tl.constexpr, STEP: tl.constexpr, WIN: tl.constexpr, BLOCK_L: tl.constexpr,
                            BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr, FP32: tl.constexpr = False):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        cm = c < dim
        k = tl.arange(0, BLOCK_L)  # window row in position order: position pos - WIN + 1 + k (ring slot: mod cap)
        km = k < WIN
        dt = out_ptr.dtype.element_ty
        blk = tl.load(blk_ptr + r).to(tl.int64)
        pos = tl.load(pos_ptr + r).to(tl.int64)
        p = pos - WIN + 1 + k
        slot = ((p % cap) + cap) % cap  # python's modulo for p < 0
        if OVERLAP:  # rows [0, M): first dim channels (Ca); rows [M, 2M): last dim channels (Cb)
            ch = tl.where(k >= M, dim, 0)
            pb_row = tl.where(k >= M, k - M, k)
        else:
            ch = tl.zeros([BLOCK_L], dtype=tl.int32)
            pb_row = k
        valid = km & (p >= 0)
        m2 = valid[:, None] & cm[None, :]
        off = blk * ring_stride_b + slot[:, None] * ring_stride_r + (ch[:, None] + c[None, :])
        newest = k == WIN - 1
        ring_rows = m2
        if PUSH:
            ring_rows = m2 & ~newest[:, None]
        if STEP:  # a verify step's q rows of a request (row r is row r % q of its request): the window rows
            # at or after the request's first row come from the step's new rows (row r - (WIN - 1 - k)), the
            # others from the ring as the step found it (nothing is pushed: the caller rolls the ring after)
            in_step = k >= WIN - 1 - (r % q)
            ring_rows = m2 & ~in_step[:, None]
        kv = tl.load(kv_ptr + off, mask=ring_rows, other=0.0)
        g = tl.load(gate_ptr + off, mask=ring_rows, other=0.0)
        if STEP:
            src = (r - (WIN - 1 - k)) * new_stride
            sm = m2 & in_step[:, None]
            skv = tl.load(new_kv_ptr + src[:, None] + ch[:, None] + c[None, :], mask=sm, other=0.0)
            sg = tl.load(new_gate_ptr + src[:, None] + ch[:, None] + c[None, :], mask=sm, other=0.0)
            kv = tl.where(sm, skv.to(tl.float32), kv.to(tl.float32))
            g = tl.where(sm, sg.to(tl.float32), g.to(tl.float32))
        if PUSH:  # the newest row comes from the new projections, rounded to the rings' dtypes as a push stores it
            kdt = kv_ptr.dtype.element_ty
            gdt = gate_ptr.dtype.element_ty
            ch_new = dim if OVERLAP else 0  # the newest row is in the Cb half for CSA
            nkv = cast_rne(tl.load(new_kv_ptr + r * new_stride + ch_new + c, mask=cm, other=0.0).to(tl.float32),
                           kdt, INTERPRET)
            ng = cast_rne(tl.load(new_gate_ptr + r * new_stride + ch_new + c, mask=cm, other=0.0).to(tl.float32),
                          gdt, INTERPRET)
            kv = tl.where(newest[:, None], nkv[None, :], kv)
            g = tl.where(newest[:, None], ng[None, :], g)
            # the push itself: this program's channels of the new row (both halves for CSA)
            at = blk * ring_stride_b + (pos % cap) * ring_stride_r
            tl.store(kv_ptr + at + ch_new + c, nkv, mask=cm)
            tl.store(gate_ptr + at + ch_new + c, ng, mask=cm)
            if OVERLAP:
                tl.store(kv_ptr + at + c, cast_rne(tl.load(new_kv_ptr + r * new_stride + c, mask=cm,
                                                           other=0.0).to(tl.float32), kdt, INTERPRET), mask=cm)
                tl.store(gate_ptr + at + c, cast_rne(tl.load(new_gate_ptr + r * new_stride + c, mask=cm,
                                                             other=0.0).to(tl.float32), gdt, INTERPRET), mask=cm)
        if FP32:  # V4.1: the ring rows as they are (fp32)
            kv = kv.to(tl.float32)
            g = g.to(tl.float32)
        else:  # the reference reads the ring rows in the stream dtype
            kv = cast_rne(kv.to(tl.float32), dt, INTERPRET).to(tl.float32)
            g = cast_rne(g.to(tl.float32), dt, INTERPRET).to(tl.float32)
        if not FP32:  # (V4.1 has no position bias)
            pb_cols = (2 * dim) if OVERLAP else dim
            pb = tl.load(pb_ptr + pb_row[:, None] * pb_cols + ch[:, None] + c[None, :],
                         mask=km[:, None] & cm[None, :], other=0.0).to(tl.float32)
            g = g + pb
        g = tl.where(m2, g, float("-inf"))
        mx = tl.max(g, axis=0)  # the newest row is always valid (p = pos >= 0): mx is finite
        if INTERPRET:  # no libdevice in the interpreter
            e = tl.exp(g - mx[None, :])
        else:  # torch's softmax calls expf
            e = libdevice.exp(g - mx[None, :])
        e = tl.where(m2, e, 0.0)
        w = tl.math.div_rn(e, tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32) + tl.sum(e, axis=0)[None, :])
        if FP32:  # V4.1: fp32 weights and products, one rounding at the end
            prod = kv * w
        else:
            w = cast_rne(w, dt, INTERPRET).to(tl.float32)
            prod = cast_rne(kv * w, dt, INTERPRET).to(tl.float32)
        pooled = tl.sum(prod, axis=0)
        tl.store(out_ptr + r * dim + c, cast_rne(pooled, dt, INTERPRET), mask=cm)


POOL_MIN_PROGRAMS = 128  # about the H200's SM count: the decode pool's channel blocks shrink (to 32) until reached


def pool_decode_triton(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: torch.Tensor, pos: torch.Tensor,
                       position_bias: torch.Tensor, ratio: int, overlap: bool, dtype: torch.dtype,
                       new_kv: torch.Tensor | None = None, new_gate: torch.Tensor | None = None,
                       query_len: int = 1, fp32: bool = False) -> torch.Tensor:
    """The same in one launch (rings with contiguous rows, the same strides for kv and gate). `query_len` q > 1: a
    verify step's rows, q a request at consecutive positions (`pool_verify_decode`): new_kv / new_gate are the
    step's rows, read where a window reaches into the step; the rings are only read. `fp32`: V4.1's pooling
    (`pool_decode_v41`: fp32 rows, weights and products, no position bias; `position_bias` is not read)."""
    assert triton is not None, "triton is not installed"
    assert ring_kv.shape == ring_gate.shape and ring_kv.stride() == ring_gate.stride()
    R, cap = pos.shape[0], ring_kv.shape[1]
    dim = ring_kv.shape[2] // (2 if overlap else 1)
    out = torch.empty(R, dim, dtype=dtype, device=pos.device)
    step = query_len > 1
    push = new_kv is not None and new_gate is not None and not step
    win = window_rows(ratio, overlap)
    assert win <= cap and (not step or (new_kv is not None and new_gate is not None and query_len <= cap))
    new_stride = ring_kv.shape[2]
    if push or step:  # rows read through one row stride: the views of a merged projection's product need no copy
        if not (new_kv.stride(1) == new_gate.stride(1) == 1 and new_kv.stride(0) == new_gate.stride(0)):
            new_kv, new_gate = new_kv.contiguous(), new_gate.contiguous()
        assert new_kv.shape == new_gate.shape == (R, ring_kv.shape[2])
        new_stride = new_kv.stride(0)
    if R:
        block_l = triton.next_power_of_2(win)
        block_d = max(16, min(triton.next_power_of_2(dim), 4096 // block_l))
        # channels are independent (every reduction runs over the ring rows), so a small batch splits them over more
        # programs: at batch 1 a CSA compressor's 512 channels were one program doing 4096 exps and IEEE divisions
        # (7.0 us on the H200; the indexer's 128 channels 4.7 us), each program now takes 32-64 of them
        while block_d > 32 and R * triton.cdiv(dim, block_d) < POOL_MIN_PROGRAMS:
            block_d //= 2
        bias = out if fp32 else position_bias.float().contiguous()  # (fp32: not read)
        _pool_decode_kernel[(R, triton.cdiv(dim, block_d))](
            ring_kv, ring_gate, blk.contiguous(), pos.contiguous(), bias, out,
            new_kv if push or step else out, new_gate if push or step else out, cap, dim, ring_kv.stride(0),
            ring_kv.stride(1), new_stride, query_len, M=ratio, OVERLAP=overlap, PUSH=push, STEP=step, WIN=win,
            BLOCK_L=block_l, BLOCK_D=block_d, INTERPRET=INTERPRET, FP32=fp32, enable_fp_fusion=False)
    return out


def pool_decode(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: torch.Tensor, pos: torch.Tensor,
                position_bias: torch.Tensor, ratio: int, overlap: bool, dtype: torch.dtype,
                new_kv: torch.Tensor | None = None, new_gate: torch.Tensor | None = None,
                query_len: int = 1) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere. `query_len` q > 1: a verify step's rows (`pool_verify_torch`: the rings
    are read, not pushed; the caller rolls them after)."""
    if (pos.is_cuda and triton is not None and ring_kv.stride(2) == 1 and ring_kv.stride() == ring_gate.stride()
            and ring_kv.shape == ring_gate.shape):
        return pool_decode_triton(ring_kv, ring_gate, blk, pos, position_bias, ratio, overlap, dtype, new_kv, new_gate,
                                  query_len)
    if query_len > 1:
        assert new_kv is not None and new_gate is not None
        return pool_verify_torch(ring_kv, ring_gate, blk, pos, position_bias, ratio, overlap, dtype, new_kv,
                                 new_gate, query_len)
    return pool_decode_torch(ring_kv, ring_gate, blk, pos, position_bias, ratio, overlap, dtype, new_kv, new_gate)



# ---- DeepSeek-V4.1's ratio-2 compressor (model.md 12): fp32 rows, no position bias --------------------------------
def pool_decode_v41_torch(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: torch.Tensor, pos: torch.Tensor,
                          kv: torch.Tensor, gate: torch.Tensor, ratio: int, dtype: torch.dtype) -> torch.Tensor:
    """Reference: push the rows' fp32 kv / gate projections [R, D] into their rings (fp32, [blocks, cap, D]) at pos %
    cap, then pool each row's window of `ratio` ring rows, positions pos - ratio + 1 .. pos: softmax of the gates
    over the window (fp32), the weighted rows summed (fp32), cast to `dtype` once. A row whose window is still open
    pools whatever its ring holds (its entry goes to the trash slot). Returns the pre-norm latents [R, D]."""
    cap = ring_kv.shape[1]
    ring_kv[blk, pos % cap] = kv
    ring_gate[blk, pos % cap] = gate
    # a ring of exactly `ratio` rows holds a closed window in position order (slot 0 = its first position); a ring
    # with slack (speculation, kv.spec.ring_slack) holds it at slots pos - ratio + 1 .. pos (mod cap)
    if cap == ratio:
        wkv, wgate = ring_kv[blk], ring_gate[blk]
    else:
        src = (pos[:, None] - ratio + 1 + torch.arange(ratio, device=pos.device)) % cap
        wkv, wgate = ring_kv[blk[:, None], src], ring_gate[blk[:, None], src]
    return (wkv * wgate.softmax(dim=1)).sum(dim=1).to(dtype)


def pool_decode_v41(ring_kv: torch.Tensor, ring_gate: torch.Tensor, blk: torch.Tensor, pos: torch.Tensor,
                    kv: torch.Tensor, gate: torch.Tensor, ratio: int, dtype: torch.dtype) -> torch.Tensor:
    """One launch on CUDA (the decode pool kernel in its fp32 form, no bias) for fp32 rings, torch elsewhere: the
    reference's ~9 kernels (two pushes, two gathers, softmax, product, sum, cast) sat on the critical path of a
    batch-1 step (the publish / picks side chain of an index layer: 30 us of 180, H100,
    2026-12-06-h100-decode-optins). The same values for every row that closes a window (the softmax as torch's:
    expf, IEEE division; two-row sums in either order are the same)."""
    if (pos.is_cuda and triton is not None and ring_kv.dtype == ring_gate.dtype == torch.float32
            and ring_kv.shape == ring_gate.shape and ring_kv.stride() == ring_gate.stride()
            and ring_kv.stride(2) == 1 and ratio == 2):
        return pool_decode_triton(ring_kv, ring_gate, blk, pos, ring_kv, ratio, False, dtype, kv, gate, fp32=True)
    return pool_decode_v41_torch(ring_kv, ring_gate, blk, pos, kv, gate, ratio, dtype)

# ---- the entry: norm, rope at the window's first position, write -----------------------------------------------
def entry_start(pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """The first position of the window a decode row at `pos` closes (rows that close none: the one before)."""
    return ((pos + 1) // ratio - 1).clamp(min=0) * ratio


def write_entries_torch(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float, rope_table: torch.Tensor,
                        pos: torch.Tensor, ratio: int, out_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference: out_cache[slots] = rope(kv_norm(pooled), at entry_start(pos)) for pooled [R, dim] in the stream
    dtype (weighted RMSNorm, HF-V4 numerics; interleaved rope on the trailing channels, cos/sin from the rows of a
    prepared rotary table [P, rope_dim] = cos | sin)."""
    from dsv4.models.layers.norm import rms_norm_torch
    from dsv4.ops.rope import apply_rope_torch

    half = rope_table.shape[1] // 2
    rows = rope_table[entry_start(pos, ratio)]
    entry = apply_rope_torch(rms_norm_torch(pooled, norm_weight, eps), rows[:, :half], rows[:, half:])
    out_cache[slots] = entry.to(out_cache.dtype)


if triton is not None:

    @triton.jit
    def _write_entries_kernel(x_ptr, w_ptr, table_ptr, pos_ptr, slot_ptr, out_ptr, eps, inv_d, ratio,
                              D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                              INTERPRET: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        eps = tl.cast(eps, tl.float32)  # torch.compile hands float arguments over as fp64
        inv_d = tl.cast(inv_d, tl.float32)
        dt = x_ptr.dtype.element_ty
        cdt = out_ptr.dtype.element_ty
        xrow = x_ptr + r * D
        # the RMS statistic as dsv4/ops/rmsnorm.py computes it
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        xf = tl.load(xrow + d, mask=dm, other=0.0).to(tl.float32)
        if INTERPRET:
            rs = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        else:
            rs = libdevice.rsqrt(tl.sum(xf * xf, axis=0) * inv_d + eps)
        orow = out_ptr + tl.load(slot_ptr + r).to(tl.int64) * D
        nope = D - 2 * HALF
        # channels without rope: the normed value, cast to the stream dtype, then to the cache's
        keep = dm & (d < nope)
        w = tl.load(w_ptr + d, mask=keep, other=0.0).to(tl.float32)
        y = cast_rne(w * (xf * rs), dt, INTERPRET).to(tl.float32)
        tl.store(orow + d, cast_rne(y, cdt, INTERPRET), mask=keep)
        # rope channels, as pairs (2i, 2i+1): normed and rounded first, then rotated in fp32 by cos/sin rounded to
        # the stream dtype (dsv4/ops/rope.py), at the window's first position
        pos = tl.load(pos_ptr + r)
        start = tl.maximum((pos + 1) // ratio - 1, 0) * ratio
        i = tl.arange(0, BLOCK_H)
        im = i < HALF
        trow = table_ptr + start.to(tl.int64) * (2 * HALF)
        c = cast_rne(tl.load(trow + i, mask=im, other=0.0), dt, INTERPRET).to(tl.float32)
        s = cast_rne(tl.load(trow + HALF + i, mask=im, other=0.0), dt, INTERPRET).to(tl.float32)
        ea, eb = nope + 2 * i, nope + 2 * i + 1
        wa = tl.load(w_ptr + ea, mask=im, other=0.0).to(tl.float32)
        wb = tl.load(w_ptr + eb, mask=im, other=0.0).to(tl.float32)
        a = cast_rne(wa * (tl.load(xrow + ea, mask=im, other=0.0).to(tl.float32) * rs), dt, INTERPRET).to(tl.float32)
        b = cast_rne(wb * (tl.load(xrow + eb, mask=im, other=0.0).to(tl.float32) * rs), dt, INTERPRET).to(tl.float32)
        ra = cast_rne(a * c - b * s, dt, INTERPRET).to(tl.float32)
        rb = cast_rne(b * c + a * s, dt, INTERPRET).to(tl.float32)
        tl.store(orow + ea, cast_rne(ra, cdt, INTERPRET), mask=im)
        tl.store(orow + eb, cast_rne(rb, cdt, INTERPRET), mask=im)


def write_entries_triton(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float, rope_table: torch.Tensor,
                         pos: torch.Tensor, ratio: int, out_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The same in one launch (a program per row): instead of the norm, the start positions (5 kernels), the table
    gather, the rope, the cast and the scatter."""
    assert triton is not None, "triton is not installed"
    R, D = pooled.shape
    half = rope_table.shape[1] // 2
    assert out_cache.shape[1] == D and out_cache.is_contiguous() and rope_table.is_contiguous()
    if R:
        _write_entries_kernel[(R,)](pooled.contiguous(), norm_weight.contiguous(), rope_table, pos.contiguous(),
                                    slots.contiguous(), out_cache, float(eps), 1.0 / D, ratio, D=D, HALF=half,
                                    BLOCK_D=triton.next_power_of_2(D), BLOCK_H=triton.next_power_of_2(half),
                                    INTERPRET=INTERPRET, enable_fp_fusion=False)


def write_entries(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float, rope_table: torch.Tensor,
                  pos: torch.Tensor, ratio: int, out_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton on CUDA, torch elsewhere."""
    if pooled.is_cuda and triton is not None:
        write_entries_triton(pooled, norm_weight, eps, rope_table, pos, ratio, out_cache, slots)
    else:
        write_entries_torch(pooled, norm_weight, eps, rope_table, pos, ratio, out_cache, slots)

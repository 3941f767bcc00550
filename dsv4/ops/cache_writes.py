"""DeepSeek-V4.1's cache writes of a decode step, one launch each on CUDA (model.md section 5): a row through an
optional V4.1 RMSNorm, rope on its trailing channels, a fake quant, written to a cache at the row's slot.

- `write_window_kv`: the window KV, wkv(x) normed (kv_norm), roped at the token's position, FP8 e4m3 with a
  power-of-two scale per 32 channels. Unfused: norm, rope, fake quant, scatter (four launches a layer).
- `write_entry_kv`: a compressor's completed entry (its normed latent), roped at the entry's first position, FP4
  e2m1 with an e4m3 scale per 16 channels. Unfused: the entry id from the position (four elementwise launches), the
  rope rows' gather (two), rope, fake quant, scatter.
- `write_index_keys`: the indexer keys of those entries, wk(latent) normed (k_norm), roped at the entry's first
  position, FP4 e2m1 with a power-of-two scale per 32 channels. Unfused: norm + rope, fake quant, scatter.

The entry writes sit on a KV source layer's side chain (publish, indexer, selection), which is the longer of the
layer's two chains at batch 1. A row whose token completes no entry writes to the trash slot (`entry_write`), as
the unfused scatter does. The entry's rope comes from the prepared rotary table (cos | sin rows): its row is
((pos + 1) // ratio - 1, at least 0) * ratio, computed in the kernel.

The kernel holds a row as its even and odd channels ([quant blocks, pairs a block] each), so a rope pair is one
element of each and a quant block one row of both: no shuffles in registers. Numerics follow the torch references
op by op (the statistic as dsv4/ops/rmsnorm.py, `rope_rotate`, the fake quant as dsv4/ops/fake_quant.py); the
statistic's sum may add in another order, so a normed value can be an ulp off, and a quantized code then flip.
"""

from __future__ import annotations

import torch

from dsv4.models.layers.norm import rms_norm_v41_torch
from dsv4.ops.compress_pool import entry_start
from dsv4.ops.fake_quant import (FP4_E4M3, FP4_UE8M0, FP8_UE8M0, fp4_fake_quant_e4m3_torch, fp4_fake_quant_ue8m0_torch,
                                 fp8_fake_quant_torch)
from dsv4.ops.rope import apply_rope_torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch reference
    triton = None

_FP8_BLOCK = 32
_QUANT_BLOCK = {FP8_UE8M0: 32, FP4_UE8M0: 32, FP4_E4M3: 16}


def _table_rows(table: torch.Tensor, pos: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) rows of a prepared rotary table [P, rope_dim] = cos | sin at the entries' first positions."""
    half = table.shape[1] // 2
    rows = table[entry_start(pos, ratio)]
    return rows[:, :half], rows[:, half:]


def write_window_kv_torch(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                          sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference: cache[slots] = fp8(rope(norm(latent))) for latent [R, D], cos / sin [R, rope_dim / 2]."""
    kv = fp8_fake_quant_torch(apply_rope_torch(rms_norm_v41_torch(latent, weight, eps), cos, sin), _FP8_BLOCK)
    cache[slots] = kv.to(cache.dtype)


def write_entry_kv_torch(latent: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, ratio: int,
                         cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference: cache[slots] = fp4_e4m3(rope(latent, at entry_start(pos, ratio))) for normed latents [R, D]."""
    cos, sin = _table_rows(table, pos, ratio)
    cache[slots] = fp4_fake_quant_e4m3_torch(apply_rope_torch(latent, cos, sin)).to(cache.dtype)


def write_index_keys_torch(k: torch.Tensor, weight: torch.Tensor, eps: float, table: torch.Tensor, pos: torch.Tensor,
                           ratio: int, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference: cache[slots] = fp4_ue8m0(rope(norm(k), at entry_start(pos, ratio))) for keys wk(latent) [R, d]."""
    cos, sin = _table_rows(table, pos, ratio)
    keys = fp4_fake_quant_ue8m0_torch(apply_rope_torch(rms_norm_v41_torch(k, weight, eps), cos, sin))
    cache[slots] = keys.to(cache.dtype)


if triton is not None:
    from dsv4.ops.fake_quant import _e2m1_round_tl, _e4m3_round, _pow2_ceil_tl
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne
    from dsv4.ops.rope import rope_rotate

    @triton.jit
    def _fake_quant_pairs(ye, yo, QUANT: tl.constexpr):
        """Both halves of [blocks, pairs] (fp32 values of the row's dtype), fake-quantized per block (a row of
        both) as `_fake_quant_kernel` does; fp32 results before the row dtype's rounding."""
        amax = tl.maximum(tl.max(tl.abs(ye), axis=1), tl.max(tl.abs(yo), axis=1))[:, None]
        if QUANT == 0:  # FP8 e4m3, power-of-two scale
            scale = _pow2_ceil_tl(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
            qe = _e4m3_round(tl.minimum(tl.maximum(ye / scale, -448.0), 448.0))
            qo = _e4m3_round(tl.minimum(tl.maximum(yo / scale, -448.0), 448.0))
        else:
            if QUANT == 1:  # FP4 e2m1, power-of-two scale
                scale = _pow2_ceil_tl(tl.maximum(amax, 6.0 * 1.1754943508222875e-38) * (1.0 / 6.0))
            else:  # FP4 e2m1, e4m3 scale
                s = tl.math.div_rn(tl.maximum(amax, 6.0 * 0.001953125), tl.full(amax.shape, 6.0, tl.float32))
                scale = _e4m3_round(tl.minimum(s, 448.0))
            qe = _e2m1_round_tl(tl.minimum(tl.maximum(tl.math.div_rn(ye, scale), -6.0), 6.0))
            qo = _e2m1_round_tl(tl.minimum(tl.maximum(tl.math.div_rn(yo, scale), -6.0), 6.0))
        return qe * scale, qo * scale

    @triton.jit
    def _row_write_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, out_ptr, x_stride, cos_stride, sin_stride,
                          eps, inv_d, ratio, D: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr,
                          PAIRS: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr, ENTRY: tl.constexpr,
                          INTERPRET: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        eps = tl.cast(eps, tl.float32)  # torch.compile hands float arguments over as fp64
        inv_d = tl.cast(inv_d, tl.float32)
        dt = x_ptr.dtype.element_ty
        # pair j = PAIRS b + p holds channels 2j (even) and 2j + 1 (odd); quant block b = channels 2 PAIRS b ..
        j = tl.arange(0, NB)[:, None] * PAIRS + tl.arange(0, PAIRS)[None, :]
        xrow = x_ptr + r * x_stride
        ye = tl.load(xrow + 2 * j).to(tl.float32)
        yo = tl.load(xrow + 2 * j + 1).to(tl.float32)
        if NORM:  # V4.1's RMSNorm: the normed value rounded to the row dtype, then the weight, rounded again
            ss = tl.sum(tl.sum(ye * ye + yo * yo, axis=1), axis=0)
            if INTERPRET:
                rs = tl.rsqrt(ss / D + eps)
            else:
                rs = libdevice.rsqrt(ss * inv_d + eps)
            we = tl.load(w_ptr + 2 * j).to(tl.float32)
            wo = tl.load(w_ptr + 2 * j + 1).to(tl.float32)
            ye = cast_rne(cast_rne(ye * rs, dt, INTERPRET).to(tl.float32) * we, dt, INTERPRET).to(tl.float32)
            yo = cast_rne(cast_rne(yo * rs, dt, INTERPRET).to(tl.float32) * wo, dt, INTERPRET).to(tl.float32)
        # rope on the last HALF pairs, at the row's position (ENTRY: its entry's first one, a prepared table's row)
        if ENTRY:
            e = tl.maximum((tl.load(pos_ptr + r).to(tl.int64) + 1) // ratio - 1, 0)
            crow = e * ratio
        else:
            crow = r
        i = j - (D // 2 - HALF)
        rope = i >= 0
        c = tl.load(cos_ptr + crow * cos_stride + i, mask=rope, other=1.0)
        s = tl.load(sin_ptr + crow * sin_stride + i, mask=rope, other=0.0)
        re, ro = rope_rotate(ye, yo, c, s, 1.0, dt, INTERPRET)
        ye = tl.where(rope, re.to(tl.float32), ye)
        yo = tl.where(rope, ro.to(tl.float32), yo)
        qe, qo = _fake_quant_pairs(ye, yo, QUANT)
        odt = out_ptr.dtype.element_ty
        orow = out_ptr + tl.load(slot_ptr + r).to(tl.int64) * D
        tl.store(orow + 2 * j, cast_rne(cast_rne(qe, dt, INTERPRET).to(tl.float32), odt, INTERPRET))
        tl.store(orow + 2 * j + 1, cast_rne(cast_rne(qo, dt, INTERPRET).to(tl.float32), odt, INTERPRET))


def _fits(x: torch.Tensor, quant: int, cache: torch.Tensor) -> bool:
    """The kernel's shape rules: D a multiple of the quant block with a power-of-two number of blocks, a contiguous
    cache of D columns."""
    D, qb = x.shape[-1], _QUANT_BLOCK[quant]
    nb = D // qb
    return D % qb == 0 and nb & (nb - 1) == 0 and cache.is_contiguous() and cache.shape[-1] == D


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
            pos: torch.Tensor | None, ratio: int, cache: torch.Tensor, slots: torch.Tensor, quant: int) -> None:
    """One launch, a program per row of x [R, D] (rows may be strided, channels unit-stride). cos / sin: [R, half]
    rows (pos None), or with `pos` the cos / sin halves of a prepared table's rows [P, 2 half] read at each row's
    entry start."""
    assert triton is not None, "triton is not installed"
    R, D = x.shape
    half = cos.shape[-1]
    qb = _QUANT_BLOCK[quant]
    assert _fits(x, quant, cache) and 2 * half <= D, (x.shape, quant, cache.shape)
    if R:
        cos, sin = (t if t.dtype == torch.float32 and t.stride(-1) == 1 else t.float().contiguous() for t in (cos, sin))
        x = x if x.stride(-1) == 1 else x.contiguous()
        _row_write_kernel[(R,)](x, x if weight is None else weight.contiguous(), cos, sin,
                                slots if pos is None else pos.contiguous(), slots.contiguous(), cache, x.stride(0),
                                cos.stride(0), sin.stride(0), float(eps), 1.0 / D, ratio, D=D, HALF=half,
                                NB=D // qb, PAIRS=qb // 2, NORM=weight is not None, QUANT=quant, ENTRY=pos is not None,
                                INTERPRET=INTERPRET, enable_fp_fusion=False)


def write_window_kv_triton(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The same in one launch (a program per row; D a multiple of 32 with a power-of-two number of FP8 blocks, and
    latent and cos / sin rows with unit channel stride: the rows may be strided, e.g. the wkv part of a merged
    projection's output, or the halves of a gathered rope-table row)."""
    _launch(latent, weight, eps, cos, sin, None, 1, cache, slots, FP8_UE8M0)


def write_entry_kv_triton(latent: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, ratio: int,
                          cache: torch.Tensor, slots: torch.Tensor) -> None:
    """`write_entry_kv_torch` in one launch (D a multiple of 16 with a power-of-two number of blocks)."""
    half = table.shape[1] // 2
    _launch(latent, None, 0.0, table[:, :half], table[:, half:], pos, ratio, cache, slots, FP4_E4M3)


def write_index_keys_triton(k: torch.Tensor, weight: torch.Tensor, eps: float, table: torch.Tensor, pos: torch.Tensor,
                            ratio: int, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """`write_index_keys_torch` in one launch (d a multiple of 32 with a power-of-two number of blocks)."""
    half = table.shape[1] // 2
    _launch(k, weight, eps, table[:, :half], table[:, half:], pos, ratio, cache, slots, FP4_UE8M0)


def _use_triton(x: torch.Tensor, quant: int, cache: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None and _fits(x, quant, cache)


def write_window_kv(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton on CUDA (where the kernel's shape rules hold), torch elsewhere."""
    if _use_triton(latent, FP8_UE8M0, cache):
        write_window_kv_triton(latent, weight, eps, cos, sin, cache, slots)
    else:
        write_window_kv_torch(latent, weight, eps, cos, sin, cache, slots)


def write_entry_kv(latent: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, ratio: int, cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """Triton on CUDA (where the kernel's shape rules hold), torch elsewhere."""
    if _use_triton(latent, FP4_E4M3, cache):
        write_entry_kv_triton(latent, table, pos, ratio, cache, slots)
    else:
        write_entry_kv_torch(latent, table, pos, ratio, cache, slots)


def write_index_keys(k: torch.Tensor, weight: torch.Tensor, eps: float, table: torch.Tensor, pos: torch.Tensor,
                     ratio: int, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton on CUDA (where the kernel's shape rules hold), torch elsewhere."""
    if _use_triton(k, FP4_UE8M0, cache):
        write_index_keys_triton(k, weight, eps, table, pos, ratio, cache, slots)
    else:
        write_index_keys_torch(k, weight, eps, table, pos, ratio, cache, slots)

"""Engram table rows gathered and dequantized in one launch, from device memory or from mapped host memory.

A V4.1 Engram table is [rows, dim] FP8 e4m3 with one scale per `dim / scale_cols` channels of a row (UE8M0 bytes,
2^(e-127), or float), or a float table. A step needs a few rows of it (tokens x n-gram orders x heads): the kernel
reads exactly those rows and writes them dequantized (value * scale, exact in fp32, then rounded once to the output
dtype) - the same numbers as the torch reference below.

The table may live in page-locked host memory that the GPU can address (a memory map of the checkpoint registered
with CUDA, dsv4.models.engram_host): the kernel then reads the rows over PCIe itself (zero-copy), with no host
sync and no staging copy, so the gather can sit inside a CUDA graph like any other kernel. A row is 256-512 bytes,
so one program per row keeps many row reads in flight; the PCIe latency, not its bandwidth, is what a step pays.
"""

from __future__ import annotations

import torch

from dsv4.quant.formats import scale_to_float

try:
    import triton
    import triton.language as tl
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def engram_gather_torch(table: torch.Tensor, scale: torch.Tensor | None, row_ids: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """Reference: rows `row_ids` (any shape) of `table` [rows, dim] -> [*row_ids.shape, dim] in `dtype`, FP8 rows
    times their scales [rows, dim / block] (uint8 UE8M0 exponents or floats). Table, scale and row_ids on one
    device."""
    flat = row_ids.reshape(-1).long()
    rows = table.index_select(0, flat)
    if scale is None:
        return rows.to(dtype).reshape(*row_ids.shape, table.shape[1])
    s = scale_to_float(scale.index_select(0, flat))
    block = table.shape[1] // s.shape[1]
    val = rows.float().reshape(-1, s.shape[1], block) * s[..., None]
    return val.to(dtype).reshape(*row_ids.shape, table.shape[1])


if triton is not None:

    @triton.jit
    def _engram_gather_kernel(table_ptr, scale_ptr, ids_ptr, out_ptr, DIM: tl.constexpr, SCALE_COLS: tl.constexpr,
                              BLOCK_D: tl.constexpr, FP8: tl.constexpr, E8M0: tl.constexpr,
                              INTERPRET: tl.constexpr):
        # one program per requested row: read its DIM values (and scales), dequantize in fp32, round once
        i = tl.program_id(0)
        row = tl.load(ids_ptr + i).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < DIM
        v = tl.load(table_ptr + row * DIM + d, mask=dm, other=0.0).to(tl.float32)
        if FP8:
            sc = tl.load(scale_ptr + row * SCALE_COLS + d // (DIM // SCALE_COLS), mask=dm, other=0)
            if E8M0:  # 2^(e-127) from bits: e = 0 is the subnormal 2^-127, 255 is NaN (as e8m0_to_float)
                bits = sc.to(tl.int32) << 23
                bits = tl.where(sc == 0, 0x00400000, bits)
                bits = tl.where(sc == 255, 0x7FC00000, bits)
                s = bits.to(tl.float32, bitcast=True)
            else:
                s = sc.to(tl.float32)
            v = v * s
        tl.store(out_ptr + i.to(tl.int64) * DIM + d, cast_rne(v, out_ptr.dtype.element_ty, INTERPRET), mask=dm)


def engram_gather_triton(table: torch.Tensor, scale: torch.Tensor | None, row_ids: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """`engram_gather_torch` in one launch on row_ids' device. `table` / `scale` may be CPU tensors in page-locked
    memory registered with CUDA (read by the GPU through unified addressing): nothing is copied or synced."""
    assert triton is not None, "triton is not installed"
    dim = table.shape[1]
    out = torch.empty(*row_ids.shape, dim, dtype=dtype, device=row_ids.device)
    n = row_ids.numel()
    if n == 0:
        return out
    fp8 = scale is not None
    if fp8 and dim % scale.shape[1]:
        raise ValueError(f"engram table dim {dim} is not a multiple of its {scale.shape[1]} scale columns")
    e8m0 = fp8 and scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
    scale_arg = (scale.view(torch.uint8) if e8m0 else scale) if fp8 else table  # (unused without FP8)
    _engram_gather_kernel[(n,)](table, scale_arg, row_ids.reshape(-1).contiguous(), out, DIM=dim,
                                SCALE_COLS=scale.shape[1] if fp8 else 1, BLOCK_D=triton.next_power_of_2(dim),
                                FP8=fp8, E8M0=e8m0, INTERPRET=INTERPRET, num_warps=2 if dim <= 512 else 4)
    return out

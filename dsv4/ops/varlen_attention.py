"""Packed variable-length, non-causal attention (the ViT's): a Triton flash-attention forward over device cu_seqlens.

q, k, v [rows, H, Dh] hold several sequences back to back; `cu_seqlens` int [S+1] (on the device) marks their
boundaries. Every row attends to all rows of its own sequence and to no other: softmax(q k^T * scale) v per
sequence, logits and softmax sums in fp32, output in q's dtype. Rows past `cu_seqlens[-1]` are padding (the unused
rows of a CUDA-graph buffer): they attend to nothing, cost nothing and come out 0 (the rule of
`block_diagonal_attention`, the torch reference in dsv4/models/vision.py).

Why this shape of kernel: the vision encoder's CUDA graphs (dsv4/runtime/encoder_cudagraphs.py) capture the
attention, so nothing here may read a device value on the host: no max_seqlen, no per-sequence grid. The grid is
fixed by shapes alone, (cdiv(rows, BLOCK_M), H), and every program finds its key range on the device:
- a per-row sequence id comes from one `torch.searchsorted` (capturable, O(rows)), the same rule the reference uses;
- each program takes BLOCK_M consecutive query rows; row r attends to keys [lo_r, hi_r) (its sequence's bounds, read
  from cu_seqlens through its id), and the program loops over key tiles of [min lo, max hi) with an online softmax.
  A block inside one sequence walks exactly that sequence, every tile but the last, partial one without any mask;
  a block that straddles a boundary walks the union of the sequences it touches, masking each (row, key) with the
  row's own bounds (rows of one sequence see the others' keys as -inf). The loop bounds are loaded in the kernel,
  so one captured graph serves any boundaries.
The unmasked tiles are most of the work and, at head_dim 64, the softmax's instructions bound it, not the MMAs:
compiled for sm_90 (Triton 3.9, 128 x 64 tiles, 8 warps) a masked tile issues 14.6 instructions a score per thread,
an unmasked one 9.9 (benchmarks/results/2026-12-05-cpu-encoder-graph-padding). The scale goes into the exponent's
FMA, and the running max is kept in scaled units, which saves a multiply a score.
Cost: O(sum over sequences of len^2) work, plus at most the neighbouring sequences' keys for the few blocks that
straddle a boundary; memory O(rows) (no [rows, rows] mask or score matrix, unlike the reference). Padding rows are
free: a block of them has an empty key range. (Until 2026-11-30 they formed one more sequence, so a nearly empty
batch in a large graph budget paid for its padding squared: the encoder graphs were slower than eager encoding.)
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference (dsv4.models.vision.block_diagonal_attention)
    triton = None

HAS_TRITON = triton is not None  # for dispatchers that take the torch reference without it

# Tile sizes for the GPU (Dh = 64 at the released shapes), the fastest of benchmarks/varlen_attention_bench.py's 7 on
# an H200 at 5 of the encoder table's 6 sequence mixes (1536x1536: 0.80 ms a layer against 0.95 for 128 x 64 with
# 8 warps and 0.83 for SDPA per image; ../benchmarks/results/2026-12-05-h200-encoder-graphs). Callers may override.
BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when kernels are defined, as triton does

if triton is not None:

    @triton.jit
    def _dot(a, b, LOWP: tl.constexpr, UPCAST: tl.constexpr):
        """a @ b with fp32 accumulation. bf16/fp16 tiles go to the tensor cores as they are; fp32 tiles use exact
        fp32 products (tf32 would cost ~1e-3 relative, more than the fp32 reference allows). The CPU interpreter
        multiplies bf16 tiles as raw integer bits, so there (UPCAST) low-precision tiles go through fp32: the same
        numbers, since bf16/fp16 products are exact in fp32."""
        if LOWP:
            if UPCAST:
                return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                return tl.dot(a, b)
        else:
            return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _attend_tile(q, k_ptr, v_ptr, n0, k_end, lo, hi, h, sk_r, sk_h, sv_r, sv_h, qk_scale, m_i, l_i, acc, d, dm,
                     MASKED: tl.constexpr, BLOCK_N: tl.constexpr, LOWP: tl.constexpr, UPCAST: tl.constexpr,
                     EVEN_D: tl.constexpr):
        """One key tile [n0, n0 + BLOCK_N) of the online softmax; MASKED: each (row, key) pair is checked against
        the row's [lo, hi) (a tile some row of the block must not see all of, or past k_end), else every row sees
        every key of the tile and nothing is checked (the interior tiles: most of the work). EVEN_D: the head dim
        is BLOCK_D, so an interior tile's loads need no predicate at all."""
        kn = n0 + tl.arange(0, BLOCK_N)
        kn64 = kn.to(tl.int64)
        k_at = k_ptr + kn64[:, None] * sk_r + h * sk_h + d[None, :]
        v_at = v_ptr + kn64[:, None] * sv_r + h * sv_h + d[None, :]
        if MASKED:
            kmask = (kn < k_end)[:, None] & dm[None, :]
            k = tl.load(k_at, mask=kmask, other=0.0)
            v = tl.load(v_at, mask=kmask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_at)
            v = tl.load(v_at)
        else:
            k = tl.load(k_at, mask=dm[None, :], other=0.0)
            v = tl.load(v_at, mask=dm[None, :], other=0.0)
        # raw logits; scale * log2(e) is applied inside the exponent's one FMA (exp2 is the native instruction). q is
        # not pre-scaled, since rounding q * scale back to bf16 would add an error the reference does not have
        s = _dot(q, tl.trans(k), LOWP, UPCAST)
        if MASKED:  # keys past k_end lie outside every row's range, so this also hides them
            s = tl.where((kn[None, :] >= lo[:, None]) & (kn[None, :] < hi[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p is rounded to v's dtype for the tensor cores (FlashAttention's numerics); its sum l_i stays fp32
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, LOWP, UPCAST)
        return m_new, l_i, acc

    @triton.jit
    def _varlen_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_ptr, cu_ptr, n_rows, n_seqs, qk_scale,
                           sq_r, sq_h, sk_r, sk_h, sv_r, sv_h, so_r, so_h,
                           D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           LOWP: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr):
        h = tl.program_id(1)
        # torch.compile hands float arguments to user kernels as fp64: keep the math (and loop-carried values) fp32
        qk_scale = tl.cast(qk_scale, tl.float32)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = rows < n_rows
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        # Row r's keys: [cu[sid], cu[sid + 1]), where sequence 0 starts at row 0 whatever cu[0] says. hi is clamped
        # to n_rows so a malformed cu_seqlens cannot make the kernel read past k/v. Padding rows (past cu[-1]: sid ==
        # n_seqs) and rows past n_rows get an empty range (lo > hi), which also keeps them out of the block's union.
        sid = tl.load(seq_ptr + rows, mask=rm, other=0)
        real = rm & (sid < n_seqs)
        lo = tl.load(cu_ptr + sid, mask=real & (sid > 0), other=0).to(tl.int32)
        hi = tl.load(cu_ptr + sid + 1, mask=real, other=0).to(tl.int32)
        hi = tl.minimum(hi, n_rows)
        lo = tl.where(real, lo, n_rows)
        hi = tl.where(real, hi, 0)
        # The union of the rows' ranges: contiguous, as consecutive rows have non-decreasing sequence ids. A block of
        # padding rows has k_end < k_start: every loop below is empty.
        k_start = tl.min(lo, axis=0)
        k_end = tl.maximum(tl.max(hi, axis=0), k_start)
        # The keys every real row of the block sees, [max lo, min hi): non-empty only when the block's real rows are
        # all one sequence's (different sequences' ranges are disjoint), and then it starts at k_start. Its whole
        # tiles need no mask: most blocks lie inside one sequence, so all their tiles but the last, partial one.
        full_lo = tl.max(tl.where(real, lo, 0), axis=0)
        full_hi = tl.min(tl.where(real, hi, n_rows), axis=0)
        mid = k_start + (tl.maximum(full_hi - k_start, 0) // BLOCK_N) * BLOCK_N
        mid = tl.where(full_lo == k_start, tl.minimum(mid, k_end), k_start)

        rows64 = rows.to(tl.int64)  # rows * row stride can pass 2^31 elements on large packed batches
        q = tl.load(q_ptr + rows64[:, None] * sq_r + h * sq_h + d[None, :], mask=rm[:, None] & dm[None, :],
                    other=0.0)
        # Running max in units of the scaled logits (scale * log2(e) > 0, so max and scaling commute). A finite start:
        # a row whose first tiles are all another sequence's keys (a block straddling a boundary) then gets
        # alpha = exp2(0) = 1 and p = exp2(-inf) = 0 instead of -inf - -inf = nan.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(k_start, mid, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, n0, k_end, lo, hi, h, sk_r, sk_h, sv_r, sv_h, qk_scale,
                                         m_i, l_i, acc, d, dm, False, BLOCK_N, LOWP, UPCAST, EVEN_D)
        for n0 in range(mid, k_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, n0, k_end, lo, hi, h, sk_r, sk_h, sv_r, sv_h, qk_scale,
                                         m_i, l_i, acc, d, dm, True, BLOCK_N, LOWP, UPCAST, EVEN_D)
        # A row of a sequence always sees itself, so l_i > 0 there. Padding rows store 0: they are kept out of the
        # masked tiles, but the unmasked ones add to every row of the block.
        l_i = tl.where(l_i > 0, l_i, 1.0)
        out = tl.where(real[:, None], acc / l_i[:, None], 0.0)
        tl.store(o_ptr + rows64[:, None] * so_r + h * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=rm[:, None] & dm[None, :])


def row_sequence_ids(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [rows]: the sequence of every packed row, the number of boundaries cu_seqlens[1:] at or below it (rows
    past cu_seqlens[-1] get S: padding). Built on cu_seqlens' device with no host read (capturable)."""
    idx = torch.arange(rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), idx, right=True, out_int32=True)


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: float | None = None, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                            num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> torch.Tensor:
    """Attention within each packed sequence (see the module docstring). q/k/v [rows, H, Dh] with any row and head
    strides (a non-contiguous last dim is copied), cu_seqlens int32/int64 [S+1] on q's device; scale defaults to
    Dh ** -0.5. Returns a new contiguous [rows, H, Dh] tensor in q's dtype. Block sizes must be powers of two >= 16
    (tl.dot's smallest tile)."""
    assert triton is not None, "triton is not installed"
    assert q.dim() == 3 and k.shape == q.shape and v.shape == q.shape, (q.shape, k.shape, v.shape)
    assert cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1, cu_seqlens.shape
    assert cu_seqlens.device == q.device, (cu_seqlens.device, q.device)
    for b in (block_m, block_n):
        assert b >= 16 and b & (b - 1) == 0, f"block sizes must be powers of two >= 16, got {b}"
    rows, heads, dh = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(rows, heads, dh, dtype=q.dtype, device=q.device)
    if rows == 0 or heads == 0 or dh == 0:
        return out
    cu = cu_seqlens.contiguous()
    seq = row_sequence_ids(cu, rows)
    scale = dh ** -0.5 if scale is None else float(scale)
    lowp = q.dtype in (torch.bfloat16, torch.float16)
    # k/v follow q's dtype: tl.dot needs both operands of one type, and the ViT produces all three together
    k, v = k.to(q.dtype), v.to(q.dtype)
    block_d = max(16, triton.next_power_of_2(dh))
    _varlen_fwd_kernel[(triton.cdiv(rows, block_m), heads)](
        q, k, v, out, seq, cu, rows, cu.numel() - 1, scale * 1.4426950408889634,  # log2(e)
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        D=dh, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, LOWP=lowp, UPCAST=_INTERPRET, EVEN_D=dh == block_d,
        num_warps=num_warps, num_stages=num_stages)
    return out


# ---- FlashAttention's varlen forward (the backend vLLM captures in its encoder graphs) ---------------------------
# Which kernel the encoder graphs use for device cu_seqlens: "triton" (the kernel above: grid sized by rows, padding
# free) or "flash" (torch's bundled FlashAttention-2 varlen forward, the kernel eager SDPA runs per image; its grid
# is cdiv(max_q, 128) x sequence slots x heads, so the slots and rows a graph's buffers hold cost empty blocks).
# Read once at import, like every DSV4_* switch; benchmarks/encoder_latency.py sets GRAPH_ATTENTION directly.
# cuDNN's ragged forward (`aten._cudnn_attention_forward` with device boundaries, the kernel eager per-image SDPA picks
# on an H100, ~1.2x the Triton kernel's rate there) was tried as a third choice and dropped: on torch 2.11 it runs
# eagerly but invalidates a CUDA graph capture (cudaErrorStreamCaptureInvalidated; H100, 2026-12-07,
# benchmarks/results/2026-12-07-h100-encoder-patch-levels).
GRAPH_ATTENTIONS = ("triton", "flash")
GRAPH_ATTENTION = os.environ.get("DSV4_ENCODER_GRAPH_ATTENTION", "triton")
if GRAPH_ATTENTION not in GRAPH_ATTENTIONS:
    raise ValueError(f"DSV4_ENCODER_GRAPH_ATTENTION must be one of {GRAPH_ATTENTIONS}, got {GRAPH_ATTENTION!r}")


def flash_supported(q: torch.Tensor) -> bool:
    """Whether torch's FlashAttention varlen forward takes q: CUDA, fp16/bf16 (it has no fp32 kernel), head_dim a
    multiple of 8 up to 256."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and hasattr(torch.ops.aten, "_flash_attention_forward"))


def _flash_forward():  # looked up per call, so a test can stand in for the CUDA-only op
    return torch.ops.aten._flash_attention_forward


def varlen_attention_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """The same attention as `varlen_attention_triton` through FlashAttention-2's varlen forward
    (`aten._flash_attention_forward`, the positional form torch has kept since 2.1): int32 boundaries (the only kind
    it takes) for both q and k, q/k/v with a unit last stride and q's dtype, and max lengths = q's row count (a bound
    every sequence of the buffer satisfies, so nothing is read on the host and the call can be captured with the
    boundaries changing between replays). FlashAttention leaves the rows past cu_seqlens[-1] unwritten (the output
    is allocated empty: garbage, NaN possibly); they are set to 0, the padding rule of the Triton kernel."""
    rows = q.shape[0]
    if rows == 0:
        return torch.empty_like(q)
    cu = cu_seqlens.to(torch.int32).contiguous()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = _flash_forward()(q, k.to(q.dtype), v.to(q.dtype), cu, cu, rows, rows, 0.0, False, False, scale=scale)[0]
    padding = torch.arange(rows, dtype=torch.int32, device=q.device) >= cu[-1]
    return out.masked_fill(padding[:, None, None], 0)

"""mHC mixes: (pre, post, comb) of one site from its streams, with Sinkhorn, for every token at once.

`hc_post`: from the projection m [T, (2+N)N] = normed streams @ fn^T (fp32), base [(2+N)N], scale [3], the fp32
pre [T, N], post [T, N], comb [T, N, N] (model.md section 3). The torch reference takes ~90 tiny kernels per site
(Sinkhorn alone is 2 * iters reductions and divisions on [T, N, N]); the Triton kernel does one token per program
with the N x N matrix in registers, one launch per site.

`hc_mixes_fused`: the whole site from the streams h [T, N, D] in two launches instead of four (the streams' fp32
norm, cuBLAS's two-kernel fp32 gemv, `hc_post`): the first reads h and fn in column chunks and writes each chunk's
fn . h dot products and sum of squares; the second adds the chunks in a fixed order, scales the dots by the rows'
rsqrt(mean(h^2) + eps) (the norm is a per-row factor, so fn . (h r) = r (fn . h)) and finishes as `hc_post`. fp32
throughout; against the composed path only the products' rounding and the sums' order differ (a few fp32 ulps of
the mixes). Used for decode-sized steps (FUSED_MIXES, FUSED_MAX_ROWS below).

`hc_dots_rows`: the projection m = norm(h) @ fn^T of more rows (prefill, larger batches) as r * (h @ fn^T) in one
tiled pass over bf16 streams, on the tensor cores: fn (fp32) is split once into three bf16 parts whose sum is fn to
fp32 precision (8 + 8 + 8 significand bits), and h (bf16) times each part is exact in fp32 before the fp32
accumulation. The composed path wrote the normed streams in fp32 ([T, N*D]: 1.34 GB at 16K tokens of V4.1) and read
them back in an fp32 GEMM: ~1.2 ms a site on an H100 at 16K, 17 sites a step (MHC_ROWS below).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None

# The fused site on CUDA (`hc_mixes_fused`, and the sublayer input in one launch: dsv4.models.layers.mhc) for steps
# of at most FUSED_MAX_ROWS tokens: its first launch reads fn once per token (a GEMM's worth of tokens would read it
# thousands of times: prefill keeps cuBLAS). H200, V4-Flash-4l released, batch 1: 1.283 -> 1.256 ms a decode step
# (benchmarks/results/2026-12-04-h200-gemv-forms-prefill-blocks). DSV4_FUSED_MHC=0 switches it off.
FUSED_MIXES = os.environ.get("DSV4_FUSED_MHC", "1") == "1"
FUSED_MAX_ROWS = 8
# columns of the flattened streams a program of the first launch reads, in one load round trip (a decode step's
# few tokens need many programs: V4 64 chunks of 16384 columns, V4.1 80 of 20480)
_MIX_CHUNK = 256
# `hc_dots_rows` for steps of more than FUSED_MAX_ROWS bf16 rows on CUDA; DSV4_MHC_ROWS=0 keeps the composed path
MHC_ROWS = os.environ.get("DSV4_MHC_ROWS", "1") != "0"
_ROWS_M = 32  # fn's rows padded to a tensor-core tile ((2+N)N = 24 at N = 4; the final collapse's N = 4)
_ROWS_BLOCK_T, _ROWS_BLOCK_K = 64, 64  # rows a program, columns a step
# `hc_dots_rows` in column splits (the default; DSV4_MHC_ROWS_SPLIT_K=0 is the single pass). A program of the single
# pass walks all N*D columns of its 64 rows in 64-column steps (320 for V4.1): at 2,048 rows that is 32 programs for
# 132 SMs, 168 us a call on an H100 against ~20 us for the 84 MB read (2026-12-06-h100-mixed-step-host, 16 calls a
# step); splits make row blocks x splits fill the SMs, and a second launch adds the splits' sums in order. Timed in
# 2026-12-06-h100-decode-b64-splits: 131 -> 16 us a call at 64 rows; the batch-64 decode replay 9.56 -> 7.29 ms.
ROWS_SPLIT_K = os.environ.get("DSV4_MHC_ROWS_SPLIT_K", "1") == "1"
# The splits' sums added as one [splits, rows, 32] tile a program of 8 rows (default; DSV4_MHC_SUM_TILE=0: the
# loop) instead of a loop over the splits a program of 64 rows: at a batch-64 decode step that loop is one program
# walking 20 dependent loads, 8.5 us a call against ~1 us of data, 16 calls a step of V4.1-Flash-8l on an H100
# (2026-12-06-h100-decode-b64-splits, b64-both-on.log). The tile's sum over the splits is a tree, not split order:
# the same fp32 bound. Timed (2026-12-06-h100-decode-optins): the batch-64 replay 7.19 -> 7.10 ms on an H100.
SUM_TILE = os.environ.get("DSV4_MHC_SUM_TILE", "1") == "1"
_SUM_TILE_T = 8
_ROWS_MIN_SPLIT_COLS = 1024


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project [.., N, N] positive matrices towards doubly stochastic: columns first, then rows/columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_post_torch(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                  hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: (pre, post, comb) from the projected mixes `m`."""
    pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, bf16_dot, rms_factor

    @triton.jit
    def _hc_outputs(pre_w, post_w, comb_w, base_ptr, scale_ptr, iters, hc_eps, N: tl.constexpr):
        """(pre [N], post [N], comb [N, N] row-major [j, k]) of one token from its projected mixes."""
        i = tl.arange(0, N)
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(pre_w * s_pre + tl.load(base_ptr + i)) + hc_eps
        post = 2.0 * tl.sigmoid(post_w * s_post + tl.load(base_ptr + N + i))
        jk = i[:, None] * N + i[None, :]
        c = comb_w * s_comb + tl.load(base_ptr + 2 * N + jk)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + hc_eps
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        return pre, post, c

    @triton.jit
    def _store_outputs(pre_ptr, post_ptr, comb_ptr, t, pre, post, comb, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(pre_ptr + t * N + i, pre)
        tl.store(post_ptr + t * N + i, post)
        tl.store(comb_ptr + t * N * N + i[:, None] * N + i[None, :], comb)

    @triton.jit
    def _hc_post_kernel(m_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, iters, hc_eps,
                        N: tl.constexpr, W: tl.constexpr):
        t = tl.program_id(0)
        # torch.compile hands float arguments to user kernels as fp64: keep the math (and loop-carried values) fp32
        hc_eps = tl.cast(hc_eps, tl.float32)
        row = m_ptr + t * W
        i = tl.arange(0, N)
        pre, post, comb = _hc_outputs(tl.load(row + i), tl.load(row + N + i),
                                      tl.load(row + 2 * N + i[:, None] * N + i[None, :]), base_ptr, scale_ptr, iters,
                                      hc_eps, N)
        _store_outputs(pre_ptr, post_ptr, comb_ptr, t, pre, post, comb, N)

    @triton.jit
    def _hc_dots_kernel(h_ptr, fn_ptr, dots_ptr, ss_ptr, K, CHUNK, M: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """Program (t, c): over the columns [c CHUNK, (c+1) CHUNK) of token t's flattened streams, the dot products
        with the M rows of fn (-> dots[t, c, :M]) and the sum of squares (-> ss[t, c])."""
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        chunks = tl.num_programs(1)
        mm = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(c * CHUNK, (c + 1) * CHUNK, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            x = tl.load(h_ptr + t * K + k, mask=km, other=0.0).to(tl.float32)
            sq += x * x
            w = tl.load(fn_ptr + mm[:, None] * K + k[None, :], mask=(mm < M)[:, None] & km[None, :], other=0.0)
            acc += w * x[None, :]
        tl.store(dots_ptr + (t * chunks + c) * BLOCK_M + mm, tl.sum(acc, axis=1))
        tl.store(ss_ptr + t * chunks + c, tl.sum(sq, axis=0))

    @triton.jit
    def _hc_mix_kernel(dots_ptr, ss_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, CHUNKS, K, inv_k,
                       norm_eps, iters, hc_eps, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                       INTERPRET: tl.constexpr):
        """Token t: the chunks' sums in chunk order, the rows' norm factor, then `hc_post`."""
        t = tl.program_id(0).to(tl.int64)
        hc_eps = tl.cast(hc_eps, tl.float32)
        norm_eps = tl.cast(norm_eps, tl.float32)
        inv_k = tl.cast(inv_k, tl.float32)
        cc = tl.arange(0, BLOCK_C)
        cm = cc < CHUNKS
        r = rms_factor(tl.sum(tl.load(ss_ptr + t * CHUNKS + cc, mask=cm, other=0.0), axis=0), K, inv_k, norm_eps,
                       INTERPRET)  # the streams' unweighted RMSNorm factor
        rows = dots_ptr + (t * CHUNKS + cc) * BLOCK_M  # [BLOCK_C] chunk rows of this token
        i = tl.arange(0, N)
        jk = i[:, None] * N + i[None, :]
        pre_w = tl.sum(tl.load(rows[:, None] + i[None, :], mask=cm[:, None], other=0.0), axis=0) * r
        post_w = tl.sum(tl.load(rows[:, None] + N + i[None, :], mask=cm[:, None], other=0.0), axis=0) * r
        comb_w = tl.sum(tl.load(rows[:, None, None] + 2 * N + jk[None, :, :], mask=cm[:, None, None], other=0.0),
                        axis=0) * r
        pre, post, comb = _hc_outputs(pre_w, post_w, comb_w, base_ptr, scale_ptr, iters, hc_eps, N)
        _store_outputs(pre_ptr, post_ptr, comb_ptr, t, pre, post, comb, N)

    @triton.jit
    def _store_normed_rows(m_ptr, acc, ss, t, tm, mm, M, K, inv_k, norm_eps, INTERPRET: tl.constexpr):
        """m[t, :M] = the rows' dots acc [BLOCK_T, BLOCK_M] times their norm factor from the sums of squares ss."""
        r = rms_factor(ss, K, inv_k, norm_eps, INTERPRET)
        tl.store(m_ptr + t[:, None] * M + mm[None, :], acc * r[:, None], mask=tm[:, None] & (mm < M)[None, :])

    @triton.jit
    def _hc_rows_kernel(h_ptr, parts_ptr, m_ptr, ws_ptr, ss_ptr, T, K, M, KS, norm_eps, inv_k, BLOCK_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
        """BLOCK_T rows: m[t, :M] = rsqrt(mean(h_t^2) + eps) * sum over the three bf16 parts of fn of h_t . part.
        SPLIT: program (rows, s) takes columns [s KS, (s + 1) KS) only and writes its dots and sum of squares to
        the workspaces [S, T, BLOCK_M] / [S, T] for `_hc_rows_sum_kernel`."""
        norm_eps = tl.cast(norm_eps, tl.float32)
        inv_k = tl.cast(inv_k, tl.float32)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        mm = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
        sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        k_lo = 0
        k_hi = K
        if SPLIT:
            k_lo = tl.program_id(1) * KS
            k_hi = tl.minimum(k_lo + KS, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < k_hi
            x = tl.load(h_ptr + t[:, None] * K + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
            xf = x.to(tl.float32)
            sq += xf * xf
            for p in tl.static_range(3):
                w = tl.load(parts_ptr + (p * BLOCK_M + mm[:, None]) * K + k[None, :], mask=km[None, :], other=0.0)
                acc = bf16_dot(x, tl.trans(w), acc, INTERPRET)
        if SPLIT:
            s = tl.program_id(1).to(tl.int64)
            tl.store(ws_ptr + (s * T + t[:, None]) * BLOCK_M + mm[None, :], acc, mask=tm[:, None])
            tl.store(ss_ptr + s * T + t, tl.sum(sq, axis=1), mask=tm)
        else:
            _store_normed_rows(m_ptr, acc, tl.sum(sq, axis=1), t, tm, mm, M, K, inv_k, norm_eps, INTERPRET)

    @triton.jit
    def _hc_rows_sum_kernel(ws_ptr, ss_ptr, m_ptr, T, K, M, S, norm_eps, inv_k, BLOCK_T: tl.constexpr,
                            BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
        """The split programs' dots and sums of squares added in split order, then the rows' norm factor."""
        norm_eps = tl.cast(norm_eps, tl.float32)
        inv_k = tl.cast(inv_k, tl.float32)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        mm = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
        ss = tl.zeros([BLOCK_T], dtype=tl.float32)
        for s in range(0, S):
            acc += tl.load(ws_ptr + (s * T + t[:, None]) * BLOCK_M + mm[None, :], mask=tm[:, None], other=0.0)
            ss += tl.load(ss_ptr + s * T + t, mask=tm, other=0.0)
        _store_normed_rows(m_ptr, acc, ss, t, tm, mm, M, K, inv_k, norm_eps, INTERPRET)

    @triton.jit
    def _hc_rows_sum_tile_kernel(ws_ptr, ss_ptr, m_ptr, T, K, M, S, norm_eps, inv_k, BLOCK_T: tl.constexpr,
                                 BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
        """`_hc_rows_sum_kernel` with every split of BLOCK_T rows loaded as one tile and summed over the splits."""
        norm_eps = tl.cast(norm_eps, tl.float32)
        inv_k = tl.cast(inv_k, tl.float32)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        mm = tl.arange(0, BLOCK_M)
        s = tl.arange(0, BLOCK_S).to(tl.int64)
        sm = s < S
        parts = tl.load(ws_ptr + ((s[:, None, None] * T + t[None, :, None]) * BLOCK_M + mm[None, None, :]),
                        mask=sm[:, None, None] & tm[None, :, None], other=0.0)
        sq = tl.load(ss_ptr + s[:, None] * T + t[None, :], mask=sm[:, None] & tm[None, :], other=0.0)
        _store_normed_rows(m_ptr, tl.sum(parts, axis=0), tl.sum(sq, axis=0), t, tm, mm, M, K, inv_k, norm_eps,
                           INTERPRET)


def hc_post_triton(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                   hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same as one Triton launch (one token per program)."""
    assert triton is not None, "triton is not installed"
    m = m.float().contiguous()
    T = m.shape[0]
    pre = torch.empty(T, n, dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=m.device)
    if T:
        _hc_post_kernel[(T,)](m, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, iters,
                              hc_eps, N=n, W=m.shape[1])
    return pre, post, comb


def hc_post(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
            hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton on CUDA (N a power of two), torch elsewhere."""
    if m.is_cuda and triton is not None and n & (n - 1) == 0:
        return hc_post_triton(m, base, scale, n, iters, hc_eps)
    return hc_post_torch(m, base, scale, n, iters, hc_eps)


def hc_mixes_fused(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                   hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) of one site from its streams h [T, N, D] (any float dtype) and fn [(2+N)N, N*D] in two
    launches, no host sync (capturable); the composed path is dsv4.models.layers.mhc.hc_mixes."""
    assert triton is not None, "triton is not installed"
    T, N = h.shape[0], h.shape[1]
    M, K = fn.shape
    h2 = h.reshape(T, K).contiguous()
    fn = fn.float().contiguous()
    pre = torch.empty(T, N, dtype=torch.float32, device=h.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T, N, N, dtype=torch.float32, device=h.device)
    if T == 0:
        return pre, post, comb
    chunks = triton.cdiv(K, _MIX_CHUNK)
    block_m = triton.next_power_of_2(M)
    dots = torch.empty(T, chunks, block_m, dtype=torch.float32, device=h.device)
    ss = torch.empty(T, chunks, dtype=torch.float32, device=h.device)
    _hc_dots_kernel[(T, chunks)](h2, fn, dots, ss, K, _MIX_CHUNK, M=M, BLOCK_M=block_m,
                                 BLOCK_K=min(_MIX_CHUNK, triton.next_power_of_2(K)), num_warps=4)
    _hc_mix_kernel[(T,)](dots, ss, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, chunks,
                         K, 1.0 / K, norm_eps, iters, hc_eps, N=N, BLOCK_M=block_m,
                         BLOCK_C=triton.next_power_of_2(chunks), INTERPRET=INTERPRET, num_warps=1)
    return pre, post, comb


def use_fused_mixes(h: torch.Tensor) -> bool:
    """The fused site for streams h [T, N, D]: on CUDA, switched on, T <= FUSED_MAX_ROWS, N a power of two."""
    n = h.shape[1]
    return (FUSED_MIXES and h.is_cuda and triton is not None and h.shape[0] <= FUSED_MAX_ROWS
            and n & (n - 1) == 0)


def _cached_parts(fn: torch.Tensor) -> torch.Tensor | None:
    """fn's bf16 parts if made since fn last changed."""
    cached = getattr(fn, "_dsv4_bf16_parts", None)
    return cached[1] if cached is not None and cached[0] == fn._version else None


def bf16_parts(fn: torch.Tensor) -> torch.Tensor:
    """fn [M, K] (fp32) as three bf16 parts [3, _ROWS_M, K] (rows past M zero) with hi + mid + lo = fn to fp32
    precision: each part the bf16 rounding of what the ones before left. Kept on fn (a parameter) until it changes,
    so a step (and a captured graph) pays nothing for it."""
    cached = _cached_parts(fn)
    if cached is not None:
        return cached
    M, K = fn.shape
    rest = fn.detach().float()
    parts = torch.zeros(3, _ROWS_M, K, dtype=torch.bfloat16, device=fn.device)
    for i in range(3):
        parts[i, :M] = rest.to(torch.bfloat16)
        rest = rest - parts[i, :M].float()
    fn._dsv4_bf16_parts = (fn._version, parts)
    return parts


def rows_splits(T: int, K: int, sms: int) -> int:
    """Column splits of `hc_dots_rows` for T rows of K columns on `sms` SMs: enough that row blocks x splits fill
    the SMs twice, each split at least _ROWS_MIN_SPLIT_COLS columns (1 = the single pass)."""
    return max(1, min(-(-2 * sms // -(-T // _ROWS_BLOCK_T)), K // _ROWS_MIN_SPLIT_COLS))


def hc_dots_rows(h: torch.Tensor, fn: torch.Tensor, norm_eps: float, splits: int | None = None,
                 sum_tile: bool | None = None) -> torch.Tensor:
    """m [T, M] fp32 = unweighted_rms_norm(h.flatten(1)) @ fn^T for bf16 streams h [T, N, D] and fp32 fn [M, N*D]
    (M <= 32): one launch; with `splits` > 1 (default: `rows_splits` under ROWS_SPLIT_K, else 1) column splits and a
    second launch that adds them in order (or as one tile a program, `sum_tile`: default SUM_TILE). The composed
    path's value to fp32 rounding and summation order."""
    assert triton is not None, "triton is not installed"
    T = h.shape[0]
    M, K = fn.shape
    assert M <= _ROWS_M and h.dtype == torch.bfloat16, (M, h.dtype)
    h2 = h.reshape(T, K).contiguous()
    m = torch.empty(T, M, dtype=torch.float32, device=h.device)
    if not T:
        return m
    if splits is None:
        sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 1
        splits = rows_splits(T, K, sms) if ROWS_SPLIT_K else 1
    KS = triton.cdiv(triton.cdiv(K, splits), _ROWS_BLOCK_K) * _ROWS_BLOCK_K  # a split's columns, whole tiles
    S = triton.cdiv(K, KS)
    ws = torch.empty(S, T, _ROWS_M, dtype=torch.float32, device=h.device) if S > 1 else m
    ss = torch.empty(S, T, dtype=torch.float32, device=h.device) if S > 1 else m
    blocks = triton.cdiv(T, _ROWS_BLOCK_T)
    _hc_rows_kernel[(blocks, S)](h2, bf16_parts(fn), m, ws, ss, T, K, M, KS, norm_eps, 1.0 / K,
                                 BLOCK_T=_ROWS_BLOCK_T, BLOCK_M=_ROWS_M, BLOCK_K=_ROWS_BLOCK_K, SPLIT=S > 1,
                                 INTERPRET=INTERPRET, num_warps=4)
    if S > 1 and (SUM_TILE if sum_tile is None else sum_tile):
        _hc_rows_sum_tile_kernel[(triton.cdiv(T, _SUM_TILE_T),)](
            ws, ss, m, T, K, M, S, norm_eps, 1.0 / K, BLOCK_T=_SUM_TILE_T, BLOCK_S=max(2, triton.next_power_of_2(S)),
            BLOCK_M=_ROWS_M, INTERPRET=INTERPRET, num_warps=4)
    elif S > 1:
        _hc_rows_sum_kernel[(blocks,)](ws, ss, m, T, K, M, S, norm_eps, 1.0 / K, BLOCK_T=_ROWS_BLOCK_T,
                                       BLOCK_M=_ROWS_M, INTERPRET=INTERPRET, num_warps=4)
    return m


def use_dots_rows(h: torch.Tensor, fn: torch.Tensor) -> bool:
    """`hc_dots_rows` for streams h [T, N, D]: on CUDA, switched on, bf16, more than FUSED_MAX_ROWS rows; not in a
    graph capture before fn's parts exist (they would live in the graph's pool: captures warm up first, so this is
    only a guard)."""
    if not (MHC_ROWS and h.is_cuda and triton is not None and h.dtype == torch.bfloat16
            and h.shape[0] > FUSED_MAX_ROWS and fn.shape[0] <= _ROWS_M):
        return False
    return _cached_parts(fn) is not None or not torch.cuda.is_current_stream_capturing()

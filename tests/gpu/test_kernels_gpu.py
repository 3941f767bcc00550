"""Triton kernels against their torch references at real shapes on the GPU (fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.mhc import hc_post_torch, hc_post_triton
from dsv4.ops.moe import (PLAN_KERNEL_MAX_ROWS, expert_gemv_torch, expert_gemv_triton, expert_grouped_torch,
                          expert_grouped_triton, group_rows_torch, group_rows_triton)
from dsv4.ops.rope import apply_rope_torch, apply_rope_triton, apply_rope_triton_


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_hc_post(T: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(T)
    m = torch.randn(T, 24, device="cuda", generator=g) * 3
    base, scale = torch.randn(24, device="cuda", generator=g), torch.rand(3, device="cuda", generator=g) + 0.5
    for a, b in zip(hc_post_torch(m, base, scale, 4, 20, 1e-6), hc_post_triton(m, base, scale, 4, 20, 1e-6)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,M,splits,tile", [(9, 24, None, None), (4096, 24, None, None), (1000, 4, None, None),
                                              (9, 24, 20, None), (2048, 24, 9, None), (1000, 4, 7, None),
                                              (64, 24, None, True), (2048, 24, 9, True), (1000, 4, 7, True)])
def test_mhc_dots_rows(T: int, M: int, splits: int | None, tile: bool | None) -> None:
    """`hc_dots_rows` (normed bf16 streams times fp32 fn in one tensor-core pass, or in column splits added by a
    second launch) against fp64 at V4.1's width (4 x 5120): within the fp32 summation bound (K 2^-24 + 2^-21) of
    sum |fn h| r, where the composed fp32 path (norm, then cuBLAS fp32 GEMM) lands too."""
    import torch.nn.functional as F

    from dsv4.models.layers.norm import unweighted_rms_norm_fp32
    from dsv4.ops.mhc import hc_dots_rows

    g = torch.Generator(device="cuda").manual_seed(T + M)
    K = 4 * 5120
    fn = torch.nn.Parameter(torch.randn(M, K, device="cuda", generator=g) * K ** -0.5)
    h = (torch.randn(T, 4, 5120, device="cuda", generator=g) * 3).to(torch.bfloat16)
    got = hc_dots_rows(h, fn, 1e-6, splits=splits, sum_tile=tile)  # tile: the splits summed as one tile
    hd = h.flatten(1).double()
    r = torch.rsqrt(hd.square().mean(1) + 1e-6)
    ref = (hd @ fn.double().T) * r[:, None]
    bound = (K * 2.0 ** -24 + 2.0 ** -21) * (hd.abs() @ fn.double().abs().T) * r[:, None]
    old = F.linear(unweighted_rms_norm_fp32(h.flatten(1), 1e-6), fn)
    assert ((got.double() - ref).abs() <= bound).all(), ((got.double() - ref).abs() / bound).max()
    assert ((old.double() - ref).abs() <= bound).all()


def test_mhc_dots_rows_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled projection takes bf16 CUDA streams of more than FUSED_MAX_ROWS rows (fewer: the fused decode
    site), not fp32 ones, and nothing with DSV4_MHC_ROWS=0."""
    from dsv4.ops import mhc

    fn = torch.zeros(24, 64, device="cuda")
    rows = lambda T, dt=torch.bfloat16: torch.zeros(T, 4, 16, device="cuda", dtype=dt)  # noqa: E731
    assert mhc.use_dots_rows(rows(mhc.FUSED_MAX_ROWS + 1), fn) and not mhc.use_dots_rows(rows(mhc.FUSED_MAX_ROWS), fn)
    assert not mhc.use_dots_rows(rows(64, torch.float32), fn)
    assert not mhc.use_dots_rows(rows(64).cpu(), fn.cpu())
    graph = torch.cuda.CUDAGraph()  # a capture before fn's parts exist takes the composed path
    with torch.cuda.graph(graph):
        assert not mhc.use_dots_rows(rows(64), fn)
    mhc.bf16_parts(fn)
    with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
        assert mhc.use_dots_rows(rows(64), fn)
    monkeypatch.setattr(mhc, "MHC_ROWS", False)
    assert not mhc.use_dots_rows(rows(64), fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,half", [((64, 64, 512), 32), ((64, 512), 32), ((7, 32, 128), 32),
                                        ((4096, 64, 512), 32)])
def test_rope(dtype: torch.dtype, shape: tuple, half: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    ang = torch.randint(0, 10**6, (shape[0], 1), device="cuda", generator=g).float() * torch.rand(half, device="cuda")
    for inverse in (False, True):
        ref = apply_rope_torch(x, ang.cos(), ang.sin(), inverse)
        got = apply_rope_triton(x, ang.cos(), ang.sin(), inverse)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(ref.float(), got.float(), rtol=tol, atol=tol)
        for vec in (False, True):  # in place, rope channels only (strided or contiguous pairs): the same bits
            y = x.clone()
            assert apply_rope_triton_(y, ang.cos(), ang.sin(), inverse, vec=vec) is y and torch.equal(y, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_gemv(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    E, D, I, T, k = 16, 4096, 2048, 2, 6
    w = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02).to(dtype)
    x = torch.randn(T, D, device="cuda", generator=g).to(dtype)
    idx = torch.randint(0, E, (T * k,), device="cuda", generator=g)
    idx[1::4] = -1  # rows with no expert (another rank's, under expert parallelism): zeros
    ref, got = expert_gemv_torch(x, w, idx, k).float(), expert_gemv_triton(x, w, idx, k).float()
    rel = ((ref - got).norm() / ref.norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2)
    assert got[idx < 0].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,E,N,K", [(512, 6, 16, 4096, 5120), (512, 6, 16, 5120, 2048), (37, 6, 256, 512, 256),
                                       (3, 2, 8, 256, 128)])
def test_expert_grouped(dtype: torch.dtype, T: int, k: int, E: int, N: int, K: int) -> None:
    """The grouped expert matmul of prefill steps at the V4.1-Flash-shaped preset's gate_up and down shapes (a
    512-token chunk), many experts with few rows, and a tiny batch. Against the same product in fp32 (cuBLAS
    without TF32, by default; rather than the bf16 torch path, whose cuBLAS may reduce split-K partials in bf16).
    fp32 (`input_precision="ieee"`, FMA on the CUDA cores): within summation order. bf16 (tensor cores): the output's
    rounding (2^-8 relative) plus the accumulation's error. Tensor cores do not accumulate as IEEE fp32: each MMA
    step (16 products here) aligns its terms to the largest exponent and truncates, about one fp32 ulp of the
    running sum per step, so the error grows with K/16 times the size of the partial sums, bounded by
    S = sum |x||w|: |got - ref| <= 2^-8 |ref| + (K/16 + 1) 2^-23 S. (The first GPU run asserted 2^-8 |ref| + 1e-5,
    i.e. exact fp32 accumulation: it held for K <= 2048 and failed at K = 5120, where near-zero outputs were off by
    ~1e-5 to 1e-4 with S ~ 57 -- the size this bound predicts, but the bound itself has not run on a GPU yet.)"""
    g = torch.Generator(device="cuda").manual_seed(T * k + E)
    x = torch.randn(T, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(E, N, K, device="cuda", generator=g) * K ** -0.5).to(dtype)
    idx = torch.randint(0, E, (T * k,), device="cuda", generator=g)
    if E < 100:  # rows with no expert (another rank's, under expert parallelism): zeros
        idx[T // 2:: 3] = -1
    ref = expert_grouped_torch(x.float(), w.float(), idx, k)
    got = expert_grouped_triton(x, w, idx, k)
    assert got[idx < 0].eq(0).all()
    assert got.dtype == dtype and got.shape == ref.shape
    err = (got.float() - ref).abs()
    if dtype == torch.float32:
        assert (err <= ref.abs() * 1e-5 + 1e-5).all(), err.max()
    else:
        S = expert_grouped_torch(x.float().abs(), w.float().abs(), idx, k)  # sum |x||w| per output
        bound = ref.abs() * 2.0 ** -8 + (K / 16 + 1) * 2.0 ** -23 * S
        assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("R,E,bm", [(1, 16, 16), (6, 256, 16), (192, 16, 32), (384, 16, 64), (777, 384, 16),
                                    (PLAN_KERNEL_MAX_ROWS, 256, 64)])
def test_group_rows_kernel(R: int, E: int, bm: int) -> None:
    """The one-launch row plan equals the torch ops' plan field for field (stable order, counts, offsets, block
    ends; rows of no expert last), also replayed from a CUDA graph with new routes in the captured input."""
    g = torch.Generator(device="cuda").manual_seed(R + E)
    idx = torch.randint(0, E, (R,), device="cuda", generator=g)
    if R > 8:
        idx[R // 3:: 5] = -1
        idx[: R // 4] = 3  # a hot expert
    ref, got = group_rows_torch(idx, E, bm), group_rows_triton(idx, E, bm)
    for name, a, b in zip(ref._fields[:4], ref[:4], got[:4]):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = group_rows_triton(idx, E, bm)
    idx.copy_(torch.randint(-1, E, (R,), device="cuda", generator=g))
    graph.replay()
    ref = group_rows_torch(idx, E, bm)
    for name, a, b in zip(ref._fields[:4], ref[:4], captured[:4]):
        assert torch.equal(a, b), ("replay", name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,D", [(1, 6, 5120), (32, 6, 5120), (64, 8, 4096), (3, 1, 100)])
def test_combine_experts(dtype: torch.dtype, T: int, k: int, D: int) -> None:
    """The fused MoE combine against the torch path on the GPU, both numerics (V4.1: one rounding; V4: weighted slots
    rounded, then the shared expert added in the model dtype). torch's CUDA reduction may add the k slots in another
    order (fp32, k ulps of S = sum |slot| + |shared|), and each rounding to the model dtype may then land on the
    neighbouring value (one ulp of the result or of the routed sum): |ref - got| <= 2 ulp (|ref| + S) + k 2^-24 S."""
    from dsv4.ops.moe import combine_experts_torch, combine_experts_triton

    g = torch.Generator(device="cuda").manual_seed(T * k + D)
    y = (torch.randn(T * k, D, device="cuda", generator=g) * 3).to(dtype)
    shared = torch.randn(T, D, device="cuda", generator=g).to(dtype)
    w = torch.rand(T * k, device="cuda", generator=g)
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    for weights in (None, w):
        ref, got = combine_experts_torch(y, weights, shared, k), combine_experts_triton(y, weights, shared, k)
        assert got.dtype == ref.dtype == dtype and got.shape == ref.shape == (T, D)
        scaled = y.float() * (weights[:, None] if weights is not None else 1.0)
        S = scaled.abs().view(T, k, D).sum(1) + shared.float().abs()
        bound = 2 * ulp * (ref.float().abs() + S) + k * 2.0 ** -24 * S
        assert ((ref.float() - got.float()).abs() <= bound).all(), weights is None


@pytest.mark.parametrize("R,M", [(1, 2048), (32, 136), (64, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores(R: int, M: int, dtype: torch.dtype) -> None:
    """The indexer scores at the V4.1 indexer's shape (64 heads of 128) against the torch path on the GPU: -inf in
    the same places, finite scores within summation order, and the same top-512 picks wherever the reference's
    k-th and (k+1)-th scores are further apart than that."""
    from dsv4.ops.indexer import indexer_scores_torch, indexer_scores_triton
    from dsv4.ops.topk import stable_topk

    g = torch.Generator(device="cuda").manual_seed(R * M)
    H, D, N = 64, 128, 4096
    # a bf16 key cache comes with a bf16 model, whose queries are bf16 values (the kernel's premise, dots_in_bf16)
    q = torch.randn(R, H, D, device="cuda", generator=g).to(dtype).float()
    w = torch.randn(R, H, device="cuda", generator=g)
    keys = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    slots = torch.randint(0, N, (R, M), device="cuda", generator=g)
    n = torch.randint(0, M + 1, (R,), device="cuda", generator=g)
    n[0] = M
    ref = indexer_scores_torch(q, w, keys, slots, n, D ** -0.5)
    got = indexer_scores_triton(q, w, keys, slots, n, D ** -0.5)
    assert torch.equal(torch.isinf(ref), torch.isinf(got))
    fin = torch.isfinite(ref)
    scale = ref[fin].abs().max()
    assert ((ref[fin] - got[fin]).abs() <= 1e-5 * scale).all()
    k = min(512, M)
    top = ref.sort(dim=1, descending=True).values
    clear = (top[:, k - 1] - top[:, k]).abs() > 2e-5 * scale if k < M else torch.ones(R, dtype=torch.bool, device="cuda")
    picks_ref, picks_got = stable_topk(ref, k).sort(1).values, stable_topk(got, k).sort(1).values
    assert torch.equal(picks_ref[clear], picks_got[clear])


@pytest.mark.parametrize("R,M,K", [(1, 2048, 512), (32, 136, 136), (64, 700, 512)])
def test_pick_sources(R: int, M: int, K: int) -> None:
    """Picks -> attention source on the GPU: integer work, so equal to the torch path exactly."""
    from dsv4.ops.indexer import pick_sources_torch, pick_sources_triton

    g = torch.Generator(device="cuda").manual_seed(R + M)
    scores = torch.randn(R, M, device="cuda", generator=g)
    n = torch.randint(0, M + 1, (R,), device="cuda", generator=g)
    scores[torch.arange(M, device="cuda")[None, :] >= n[:, None]] = float("-inf")
    picks = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :K]
    eslots = torch.randint(0, 10**6, (R, M), device="cuda", generator=g)
    for sc in (scores, None):
        for a, b in zip(pick_sources_torch(picks, eslots, sc), pick_sources_triton(picks, eslots, sc)):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 32, 512])
def test_engram_update(dtype: torch.dtype, T: int) -> None:
    """The fused Engram gate and update at the V4.1-Flash shape (hc 4, hidden 5120) against the torch path on the
    GPU, masked tokens included: within an ulp of the stream dtype (the sums over D add in another order), nearly
    all equal in bf16; masked tokens pass through exactly."""
    from dsv4.ops.engram import engram_update_torch, engram_update_triton

    g = torch.Generator(device="cuda").manual_seed(T)
    hc, D = 4, 5120
    h = torch.randn(T, hc, D, device="cuda", generator=g).to(dtype)
    kv = torch.randn(T, (hc + 1) * D, device="cuda", generator=g).to(dtype)
    qw = (torch.rand(hc, D, device="cuda", generator=g) + 0.5).to(dtype)
    kw = torch.randn(hc, D, device="cuda", generator=g).to(dtype)
    mask = torch.rand(T, device="cuda", generator=g) < 0.3
    ref, got = engram_update_torch(h, kv, qw, kw, 1e-6, mask), engram_update_triton(h, kv, qw, kw, 1e-6, mask)
    r, o = ref.float(), got.float()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    # the gate may differ by what the sums' order moves it (~1e-6 here; 1e-4 allowed), scaled by the value row
    value = kv[:, hc * D:].float().abs()[:, None, :]
    assert ((r - o).abs() <= r.abs() * ulp + 1e-4 * value + 1e-6).all(), (r - o).abs().max()
    if dtype == torch.bfloat16:
        assert (r != o).float().mean() < 0.05
    assert torch.equal(got[mask], h[mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,m", [(512, 4), (512, 128), (128, 4)])
def test_write_entries(dtype: torch.dtype, D: int, m: int) -> None:
    """V4's fused compressed-entry write (norm, rope at the window's start, scatter) against the torch path on the
    GPU at the V4-Flash shapes (head 512 or indexer 128, rope 64): only the rows' slots change, within an ulp of the
    stream dtype (the RMS statistic's sum may add in another order), nearly all equal."""
    from dsv4.models.config import RopeConfig
    from dsv4.models.layers.norm import rms_norm_torch
    from dsv4.models.layers.rope import RotaryTable
    from dsv4.ops.compress_pool import write_entries_torch, write_entries_triton

    g = torch.Generator(device="cuda").manual_seed(D + m)
    rope = RotaryTable(RopeConfig(theta=10000.0, dim=64)).cuda()
    rope.prepare(8192)
    R = 64
    pooled = (torch.randn(R, D, device="cuda", generator=g) * 3).to(dtype)
    weight = torch.rand(D, device="cuda", generator=g) + 0.5
    pos = torch.randint(0, 8192, (R,), device="cuda", generator=g)
    slots = torch.randperm(4 * R, device="cuda", generator=g)[:R]
    caches = [torch.full((4 * R, D), 7.0, device="cuda", dtype=dtype) for _ in range(2)]
    write_entries_torch(pooled, weight, 1e-6, rope.table, pos, m, caches[0], slots)
    write_entries_triton(pooled, weight, 1e-6, rope.table, pos, m, caches[1], slots)
    r, o = caches[0].float(), caches[1].float()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    # a normed value one ulp off (the statistic's sum order) moves a rotated pair by an ulp of the pair's size, which
    # can exceed an ulp of a result that cancels
    y = rms_norm_torch(pooled, weight, 1e-6).float()
    pair = torch.zeros_like(y)
    pair[:, D - 64:] = (y[:, D - 64::2].abs() + y[:, D - 63::2].abs()).repeat_interleave(2, dim=1)
    bound = r[slots].abs() * ulp + 2 * ulp * pair + 1e-6
    assert ((r[slots] - o[slots]).abs() <= bound).all(), (r - o).abs().max()
    if dtype == torch.bfloat16:  # in fp32 a statistic one ulp off changes every element of its row
        assert (r != o).float().mean() < 0.05
    untouched = torch.ones(4 * R, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert (o[untouched] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1, 32, 64])
def test_window_kv(dtype: torch.dtype, R: int) -> None:
    """V4.1's fused window-KV write (norm, rope, FP8 fake quant, scatter) against the torch ops on the GPU at the
    V4.1 shape (head 512, rope 64, cos/sin from a gathered table row): only the rows' slots change; nearly every
    element equal, the rest at most one FP8 step (2^-3 relative) away (a normed value an ulp off flips a code)."""
    from dsv4.models.config import RopeConfig
    from dsv4.models.layers.rope import RotaryTable
    from dsv4.ops.cache_writes import write_window_kv_torch, write_window_kv_triton

    g = torch.Generator(device="cuda").manual_seed(R)
    D = 512
    rope = RotaryTable(RopeConfig(theta=10000.0, dim=64)).cuda()
    rope.prepare(4096)
    cos, sin = rope(torch.randint(0, 4096, (R,), device="cuda", generator=g))
    latent = (torch.randn(R, D, device="cuda", generator=g) * 4).to(dtype)
    weight = (torch.rand(D, device="cuda", generator=g) + 0.5).to(dtype)
    slots = torch.randperm(2 * R, device="cuda", generator=g)[:R]
    caches = [torch.full((2 * R, D), 3.0, device="cuda", dtype=dtype) for _ in range(2)]
    write_window_kv_torch(latent, weight, 1e-6, cos, sin, caches[0], slots)
    write_window_kv_triton(latent, weight, 1e-6, cos, sin, caches[1], slots)
    r, o = caches[0].float(), caches[1].float()
    assert ((r - o).abs() <= r.abs() * 2.0 ** -3 + 1e-6).all()
    assert (r != o).float().mean() < 0.02
    untouched = torch.ones(2 * R, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert (o[untouched] == 3.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 2])
def test_entry_writes(dtype: torch.dtype, ratio: int) -> None:
    """V4.1's fused decode entry writes at the V4.1 shapes (latent 512 with rope 64, indexer keys 128) against the
    torch ops on the GPU: the compressed entry bit for bit (no norm), the keys nearly all equal and the rest at most
    one FP4 step away; rows that complete no entry write the trash slot only."""
    from dsv4.models.config import RopeConfig
    from dsv4.models.layers.rope import RotaryTable
    from dsv4.ops.cache_writes import (write_entry_kv_torch, write_entry_kv_triton, write_index_keys_torch,
                                       write_index_keys_triton)

    g = torch.Generator(device="cuda").manual_seed(ratio)
    R, D, d = 64, 512, 128
    rope = RotaryTable(RopeConfig(theta=10000.0, dim=64)).cuda()
    rope.prepare(8192)
    pos = torch.randint(0, 8000, (R,), device="cuda", generator=g)
    closes = (pos + 1) % ratio == 0
    slots = torch.where(closes, torch.randperm(2 * R, device="cuda", generator=g)[:R] + 1, 0)  # 0: the trash slot
    latent = (torch.randn(R, D, device="cuda", generator=g) * 3).to(dtype)
    caches = [torch.full((2 * R + 1, D), 7.0, device="cuda", dtype=dtype) for _ in range(2)]
    write_entry_kv_torch(latent, rope.table, pos, ratio, caches[0], slots)
    write_entry_kv_triton(latent, rope.table, pos, ratio, caches[1], slots)
    assert torch.equal(caches[0][1:], caches[1][1:])
    k = (torch.randn(R, d, device="cuda", generator=g) * 2).to(dtype)
    w = (torch.rand(d, device="cuda", generator=g) + 0.5).to(dtype)
    keys = [torch.full((2 * R + 1, d), 7.0, device="cuda", dtype=dtype) for _ in range(2)]
    write_index_keys_torch(k, w, 1e-6, rope.table, pos, ratio, keys[0], slots)
    write_index_keys_triton(k, w, 1e-6, rope.table, pos, ratio, keys[1], slots)
    r, o = keys[0][1:].float(), keys[1][1:].float()
    assert ((r - o).abs() <= r.abs() * 0.5 + 1e-6).all()
    assert (r != o).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_bits(dtype: torch.dtype) -> None:
    """The Triton fake quant (what fp8_fake_quant & co. dispatch to on CUDA) equals the torch path on the GPU bit
    for bit, the sign of zero included: random values at the V4.1 shapes, tiny and huge blocks, zeros, e2m1 ties
    and every e4m3 midpoint."""
    from dsv4.ops.fake_quant import (FP4_E4M3, FP4_UE8M0, FP8_UE8M0, fake_quant_triton, fp4_fake_quant_e4m3_torch,
                                     fp4_fake_quant_ue8m0_torch, fp8_fake_quant_torch)

    g = torch.Generator(device="cuda").manual_seed(5)
    cases = [torch.randn(64, 512, device="cuda", generator=g), torch.randn(32, 64, 128, device="cuda", generator=g),
             torch.randn(7, 64, device="cuda", generator=g) * 100, torch.randn(5, 32, device="cuda", generator=g) * 1e-5,
             torch.zeros(2, 32, device="cuda"), -torch.zeros(2, 32, device="cuda"),
             (torch.randint(-24, 25, (4, 64), device="cuda", generator=g) * 0.25).float()]
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
    mids = (grid[1:] + grid[:-1]) / 2
    mids = torch.cat([mids, mids.new_zeros((-len(mids)) % 31)]).view(-1, 31)
    blocks = torch.cat([torch.full((mids.shape[0], 1), 448.0), mids], dim=1).cuda()
    cases += [blocks, -blocks, blocks * 2.0**-20]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for x in cases:
        x = x.to(dtype)
        for fn, mode, block in ((fp8_fake_quant_torch, FP8_UE8M0, 32), (fp4_fake_quant_ue8m0_torch, FP4_UE8M0, 32),
                                (fp4_fake_quant_e4m3_torch, FP4_E4M3, 16)):
            ref, got = fn(x, block), fake_quant_triton(x, mode, block)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(ref.view(bits), got.view(bits)), (fn.__name__, (ref.float() - got.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D", [(1, 4096), (32, 5120), (64, 4096), (3, 100)])
def test_mhc_collapse_expand(dtype: torch.dtype, T: int, D: int) -> None:
    """The stream collapse and both expand numerics against torch on the GPU: within the terms' reordering
    bound, and in bf16 nearly every element bit-equal."""
    from dsv4.ops.mhc_streams import collapse_torch, collapse_triton, expand_torch, expand_triton

    g = torch.Generator(device="cuda").manual_seed(T + D)
    N = 4
    h = torch.randn(T, N, D, device="cuda", generator=g).to(dtype)
    y = torch.randn(T, D, device="cuda", generator=g).to(dtype)
    pre = torch.rand(T, N, device="cuda", generator=g) + 0.1
    post = 2 * torch.rand(T, N, device="cuda", generator=g)
    comb = torch.softmax(torch.randn(T, N, N, device="cuda", generator=g), dim=-1)
    hf = h.float().abs()
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    checks = [(collapse_torch(h, pre), collapse_triton(h, pre), (pre[..., None] * hf).sum(1))]
    mag = post[..., None] * y.float().abs()[:, None] + torch.matmul(comb.transpose(-1, -2), hf)
    for fp32 in (True, False):
        checks.append((expand_torch(y, h, post, comb, fp32), expand_triton(y, h, post, comb, fp32), mag))
    for ref, got, m in checks:
        assert ref.dtype == got.dtype == dtype and ref.shape == got.shape
        r, o = ref.float(), got.float()
        assert ((r - o).abs() <= r.abs() * ulp + m * 4 * 2.0 ** -23 + 1e-30).all()
        if dtype == torch.bfloat16:
            assert (r != o).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,I", [(1, 2048), (6, 2048), (192, 1536), (5, 100)])
def test_swiglu_bits(dtype: torch.dtype, R: int, I: int) -> None:
    """The fused clamped SwiGLU gives torch's CUDA bits: the same silu formula (accurate expf, IEEE division),
    every product rounded, both numerics, with and without the row weight, on strided halves of one row."""
    from dsv4.ops.swiglu import swiglu_torch, swiglu_triton

    g = torch.Generator(device="cuda").manual_seed(R * I)
    gu = (torch.randn(R, 2 * I, device="cuda", generator=g) * 6).to(dtype)
    gate, up = gu[:, :I], gu[:, I:]
    w = torch.rand(R, device="cuda", generator=g)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for weight, fp32 in ((None, True), (w, True), (None, False)):
        ref, got = swiglu_torch(gate, up, 10.0, weight, fp32), swiglu_triton(gate, up, 10.0, weight, fp32)
        assert torch.equal(ref.view(bits), got.view(bits)), (weight is not None, fp32, (ref - got).abs().max())


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("T,E,k", [(1, 64, 6), (32, 64, 6), (64, 256, 8), (7, 9, 1)])
def test_router_matches_torch(scoring: str, T: int, E: int, k: int) -> None:
    """The fused V4.1 routing picks exactly torch's experts on the GPU (its scores follow torch's CUDA arithmetic,
    ties to the lowest id) and its weights agree to an fp32 ulp or two (the normalising sum's order)."""
    from dsv4.ops.router import route_torch, route_triton

    g = torch.Generator(device="cuda").manual_seed(T * E + k)
    logits = torch.randn(T, E, device="cuda", generator=g) * 4
    logits[0, 1] = logits[0, 4] = logits[0].max() + 1  # an exact tie at the top
    bias, bias_vl = (torch.randn(E, device="cuda", generator=g) * 0.1 for _ in range(2))
    bias[[1, 4]] = bias_vl[[1, 4]] = 0.0
    is_image = torch.rand(T, device="cuda", generator=g) < 0.5
    for temp in (1.0, 1.3):
        w0, i0 = route_torch(logits, bias, bias_vl, is_image, temp, scoring, k, 1.5)
        w1, i1 = route_triton(logits, bias, bias_vl, is_image, temp, scoring, k, 1.5)
        assert torch.equal(i0, i1)
        assert torch.allclose(w0, w1, rtol=3e-7, atol=0), (w0 - w1).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,overlap,dim", [(4, True, 512), (128, False, 512), (4, True, 128)])
def test_compressor_decode_pool(dtype: torch.dtype, m: int, overlap: bool, dim: int) -> None:
    """V4's decode pooling kernel against the torch path on the GPU, with early rows (masked ring rows) and many
    state blocks: nearly every element equal, the rest within the rounding bound below.

    The bound: the softmax denominators add in another order, so a weight w may round to the neighbouring stream
    value (one ulp, <= 2^-7 w in bf16), which moves its product kv*w by up to two ulps of it (the weight's and the
    product's rounding); the denominator's and the weighted sum's n terms add in another order (n fp32 ulps each,
    relative to sum |kv*w|); the result rounds once more (one ulp of it). With S = sum |kv*w| (the reference pooling
    of |kv|): |r - o| <= ulp |r| + S (2 ulp + 2 n 2^-24). Its first GPU run at 128 rows failed the bound without the S terms, where an entry
    cancels to near 0 and a flipped weight is far more than one ulp of the result."""
    from dsv4.ops.compress_pool import pool_decode_torch, pool_decode_triton

    g = torch.Generator(device="cuda").manual_seed(m + dim)
    cap, coff, blocks, R = (2 * m if overlap else m), (2 if overlap else 1), 70, 64
    ring_kv = torch.randn(blocks, cap, coff * dim, device="cuda", generator=g).to(dtype)
    ring_gate = torch.randn(blocks, cap, coff * dim, device="cuda", generator=g) * 2
    pb = torch.randn(m, coff * dim, device="cuda", generator=g)
    pos = torch.randint(0, 4 * cap, (R,), device="cuda", generator=g)
    pos[:4] = torch.tensor([0, 1, cap - 1, cap], device="cuda")
    blk = torch.randperm(blocks, device="cuda", generator=g)[:R]
    ref = pool_decode_torch(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype)
    got = pool_decode_triton(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype)
    assert ref.dtype == got.dtype and ref.shape == got.shape
    r, o = ref.float(), got.float()
    s = pool_decode_torch(ring_kv.abs(), ring_gate, blk, pos, pb, m, overlap, dtype).float()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    bound = r.abs() * ulp + s * (2 * ulp + 2 * cap * 2.0 ** -24)
    assert ((r - o).abs() <= bound).all(), ((r - o).abs() / bound).max()
    if dtype == torch.bfloat16:
        assert (r != o).float().mean() < 0.05, (r != o).float().mean()
    # with the push of the new raw rows (blk is a permutation: one state block per row, as in the engine): the same
    # ring contents bit for bit, and pooled entries within the same bound
    new_kv = (torch.randn(R, coff * dim, device="cuda", generator=g) * 3).to(dtype)
    new_gate = torch.randn(R, coff * dim, device="cuda", generator=g)  # fp32, as the gate ring
    rings = [(ring_kv.clone(), ring_gate.clone()) for _ in range(2)]
    ref = pool_decode_torch(*rings[0], blk, pos, pb, m, overlap, dtype, new_kv, new_gate)
    got = pool_decode_triton(*rings[1], blk, pos, pb, m, overlap, dtype, new_kv, new_gate)
    assert torch.equal(rings[0][0], rings[1][0]) and torch.equal(rings[0][1], rings[1][1])
    r, o = ref.float(), got.float()
    s = pool_decode_torch(rings[0][0].abs(), rings[0][1], blk, pos, pb, m, overlap, dtype).float()
    bound = r.abs() * ulp + s * (2 * ulp + 2 * cap * 2.0 ** -24)
    assert ((r - o).abs() <= bound).all(), ((r - o).abs() / bound).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slack", [0, 5])
def test_v41_decode_pool(dtype: torch.dtype, slack: int) -> None:
    """V4.1's ratio-2 decode pooling kernel (`pool_decode_v41` on CUDA) against its torch reference on the GPU, 64
    rows at V4.1-Flash's head_dim: the rings after the push bit for bit; the latents of the rows that close their
    pair within one rounding of the stream dtype plus a few fp32 ulps of the rows (two-term sums add in either order;
    the softmax's exp and division may round differently from torch's kernel)."""
    from dsv4.ops.compress_pool import pool_decode_v41, pool_decode_v41_torch

    g = torch.Generator(device="cuda").manual_seed(41 + slack)
    R, dim, blocks = 64, 512, 70
    ring_kv = torch.randn(blocks, 2 + slack, dim, device="cuda", generator=g) * 2
    ring_gate = torch.randn(blocks, 2 + slack, dim, device="cuda", generator=g) * 3
    pos = torch.randint(0, 4000, (R,), device="cuda", generator=g)
    pos[:2] = torch.tensor([1, 0], device="cuda")
    blk = torch.randperm(blocks, device="cuda", generator=g)[:R]
    kv = torch.randn(R, dim, device="cuda", generator=g) * 2
    gate = torch.randn(R, dim, device="cuda", generator=g) * 3
    rings = [(ring_kv.clone(), ring_gate.clone()) for _ in range(2)]
    ref = pool_decode_v41_torch(*rings[0], blk, pos, kv, gate, 2, dtype)
    got = pool_decode_v41(*rings[1], blk, pos, kv, gate, 2, dtype)
    assert torch.equal(rings[0][0], rings[1][0]) and torch.equal(rings[0][1], rings[1][1])
    closed = (pos + 1) % 2 == 0
    r, o = ref[closed].float(), got[closed].float()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    bound = r.abs() * ulp + 4 * 2.0 ** -23 * rings[0][0].abs().amax()
    assert ((r - o).abs() <= bound).all(), ((r - o).abs() / bound).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "overlap", "dim"), [(4, True, 512), (128, False, 512), (4, True, 128)])
def test_pool_verify_rows(dtype: torch.dtype, m: int, overlap: bool, dim: int) -> None:
    """A verify step's rows (q = 6 a request, 32 requests; V4-Flash's CSA, HCA and CSA indexer compressors): the
    kernel's windows from the step and the ring as `pool_verify_torch`, within the decode pool's bound, rings
    untouched."""
    from dsv4.ops.compress_pool import pool_decode_triton, pool_verify_torch

    g = torch.Generator(device="cuda").manual_seed(m + dim + 1)
    q, R = 6, 32
    cap, coff = (2 * m if overlap else m) + q, (2 if overlap else 1)  # q rows of slack, as under speculation
    ring_kv = torch.randn(70, cap, coff * dim, device="cuda", generator=g).to(dtype)
    ring_gate = torch.randn(70, cap, coff * dim, device="cuda", generator=g) * 2
    pb = torch.randn(m, coff * dim, device="cuda", generator=g)
    starts = torch.randint(0, 4 * cap, (R,), device="cuda", generator=g)
    starts[:3] = torch.tensor([0, 1, cap - 2], device="cuda")
    pos = (starts[:, None] + torch.arange(q, device="cuda")).reshape(-1)
    blk = torch.randperm(70, device="cuda", generator=g)[:R].repeat_interleave(q)
    new_kv = (torch.randn(R * q, coff * dim, device="cuda", generator=g) * 3).to(dtype)
    new_gate = torch.randn(R * q, coff * dim, device="cuda", generator=g).to(dtype)
    before = ring_kv.clone()
    ref = pool_verify_torch(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype, new_kv, new_gate, q)
    got = pool_decode_triton(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype, new_kv, new_gate, q)
    assert torch.equal(ring_kv, before)
    r, o = ref.float(), got.float()
    s = pool_verify_torch(ring_kv.abs(), ring_gate, blk, pos, pb, m, overlap, dtype, new_kv.abs(), new_gate,
                          q).float()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    bound = r.abs() * ulp + s * (2 * ulp + 2 * cap * 2.0 ** -24)
    assert ((r - o).abs() <= bound).all(), ((r - o).abs() / bound).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E", [256, 384])
@pytest.mark.parametrize("hash_layer", [False, True])
def test_route_v4(dtype: torch.dtype, E: int, hash_layer: bool) -> None:
    """V4's router kernel against torch's ops on the same CUDA logits: the same experts, and weights rounded at the
    same points (the normalising sum's order may move one ulp)."""
    from dsv4.ops.router import route_v4_torch, route_v4_triton
    g = torch.Generator(device="cuda").manual_seed(E)
    T, k = 64, 6
    logits = (torch.randn(T, E, device="cuda", generator=g) * 3).to(dtype)
    bias = torch.randn(E, device="cuda", generator=g) * 0.1
    tid2eid = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(100)]).int()
    ids = torch.randint(0, 100, (T,), device="cuda", generator=g)
    b, table = (None, tid2eid) if hash_layer else (bias, None)
    w0, i0 = route_v4_torch(logits, b, table, ids, "sqrtsoftplus", k, 2.5)
    w1, i1 = route_v4_triton(logits, b, table, ids, "sqrtsoftplus", k, 2.5)
    assert torch.equal(i0, i1)
    rtol = 4e-7 if dtype == torch.float32 else 2.0 ** -7
    assert w1.dtype == dtype and torch.allclose(w0.float(), w1.float(), rtol=rtol, atol=0)
    if dtype == torch.bfloat16:
        assert (w0 == w1).float().mean() > 0.9

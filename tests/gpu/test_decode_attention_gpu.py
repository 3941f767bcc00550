"""The sink attention kernels at real shapes (64 heads, head dim 512, window 128, top-k 512) against the torch
reference, in fp64 and in the model's own fp32 form: the flash-decoding split kernel (decode batches, eager and under
CUDA graph capture) and the rows kernel (prefill-sized row counts)."""

from __future__ import annotations

import pytest
import torch

from dsv4.models.layers.attention import sink_attention_rows
from dsv4.ops.decode_attention import _sm_count, decode_sink_attention, decode_sink_attention_triton, use_rows_kernel

H, D, W = 64, 512, 128


def _case(R: int, L2: int, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    nw, nc = 8192, 4096
    window = torch.randn(nw, D, device="cuda", generator=g).to(dtype)
    comp = (torch.randn(nc, D, device="cuda", generator=g) * 1.5).to(dtype)
    q = (torch.randn(R, H, D, device="cuda", generator=g) * 2).to(dtype)
    sinks = torch.randn(H, device="cuda", generator=g) * 2
    ws = torch.stack([torch.randperm(nw, device="cuda", generator=g)[:W] for _ in range(R)])
    cs = torch.stack([torch.randperm(nc, device="cuda", generator=g)[:L2] for _ in range(R)])
    # a short history on row 0 (few window keys, no compressed one), random masks elsewhere
    wm = torch.rand(R, W, device="cuda", generator=g) < 0.9
    cm = torch.rand(R, L2, device="cuda", generator=g) < 0.8
    wm[0, 5:], cm[0] = False, False
    if R > 2:
        wm[1], cm[1] = False, False  # a padding row: nothing visible -> 0
    return q, [(window, ws, wm), (comp, cs, cm)], sinks


def _reference(q: torch.Tensor, sources: list, sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    keys = torch.cat([c[s] for c, s, _ in sources], dim=1).to(dtype)
    mask = torch.cat([m for _, _, m in sources], dim=1)
    logits = torch.einsum("rhd,rld->rhl", q.to(dtype), keys) * D ** -0.5
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    logits = torch.cat([logits, sinks.to(dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("rhl,rld->rhd", probs, keys)


@pytest.mark.parametrize("R", [1, 8, 32])
@pytest.mark.parametrize("L2", [512, 8])
def test_bf16_matches_fp64(R: int, L2: int) -> None:
    q, sources, sinks = _case(R, L2, torch.bfloat16, R * 1000 + L2)
    ref64 = _reference(q, sources, sinks, torch.float64)
    got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5)
    keys = torch.cat([c[s] for c, s, _ in sources], dim=1)
    ref32 = sink_attention_rows(q, keys, torch.cat([m for _, _, m in sources], 1), sinks, D ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (R, H, D)
    assert torch.allclose(got.double(), ref64, rtol=1e-2, atol=1e-2), (got.double() - ref64).abs().max()
    # as accurate as the reference the model used before (both round to bf16 once at the end)
    err, err32 = (got.double() - ref64).abs().mean(), (ref32.double() - ref64).abs().mean()
    assert err <= 1.5 * err32 + 1e-6, (err, err32)
    if R > 2:
        assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("R", [1, 32])
def test_fp32_matches_fp64(R: int) -> None:
    q, sources, sinks = _case(R, 512, torch.float32, 7 + R)
    got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5)
    assert torch.allclose(got.double(), _reference(q, sources, sinks, torch.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("R", [1, 8, 32])
def test_single_source_and_splits(R: int) -> None:
    q, sources, sinks = _case(R, 512, torch.bfloat16, 99 + R)
    ref = _reference(q, sources[:1], sinks, torch.float64)
    assert torch.allclose(decode_sink_attention(q, sources[:1], sinks, D ** -0.5).double(), ref, rtol=1e-2, atol=1e-2)
    ref = _reference(q, sources, sinks, torch.float64)
    for chunk in (32, 96, 1024):
        got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, chunk=chunk)
        assert torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2), chunk


@pytest.mark.parametrize("R", [8, 32, 64])
def test_cuda_graph_replay(R: int) -> None:
    """Captured once, replayed on new slots, masks and queries written in place: the same as eager (8 rows: the
    split kernel; 32 and 64: the rows kernel with key splits, as decode graphs of 32 / 64 requests take it)."""
    q, sources, sinks = _case(R, 512, torch.bfloat16, 5)
    assert use_rows_kernel(R, H, _sm_count(q.device)) == (R >= 16)  # an H100 / H200 (132 SMs)
    decode_sink_attention(q, sources, sinks, D ** -0.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_sink_attention(q, sources, sinks, D ** -0.5)
    q2, sources2, _ = _case(R, 512, torch.bfloat16, 6)
    q.copy_(q2)
    for (_, s, m), (_, s2, m2) in zip(sources, sources2):
        s.copy_(s2)
        m.copy_(m2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_sink_attention(q, sources, sinks, D ** -0.5))


@pytest.mark.parametrize("R", [1, 32])
def test_table_source_at_v4_hca_shapes(R: int) -> None:
    """V4's HCA entries read through the block table (`TableSource`) at max_model_len 1M (width 8192 entries of
    ratio 128, 64-entry blocks) with each row's n from 0 to 32: the same output as the torch reference on the
    materialised slots, and about as fast as through a width of 64 (max_model_len 8192) for the same n."""
    from dsv4.ops.decode_attention import TableSource, decode_sink_attention_torch

    g = torch.Generator(device="cuda").manual_seed(R)
    BS, nc = 64, 16384
    q, sources, sinks = _case(R, 8, torch.bfloat16, R)
    comp = (torch.randn(nc, D, device="cuda", generator=g) * 1.5).to(torch.bfloat16)
    n = torch.randint(0, 33, (R,), device="cuda", generator=g)
    n[0] = 0
    table = torch.randint(0, nc // BS, (R, 8192 // BS), device="cuda", generator=g, dtype=torch.int32)
    wide = TableSource(comp, table, n, BS, 8192)
    short = TableSource(comp, table[:, :1].contiguous(), n, BS, 64)  # the same visible entries (n <= 32 < 64)
    ref = decode_sink_attention_torch(q, [sources[0], wide], sinks, D ** -0.5)
    for src in (wide, short):
        got = decode_sink_attention_triton(q, [sources[0], src], sinks, D ** -0.5)
        assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2), (src.width, (got.float() - ref.float()).abs().max())
    # the cost follows n, not the width: only the split count (bounded by the programs per SM) and the merge grow
    times = {}
    for name, src in (("8192", wide), ("64", short)):
        for _ in range(3):
            decode_sink_attention_triton(q, [sources[0], src], sinks, D ** -0.5)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            decode_sink_attention_triton(q, [sources[0], src], sinks, D ** -0.5)
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 50
    print({k: round(v * 1000, 1) for k, v in times.items()}, "us")
    assert times["8192"] <= 1.5 * times["64"] + 0.02, times


@pytest.mark.parametrize("R,L2", [(1, 512), (37, 8), (1500, 512), (1500, 0)])
def test_rows_kernel_matches_fp64(R: int, L2: int) -> None:
    """The rows kernel (one program per row and value half, all 64 heads) as accurate as the split kernel and the
    fp32 reference, forced at decode sizes and chosen by shape at prefill sizes; a padding row outputs 0."""
    q, sources, sinks = _case(R, L2, torch.bfloat16, 31 * R + L2)
    srcs = sources if L2 else sources[:1]
    ref64 = _reference(q, srcs, sinks, torch.float64)
    keys = torch.cat([c[s] for c, s, _ in srcs], dim=1)
    ref32 = sink_attention_rows(q, keys, torch.cat([m for _, _, m in srcs], 1), sinks, D ** -0.5)
    got = decode_sink_attention_triton(q, srcs, sinks, D ** -0.5, rows=True)
    assert torch.allclose(got.double(), ref64, rtol=1e-2, atol=1e-2), (got.double() - ref64).abs().max()
    err, err32 = (got.double() - ref64).abs().mean(), (ref32.double() - ref64).abs().mean()
    assert err <= 1.5 * err32 + 1e-6, (err, err32)
    split = decode_sink_attention_triton(q, srcs, sinks, D ** -0.5, rows=False)
    assert (got.double() - ref64).abs().mean() <= 1.1 * (split.double() - ref64).abs().mean() + 1e-6
    if R > 2:
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    if use_rows_kernel(R, H, _sm_count(q.device)):  # what the model gets by default at this size
        assert torch.equal(decode_sink_attention(q, srcs, sinks, D ** -0.5), got)


def test_rows_kernel_table_source_and_fp32() -> None:
    """The rows kernel through a block table (V4's HCA entries; n from 0 to the width) and with fp32 caches."""
    from dsv4.ops.decode_attention import TableSource, decode_sink_attention_torch

    g = torch.Generator(device="cuda").manual_seed(3)
    R, BS, nc, width = 700, 64, 16384, 256
    q, sources, sinks = _case(R, 8, torch.bfloat16, 3)
    comp = (torch.randn(nc, D, device="cuda", generator=g) * 1.5).to(torch.bfloat16)
    n = torch.randint(0, width + 1, (R,), device="cuda", generator=g)
    n[0], n[2] = 0, width
    table = torch.randint(0, nc // BS, (R, width // BS), device="cuda", generator=g, dtype=torch.int32)
    src = TableSource(comp, table, n, BS, width)
    ref = decode_sink_attention_torch(q, [sources[0], src], sinks, D ** -0.5)
    got = decode_sink_attention_triton(q, [sources[0], src], sinks, D ** -0.5, rows=True)
    assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2), (got.float() - ref.float()).abs().max()
    # fp32: as close to fp64 as the split kernel on the same inputs (an MMA in TF32 would be ~100x further)
    q, sources, sinks = _case(300, 512, torch.float32, 4)
    ref64 = _reference(q, sources, sinks, torch.float64)
    err = (decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=True).double() - ref64).abs()
    err_split = (decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=False).double() - ref64).abs()
    print("fp32 rows / split error: max", err.max().item(), err_split.max().item(), "mean", err.mean().item(),
          err_split.mean().item())
    assert err.max() <= 2 * err_split.max() + 1e-7 and err.mean() <= 1.5 * err_split.mean() + 1e-9


@pytest.mark.parametrize("R,L2,splits", [(64, 512, 2), (64, 512, 4), (50, 8, 2), (16, 0, 3)])
def test_rows_kernel_key_splits(R: int, L2: int, splits: int) -> None:
    """The rows kernel with its keys in splits (DSV4_ROWS_SPLITS: decode batches), merged by the split kernel's
    merge: as accurate as the whole walk against fp64, a padding row 0, and the same through a block table whose
    rows' n leave whole splits empty; under CUDA-graph replay too."""
    from dsv4.ops.decode_attention import TableSource, decode_sink_attention_torch

    q, sources, sinks = _case(R, L2, torch.bfloat16, 7 * R + L2 + splits)
    srcs = sources if L2 else sources[:1]
    ref64 = _reference(q, srcs, sinks, torch.float64)
    whole = decode_sink_attention_triton(q, srcs, sinks, D ** -0.5, rows=True)
    got = decode_sink_attention_triton(q, srcs, sinks, D ** -0.5, rows=True, row_splits=splits)
    assert torch.allclose(got.double(), ref64, rtol=1e-2, atol=1e-2), (got.double() - ref64).abs().max()
    assert (got.double() - ref64).abs().mean() <= 1.1 * (whole.double() - ref64).abs().mean() + 1e-6
    if R > 2:
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = decode_sink_attention_triton(q, srcs, sinks, D ** -0.5, rows=True, row_splits=splits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got)
    g = torch.Generator(device="cuda").manual_seed(splits)
    BS, nc, width = 64, 4096, 512
    comp = (torch.randn(nc, D, device="cuda", generator=g) * 1.5).to(torch.bfloat16)
    n = torch.randint(0, width + 1, (R,), device="cuda", generator=g)
    n[0], n[-1] = 0, width
    table = torch.randint(0, nc // BS, (R, width // BS), device="cuda", generator=g, dtype=torch.int32)
    src = TableSource(comp, table, n, BS, width)
    ref = decode_sink_attention_torch(q, [sources[0], src], sinks, D ** -0.5)
    got = decode_sink_attention_triton(q, [sources[0], src], sinks, D ** -0.5, rows=True, row_splits=splits)
    assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2), (got.float() - ref.float()).abs().max()


@pytest.mark.parametrize("R", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ropes_inside_the_attention_equal_the_rope_launches(R: int, dtype: torch.dtype) -> None:
    """`rope=(cos, sin)` (V4.1's decode: 32 rope pairs at the end of 512 channels): the queries roped in the split
    kernel and the output un-roped in the merge give the bits of the rope launches around the attention, on the
    compiled kernels (their other math keeps FMA contraction; the rope's products are `mul.rn`). Batch 64 takes the
    rows kernel with key splits (roped queries in place, the merge un-ropes). Also `rope_queries=False` and the
    rope kernels themselves against the torch reference bit for bit (the `mul.rn` products)."""
    from dsv4.ops.rope import apply_rope_torch, apply_rope_triton, apply_rope_triton_
    q, sources, sinks = _case(R, 512, dtype, 77 + R)
    g = torch.Generator(device="cuda").manual_seed(R)
    ang = torch.rand(R, 32, device="cuda", generator=g) * 1000
    cos, sin = ang.cos(), ang.sin()
    assert torch.equal(apply_rope_triton(q, cos, sin), apply_rope_torch(q, cos, sin))
    for rope_queries in (True, False):
        qr = apply_rope_triton(q, cos, sin) if rope_queries else q
        want = apply_rope_triton_(decode_sink_attention_triton(qr, sources, sinks, D ** -0.5), cos, sin, inverse=True)
        got = decode_sink_attention_triton(q.clone(), sources, sinks, D ** -0.5, rope=(cos, sin),
                                           rope_queries=rope_queries)
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()

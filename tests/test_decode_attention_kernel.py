"""The flash-decoding sink attention kernel against `sink_attention_rows` on the gathered keys, on small random
inputs under TRITON_INTERPRET=1 (the CPU interpreter; each check runs in a subprocess because the flag is read
when kernels are defined)."""

from __future__ import annotations

import pytest
import torch
from test_kernels_interpret import _interpret, _tiers

# Shared by the checks: random caches, shuffled slots, masks with a fully masked row (row 0, when R > 1: every key
# of both sources hidden) and a row whose window alone is masked; the reference on the gathered, concatenated keys.
_SETUP = """
    import torch
    from dsv4.models.layers.attention import sink_attention_rows
    from dsv4.ops.decode_attention import decode_sink_attention_triton

    def case(g, R, H, D, W, L2, dtype, two=True):
        N = 3 * (W + L2) + 7
        window, comp = torch.randn(N, D, generator=g).to(dtype), (torch.randn(N, D, generator=g) * 2).to(dtype)
        q = (torch.randn(R, H, D, generator=g) * 3).to(dtype)
        sinks = torch.randn(H, generator=g) * 2
        ws = torch.stack([torch.randperm(N, generator=g)[:W] for _ in range(R)])
        cs = torch.stack([torch.randperm(N, generator=g)[:L2] for _ in range(R)])
        wm, cm = torch.rand(R, W, generator=g) < 0.7, torch.rand(R, L2, generator=g) < 0.6
        if R > 1:
            wm[0], cm[0] = False, False  # no visible key: the reference puts all weight on the sink -> 0
            wm[1] = False  # only compressed keys
        ws = ws.masked_fill(~wm, -1)  # masked slots may be anything (PAD_SLOT here): never read
        sources = [(window, ws, wm), (comp, cs, cm)] if two else [(window, ws, wm)]
        keys = torch.cat([c[s.clamp(min=0)] for c, s, _ in sources], dim=1)
        mask = torch.cat([m for _, _, m in sources], dim=1)
        ref = sink_attention_rows(q, keys, mask, sinks, D ** -0.5)
        return q, sources, sinks, mask, ref
"""


# (dtype, tol, R, H, D, L2, chunk): every combination, fp32 and bf16
_REFERENCE_CASES = [(dtype, tol, R, H, D, L2, chunk)
                    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2))
                    for R in (1, 3) for H in (2, 8) for D in (16, 64) for L2 in (0, 5, 24) for chunk in (None, 32)]


@pytest.mark.parametrize("cases", _tiers(_REFERENCE_CASES, [
    (torch.bfloat16, 2e-2, 3, 8, 64, 24, 32), (torch.bfloat16, 2e-2, 3, 2, 16, 5, None),
    (torch.bfloat16, 2e-2, 1, 8, 16, 0, 32)]))
def test_decode_attention_matches_reference(cases: list) -> None:
    """The split kernel against the reference for one row and three (a fully masked row, a row of compressed keys
    only), 2 and 8 heads, head dims 16 and 64, no / 5 / 24 compressed keys, one split and chunks of 32; fp32 and
    bf16. The main tier runs three bf16 cases (each R, H, D, L2 and chunk in one of them at least), the slow tier
    every other combination."""
    _interpret(_SETUP + """
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for dtype, tol, R, H, D, L2, chunk in CASES:
        q, sources, sinks, mask, ref = case(g, R, H, D, 8, L2, dtype)
        got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, chunk=chunk)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol), \\
            (dtype, R, H, D, L2, (got.float() - ref.float()).abs().max())
        assert torch.equal(got[~mask.any(1)], torch.zeros_like(got[~mask.any(1)]))
        assert ref.abs().max() > 0.05  # a real signal, not all sink
        worst = max(worst, (got.float() - ref.float()).abs().max().item())
    print("max abs err", worst)
    print("ok")
    """, CASES=cases)


# (dtype, tol, R, H, D, W, L2)
_SPLITS_CASES = [(dtype, tol) + shape for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2))
                 for shape in ((2, 4, 32, 70, 100), (1, 16, 16, 40, 33))]


@pytest.mark.parametrize("cases", _tiers(_SPLITS_CASES, [(torch.bfloat16, 2e-2, 2, 4, 32, 70, 100)]))
def test_decode_attention_splits_and_one_source(cases: list) -> None:
    """Several splits per source (chunk 32 over 70 / 100 keys) merge like one pass; a single source; and the
    split count derived from shapes. The main tier runs bf16 over 70 / 100 keys, the slow tier the other shape and
    fp32; both tiers the empty sources and the split counts."""
    _interpret(_SETUP + """
    from dsv4.ops.decode_attention import decode_splits
    g = torch.Generator().manual_seed(1)
    for dtype, tol, R, H, D, W, L2 in CASES:
        q, sources, sinks, mask, ref = case(g, R, H, D, W, L2, dtype)
        for chunk in (32, 64, None):
            got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, chunk=chunk)
            assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol), (chunk, (got - ref).abs().max())
        q, sources, sinks, mask, ref = case(g, R, H, D, W, 0, dtype, two=False)
        got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, chunk=32)
        assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol)
    # no key at all (two empty sources): one empty split, output 0 (the sink takes every weight)
    q = torch.randn(2, 4, 16, generator=g)
    empty = (torch.randn(5, 16, generator=g), torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool))
    assert torch.equal(decode_sink_attention_triton(q, [empty, empty], torch.randn(4, generator=g), 0.25),
                       torch.zeros_like(q))
    assert decode_splits(1, 64, [128, 512], 132) == (32, [4, 16])  # batch 1: many splits to fill the GPU
    assert decode_splits(32, 64, [128, 512], 132) == (224, [1, 3])  # a full batch: few
    assert decode_splits(4, 64, [128, 8], 132) == (32, [4, 1])  # batch 4: still one tile a split
    assert decode_splits(1, 64, [128, 8], 132, chunk=64) == (64, [2, 1])  # a chunk given by the caller
    print("ok")
    """, CASES=cases)


def test_table_source_loops_to_each_rows_n() -> None:
    """A second source read through a block table (`TableSource`, V4's HCA entries) equals the reference on its
    materialised slots, for rows with no entry, fewer than a block, several blocks, exactly the width; with splits
    past every row's n (chunk 32 over a width of 200) and without; and its work follows n: garbage in the table past
    each row's blocks and in the cache rows no row sees is never read (NaN there would spread into the output)."""
    _interpret(_SETUP + """
    from dsv4.ops.decode_attention import TableSource, decode_sink_attention_torch
    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        R, H, D, W, BS, width = 5, 4, 32, 8, 4, 200
        window = torch.randn(64, D, generator=g).to(dtype)
        q = (torch.randn(R, H, D, generator=g) * 3).to(dtype)
        sinks = torch.randn(H, generator=g)
        ws = torch.randint(0, 64, (R, W), generator=g)
        wm = torch.rand(R, W, generator=g) < 0.7
        n = torch.tensor([0, 3, 9, 17, width])
        MB = -(-width // BS)
        table = torch.full((R, MB), 10 ** 6, dtype=torch.int32)  # far out of range: never read
        comp = torch.full((R * MB * BS + BS, D), float("nan")).to(dtype)
        for r in range(R):
            used = -(-int(n[r]) // BS)
            blocks = torch.randperm(R * MB, generator=g)[:used] + 1
            table[r, :used] = blocks.int()
            for b in blocks.tolist():
                comp[b * BS:(b + 1) * BS] = (torch.randn(BS, D, generator=g) * 2).to(dtype)
        src = TableSource(comp, table, n, BS, width)
        _, slots, vis = src.as_slots()
        ref_comp = comp.clone()
        ref_comp[torch.isnan(ref_comp)] = 0  # the reference gathers every slot; masked ones must not matter
        ref = decode_sink_attention_torch(q, [(window, ws, wm), (ref_comp, slots.clamp(max=ref_comp.shape[0] - 1), vis)],
                                          sinks, D ** -0.5)
        for chunk in (32, None):
            got = decode_sink_attention_triton(q, [(window, ws, wm), src], sinks, D ** -0.5, chunk=chunk)
            assert not torch.isnan(got).any(), chunk
            assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol), (chunk, (got.float() - ref.float()).abs().max())
    print("ok")
    """)


# (kind, dtype, tol, shape): "rows", shape (R, H, D, W, L2): against the reference and the split kernel; "table":
# through a block table, without key splits and with; "splits", shape (R, H, D, W, L2, splits): key splits over
# slot lists
_ROWS_CASES = [(kind, dtype, tol, shape) for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2))
               for kind, shape in [("rows", s) for s in ((3, 8, 64, 40, 33), (3, 20, 32, 8, 0), (2, 4, 128, 70, 5))]
               + [("table", ())]
               + [("splits", s) for s in ((3, 8, 64, 40, 33, 2), (3, 20, 32, 8, 0, 3), (2, 4, 128, 70, 5, 4),
                                          (3, 8, 64, 100, 90, 3))]]


@pytest.mark.parametrize("cases", _tiers(_ROWS_CASES, [
    ("rows", torch.bfloat16, 2e-2, (3, 20, 32, 8, 0)), ("table", torch.bfloat16, 2e-2, ()),
    ("splits", torch.bfloat16, 2e-2, (3, 8, 64, 40, 33, 2))]))
def test_rows_kernel_matches_reference(cases: list) -> None:
    """The rows kernel (prefill: one program per row, head block and value half, finished with the sink in place)
    equals the reference and the split kernel: head counts under and over a block (8, 20), head dims with the value
    columns halved (64, 128) and whole (32), one source and two, rows with no visible key or no window key; and
    through a block table with each row's n from 0 to the width (NaN past n and in unread cache rows); its key
    splits through the table and over slot lists. fp32 and bf16. The main tier runs bf16: 20 heads of 32 over one
    source, the block table, key splits over both sources; the slow tier the other cases; both tiers the rules that
    pick the kernel and its splits."""
    _interpret(_SETUP + """
    from dsv4.ops.decode_attention import TableSource, decode_sink_attention_torch, rows_splits, use_rows_kernel
    g = torch.Generator().manual_seed(4)
    for kind, dtype, tol, shape in CASES:
        if kind == "rows":
            R, H, D, W, L2 = shape
            q, sources, sinks, mask, ref = case(g, R, H, D, W, L2, dtype, two=L2 > 0)
            got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=True)
            assert got.shape == ref.shape and got.dtype == ref.dtype
            assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol), (R, H, D, (got - ref).abs().max())
            assert torch.equal(got[~mask.any(1)], torch.zeros_like(got[~mask.any(1)]))
            split = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=False)
            assert torch.allclose(got.float(), split.float(), rtol=tol, atol=tol)
        elif kind == "table":
            R, H, D, BS, width = 4, 4, 64, 4, 24
            window = torch.randn(40, D, generator=g).to(dtype)
            q = (torch.randn(R, H, D, generator=g) * 3).to(dtype)
            sinks = torch.randn(H, generator=g)
            ws, wm = torch.randint(0, 40, (R, 8), generator=g), torch.rand(R, 8, generator=g) < 0.7
            n = torch.tensor([0, 3, 9, width])
            table = torch.full((R, width // BS), 10 ** 6, dtype=torch.int32)  # far out of range past each row's n
            comp = torch.full((R * width + BS, D), float("nan")).to(dtype)
            for r in range(R):
                used = -(-int(n[r]) // BS)
                blocks = torch.randperm(R * width // BS, generator=g)[:used] + 1
                table[r, :used] = blocks.int()
                for b in blocks.tolist():
                    comp[b * BS:(b + 1) * BS] = (torch.randn(BS, D, generator=g) * 2).to(dtype)
            src = TableSource(comp, table, n, BS, width)
            _, slots, vis = src.as_slots()
            clean = torch.nan_to_num(comp)
            ref = decode_sink_attention_torch(q, [(window, ws, wm), (clean, slots.clamp(max=clean.shape[0] - 1), vis)],
                                              sinks, D ** -0.5)
            got = decode_sink_attention_triton(q, [(window, ws, wm), src], sinks, D ** -0.5, rows=True)
            assert not torch.isnan(got).any()
            assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol), (got.float() - ref.float()).abs().max()
            # key splits of the rows kernel (decode batches, DSV4_ROWS_SPLITS): the same outputs through the
            # workspace and the merge; here through the block table, the rows with n 0 and 3 leaving whole splits
            # empty
            got = decode_sink_attention_triton(q, [(window, ws, wm), src], sinks, D ** -0.5, rows=True, row_splits=4)
            assert not torch.isnan(got).any()
            assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol), (got.float() - ref.float()).abs().max()
        else:  # and over slot lists: one source or both, splits across the window only or both, more splits than keys
            R, H, D, W, L2, splits = shape
            q, sources, sinks, mask, ref = case(g, R, H, D, W, L2, dtype, two=L2 > 0)
            got = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=True, row_splits=splits)
            assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol), (R, splits, (got - ref).abs().max())
            assert torch.equal(got[~mask.any(1)], torch.zeros_like(got[~mask.any(1)]))
    # the default: the rows kernel from rows x head blocks >= 0.12 of the SMs (132 SMs, 64 heads: 16 rows; 128
    # heads, two head blocks: 8 rows)
    assert not use_rows_kernel(1, 64, 132) and not use_rows_kernel(15, 64, 132) and not use_rows_kernel(7, 128, 132)
    assert use_rows_kernel(16, 64, 132) and use_rows_kernel(32, 64, 132) and use_rows_kernel(8, 128, 132)
    # the rows kernel's split rule (ROWS_SPLITS, the default): at 64 rows of 64 heads (128 programs for 132 SMs, 2
    # each) two splits, each half the window and half the 512 keys; none once the programs fill the SMs, none on
    # few keys, none when off; shares rounded up to 16-key tiles
    from dsv4.ops import decode_attention as da
    assert da.ROWS_SPLITS  # on by default since timed (results/2026-12-06-h100-decode-optins)
    da.ROWS_SPLITS = False  # DSV4_ROWS_SPLITS=0
    assert rows_splits(64, 64, [128, 512], 132, True) == (1, [128, 512])
    da.ROWS_SPLITS = True
    assert rows_splits(64, 64, [128, 512], 132, True) == (2, [64, 256])
    assert rows_splits(50, 64, [128, 512], 132, True) == (2, [64, 256])
    assert rows_splits(132, 64, [128, 512], 132, True) == (1, [128, 512])
    assert rows_splits(64, 64, [100, 0], 132, True) == (1, [100, 0])  # fewer than 2 x 64 keys
    assert rows_splits(16, 64, [128, 40], 132, True) == (2, [64, 32])  # 8 wanted, 168 keys: 2
    assert rows_splits(16, 64, [128, 512], 132, True) == (8, [16, 64])
    print("ok")
    """, CASES=cases)


def test_dispatch_uses_torch_on_cpu() -> None:
    """On CPU tensors the entry point is the reference exactly (the model's CPU decode path is unchanged)."""
    import torch

    from dsv4.models.layers.attention import sink_attention_rows
    from dsv4.ops.decode_attention import decode_sink_attention

    g = torch.Generator().manual_seed(2)
    cache, comp = torch.randn(20, 8, generator=g), torch.randn(9, 8, generator=g)
    q, sinks = torch.randn(3, 2, 8, generator=g), torch.randn(2, generator=g)
    ws, cs = torch.randint(0, 20, (3, 4), generator=g), torch.randint(0, 9, (3, 5), generator=g)
    wm, cm = torch.rand(3, 4, generator=g) < 0.5, torch.rand(3, 5, generator=g) < 0.5
    ref = sink_attention_rows(q, torch.cat([cache[ws], comp[cs]], 1), torch.cat([wm, cm], 1), sinks, 0.3)
    assert torch.equal(decode_sink_attention(q, [(cache, ws, wm), (comp, cs, cm)], sinks, 0.3), ref)
    assert torch.equal(decode_sink_attention(q, [(cache, ws, wm)], sinks, 0.3),
                       sink_attention_rows(q, cache[ws], wm, sinks, 0.3))


# (dtype, R, H, D, W, L2, half, kw)
_ROPE_CASES = [(dtype,) + shape for dtype in (torch.bfloat16, torch.float32)
               for shape in ((1, 8, 64, 40, 33, 16, {"chunk": 32}), (3, 20, 32, 8, 0, 8, {}),
                             (2, 4, 64, 70, 5, 16, {"rows": True}),
                             (3, 8, 64, 100, 90, 16, {"rows": True, "row_splits": 3}),
                             (2, 16, 64, 24, 40, 16, {"chunk": 32}))]


@pytest.mark.parametrize("cases", _tiers(_ROPE_CASES, [(torch.bfloat16, 1, 8, 64, 40, 33, 16, {"chunk": 32}),
                                                       (torch.bfloat16, 3, 20, 32, 8, 0, 8, {})]))
def test_ropes_inside_the_attention_equal_the_rope_launches(cases: list) -> None:
    """`rope=(cos, sin)`: the split kernel's queries roped on load and the merge's output un-roped before its store
    give the same bits as the rope launches around the attention (queries roped, attention, output un-roped): split
    path with several splits and one, one source and two, the nope channels first (D 64 / 32, rope 16 / 8 pairs),
    head counts under and over a block; `rope_queries=False` (V4: queries roped with their norm); the rows kernel
    with and without key splits (it takes the roped queries; its merge un-ropes); DSV4_ATTN_ROPE_FUSED off; bf16
    and fp32. The main tier runs the split path in bf16 (the kernels that rope): several splits over two sources
    (D 64, 8 heads) and one split of one source (D 32, 20 heads); the slow tier the other cases."""
    _interpret(_SETUP + """
    from dsv4.ops import decode_attention as da
    from dsv4.ops.rope import apply_rope_triton, apply_rope_triton_
    g = torch.Generator().manual_seed(7)

    def composed(q, sources, sinks, D, cos, sin, rope_queries=True, **kw):
        qr = apply_rope_triton(q, cos, sin) if rope_queries else q
        return apply_rope_triton_(decode_sink_attention_triton(qr, sources, sinks, D ** -0.5, **kw), cos, sin,
                                  inverse=True)

    for dtype, R, H, D, W, L2, half, kw in CASES:
        q, sources, sinks, mask, ref = case(g, R, H, D, W, L2, dtype, two=L2 > 0)
        ang = torch.rand(R, half, generator=g) * 6.3
        cos, sin = ang.cos(), ang.sin()
        for rope_queries in (True, False):
            want = composed(q, sources, sinks, D, cos, sin, rope_queries, **kw)
            for fused in (True, False):
                da.ROPE_FUSED = fused
                got = decode_sink_attention_triton(q.clone(), sources, sinks, D ** -0.5, rope=(cos, sin),
                                                   rope_queries=rope_queries, **kw)
                assert torch.equal(got, want), (dtype, R, H, D, kw, rope_queries, fused, (got - want).abs().max())
            da.ROPE_FUSED = True
        # the rope moved something: without it the output differs
        plain = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, **kw)
        assert not torch.equal(plain, want)
    print("ok")
    """, CASES=cases)


def test_rope_on_the_cpu_path_is_the_composition() -> None:
    """Off the GPU, `rope` is the reference between the two rope ops (what the CUDA path must equal)."""
    import torch

    from dsv4.ops.decode_attention import decode_sink_attention, decode_sink_attention_torch
    from dsv4.ops.rope import apply_rope_torch

    g = torch.Generator().manual_seed(3)
    cache = torch.randn(20, 16, generator=g).bfloat16()
    q, sinks = torch.randn(2, 3, 16, generator=g).bfloat16(), torch.randn(3, generator=g)
    ws, wm = torch.randint(0, 20, (2, 6), generator=g), torch.rand(2, 6, generator=g) < 0.7
    ang = torch.rand(2, 4, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    want = apply_rope_torch(decode_sink_attention_torch(apply_rope_torch(q, cos, sin), [(cache, ws, wm)], sinks, 0.25),
                            cos, sin, inverse=True)
    assert torch.equal(decode_sink_attention(q.clone(), [(cache, ws, wm)], sinks, 0.25, rope=(cos, sin)), want)
    want = apply_rope_torch(decode_sink_attention_torch(q, [(cache, ws, wm)], sinks, 0.25), cos, sin, inverse=True)
    assert torch.equal(decode_sink_attention(q.clone(), [(cache, ws, wm)], sinks, 0.25, rope=(cos, sin),
                                             rope_queries=False), want)


# (dtype, R, H, D, W, L2, kw, half)
_MERGE_CASES = [(dtype,) + shape for dtype in (torch.bfloat16, torch.float32)
                for shape in ((1, 8, 64, 40, 33, {"chunk": 32}, 16), (2, 4, 256, 70, 5, {"chunk": 32}, 16),
                              (1, 4, 256, 8, 100, {"chunk": 32}, 0),
                              (3, 8, 64, 100, 90, {"rows": True, "row_splits": 3}, 8),
                              (1, 2, 64, 128, 900, {"chunk": 32}, 0))]


@pytest.mark.parametrize("cases", _tiers(_MERGE_CASES, [(torch.bfloat16, 1, 8, 64, 40, 33, {"chunk": 32}, 16),
                                                        (torch.bfloat16, 1, 4, 256, 8, 100, {"chunk": 32}, 0)]))
def test_merge_in_channel_blocks_keeps_the_bits(cases: list) -> None:
    """The merge of the splits in blocks of channels with its loop unrolled (COMBINE_CHANNELS, the default) gives
    the bits of the whole-row merge with the loop as it was (DSV4_COMBINE_CHANNELS=0): split counts 1 to 33 (not
    multiples of four, and past the unrolled rounds' four), channels one block and several (D 64 / 256 at 32
    channels a block), with the output's inverse rope in the last block and not, the rows kernel's split merge; bf16
    and fp32. The main tier runs bf16: 4 splits of 64 channels with the rope, 5 of 256 channels without; the slow
    tier the other cases (33 splits, the rows kernel's merge among them)."""
    _interpret(_SETUP + """
    from dsv4.ops import decode_attention as da
    g = torch.Generator().manual_seed(8)
    for dtype, R, H, D, W, L2, kw, half in CASES:
        q, sources, sinks, mask, ref = case(g, R, H, D, W, L2, dtype, two=L2 > 0)
        ang = torch.rand(R, max(half, 1), generator=g) * 6.3
        rope = (ang.cos(), ang.sin()) if half else None
        outs = []
        for channels in (0, 32):
            da.COMBINE_CHANNELS = channels
            outs.append(decode_sink_attention_triton(q.clone(), sources, sinks, D ** -0.5, rope=rope, **kw))
        da.COMBINE_CHANNELS = 128
        assert torch.equal(outs[0], outs[1]), (dtype, R, H, D, kw, (outs[0] - outs[1]).abs().max())
        assert torch.allclose(outs[1].float(), (ref if rope is None else outs[0]).float(), rtol=2e-2, atol=2e-2)
    print("ok")
    """, CASES=cases)

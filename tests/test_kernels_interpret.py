"""Triton kernels against their torch references on small random inputs, under TRITON_INTERPRET=1 (the CPU
interpreter; each check runs in a fresh process, since the flag is read when kernels are defined: a child the
interpreter worker forks, tests/interpret_worker.py)."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from interpret_worker import InterpreterWorker

_WORKER = InterpreterWorker()
atexit.register(_WORKER.stop)


def _interpret(code: str, **names: object) -> None:
    """Runs `code` (dedented) under the interpreter in a fresh Python (a child of the interpreter worker); `names`
    (e.g. CASES, the cases its loop runs) are set first, written as their repr (tuples, lists, dicts, numbers,
    strings, torch dtypes). The check passes when it exits 0 and prints "ok"."""
    head = "import torch\n" + "".join(f"{k} = {v!r}\n" for k, v in names.items()) if names else ""
    # The longest check (test_triton_path_interpret: three tiny models on every kernel) took 437 s on a slow 2-core
    # machine and passed 600 s on the same machine later in the day (2026-12-05): the limit only catches a hang.
    status, out, err = _WORKER.run(head + textwrap.dedent(code), timeout=1500)
    assert status == 0 and "ok" in out, out[-2000:] + err[-4000:]


def _tiers(cases: list, main: list) -> list:
    """A check's cases split over the two tiers, as its parameters: `main`, a few that still exercise each feature,
    in the main tier (`pytest -q -m "not slow" tests`), and the rest of `cases` in the slow tier (`-m slow`, which CI
    runs too), in their order in `cases`. Every case runs in one tier or the other."""
    assert main and len(set(map(repr, main))) == len(main) and all(c in cases for c in main), main
    rest = [c for c in cases if c not in main]
    main = [c for c in cases if c in main]
    assert rest, "all the cases in the main tier: nothing to split"
    return [pytest.param(main, id="main"), pytest.param(rest, id="rest", marks=pytest.mark.slow)]


def test_hc_post_kernel_matches_torch() -> None:
    _interpret("""
        import torch
        from dsv4.ops.mhc import hc_post_torch, hc_post_triton
        g = torch.Generator().manual_seed(0)
        for T in (1, 3, 17):
            for iters in (1, 2, 20):
                n = 4
                m = torch.randn(T, (2 + n) * n, generator=g) * 3
                base = torch.randn((2 + n) * n, generator=g)
                scale = torch.rand(3, generator=g) + 0.5
                ref = hc_post_torch(m, base, scale, n, iters, 1e-6)
                got = hc_post_triton(m, base, scale, n, iters, 1e-6)
                for a, b in zip(ref, got):
                    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (T, iters, (a - b).abs().max())
        print("ok")
    """)


def test_fused_mhc_site_matches_the_composed_path() -> None:
    """`hc_mixes_fused` (two launches: chunked fn . h dots with sums of squares, then the chunks' sums, the norm
    factor and hc_post) against the composed path (the streams' fp32 norm, the fp32 projection, hc_post) on the CPU,
    both measured against an fp64 run of the composed path: the fused mixes differ only in where the norm factor is
    applied and in the sums' order (a few fp32 ulps of m, relative ~K 2^-24), which Sinkhorn's 20 iterations do not
    amplify past 1e-5 on outputs of order one. Streams in bf16 and fp32; K = N * D of 384 (a full chunk of 256 and
    a partial one), 1024 (four exact chunks) and 2400 (ten, the last partial); one and several tokens. A chunk
    dropped or summed twice, or a mixes scale off by 1e-4, moves the outputs by more than the bound."""
    _interpret("""
        import torch
        import torch.nn.functional as F
        from dsv4.ops.mhc import hc_mixes_fused, hc_post_torch
        from dsv4.models.layers.norm import unweighted_rms_norm_torch
        g = torch.Generator().manual_seed(3)
        n, iters, hc_eps, norm_eps = 4, 20, 1e-6, 1e-6

        def composed(h, fn, base, scale, dt):
            flat = unweighted_rms_norm_torch(h.flatten(1).to(dt), norm_eps)
            return hc_post_torch(F.linear(flat, fn.to(dt)), base.to(dt), scale.to(dt), n, iters, hc_eps)

        for D in (96, 256, 600):
            K = n * D
            fn = torch.randn((2 + n) * n, K, generator=g) * K ** -0.5
            base = torch.randn((2 + n) * n, generator=g)
            scale = torch.rand(3, generator=g) + 0.5
            for T in (1, 3):
                for dtype in (torch.bfloat16, torch.float32):
                    h = (torch.randn(T, n, D, generator=g) * 3).to(dtype)
                    ref = composed(h.double(), fn, base, scale, torch.float64)
                    got = hc_mixes_fused(h, fn, base, scale, iters, hc_eps, norm_eps)
                    old = composed(h.float(), fn, base, scale, torch.float32)
                    for name, r, a, b in zip(("pre", "post", "comb"), ref, got, old):
                        assert a.dtype == torch.float32 and a.shape == r.shape, name
                        err, err_old = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
                        assert err <= 1e-5, (D, T, dtype, name, err, err_old)
        print("ok")
    """)


# (D, T, M)
_DOTS_ROWS_CASES = [(40, 70, 24), (100, 9, 24), (48, 13, 4)]


@pytest.mark.parametrize("cases", _tiers(_DOTS_ROWS_CASES, [(100, 9, 24)]))
def test_mhc_dots_rows_match_the_composed_projection(cases: list) -> None:
    """`hc_dots_rows` (the projection of normed bf16 streams as r * (h . fn), fn in three bf16 parts on the tensor
    cores) against an fp64 run of the composed path (fp32 norm, fp32 projection): each m within the fp32
    summation bound (K 2^-24 + 2^-21) of sum |fn h| r, where the fp32 composed path lands too; the parts sum to fn
    within 2^-26 |fn|. Rows past a 64-row tile, K off the 64-column tile, the site's M = 24 and the final
    collapse's 4, a zero row (its m 0). Only the first part kept (fn to ~2^-9) or the norm factor left out
    fails it. The main tier runs 9 rows of K 400 and M 24, the slow tier the other two cases."""
    _interpret("""
        import torch
        import torch.nn.functional as F
        from dsv4.ops.mhc import bf16_parts, hc_dots_rows
        from dsv4.models.layers.norm import unweighted_rms_norm_torch
        g = torch.Generator().manual_seed(4)
        n, eps = 4, 1e-6
        for D, T, M in CASES:
            K = n * D
            fn = torch.nn.Parameter(torch.randn(M, K, generator=g) * K ** -0.5)
            parts = bf16_parts(fn)
            assert parts.shape == (3, 32, K) and not parts[:, M:].any()
            assert ((parts[:, :M].double().sum(0) - fn.double()).abs() <= 2.0 ** -26 * fn.double().abs()).all()
            h = (torch.randn(T, n, D, generator=g) * 3).to(torch.bfloat16)
            h[1] = 0
            got = hc_dots_rows(h, fn, eps)
            # in column splits (the last one short, or one a 64-column step) added by a second launch: the same
            # bound; one split is the single pass's bits
            split = [hc_dots_rows(h, fn, eps, splits=S, sum_tile=tile) for S in (2, 3, K) for tile in (False, True)]
            assert torch.equal(hc_dots_rows(h, fn, eps, splits=1), got)
            flat64 = unweighted_rms_norm_torch(h.flatten(1).double(), eps)
            ref = F.linear(flat64, fn.double())
            r = flat64.abs().sum(1) / h.flatten(1).double().abs().sum(1).clamp(min=1e-30)  # the rows' norm factors
            bound = (K * 2.0 ** -24 + 2.0 ** -21) * (h.flatten(1).double().abs() @ fn.double().abs().T) * r[:, None]
            old = F.linear(unweighted_rms_norm_torch(h.flatten(1).float(), eps), fn.float())
            for m in [got] + split:
                assert m.dtype == torch.float32 and m.shape == (T, M)
                assert ((m.double() - ref).abs() <= bound).all(), ((m.double() - ref).abs() / bound).max()
                assert not m[1].any()
            assert ((old.double() - ref).abs() <= bound).all()
        print("ok")
    """, CASES=cases)


def test_mhc_rows_splits_fill_the_sms() -> None:
    """`rows_splits`: row blocks (64 rows) x splits >= twice the SMs, each split >= 1,024 columns, at least 1."""
    mhc = pytest.importorskip("dsv4.ops.mhc")
    K = 4 * 5120
    assert [mhc.rows_splits(T, K, 132) for T in (9, 576, 2048, 8192, 16384, 65536)] == [20, 20, 9, 3, 2, 1]
    assert mhc.rows_splits(2048, 1000, 132) == 1  # too few columns to split


def test_collapse_rms_norm_kernel_equals_the_two_kernels() -> None:
    """`collapse_rms_norm_triton` (the fused site's sublayer input) gives the bits of the collapse kernel followed
    by the RMSNorm kernel (the same collapse order and roundings, the same statistic over one block of the row),
    HF-V4 weighted and V4.1 flavours, bf16 / fp32 streams, bf16 / fp32 V4.1 weights, D a power of two and not, one
    and several tokens; and the torch reference within the RMSNorm kernel's ulp bounds (tests/rmsnorm_checks.py)."""
    _interpret("""
        import sys
        import torch
        sys.path.insert(0, "tests")
        from rmsnorm_checks import BOUND, ulps
        from dsv4.ops.mhc_streams import collapse_rms_norm_torch, collapse_rms_norm_triton, collapse_triton
        from dsv4.ops.rmsnorm import MODE_V41, MODE_WEIGHTED, rms_norm_triton, rms_norm_v41_triton
        g = torch.Generator().manual_seed(5)
        for T, D in ((1, 64), (3, 100), (2, 2048)):
            for dtype in (torch.bfloat16, torch.float32):
                h = (torch.randn(T, 4, D, generator=g) * 2).to(dtype)
                pre = torch.rand(T, 4, generator=g) + 0.1
                w32 = torch.rand(D, generator=g) + 0.5
                for mode, w in ((MODE_WEIGHTED, w32), (MODE_V41, w32.to(dtype)), (MODE_V41, w32)):
                    two = (rms_norm_triton if mode == MODE_WEIGHTED else rms_norm_v41_triton)(
                        collapse_triton(h, pre), w, 1e-6)
                    got = collapse_rms_norm_triton(h, pre, w, 1e-6, mode)
                    assert got.dtype == two.dtype and torch.equal(got, two), (T, D, dtype, mode)
                    ref = collapse_rms_norm_torch(h, pre, w, 1e-6, mode)
                    name = "weighted" if mode == MODE_WEIGHTED else "v41"
                    if ref.dtype == dtype:
                        assert ulps(ref, got).max() <= BOUND[dtype, name] + 1, (T, D, dtype, mode)
                    else:  # bf16 streams, fp32 weight: the normalised value went through bf16
                        assert torch.allclose(got, ref, rtol=2 ** -6, atol=0), (T, D, dtype, mode)
        print("ok")
    """)


def test_expand_collapse_rms_norm_kernel_equals_the_two_kernels() -> None:
    """`expand_collapse_rms_norm_triton` (a V4.1 site's expand and the next sublayer's input in one launch) gives the
    bits of `expand_triton(fp32=True)` and `collapse_rms_norm_triton` on its output, both outputs: V4.1 and weighted
    norms, bf16 / fp32 streams and weights, N 2 and 4, D a power of two and not, one and several tokens; and the
    torch reference (the streams within one ulp: the mix's sum order differs)."""
    _interpret("""
        import torch
        from dsv4.ops.mhc_streams import (collapse_rms_norm_triton, expand_collapse_rms_norm_torch,
                                          expand_collapse_rms_norm_triton, expand_triton)
        from dsv4.ops.rmsnorm import MODE_V41, MODE_WEIGHTED
        g = torch.Generator().manual_seed(6)
        for T, N, D in ((1, 4, 64), (3, 4, 100), (2, 2, 2048), (1, 4, 1280)):
            for dtype in (torch.bfloat16, torch.float32):
                y = (torch.randn(T, D, generator=g) * 3).to(dtype)
                h = (torch.randn(T, N, D, generator=g) * 2).to(dtype)
                post = torch.rand(T, N, generator=g) * 2
                comb = torch.rand(T, N, N, generator=g)
                pre = torch.rand(T, N, generator=g) + 0.1
                w32 = torch.rand(D, generator=g) + 0.5
                for mode, w in ((MODE_V41, w32.to(dtype)), (MODE_V41, w32), (MODE_WEIGHTED, w32)):
                    h2 = expand_triton(y, h, post, comb, fp32=True)
                    x2 = collapse_rms_norm_triton(h2, pre, w, 1e-6, mode)
                    got_h, got_x = expand_collapse_rms_norm_triton(y, h, post, comb, pre, w, 1e-6, mode)
                    assert got_h.dtype == h2.dtype and torch.equal(got_h, h2), (T, N, D, dtype, mode)
                    assert got_x.dtype == x2.dtype and torch.equal(got_x, x2), (T, N, D, dtype, mode)
                    ref_h, ref_x = expand_collapse_rms_norm_torch(y, h, post, comb, pre, w, 1e-6, mode)
                    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
                    assert torch.allclose(got_h.float(), ref_h.float(), rtol=tol, atol=tol)
                    assert torch.allclose(got_x.float(), ref_x.float(), rtol=4 * tol, atol=4 * tol)
        print("ok")
    """)


_GROUP_ROWS_CHECK = """
    import torch
    from dsv4.ops.moe import (PLAN_KERNEL_MAX_ROWS, expert_grouped_torch, expert_grouped_triton, group_rows_torch,
                              group_rows_triton)
    g = torch.Generator().manual_seed(11)
    for R, E, bm in CASES:
        idx = torch.randint(0, E, (R,), generator=g)
        if R > 8:
            idx[: R // 4] = 1  # a hot expert (several blocks), rows of no expert, an expert with none
            idx[R // 3:: 7] = -1
            idx[idx == 0] = 2
        ref, got = group_rows_torch(idx, E, bm), group_rows_triton(idx, E, bm)
        for name, a, b in zip(ref._fields, ref, got):
            assert (a == b if name == "block_m" else (a.dtype == b.dtype and torch.equal(a, b))), (R, E, name)
        if R <= 200:
            x = torch.randn(R, 32, generator=g)
            w = torch.randn(E, 24, 32, generator=g)
            plan = group_rows_triton(idx, E, 64)
            assert torch.allclose(expert_grouped_triton(x, w, idx, 1, plan), expert_grouped_torch(x, w, idx, 1),
                                  rtol=1e-5, atol=1e-5), (R, E)
    print("ok")
"""


# (R, E, block_m)
_GROUP_ROWS_CASES = [(1, 4, 16), (5, 16, 16), (192, 16, 32), (200, 3, 64), (97, 384, 16)]


@pytest.mark.parametrize("cases", _tiers(_GROUP_ROWS_CASES, [(1, 4, 16), (97, 384, 16)]))
def test_group_rows_kernel_matches_torch(cases: list) -> None:
    """The one-launch row plan of the grouped matmuls (decode steps) equals the torch ops' plan field for field:
    the stable order (ties in row order), counts, offsets and block ends, with rows of no expert (-1), experts with
    no rows, one hot expert over several blocks, R of 1 and not a power of two; and a grouped matmul given that plan
    equals the reference. The main tier runs R 1 and 97 (of 384 experts), the slow tier the other three."""
    _interpret(_GROUP_ROWS_CHECK, CASES=cases)


@pytest.mark.slow  # ~8 s under the interpreter (a 1024-key sort): the slow tier (CI runs it too)
def test_group_rows_kernel_at_its_row_limit() -> None:
    """The same at PLAN_KERNEL_MAX_ROWS rows, the largest sort the kernel takes."""
    _interpret(_GROUP_ROWS_CHECK + "\n    assert CASES[-1][0] == PLAN_KERNEL_MAX_ROWS", CASES=((1024, 256, 64),))


# the main tier: heads with nope channels and a half not a power of two; the slow tier the other shapes
@pytest.mark.parametrize("shape,half", [pytest.param((5, 64), 8, marks=pytest.mark.slow),
                                        pytest.param((3, 4, 32), 4, marks=pytest.mark.slow),
                                        pytest.param((2, 3, 128), 32, marks=pytest.mark.slow),
                                        pytest.param((1, 16), 8, marks=pytest.mark.slow), ((5, 2, 20), 6)])
def test_rope_kernel_matches_torch(shape: tuple, half: int) -> None:
    _interpret(f"""
        import torch
        from dsv4.ops.rope import apply_rope_torch, apply_rope_torch_, apply_rope_triton, apply_rope_triton_
        g = torch.Generator().manual_seed(1)
        x = torch.randn({shape}, generator=g)
        pos = torch.randint(0, 5000, ({shape[0]},), generator=g).float()
        inv = 1.0 / (10000 ** (torch.arange({half}) / {half}))
        ang = pos[:, None] * inv
        cos, sin = ang.cos(), ang.sin()
        for inverse in (False, True):
            ref = apply_rope_torch(x, cos, sin, inverse)
            got = apply_rope_triton(x, cos, sin, inverse)
            assert torch.allclose(ref, got, rtol=1e-6, atol=1e-6), (ref - got).abs().max()
            nope = x.shape[-1] - 2 * {half}
            assert torch.equal(got[..., :nope], x[..., :nope])
            # cos/sin as the strided halves of one table row (what a prepared RotaryTable returns): read in place
            table = torch.cat([cos, sin], dim=-1)
            assert torch.equal(apply_rope_triton(x, table[:, :{half}], table[:, {half}:], inverse), got)
            # in place: the same bits, the nope channels untouched (rows past a 32-row program, strided tables,
            # and a non-contiguous x written back through the copy)
            for fn, want in ((apply_rope_triton_, got), (apply_rope_torch_, ref)):
                y = x.clone()
                assert fn(y, table[:, :{half}], table[:, {half}:], inverse) is y and torch.equal(y, want)
            y = x.clone()  # the pairs as one contiguous run a row: the same bits
            assert apply_rope_triton_(y, table[:, :{half}], table[:, {half}:], inverse, vec=True) is y
            assert torch.equal(y, got)
            xt = x.transpose(0, -1).contiguous().transpose(0, -1)  # same values, not contiguous
            assert torch.equal(apply_rope_triton_(xt, cos, sin, inverse), got)
        rows = torch.randn(70, *x.shape[1:], generator=g)  # 70 * heads rows: partial last program
        c, s_ = torch.randn(70, {half}, generator=g), torch.randn(70, {half}, generator=g)
        for vec in (False, True):
            assert torch.equal(apply_rope_triton_(rows.clone(), c, s_, vec=vec), apply_rope_triton(rows, c, s_))
        print("ok")
    """)


def test_rope_in_place_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`apply_rope_` writes into x and returns it; with DSV4_ROPE_INPLACE=0 (comparisons) it leaves x alone and
    returns the copy: the same values either way."""
    rope = pytest.importorskip("dsv4.ops.rope")
    g = torch.Generator().manual_seed(3)
    x, ang = torch.randn(6, 4, 32, generator=g), torch.rand(6, 8, generator=g) * 100
    want = rope.apply_rope_torch(x, ang.cos(), ang.sin())
    y = x.clone()
    assert rope.apply_rope_(y, ang.cos(), ang.sin()) is y and torch.equal(y, want)
    monkeypatch.setattr(rope, "ROPE_INPLACE", False)
    y = x.clone()
    got = rope.apply_rope_(y, ang.cos(), ang.sin())
    assert got is not y and torch.equal(y, x) and torch.equal(got, want)


# (shape, half, pad, dtype)
_NORM_ROPE_CASES = [(shape, half, pad, dtype)
                    for shape, half, pad in (((2, 8, 512), 32, 0), ((2, 3, 64), 8, 0), ((5, 100), 16, 12),
                                             ((3, 128), 32, 40), ((4, 48), 24, 0))
                    for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("cases", _tiers(_NORM_ROPE_CASES, [((2, 3, 64), 8, 0, torch.bfloat16),
                                                            ((5, 100), 16, 12, torch.bfloat16)]))
def test_rms_norm_rope_kernel_equals_the_two_kernels(cases: list) -> None:
    """`rms_norm_rope_triton` (an attention layer's norm then rope in one launch) gives the bits of the RMSNorm kernel
    followed by the rope kernel: the unweighted per-head query norm, HF-V4's weighted and V4.1's norm (bf16 and fp32
    weights), bf16 and fp32; V4's head_dim 512 with rope dim 64 (8 heads), head_dim 64 with rope 16, V4.1's index
    keys (128, rope 64), D not a power of two, rope over the whole row; rows strided (a merged projection's column
    slice), cos / sin the strided halves of a table row. On grid inputs (sums exact in any order) also the torch
    composition's bits. The window-write form: only the rows' slots change, to the composition's rows. The main
    tier runs bf16 on heads of 64 and on strided rows of 100 (with the window write), the slow tier the other
    cases."""
    _interpret("""
        import torch
        from dsv4.ops.norm_rope import (rms_norm_rope_torch, rms_norm_rope_triton, write_rms_norm_rope_torch,
                                        write_rms_norm_rope_triton)
        from dsv4.ops.rmsnorm import (MODE_UNWEIGHTED, MODE_V41, MODE_WEIGHTED, rms_norm_triton, rms_norm_v41_triton,
                                      unweighted_rms_norm_triton)
        from dsv4.ops.rope import apply_rope_triton
        g = torch.Generator().manual_seed(21)
        two_kernels = {MODE_WEIGHTED: rms_norm_triton, MODE_V41: rms_norm_v41_triton,
                       MODE_UNWEIGHTED: lambda x, w, eps: unweighted_rms_norm_triton(x, eps)}
        for shape, half, pad, dtype in CASES:
            T, D = shape[0], shape[-1]
            ang = torch.rand(T, 1, generator=g) * 100 * torch.rand(half, generator=g)
            table = torch.cat([ang.cos(), ang.sin()], dim=-1)
            cos, sin = table[:, :half], table[:, half:]
            w32 = torch.rand(D, generator=g) + 0.5
            for grid in (False, True):
                raw = torch.randn(*shape[:-1], pad + D, generator=g) * 3
                x = ((raw * 8).round() / 8 if grid else raw).to(dtype)[..., pad:]  # grid: multiples of 1/8
                cases = [(MODE_UNWEIGHTED, None), (MODE_WEIGHTED, w32), (MODE_V41, w32.to(dtype))]
                cases += [(MODE_V41, w32)] if dtype == torch.bfloat16 else []  # fp32 output, rope in fp32
                for mode, w in cases:
                    got = rms_norm_rope_triton(x, w, 1e-6, mode, cos, sin)
                    two = apply_rope_triton(two_kernels[mode](x, w, 1e-6), cos, sin)
                    assert got.dtype == two.dtype and torch.equal(got, two), (shape, dtype, mode, grid)
                    if grid:
                        ref = rms_norm_rope_torch(x, w, 1e-6, mode, cos, sin)
                        assert torch.equal(got, ref), (shape, dtype, mode, (got.float() - ref.float()).abs().max())
                if len(shape) == 2 and grid:  # the window write (and into a cache of another dtype: cast after)
                    slots = torch.randperm(9, generator=g)[:T]
                    for cache_dtype in (dtype, torch.bfloat16):
                        for mode, w in cases[:3]:
                            caches = [torch.full((9, D), 3.0, dtype=cache_dtype) for _ in range(2)]
                            write_rms_norm_rope_torch(x, w, 1e-6, mode, cos, sin, caches[0], slots)
                            write_rms_norm_rope_triton(x, w, 1e-6, mode, cos, sin, caches[1], slots)
                            assert torch.equal(caches[0], caches[1]), (shape, dtype, cache_dtype, mode)
        print("ok")
    """, CASES=cases)


def test_expert_gemv_kernel_matches_torch() -> None:
    _interpret("""
        import torch
        from dsv4.ops.moe import expert_gemv_torch, expert_gemv_triton
        g = torch.Generator().manual_seed(2)
        for (E, N, K, T, k) in ((8, 32, 64, 1, 2), (4, 40, 300, 3, 2), (16, 16, 16, 2, 6)):
            w = torch.randn(E, N, K, generator=g)
            x = torch.randn(T, K, generator=g)
            idx = torch.randint(0, E, (T * k,), generator=g)
            idx[::3] = -1  # rows with no expert (another rank's): zeros
            ref = expert_gemv_torch(x, w, idx, k)
            got = expert_gemv_triton(x, w, idx, k)
            assert torch.allclose(ref, got, rtol=1e-4, atol=1e-4), (ref - got).abs().max()
            assert got[idx < 0].eq(0).all()
            h = torch.randn(T * k, N, generator=g)
            w2 = torch.randn(E, K, N, generator=g)
            assert torch.allclose(expert_gemv_torch(h, w2, idx, 1), expert_gemv_triton(h, w2, idx, 1), rtol=1e-4, atol=1e-4)
        print("ok")
    """)


def test_expert_grouped_kernel_matches_torch() -> None:
    """The grouped expert matmul of prefill steps: rows spread over many experts, all rows on one expert (several
    full blocks and a partial one), experts with no rows, more experts than rows, x shared by k slots; fp32 within
    summation order, bf16 equal to the per-expert F.linear (products exact in fp32, one rounding at the end)."""
    _interpret("""
        import torch
        from dsv4.ops.moe import GROUPED_BLOCK_M, expert_grouped_torch, expert_grouped_triton
        g = torch.Generator().manual_seed(6)
        M = GROUPED_BLOCK_M
        for dtype in (torch.float32, torch.bfloat16):
            for R, E, N, K, k in ((1, 4, 16, 32, 1), (7, 5, 40, 48, 1), (3 * 70, 9, 96, 80, 3), (2 * M + 5, 3, 24, 16, 1),
                                  (6, 64, 16, 16, 6)):
                x = torch.randn(R // k, K, generator=g).to(dtype)
                w = torch.randn(E, N, K, generator=g).to(dtype)
                idx = torch.randint(0, E, (R,), generator=g)
                if R > M:
                    idx[: M + 9] = 1  # one expert with more than a block
                    idx[idx == 0] = 2  # and one with none
                if R % 2:  # rows with no expert (-1, another rank's): zeros, in a block of their own
                    idx[R // 3:: 2] = -1
                ref, got = expert_grouped_torch(x, w, idx, k), expert_grouped_triton(x, w, idx, k)
                assert got[idx < 0].eq(0).all()
                assert ref.dtype == got.dtype == dtype and ref.shape == got.shape == (R, N)
                if dtype == torch.float32:
                    assert torch.allclose(ref, got, rtol=1e-5, atol=1e-5), (R, E, (ref - got).abs().max())
                else:
                    assert (ref.float() - got.float()).abs().le(ref.float().abs() * 2.0 ** -8).all(), (R, E)
                    assert (ref != got).float().mean() < 0.01, (R, E, (ref != got).float().mean())
        print("ok")
    """)


def test_combine_experts_kernel_is_bit_exact() -> None:
    """The MoE combine (slots summed in order in fp32, then the shared expert) gives the torch path's bits: V4.1
    (one rounding) and V4 (weighted slots rounded, then a model-dtype add), bf16 and fp32, top-k 1/2/6."""
    _interpret("""
        import torch
        from dsv4.ops.moe import combine_experts_torch, combine_experts_triton
        g = torch.Generator().manual_seed(8)
        for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            for T, k, D in ((1, 6, 64), (5, 2, 100), (3, 1, 2048)):
                y = (torch.randn(T * k, D, generator=g) * 3).to(dtype)
                shared = torch.randn(T, D, generator=g).to(dtype)
                w = torch.rand(T * k, generator=g)
                rows = torch.randperm(T * k, generator=g)  # the slots' rows elsewhere (sorted experts' order)
                for weights in (None, w):
                    ref = combine_experts_torch(y, weights, shared, k)
                    got = combine_experts_triton(y, weights, shared, k)
                    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape == (T, D)
                    assert torch.equal(ref.view(bits), got.view(bits)), (dtype, T, k, weights is None)
                    # read through rows: the same as the rows moved into slot order first (weights stay per slot)
                    moved = torch.empty_like(y)
                    moved[torch.arange(T * k)] = y[rows]
                    ref = combine_experts_torch(moved, weights, shared, k)
                    for fn in (combine_experts_torch, combine_experts_triton):
                        got = fn(y, weights, shared, k, rows)
                        assert torch.equal(ref.view(bits), got.view(bits)), (dtype, T, k, weights is None, "rows")
        print("ok")
    """)


def test_indexer_scores_kernel_matches_torch() -> None:
    """The indexer scores read through the entry slots: rows with every, some and no entry visible, head and channel
    counts off the tile sizes, FP4-like grid values (exact products) and random ones; fp32 within summation order,
    -inf exactly where the reference has it, and the same top-k picks."""
    _interpret("""
        import torch
        from dsv4.ops.indexer import indexer_scores_torch, indexer_scores_triton
        from dsv4.ops.topk import stable_topk
        g = torch.Generator().manual_seed(9)
        for R, H, D, M, N, dtype in ((1, 4, 32, 7, 20, torch.float32), (5, 8, 128, 40, 90, torch.bfloat16),
                                     (3, 3, 20, 33, 50, torch.float32), (2, 64, 128, 70, 200, torch.bfloat16)):
            q = torch.randn(R, H, D, generator=g)
            if R == 5:
                q = (q * 2).round() / 2  # a coarse grid, as after FP4 fake quant
            w = torch.randn(R, H, generator=g)
            keys = torch.randn(N, D, generator=g).to(dtype)
            slots = torch.randint(0, N, (R, M), generator=g)
            n = torch.randint(0, M + 1, (R,), generator=g)
            n[0] = M
            if R > 1:
                n[1] = 0
            ref = indexer_scores_torch(q, w, keys, slots, n, D ** -0.5)
            got = indexer_scores_triton(q, w, keys, slots, n, D ** -0.5)
            assert got.dtype == torch.float32 and got.shape == ref.shape == (R, M)
            assert torch.equal(torch.isinf(ref), torch.isinf(got))
            fin = torch.isfinite(ref)
            assert torch.allclose(ref[fin], got[fin], rtol=1e-5, atol=1e-5), (ref[fin] - got[fin]).abs().max()
            k = min(8, M)
            assert torch.equal(stable_topk(ref, k), stable_topk(got, k))
        print("ok")
    """)


def test_pick_sources_kernel_equals_torch() -> None:
    """Picks -> attention source: with and without the scores (picks of a -inf score become -1), picks already -1
    (a later layer reusing them), K not a power of two, K = M; and slots kept one row per request (`rows_of`,
    TokenKeySlots' form), which give each row its request's slots (the per-row form's, masked slots aside)."""
    _interpret("""
        import torch
        from dsv4.ops.indexer import pick_sources_torch, pick_sources_triton
        from dsv4.ops.topk import stable_topk
        g = torch.Generator().manual_seed(10)
        for R, M, K in ((1, 9, 4), (4, 40, 13), (3, 16, 16)):
            scores = torch.randn(R, M, generator=g)
            n = torch.tensor([M, 2, 0, 7][:R])
            scores[torch.arange(M)[None, :] >= n[:, None]] = float("-inf")
            picks = stable_topk(scores, K)
            eslots = torch.randint(0, 1000, (R, M), generator=g)
            for sc in (scores, None):
                ref = pick_sources_torch(picks, eslots, sc)
                got = pick_sources_triton(picks, eslots, sc)
                for a, b in zip(ref, got):
                    assert a.dtype == b.dtype and torch.equal(a, b), (R, M, K, sc is None)
                if sc is not None:
                    assert (ref[0] == -1).any() == (R > 1)  # the -1 path is exercised (rows with n < K)
            rows_of = torch.arange(R) % 2  # two requests' slot rows shared by the R rows
            for sc in (scores, None):
                ref = pick_sources_torch(picks, eslots[:2], sc, rows_of)
                got = pick_sources_triton(picks, eslots[:2], sc, rows_of)
                for a, b in zip(ref, got):
                    assert a.dtype == b.dtype and torch.equal(a, b), (R, M, K, sc is None, "rows_of")
                per_row = pick_sources_torch(picks, eslots[:2][rows_of], sc)
                assert torch.equal(ref[0], per_row[0]) and torch.equal(ref[1], per_row[1])
        print("ok")
    """)


# The decode selection tests' inputs (code for their child Pythons): queries and keys on halves, so products and
# sums of halves are exact in fp32 (scores tie bitwise, and only ids order them); row 0 sees every entry, row 1
# none, row 2 fewer than k; at 600 entries row 3 sees 150; a pooled source with -1s and ids past the last block.
_SELECT_INPUTS = textwrap.dedent("""
    def select_inputs(g, R, H, D, bs, M, k, C, CB, neg):
        grid = lambda x: (x * 2).round() / 2
        MB = -(-M // bs) + 1
        N = (MB * R + 5) * bs
        q, keys = grid(torch.randn(R, H, D, generator=g)), grid(torch.randn(N, D, generator=g))
        w = torch.randn(R, H, generator=g)
        if neg:
            w = -w.abs() - 0.1
            q = -q.abs()  # with keys >= 0 below every dot is <= 0: relu 0, score -0.0 or 0.0
            keys = keys.abs()
        table = torch.randint(1, N // bs, (R, MB), generator=g, dtype=torch.int32)
        n = torch.randint(0, M + 1, (R,), generator=g)
        n[0], n[1] = M, 0
        if R > 2:
            n[2] = k - 1
        if M == 600:
            n[3] = 150
        pool = None
        if C:
            pool = torch.stack([torch.randperm(-(-M // CB) + 2, generator=g)[:C] for _ in range(R)])
            pool[:, C - 2:] = -1
        return q, w, keys, table, n, pool
""")


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_decode_select_kernels_equal_torch() -> None:
    """The fused decode selection (scores of each row's visible entries through its block table, running top-k,
    merge) against the reference (every entry up to max_entries scored, sorted): the same picks in the same order,
    slots and mask, and the same candidate blocks, on exact-product grids (every score bitwise equal, so ties are
    exercised). Rows with every, no and fewer than k visible entries; raw keys (chunks <= the list) and running
    lists (one split); the candidate source (block top-k, pinned newest block, more blocks than kept); a pooled
    index source (candidate lists with -1s and ids past the last block); scores of -0.0 (all weights < 0). Both
    merges: sorted cuts and the radix select."""
    _interpret("import torch\n" + _SELECT_INPUTS + textwrap.dedent("""
        from dsv4.ops.indexer import decode_select_torch, decode_select_triton
        g = torch.Generator().manual_seed(11)
        checked = 0
        for R, H, D, bs, M, k, C, CB, keep, neg in [
            (3, 4, 32, 4, 40, 8, 0, 4, 0, False), (4, 8, 20, 8, 150, 5, 0, 4, 0, False),
            (3, 4, 32, 4, 40, 8, 0, 4, 4, False), (3, 4, 32, 4, 300, 8, 0, 8, 4, False),
            (3, 4, 32, 4, 40, 8, 6, 4, 0, False), (3, 4, 16, 4, 400, 8, 40, 4, 0, False),
            (2, 3, 16, 2, 5, 3, 0, 4, 0, False), (3, 4, 16, 4, 60, 8, 0, 4, 0, True),
            (4, 64, 128, 8, 100, 24, 0, 8, 6, False),
            # 3 splits: 16, 16 and 6 blocks, under the block lists' 64 places (the merge reads 16 of each); all 38
            # blocks kept, so a block the merge misses shows
            (3, 4, 32, 4, 150, 8, 0, 4, 40, False),
            # a full row's chunks pass the 64-place block lists at 1 split, row 3's fit (RAW_BLOCKS 1)
            (4, 4, 32, 4, 600, 8, 0, 4, 40, False),
        ]:
            q, w, keys, table, n, pool = select_inputs(g, R, H, D, bs, M, k, C, CB, neg)
            ref = decode_select_torch(q, w, keys, table, bs, n, M, D ** -0.5, k, pool, CB, keep)
            # (splits, merge groups): one merge program a row (G 1), or G group lists first, with shares of
            # unequal size (16 / 3) and groups past a short row's keys; 64 = MAX_SPLITS, most splits past its end
            runs = [(1, 1), (3, 1), (4, 2)] + ([(64, None), (16, 3)] if M >= 300 else [])
            for S, G in runs:
                for radix in (False, True):  # the sort-based merge, and the radix select
                    got = decode_select_triton(q, w, keys, table, bs, n, M, D ** -0.5, k, pool, CB, keep, splits=S,
                                               groups=G, radix=radix)
                    for a, b in zip(ref[:3], got[:3]):
                        assert a.dtype == b.dtype and torch.equal(a, b), (R, M, k, C, keep, S, G, radix, a, b)
                    assert (ref[3] is None) == (keep == 0) and (keep == 0 or torch.equal(ref[3], got[3])), \
                        (ref[3], got, radix)
                    checked += 1
        assert checked == 78
        print("ok")
    """))


@pytest.mark.slow  # ~36 s interpreted, the main tier's longest: the slow tier keeps that tier under 10 minutes
def test_decode_select_radix_merge_equals_torch() -> None:
    """The decode selection with its merge as a radix select (`radix=True`: digit counts, scans, gather, one
    sort) against the reference, as the test above checks the sort-based merge (the same exact-product grids, so
    scores tie and only ids order them): raw keys and running lists, short rows and empty ones, the candidate
    source's blocks (more blocks than kept, all kept; the split kernel's block lists unsorted and sorted), a
    pooled source, -0.0 scores, 64 splits over a long row."""
    _interpret("import torch\n" + _SELECT_INPUTS + textwrap.dedent("""
        import dsv4.ops.indexer as idx
        from dsv4.ops.indexer import decode_select_torch, decode_select_triton
        g = torch.Generator().manual_seed(12)
        checked = 0
        for R, H, D, bs, M, k, C, CB, keep, neg, splits in [
            (3, 4, 32, 4, 40, 8, 0, 4, 0, False, (1, 3)),      # running lists (1 split), raw keys (3)
            (3, 4, 32, 4, 300, 8, 0, 8, 4, False, (4, 64)),    # candidate blocks, most of 64 splits past the end
            (3, 4, 16, 4, 400, 8, 40, 4, 0, False, (3,)),      # pooled source
            (3, 4, 16, 4, 60, 8, 0, 4, 0, True, (3,)),         # -0.0 / 0.0 scores: ids order everything
            (3, 4, 32, 4, 150, 8, 0, 4, 40, False, (3,)),      # every block kept
            # a full row's chunk (600 entries, 150 blocks) passes the 64-place block list, row 3's (150, 38) fits:
            # the split kernel decides per row (RAW_BLOCKS 1)
            (4, 4, 32, 4, 600, 8, 0, 4, 40, False, (1,)),
        ]:
            q, w, keys, table, n, pool = select_inputs(g, R, H, D, bs, M, k, C, CB, neg)
            ref = decode_select_torch(q, w, keys, table, bs, n, M, D ** -0.5, k, pool, CB, keep)
            for S in splits:
                # the split kernel's block lists (DSV4_RAW_BLOCK_LISTS): unsorted where a row's chunk fits (1, the
                # default), unsorted with the sorted path compiled out where max_entries bounds every chunk (2),
                # merged through sorted LB tiles (0)
                for raw in ((1, 2, 0) if keep else (1,)):
                    idx.RAW_BLOCK_LISTS = raw
                    got = decode_select_triton(q, w, keys, table, bs, n, M, D ** -0.5, k, pool, CB, keep,
                                               splits=S, radix=True)
                    for a, b in zip(ref[:3], got[:3]):
                        assert a.dtype == b.dtype and torch.equal(a, b), (R, M, k, C, keep, S, raw, a, b)
                    assert (ref[3] is None) == (keep == 0) and (keep == 0 or torch.equal(ref[3], got[3])), \
                        (ref[3], got, raw)
                    checked += 1
        assert checked == 16
        print("ok")
    """))


def test_select_splits_fill_the_gpu_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode selection's split count: rows x splits >= twice the SMs, at most MAX_SPLITS (64: the batch-1 long
    rows measured fastest there), at least one; and its merge's group count."""
    idx = pytest.importorskip("dsv4.ops.indexer")
    monkeypatch.setattr(idx, "_sm_count", lambda device: 132)
    dev = torch.device("cpu")
    assert idx.MAX_SPLITS == 64
    assert [idx.select_splits(R, dev) for R in (1, 4, 5, 8, 33, 64, 264, 1000)] == [64, 64, 53, 33, 8, 5, 1, 1]
    # the merge's first stage: ~8 split lists a group, none (1) under 16 splits
    assert [idx.merge_groups(S) for S in (64, 53, 33, 17, 16, 15, 8, 1)] == [8, 6, 4, 2, 2, 1, 1, 1]
    # the default merge: a radix select where the sort merge would take >= 16 splits (batch <= 16 here), then with
    # up to RADIX_MAX_SPLITS (256) splits; sorted cuts above; DSV4_SELECT_RADIX's 0 / 1 force one form
    rows = (1, 2, 8, 16, 17, 32, 1000)
    assert [idx.select_plan(R, dev) for R in rows] == [
        (256, True), (132, True), (33, True), (17, True), (16, True), (9, False), (1, False)]
    assert [idx.select_plan(R, dev, radix=False) for R in rows] == [(idx.select_splits(R, dev), False) for R in rows]
    assert [idx.select_plan(R, dev, radix=True)[0] for R in rows] == [256, 132, 33, 17, 16, 9, 1]
    monkeypatch.setattr(idx, "RADIX_SELECT", False)
    assert idx.select_plan(1, dev) == (64, False)
    monkeypatch.setattr(idx, "RADIX_SELECT", True)
    assert idx.select_plan(1000, dev) == (1, True)


def test_select_radix_switch_rejects_other_values() -> None:
    """DSV4_SELECT_RADIX is auto, 0 or 1: another value stops the import with one error naming it, rather than
    silently meaning 0."""
    env = {**os.environ, "DSV4_SELECT_RADIX": "yes"}
    out = subprocess.run([sys.executable, "-c", "import dsv4.ops.indexer"], env=env, capture_output=True, text=True,
                         check=False)
    assert out.returncode != 0 and "DSV4_SELECT_RADIX must be auto, 0 or 1, not 'yes'" in out.stderr, out.stderr


def test_pick_table_sources_kernel_equals_torch() -> None:
    """Published picks -> slots through the block table: -1 picks, K not a power of two."""
    _interpret("""
        import torch
        from dsv4.ops.indexer import pick_table_sources_torch, pick_table_sources_triton
        g = torch.Generator().manual_seed(12)
        for R, K, bs in ((1, 4, 4), (4, 13, 8), (3, 16, 2)):
            table = torch.randint(0, 1000, (R, 9), generator=g, dtype=torch.int32)
            picks = torch.randint(-1, 9 * bs, (R, K), generator=g)
            for a, b in zip(pick_table_sources_torch(picks, table, bs), pick_table_sources_triton(picks, table, bs)):
                assert a.dtype == b.dtype and torch.equal(a, b), (R, K)
        print("ok")
    """)


def test_engram_update_kernel_matches_torch() -> None:
    """The Engram gate and update: hc 4 and 2, D off the block size and over several blocks, masked tokens, a
    stream whose dot is exactly 0 (sign 0: gate 1/2); fp32 within summation order, bf16 within an ulp and nearly
    all equal."""
    _interpret("""
        import torch
        from dsv4.ops.engram import engram_update_torch, engram_update_triton
        g = torch.Generator().manual_seed(11)
        for dtype in (torch.float32, torch.bfloat16):
            for T, hc, D in ((1, 4, 64), (5, 4, 100), (3, 2, 2500)):
                h = torch.randn(T, hc, D, generator=g).to(dtype)
                kv = torch.randn(T, (hc + 1) * D, generator=g).to(dtype)
                kv[0, :D] = 0  # stream 0 of token 0: key 0, dot 0
                qw, kw = (torch.rand(hc, D, generator=g) + 0.5).to(dtype), torch.randn(hc, D, generator=g).to(dtype)
                for mask in (None, torch.arange(T) % 2 == 1):
                    ref = engram_update_torch(h, kv, qw, kw, 1e-6, mask)
                    got = engram_update_triton(h, kv, qw, kw, 1e-6, mask)
                    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
                    r, o = ref.float(), got.float()
                    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
                    # the gate may move by what the sums' order changes (1e-4 allowed), scaled by the value row
                    value = kv[:, hc * D:].float().abs()[:, None, :]
                    bound = r.abs() * ulp + 1e-4 * value + 1e-6
                    assert ((r - o).abs() <= bound).all(), (dtype, T, hc, D, (r - o).abs().max())
                    if dtype == torch.bfloat16:
                        assert (r != o).float().mean() < 0.05
                    if mask is not None:  # masked tokens: gate 0, the streams pass through (rounded to the dtype)
                        assert torch.equal(got[mask], h[mask])
        print("ok")
    """)


def test_engram_gather_kernel_matches_torch() -> None:
    """Engram rows gathered and dequantized: FP8 with UE8M0 bytes (every exponent, 0 = 2^-127 and 255 = NaN among
    them), with float scales, and a float table; dims off the power of two, repeated and extreme row ids, bf16 and
    fp32 outputs: bit-equal to the reference (bf16 subnormals aside), and the reference equal to a per-row
    transcription."""
    _interpret("""
        import math
        import torch
        from dsv4.ops.engram_gather import engram_gather_torch, engram_gather_triton
        g = torch.Generator().manual_seed(3)
        for rows, dim, cols, kind in ((300, 64, 2, "e8m0"), (256, 96, 3, "e8m0"), (50, 40, 1, "f32"),
                                      (70, 48, 0, "bf16")):
            if kind == "bf16":
                table, scale = torch.randn(rows, dim, generator=g).to(torch.bfloat16), None
            else:
                table = (torch.randn(rows, dim, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
                if kind == "e8m0":
                    scale = torch.arange(rows * cols, dtype=torch.int64).remainder(256).to(torch.uint8)
                    scale = scale.reshape(rows, cols)
                else:
                    scale = torch.rand(rows, cols, generator=g) * 0.01
            ids = torch.randint(0, rows, (5, 7), generator=g)
            ids[0, 0], ids[0, 1], ids[1, 0] = 0, rows - 1, 0  # both ends, a repeat
            for dtype in (torch.float32, torch.bfloat16):
                ref = engram_gather_torch(table, scale, ids, dtype)
                got = engram_gather_triton(table, scale, ids, dtype)
                assert got.shape == (5, 7, dim) and got.dtype == dtype
                if dtype == torch.bfloat16:  # the interpreter mis-rounds bf16 subnormals (a GPU does not: tests/gpu)
                    tiny = ref.float().abs() < torch.finfo(torch.bfloat16).tiny
                    got, cmp = got.masked_fill(tiny, 0), ref.masked_fill(tiny, 0)
                else:
                    cmp = ref
                assert torch.equal(got.isnan(), cmp.isnan()) and torch.equal(got.nan_to_num(), cmp.nan_to_num())
                # the reference, transcribed per row: value * scale of its channel block, in fp32, rounded once
                for i, r in enumerate(ids.reshape(-1).tolist()[:6]):
                    want = []
                    for d in range(dim):
                        v = float(table[r, d].float())
                        if scale is not None:
                            blk = d // (dim // cols)
                            s = (math.ldexp(1.0, int(scale[r, blk]) - 127) if kind == "e8m0"
                                 else float(scale[r, blk]))
                            v = float("nan") if kind == "e8m0" and int(scale[r, blk]) == 255 else v * s
                        want.append(v)
                    want = torch.tensor(want, dtype=torch.float32).to(dtype)
                    row = ref.reshape(-1, dim)[i]
                    assert torch.equal(row.isnan(), want.isnan()) and torch.equal(row.nan_to_num(), want.nan_to_num())
        empty = engram_gather_triton(table, scale, torch.zeros(0, 3, dtype=torch.int64), torch.bfloat16)
        assert empty.shape == (0, 3, 48)
        print("ok")
    """)


def test_write_entries_kernel_matches_torch() -> None:
    """V4's compressed-entry write of a decode step (norm, rope at the window's start, scatter into the cache): rows
    that close a window and rows that do not (start clamped at 0), head dims with and without nope channels, bf16
    and fp32 streams, a bf16 cache; only the rows' slots change, within an ulp of the stream dtype."""
    _interpret("""
        import torch
        from dsv4.models.config import RopeConfig
        from dsv4.models.layers.rope import RotaryTable
        from dsv4.models.layers.norm import rms_norm_torch
        from dsv4.ops.compress_pool import write_entries_torch, write_entries_triton
        g = torch.Generator().manual_seed(12)
        for dtype, cache_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                   (torch.float32, torch.bfloat16)):
            for D, rd, m in ((64, 16, 4), (32, 32, 2), (48, 16, 128)):
                rope = RotaryTable(RopeConfig(theta=10000.0, dim=rd))
                rope.prepare(1024)
                pooled = (torch.randn(6, D, generator=g) * 3).to(dtype)
                weight = torch.rand(D, generator=g) + 0.5
                pos = torch.tensor([0, m - 2, m - 1, 3 * m - 1, 5 * m + 1, 1000])
                slots = torch.tensor([3, 7, 1, 0, 9, 5])
                caches = [torch.full((12, D), 7.0).to(cache_dtype) for _ in range(2)]
                write_entries_torch(pooled, weight, 1e-6, rope.table, pos, m, caches[0], slots)
                write_entries_triton(pooled, weight, 1e-6, rope.table, pos, m, caches[1], slots)
                r, o = caches[0].float(), caches[1].float()
                untouched = torch.ones(12, dtype=torch.bool)
                untouched[slots] = False
                assert (o[untouched] == 7.0).all() and (r[untouched] == 7.0).all()
                ulp = 2.0 ** -7 if torch.bfloat16 in (dtype, cache_dtype) else 2.0 ** -20
                # a normed value one ulp off moves a rotated pair by an ulp of the pair's size (cancellation)
                y = rms_norm_torch(pooled, weight, 1e-6).float()
                pair = torch.zeros_like(y)
                pair[:, D - rd:] = (y[:, D - rd::2].abs() + y[:, D - rd + 1::2].abs()).repeat_interleave(2, dim=1)
                bound = r[slots].abs() * ulp + 2 * ulp * pair + 1e-6
                assert ((r[slots] - o[slots]).abs() <= bound).all(), (dtype, D, m, (r - o).abs().max())
                if cache_dtype == torch.bfloat16:  # in fp32 a statistic one ulp off changes its whole row
                    assert (r != o).float().mean() < 0.05
        print("ok")
    """)


def test_window_kv_kernel_matches_torch() -> None:
    """V4.1's window-KV write of a decode step (V4.1 RMSNorm, rope, FP8 fake quant, scatter) against the torch ops:
    head dims of 1, 4 and 16 FP8 blocks, rope over part or all of the row, cos/sin as the strided halves of a
    table row, latent rows strided (D = 128), bf16 and fp32; only the rows' slots change; nearly every element equal, and the rest one FP8 step
    away at most (a normed value an ulp off can flip a code)."""
    _interpret("""
        import torch
        from dsv4.ops.cache_writes import write_window_kv_torch, write_window_kv_triton
        g = torch.Generator().manual_seed(13)
        for dtype in (torch.bfloat16, torch.float32):
            for D, half in ((32, 8), (128, 32), (512, 32), (64, 32)):
                R = 5
                # D = 128: the latent's rows strided, as the wkv part of a merged projection's output
                pad = 24 if D == 128 else 0
                latent = (torch.randn(R, pad + D, generator=g) * 4).to(dtype)[:, pad:]
                weight = (torch.rand(D, generator=g) + 0.5).to(dtype)
                ang = torch.rand(R, 1, generator=g) * 100 * torch.rand(half, generator=g)
                table = torch.cat([ang.cos(), ang.sin()], dim=-1)
                cos, sin = table[:, :half], table[:, half:]
                slots = torch.tensor([4, 0, 7, 2, 5])
                caches = [torch.full((9, D), 3.0).to(dtype) for _ in range(2)]
                write_window_kv_torch(latent, weight, 1e-6, cos, sin, caches[0], slots)
                write_window_kv_triton(latent, weight, 1e-6, cos, sin, caches[1], slots)
                r, o = caches[0].float(), caches[1].float()
                untouched = torch.ones(9, dtype=torch.bool)
                untouched[slots] = False
                assert (o[untouched] == 3.0).all()
                assert ((r - o).abs() <= r.abs() * 2.0 ** -3 + 1e-6).all(), (dtype, D, (r - o).abs().max())
                assert (r != o).float().mean() < 0.02, (dtype, D, (r != o).float().mean())
        print("ok")
    """)


# (dtype, D, d, half, ratio)
_ENTRY_WRITES_CASES = [(dtype, D, d, half, ratio) for dtype in (torch.bfloat16, torch.float32)
                       for D, d, half in ((64, 32, 8), (512, 128, 32)) for ratio in (1, 2, 4)]


@pytest.mark.parametrize("cases", _tiers(_ENTRY_WRITES_CASES, [(torch.bfloat16, 64, 32, 8, 2),
                                                               (torch.bfloat16, 512, 128, 32, 4)]))
def test_entry_writes_kernel_matches_torch(cases: list) -> None:
    """V4.1's decode entry writes (dsv4.ops.cache_writes): the compressed entry (rope at the entry's first position
    from a prepared table, FP4 with e4m3 scales per 16, scatter) bit for bit against the torch ops, and the indexer
    keys (V4.1 norm, the same rope, FP4 with power-of-two scales per 32) within one FP4 step where a normed value
    lands an ulp off; ratios 1, 2 and 4, positions that complete an entry and that do not (their slot the trash
    slot, as `entry_write` gives), bf16 and fp32, the latent rows strided. The main tier runs bf16: D 64 at ratio
    2 and D 512 at ratio 4; the slow tier the other cases."""
    _interpret("""
        import torch
        from dsv4.ops.cache_writes import (write_entry_kv_torch, write_entry_kv_triton, write_index_keys_torch,
                                           write_index_keys_triton)
        g = torch.Generator().manual_seed(21)
        P = 64
        for dtype, D, d, half, ratio in CASES:
            ang = torch.arange(P)[:, None] * torch.rand(half, generator=g)
            table = torch.cat([ang.cos(), ang.sin()], dim=-1)
            R = 6
            pos = torch.tensor([0, 1, 2, 7, 30, 41])
            closes = (pos + 1) % ratio == 0
            slots = torch.where(closes, torch.tensor([3, 5, 1, 8, 6, 2]), 0)  # slot 0: the trash slot
            latent = (torch.randn(R, D + 8, generator=g) * 3).to(dtype)[:, 8:]
            caches = [torch.full((10, D), 7.0).to(dtype) for _ in range(2)]
            write_entry_kv_torch(latent, table, pos, ratio, caches[0], slots)
            write_entry_kv_triton(latent, table, pos, ratio, caches[1], slots)
            kept = slots[closes]
            assert torch.equal(caches[0][kept], caches[1][kept]), (dtype, D, ratio)
            assert (caches[1][[i for i in range(1, 10) if i not in kept.tolist()]] == 7.0).all()
            k = (torch.randn(R, d, generator=g) * 2).to(dtype)
            w = (torch.rand(d, generator=g) + 0.5).to(dtype)
            keys = [torch.full((10, d), 7.0).to(dtype) for _ in range(2)]
            write_index_keys_torch(k, w, 1e-6, table, pos, ratio, keys[0], slots)
            write_index_keys_triton(k, w, 1e-6, table, pos, ratio, keys[1], slots)
            r, o = keys[0][kept].float(), keys[1][kept].float()
            assert ((r - o).abs() <= r.abs() * 0.5 + 1e-6).all(), (dtype, d, ratio, (r - o).abs().max())
            assert (r != o).float().mean() < 0.02, (dtype, d, ratio, (r != o).float().mean())
        print("ok")
    """, CASES=cases)


def test_fake_quant_kernel_is_bit_exact() -> None:
    _interpret("""
        import torch
        from dsv4.ops.fake_quant import (FP4_E4M3, FP4_UE8M0, FP8_UE8M0, fake_quant_triton,
                                         fp4_fake_quant_e4m3_torch, fp4_fake_quant_ue8m0_torch, fp8_fake_quant_torch)
        g = torch.Generator().manual_seed(3)
        cases = [torch.randn(7, 64, generator=g), torch.randn(3, 4, 128, generator=g) * 100,
                 torch.randn(5, 32, generator=g) * 1e-5, torch.zeros(2, 32), -torch.zeros(2, 32),
                 torch.tensor([[-1e-30] * 16 + [1.0] * 16]),  # negative values that quantise to -0
                 (torch.randint(-24, 25, (4, 64), generator=g) * 0.25).float(),  # e2m1 grid ties
                 torch.randn(6, 64, generator=g).to(torch.bfloat16).float()]
        # e4m3 round-half-even: every midpoint between neighbouring e4m3 values, in blocks whose amax is 448
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
        mids = (grid[1:] + grid[:-1]) / 2
        mids = torch.cat([mids, mids.new_zeros((-len(mids)) % 31)]).view(-1, 31)
        blocks = torch.cat([torch.full((mids.shape[0], 1), 448.0), mids], dim=1)
        cases += [blocks, -blocks, blocks * 2.0**-20]
        for x in cases:
            for fn, mode, block in ((fp8_fake_quant_torch, FP8_UE8M0, 32),
                                    (fp4_fake_quant_ue8m0_torch, FP4_UE8M0, 32), (fp4_fake_quant_e4m3_torch, FP4_E4M3, 16)):
                ref, got = fn(x, block), fake_quant_triton(x, mode, block)
                # compared as bits: torch.equal calls -0 and +0 equal, and e4m3 keeps the sign of zero
                assert torch.equal(ref.view(torch.int32), got.view(torch.int32)), (fn.__name__, ref, got)
        print("ok")
    """)


def test_mhc_collapse_and_expand_kernels_match_torch() -> None:
    """Both numerics of expand and the collapse, fp32 and bf16 streams, N = 1, 2, 4, D not a power of two, no
    tokens, against the torch references. The N terms may be summed in another order: the fp32 sums may differ by
    a few fp32 roundings of the terms' magnitude, which the final cast can turn into one ulp of the stream dtype;
    in bf16 nearly every element is bit-equal."""
    _interpret("""
        import torch
        from dsv4.ops.mhc_streams import collapse_torch, collapse_triton, expand_torch, expand_triton
        g = torch.Generator().manual_seed(0)

        def close(ref, got, mag, dtype):
            ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
            r, o = ref.float(), got.float()
            assert ref.dtype == got.dtype == dtype and ref.shape == got.shape
            bound = r.abs() * ulp + mag * 4 * 2.0 ** -23 + 1e-30
            assert ((r - o).abs() <= bound).all(), ((r - o).abs() / bound).max()
            if dtype != torch.float32 and r.numel():  # fp32 keeps the reordering bits; bf16 rounds them off
                assert (r != o).float().mean() < 0.01, (r != o).float().mean()

        for dtype in (torch.float32, torch.bfloat16):
            for T, N, D in ((3, 4, 100), (1, 2, 64), (5, 1, 33), (0, 4, 16), (2, 4, 2048)):
                h = torch.randn(T, N, D, generator=g).to(dtype)
                y = torch.randn(T, D, generator=g).to(dtype)
                pre = torch.rand(T, N, generator=g) + 0.1
                post = 2 * torch.rand(T, N, generator=g)
                comb = torch.softmax(torch.randn(T, N, N, generator=g), dim=-1)
                hf = h.float().abs()
                close(collapse_torch(h, pre), collapse_triton(h, pre), (pre[..., None] * hf).sum(1), dtype)
                mag = post[..., None] * y.float().abs()[:, None] + torch.matmul(comb.transpose(-1, -2), hf)
                for fp32 in (True, False):
                    close(expand_torch(y, h, post, comb, fp32), expand_triton(y, h, post, comb, fp32), mag, dtype)
        print("ok")
    """)


def test_swiglu_kernel_matches_torch() -> None:
    """Both numerics, with and without a row weight, strided halves of one gate_up row, values around the clamp
    limit: within a few fp32 ulps of the torch reference (the CPU's silu is vectorised differently from the CUDA
    formula the kernel follows), and in bf16 nearly every element bit-equal."""
    _interpret("""
        import torch
        from dsv4.ops.swiglu import swiglu_torch, swiglu_triton
        g = torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.bfloat16):
            for R, I in ((3, 96), (1, 64), (7, 200), (0, 32)):
                gu = (torch.randn(R, 2 * I, generator=g) * 6).to(dtype)  # beyond the limit 10 now and then
                gate, up = gu[:, :I], gu[:, I:]
                w = torch.rand(R, generator=g)
                for weight, fp32 in ((None, True), (w, True), (None, False)):
                    ref = swiglu_torch(gate, up, 10.0, weight, fp32)
                    got = swiglu_triton(gate, up, 10.0, weight, fp32)
                    assert ref.dtype == got.dtype == dtype and ref.shape == got.shape
                    r, o = ref.float(), got.float()
                    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
                    assert ((r - o).abs() <= r.abs() * 4 * ulp + 1e-30).all(), ((r - o).abs() / r.abs()).max()
                    if dtype == torch.bfloat16 and r.numel():
                        assert (r != o).float().mean() < 0.01, (r != o).float().mean()
        print("ok")
    """)


def test_router_kernel_matches_torch() -> None:
    """Both scorings, k = 1, 6 and 8, expert counts not a power of two, image and text tokens (two biases), exact
    ties between experts (the lowest id wins), a gate temperature: the same experts as the torch reference and
    weights within a few fp32 ulps (the CPU divides by the temperature where the kernel multiplies by its inverse,
    as torch does on CUDA)."""
    _interpret("""
        import torch
        from dsv4.ops.router import route_torch, route_triton
        g = torch.Generator().manual_seed(2)
        for scoring in ("sqrtsoftplus", "sigmoid"):
            for T, E, k in ((5, 16, 6), (3, 60, 8), (4, 9, 1), (0, 16, 2)):
                logits = torch.randn(T, E, generator=g) * 4
                if T > 1:
                    logits[1, 3] = logits[1, 7] = 30.0  # a tie above softplus' threshold
                    logits[0, 2] = logits[0, 5] = logits[0].max() + 1
                bias, bias_vl = torch.randn(E, generator=g) * 0.1, torch.randn(E, generator=g) * 0.1
                if T > 1:
                    bias[[2, 3, 5, 7]] = bias_vl[[2, 3, 5, 7]] = 0.0
                is_image = torch.rand(T, generator=g) < 0.5
                for temp in (1.0, 1.3):
                    w0, i0 = route_torch(logits, bias, bias_vl, is_image, temp, scoring, k, 1.5)
                    w1, i1 = route_triton(logits, bias, bias_vl, is_image, temp, scoring, k, 1.5)
                    assert torch.equal(i0, i1), (scoring, T, E, k, i0, i1)
                    assert w1.dtype == torch.float32 and torch.allclose(w0, w1, rtol=4e-7, atol=0), (w0 - w1).abs().max()
        print("ok")
    """)


def test_v4_router_kernel_matches_torch() -> None:
    """DeepSeek-V4's router (`route_v4`): top-k layers (the fp32 selection bias) and hash layers (`tid2eid`), both
    scorings, k = 6 and 1, expert counts not a power of two, exact ties between experts (the lowest id wins), logits
    above softplus' threshold, fp32 and bf16 logits. The same experts as the torch reference; weights in the logits'
    dtype, within a few fp32 ulps in fp32 (the CPU's softplus and the kernel's may differ in the last bit) and within
    one bf16 ulp in bf16 (the same per-op roundings; a last-bit difference before a rounding can move it), nearly all
    bf16 weights equal."""
    _interpret("""
        import torch
        from dsv4.ops.router import route_v4_torch, route_v4_triton
        g = torch.Generator().manual_seed(8)
        equal = total = 0
        for dtype in (torch.float32, torch.bfloat16):
            for scoring in ("sqrtsoftplus", "sigmoid"):
                for T, E, k in ((5, 16, 6), (3, 60, 6), (4, 9, 1)):
                    logits = torch.randn(T, E, generator=g) * 4
                    logits[1, 3] = logits[1, 7] = 30.0  # a tie above softplus' threshold
                    logits[0, 2] = logits[0, 5] = logits[0].max() + 1
                    logits = logits.to(dtype)
                    bias = torch.randn(E, generator=g) * 0.1
                    bias[[2, 3, 5, 7]] = 0.0
                    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)]).int()
                    ids = torch.randint(0, 50, (T,), generator=g)
                    for b, table in ((bias, None), (None, tid2eid)):
                        w0, i0 = route_v4_torch(logits, b, table, ids, scoring, k, 1.5)
                        w1, i1 = route_v4_triton(logits, b, table, ids, scoring, k, 1.5)
                        case = (dtype, scoring, T, E, k, table is None)
                        assert torch.equal(i0, i1), (case, i0, i1)
                        assert w1.dtype == dtype and w1.shape == w0.shape, case
                        rtol = 4e-7 if dtype == torch.float32 else 2.0 ** -7
                        assert torch.allclose(w0.float(), w1.float(), rtol=rtol, atol=0), (case, (w0 - w1).abs().max())
                        if dtype == torch.bfloat16:
                            equal += int((w0 == w1).sum())
                            total += w0.numel()
        assert equal >= 0.9 * total, (equal, total)
        w, i = route_v4_triton(torch.zeros(0, 16), torch.zeros(16), None, torch.zeros(0, dtype=torch.long),
                               "sqrtsoftplus", 6, 1.5)
        assert w.shape == i.shape == (0, 6)
        print("ok")
    """)


def test_v41_decode_pool_kernel_matches_torch() -> None:
    """V4.1's ratio-2 decode pooling (`pool_decode_v41`: the decode pool kernel with fp32 rows, weights and products,
    no position bias) against its reference (the model's former torch path): the rings after the push bitwise equal,
    the pooled latents of every row that closes its pair within a few fp32 ulps (the interpreter's exp is numpy's,
    the reference's torch's; on the GPU both are expf) and, for bf16 streams, nearly all equal; rings of exactly
    two rows (slot order = position order) and with slack (speculation), the first pair of a sequence. Planted
    bf16 roundings of the weights or of the ring rows (V4's numerics) fail it."""
    _interpret("""
        import torch
        from dsv4.ops.compress_pool import pool_decode_triton, pool_decode_v41_torch
        g = torch.Generator().manual_seed(5)
        for dtype in (torch.bfloat16, torch.float32):
            for dim, slack in ((48, 0), (512, 0), (40, 3)):
                cap, blocks = 2 + slack, 6
                ring_kv = torch.randn(blocks, cap, dim, generator=g) * 2
                ring_gate = torch.randn(blocks, cap, dim, generator=g) * 3
                pos = torch.tensor([1, 0, 7, 2 * cap + 1, 998, 1001])  # rows 1 and 4 leave their pair open
                blk = torch.tensor([5, 0, 2, 1, 3, 4])
                kv = torch.randn(6, dim, generator=g) * 2
                gate = torch.randn(6, dim, generator=g) * 3
                rings = [(ring_kv.clone(), ring_gate.clone()) for _ in range(2)]
                ref = pool_decode_v41_torch(*rings[0], blk, pos, kv, gate, 2, dtype)
                got = pool_decode_triton(*rings[1], blk, pos, rings[1][0], 2, False, dtype, kv, gate, fp32=True)
                assert torch.equal(rings[0][0], rings[1][0]) and torch.equal(rings[0][1], rings[1][1])
                assert not torch.equal(rings[0][0], ring_kv)  # the push happened
                closed = (pos + 1) % 2 == 0
                r, o = ref[closed].float(), got[closed].float()
                assert ref.dtype == got.dtype == dtype and got.shape == (6, dim)
                if dtype == torch.float32:
                    assert ((r - o).abs() <= 4 * 2.0 ** -23 * (r.abs() + kv.abs().amax())).all(), (r - o).abs().max()
                else:
                    assert ((r - o).abs() <= 2.0 ** -7 * r.abs()).all() and (r != o).float().mean() < 0.02
        print("ok")
    """)


# (dtype, m, overlap, dim, slack); slack: ring rows past the window (speculation on V4, kv.spec.ring_slack)
_POOL_CASES = [(dtype, m, overlap, dim, slack) for dtype in (torch.bfloat16, torch.float32)
               for m, overlap, dim, slack in ((2, True, 48, 0), (4, False, 64, 3), (32, False, 24, 0),
                                              (4, True, 16, 5))]


@pytest.mark.parametrize("cases", _tiers(_POOL_CASES, [(torch.bfloat16, 4, False, 64, 3),
                                                       (torch.bfloat16, 4, True, 16, 5)]))
def test_compressor_decode_pool_kernel_matches_torch(cases: list) -> None:
    """Overlapping (CSA) and plain (HCA) compressors, short and long rings (and rings longer than their window, as
    under speculation), rows early in their sequence (masked ring rows), bf16 and fp32 streams: within one ulp of
    the stream dtype of the torch reference, nearly all equal; with the push of new rows; and a verify step's rows
    (`query_len`). The main tier runs bf16 with a plain and an overlapping ring of 4, both with slack; the slow
    tier the other cases."""
    _interpret("""
        import torch
        from dsv4.ops.compress_pool import pool_decode_torch, pool_decode_triton, pool_verify_torch
        g = torch.Generator().manual_seed(4)
        for dtype, m, overlap, dim, slack in CASES:
            cap, coff, blocks = (2 * m if overlap else m) + slack, (2 if overlap else 1), 5
            ring_kv = torch.randn(blocks, cap, coff * dim, generator=g).to(dtype)
            ring_gate = torch.randn(blocks, cap, coff * dim, generator=g) * 2
            pb = torch.randn(m, coff * dim, generator=g)
            pos = torch.tensor([0, 1, cap - 1, cap, 3 * cap + 1, 1000])
            blk = torch.tensor([4, 0, 2, 1, 3, 2])
            ref = pool_decode_torch(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype)
            got = pool_decode_triton(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype)
            assert ref.dtype == got.dtype == dtype and ref.shape == got.shape == (6, dim)
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
            r, o = ref.float(), got.float()
            scale = ring_kv.float().abs().amax()
            assert ((r - o).abs() <= r.abs() * ulp + scale * 2.0 ** -22).all(), (m, overlap, (r - o).abs().max())
            if dtype == torch.bfloat16:
                assert (r != o).float().mean() < 0.05, (r != o).float().mean()
            # with the push of the rows' new raw rows (one state block per row, as the engine has): the same
            # pooled entries, and the same ring contents after
            blk = torch.tensor([4, 0, 2, 1, 3])
            pos = pos[:5]
            new_kv = (torch.randn(5, coff * dim, generator=g) * 3).to(dtype)
            new_gate = torch.randn(5, coff * dim, generator=g) * 2  # fp32: the bf16 kv ring's gate ring is fp32
            rings = [(ring_kv.clone(), ring_gate.clone()) for _ in range(2)]
            ref = pool_decode_torch(*rings[0], blk, pos, pb, m, overlap, dtype, new_kv, new_gate)
            got = pool_decode_triton(*rings[1], blk, pos, pb, m, overlap, dtype, new_kv, new_gate)
            assert torch.equal(rings[0][0], rings[1][0]) and torch.equal(rings[0][1], rings[1][1])
            assert not torch.equal(rings[0][0], ring_kv)  # the push happened
            r, o = ref.float(), got.float()
            assert ((r - o).abs() <= r.abs() * ulp + 3 * scale * 2.0 ** -22).all(), (m, overlap, (r - o).abs().max())
            # new rows as column views of one product (a merged projection's: rows strided by its width, read
            # in place) push and pool exactly as their contiguous copies
            W = coff * dim
            prod = torch.cat([new_kv.float(), new_gate, torch.randn(5, 7, generator=g)], dim=1).to(dtype)
            views = (prod[:, :W], prod[:, W:2 * W])
            assert views[0].stride(0) == 2 * W + 7 and not views[0].is_contiguous()
            rings = [(ring_kv.clone(), ring_gate.clone()) for _ in range(2)]
            ref = pool_decode_triton(*rings[0], blk, pos, pb, m, overlap, dtype, *(v.contiguous() for v in views))
            got = pool_decode_triton(*rings[1], blk, pos, pb, m, overlap, dtype, *views)
            assert torch.equal(rings[0][0], rings[1][0]) and torch.equal(rings[0][1], rings[1][1])
            assert torch.equal(ref, got)
            # a verify step's q = 3 rows a request (query_len): each window from the step's rows where it reaches
            # into the step and from the ring before, as pool_verify_torch; the rings only read; the same rows one
            # position later (every window's step / ring split moves) far from it (catches an off-by-one)
            q, starts = 3, [0, 2, cap - 1, 5 * cap + 3]
            pos = torch.tensor([p + j for p in starts for j in range(q)])
            blk = torch.tensor([b for b in (3, 1, 0, 2) for _ in range(q)])
            rows = torch.cat([torch.randn(len(pos), 2 * W, generator=g), torch.randn(len(pos), 5, generator=g)],
                             dim=1).to(dtype)
            step_kv, step_gate = rows[:, :W], rows[:, W:2 * W]  # strided views, read in place
            before = (ring_kv.clone(), ring_gate.clone())
            ref = pool_verify_torch(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype, step_kv, step_gate, q)
            got = pool_decode_triton(ring_kv, ring_gate, blk, pos, pb, m, overlap, dtype, step_kv, step_gate, q)
            assert torch.equal(ring_kv, before[0]) and torch.equal(ring_gate, before[1])
            r, o = ref.float(), got.float()
            tol = r.abs() * ulp + 3 * max(scale, step_kv.float().abs().amax()) * 2.0 ** -22
            assert ((r - o).abs() <= tol).all(), (m, q, (r - o).abs().max())
            off = pool_verify_torch(ring_kv, ring_gate, blk, pos + 1, pb, m, overlap, dtype, step_kv, step_gate, q)
            assert ((off.float() - o).abs() > tol).float().mean() > 0.5
        print("ok")
    """, CASES=cases)


# (R, N, K, dtype)
_FP32_LINEAR_CASES = [(1, 16, 320, torch.bfloat16), (5, 37, 300, torch.bfloat16), (3, 24, 64, torch.float32),
                      (40, 100, 96, torch.bfloat16), (1, 1030, 64, torch.bfloat16)]


@pytest.mark.parametrize("cases", _tiers(_FP32_LINEAR_CASES, [(5, 37, 300, torch.bfloat16),
                                                              (3, 24, 64, torch.float32)]))
def test_fp32_linear_kernel_matches_torch(cases: list) -> None:
    """fp32 math on a stored bf16 / fp32 weight (V4.1's router and ratio-2 compressor): within the reordering of
    fp32 sums of exact products of F.linear(x.float(), w.float()); one row, several, a strided x, N and K off the
    tiles; bf16 values whose products and sums are exact on a coarse grid give bit-equal outputs. The main tier runs
    5 rows of a bf16 weight and 3 of an fp32 one, the slow tier the other shapes; both tiers check that the shapes
    of the two together take every tile shape, and the strided x and the grid."""
    _interpret("""
        import torch
        from dsv4.ops.fp32_linear import decode_blocks, fp32_linear_torch, fp32_linear_triton
        g = torch.Generator().manual_seed(5)
        tiles = set()
        for R, N, K, dtype in CASES:
            x = torch.randn(R, K, generator=g).to(dtype)
            w = torch.randn(N, K, generator=g).to(dtype)
            ref = fp32_linear_torch(x, w)
            s = x.float().abs() @ w.float().abs().t()
            for blocks in ("wide", "narrow"):  # every tile shape: 1-16 outputs a program, K in one step or several
                tiles.add(decode_blocks(R, N, K, blocks))
                got = fp32_linear_triton(x, w, blocks)
                assert got.dtype == torch.float32 and got.shape == (R, N)
                assert ((got - ref).abs() <= K * 2.0 ** -23 * s).all(), (blocks, (got - ref).abs().max())
        # every tile shape over the cases of both tiers (those not run here run in the other tier)
        tiles |= {decode_blocks(R, N, K, blocks) for R, N, K, _ in ALL_CASES for blocks in ("wide", "narrow")}
        assert {n for n, _ in tiles} == {1, 4, 8, 16}, tiles
        w = torch.randn(10, 96, generator=g).to(torch.bfloat16)
        for xs in (torch.randn(4, 2 * 96, generator=g).to(torch.bfloat16)[:, ::2],  # strided columns: copied
                   torch.randn(4, 96 + 7, generator=g).to(torch.bfloat16)[:, :96]):  # rows read through their stride
            assert ((fp32_linear_triton(xs, w) - fp32_linear_torch(xs, w)).abs() <= 1e-4).all()
        grid = lambda t: ((t * 4).round() / 4).to(torch.bfloat16)  # quarters: every sum exact in fp32
        x, w = grid(torch.randn(2, 512, generator=g)), grid(torch.randn(12, 512, generator=g))
        assert torch.equal(fp32_linear_triton(x, w), fp32_linear_torch(x, w))
        print("ok")
    """, CASES=cases, ALL_CASES=_FP32_LINEAR_CASES)

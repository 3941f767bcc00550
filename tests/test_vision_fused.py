"""The ViT's fused launches (dsv4/ops/vision_fused.py) under TRITON_INTERPRET=1 (the CPU interpreter; each check runs
in a subprocess because the flag is read when kernels are defined), and the tower that uses them.

What is exact and what is bounded:
- the q/k rope is bit-identical to `apply_vision_rope` (every product rounded on its own, RNE casts), any input;
- silu(gate) * up is bit-identical to dsv4/ops/swiglu.py's kernel with an infinite clamp (the same formula, torch's
  CUDA one); against the CPU's `F.silu(gate) * up` the only difference is the CPU's silu itself (vectorised
  differently, 4 fp32 ulps measured): fp32 within 8 ulps (that, and the product's own rounding, with room for another
  CPU's exp); bf16 within 2 ulps, since the fp32 difference can move only silu's bf16 rounding, by one ulp, which
  moves the bf16 product by at most 2 ulps (one ulp is 2^-8..2^-7 relative) - identical in practice (0 of 200,000
  silu values differed, and nearly all elements here must be identical);
- the residual add is exact; its norm is bit-identical to the RMSNorm kernel on that sum (the same tile, the same
  order of the fp32 sum), and against the CPU's torch norm bit-identical on grid inputs (an exact sum of squares in
  any order) and within rmsnorm.py's bound otherwise (tests/rmsnorm_checks.py);
- a tiny tower with the fused launches forced on equals the unfused one: in fp32 to 1e-5 (a few-ulp silu and norm
  differences through two blocks); in bf16 to within the unfused bf16 tower's own distance from the fp32 tower.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_kernels_interpret import _interpret, _tiers

from dsv4.models.vision import VisionConfig, VisionTower
from dsv4.ops import vision_fused as vf

_PRELUDE = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import torch
from rmsnorm_checks import check_close, grid, ulps
from dsv4.ops import vision_fused as vf

def bits(t):  # compare bit patterns: torch.equal takes -0.0 == 0.0
    return t.contiguous().view({{torch.float32: torch.int32, torch.bfloat16: torch.int16}}[t.dtype])
"""
ROWS = (1, 7, 33, 130)


def test_qk_rope_bit_identical() -> None:
    _interpret(_PRELUDE + f"""
from dsv4.models.vision import vision_positions, vision_rope
g = torch.Generator().manual_seed(0)
for n in {ROWS}:
    for heads, head_dim in ((2, 8), (3, 12), (2, 64)):  # 12: a half of 6 (not a power of two); 64: the released
        hidden = heads * head_dim
        pos = vision_positions([(n, 1)]) if n % 2 else torch.randint(0, 80, (n, 2), generator=g)
        cos, sin = vision_rope(pos, head_dim, 10000.0)
        for dtype in (torch.float32, torch.bfloat16):
            big = (torch.randn(n, 3 * hidden + 5, generator=g) * 4).to(dtype)
            big[n // 2] = 0  # a row of zeros
            for qkv in (big[:, :3 * hidden].contiguous(), big[:, 5:]):  # contiguous rows, and strided rows
                ref = vf.vision_qk_rope_torch(qkv, cos, sin, heads, head_dim)
                got = vf.vision_qk_rope_triton(qkv, cos, sin, heads, head_dim)
                for name, r, o in zip("qkv", ref, got):
                    assert o.dtype == dtype and o.shape == (n, heads, head_dim), (name, o.dtype, o.shape)
                    assert torch.equal(bits(r), bits(o)), (name, n, heads, head_dim, dtype, (r - o).abs().max())
                q, k, v = got
                assert q.is_contiguous() and k.is_contiguous()
                assert v.data_ptr() == qkv[:, 2 * hidden:].data_ptr()  # v: a view of qkv, no copy
# empty input
q, k, v = vf.vision_qk_rope_triton(torch.zeros(0, 48), torch.zeros(0, 4), torch.zeros(0, 4), 2, 8)
assert q.shape == k.shape == v.shape == (0, 2, 8)
print("ok")
""")


def test_silu_mul() -> None:
    _interpret(_PRELUDE + f"""
import torch.nn.functional as F
from dsv4.ops.swiglu import swiglu_triton
g = torch.Generator().manual_seed(1)
worst = {{}}
for n in {ROWS}:
    for I in (5, 64) + ((1100,) if n < 33 else ()):  # 1100: two blocks of 1024 columns, the second partial
        for dtype in (torch.float32, torch.bfloat16):
            big = (torch.randn(n, 2 * I + 3, generator=g) * 6).to(dtype)
            big[n // 2] = 0
            big[-1, :I] = torch.linspace(-90, 90, I)  # silu's tails: exp overflowing to inf, and to 0
            for x in (big[:, :2 * I].contiguous(), big[:, 3:])[: 2 if I == 64 else 1]:  # strided rows once
                got = vf.silu_mul_triton(x)
                assert got.dtype == dtype and got.shape == (n, I) and got.is_contiguous()
                if n < 130:  # the same formula as swiglu.py's kernel (clamps at +-inf: none): bit-identical
                    same = swiglu_triton(x[:, :I], x[:, I:], float("inf"), fp32=False)  # (a program a row: slow)
                    assert torch.equal(bits(same), bits(got)), (n, I, dtype)
                ref = F.silu(x[:, :I]) * x[:, I:]
                d = int(ulps(ref, got).max())
                worst[dtype] = max(worst.get(dtype, 0), d)
                assert d <= (8 if dtype == torch.float32 else 2), (n, I, dtype, d)
                if dtype == torch.bfloat16:
                    assert (ref == got).float().mean() > 0.999, (n, I)
assert vf.silu_mul_triton(torch.zeros(0, 8)).shape == (0, 4)
print("worst ulps vs F.silu * up:", worst)
print("ok")
""")


# (n, D, dtype): 1024 the released width; 9000 two chunks of the norm's 8192 columns (the interpreter is slow on
# wide rows: on fewer rows)
_ADD_NORM_CASES = [(n, D, dtype) for n in ROWS
                   for D in (16, 64) + ((1024,) if n < 130 else ()) + ((9000,) if n < 33 else ())
                   for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("cases", _tiers(_ADD_NORM_CASES, [(7, 64, torch.bfloat16), (1, 9000, torch.float32)]))
def test_add_rms_norm(cases: list) -> None:
    """The main tier runs 7 rows of 64 in bf16 (contiguous and strided) and one fp32 row of 9000 (two chunks), the
    slow tier the other cases."""
    _interpret(_PRELUDE + """
from dsv4.models.layers.norm import rms_norm_torch
from dsv4.ops.rmsnorm import rms_norm_triton
g = torch.Generator().manual_seed(2)
for n, D, dtype in CASES:
    w = 1 + 0.2 * torch.randn(D, generator=g)  # the ViT's fp32 norm weight
    for kind in ("grid", "gauss"):
        if kind == "grid":  # multiples of 1/8: the sum of squares is exact in any order
            x, y = grid((n, D), g).to(dtype), grid((n, D), g).to(dtype)
        else:
            x, y = ((torch.randn(n, D, generator=g) * 3).to(dtype) for _ in range(2))
        x[n // 2] = 0
        y[-1] = -x[-1]  # a residual of zeros: its norm is 0
        if n > 2:
            y[1] = 0  # x + 0
        wide = torch.zeros(n, D + 3, dtype=dtype)
        wide[:, 3:] = x
        for xin in (x, wide[:, 3:])[: 2 if D == 64 else 1]:  # contiguous rows, and strided rows once
            h, out = vf.add_rms_norm_triton(xin, y, w, 1e-6)
            assert h.dtype == out.dtype == dtype and h.shape == out.shape == (n, D)
            ref_h, ref = vf.add_rms_norm_torch(xin, y, w, 1e-6)
            assert torch.equal(bits(ref_h), bits(h)), (n, D, dtype)
            # what the unfused tower runs on CUDA: the add, then the RMSNorm kernel: always bit-identical
            assert torch.equal(bits(rms_norm_triton(ref_h, w, 1e-6)), bits(out)), (n, D, dtype, kind)
            assert not out[-1].any()
            if kind == "grid":
                assert torch.equal(bits(ref), bits(out)), (n, D, dtype, int(ulps(ref, out).max()))
            else:
                check_close("weighted", dtype, ref, out, n)
print("ok")
""", CASES=cases)


def test_tower_fused_equals_unfused() -> None:
    """A tiny tower (head_dim 64, I not a multiple of the blocks, three images) with the fused launches forced on
    (interpreted) against the unfused tower. Both norm paths are compared: the unfused tower as the CPU runs it
    (torch norm) and as CUDA runs it (the RMSNorm kernel), which in bf16 the fused one must equal up to silu's
    CPU-only ulps."""
    _interpret(_PRELUDE + """
import contextlib
from dsv4.models.layers import norm as norm_mod
from dsv4.models.vision import VisionConfig, VisionTower, cu_seqlens_of, vision_positions, vision_rope
from dsv4.ops.rmsnorm import rms_norm_triton

cfg = VisionConfig(hidden_size=128, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                   patch_size=14, max_image_tokens=64, min_pixels=7056)
grids = [(3, 4), (2, 5), (1, 1)]
g = torch.Generator().manual_seed(3)
tower = VisionTower(cfg)
with torch.no_grad():
    for name, p in tower.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
patches = torch.rand(sum(h * w for h, w in grids), cfg.patch_dim, generator=g) * 2 - 1
pos = vision_positions(grids)
cos, sin = vision_rope(pos, cfg.head_dim, cfg.rope_theta)
cu = cu_seqlens_of(grids)
calls = {}

def counted(name, fn):
    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapper

@contextlib.contextmanager
def patched(fused, kernel_norm):
    saved = (vf.use_fused, vf.vision_qk_rope, vf.silu_mul, vf.add_rms_norm, norm_mod.rms_norm)
    if fused:  # the CUDA dispatch, on the CPU: every fused function is its Triton version
        vf.use_fused = lambda x: True
        vf.vision_qk_rope = counted("rope", vf.vision_qk_rope_triton)
        vf.silu_mul = counted("silu", vf.silu_mul_triton)
        vf.add_rms_norm = counted("add_norm", vf.add_rms_norm_triton)
    if kernel_norm:
        norm_mod.rms_norm = rms_norm_triton
    try:
        yield
    finally:
        vf.use_fused, vf.vision_qk_rope, vf.silu_mul, vf.add_rms_norm, norm_mod.rms_norm = saved

def run(dtype, fused, kernel_norm):
    t = VisionTower(cfg)
    t.load_state_dict(tower.state_dict())
    for name, p in t.named_parameters():
        p.data = p.data.to(torch.float32 if "norm" in name else dtype)
    with patched(fused, kernel_norm), torch.no_grad():
        return t.forward_packed(patches, cos, sin, cu)

exact = run(torch.float32, False, False).double()  # the reference of the bf16 towers' rounding error
for dtype in (torch.float32, torch.bfloat16):
    fused = run(dtype, True, True)
    assert calls == {"rope": 2, "silu": 2, "add_norm": 4}, calls  # per block: one rope, one SwiGLU, two add+norms
    calls.clear()
    assert fused.dtype == dtype and fused.shape == (patches.shape[0], cfg.hidden_size)
    cpu, cuda_like = run(dtype, False, False), run(dtype, False, True)
    assert calls == {}
    d_cpu = (fused.double() - cpu.double()).abs().max().item()
    d_cuda = (fused.double() - cuda_like.double()).abs().max().item()
    own = (cpu.double() - exact).abs().max().item()  # the unfused bf16 tower's own rounding error (0 for fp32)
    print(dtype, "fused vs unfused (torch norm)", d_cpu, "(kernel norm)", d_cuda, "unfused vs fp32", own)
    if dtype == torch.float32:
        assert d_cpu <= 1e-5 and d_cuda <= 1e-5, (d_cpu, d_cuda)
    else:
        assert d_cpu <= own and d_cuda <= own, (d_cpu, d_cuda, own)
        assert (fused == cuda_like).float().mean() > 0.99
print("ok")
""")


def test_cpu_tower_runs_the_torch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA the fused functions are never called, whatever the switch says."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a fused vision launch on the CPU")
    for name in ("vision_qk_rope", "silu_mul", "add_rms_norm"):
        monkeypatch.setattr(vf, name, refuse)
    monkeypatch.setattr(vf, "VISION_FUSED", True)
    cfg = VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)
    assert not vf.use_fused(torch.zeros(1))
    out = VisionTower(cfg)(torch.rand(6, cfg.patch_dim), [(2, 3)])
    assert out.shape == (6, 32)


def test_switch_is_read_from_the_environment() -> None:
    """On by default; DSV4_VISION_FUSED=0 (read at import) turns it off."""
    if "DSV4_VISION_FUSED" not in os.environ:
        assert vf.VISION_FUSED
    code = "from dsv4.ops import vision_fused as vf; print(vf.VISION_FUSED)"
    env = {**os.environ, "DSV4_VISION_FUSED": "0"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0 and res.stdout.strip() == "False", (res.stdout, res.stderr[-2000:])

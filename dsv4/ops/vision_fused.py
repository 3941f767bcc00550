"""The V4.1 ViT's elementwise work as three Triton launches a block (dsv4/models/vision.py), on CUDA only.

Per block the torch code runs ~20 small kernels around its GEMMs and attention: the 2D rope of q and of k (fp32 copies,
four products, a subtraction and an addition, a cat, the cast back), silu(gate) * up (two kernels after the chunk)
and two residual adds before their RMSNorms. At the released shape (one 1024x768 image, 4,608 graph rows, 32 blocks)
those took ~8.6 ms of the tower's 21.4 ms of kernels on an H100. Here:

- `vision_qk_rope`: one launch reads q and k out of the wqkv output and writes both roped (NeoX half-split rotation
  over the whole head, `apply_vision_rope`) as contiguous [n, heads, head_dim]; v stays the view attention takes.
- `silu_mul`: silu(gate) * up of the w1 output [n, 2I] -> [n, I] in one launch.
- `add_rms_norm`: the residual add and the RMSNorm after it in one launch, returning both the new residual and its
  norm (norm2 after the attention's add; the next block's norm1, or the tower's final norm, after the MLP's add).

Exactness, against the torch ops they replace on CUDA:
- the rope rounds each fp32 product on its own (`mul.rn`, never contracted into an FMA with the add) and rounds the
  sums to nearest-even: bit-identical to `apply_vision_rope` on any device.
- silu is torch's CUDA formula, x / (1 + expf(-x)) with libdevice's accurate expf and an IEEE division, rounded to
  the activation dtype before the product (F.silu's output), the product rounded once: torch's CUDA bits. Under the
  interpreter (CPU tests) the reference is the CPU's vectorised silu, whose fp32 result differs by a few ulps
  (4 measured); the bf16 results matched there.
- the residual is rounded to the activation dtype before it is normed, as `x = x + y; norm(x)` does, and the norm is
  dsv4/ops/rmsnorm.py's weighted flavour through its jit helpers over the same [ROWS, BLOCK] tile and warps
  (`norm_tile`), so the statistic's fp32 sum runs in the order of the RMSNorm kernel: bit-identical to the add
  followed by that kernel (which is what the unfused tower runs on CUDA); against the CPU's torch norm, the bound of
  rmsnorm.py's docstring.

`DSV4_VISION_FUSED=0` keeps the torch code on CUDA (comparisons); off CUDA the tower always runs the torch code.
Every launch takes its shapes from tensor shapes alone (no host read of device values): safe under the encoder's
CUDA-graph capture (dsv4/runtime/encoder_cudagraphs.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dsv4.models.layers.norm import rms_norm_torch
from dsv4.ops.rmsnorm import MODE_WEIGHTED, norm_tile

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch references
    triton = None

# Read once at import, like every DSV4_* switch; tests (and benchmarks) may set VISION_FUSED directly.
VISION_FUSED = os.environ.get("DSV4_VISION_FUSED", "1") != "0"
_ELEMS = 2048  # elements a program of the rope and SwiGLU launches handles (rows x block)


def use_fused(x: torch.Tensor) -> bool:
    """Whether the ViT runs the fused launches on activations like x: on CUDA with triton, unless
    DSV4_VISION_FUSED=0. Read per call (not at import), so flipping VISION_FUSED takes effect at once."""
    return VISION_FUSED and triton is not None and x.is_cuda


# ---- torch references (the unfused tower's exact ops) ---------------------------------------------------------
def vision_qk_rope_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                         head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused attention's prologue: qkv [n, 3 * heads * head_dim] -> q, k roped by `apply_vision_rope`, v as a
    view, each [n, heads, head_dim]; cos / sin [n, head_dim / 2] fp32."""
    from dsv4.models.vision import apply_vision_rope  # lazy: dsv4.models.vision imports this module

    n = qkv.shape[0]
    q, k, v = (t.reshape(n, num_heads, head_dim) for t in qkv.chunk(3, dim=-1))
    return apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin), v


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] = [gate | up] -> silu(gate) * up [n, I], each op in the input's dtype (the unfused MLP's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rms_norm_torch(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + y (rounded to x's dtype) and the weighted RMSNorm of h (`rms_norm_torch`, fp32 weight)."""
    h = x + y
    return h, rms_norm_torch(h, weight, eps)


# ---- kernels ---------------------------------------------------------------------------------------------------
if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne, rms_apply, rms_factor
    from dsv4.ops.rope import _mul_rn

    @triton.jit
    def _qk_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, n, qkv_stride, cos_stride, sin_stride,
                        HIDDEN: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                        INTERPRET: tl.constexpr):
        # program (row block, part): part 0 ropes q (qkv channels [0, HIDDEN)), part 1 k ([HIDDEN, 2 HIDDEN)), into
        # out[part] ([2, n, HIDDEN]). A row's HIDDEN / 2 rotation pairs are flattened: pair j = (head j // HALF,
        # i = j % HALF), x1 = channel i of the head, x2 = channel HALF + i, both turned by angle i (cos / sin col i).
        part = tl.program_id(1)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        j = tl.arange(0, BLOCK)
        i = j % HALF
        col = (j // HALF) * (2 * HALF) + i  # x1's channel in the head-major row
        m = (rows < n)[:, None] & (j < HIDDEN // 2)[None, :]
        src = qkv_ptr + rows[:, None] * qkv_stride + part * HIDDEN + col[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + rows[:, None] * cos_stride + i[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + rows[:, None] * sin_stride + i[None, :], mask=m, other=0.0).to(tl.float32)
        # apply_vision_rope: (x1 c - x2 s, x2 c + x1 s) in fp32, every product rounded before the add (mul.rn)
        o1 = _mul_rn(x1, c, INTERPRET) - _mul_rn(x2, s, INTERPRET)
        o2 = _mul_rn(x2, c, INTERPRET) + _mul_rn(x1, s, INTERPRET)
        dt = out_ptr.dtype.element_ty
        dst = out_ptr + (part.to(tl.int64) * n + rows[:, None]) * HIDDEN + col[None, :]
        tl.store(dst, cast_rne(o1, dt, INTERPRET), mask=m)
        tl.store(dst + HALF, cast_rne(o2, dt, INTERPRET), mask=m)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n, I, x_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         INTERPRET: tl.constexpr):
        # a [ROWS, BLOCK] tile of the output [n, I]: gate at x's columns [0, I), up at [I, 2I)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = (rows < n)[:, None] & (cols < I)[None, :]
        src = x_ptr + rows[:, None] * x_stride + cols[None, :]
        g = tl.load(src, mask=m, other=0.0).to(tl.float32)
        u = tl.load(src + I, mask=m, other=0.0).to(tl.float32)
        if INTERPRET:  # no libdevice in the interpreter
            e = tl.exp(-g)
        else:  # torch's CUDA silu calls expf: libdevice's __nv_expf, not tl.exp's fast exp2 path
            e = libdevice.exp(-g)
        dt = out_ptr.dtype.element_ty
        # F.silu's output (rounded to dt), then the product in fp32 rounded once: what `F.silu(gate) * up` rounds
        s = cast_rne(tl.math.div_rn(g, 1.0 + e), dt, INTERPRET).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * I + cols[None, :], cast_rne(s * u, dt, INTERPRET), mask=m)

    @triton.jit
    def _residual(xrow, yrow, cols, m, dt: tl.constexpr, INTERPRET: tl.constexpr):
        """x + y rounded to dt (`x + y` in torch), as fp32."""
        x = tl.load(xrow + cols, mask=m, other=0.0).to(tl.float32)
        y = tl.load(yrow + cols, mask=m, other=0.0).to(tl.float32)
        return cast_rne(x + y, dt, INTERPRET).to(tl.float32)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, out_ptr, n_rows, x_stride, y_stride, eps, inv_d,
                             D: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                             INTERPRET: tl.constexpr):
        eps = tl.cast(eps, tl.float32)  # torch.compile hands float arguments over as fp64
        inv_d = tl.cast(inv_d, tl.float32)
        # one program = ROWS rows x D channels, the tile of _rms_norm_kernel (norm_tile): the statistic's fp32 sum
        # runs over the same [ROWS, BLOCK] accumulator in the same column order, so its bits are that kernel's
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        r64 = rows.to(tl.int64)[:, None]
        xrow = x_ptr + r64 * x_stride
        yrow = y_ptr + r64 * y_stride
        dt = h_ptr.dtype.element_ty
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for c0 in range(0, D, BLOCK):  # as rms_row_factors, on the rounded residual
            cols = c0 + tl.arange(0, BLOCK)
            m = rmask[:, None] & (cols < D)[None, :]
            h = _residual(xrow, yrow, cols[None, :], m, dt, INTERPRET)
            acc += h * h  # the launch disables FMA fusion: h^2 is rounded before the add, as in torch
        r = rms_factor(tl.sum(acc, axis=1), D, inv_d, eps, INTERPRET)[:, None]
        # second pass as rms_store_cols: the residual recomputed from x and y (not read back from h_ptr, which other
        # threads of the program wrote: that would need a barrier), stored, and normed
        for c0 in range(0, D, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            cmask = cols < D
            m = rmask[:, None] & cmask[None, :]
            h = _residual(xrow, yrow, cols[None, :], m, dt, INTERPRET)
            tl.store(h_ptr + r64 * D + cols[None, :], h.to(dt), mask=m)  # h holds dt values: an exact cast
            y = rms_apply(h, r, w_ptr, cols[None, :], cmask[None, :], MODE, dt, dt, INTERPRET)
            tl.store(out_ptr + r64 * D + cols[None, :], cast_rne(y, dt, INTERPRET), mask=m)


def vision_qk_rope_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                          head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`vision_qk_rope_torch` with q and k roped in one launch (into one [2, n, heads, head_dim] buffer: two
    contiguous tensors); v is the same view of qkv."""
    assert triton is not None, "triton is not installed"
    n, hidden, half = qkv.shape[0], num_heads * head_dim, head_dim // 2
    assert qkv.dim() == 2 and qkv.shape[1] == 3 * hidden and head_dim % 2 == 0, (qkv.shape, num_heads, head_dim)
    assert cos.shape == sin.shape == (n, half), (cos.shape, sin.shape, n, half)
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(2, n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n:
        # fp32 tables with unit column stride (vision_rope's already are: no copy)
        cos, sin = (t if t.dtype == torch.float32 and t.stride(1) == 1 else t.float().contiguous() for t in (cos, sin))
        block = triton.next_power_of_2(hidden // 2)  # a program holds whole rows' pairs
        rows = max(1, _ELEMS // block)
        _qk_rope_kernel[(triton.cdiv(n, rows), 2)](
            qkv, cos, sin, out, n, qkv.stride(0), cos.stride(0), sin.stride(0), HIDDEN=hidden, HALF=half, ROWS=rows,
            BLOCK=block, INTERPRET=INTERPRET, enable_fp_fusion=False)
    return out[0], out[1], qkv[:, 2 * hidden:].reshape(n, num_heads, head_dim)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_torch` in one launch. (dsv4/ops/swiglu.py's kernel clamps gate and up to a limit, which with an
    infinite limit changes NaNs, and takes the halves as two tensors; this one reads the [gate | up] rows as they
    come out of w1.)"""
    assert triton is not None, "triton is not installed"
    n, two_i = gate_up.shape
    assert two_i % 2 == 0, gate_up.shape
    I = two_i // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(n, I, dtype=gate_up.dtype, device=gate_up.device)
    if n and I:
        block = min(1024, triton.next_power_of_2(I))  # a row in blocks of up to 1024, rows packed up to _ELEMS
        rows = max(1, _ELEMS // block)
        _silu_mul_kernel[(triton.cdiv(n, rows), triton.cdiv(I, block))](
            gate_up, out, n, I, gate_up.stride(0), ROWS=rows, BLOCK=block, INTERPRET=INTERPRET,
            enable_fp_fusion=False)
    return out


def add_rms_norm_triton(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_torch` in one launch: x, y [n, D] of one dtype (rows may be strided), weight [D] (the ViT's
    fp32 norm weight) -> (x + y, its norm), fresh contiguous tensors in x's dtype."""
    assert triton is not None, "triton is not installed"
    assert x.dim() == 2 and x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
    n, D = x.shape
    x, y = (t if t.stride(1) == 1 else t.contiguous() for t in (x, y))
    h = torch.empty(n, D, dtype=x.dtype, device=x.device)
    out = torch.empty_like(h)
    if n and D:
        block, rows, num_warps = norm_tile(D)  # the RMSNorm launch's tile and warps: its summation order
        _add_rms_norm_kernel[(triton.cdiv(n, rows),)](
            x, y, weight.contiguous(), h, out, n, x.stride(0), y.stride(0), eps, 1.0 / D, D=D, MODE=MODE_WEIGHTED,
            ROWS=rows, BLOCK=block, INTERPRET=INTERPRET, num_warps=num_warps, enable_fp_fusion=False)
    return h, out


# ---- dispatch ----------------------------------------------------------------------------------------------------
def vision_qk_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton on CUDA, torch elsewhere."""
    if qkv.is_cuda and triton is not None:
        return vision_qk_rope_triton(qkv, cos, sin, num_heads, head_dim)
    return vision_qk_rope_torch(qkv, cos, sin, num_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if gate_up.is_cuda and triton is not None:
        return silu_mul_triton(gate_up)
    return silu_mul_torch(gate_up)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None:
        return add_rms_norm_triton(x, y, weight, eps)
    return add_rms_norm_torch(x, y, weight, eps)

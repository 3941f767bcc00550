"""The ViT's fused launches (dsv4/ops/vision_fused.py) on the GPU at the released shape: one 1024x768 image (74 x 55 =
4,070 patches) in the encoder graphs' 4,608-row buffer, hidden 1024, 16 heads of 64, SwiGLU 2816, bf16.

Each launch gives the bits of the CUDA ops it replaces: the q/k rope those of `apply_vision_rope`, silu(gate) * up
those of `F.silu(gate) * up` (torch's CUDA silu formula), the residual add those of `x + y` and its norm those of the
RMSNorm kernel (the same tile, so the same order of the statistic's sum; against the torch norm, rmsnorm.py's bound).
The released tower (random weights) with the launches equals the tower with DSV4_VISION_FUSED=0 within the encoder
graphs' tolerance (tests/gpu/test_encoder_cudagraphs_gpu.py: 2e-2) - bit for bit, as every launch is; a CUDA-graph
capture of the fused tower replays its eager run exactly, and the fused forward never waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from rmsnorm_checks import check_close, ulps

from dsv4.models.layers.norm import rms_norm_torch
from dsv4.models.vision import VisionConfig, VisionTower, vision_param_dtype, vision_positions, vision_rope
from dsv4.ops import vision_fused as vf
from dsv4.ops.rmsnorm import rms_norm_triton

CFG = VisionConfig()  # the released tower
N, HIDDEN, HEADS, HEAD_DIM, INTER = 4608, CFG.hidden_size, CFG.num_attention_heads, CFG.head_dim, CFG.intermediate_size
GRID = (74, 55)  # 4,070 patches: a 1024x768 image
REAL = GRID[0] * GRID[1]
TOL = 2e-2  # the encoder graphs' tolerance against eager (bf16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (torch.equal takes -0.0 == 0.0)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _rope_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of the image's positions, padded to N rows with position (0, 0) (the graph buffer's zero padding)."""
    pos = torch.zeros(N, 2, dtype=torch.int64)
    pos[:REAL] = vision_positions([GRID])
    return vision_rope(pos.cuda(), HEAD_DIM, CFG.rope_theta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_rope_bits(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = (torch.randn(N, 3 * HIDDEN, device="cuda", generator=g) * 4).to(dtype)
    qkv[REAL:] = 0
    cos, sin = _rope_tables()
    ref = vf.vision_qk_rope_torch(qkv, cos, sin, HEADS, HEAD_DIM)
    got = vf.vision_qk_rope(qkv, cos, sin, HEADS, HEAD_DIM)  # the dispatcher takes the kernel on CUDA
    for name, r, o in zip("qkv", ref, got):
        assert o.dtype == dtype and o.shape == (N, HEADS, HEAD_DIM)
        assert torch.equal(_bits(r), _bits(o)), (name, (r.float() - o.float()).abs().max())
    assert got[0].is_contiguous() and got[1].is_contiguous() and got[2].data_ptr() == qkv[:, 2 * HIDDEN:].data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_bits(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(N, 2 * INTER, device="cuda", generator=g) * 6).to(dtype)
    x[-1, :INTER] = torch.linspace(-90, 90, INTER)  # silu's tails
    x[REAL:-1] = 0
    ref, got = vf.silu_mul_torch(x), vf.silu_mul(x)
    assert got.dtype == dtype and got.shape == (N, INTER)
    assert torch.equal(_bits(ref), _bits(got)), int(ulps(ref, got).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_bits(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    x, y = ((torch.randn(N, HIDDEN, device="cuda", generator=g) * 3).to(dtype) for _ in range(2))
    y[-1] = -x[-1]  # a zero residual
    w = 1 + 0.2 * torch.randn(HIDDEN, device="cuda", generator=g)  # fp32, as the ViT's norms keep it
    h, out = vf.add_rms_norm(x, y, w, CFG.rms_norm_eps)
    assert h.dtype == out.dtype == dtype and h.shape == out.shape == (N, HIDDEN)
    assert torch.equal(_bits(x + y), _bits(h))
    # the unfused tower on CUDA: the add, then the RMSNorm kernel
    assert torch.equal(_bits(rms_norm_triton(x + y, w, CFG.rms_norm_eps)), _bits(out))
    check_close("weighted", dtype, rms_norm_torch(x + y, w, CFG.rms_norm_eps), out, N)
    assert not out[-1].any()


@pytest.fixture(scope="module")
def tower() -> VisionTower:
    """The released tower in bf16 (norm weights fp32, as shipped) with random weights scaled so that activations
    stay O(1) through 32 blocks: std 0.8 / sqrt(fan-in), biases 0.1, norms 1 +- 0.2."""
    with torch.device("cuda"):
        t = VisionTower(CFG)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in t.named_parameters():
            noise = torch.randn(p.shape, device="cuda", generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else noise * (0.8 / p.shape[1] ** 0.5 if p.dim() == 2 else 0.1))
            p.data = p.data.to(vision_param_dtype(f"vision.{name}", torch.bfloat16))
    return t.eval()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Calls of each fused function while the test runs."""
    calls: dict[str, int] = {}

    def count(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper
    for name in ("vision_qk_rope", "silu_mul", "add_rms_norm"):
        monkeypatch.setattr(vf, name, count(name, getattr(vf, name)))
    yield calls


def _inputs(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    patches = torch.zeros(N, CFG.patch_dim, device="cuda")
    patches[:REAL] = torch.rand(REAL, CFG.patch_dim, device="cuda", generator=g) * 2 - 1
    return patches


def _run(tower: VisionTower, patches: torch.Tensor, cu: torch.Tensor, fused: bool,
         monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(vf, "VISION_FUSED", fused)  # what DSV4_VISION_FUSED sets at import
    cos, sin = (t[: patches.shape[0]] for t in _rope_tables())
    with torch.inference_mode():
        return tower.forward_packed(patches, cos, sin, cu)


def test_tower_fused_equals_unfused(tower: VisionTower, counted: dict[str, int],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager (per-image SDPA over the 4,070 real rows) and the graph layout (4,608 rows, cu_seqlens on the device:
    the varlen kernel; the padding rows are computed too)."""
    patches = _inputs(1)
    for rows, cu in ((REAL, torch.tensor([0, REAL], dtype=torch.int32)),
                     (N, torch.tensor([0, REAL], dtype=torch.int32, device="cuda"))):
        counted.clear()
        unfused = _run(tower, patches[:rows], cu, False, monkeypatch)
        assert counted == {}
        fused = _run(tower, patches[:rows], cu, True, monkeypatch)
        blocks = CFG.num_hidden_layers
        assert counted == {"vision_qk_rope": blocks, "silu_mul": blocks, "add_rms_norm": 2 * blocks}, counted
        assert fused.dtype == torch.bfloat16 and fused.shape == (rows, HIDDEN) and fused.isfinite().all()
        torch.testing.assert_close(fused, unfused, rtol=TOL, atol=TOL)
        assert torch.equal(_bits(fused), _bits(unfused)), (rows, (fused.float() - unfused.float()).abs().max())


def test_graph_replay_equals_eager(tower: VisionTower, counted: dict[str, int],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """forward_packed with the fused launches captured in a CUDA graph (as EncoderCudaGraphManager captures it):
    replays on refilled buffers equal eager runs on them, and the eager forward never syncs with the host."""
    monkeypatch.setattr(vf, "VISION_FUSED", True)
    patches, cu = _inputs(2), torch.tensor([0, REAL], dtype=torch.int32, device="cuda")
    cos, sin = _rope_tables()
    with torch.inference_mode():
        for _ in range(2):  # compile the kernels and make lazy allocations outside the capture
            tower.forward_packed(patches, cos, sin, cu)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tower.forward_packed(patches, cos, sin, cu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = tower.forward_packed(patches, cos, sin, cu)
        assert counted["vision_qk_rope"] == 4 * CFG.num_hidden_layers  # the capture ran the fused path
        for seed, real in ((3, REAL), (4, 1000)):  # other pixels; then a smaller image in the same buffer
            patches.copy_(_inputs(seed))
            patches[real:] = 0
            cu.copy_(torch.tensor([0, real], dtype=torch.int32))
            graph.replay()
            eager = tower.forward_packed(patches, cos, sin, cu)
            torch.cuda.synchronize()
            assert torch.equal(_bits(static), _bits(eager)), seed

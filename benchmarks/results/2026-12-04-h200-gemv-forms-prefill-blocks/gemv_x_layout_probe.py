"""Probe: where the one-row FP8 gemv loses time (one GPU). The dense gemv of dsv4/ops/moe_quant.py loads its x tile
in one layout and converts it to the weight planes' layout through shared memory (STSM, LDS and four barriers a K
step, compiled for sm_90), which makes each step wait on the x load. Three forms of the same kernel (V4 blocks 128,
UE8M0 scales, bf16 x): MODE 0 the module's x load (`_load_x` + `_x_planes`), MODE 1 four strided bf16 loads a step,
one per plane, MODE 2 two strided int32 loads (two bf16 each) a step, split by bit operations; MODE 1 and 2 compile
to no barrier in the loop at 16 x 256 tiles. Times: CUDA-graph replays, weights rotated past L2; checked against the
dequantized weight in fp32.

usage: PYTHONPATH=. python3 benchmarks/gemv_x_layout_probe.py
"""
import sys
import itertools, math
import torch, triton, triton.language as tl, triton.testing
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight
from dsv4.ops.moe_quant import _load_weights, _load_scales, _multipliers, _planes, _load_x, _x_planes
from dsv4.ops.rmsnorm import cast_rne

@triton.jit
def _xw(xw_ptr, kg, lim, c2: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr):
    # x as int32 words (2 bf16 each); word (kg/2 + 2 w + c2) for w in [0, W)
    idx = (kg // 2)[:, None] + (tl.arange(0, W) * HALF)[None, :] + c2
    return tl.load(xw_ptr + idx, mask=idx < lim, other=0)

@triton.jit
def _lo(u):
    return (u << 16).to(tl.float32, bitcast=True)

@triton.jit
def _hi(u):
    return (u & -65536).to(tl.float32, bitcast=True)

@triton.jit
def gemv(x_ptr, w_ptr, s_ptr, out_ptr, N, K, KW, SK, BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr,
         G: tl.constexpr, SUB: tl.constexpr, MODE: tl.constexpr, PTX: tl.constexpr = True):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    VPW: tl.constexpr = 4
    W: tl.constexpr = SUB // VPW
    BLOCK_K: tl.constexpr = G * SUB
    kg = tl.arange(0, G) * SUB
    acc = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    for k0 in range(0, K, BLOCK_K):
        wq = _load_weights(w_ptr, n, nm, kg + k0, KW, KW, W, VPW)
        sq = _load_scales(s_ptr, n, nm, kg + k0, SK, K, BN, BK)
        sc = _multipliers(sq, False, True)
        w0, w1, w2, w3 = _planes(wq, False, PTX)
        if MODE == 0:
            xq = _load_x(x_ptr, kg + k0, K, W, VPW)
            x0, x1, x2, x3 = _x_planes(xq, G, W, VPW)
        elif MODE == 1:
            xk = (kg + k0)[:, None] + (tl.arange(0, W) * VPW)[None, :]
            x0 = tl.load(x_ptr + xk, mask=xk < K, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + xk + 1, mask=xk < K, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + xk + 2, mask=xk < K, other=0.0).to(tl.float32)
            x3 = tl.load(x_ptr + xk + 3, mask=xk < K, other=0.0).to(tl.float32)
        else:
            a = _xw(xw_ptr, kg + k0, K // 2, 0, W, 2)
            b = _xw(xw_ptr, kg + k0, K // 2, 1, W, 2)
            x0, x1, x2, x3 = _lo(a), _hi(a), _lo(b), _hi(b)
        part = w0 * x0[None, :, :]
        part += w1 * x1[None, :, :]
        part += w2 * x2[None, :, :]
        part += w3 * x3[None, :, :]
        acc += tl.sum(part, axis=2) * sc
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + n, y.to(tl.bfloat16), mask=nm)



SHAPES = {"v4.wq_b": (32768, 1024), "v4.wo_b": (4096, 8192), "v4.wq_a": (1024, 4096), "v4.shared_up": (2048, 4096)}


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':14s} {'tile':8s} {'mode':4s} {'us':>7s} {'GB/s':>6s} {'rel_err':>8s}")
    for name, (N, K) in SHAPES.items():
        w = QuantWeight(*quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, (128, 128)),
                        (128, 128))
        copies = max(1, min(64, math.ceil(180e6 / (N * K))))
        ws = [w] + [QuantWeight(w.data.clone(), w.scale.clone(), (128, 128)) for _ in range(copies - 1)]
        x = torch.randn(K, device="cuda", generator=g).to(torch.bfloat16)
        ref = w.dequantize(torch.float32) @ x.float()
        for (tn, tk), mode in itertools.product(((16, 256), (8, 512), (32, 256), (16, 512)), (0, 1, 2)):
            out = torch.empty(N, dtype=torch.bfloat16, device="cuda")

            def run(q: QuantWeight) -> None:
                gemv[(triton.cdiv(N, tn),)](x, q.data.view(torch.int32), q.scale, out, N, K, K // 4,
                                            q.scale.shape[-1], BN=128, BK=128, BLOCK_N=tn, G=tk // 16, SUB=16,
                                            MODE=mode, num_warps=4)
            run(w)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            it = itertools.cycle(ws)
            us = triton.testing.do_bench_cudagraph(lambda: run(next(it)), rep=10, return_mode="median") * 1e3
            print(f"{name:14s} {tn}x{tk:<5d} {mode:4d} {us:7.1f} {N * K / us * 1e-3:6.0f} {err:8.1e}", flush=True)


if __name__ == "__main__":
    main()

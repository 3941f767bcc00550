"""Forms of the one-row quantized gemv (dsv4.ops.moe_quant._expert_gemv_q_kernel) against the landed one, on one GPU.

Each form is the landed moe_quant.py with a source transformation (FORMS below), written to a temporary module and
imported, so the comparison is the one change alone:
- `base`: the landed kernel;
- `d2`: the weight words prefetched two K tiles ahead instead of one (ncu: long-scoreboard stalls are 10.3 of the
  16.5 cycles between a warp's issues on V4 wq_b: too few bytes in flight);
- `join8`: FP8 groups of 8 columns (8-byte word loads), the decoded planes joined back into column order and x
  loaded in the product's own 3-D shape, so no x tile goes through shared memory (sm_90 SASS: no LDS / STS / BAR in
  the loop, against 4 LDS + 2 STSM + 4 BAR; ncu: short-scoreboard and barrier stalls 2.7 of 9 cycles on wo_b), but
  6.3 instructions a weight against 4.6 (x loaded once per row, products summed as a tree);
- `xs8`: groups of 8 columns and x loaded as [1, G, 8], a group's 8 values in the thread that holds its weight
  words, split into the planes there: with block_k = 256 x warps (one group a thread) the loop has no shuffle and a
  thread keeps its x for all of its rows (sm_90: 4.1 instructions a weight at 8 x 1024, 56 registers, twice the
  weight bytes a thread has in flight); MXFP4 then loads one 4-byte word a row and group (5.5-5.8 a weight).
Times are triton.testing.do_bench_cudagraph medians over weight copies spanning > 3x L2 (HBM reads, as a decode
step), outputs checked against the torch reference first.

usage: PYTHONPATH=. python3 THIS [--forms base,d2,xs8] [--rep 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import tempfile

import torch
import triton
import triton.testing

from dsv4.ops import moe_quant
from dsv4.ops.fp8_linear import gemv_config
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight

L2 = 60e6


def _kernel_span(s: str) -> tuple[int, int]:
    a = s.index("    def _expert_gemv_q_kernel")
    return a, s.index("    @triton.jit", a)


def form_d2(s: str) -> str:
    a, b = _kernel_span(s)
    k = s[a:b]
    k = k.replace("        wq = _load_weights(wbase, n, nm, kg, KW, kw_end, W, VPW)\n",
                  "        wq = _load_weights(wbase, n, nm, kg, KW, kw_end, W, VPW)\n"
                  "        wq1 = _load_weights(wbase, n, nm, kg + BLOCK_K, KW, kw_end, W, VPW)\n")
    k = k.replace("wq_next = _load_weights(wbase, n, nm, kg + BLOCK_K,", "wq_next = _load_weights(wbase, n, nm, kg + 2 * BLOCK_K,")
    k = k.replace("wq, sq, xq, kg = wq_next, sq_next, xq_next, kg + BLOCK_K",
                  "wq, wq1, sq, xq, kg = wq1, wq_next, sq_next, xq_next, kg + BLOCK_K")
    assert k.count("wq1") == 3
    return s[:a] + k + s[b:]


def form_join8(s: str) -> str:
    a, b = _kernel_span(s)
    k = s[a:b]
    start = k.index("            if FP4:\n                w0, w1, w2, w3, w4, w5, w6, w7 = _planes(wq, FP4, PTX)")
    end = k.index("            part = tl.sum(part, axis=2)")
    k = k[:start] + """            if FP4:
                w0, w1, w2, w3, w4, w5, w6, w7 = _planes(wq, FP4, PTX)
                wt = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
            else:
                w0, w1, w2, w3 = _planes(wq, FP4, PTX)
                wt = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # (join adds the minor axis: plane = 2 i + o)
            wt = tl.reshape(wt, [BLOCK_N, G, SUB])
            xq = _load_x3(xrow, kg, k_end, SUB, BLOCK_N)
            sq = _load_scales(sbase, n, nm, kg, SK, k_end, BN, BK)
            sc = _multipliers(sq, FP4, UE8M0)
            part = _weight(wt, sc, ROUND_W, dt, INTERPRET) * xq
""" + k[end:]
    for old, new in (("        sq = _load_scales(sbase, n, nm, kg, SK, k_end, BN, BK)\n        xq = _load_x(xrow, kg, k_end, W, VPW)\n", ""),
                     ("            sq_next = _load_scales(sbase, n, nm, kg + BLOCK_K, SK, k_end, BN, BK)\n            xq_next = _load_x(xrow, kg + BLOCK_K, k_end, W, VPW)\n            sc = _multipliers(sq, FP4, UE8M0)\n", ""),
                     ("wq, sq, xq, kg = wq_next, sq_next, xq_next, kg + BLOCK_K", "wq, kg = wq_next, kg + BLOCK_K")):
        assert old in k, old[:60]
        k = k.replace(old, new)
    helper = '''    @triton.jit
    def _load_x3(xrow, kg, K, SUB: tl.constexpr, BLOCK_N: tl.constexpr):
        """x's columns kg + [0, SUB) per group, in the product's shape [BLOCK_N, G, SUB] (rows broadcast)."""
        xk = tl.zeros([BLOCK_N, 1, 1], dtype=tl.int32) + kg[None, :, None] + tl.arange(0, SUB)[None, None, :]
        return tl.load(xrow + xk, mask=xk < K, other=0.0).to(tl.float32)

'''
    s = s[:a] + k + s[b:]
    s = s.replace("    @triton.jit\n    def _expert_gemv_q_kernel", helper + "    @triton.jit\n    def _expert_gemv_q_kernel")
    # groups of 8 FP8 columns (two words), 16 MXFP4 (two words)
    s = s.replace("    sub = 32 if fp4 else min(bk, block_k, 16)", "    sub = 16 if fp4 else min(bk, block_k, 8)")
    return s


def form_xs8(s: str) -> str:
    """Groups of 8 columns (two FP8 words, one MXFP4 word), x loaded as [1, G, 8] (a group's 16 bytes in one thread, as its two weight words
    are) and split into planes inside the thread: the planes' FMA chain of the landed kernel, no x shuffle."""
    a, b = _kernel_span(s)
    k = s[a:b]
    for old, new in (("        xq = _load_x(xrow, kg, k_end, W, VPW)\n", "        xq = _load_x1(xrow, kg, k_end, SUB)\n"),
                     ("            xq_next = _load_x(xrow, kg + BLOCK_K, k_end, W, VPW)\n",
                      "            xq_next = _load_x1(xrow, kg + BLOCK_K, k_end, SUB)\n"),
                     ("                x0, x1, x2, x3 = _x_planes(xq, G, W, VPW)\n",
                      "                x0, x1, x2, x3 = _x_planes1(xq, G, W, VPW)\n"),
                     ("                x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(xq, G, W, VPW)\n",
                      "                x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes1(xq, G, W, VPW)\n"),
                     ("* x4[None, :, :]", "* x4"), ("* x5[None, :, :]", "* x5"), ("* x6[None, :, :]", "* x6"),
                     ("* x7[None, :, :]", "* x7"),
                     ("* x0[None, :, :]", "* x0"), ("* x1[None, :, :]", "* x1"), ("* x2[None, :, :]", "* x2"),
                     ("* x3[None, :, :]", "* x3")):
        assert old in k, old[:60]
        k = k.replace(old, new)
    helper = '''    @triton.jit
    def _load_x1(xrow, kg, K, SUB: tl.constexpr):
        xk = kg[None, :, None] + tl.arange(0, SUB)[None, None, :]
        # one mask per group (the dispatcher's K is a multiple of SUB), so the load stays a 16-byte vector
        return tl.load(xrow + xk, mask=(kg < K)[None, :, None], other=0.0).to(tl.float32)

    @triton.jit
    def _x_planes1(xv, G: tl.constexpr, W: tl.constexpr, VPW: tl.constexpr):
        if VPW == 8:
            x_0, x_1 = tl.split(tl.reshape(xv, [1, G, W, 2, 2, 2]))
            x00, x01 = tl.split(x_0)
            x10, x11 = tl.split(x_1)
            c0, c4 = tl.split(x00)
            c2, c6 = tl.split(x01)
            c1, c5 = tl.split(x10)
            c3, c7 = tl.split(x11)
            return c0, c1, c2, c3, c4, c5, c6, c7
        else:
            x_0, x_1 = tl.split(tl.reshape(xv, [1, G, W, 2, 2]))
            c0, c2 = tl.split(x_0)
            c1, c3 = tl.split(x_1)
            return c0, c1, c2, c3

'''
    s = s[:a] + k + s[b:]
    s = s.replace("    @triton.jit\n    def _expert_gemv_q_kernel", helper + "    @triton.jit\n    def _expert_gemv_q_kernel")
    return s.replace("    sub = 32 if fp4 else min(bk, block_k, 16)", "    sub = 8")


FORMS = {"base": lambda s: s, "d2": form_d2, "join8": form_join8, "xs8": form_xs8}


def load_form(name: str, tmp: str):
    src = FORMS[name](open(moe_quant.__file__).read())
    path = os.path.join(tmp, f"gemv_form_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"gemv_form_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# name: (N, K, groups); V4-Flash released FP8 blocks of 128
DENSE = {"wq_a": (1024, 4096, 1), "wkv": (512, 4096, 1), "wq_a+wkv": (1536, 4096, 1), "wq_b": (32768, 1024, 1),
         "wo_a": (8192, 4096, 8), "wo_b": (4096, 8192, 1), "shared_up": (2048, 4096, 1),
         "shared_gate+up": (4096, 4096, 1), "shared_down": (4096, 2048, 1)}
EXPERTS = {"gate_up": (4096, 4096), "down": (4096, 2048)}  # 6 routes of 16 MXFP4 experts
def _t(bn: int, bk: int, w: int) -> dict[str, int]:
    return dict(block_n=bn, block_k=bk, num_warps=w)


# tiles per form ({}: the landed choice, gemv_config / GEMV_Q_CONFIG); xs8's x tile holds a whole group per thread only
# when block_k = 256 x warps (G = 32 x warps groups of 8: one group a thread)
DENSE_TILES = {"base": ({}, _t(16, 256, 4), _t(8, 512, 4)), "d2": ({},), "join8": ({},),
               "xs8": (_t(8, 1024, 4), _t(16, 1024, 4), _t(4, 1024, 4), _t(8, 2048, 8), _t(16, 2048, 8))}
EXPERT_TILES = {"base": ({}, _t(16, 256, 4), _t(8, 1024, 4)), "d2": ({},), "join8": ({},),
                "xs8": (_t(8, 1024, 4), _t(16, 1024, 4), _t(8, 2048, 8))}


def _time(fn, rep: int) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forms", default="base,d2,xs8")
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    forms = {f: load_form(f, tmp) for f in args.forms.split(",")}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    for name, (N, K, G) in DENSE.items():
        w = QuantWeight(*quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, (128, 128)), (128, 128))
        copies = max(1, min(64, math.ceil(3 * L2 / (N * K))))
        ws = [w] + [QuantWeight(w.data.clone(), w.scale.clone(), w.block) for _ in range(copies - 1)]
        w3s = [QuantWeight(q.data.view(G, N // G, K), q.scale.view(G, -1, q.scale.shape[-1]), q.block) for q in ws]
        x = torch.randn(G, K, device="cuda", generator=g).to(torch.bfloat16)
        ref = torch.cat([x[i:i + 1].float() @ ws[0].dequantize(torch.float32)[i * (N // G):(i + 1) * (N // G)].t()
                         for i in range(G)], dim=1)
        floor = (N * K + ws[0].scale.numel()) / 4.2e12 * 1e6
        for f, mod in forms.items():
            for tile in DENSE_TILES[f]:
                cfg = tile or gemv_config(N, G, 128)
                label = f"{cfg['block_n']}x{cfg['block_k']}w{cfg['num_warps']}" + ("*" if not tile else "")
                _row(rows, name, f, label, floor, lambda c=cfg, m=mod, q=None: m.expert_gemv_q_triton(
                    x, w3s[0] if q is None else q, None, 1, c).view(1, N), ref, w3s, args.rep)
        del ws, w3s
        torch.cuda.empty_cache()
    for name, (N, K) in EXPERTS.items():
        E = 16
        data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=g)
        scale = torch.randint(112, 125, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g)
        w4 = QuantWeight(data, scale, (1, 32))
        copies = max(1, min(16, math.ceil(3 * L2 / (E * N * K // 2))))
        ws = [w4] + [QuantWeight(data.clone(), scale.clone(), (1, 32)) for _ in range(copies - 1)]
        x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randperm(E, device="cuda", generator=g)[:6]
        ref = moe_quant.expert_gemv_q_torch(x, w4, idx, 6).float()
        floor = 6 * (N * K // 2 + N * K // 32) / 4.2e12 * 1e6
        for f, mod in forms.items():
            for tile in EXPERT_TILES[f]:
                cfg = tile or moe_quant.GEMV_Q_CONFIG["fp4"]
                label = f"{cfg['block_n']}x{cfg['block_k']}w{cfg['num_warps']}" + ("*" if not tile else "")
                _row(rows, f"mxfp4.{name}", f, label, floor, lambda c=cfg, m=mod, q=None: m.expert_gemv_q_triton(
                    x, w4 if q is None else q, idx, 6, c), ref, ws, args.rep)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), fh, indent=1)


def _row(rows: list, shape: str, form: str, label: str, floor: float, fn, ref: torch.Tensor, weights: list,
         rep: int) -> None:
    """Check one (form, tile) against the reference, time it over the weight copies, print and record it."""
    try:
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"rel_err {err}"
        it = itertools.cycle(weights)
        us = _time(lambda: fn(q=next(it)), rep)
    except Exception as e:  # a form that does not compile at a tile: report it, measure the rest
        print(f"{shape:16s} {form:6s} {label:14s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        rows.append(dict(shape=shape, form=form, tile=label, error=str(e)[:500]))
        return
    rows.append(dict(shape=shape, form=form, tile=label, us=us, floor_us=floor, rel_err=err))
    print(f"{shape:16s} {form:6s} {label:14s} {us:8.1f} us  floor {floor:5.1f} ({floor / us:4.0%})  err {err:.1e}",
          flush=True)


if __name__ == "__main__":
    main()

"""The one-row quantized gemv (`dsv4.ops.moe_quant._expert_gemv_q_kernel`) over its tiles and loop forms, at the
shapes a batch-1 decode step runs it on (one GPU).

usage: PYTHONPATH=. python3 benchmarks/gemv_pipeline_sweep.py [--json PATH] [--rep MS] [--quick]

- dense FP8 at M = 1 (`fp8_gemv_triton`): the V4-Flash (blocks 128) and V4.1-Flash (blocks 32) linears of
  benchmarks/fp8_linear_bench.py;
- MXFP4 routed experts at T = 1 (6 routes) over 16 experts (the cut-down presets) and the release's 256 / 384, and
  T = 32 (192 routes) over the release's experts (the per-row gemv's case in the engine: routes <= experts).
Configs: block_n x block_k x num_warps x stages, where stages 1 is the register double buffer and S > 1 the loop the
compiler pipelines through shared memory (cp.async, S tiles in flight a program). Times are medians of CUDA-graph
replays (triton.testing.do_bench_cudagraph), the weights rotated over copies spanning > 3x the 60 MB L2 (dense) or
over 16 route sets (experts). GB/s counts the stored bytes read (weights + scales of the distinct experts, x, out);
floor% is those bytes over 4.2 TB/s against the time. Each config's output is checked against the default config's
(max relative difference; both sum the same fp32 products in another order). The last lines print the best config
per shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable

import torch
import triton
import triton.testing

from dsv4.ops import fp8_linear
from dsv4.ops.fp8_linear import fp8_gemv_triton
from dsv4.ops.moe_quant import GEMV_Q_CONFIG, expert_gemv_q_triton
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight

HBM_BPS, L2_BYTES, TOP_K, SETS = 4.2e12, 60e6, 6, 16
DENSE = {  # name: (N, K, groups, block), as benchmarks/fp8_linear_bench.py
    "v4.wq_a": (1024, 4096, 1, (128, 128)), "v4.wq_b": (32768, 1024, 1, (128, 128)),
    "v4.wo_a": (8192, 4096, 8, (128, 128)), "v4.wo_b": (4096, 8192, 1, (128, 128)),
    "v4.shared_up": (2048, 4096, 1, (128, 128)),
    "v41.wq_a": (1280, 5120, 1, (32, 32)), "v41.wq_b": (32768, 1280, 1, (32, 32)),
    "v41.wo_b": (5120, 8192, 1, (32, 32)), "v41.shared_up": (2304, 5120, 1, (32, 32)),
}
EXPERTS = {  # name: (E, N, K, T)
    "v4.gate_up.e16": (16, 4096, 4096, 1), "v4.down.e16": (16, 4096, 2048, 1),
    "v4.gate_up.e256": (256, 4096, 4096, 1), "v4.down.e256": (256, 4096, 2048, 1),
    "v41.gate_up.e16": (16, 4608, 5120, 1), "v41.down.e16": (16, 5120, 2304, 1),
    "v41.gate_up.e384": (384, 4608, 5120, 1), "v41.down.e384": (384, 5120, 2304, 1),
    "v4.gate_up.e256.t32": (256, 4096, 4096, 32), "v41.gate_up.e384.t32": (384, 4608, 5120, 32),
}
TILES = {"fp8": [(16, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 4), (32, 256, 4), (8, 256, 4)],
         "fp4": [(16, 512, 4), (8, 512, 4), (16, 1024, 4), (32, 512, 4), (8, 1024, 8), (16, 512, 8)]}
STAGES = (1, 2, 3, 4)


def _time_us(fn: Callable[[], object], rep_ms: int) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _configs(fmt: str, quick: bool) -> list[dict[str, int]]:
    tiles = TILES[fmt][:2] if quick else TILES[fmt]
    return [dict(block_n=bn, block_k=bk, num_warps=nw, stages=s) for (bn, bk, nw), s in itertools.product(tiles, STAGES)]


def sweep_dense(rep: int, quick: bool, rows: list[dict]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    default_config = fp8_linear.gemv_config
    for name, (N, K, G, block) in DENSE.items():
        w = QuantWeight(*quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, block), block)
        copies = max(1, min(64, math.ceil(3 * L2_BYTES / (N * K))))
        ws = [w] + [QuantWeight(w.data.clone(), w.scale.clone(), block) for _ in range(copies - 1)]
        x = torch.randn(1, G * K, device="cuda", generator=g).to(torch.bfloat16)
        nbytes = w.nbytes + 2 * G * K + 2 * N
        base = fp8_gemv_triton(x, w, G)
        for cfg in [None] + _configs("fp8", quick):
            fp8_linear.gemv_config = default_config if cfg is None else (lambda n, c=cfg: c)
            it = itertools.cycle(ws)
            try:
                err = _rel(fp8_gemv_triton(x, w, G), base)
                us = _time_us(lambda: fp8_gemv_triton(x, next(it), G), rep)
            except Exception as e:  # a config that does not compile or fit: report it, go on
                print(f"{name:22s} {cfg} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            _row(rows, "dense", name, cfg or dict(default_config(N), default=True), us, nbytes, err)
        fp8_linear.gemv_config = default_config
        del ws
        torch.cuda.empty_cache()


def sweep_experts(rep: int, quick: bool, rows: list[dict]) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, (E, N, K, T) in EXPERTS.items():
        data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=g)
        w = QuantWeight(data, torch.randint(112, 125, (E, N, K // 32), dtype=torch.uint8, device="cuda",
                                            generator=g), (1, 32))
        x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
        sets = [torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOP_K] for _ in range(T)]).view(-1)
                for _ in range(SETS)]
        distinct = sum(len(torch.unique(s)) for s in sets) / SETS
        nbytes = distinct * (N * K // 2 + N * K // 32) + 2 * T * K + 2 * T * TOP_K * N
        base = expert_gemv_q_triton(x, w, sets[0], TOP_K)
        for cfg in [None] + _configs("fp4", quick):
            it = itertools.cycle(sets)
            try:
                err = _rel(expert_gemv_q_triton(x, w, sets[0], TOP_K, cfg), base)
                us = _time_us(lambda: expert_gemv_q_triton(x, w, next(it), TOP_K, cfg), rep)
            except Exception as e:
                print(f"{name:22s} {cfg} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            _row(rows, "experts", name, cfg or dict(GEMV_Q_CONFIG["fp4"], default=True), us, nbytes, err)
        torch.cuda.empty_cache()


def _row(rows: list[dict], kind: str, name: str, cfg: dict, us: float, nbytes: float, err: float) -> None:
    floor = nbytes / HBM_BPS * 1e6
    rows.append(dict(kind=kind, shape=name, config=cfg, us=round(us, 2), gbps=round(nbytes / us * 1e-3),
                     floor_us=round(floor, 2), rel_diff=err))
    tag = "default" if cfg.get("default") else f"n{cfg['block_n']} k{cfg['block_k']} w{cfg['num_warps']} " \
                                                f"s{cfg.get('stages', 1)}"
    print(f"{name:22s} {tag:22s} {us:8.1f} us {nbytes / us * 1e-3:7.0f} GB/s {floor / us:5.0%}  diff {err:.1e}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rep", type=int, default=10, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--quick", action="store_true", help="two tiles a format (x the four stage counts)")
    args = ap.parse_args()
    rows: list[dict] = []
    sweep_dense(args.rep, args.quick, rows)
    sweep_experts(args.rep, args.quick, rows)
    print("\nbest per shape (default -> best):")
    for name in list(DENSE) + list(EXPERTS):
        mine = [r for r in rows if r["shape"] == name and r["rel_diff"] < 1e-2]
        if not mine:
            continue
        default = next((r for r in mine if r["config"].get("default")), None)
        best = min(mine, key=lambda r: r["us"])
        print(f"{name:22s} {default['us'] if default else float('nan'):8.1f} -> {best['us']:8.1f} us "
              f"({best['floor_us'] / best['us']:.0%} of floor) {best['config']}")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""Routed-expert matmuls from quantized weights against bf16, at the released expert shapes (one GPU).

usage: PYTHONPATH=. python3 benchmarks/moe_quant_bench.py [--json PATH] [--formats mxfp4[,fp8]] [--sweep]
                                                          [--tokens 32,64] [--experts E] [--models v4-flash]
                                                          [--sweep-grouped] [--plan]

For V4-Flash (256 experts: gate_up [4096, 4096], down [4096, 2048]) and V4.1-Flash (384 experts: gate_up
[4608, 5120], down [5120, 2304]), bf16 x:
- decode, batch 1, 8, 32, 64: T tokens x top-6 routes on random distinct experts (gate_up reads one x row per
  token, down one per route), `expert_gemv_triton` on bf16 experts vs, on the stored bytes, `expert_gemv_q_triton`
  (per row) and `expert_grouped_q_triton`;
- prefill, T = 512 and 4096: `expert_grouped_triton` vs `expert_grouped_q_triton`.
Times are medians of CUDA-graph replays for decode (triton.testing.do_bench_cudagraph) and of do_bench for prefill;
the calls rotate over 16 route sets, so no call finds its experts' bytes cached. GB/s counts the stored bytes
(weights + scales) of the distinct experts a call reads, i.e. the least any kernel must move; `floor` is that over 4.2 TB/s (H200 HBM3e). Prefill also
reports TFLOP/s (2 R N K). `--sweep`: the quantized kernels' tile configs on V4.1 gate_up (for tuning GEMV_Q_CONFIG
and GROUPED_Q_CONFIG; a few minutes more). `--experts 16`: that many experts instead of the release's (the cut-down
presets v4-flash-4l / v41-flash-8l have 16: at T=32 every expert takes ~12 routes). `--sweep-grouped`: the grouped
kernel with and without the x prefetch and its tiles (block_n, block_k, num_warps) at each T from 8 to 512.
`--plan`: the row plan of the grouped matmuls (`group_rows`), torch ops against the one-launch kernel, at the decode
route counts.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.testing

from dsv4.ops import moe_quant
from dsv4.ops.moe import expert_gemv_triton, expert_grouped_triton
from dsv4.ops.moe_quant import expert_gemv_q_triton, expert_grouped_q_triton
from dsv4.quant.weight import QuantWeight

MODELS = {"v4-flash": (256, {"gate_up": (4096, 4096), "down": (4096, 2048)}),
          "v41-flash": (384, {"gate_up": (4608, 5120), "down": (5120, 2304)})}
TOP_K = 6
HBM = 4.2e12  # B/s
SETS = 16


def make_weight(fmt: str, E: int, N: int, K: int) -> torch.Tensor | QuantWeight:
    """Random experts in `fmt` (the values do not change the time; the scales are realistic powers of two)."""
    dev = "cuda"
    if fmt == "bf16":
        return torch.empty(E, N, K, dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
    if fmt == "mxfp4":
        data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev)
        return QuantWeight(data, torch.randint(112, 125, (E, N, K // 32), dtype=torch.uint8, device=dev), (1, 32))
    bits = torch.randint(0, 126, (E, N, K), dtype=torch.uint8, device=dev)  # no NaN
    scale = torch.randint(112, 125, (E, triton.cdiv(N, 128), triton.cdiv(K, 128)), dtype=torch.uint8, device=dev)
    return QuantWeight(bits.view(torch.float8_e4m3fn), scale, (128, 128))


def expert_bytes(w: torch.Tensor | QuantWeight) -> int:
    """Stored bytes of one expert."""
    if isinstance(w, QuantWeight):
        return w.nbytes // w.shape[0]
    return w[0].numel() * w.element_size()


def route_sets(T: int, E: int) -> list[torch.Tensor]:
    """SETS routings of T tokens to TOP_K distinct random experts each, flattened (token-major)."""
    return [torch.rand(T, E, device="cuda").argsort(dim=1)[:, :TOP_K].reshape(-1).contiguous() for _ in range(SETS)]


def bench(fn, x: torch.Tensor, w, sets: list[torch.Tensor], x_div: int, graph: bool = True) -> float:
    """Median us of fn(x, w, idx, x_div), idx rotating over the route sets; replayed from a CUDA graph (as a decode
    step runs; plain do_bench would time the Python launch of a tens-of-us kernel) unless `graph` is False (the
    bf16 grouped kernel counts its rows with a host sync: prefill steps are not captured anyway)."""
    it = itertools.cycle(sets)
    fn(x, w, sets[0], x_div)  # compile
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(lambda: fn(x, w, next(it), x_div), rep=100,
                                                       return_mode="median")
    return 1e3 * triton.testing.do_bench(lambda: fn(x, w, next(it), x_div), warmup=25, rep=100, return_mode="median")


PHASES = (("decode", 1), ("decode", 8), ("decode", 32), ("decode", 64), ("prefill", 512), ("prefill", 4096))


def run(formats: list[str], rows: list[dict], sweep: bool, phases: list[tuple[str, int]], models: list[str],
        experts: int | None, sweep_grouped_forms: bool) -> None:
    for model in models:
        E, projs = MODELS[model]
        E = experts or E
        for proj, (N, K) in projs.items():
            weights = {fmt: make_weight(fmt, E, N, K) for fmt in ["bf16", *formats]}
            for phase, T in phases:
                sets = route_sets(T, E)
                R = T * TOP_K
                x_div = TOP_K if proj == "gate_up" else 1  # gate_up: one x row per token; down: one per route
                x = torch.randn(R // x_div, K, device="cuda").to(torch.bfloat16)
                distinct = sum(int(torch.unique(s).numel()) for s in sets) / len(sets)
                runs = [(fmt, w, fn) for fmt, w in weights.items() for fn in (
                    ((expert_gemv_triton,) if fmt == "bf16" else
                     (expert_gemv_q_triton, expert_grouped_q_triton))
                    if phase == "decode" else
                    ((expert_grouped_triton,) if fmt == "bf16" else (expert_grouped_q_triton,)))]
                for fmt, w, fn in runs:
                    us = bench(fn, x, w, sets, x_div, graph=phase == "decode")
                    nbytes = distinct * expert_bytes(w)
                    row = dict(model=model, proj=proj, N=N, K=K, E=E, phase=phase, T=T, R=R, fmt=fmt,
                               kernel=fn.__name__, us=round(us, 2), distinct_experts=distinct, bytes=int(nbytes),
                               gbps=round(nbytes / us / 1e3, 1), floor_us=round(nbytes / HBM * 1e6, 2),
                               tflops=round(2 * R * N * K / us / 1e6, 1))
                    rows.append(row)
                    if sweep_grouped_forms and 8 <= T <= 512 and fn is expert_grouped_q_triton:
                        sweep_grouped(x, w, sets, x_div, row, rows, graph=phase == "decode")
                    extra = f"{row['tflops']:7.1f} TFLOP/s" if phase == "prefill" else ""
                    print(f"{model:9s} {proj:7s} {phase:7s} T={T:<5d} {fmt:5s} {fn.__name__:26s} {us:9.1f} us  "
                          f"{row['gbps']:7.1f} GB/s"
                          f"  floor {row['floor_us']:8.1f} us  ({distinct:.0f} experts) {extra}", flush=True)
            if sweep and model == "v41-flash" and proj == "gate_up":
                sweep(weights, E, K, rows)
            del weights
            torch.cuda.empty_cache()


def sweep(weights: dict, E: int, K: int, rows: list[dict]) -> None:
    """The quantized kernels over tile configs (GEMV_Q_CONFIG, GROUPED_Q_CONFIG; restored afterwards)."""
    for fmt, w in weights.items():
        if fmt == "bf16":
            continue
        key = "fp4" if fmt == "mxfp4" else "fp8"
        saved, saved_grouped = dict(moe_quant.GEMV_Q_CONFIG[key]), dict(moe_quant.GROUPED_Q_CONFIG)
        for T in (1, 32):
            sets = route_sets(T, E)
            x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
            for bn, bk, nw in itertools.product((8, 16, 32), (256, 512, 1024), (2, 4, 8)):
                moe_quant.GEMV_Q_CONFIG[key] = dict(block_n=bn, block_k=bk, num_warps=nw)
                us = bench(expert_gemv_q_triton, x, w, sets, TOP_K)
                rows.append(dict(sweep="gemv", fmt=fmt, T=T, block_n=bn, block_k=bk, num_warps=nw, us=round(us, 2)))
                print(f"sweep gemv {fmt} T={T:<4d} block_n={bn:<3d} block_k={bk:<5d} warps={nw}: {us:8.1f} us",
                      flush=True)
        moe_quant.GEMV_Q_CONFIG[key] = saved
        for T in (512, 4096):
            sets = route_sets(T, E)
            x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
            for bn, nw, bm in itertools.product((64, 128), (4, 8), (64, 128)):
                moe_quant.GROUPED_Q_CONFIG.update(block_n=bn, num_warps=nw, max_block_m=bm)
                us = bench(expert_grouped_q_triton, x, w, sets, TOP_K, graph=False)
                rows.append(dict(sweep="grouped", fmt=fmt, T=T, block_n=bn, num_warps=nw, max_block_m=bm,
                                 us=round(us, 2)))
                print(f"sweep grouped {fmt} T={T:<4d} block_n={bn:<3d} warps={nw} max_block_m={bm:<3d}: {us:8.1f} us",
                      flush=True)
            moe_quant.GROUPED_Q_CONFIG.clear()
            moe_quant.GROUPED_Q_CONFIG.update(saved_grouped)


def sweep_grouped(x: torch.Tensor, w: QuantWeight, sets: list[torch.Tensor], x_div: int, base: dict,
                  rows: list[dict], graph: bool) -> None:
    """The grouped kernel's forms and tiles at one shape (GROUPED_Q_CONFIG restored afterwards): the default tiles
    with and without the x prefetch, then block_n, block_k and warps (the default prefetch rule)."""
    saved = dict(moe_quant.GROUPED_Q_CONFIG)
    forms = [dict(prefetch_x_max_block_m=p) for p in (0, 64)]
    tiles = [dict(block_n=bn, block_k=bk, num_warps=nw)
             for bn, bk, nw in itertools.product((64, 128), (128, 256), (4, 8))]
    for cfg in forms + tiles:
        moe_quant.GROUPED_Q_CONFIG.clear()
        moe_quant.GROUPED_Q_CONFIG.update({**saved, **cfg})
        us = bench(expert_grouped_q_triton, x, w, sets, x_div, graph=graph)
        rows.append({**base, "sweep": "grouped", **cfg, "us": round(us, 2),
                     "floor_pct": round(100 * base["floor_us"] / us, 1)})
        desc = " ".join(f"{k}={v}" for k, v in cfg.items())
        print(f"  sweep grouped {base['proj']} {base['phase']} T={base['T']:<4d} {desc}: {us:8.1f} us "
              f"({100 * base['floor_us'] / us:3.0f}% of floor)", flush=True)
    moe_quant.GROUPED_Q_CONFIG.clear()
    moe_quant.GROUPED_Q_CONFIG.update(saved)


def bench_plan(E: int, rows: list[dict]) -> None:
    """`group_rows` at the decode route counts: torch ops vs the one-launch kernel (CUDA-graph replays)."""
    from dsv4.ops.moe import group_rows_torch, group_rows_triton
    for T in (1, 8, 32, 64, 128, 512):
        sets = route_sets(T, E)
        for fn in (group_rows_torch, group_rows_triton):
            it = itertools.cycle(sets)
            fn(sets[0], E, 32)
            us = 1e3 * triton.testing.do_bench_cudagraph(lambda: fn(next(it), E, 32), rep=50, return_mode="median")
            rows.append(dict(sweep="plan", E=E, T=T, R=T * TOP_K, kernel=fn.__name__, us=round(us, 2)))
            print(f"plan E={E} T={T:<4d} R={T * TOP_K:<5d} {fn.__name__:18s} {us:7.2f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--formats", default="mxfp4", help="comma-separated: mxfp4, fp8")
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernels' tiles (V4.1 gate_up)")
    ap.add_argument("--tokens", default="", help="only these T (comma-separated), e.g. 32,64")
    ap.add_argument("--experts", type=int, default=None, help="experts per layer (default: the release's)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--sweep-grouped", action="store_true",
                    help="sweep the grouped kernel's forms and tiles at T = 8..512")
    ap.add_argument("--plan", action="store_true", help="time the grouped matmuls' row plan")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows: list[dict] = []
    tokens = {int(t) for t in args.tokens.split(",") if t}
    if args.plan:
        for E in sorted({args.experts or MODELS[m][0] for m in args.models.split(",")} | {16}):
            bench_plan(E, rows)
    run(args.formats.split(","), rows, args.sweep, [(p, T) for p, T in PHASES if not tokens or T in tokens],
        args.models.split(","), args.experts, args.sweep_grouped)
    print("\nsummary: us (x faster than bf16), % of the bandwidth floor")
    for (model, proj, phase, T), group in itertools.groupby(
            [r for r in rows if "sweep" not in r], key=lambda r: (r["model"], r["proj"], r["phase"], r["T"])):
        group = list(group)
        base = group[0]["us"]
        cells = [f"{r['fmt']} {r['kernel'].replace('expert_', '').replace('_triton', '')} {r['us']:8.1f} "
                 f"({base / r['us']:4.2f}x, {100 * r['floor_us'] / r['us']:3.0f}%)"
                 for r in group]
        print(f"{model:9s} {proj:7s} {phase:7s} T={T:<5d} " + "  ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""A prefill step's routed experts, two ways, at Flash expert shapes (one GPU, bf16): the Triton grouped kernel in route
order (`moe_output` with dsv4.ops.moe_sorted off, today's default) against rows sorted by expert through torch's
CUTLASS grouped GEMM (`moe_sorted.experts_sorted`).

usage: PYTHONPATH=. python3 benchmarks/moe_prefill_gemm.py [--tokens 512,4096,16384] [--experts 16,256]
                                                           [--models v4,v41] [--formats bf16,mxfp4] [--json PATH]
                                                           [--floor]

Each case is one MoE layer's routed part (routing weights and ids given; the shared expert left out): the row plan,
gate_up, SwiGLU (V4.1: weighted before down, fp32), down and the combine over the slots, for T tokens x top-6 routes
on random distinct experts. Times are medians of `triton.testing.do_bench` (eager launches, as a prefill runs);
TFLOP/s counts 2 x routes x (2I x D + D x I). Both outputs are compared (max difference over the output's largest
magnitude: bf16 rounding is ~4e-3). `mxfp4`: the experts as the released checkpoints store them (random e2m1 bytes,
UE8M0 scales), the Triton W4A16 grouped kernel against dequantize-then-grouped-GEMM (the dequantization counted in
the sorted time). The first case also runs with torch's profiler, to show where the sorted path's
time goes (sort, gather, the two GEMMs, scatter). `--floor` (no GPU needed): each case's FLOPs and bytes, and the
least time they take on one H200 (dense bf16 peak; HBM bandwidth for the weights and, MXFP4, their dequantization).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton.testing

from dsv4.bench.latency import environment
from dsv4.models.layers.moe import moe_output
from dsv4.ops import moe_sorted
from dsv4.quant.weight import QuantWeight

SHAPES = {"v4": (4096, 2048, False), "v41": (5120, 2304, True)}  # hidden, expert width, weight before down
TOP_K = 6


def _mxfp4(E: int, N: int, K: int, g: torch.Generator) -> QuantWeight:
    """Random released-format experts: uniform e2m1 bytes, UE8M0 scales 2^-9 .. 2^-5 (weights of ~0.01-0.2)."""
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, device="cuda", dtype=torch.uint8)
    scale = torch.randint(118, 123, (E, N, K // 32), generator=g, device="cuda", dtype=torch.uint8)
    return QuantWeight(data, scale, (1, 32))


def _experts(model: str, E: int, fmt: str, g: torch.Generator) -> tuple[torch.Tensor | QuantWeight, ...]:
    D, inter, _ = SHAPES[model]
    if fmt == "mxfp4":
        return _mxfp4(E, 2 * inter, D, g), _mxfp4(E, D, inter, g)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    return (torch.randn(E, 2 * inter, D, generator=g, **bf) * D ** -0.5,
            torch.randn(E, D, inter, generator=g, **bf) * inter ** -0.5)


def _case(model: str, E: int, T: int, fmt: str) -> dict:
    D, inter, before = SHAPES[model]
    g = torch.Generator(device="cuda").manual_seed(T + E)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, D, generator=g, **bf)
    gate_up, down = _experts(model, E, fmt, g)
    idx = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :TOP_K]
    weights = torch.rand(T, TOP_K, generator=g, device="cuda")
    shared = torch.zeros(T, D, **bf)

    def run(on: bool) -> torch.Tensor:
        moe_sorted.SORTED_EXPERTS = on
        return moe_output(x, weights, idx, gate_up, down, 7.0, weight_before_down=before, fixed=False, shared=shared)

    ref, got = run(False), run(True)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    flops = 2 * T * TOP_K * 3 * inter * D
    row = {"model": model, "format": fmt, "experts": E, "tokens": T, "routes": T * TOP_K, "max_rel_diff": err}
    for name, on in (("triton", False), ("sorted", True)):
        ms = triton.testing.do_bench(lambda: run(on), warmup=50, rep=300)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
    row["speedup"] = row["triton_ms"] / row["sorted_ms"]
    return row


def _profile(model: str, E: int, T: int, fmt: str) -> str:
    D, inter, before = SHAPES[model]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, D, **bf)
    gate_up, down = _experts(model, E, fmt, torch.Generator(device="cuda").manual_seed(0))
    idx = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :TOP_K]
    weights, shared = torch.rand(T, TOP_K, device="cuda"), torch.zeros(T, D, **bf)
    out = []
    for on in (False, True):
        moe_sorted.SORTED_EXPERTS = on
        for _ in range(3):
            moe_output(x, weights, idx, gate_up, down, 7.0, weight_before_down=before, fixed=False, shared=shared)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                moe_output(x, weights, idx, gate_up, down, 7.0, weight_before_down=before, fixed=False,
                           shared=shared)
            torch.cuda.synchronize()
        out.append(f"== {'sorted' if on else 'triton'}: {model} {fmt}, {E} experts, {T} tokens (5 calls)\n"
                   + prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    return "\n".join(out)


H200_BF16_FLOPS, H200_BYTES_S = 989.5e12, 4.8e12  # dense bf16 peak (dsv4/bench/flops.py), HBM3e bandwidth


def floor_rows(models: list[str], experts: list[int], tokens: list[int], formats: list[str]) -> list[dict]:
    """FLOPs and bytes of each case and their least time on one H200: the GEMMs at the bf16 peak; the stored bytes
    (the weights read once: bf16 2 bytes, MXFP4 0.5 + 1/32; x, the intermediate and the output read and written
    once, 2 bytes each); and what the sorted path moves besides, for MXFP4 the dequantized copy (2 bytes written,
    2 read back per weight)."""
    rows = []
    for fmt, model in itertools.product(formats, models):
        D, inter, _ = SHAPES[model]
        for E, T in itertools.product(experts, tokens):
            R = T * TOP_K
            flops = 2 * R * 3 * inter * D
            weights = E * 3 * inter * D
            stored = weights * (2 if fmt == "bf16" else 0.5 + 1 / 32) + 2 * (2 * R * D + 3 * R * inter)
            extra = 0 if fmt == "bf16" else 4 * weights
            rows.append({"model": model, "format": fmt, "experts": E, "tokens": T, "routes": R, "gflop": flops / 1e9,
                         "compute_ms": flops / H200_BF16_FLOPS * 1e3, "stored_bytes_ms": stored / H200_BYTES_S * 1e3,
                         "sorted_bytes_ms": (stored + extra) / H200_BYTES_S * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--experts", default="16,256")
    ap.add_argument("--models", default="v4,v41")
    ap.add_argument("--formats", default="bf16,mxfp4")
    ap.add_argument("--json", default=None)
    ap.add_argument("--floor", action="store_true", help="print each case's FLOP / byte floor on one H200 and exit")
    args = ap.parse_args()
    if args.floor:
        for r in floor_rows(args.models.split(","), [int(e) for e in args.experts.split(",")],
                            [int(t) for t in args.tokens.split(",")], args.formats.split(",")):
            print(f"{r['model']} {r['format']:5s} E={r['experts']:4d} T={r['tokens']:6d}: {r['gflop']:7.0f} GFLOP, "
                  f"compute {r['compute_ms']:6.3f} ms, stored bytes {r['stored_bytes_ms']:6.3f} ms, sorted path's "
                  f"bytes {r['sorted_bytes_ms']:6.3f} ms")
        return
    moe_sorted.MIN_ROWS = moe_sorted.MIN_QUANT_ROWS_PER_EXPERT = 0  # the switch decides on nothing but the case here
    rows = []
    for fmt, model in itertools.product(args.formats.split(","), args.models.split(",")):
        for E in (int(e) for e in args.experts.split(",")):
            for T in (int(t) for t in args.tokens.split(",")):
                row = _case(model, E, T, fmt)
                rows.append(row)
                print(f"{model} {fmt:5s} E={E:4d} T={T:6d}: triton {row['triton_ms']:8.3f} ms "
                      f"({row['triton_tflops']:6.1f} TFLOP/s)  sorted {row['sorted_ms']:8.3f} ms ({row['sorted_tflops']:6.1f})  "
                      f"x{row['speedup']:.2f}  diff {row['max_rel_diff']:.1e}", flush=True)
                torch.cuda.empty_cache()
    model, E = args.models.split(",")[0], int(args.experts.split(",")[0])
    prof = "\n".join(_profile(model, E, int(args.tokens.split(",")[-1]), fmt) for fmt in args.formats.split(","))
    print(prof)
    if args.json:
        with open(args.json, "w") as f:
            env = environment(args, torch.device("cuda"))
            env["command"] = "PYTHONPATH=. python3 " + " ".join(sys.argv)
            json.dump({"env": env, "rows": rows, "profile": prof}, f, indent=1)


if __name__ == "__main__":
    main()

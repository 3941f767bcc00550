"""What the sink attention kernels of dsv4.ops.decode_attention compile to, without a GPU: registers, stack (spills)
and the key-tile loop's opcodes per thread, for the rows kernel (prefill: all heads of a row in one program) at
several tile / warp configurations, beside the split kernel (decode) as launched today.

usage: PYTHONPATH=.:benchmarks python3 benchmarks/rows_attention_sass.py [--json PATH]

Compiles for sm_90 with the Triton installed here (its own ptxas and cuobjdump; no driver needed) at DeepSeek-V4's
shapes: bf16 q and caches, H 64, D 512, two sources (slots + mask, then a second slots + mask source), 16-byte
aligned pointers and strides. A lead for spills and instruction counts, not a time: the H200's Triton may compile differently.
"""

from __future__ import annotations

import argparse
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.ops import decode_attention
from grouped_q_sass import analyse

POINTERS = {"q_ptr": "*bf16", "c1_ptr": "*bf16", "s1_ptr": "*i64", "v1_ptr": "*i1", "c2_ptr": "*bf16",
            "s2_ptr": "*i64", "v2_ptr": "*i1"}
# BLOCK_H, BLOCK_DV, BLOCK_N, warps, stages
ROWS_CONFIGS = [(64, 256, 32, 4, 2), (64, 256, 16, 4, 2), (64, 256, 16, 4, 3), (64, 256, 64, 4, 2), (64, 256, 32, 8, 2)]


def _signature(fn: triton.JITFunction, pointers: dict[str, str]) -> dict[str, str]:
    sig = {}
    for a in fn.arg_names:
        if a in pointers:
            sig[a] = pointers[a]
        elif a == "scale":
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    return sig


def compile_kernel(fn: triton.JITFunction, consts: dict, pointers: dict[str, str], warps: int,
                   stages: int = decode_attention.SPLIT_STAGES) -> tuple[bytes, int]:
    """(cubin, shared memory bytes a program) of one configuration."""
    sig = {**_signature(fn, pointers), **{k: "constexpr" for k in consts}}
    # what the launch specializes on at these shapes: 16-byte aligned pointers, strides multiples of 16
    aligned = list(pointers) + [a for a in fn.arg_names if a.endswith("stride") or a in ("sq_r", "sq_h", "so_r", "so_h")]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    return kernel.asm["cubin"], kernel.metadata.shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, bf16, H 64, D 512")
    common = dict(D=512, BLOCK_D=512, TC=True, UPCAST=False)
    cases = [("split", decode_attention._split_kernel,
              dict(common, BLOCK_H=decode_attention.BLOCK_H, BLOCK_N=decode_attention.BLOCK_N, TABLE2=False),
              {**POINTERS, "ws_m": "*fp32", "ws_l": "*fp32", "ws_acc": "*fp32"}, decode_attention.SPLIT_WARPS,
              decode_attention.SPLIT_STAGES)]
    rows_pointers = {**POINTERS, "sinks_ptr": "*fp32", "out_ptr": "*bf16", "ws_m": "*fp32", "ws_l": "*fp32",
                     "ws_acc": "*fp32"}
    # the rows kernel whole (SPLIT off), and its default tiles with key splits (DSV4_ROWS_SPLITS: decode batches)
    for (bh, dv, bn, warps, stages), split in [(c, False) for c in ROWS_CONFIGS] + [(ROWS_CONFIGS[1], True)]:
        consts = dict(D=512, BLOCK_DV=dv, HALVES=dv < 512, TC=True, UPCAST=False, BLOCK_H=bh, BLOCK_N=bn, TABLE2=False,
                      SPLIT=split)
        cases.append(("rows+split" if split else "rows", decode_attention._rows_kernel, consts, rows_pointers, warps,
                      stages))
    rows = []
    for name, fn, consts, pointers, warps, stages in cases:
        cubin, shared = compile_kernel(fn, consts, pointers, warps, stages)
        row = dict(kernel=name, block_h=consts["BLOCK_H"], block_dv=consts.get("BLOCK_DV", 512),
                   block_n=consts["BLOCK_N"], warps=warps, stages=stages, shared=shared, **analyse(cubin))
        rows.append(row)
        top = " ".join(f"{k} {v}" for k, v in list(row["loop_ops"].items())[:10])
        print(f"{name:10s} BLOCK_H {row['block_h']:3d} BLOCK_DV {row['block_dv']:3d} BLOCK_N {row['block_n']:3d} "
              f"{warps:2d} warps {stages} stages: {row['registers']} registers, stack {row['stack']:5d} B, "
              f"shared {shared // 1024:3d} KB, loop {row['loop_instructions']:5d} instructions: {top}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

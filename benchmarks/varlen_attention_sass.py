"""What the vision encoder's Triton varlen attention kernel compiles to, without a GPU: registers and the
instructions of each key-tile loop per thread, per score, at several tile configurations.

usage: python3 benchmarks/varlen_attention_sass.py [--json PATH]

Compiles `dsv4.ops.varlen_attention._varlen_fwd_kernel` for sm_90 with the Triton installed here (its own ptxas and
cuobjdump) as the encoder launches it: bf16, head_dim 64, 16-byte aligned pointers. The kernel has two loops, the
unmasked tiles of a block that lies inside one sequence (most of the work) and the masked ones (the last, partial
tile and blocks straddling a boundary); a thread's share of a tile is BLOCK_M * BLOCK_N / threads scores. At head_dim
64 the softmax's instructions, not the MMAs, bound a tile: on an H100-class SM a 128 x 64 tile's MMAs take ~512
cycles, and each instruction a score costs 128 x 64 / 128 = 64 issue cycles. A lead, not a time: the H200's Triton
(3.6) may compile differently.
"""

from __future__ import annotations

import argparse
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.ops import varlen_attention
from grouped_q_sass import _dump, loops

SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "seq_ptr": "*i32",
             "cu_ptr": "*i32", "n_rows": "i32", "n_seqs": "i32", "qk_scale": "fp32", "sq_r": "i32", "sq_h": "i32",
             "sk_r": "i32", "sk_h": "i32", "sv_r": "i32", "sv_h": "i32", "so_r": "i32", "so_h": "i32"}
CONFIGS = [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)]  # BLOCK_M, BLOCK_N, warps, stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    fn = varlen_attention._varlen_fwd_kernel
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in SIGNATURE
               if a not in ("n_rows", "n_seqs", "qk_scale")}
    print(f"triton {triton.__version__}, sm_90, bf16, head_dim 64")
    rows = []
    for bm, bn, warps, stages in CONFIGS:
        consts = dict(D=64, BLOCK_D=64, BLOCK_M=bm, BLOCK_N=bn, LOWP=True, UPCAST=False)
        src = ASTSource(fn=fn, signature={**SIGNATURE, **{k: "constexpr" for k in consts}}, constexprs=consts,
                        attrs=aligned)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        usage, sass = _dump(kernel.asm["cubin"])
        per_thread = bm * bn / (32 * warps)
        found = [dict(instructions=n, per_score=round(n / per_thread, 2), ops=ops) for n, ops in loops(sass)]
        rows.append(dict(block_m=bm, block_n=bn, warps=warps, stages=stages, usage=usage.strip(), loops=found))
        text = "; ".join(f"{lo['instructions']} instructions ({lo['per_score']} a score): "
                         + " ".join(f"{k} {v}" for k, v in list(lo["ops"].items())[:8]) for lo in found)
        print(f"{bm} x {bn}, {warps} warps, {stages} stages: {text}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

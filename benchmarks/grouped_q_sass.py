"""What the grouped quantized expert kernel compiles to, without a GPU: registers, stack (spills) and the opcodes of
its K loop per thread, for each variant (rows per block, x prefetch), specialized as the launch is at the
released shapes (16-byte aligned pointers, sizes multiples of 16: without that, the loads are 4-byte and the sums
cross threads, a different kernel).

usage: python3 benchmarks/grouped_q_sass.py [--json PATH]

Compiles `dsv4.ops.moe_quant._expert_grouped_q_kernel` for sm_90 with the Triton installed here (its own ptxas and
cuobjdump; no driver needed) at the MXFP4 decode configuration of GROUPED_Q_CONFIG (bf16 x, UE8M0 scales, blocks of
(1, 32)). The loop is the longest backward branch's body; a thread's share of a tile is BLOCK_N * BLOCK_K / threads
weights, so `per weight` is the loop's instructions over that. A lead for where the instructions go (address and mask
arithmetic against decode math), not a time: the H200's Triton may differ from the one here.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.ops import moe_quant

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "order_ptr": "*i64", "counts_ptr": "*i64",
             "offsets_ptr": "*i64", "block_ends_ptr": "*i64", "out_ptr": "*bf16", "E": "i32", "N": "i32", "K": "i32",
             "KW": "i32", "SK": "i32", "x_div": "i32"}
VARIANTS = [(16, True), (32, True), (64, False), (16, False), (32, False), (64, True)]  # (BLOCK_M, PREFETCH_X)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_variant(block_m: int, prefetch_x: bool) -> tuple[bytes, int, int]:
    """(cubin, BLOCK_N * BLOCK_K weights a tile, threads) of one variant."""
    cfg = moe_quant.GROUPED_Q_CONFIG
    block_n, block_k, warps = cfg["block_n"], cfg["block_k"], cfg["num_warps"]
    consts = dict(FP4=True, UE8M0=True, BN=1, BK=32, BLOCK_M=block_m, BLOCK_N=block_n, G=block_k // 32, SUB=32,
                  BLOCK_E=32, IEEE=False, PTX=True, PREFETCH_X=prefetch_x, INTERPRET=False)
    fn = moe_quant._expert_grouped_q_kernel
    # what the launch specializes on at the released shapes: 16-byte aligned pointers, E, N, K, KW, SK multiples of 16
    # (x_div, 6 for gate_up, is not)
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in SIGNATURE if a != "x_div"}
    src = ASTSource(fn=fn, signature={**SIGNATURE, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    return kernel.asm["cubin"], block_n * block_k, 32 * warps


def _dump(cubin: bytes) -> tuple[str, str]:
    """(resource usage, SASS) of a cubin, through Triton's own cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return usage, sass


def loops(sass: str) -> list[tuple[int, dict[str, int]]]:
    """Every loop of the SASS (a backward branch's body), in code order: (instructions, opcode counts)."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            body = ins[index[int(m.group(1), 16)]:i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
            out.append((len(body), dict(ops.most_common())))
    return out


def analyse(cubin: bytes) -> dict:
    """Registers, stack and the longest loop's (the K loop's) opcode counts of one cubin."""
    usage, sass = _dump(cubin)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    length, ops = max(loops(sass), default=(0, {}), key=lambda lo: lo[0])
    return dict(registers=regs, stack=stack, loop_instructions=length, loop_ops=ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, GROUPED_Q_CONFIG {moe_quant.GROUPED_Q_CONFIG}")
    rows = []
    for block_m, prefetch_x in VARIANTS:
        cubin, tile, threads = compile_variant(block_m, prefetch_x)
        row = dict(block_m=block_m, prefetch_x=prefetch_x, **analyse(cubin))
        row["per_weight"] = round(row["loop_instructions"] / (tile / threads), 2)
        rows.append(row)
        top = " ".join(f"{k} {v}" for k, v in list(row["loop_ops"].items())[:10])
        print(f"BLOCK_M {block_m:3d} prefetch_x {prefetch_x!s:5s}: {row['registers']} registers, "
              f"stack {row['stack']:4d} B, loop {row['loop_instructions']:4d} instructions "
              f"({row['per_weight']:.1f} a weight): {top}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "config": moe_quant.GROUPED_Q_CONFIG, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

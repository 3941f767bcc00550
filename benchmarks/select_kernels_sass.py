"""What the decode selection's kernels compile to for sm_90, without a GPU: registers, stack (spills), shared memory
and the SASS instruction count of each, at V4.1-Flash's candidate-source configuration (top-512, kept 2,048 blocks
of 8 entries, 32 index heads of 128, bf16 keys).

usage: python3 benchmarks/select_kernels_sass.py

Compiled with the Triton installed here (its own ptxas and cuobjdump; no driver needed). The H200's Triton (3.6) may
allocate differently; this catches spills and resource blow-ups of a kernel that has not yet run on a GPU (the radix
merge's kernels, the split kernel with its block lists unsorted), not its speed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.ops import indexer as ix

L, LB, CB, SUB, KEEP, H, D = 512, 2048, 8, 32, 2048, 32, 128


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def build(fn: Any, signature: dict[str, str], consts: dict[str, Any], warps: int) -> str:
    """One line: the kernel's resource usage and SASS instruction count."""
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in consts}}, constexprs=consts)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    res = next(line.strip() for line in usage.splitlines() if "REG" in line)
    keep = " ".join(part for part in res.split() if part.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))
    n_instr = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
    return f"{keep}, {n_instr} instructions"


def main() -> None:
    lists = dict(L=L, LB=LB, CB=CB, SUB=SUB, POOL=False, BLOCKS=True)
    split_sig = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*bf16", table_ptr="*i32", t_stride="i32", n_ptr="*i64",
                     cand_ptr="*i64", c_stride="i32", C="i32", row_ptr="*i64", tile_ptr="*i64", brow_ptr="*i64",
                     btile_ptr="*i64", S="i32", H="i32", D="i32", BS="i32", scale="fp32")
    # chunks' blocks: all fit / where they fit / sorted tiles; sorted entry lists (the sort merge's) or appended
    # 2L-place ones (the radix merge's)
    for raw, warps, append in ((2, 4, False), (1, 4, False), (0, 4, False), (2, 8, False), (1, 4, True),
                               (1, 8, True)):
        consts = dict(lists, BLOCK_H=H, BLOCK_D=D, BF16=True, RAW_BLOCKS=raw, LW=2 * L if append else L,
                      APPEND=append)
        print(f"_select_split_kernel RAW_BLOCKS={raw}, {warps} warps{', APPEND' if append else ''}: "
              f"{build(ix._select_split_kernel, split_sig, consts, warps)}")
    plain = dict(L=L, LB=1, CB=1, SUB=SUB, POOL=False, BLOCKS=False, BLOCK_H=H, BLOCK_D=D, BF16=True, RAW_BLOCKS=2,
                 LW=L, APPEND=False)
    for warps in (4, 8):
        print(f"_select_split_kernel plain rows, {warps} warps: "
              f"{build(ix._select_split_kernel, split_sig, plain, warps)}")
    merge_sig = dict(n_ptr="*i64", C="i32", row_ptr="*i64", brow_ptr="*i64", part_ptr="*i64", bpart_ptr="*i64",
                     acc_ptr="*i64", bacc_ptr="*i64", S="i32", G="i32", STAGE="i32", table_ptr="*i32",
                     t_stride="i32", BS="i32", picks_ptr="*i64", slots_ptr="*i64", mask_ptr="*i1", K="i32",
                     cands_ptr="*i64", KEEP="i32")
    consts = dict(lists, KP=L, KEEPP=KEEP)
    print(f"_select_merge_kernel (sorted cuts): {build(ix._select_merge_kernel, merge_sig, consts, ix.MERGE_WARPS)}")
    radix = dict(lists, TILE=ix.RADIX_TILE, ST=ix.RADIX_STATE, LW=2 * L)
    rows = dict(n_ptr="*i64", C="i32", S="i32", row_ptr="*i64", brow_ptr="*i64", sel_ptr="*i64")
    print(f"_radix_count_kernel: {build(ix._radix_count_kernel, dict(rows, ROUND='i32', P='i32'), radix, 4)}")
    scan_sig = dict(sel_ptr="*i64", K="i32", KEEP="i32", ROUND="i32")
    print(f"_radix_scan_kernel: "
          f"{build(ix._radix_scan_kernel, scan_sig, dict(BLOCKS=True, LAST=False, ST=ix.RADIX_STATE), 1)}")
    gather_sig = dict(rows, acc_ptr="*i64", bacc_ptr="*i64", P="i32")
    print(f"_radix_gather_kernel: {build(ix._radix_gather_kernel, gather_sig, radix, 4)}")
    write_sig = dict(sel_ptr="*i64", acc_ptr="*i64", bacc_ptr="*i64", table_ptr="*i32", t_stride="i32", BS="i32",
                     picks_ptr="*i64", slots_ptr="*i64", mask_ptr="*i1", K="i32", cands_ptr="*i64", KEEP="i32")
    write = dict(L=L, LB=LB, BLOCKS=True, ST=ix.RADIX_STATE, TI=ix.RADIX_WRITE_KEYS, TJ=ix.RADIX_WRITE_TILE)
    print(f"_radix_write_kernel: {build(ix._radix_write_kernel, write_sig, write, 4)}")


if __name__ == "__main__":
    main()

"""What the fused mHC expand + collapse + norm kernel (dsv4.ops.mhc_streams._expand_collapse_norm_kernel) compiles to
for sm_90 without a GPU, at V4.1-Flash's shape (4 bf16 streams of 5120: BLOCK_D 8192, V4.1 norm), by warp count:
registers, stack (spill) bytes, SASS instructions; and the collapse + norm kernel it replaces, for comparison.

usage: PYTHONPATH=. python3 benchmarks/mhc_expand_collapse_sass.py

Compiled with the Triton installed here (its own ptxas; no driver needed). A lead for the GPU, not a time.
"""

from __future__ import annotations

from select_kernels_sass import build

from dsv4.ops import mhc_streams as ms
from dsv4.ops.rmsnorm import MODE_V41


def main() -> None:
    sig = dict(y_ptr="*bf16", h_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", pre_ptr="*fp32", w_ptr="*bf16",
               hout_ptr="*bf16", x_ptr="*bf16", D="i32", eps="fp32", inv_d="fp32")
    consts = dict(N=4, MODE=MODE_V41, BLOCK_D=8192, INTERPRET=False)
    for warps in (8, 16, 32):
        print(f"_expand_collapse_norm_kernel, {warps} warps: {build(ms._expand_collapse_norm_kernel, sig, consts, warps)}")
    sig2 = dict(h_ptr="*bf16", pre_ptr="*fp32", w_ptr="*bf16", out_ptr="*bf16", D="i32", eps="fp32", inv_d="fp32")
    print(f"_collapse_norm_kernel, 16 warps: {build(ms._collapse_norm_kernel, sig2, consts, 16)}")


if __name__ == "__main__":
    main()

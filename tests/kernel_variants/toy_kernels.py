"""Tiny Triton kernels for tests/test_ttir_check.py, the same sum each: one with a name typed int64 in one branch of a
runtime `if` and like `n` in the other (the interpreter runs it; the compiler refuses it where `n` is int32), one
with a single type, and one with the mixed types only behind a GPU switch (BF16)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mixed_branch_types(x_ptr, out_ptr, n, WIDE: tl.constexpr):
    m = tl.load(x_ptr)
    if n > 0:
        end = m.to(tl.int64) + n
    else:
        end = m + n
    tl.store(out_ptr, end + WIDE)


@triton.jit
def one_branch_type(x_ptr, out_ptr, n, WIDE: tl.constexpr):
    m = tl.load(x_ptr).to(tl.int64)
    if n > 0:
        end = m + n
    else:
        end = m - n
    tl.store(out_ptr, end + WIDE)


@triton.jit
def switch_branch_bug(x_ptr, out_ptr, n, WIDE: tl.constexpr, BF16: tl.constexpr):
    """The mixed types only in the branch a GPU switch takes (BF16 is off under the interpreter, on the GPU)."""
    m = tl.load(x_ptr)
    if BF16:
        if n > 0:
            end = m.to(tl.int64) + n
        else:
            end = m + n
    else:
        end = m.to(tl.int64) + n
    tl.store(out_ptr, end + WIDE)

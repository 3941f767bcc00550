"""sm_90 builds of the mHC rows kernel (single pass / SPLIT) and the in-place rope kernel (strided / VEC pairs):
registers, stack, shared memory, and the global / shared memory instructions (Triton installed here, no GPU)."""
import os, re, subprocess, tempfile
from collections import Counter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4.ops import mhc, rope

TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def build(fn, sig, consts, aligned, **opts):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **opts))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        usage = subprocess.run([TOOL, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([TOOL, "-sass", f.name], capture_output=True, text=True).stdout
    ops = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\d\s+)?([A-Z0-9_.]+)", sass, re.M))
    mem = {o: n for o, n in ops.items() if o.startswith(("LDG", "STG", "LDS", "STS"))}
    return " ".join(re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+", usage)) + f" instructions {sum(ops.values())} {mem}"

sig = {"h_ptr": "*bf16", "parts_ptr": "*bf16", "m_ptr": "*fp32", "ws_ptr": "*fp32", "ss_ptr": "*fp32", "T": "i32",
       "K": "i32", "M": "i32", "KS": "i32", "norm_eps": "fp32", "inv_k": "fp32"}
for split in (False, True):
    print("mhc _hc_rows_kernel SPLIT", split, build(mhc._hc_rows_kernel, sig, dict(BLOCK_T=64, BLOCK_M=32, BLOCK_K=64,
          SPLIT=split, INTERPRET=False), ("h_ptr", "parts_ptr", "m_ptr", "ws_ptr", "ss_ptr", "K", "KS")))
sig = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "rows": "i32", "heads": "i32", "sign": "fp32",
       "cos_stride": "i32", "sin_stride": "i32"}
for vec in (False, True):
    print("rope _rope_inplace_kernel VEC", vec, build(rope._rope_inplace_kernel, sig, dict(D=512, HALF=32, BLOCK_H=32,
          BLOCK_R=32, VEC=vec, INTERPRET=False), ("x_ptr", "cos_ptr", "sin_ptr", "rows", "cos_stride", "sin_stride"),
          enable_fp_fusion=False))

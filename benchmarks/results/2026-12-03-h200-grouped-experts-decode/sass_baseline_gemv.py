"""The c4cf3ec grouped kernel and the one-row gemv, compiled as benchmarks/grouped_q_sass.py compiles (sm_90, the
launch's divisibility specialization). Run from the repo root with the c4cf3ec moe_quant.py at /tmp/old_moe_quant.py:
  git show c4cf3ec:dsv4/ops/moe_quant.py > /tmp/old_moe_quant.py; python3 THIS"""
import importlib.util, sys
sys.path.insert(0, "benchmarks")
import grouped_q_sass as gs, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4.ops import moe_quant as mq
spec = importlib.util.spec_from_file_location("old_moe_quant", "/tmp/old_moe_quant.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

def build(fn, sig, consts, warps, skip=("x_div",)):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in skip}
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
    return gs.analyse(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["cubin"])

print(f"triton {triton.__version__}, sm_90")
for bm in (16, 32, 64):
    c = dict(FP4=True, UE8M0=True, BN=1, BK=32, BLOCK_M=bm, BLOCK_N=64, G=4, SUB=32, BLOCK_E=32, IEEE=False, PTX=True,
             INTERPRET=False)
    r = build(old._expert_grouped_q_kernel, gs.SIGNATURE, c, 4)
    print(f"c4cf3ec grouped BLOCK_M {bm}: {r['registers']} registers, stack {r['stack']}, loop {r['loop_instructions']}"
          f" ({r['loop_instructions'] / 64:.1f} a weight)")
sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "idx_ptr": "*i64", "out_ptr": "*bf16", "E": "i32", "N": "i32",
       "K": "i32", "KW": "i32", "SK": "i32", "x_div": "i32"}
for name, fp4, bn, bk, tn, tk in (("mxfp4 experts 16x512", True, 1, 32, 16, 512), ("fp8 dense 8x512", False, 128, 128, 8, 512),
                                  ("fp8 dense 16x256", False, 128, 128, 16, 256)):
    sub = 32 if fp4 else 16
    c = dict(FP4=fp4, UE8M0=True, BN=bn, BK=bk, ROUND_W=False, BLOCK_N=tn, G=tk // sub, SUB=sub, PTX=True, INTERPRET=False)
    r = build(mq._expert_gemv_q_kernel, sig, c, 4)
    print(f"gemv {name}: {r['registers']} registers, loop {r['loop_instructions']} "
          f"({r['loop_instructions'] / (tn * tk / 128):.2f} a weight)")

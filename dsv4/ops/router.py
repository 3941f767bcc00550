"""DeepSeek-V4.1's MoE routing after the gate projection, as one launch on CUDA (model.md section 4).

From the fp32 gate logits [T, E]: scores s = act(logits / gate_temp) (sqrt(softplus) or sigmoid), the selection
bias of the token's kind (images use `bias_vl`) added for the choice only, the top-k experts of s + bias (ties to
the lowest expert id, `stable_topk`), their unbiased scores normalised to sum 1 (when k > 1) and scaled by
`routed_scaling_factor`. Returns (weights [T, k] fp32, expert ids [T, k] int64).

The torch expression is ~12 kernels per layer (division, activation, bias select and add, a stable sort, gather,
sum, division, scale); the kernel does one token per program with the E scores in registers and picks the k experts
by k rounds of max. It follows torch's CUDA arithmetic so that the CHOICE is identical: division by the Python
scalar gate_temp is a multiply by fp32(1 / gate_temp) there (torch's CUDA division by a CPU scalar), softplus is
log1p(expf(x)) below its threshold 20, sqrt and sigmoid's division are IEEE-rounded, expf and log1pf are libdevice's.
The weights' normalising sum adds the k scores in order, which torch may not: they can differ by an fp32 ulp.

`route_v4`: DeepSeek-V4's router after its projection, the same in one launch for both of its kinds of layer. The
scores stay in the logits' dtype (the projection's, bf16 on a GPU), each op rounding to it as torch's ops on a bf16
tensor do (softplus, then sqrt, each computed in fp32 and rounded; the sum of the k weights in fp32, rounded; the
division and the scale likewise); selection adds the fp32 `e_score_correction_bias` (top-k layers) or reads the
token's experts from `tid2eid` (hash layers); the weights are normalised for every k. The torch expression is ~8
kernels a layer (activation, sqrt, bias add, a stable sort or an index, gather, sum, add, division, scale). On by
default on CUDA (DSV4_FUSED_ROUTER=0: torch's ops). H200, V4-Flash-4l released, FULL graphs
(benchmarks/results/2026-12-04-h200-decode-launches): batch-1 step 1.246 -> 1.203 ms, batch 32 2.518 -> 2.457 ms;
choice and weights equal torch's at 1-16,384 tokens over 16 and 256 experts (benchmarks/router_bench.py).
"""

from __future__ import annotations

import os
import struct

import torch
import torch.nn.functional as F

from dsv4.ops.topk import stable_topk

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch reference
    triton = None

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1}  # the activations the kernel implements (softmax: torch only)
# V4's router kernel (`route_v4`) on CUDA; DSV4_FUSED_ROUTER=0 runs the torch expression instead
FUSED_ROUTER_V4 = os.environ.get("DSV4_FUSED_ROUTER", "1") == "1"


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def fp32_reciprocal(x: float) -> float:
    """fp32(1) / fp32(x), correctly rounded (a double quotient of two fp32 values rounds to the fp32 quotient), as
    torch's CUDA division by a Python scalar computes it before multiplying. Pure Python, so it also works while a
    model is built on the meta device; call it at set-up, outside torch.compile's trace."""
    return _fp32(1.0 / _fp32(x))


def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Router activation: sqrt(softplus(x)) for V4; softmax and sigmoid are accepted too."""
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def route_torch(logits: torch.Tensor, bias: torch.Tensor, bias_vl: torch.Tensor, is_image: torch.Tensor,
                gate_temp: float, scoring_func: str, top_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: logits [T, E] fp32, bias / bias_vl [E], is_image [T] bool."""
    s = score(logits / gate_temp, scoring_func)
    b = torch.where(is_image[:, None], bias_vl.float(), bias.float())
    idx = stable_topk(s + b, top_k)
    w = s.gather(1, idx)
    if top_k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


def route_v4_torch(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                   input_ids: torch.Tensor, scoring_func: str, top_k: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: logits [T, E] (the projection's dtype), `bias` [E] fp32 (top-k layers) or `tid2eid` [vocab, k]
    with the tokens' `input_ids` [T] (hash layers) -> (weights [T, k] in logits' dtype, expert ids [T, k] int64).
    Ties in selection go to the lowest expert id."""
    scores = score(logits, scoring_func)
    idx = tid2eid[input_ids].long() if tid2eid is not None else stable_topk(scores + bias, top_k)
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne

    @triton.jit
    def _top_k(v, s, e, kk, K: tl.constexpr, BLOCK_E: tl.constexpr):
        """The K experts of largest v [BLOCK_E] (ties to the lowest id), by K rounds of max: their ids [KB] in pick
        order, their s, and the sum of those s added in that order."""
        picks = tl.zeros(kk.shape, dtype=tl.int64)
        ws = tl.zeros(kk.shape, dtype=tl.float32)
        total = 0.0
        for k in tl.static_range(K):
            m = tl.max(v, axis=0)
            i = tl.min(tl.where(v == m, e, BLOCK_E), axis=0)  # the lowest expert id among the maxima
            si = tl.sum(tl.where(e == i, s, 0.0), axis=0)
            picks = tl.where(kk == k, i.to(tl.int64), picks)
            ws = tl.where(kk == k, si, ws)
            total += si
            v = tl.where(e == i, float("-inf"), v)
        return picks, ws, total

    @triton.jit
    def _route_kernel(logit_ptr, bias_ptr, bias_vl_ptr, img_ptr, w_ptr, idx_ptr, E, inv_temp, scale,
                      K: tl.constexpr, KB: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr,
                      INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        inv_temp = tl.cast(inv_temp, tl.float32)  # torch.compile hands float arguments over as fp64
        scale = tl.cast(scale, tl.float32)
        x = tl.load(logit_ptr + t * E + e, mask=em, other=0.0) * inv_temp
        if INTERPRET:  # no libdevice in the interpreter
            ex = tl.exp(x)
            exn = tl.exp(-x)
        else:
            ex = libdevice.exp(x)
            exn = libdevice.exp(-x)
        if SCORING == 0:
            if INTERPRET:
                sp = tl.log(1.0 + ex)
            else:
                sp = libdevice.log1p(ex)
            s = tl.sqrt_rn(tl.where(x > 20.0, x, sp))
        else:
            s = tl.math.div_rn(tl.full([BLOCK_E], 1.0, tl.float32), 1.0 + exn)
        img = tl.load(img_ptr + t) != 0
        b = tl.where(img, tl.load(bias_vl_ptr + e, mask=em, other=0.0), tl.load(bias_ptr + e, mask=em, other=0.0))
        kk = tl.arange(0, KB)
        picks, ws, total = _top_k(tl.where(em, s + b, float("-inf")), s, e, kk, K, BLOCK_E)
        if K > 1:
            ws = tl.math.div_rn(ws, tl.zeros([KB], dtype=tl.float32) + (total + 1e-20))
        km = kk < K
        tl.store(w_ptr + t * K + kk, ws * scale, mask=km)
        tl.store(idx_ptr + t * K + kk, picks, mask=km)

    @triton.jit
    def _route_v4_kernel(logit_ptr, bias_ptr, tid_ptr, ids_ptr, w_ptr, idx_ptr, E, scale, K: tl.constexpr,
                         KB: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr, HASH: tl.constexpr,
                         INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        scale = tl.cast(scale, tl.float32)  # torch.compile hands float arguments over as fp64
        dt = logit_ptr.dtype.element_ty
        x = tl.load(logit_ptr + t * E + e, mask=em, other=0.0).to(tl.float32)
        if SCORING == 0:  # sqrt(softplus(x)), each op rounded to dt
            if INTERPRET:  # no libdevice in the interpreter: log1p by Kahan's identity (log(1 + y) loses small y)
                ex = tl.exp(x)
                u = 1.0 + ex
                sp = tl.where(u == 1.0, ex, tl.log(u) * (ex / (u - 1.0)))
            else:
                sp = libdevice.log1p(libdevice.exp(x))
            sp = cast_rne(tl.where(x > 20.0, x, sp), dt, INTERPRET).to(tl.float32)
            s = cast_rne(tl.sqrt_rn(sp), dt, INTERPRET).to(tl.float32)
        else:
            exn = tl.exp(-x) if INTERPRET else libdevice.exp(-x)
            s = cast_rne(tl.math.div_rn(tl.full([BLOCK_E], 1.0, tl.float32), 1.0 + exn), dt, INTERPRET).to(tl.float32)
        kk = tl.arange(0, KB)
        km = kk < K
        if HASH:  # the token's experts from the table
            tok = tl.load(ids_ptr + t).to(tl.int64)
            picks = tl.load(tid_ptr + tok * K + kk, mask=km, other=0).to(tl.int64)
            ws = tl.zeros([KB], dtype=tl.float32)
            total = 0.0
            for k in tl.static_range(K):
                i = tl.sum(tl.where(kk == k, picks, 0), axis=0)
                si = tl.sum(tl.where(e == i, s, 0.0), axis=0)
                ws = tl.where(kk == k, si, ws)
                total += si
        else:
            picks, ws, total = _top_k(tl.where(em, s + tl.load(bias_ptr + e, mask=em, other=0.0), float("-inf")), s,
                                      e, kk, K, BLOCK_E)
        denom = cast_rne(cast_rne(total, dt, INTERPRET).to(tl.float32) + 1e-20, dt, INTERPRET).to(tl.float32)
        w = cast_rne(tl.math.div_rn(ws, tl.zeros([KB], dtype=tl.float32) + denom), dt, INTERPRET).to(tl.float32)
        tl.store(w_ptr + t * K + kk, cast_rne(w * scale, dt, INTERPRET), mask=km)
        tl.store(idx_ptr + t * K + kk, picks, mask=km)


def route_triton(logits: torch.Tensor, bias: torch.Tensor, bias_vl: torch.Tensor, is_image: torch.Tensor,
                 gate_temp: float, scoring_func: str, top_k: int, scale: float,
                 inv_temp: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in one launch (scoring sqrtsoftplus or sigmoid). `inv_temp`: fp32_reciprocal(gate_temp), computed
    ahead by callers that run under torch.compile."""
    assert triton is not None, "triton is not installed"
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        inv_temp = fp32_reciprocal(gate_temp) if inv_temp is None else inv_temp
        # a bool mask is read as its bytes (a view): `.to(uint8)` was a copy kernel on every layer's routing chain
        # (Inductor cannot lower a bool -> uint8 view: a compiled forward keeps the cast)
        view = is_image.dtype == torch.bool and not torch.compiler.is_compiling()
        image = (is_image.view(torch.uint8) if view else is_image.to(torch.uint8)).contiguous()
        _route_kernel[(T,)](logits.float().contiguous(), bias.float().contiguous(), bias_vl.float().contiguous(),
                            image, w, idx, E, inv_temp, float(scale), K=top_k,
                            KB=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                            SCORING=SCORING[scoring_func], INTERPRET=INTERPRET, enable_fp_fusion=False)
    return w, idx


def route(logits: torch.Tensor, bias: torch.Tensor, bias_vl: torch.Tensor, is_image: torch.Tensor,
          gate_temp: float, scoring_func: str, top_k: int, scale: float,
          inv_temp: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA (sqrtsoftplus / sigmoid scoring), torch elsewhere."""
    if logits.is_cuda and triton is not None and scoring_func in SCORING:
        return route_triton(logits, bias, bias_vl, is_image, gate_temp, scoring_func, top_k, scale, inv_temp)
    return route_torch(logits, bias, bias_vl, is_image, gate_temp, scoring_func, top_k, scale)


def route_v4_triton(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                    input_ids: torch.Tensor, scoring_func: str, top_k: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_v4_torch` in one launch (scoring sqrtsoftplus or sigmoid), no host sync."""
    assert triton is not None, "triton is not installed"
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        is_hash = tid2eid is not None
        table = tid2eid.contiguous() if is_hash else idx  # (not read unless hash)
        b = idx if is_hash else bias.float().contiguous()  # (not read when hash)
        ids = input_ids.contiguous() if is_hash else idx  # (not read unless hash)
        _route_v4_kernel[(T,)](logits.contiguous(), b, table, ids, w, idx, E, float(scale),
                               K=top_k, KB=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                               SCORING=SCORING[scoring_func], HASH=is_hash, INTERPRET=INTERPRET,
                               enable_fp_fusion=False)
    return w, idx


def route_v4(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None, input_ids: torch.Tensor,
             scoring_func: str, top_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA (unless FUSED_ROUTER_V4 is off; sqrtsoftplus / sigmoid scoring), torch elsewhere."""
    if FUSED_ROUTER_V4 and logits.is_cuda and triton is not None and scoring_func in SCORING:
        return route_v4_triton(logits, bias, tid2eid, input_ids, scoring_func, top_k, scale)
    return route_v4_torch(logits, bias, tid2eid, input_ids, scoring_func, top_k, scale)
